"""The vLLM collector against `VllmStandIn` (a stand-in: vLLM needs a GPU) serving fixtures.

`tests/fixtures/vllm/metrics-v1.txt` is a reconstruction of a vLLM 0.12 `/metrics` with two
data-parallel engines; `metrics-v1-0.8.txt` is the older v1 format (see their headers).
"""

from __future__ import annotations

import logging
import re
import shutil
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from exporter.collectors.base import SourceCollector
from exporter.collectors.vllm import DEFAULT_MARGIN_SECONDS, RETIRE_AFTER_SCRAPES, VllmCollector
from fleet.roster import Server
from tests.golden import assert_golden, exposition
from tests.scraping import scrape
from tests.vllm_stand_in import VllmStandIn

FIXTURES = Path(__file__).parent / "fixtures" / "vllm"
V1 = FIXTURES / "metrics-v1.txt"
V1_OLD = FIXTURES / "metrics-v1-0.8.txt"
MODEL = "Qwen/Qwen3-32B-AWQ"
# Room for a loaded CI machine on top of the collector's own budget.
SLACK_SECONDS = 1.0

# Every family a healthy server with the v1 fixture has, besides info and up.
PER_SERVER_SAMPLES: tuple[tuple[str, dict[str, str]], ...] = (
    ("gpufleet_vllm_endpoint", {"endpoint": "metrics", "state": "ok"}),
    ("gpufleet_vllm_requests_running", {}),
    ("gpufleet_vllm_requests_waiting", {}),
    ("gpufleet_vllm_kv_cache_usage_ratio", {}),
    ("gpufleet_vllm_prompt_tokens_total", {}),
    ("gpufleet_vllm_generation_tokens_total", {}),
    ("gpufleet_vllm_preemptions_total", {}),
    ("gpufleet_vllm_time_to_first_token_seconds_count", {}),
    ("gpufleet_vllm_time_to_first_token_seconds_sum", {}),
    ("gpufleet_vllm_time_to_first_token_seconds_bucket", {"le": "+Inf"}),
)


def roster_server(
    url: str,
    *,
    timeout: float = 2.0,
    key_file: Path | None = None,
    model: str = "Qwen3-32B-AWQ",
    gpu: int | None = None,
) -> Server:
    return Server(
        engine="vllm",
        url=url,
        unit="vllm@gamma.service",
        role="gpu-dense",
        model=model,
        gpu=gpu,
        api_key_file=key_file,
        timeout_seconds=timeout,
    )


def value(registry: CollectorRegistry, name: str, server: str = "gamma", **labels: str) -> Any:
    return registry.get_sample_value(name, {"server": server, **labels})


def endpoint_state(registry: CollectorRegistry, server: str = "gamma") -> str | None:
    """The one state whose endpoint series is 1, or None when there are no endpoint series."""
    values = {
        state: value(registry, "gpufleet_vllm_endpoint", server, endpoint="metrics", state=state)
        for state in ("ok", "busy", "disabled", "error")
    }
    if all(v is None for v in values.values()):
        return None
    ones = [state for state, v in values.items() if v == 1.0]
    assert len(ones) == 1 and sorted(values.values()) == [0.0, 0.0, 0.0, 1.0], values
    return ones[0]


MakeStandIn = Callable[..., VllmStandIn]
MakeCollector = Callable[..., VllmCollector]


@pytest.fixture
def stand_in() -> Iterator[MakeStandIn]:
    made: list[VllmStandIn] = []

    def build(metrics_file: Path = V1, **kwargs: Any) -> VllmStandIn:
        server = VllmStandIn(metrics_file, **kwargs)
        made.append(server)
        return server

    yield build
    for server in made:
        server.stop()


@pytest.fixture
def make() -> Iterator[MakeCollector]:
    made: list[VllmCollector] = []

    def build(servers: dict[str, Server], **kwargs: Any) -> VllmCollector:
        collector = VllmCollector(servers, **kwargs)
        made.append(collector)
        return collector

    yield build
    for collector in made:
        collector.close()


def test_follows_the_collector_contract(make: MakeCollector, stand_in: MakeStandIn) -> None:
    vllm = stand_in()
    llama = Server(
        engine="llama", url="http://127.0.0.1:9", unit="llama-server@alpha.service",
        role="gpu-light", model="Gemma",
    )  # fmt: skip
    collector = make({"gamma": roster_server(vllm.url), "alpha": llama})
    assert isinstance(collector, SourceCollector)
    assert collector.name == "vllm"
    registry, error = scrape(collector)
    assert error is None
    # The llama server belongs to the llama collector: not read, not exported.
    assert value(registry, "gpufleet_vllm_up", "alpha") is None
    assert value(registry, "gpufleet_vllm_up") == 1.0
    first, second = list(collector.collect()), list(collector.collect())
    assert all(a is not b for a, b in zip(first, second, strict=True)), "families must be fresh"


def test_one_server_golden(make: MakeCollector, stand_in: MakeStandIn) -> None:
    collector = make({"gamma": roster_server(stand_in().url)})
    text = exposition(collector)
    assert_golden(text, "vllm_v1")
    # Never vLLM's own labels, never `instance`.
    for label in ("model_name=", "engine=", "instance="):
        assert label not in text


def test_sums_over_engines_and_averages_the_cache_ratio(
    make: MakeCollector, stand_in: MakeStandIn
) -> None:
    registry, error = scrape(make({"gamma": roster_server(stand_in().url)}))
    assert error is None
    # The fixture's engine 0 and engine 1, added (and the KV ratio averaged) by hand.
    assert value(registry, "gpufleet_vllm_requests_running") == 3 + 2
    assert value(registry, "gpufleet_vllm_requests_waiting") == 0 + 1
    assert value(registry, "gpufleet_vllm_prompt_tokens_total") == 1_699_636 + 1_755_269
    assert value(registry, "gpufleet_vllm_generation_tokens_total") == 372_640 + 385_063
    assert value(registry, "gpufleet_vllm_preemptions_total") == 0 + 2
    assert value(registry, "gpufleet_vllm_kv_cache_usage_ratio") == pytest.approx(
        (0.021084112149532763 + 0.01278504672897196) / 2
    )
    ttft = "gpufleet_vllm_time_to_first_token_seconds"
    assert value(registry, f"{ttft}_bucket", le="0.25") == 922 + 768
    assert value(registry, f"{ttft}_bucket", le="+Inf") == 1412 + 1390
    assert value(registry, f"{ttft}_count") == 1412 + 1390
    assert value(registry, f"{ttft}_sum") == pytest.approx(369.601703995856 + 470.43044363770315)
    assert (
        value(registry, "gpufleet_vllm_info", role="gpu-dense", model="Qwen3-32B-AWQ",
              served_model=MODEL, gpu="")
        == 1.0
    )  # fmt: skip


def test_the_info_series_names_the_roster_gpu_up_or_down(
    make: MakeCollector, stand_in: MakeStandIn
) -> None:
    # The rules copy `gpu` onto the server's alerts (GpuLost inhibits the servers of its card):
    # it comes from the roster, so it is there while the server is down too.
    up, down = stand_in(), stand_in()
    down.stop()
    collector = make(
        {"gamma": roster_server(up.url, gpu=1), "delta": roster_server(down.url, gpu=0)}
    )
    registry, error = scrape(collector)
    assert error is None
    assert value(registry, "gpufleet_vllm_up", "delta") == 0.0
    info = {
        sample.labels["server"]: sample.labels["gpu"]
        for family in registry.collect()
        if family.name == "gpufleet_vllm_info"
        for sample in family.samples
    }
    assert info == {"gamma": "1", "delta": "0"}


def test_hung_server_costs_one_timeout_and_spares_the_other(
    make: MakeCollector, stand_in: MakeStandIn
) -> None:
    healthy, hung = stand_in(), stand_in()
    hung.hang()
    timeout = 0.5
    collector = make(
        {
            "gamma": roster_server(healthy.url, timeout=timeout),
            "delta": roster_server(hung.url, timeout=timeout),
        }
    )
    start = time.monotonic()
    registry, error = scrape(collector)
    elapsed = time.monotonic() - start
    assert elapsed < timeout + DEFAULT_MARGIN_SECONDS + SLACK_SECONDS
    assert error is None, "a hung server is what `up 0` reports, not a collector failure"
    assert value(registry, "gpufleet_vllm_up") == 1.0
    for name, labels in PER_SERVER_SAMPLES:
        assert value(registry, name, **labels) is not None, name
    assert value(registry, "gpufleet_vllm_up", "delta") == 0.0
    assert {seen.path for seen in hung.seen} == {"/health", "/metrics"}, "it did accept"
    assert endpoint_state(registry, "delta") is None
    assert value(registry, "gpufleet_vllm_requests_running", "delta") is None
    assert (
        value(registry, "gpufleet_vllm_info", "delta", role="gpu-dense", model="Qwen3-32B-AWQ",
              served_model="", gpu="")
        == 1.0
    )  # fmt: skip


def test_trickling_answer_is_cut_off_at_the_deadline_and_not_queued_behind(
    make: MakeCollector, stand_in: MakeStandIn
) -> None:
    # Each byte comes sooner than the socket timeout, so only the scrape's deadline ends it.
    server = stand_in()
    server.trickle("/metrics")
    timeout = 0.5
    collector = make({"gamma": roster_server(server.url, timeout=timeout)})
    start = time.monotonic()
    registry, error = scrape(collector)
    elapsed = time.monotonic() - start
    assert collector.budget_seconds == timeout + DEFAULT_MARGIN_SECONDS
    assert collector.budget_seconds - 0.1 < elapsed < collector.budget_seconds + SLACK_SECONDS
    assert error is None
    assert value(registry, "gpufleet_vllm_up") == 1.0
    assert endpoint_state(registry) == "busy"
    assert value(registry, "gpufleet_vllm_requests_running") is None

    # The call was cut at its deadline (the whole call is bounded, not each read): the next
    # scrape makes a fresh call, cut at the deadline again, and never two at once.
    registry, _ = scrape(collector)
    assert endpoint_state(registry) == "busy"
    assert [seen.path for seen in server.seen].count("/metrics") == 2

    server.release()
    deadline = time.monotonic() + 5
    while endpoint_state(registry) != "ok" and time.monotonic() < deadline:
        time.sleep(0.05)
        registry, _ = scrape(collector)
    assert endpoint_state(registry) == "ok"
    assert value(registry, "gpufleet_vllm_requests_running") == 5.0


def test_stopped_server_is_down_without_endpoint_series(
    make: MakeCollector, stand_in: MakeStandIn
) -> None:
    server = stand_in()
    collector = make({"gamma": roster_server(server.url)})
    registry, _ = scrape(collector)
    assert value(registry, "gpufleet_vllm_up") == 1.0
    server.stop()
    registry, error = scrape(collector)
    assert error is None
    assert value(registry, "gpufleet_vllm_up") == 0.0
    assert endpoint_state(registry) is None
    for name, labels in PER_SERVER_SAMPLES:
        assert value(registry, name, **labels) is None, name
    # The served model seen before stays on the info series: no label churn on a restart.
    assert (
        value(registry, "gpufleet_vllm_info", role="gpu-dense", model="Qwen3-32B-AWQ",
              served_model=MODEL, gpu="")
        == 1.0
    )  # fmt: skip


def test_health_503_is_down(make: MakeCollector, stand_in: MakeStandIn) -> None:
    server = stand_in()
    server.answer_status("/health", 503)  # vLLM's answer once its engine core died
    registry, error = scrape(make({"gamma": roster_server(server.url)}))
    assert error is None
    assert value(registry, "gpufleet_vllm_up") == 0.0
    assert endpoint_state(registry) is None


def test_bearer_key_from_file(make: MakeCollector, stand_in: MakeStandIn, tmp_path: Path) -> None:
    server = stand_in(api_key="s3cret-key")
    key_file = tmp_path / "gamma.key"
    key_file.write_text("s3cret-key\n")
    registry, error = scrape(make({"gamma": roster_server(server.url, key_file=key_file)}))
    assert error is None
    assert endpoint_state(registry) == "ok"
    assert value(registry, "gpufleet_vllm_requests_running") == 5.0
    sent = {seen.path: seen.authorization for seen in server.seen}
    assert sent == {"/metrics": "Bearer s3cret-key", "/health": None}


def test_key_required_but_not_configured_is_a_server_error(
    make: MakeCollector, stand_in: MakeStandIn
) -> None:
    server = stand_in(api_key="s3cret-key")
    registry, error = scrape(make({"gamma": roster_server(server.url)}))
    assert error is None, "a 401 is the server's answer, not a fault of this host"
    assert endpoint_state(registry) == "error"
    assert value(registry, "gpufleet_vllm_requests_running") is None


def test_missing_key_file_is_an_endpoint_error_and_a_collector_error(
    make: MakeCollector,
    stand_in: MakeStandIn,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    server = stand_in(api_key="s3cret-key")
    key_file = tmp_path / "missing.key"
    collector = make({"gamma": roster_server(server.url, key_file=key_file)})
    with caplog.at_level(logging.WARNING, logger="exporter.collectors.vllm"):
        registry, error = scrape(collector)
    assert error is not None
    assert str(key_file) in str(error)
    assert str(key_file) in caplog.text
    # Everything else was still yielded before the error.
    assert value(registry, "gpufleet_vllm_up") == 1.0
    assert endpoint_state(registry) == "error"
    assert "/metrics" not in [seen.path for seen in server.seen]


def test_a_crashing_read_is_a_collector_error_and_spares_the_rest(
    make: MakeCollector, stand_in: MakeStandIn, tmp_path: Path
) -> None:
    # A bug on this side: a key file path as a plain string, which the roster's validation
    # (skipped here to provoke it) would have made a Path; reading it raises AttributeError.
    key_file = tmp_path / "zeta.key"
    key_file.write_text("s3cret-key\n")
    broken = Server.model_construct(
        **{**roster_server(stand_in().url).model_dump(), "api_key_file": str(key_file)}
    )
    collector = make({"gamma": roster_server(stand_in().url), "zeta": broken})
    registry, error = scrape(collector)
    assert error is not None
    assert "server zeta: reading /metrics crashed: AttributeError" in str(error)
    assert value(registry, "gpufleet_vllm_up") == 1.0
    assert endpoint_state(registry) == "ok"
    assert value(registry, "gpufleet_vllm_up", "zeta") == 1.0
    assert endpoint_state(registry, "zeta") == "error"
    assert value(registry, "gpufleet_vllm_requests_running", "zeta") is None


@pytest.mark.parametrize(
    ("status", "state"), [(404, "disabled"), (501, "disabled"), (500, "error"), (502, "error")]
)
def test_metrics_status(
    make: MakeCollector, stand_in: MakeStandIn, status: int, state: str
) -> None:
    server = stand_in()
    server.answer_status("/metrics", status)
    registry, error = scrape(make({"gamma": roster_server(server.url)}))
    assert error is None
    assert value(registry, "gpufleet_vllm_up") == 1.0
    assert endpoint_state(registry) == state
    assert value(registry, "gpufleet_vllm_requests_running") is None


def test_metrics_without_vllm_series_is_disabled(
    make: MakeCollector, stand_in: MakeStandIn
) -> None:
    # vLLM with --disable-log-stats: only prometheus_client's own and the HTTP series remain.
    server = stand_in()
    text = V1.read_text()
    server.serve_metrics_text(
        "\n".join(line for line in text.splitlines() if "vllm:" not in line) + "\n"
    )
    registry, error = scrape(make({"gamma": roster_server(server.url)}))
    assert error is None
    assert endpoint_state(registry) == "disabled"


def test_unparsable_metrics_is_an_error(make: MakeCollector, stand_in: MakeStandIn) -> None:
    server = stand_in()
    server.serve_metrics_text("<html><body><h1>502 Bad Gateway</h1></body></html>\n")
    registry, error = scrape(make({"gamma": roster_server(server.url)}))
    assert error is None
    assert endpoint_state(registry) == "error"
    assert value(registry, "gpufleet_vllm_kv_cache_usage_ratio") is None


def test_older_metric_names(make: MakeCollector, stand_in: MakeStandIn) -> None:
    server = stand_in(V1_OLD)
    registry, error = scrape(make({"gamma": roster_server(server.url, model="Qwen2.5-14B")}))
    assert error is None
    assert endpoint_state(registry) == "ok"
    # vllm:gpu_cache_usage_perc, the name before vllm:kv_cache_usage_perc.
    assert value(registry, "gpufleet_vllm_kv_cache_usage_ratio") == 0.003798767967145844
    assert value(registry, "gpufleet_vllm_requests_running") == 1.0
    assert value(registry, "gpufleet_vllm_prompt_tokens_total") == 266_984.0
    assert value(registry, "gpufleet_vllm_time_to_first_token_seconds_count") == 213.0
    assert (
        value(registry, "gpufleet_vllm_info", role="gpu-dense", model="Qwen2.5-14B",
              served_model="Qwen/Qwen2.5-14B-Instruct", gpu="")
        == 1.0
    )  # fmt: skip


def test_a_changed_value_shows_on_the_next_scrape(
    make: MakeCollector, stand_in: MakeStandIn, tmp_path: Path
) -> None:
    served = tmp_path / "metrics.txt"
    shutil.copy(V1, served)
    collector = make({"gamma": roster_server(stand_in(served).url)})
    registry, _ = scrape(collector)
    assert value(registry, "gpufleet_vllm_requests_running") == 5.0
    before = f'vllm:num_requests_running{{engine="0",model_name="{MODEL}"}} 3.0\n'
    text = served.read_text()
    assert before in text
    served.write_text(text.replace(before, before.replace(" 3.0", " 7.0")))
    registry, _ = scrape(collector)
    assert value(registry, "gpufleet_vllm_requests_running") == 7.0 + 2.0


def test_promtool_accepts_the_exposition(
    make: MakeCollector, stand_in: MakeStandIn, tmp_path: Path
) -> None:
    key_file = tmp_path / "missing.key"
    down = stand_in()
    down.stop()
    collector = make(
        {
            "gamma": roster_server(stand_in().url),
            "delta": roster_server(down.url),
            "omega": roster_server(stand_in(V1_OLD).url, key_file=key_file),
        }
    )
    families, _ = scrape(collector)
    text = generate_latest(families).decode()
    assert 'gpufleet_vllm_up{server="delta"} 0.0' in text
    promtool = shutil.which("promtool")
    assert promtool is not None, "promtool is missing: `make test` installs Debian's prometheus"
    check = subprocess.run(
        [promtool, "check", "metrics"], input=text, capture_output=True, text=True, check=False
    )
    assert check.returncode == 0, check.stdout + check.stderr
    assert check.stdout + check.stderr == ""


def test_summed_counters_do_not_drop_when_one_engine_restarts(
    make: MakeCollector, stand_in: MakeStandIn, tmp_path: Path
) -> None:
    """vLLM restarts a dead engine; its counters start at 0 again, the sum must not drop."""
    served = tmp_path / "metrics.txt"
    shutil.copy(V1, served)
    collector = make({"gamma": roster_server(stand_in(served).url)})
    registry, _ = scrape(collector)
    before = value(registry, "gpufleet_vllm_generation_tokens_total")
    assert before == 372_640 + 385_063
    # Engine 1 restarted and has generated 100 tokens since; engine 0 went on by 10.
    text = served.read_text()
    engine0 = f'vllm:generation_tokens_total{{engine="0",model_name="{MODEL}"}} 372640.0\n'
    engine1 = f'vllm:generation_tokens_total{{engine="1",model_name="{MODEL}"}} 385063.0\n'
    assert engine0 in text and engine1 in text
    text = text.replace(engine0, engine0.replace("372640.0", "372650.0"))
    served.write_text(text.replace(engine1, engine1.replace("385063.0", "100.0")))
    registry, _ = scrape(collector)
    after = value(registry, "gpufleet_vllm_generation_tokens_total")
    assert after == before + 10 + 100  # what was generated in between, nothing more or less
    # The engine vanishes from /metrics altogether (data parallelism reduced): its count stays.
    served.write_text(served.read_text().replace(engine1.replace("385063.0", "100.0"), ""))
    registry, _ = scrape(collector)
    assert value(registry, "gpufleet_vllm_generation_tokens_total") == after


def test_a_gone_engines_memory_is_retired_and_its_count_kept(
    make: MakeCollector, stand_in: MakeStandIn, tmp_path: Path
) -> None:
    """Engines and models come and go (a model swap renames every series): the collector's
    memory of each must not grow for ever, and the sums must still never drop."""
    served = tmp_path / "metrics.txt"
    shutil.copy(V1, served)
    collector = make({"gamma": roster_server(stand_in(served).url)})
    registry, _ = scrape(collector)
    before = value(registry, "gpufleet_vllm_generation_tokens_total")
    memory = collector._memory["gamma"]
    remembered = len(memory.counters)
    assert remembered > 0 and not memory.retired
    # The model is swapped: every vllm: series now has another model_name, counting from 0.
    swapped = served.read_text().replace(f'model_name="{MODEL}"', 'model_name="Other/Model"')
    swapped = re.sub(r"(vllm:generation_tokens_total\{[^}]*\}) [0-9.e+]+", r"\1 5.0", swapped)
    served.write_text(swapped)
    for _ in range(RETIRE_AFTER_SCRAPES + 1):
        registry, _ = scrape(collector)
    assert len(memory.counters) == remembered  # the old model's entries are gone
    assert memory.retired  # folded, by counter and bucket only
    assert all("engine" not in dict(labels) for _, labels in memory.retired)
    after = value(registry, "gpufleet_vllm_generation_tokens_total")
    assert after == before + 2 * 5.0  # two engines of the new model, 5 tokens each
