"""The llama-server collector and the canary against real llama-server processes.

Every server here is the pinned llama.cpp build serving the tiny random-weight model that
`tests/llama_lab.py` writes (see tests/conftest.py): idle, generating, saturated, loading,
killed, frozen, API key, `--metrics` missing, `--no-slots`, the canary. One case alone, an
inference loop too busy to answer `/metrics`, uses a local stand-in (see that test for why).
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client.metrics_core import Metric

from exporter.canary import CanaryCollector, CanaryProbe
from exporter.collectors.base import CollectorError
from exporter.collectors.llama import LlamaCollector
from fleet.roster import Canary, Server
from tests.llama_lab import StartLlamaServer, free_port, wait_until
from tests.vllm_stand_in import VllmStandIn

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]
Made = list[LlamaCollector | CanaryCollector]

# 2 slots of 32768 tokens, as in the recorded captures: room for a 30000-token generation.
BUSY_ARGS = ("-c", "65536", "-np", "2", "-t", "1", "-a", "tiny", "--metrics")
SMALL_ARGS = ("-c", "1024", "-np", "2", "-t", "1", "-a", "tiny", "--metrics")


def entry(url: str, **extra: object) -> Server:
    return Server.model_validate(
        {
            "engine": "llama",
            "url": url,
            "unit": "llama-server@t.service",
            "role": "gpu-dense",
            "model": "tiny-test",
            **extra,
        }
    )


class Scrape:
    """One collect(), its samples, and the CollectorError it ended with (if any)."""

    def __init__(self, families: Iterator[Metric]) -> None:
        self.samples: Samples = {}
        self.error: CollectorError | None = None
        try:
            for family in families:
                for s in family.samples:
                    # As Prometheus stores it: an empty served_model (not a router) is no label.
                    labels = {k: v for k, v in s.labels.items() if k != "served_model" or v}
                    self.samples[s.name, frozenset(labels.items())] = s.value
        except CollectorError as exc:
            self.error = exc

    def get(self, name: str, **labels: str) -> float | None:
        return self.samples.get((name, frozenset(labels.items())))

    def names(self, server: str) -> set[str]:
        return {name for name, labels in self.samples if ("server", server) in labels}

    def endpoint(self, server: str, endpoint: str) -> str:
        states = [
            dict(labels)["state"]
            for (name, labels), value in self.samples.items()
            if name == "gpufleet_llama_endpoint"
            and ("server", server) in labels
            and ("endpoint", endpoint) in labels
            and value == 1
        ]
        assert len(states) == 1, f"{server}/{endpoint}: {states}"
        return states[0]

    def health(self, server: str) -> str:
        states = [
            dict(labels)["state"]
            for (name, labels), value in self.samples.items()
            if name == "gpufleet_llama_health" and ("server", server) in labels and value == 1
        ]
        assert len(states) == 1, states
        return states[0]


def scrape(collector: LlamaCollector) -> Scrape:
    return Scrape(iter(collector.collect()))


@pytest.fixture
def collectors() -> Iterator[Made]:
    made: Made = []
    yield made
    for collector in made:
        collector.close()


def make(made: Made, **servers: Server) -> LlamaCollector:
    collector = LlamaCollector(servers)
    made.append(collector)
    return collector


def test_idle_server(llama_server: StartLlamaServer, collectors: Made) -> None:
    server = llama_server(*SMALL_ARGS)
    s = scrape(make(collectors, alpha=entry(server.url)))
    assert s.error is None
    assert s.get("gpufleet_llama_up", server="alpha") == 1
    assert s.health("alpha") == "ok"
    info = [labels for (name, labels) in s.samples if name == "gpufleet_llama_info"]
    assert len(info) == 1
    labels = dict(info[0])
    assert labels["alias"] == "tiny" and labels["role"] == "gpu-dense"
    # The pinned build comes from a source package: its build_info "b0-unknown" is no version.
    assert labels["model"] == "tiny-test" and labels["build"] == ""
    assert labels["gpu"] == ""  # the roster gives none: no label in Prometheus
    assert s.get("gpufleet_llama_sleeping", server="alpha") == 0
    assert "instance" not in labels and "host" not in labels
    assert s.get("gpufleet_llama_context_tokens", server="alpha") == 512  # per slot
    assert s.get("gpufleet_llama_slots", server="alpha", state="idle") == 2
    assert s.get("gpufleet_llama_slots", server="alpha", state="busy") == 0
    assert s.get("gpufleet_llama_requests_processing", server="alpha") == 0
    assert s.get("gpufleet_llama_requests_deferred", server="alpha") == 0
    assert s.get("gpufleet_llama_decode_calls_total", server="alpha") is not None
    assert s.get("gpufleet_llama_predicted_tokens_total", server="alpha") == 0
    for endpoint in ("metrics", "props"):
        assert s.endpoint("alpha", endpoint) == "ok"
    # Nothing processing: every slot is idle (from /props total_slots) and /slots, which would
    # reset the idle timer of a server that sleeps, was not asked.
    assert not [labels for (n, labels) in s.samples if n == "gpufleet_llama_endpoint"
                and ("endpoint", "slots") in labels]  # fmt: skip
    assert not any(n.startswith("gpufleet_llama_slot_") for n in s.names("alpha"))


def test_generating_and_saturated(llama_server: StartLlamaServer, collectors: Made) -> None:
    server = llama_server(*BUSY_ARGS)
    collector = make(collectors, alpha=entry(server.url))
    for _ in range(3):  # three long requests on two slots: one waits
        server.generate(n_predict=30000)
    first = scrape(collector)
    wait_until(
        lambda: (
            (scrape(collector).get("gpufleet_llama_requests_deferred", server="alpha") or 0) >= 1
        ),
        timeout=20,
        what="a deferred request",
    )
    time.sleep(0.5)
    second = scrape(collector)
    assert second.get("gpufleet_llama_slots", server="alpha", state="busy") == 2
    assert second.get("gpufleet_llama_slots", server="alpha", state="idle") == 0
    assert second.get("gpufleet_llama_requests_processing", server="alpha") == 2
    assert (second.get("gpufleet_llama_requests_deferred", server="alpha") or 0) >= 1
    # Progress shows in decode calls and per-slot decoded tokens, not in the token counters.
    d1 = first.get("gpufleet_llama_decode_calls_total", server="alpha") or 0
    d2 = second.get("gpufleet_llama_decode_calls_total", server="alpha") or 0
    assert d2 > d1
    assert second.get("gpufleet_llama_predicted_tokens_total", server="alpha") == 0
    for slot in ("0", "1"):
        assert (
            second.get("gpufleet_llama_slot_decoded_tokens", server="alpha", slot=slot) or 0
        ) > 0
        assert second.get("gpufleet_llama_slot_predict_limit", server="alpha", slot=slot) == 30000
    # The task age is the exporter's own memory of when it first saw the task.
    third = scrape(collector)
    age2 = second.get("gpufleet_llama_slot_task_age_seconds", server="alpha", slot="0")
    age3 = third.get("gpufleet_llama_slot_task_age_seconds", server="alpha", slot="0")
    assert age2 is not None and age3 is not None and age3 > age2


def test_uncapped_request_has_infinite_limit(
    llama_server: StartLlamaServer, collectors: Made
) -> None:
    server = llama_server(*BUSY_ARGS)
    collector = make(collectors, alpha=entry(server.url))
    server.generate(n_predict=-1)
    wait_until(
        lambda: (
            scrape(collector).get("gpufleet_llama_slot_predict_limit", server="alpha", slot="0")
            is not None
            or scrape(collector).get("gpufleet_llama_slot_predict_limit", server="alpha", slot="1")
            is not None
        ),
        timeout=20,
        what="a busy slot",
    )
    s = scrape(collector)
    limits = [v for (n, _), v in s.samples.items() if n == "gpufleet_llama_slot_predict_limit"]
    assert limits == [math.inf]


def test_killed_and_frozen_servers_cost_one_timeout(
    llama_server: StartLlamaServer, collectors: Made
) -> None:
    healthy = llama_server(*SMALL_ARGS)
    frozen = llama_server(*SMALL_ARGS)
    killed = llama_server(*SMALL_ARGS)
    timeout = 1.0
    collector = make(
        collectors,
        healthy=entry(healthy.url, timeout_seconds=timeout),
        frozen=entry(frozen.url, timeout_seconds=timeout),
        killed=entry(killed.url, timeout_seconds=timeout),
    )
    frozen.freeze()
    killed.kill()
    start = time.monotonic()
    s = scrape(collector)
    elapsed = time.monotonic() - start
    # One timeout for the frozen server, not one per endpoint, and not per server.
    assert elapsed < 2 * timeout, elapsed
    assert s.error is None
    assert s.health("frozen") == "timeout" and s.get("gpufleet_llama_up", server="frozen") == 0
    assert s.health("killed") == "unreachable" and s.get("gpufleet_llama_up", server="killed") == 0
    assert s.health("healthy") == "ok"
    for endpoint in ("metrics", "props"):
        assert s.endpoint("healthy", endpoint) == "ok"
    assert s.get("gpufleet_llama_decode_calls_total", server="healthy") is not None
    # Down servers keep their identity and say nothing about endpoints they did not read.
    assert s.names("frozen") == {
        "gpufleet_llama_up",
        "gpufleet_llama_health",
        "gpufleet_llama_info",
    }
    frozen.thaw()
    assert scrape(collector).health("frozen") == "ok"


def test_the_info_series_names_the_roster_gpu_while_down(collectors: Made) -> None:
    # The rules copy `gpu` onto the server's alerts, so that GpuLost inhibits the servers of
    # the lost card only: from the roster, so there when the server is down (refused here),
    # which is when it counts. Without a roster gpu the label is empty (no label).
    on_0, on_1, cpu = (f"http://127.0.0.1:{free_port()}" for _ in range(3))
    s = scrape(
        make(
            collectors,
            a=entry(on_0, gpu=0, timeout_seconds=0.5),
            b=entry(on_1, gpu=1, timeout_seconds=0.5),
            c=entry(cpu, timeout_seconds=0.5),
        )
    )
    assert {server: s.health(server) for server in "abc"} == dict.fromkeys("abc", "unreachable")
    info = {
        dict(labels)["server"]: dict(labels)["gpu"]
        for (name, labels) in s.samples
        if name == "gpufleet_llama_info"
    }
    assert info == {"a": "0", "b": "1", "c": ""}


def test_loading_reads_as_down_with_state_loading(
    llama_server: StartLlamaServer, large_model: Path, load_args: tuple[str, ...], collectors: Made
) -> None:
    server = llama_server(*load_args, "-c", "512", "-t", "1", model=large_model, healthy=False)
    server.wait_listening(timeout=30)
    collector = make(collectors, big=entry(server.url, timeout_seconds=1))
    seen: list[str] = []
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        s = scrape(collector)
        state = s.health("big")
        seen.append(state)
        if state == "loading":
            assert s.get("gpufleet_llama_up", server="big") == 0
            assert "gpufleet_llama_endpoint" not in s.names("big")
        if state == "ok":
            break
        time.sleep(0.02)
    assert "loading" in seen, f"never saw 503 while loading: {seen[:5]}…\n{server.log_tail()}"
    assert seen[-1] == "ok", server.log_tail()


def test_api_key_from_a_file(
    llama_server: StartLlamaServer, tmp_path: Path, collectors: Made
) -> None:
    server = llama_server(*SMALL_ARGS, "--api-key", "s3cret")
    good, wrong = tmp_path / "good.key", tmp_path / "wrong.key"
    good.write_text("s3cret\n")
    wrong.write_text("nope\n")
    collector = make(
        collectors,
        good=entry(server.url, api_key_file=str(good)),
        wrong=entry(server.url, api_key_file=str(wrong)),
        missing=entry(server.url, api_key_file=str(tmp_path / "absent.key")),
    )
    s = scrape(collector)
    for name in ("good", "wrong", "missing"):
        assert s.get("gpufleet_llama_up", server=name) == 1  # /health needs no key
    for endpoint in ("metrics", "props"):
        assert s.endpoint("good", endpoint) == "ok"
        assert s.endpoint("wrong", endpoint) == "error"  # 401
        assert s.endpoint("missing", endpoint) == "error"
    assert s.get("gpufleet_llama_decode_calls_total", server="good") is not None
    assert s.error is not None and "absent.key" in str(s.error)


def test_without_metrics_or_slots_only_those_series_go(
    llama_server: StartLlamaServer, collectors: Made
) -> None:
    no_metrics = llama_server("-c", "1024", "-np", "2", "-t", "1")
    no_slots = llama_server(*SMALL_ARGS, "--no-slots")
    s = scrape(make(collectors, a=entry(no_metrics.url), b=entry(no_slots.url)))
    assert s.error is None
    assert s.endpoint("a", "metrics") == "disabled"
    assert s.get("gpufleet_llama_decode_calls_total", server="a") is None
    # Without /metrics nothing says whether requests are processing, and /slots would keep a
    # sleeping server awake: the slots are unknown, so absent.
    assert s.get("gpufleet_llama_slots", server="a", state="idle") is None
    assert "gpufleet_llama_slot_decoded_tokens" not in s.names("a")
    assert s.endpoint("b", "metrics") == "ok"
    # Idle: every slot free, from /props; /slots (disabled here) is not needed to say so.
    assert s.get("gpufleet_llama_slots", server="b", state="idle") == 2
    assert s.get("gpufleet_llama_decode_calls_total", server="b") is not None
    assert s.get("gpufleet_llama_context_tokens", server="b") == 512  # from /props
    for name in ("a", "b"):
        assert s.get("gpufleet_llama_up", server=name) == 1


def test_canary_measures_an_idle_server_and_skips_a_busy_one(
    llama_server: StartLlamaServer, collectors: Made
) -> None:
    server = llama_server("-c", "4096", "-np", "1", "-t", "1", "-a", "tiny", "--metrics")
    settings = Canary(interval_seconds=10, max_tokens=16, timeout_seconds=30)
    probe = CanaryProbe("alpha", entry(server.url, canary=settings.model_dump()), settings)
    assert probe.run_once() == "ok", server.log_tail()
    result = probe.snapshot()[0].get("")
    assert result is not None
    assert result.generation_tokens_per_second is not None
    assert result.generation_tokens_per_second > 0
    assert result.prompt_tokens_per_second is not None and result.prompt_tokens_per_second > 0
    assert abs(result.finished_at - time.time()) < 60
    generation = server.generate(n_predict=30000)
    wait_until(
        lambda: probe.run_once() == "skipped_busy", timeout=20, what="the canary to see a busy slot"
    )
    generation.cancel()
    server.kill()
    assert probe.run_once() == "skipped_down"
    assert probe.snapshot()[1]["ok"] == 1


def test_canary_collector_runs_in_the_background(
    llama_server: StartLlamaServer, collectors: Made
) -> None:
    server = llama_server("-c", "4096", "-np", "1", "-t", "1", "--metrics")
    canary = {"interval_seconds": 10, "max_tokens": 8}
    collector = CanaryCollector(
        {"alpha": entry(server.url, canary=canary)}, first_delay_seconds=0.5
    )
    collectors.append(collector)
    probe = collector.probes[0]
    wait_until(lambda: probe.snapshot()[0] != {}, timeout=30, what="the first canary run")
    s = Scrape(iter(collector.collect()))
    assert (s.get("gpufleet_canary_tokens_per_second", server="alpha", phase="generation") or 0) > 0
    assert s.get("gpufleet_canary_last_run_timestamp_seconds", server="alpha") is not None
    assert s.get("gpufleet_canary_runs_total", server="alpha", outcome="ok") == 1


def test_a_busy_inference_loop_is_busy_not_down(collectors: Made) -> None:
    # llama-server answers /health from its HTTP threads but /metrics and /slots through the
    # inference loop, which a long prompt batch can hold for seconds (DESIGN.md). Here even a
    # 6000-token prompt on the 300 MB lab model left /metrics answering between batches, so
    # this one case uses the local stand-in server (tests/vllm_stand_in.py), which answers
    # /health and hangs /metrics the way that held loop does.
    fixture = Path(__file__).parent / "fixtures" / "llama" / "metrics-busy.txt"
    with VllmStandIn(fixture) as stand_in:
        stand_in.hang("/metrics")
        collector = make(collectors, alpha=entry(stand_in.url, timeout_seconds=0.5))
        s = scrape(collector)
        stand_in.release()
    assert s.error is None
    assert s.get("gpufleet_llama_up", server="alpha") == 1
    assert s.health("alpha") == "ok"
    assert s.endpoint("alpha", "metrics") == "busy"
    assert s.get("gpufleet_llama_requests_processing", server="alpha") is None
