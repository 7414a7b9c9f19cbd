"""Router mode (`llama-server --models-dir DIR`) against the real pinned build.

One router process, one child per model: `alpha` loaded, `beta` listed and never loaded, and
`broken` (a file that is no model) whose load failed. Scraping must never load or wake a
model: only `loaded` children are read, with `?model=NAME&autoload=false`. The router's series
keep the roster's `server`; the child's id goes in `served_model`.
"""

from __future__ import annotations

import http.client
import json
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import pytest

from exporter.canary import CanaryProbe, CanaryResult
from exporter.collectors import catalogue
from exporter.collectors.llama import LlamaCollector
from fleet.roster import Canary
from remediator.actions.registry import StepResult
from remediator.actions.serving import CanaryParams, canary_benchmark
from remediator.actions.settings import ActionSettings
from remediator.alerts import Alert
from remediator.playbooks.loader import Rejection, Target, load_playbooks
from remediator.playbooks.model import resolve_target
from tests.llama_lab import LlamaServer, get_json, wait_until
from tests.prometheus_lab import MetricsEndpoint, PrometheusServer
from tests.recorded_llama import FIXTURES, JSON, RecordedLlama
from tests.test_host_actions import context, server_roster
from tests.test_llama_collector import Scrape, entry

ROUTER_ARGS = ("-c", "512", "-np", "2", "-t", "1", "--metrics", "--models-max", "3")
IDLE_SECONDS = 3


def post(server: LlamaServer, path: str, body: dict[str, Any]) -> int:
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    try:
        conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
        response = conn.getresponse()
        response.read()
        return response.status
    finally:
        conn.close()


def states(server: LlamaServer) -> dict[str, dict[str, Any]]:
    """The router's own `/models` statuses (answered by the router: it loads nothing)."""
    return {m["id"]: m["status"] for m in get_json(server.url, "/models")["data"]}


@pytest.fixture
def start_router(llama_binary: Path, tiny_model: Path, tmp_path: Path) -> Iterator[Any]:
    made: list[LlamaServer] = []

    def start(*extra: str) -> LlamaServer:
        models = tmp_path / "models"
        models.mkdir(exist_ok=True)
        for name in ("alpha", "beta"):
            shutil.copy(tiny_model, models / f"{name}.gguf")
        (models / "broken.gguf").write_bytes(b"GGUF" + bytes(64))  # a header and nothing else
        server = LlamaServer(llama_binary, ["--models-dir", str(models), *ROUTER_ARGS, *extra],
                             tmp_path)  # fmt: skip
        made.append(server)
        server.start()
        server.wait_healthy()
        assert post(server, "/models/load", {"model": "broken"}) == 200
        assert post(server, "/models/load", {"model": "alpha"}) == 200
        wait_until(
            lambda: (
                states(server)["alpha"]["value"] == "loaded"
                and states(server)["broken"].get("failed") is True
            ),
            30,
            interval=0.1,
            what="alpha loaded and broken failed",
        )
        return server

    yield start
    for server in made:
        server.stop()


def test_router_models_are_read_without_loading_any(start_router: Any) -> None:
    router = start_router()
    collector = LlamaCollector({"hub": entry(router.url)})
    try:
        for _ in range(5):
            s = Scrape(iter(collector.collect()))
            time.sleep(0.2)
        # Nothing was loaded by scraping: beta is listed, never asked.
        assert states(router)["beta"]["value"] == "unloaded"
        assert s.error is None
        assert s.get("gpufleet_llama_up", server="hub") == 1
        info = [labels for (name, labels) in s.samples if name == "gpufleet_llama_info"]
        assert len(info) == 1 and dict(info[0])["server"] == "hub"  # one per server
        assert s.get("gpufleet_llama_context_tokens", server="hub") is None  # a router has none
        for model, state in (("alpha", "loaded"), ("beta", "unloaded"), ("broken", "failed")):
            assert s.get("gpufleet_llama_model_info", server="hub", served_model=model) == 1
            assert s.get("gpufleet_llama_model_state", server="hub", served_model=model,
                         state=state) == 1  # fmt: skip
        assert s.get("gpufleet_llama_model_exit_code", server="hub", served_model="broken") == 1
        assert s.get("gpufleet_llama_model_exit_code", server="hub", served_model="alpha") is None
        assert s.endpoint("hub", "models") == "ok"
        assert s.endpoint("hub", "metrics") == "ok"  # alpha's, the one loaded model
        alpha = {"server": "hub", "served_model": "alpha"}
        assert s.get("gpufleet_llama_context_tokens", **alpha) == 256  # -c 512 -np 2
        assert s.get("gpufleet_llama_slots", **alpha, state="idle") == 2
        assert s.get("gpufleet_llama_decode_calls_total", **alpha) is not None
        assert s.get("gpufleet_llama_spec_accepted_tokens_total", **alpha) == 0
        # Only model info and state speak of a model that is not loaded.
        about_beta = {n for n, labels in s.samples if ("served_model", "beta") in labels}
        assert about_beta == {"gpufleet_llama_model_info", "gpufleet_llama_model_state"}

        generation = router.generate(n_predict=30000, model="alpha")
        wait_until(
            lambda: Scrape(iter(collector.collect())).get(
                "gpufleet_llama_slot_decoded_tokens", **alpha, slot="0"
            ) is not None or Scrape(iter(collector.collect())).get(
                "gpufleet_llama_slot_decoded_tokens", **alpha, slot="1"
            ) is not None,
            20,
            what="alpha's busy slot read with served_model",
        )  # fmt: skip
        s = Scrape(iter(collector.collect()))
        assert s.get("gpufleet_llama_slots", **alpha, state="busy") == 1
        assert s.endpoint("hub", "slots") == "ok"
        generation.cancel()
        # Every family as the catalogue has it (the full-scrape test has no router).
        for (name, labels), _ in s.samples.items():
            spec = catalogue.CATALOGUE.get(name) or catalogue.CATALOGUE[name + "_total"]
            assert {k for k, _ in labels} <= set(spec.labels), name
    finally:
        collector.close()
    assert states(router)["beta"]["value"] == "unloaded"


def test_router_canary_probes_loaded_models_only(start_router: Any) -> None:
    router = start_router()
    settings = Canary(interval_seconds=10, max_tokens=8, timeout_seconds=30)
    probe = CanaryProbe("hub", entry(router.url, canary=settings.model_dump()), settings)
    assert probe.run_once() == "ok"
    results, _ = probe.snapshot()
    assert set(results) == {"alpha"}
    assert (results["alpha"].generation_tokens_per_second or 0) > 0
    assert states(router)["beta"]["value"] == "unloaded"


def test_a_sleeping_router_model_is_not_woken_by_scrapes_or_the_canary(
    start_router: Any,
) -> None:
    router = start_router("--sleep-idle-seconds", str(IDLE_SECONDS))
    collector = LlamaCollector({"hub": entry(router.url)})
    settings = Canary(interval_seconds=10, max_tokens=8, timeout_seconds=30)
    probe = CanaryProbe("hub", entry(router.url, canary=settings.model_dump()), settings)
    try:
        loaded_at = time.monotonic()
        # Scraped every second, the loaded child still falls asleep on time...
        while states(router)["alpha"]["value"] != "sleeping":
            Scrape(iter(collector.collect()))
            assert time.monotonic() - loaded_at < IDLE_SECONDS + 3, states(router)
            time.sleep(1.0)
        # ...and stays asleep under scrapes and canary attempts.
        for _ in range(8):
            s = Scrape(iter(collector.collect()))
            assert s.get("gpufleet_llama_model_state", server="hub", served_model="alpha",
                         state="sleeping") == 1  # fmt: skip
            assert s.get("gpufleet_llama_slots", server="hub", served_model="alpha",
                         state="idle") is None  # fmt: skip
            assert probe.run_once() == "skipped_sleeping"
            assert states(router)["alpha"]["value"] == "sleeping"
            time.sleep(1.0)
    finally:
        collector.close()


def test_two_loaded_router_models_are_read_apart(start_router: Any) -> None:
    router = start_router()
    assert post(router, "/models/load", {"model": "beta"}) == 200
    wait_until(lambda: states(router)["beta"]["value"] == "loaded", 30, what="beta loaded")
    collector = LlamaCollector({"hub": entry(router.url)})
    alpha = {"server": "hub", "served_model": "alpha"}
    beta = {"server": "hub", "served_model": "beta"}
    try:
        generation = router.generate(n_predict=30000, model="alpha")
        wait_until(
            lambda: Scrape(iter(collector.collect())).get(
                "gpufleet_llama_slots", **alpha, state="busy"
            ) == 1,
            20,
            what="alpha busy",
        )  # fmt: skip
        s = Scrape(iter(collector.collect()))
        generation.cancel()
    finally:
        collector.close()
    # Each child's own counters and slots: alpha generates, beta idles (its /slots not asked).
    assert s.get("gpufleet_llama_requests_processing", **alpha) == 1
    assert s.get("gpufleet_llama_requests_processing", **beta) == 0
    assert s.get("gpufleet_llama_slots", **beta, state="idle") == 2
    decoded = [labels for (n, labels) in s.samples if n == "gpufleet_llama_slot_decoded_tokens"]
    assert decoded and all(("served_model", "alpha") in labels for labels in decoded)
    assert s.endpoint("hub", "metrics") == "ok" and s.endpoint("hub", "slots") == "ok"
    info = [labels for (name, labels) in s.samples if name == "gpufleet_llama_info"]
    assert len(info) == 1


@pytest.mark.parametrize("marked", [True, None])
def test_the_roster_may_mark_a_router_when_props_does_not_say(marked: bool | None) -> None:
    from tests.llama_stand_in import LlamaStandIn

    # /props fails (500) every scrape, so only the roster can tell this is a router.
    with LlamaStandIn("error", paths=frozenset({"/props"})) as server:
        collector = LlamaCollector({"hub": entry(server.url, router=marked)})
        try:
            s = Scrape(iter(collector.collect()))
            endpoints = {
                dict(labels)["endpoint"]
                for name, labels in s.samples
                if name == "gpufleet_llama_endpoint" and ("server", "hub") in labels
            }
            if marked:
                # Read as a router: its model list was asked for, its own /metrics was not.
                assert "models" in endpoints and "metrics" not in endpoints, endpoints
            else:
                # Detected from /props only: not a router, so no list; /metrics read.
                assert "models" not in endpoints and s.endpoint("hub", "metrics") == "ok"
        finally:
            collector.close()


# -- the remediator's canary_benchmark on a router's child -------------------------------------


def test_the_remediators_canary_measures_the_named_child_and_loads_no_other(
    start_router: Any, tmp_path: Path
) -> None:
    router = start_router()
    roster = server_roster(tmp_path, router.url)
    host = roster.hosts["dioscuri"]
    # The 7-day baseline of alpha alone (a router's children have their own, by served_model).
    baseline = (
        'server_model:gpufleet_tokens_per_second:baseline_7d{host="dioscuri",server="alpha",'
        'role="r",model="alpha",served_model="alpha"} 1\n'
    )
    with (
        MetricsEndpoint(baseline) as endpoint,
        PrometheusServer(tmp_path / "prom", [endpoint.target]) as prometheus,
    ):
        prometheus.wait_for(
            'server_model:gpufleet_tokens_per_second:baseline_7d{served_model="alpha"}'
        )

        def canary(served: str, mode: Literal["confirm", "verify"] = "confirm") -> StepResult:
            target = Target("server", "dioscuri", host, server="alpha",
                            server_entry=host.servers["alpha"], served_model=served)  # fmt: skip
            ctx = context(target, ActionSettings(), prometheus_url=prometheus.url)
            return canary_benchmark(ctx, CanaryParams(n_predict=8, mode=mode))

        measured = canary("alpha")
        assert measured.ok and measured.finish is not None, measured.output  # 1 tok/s: false alarm
        assert "false alarm" in measured.output and measured.details["tokens_per_second"] > 1
        # beta is listed, not loaded: not measured, not loaded by the attempt, nothing restarted.
        skipped = canary("beta")
        assert skipped.ok and "not measured: model beta is not loaded" in skipped.output
        assert skipped.finish is not None
        # As a verification probe an unknown speed is no recovery.
        unverified = canary("beta", mode="verify")
        assert not unverified.ok and "not verified: model beta is not loaded" in unverified.output
    assert states(router)["beta"]["value"] == "unloaded"


def test_a_router_childs_alert_names_it_in_the_target_and_a_bad_name_is_refused(
    tmp_path: Path,
) -> None:
    roster = server_roster(tmp_path, "http://127.0.0.1:9")
    playbook = next(p for p in load_playbooks(None) if p.name == "tokens-per-second-degraded")

    def resolve(**labels: str) -> object:
        alert = Alert.model_validate(
            {"status": "firing", "startsAt": "2026-12-01T04:00:00Z", "fingerprint": "f00d",
             "labels": {"alertname": "TokensPerSecondDegraded", "host": "dioscuri",
                        "server": "alpha", **labels}}
        )  # fmt: skip
        return resolve_target(playbook, alert, roster)

    child = resolve(served_model="gemma-4.Q4_K_M")
    assert isinstance(child, Target) and child.served_model == "gemma-4.Q4_K_M"
    assert child.key == "server/dioscuri/alpha"  # the budget is the router's: one process
    plain = resolve()
    assert isinstance(plain, Target) and plain.served_model is None
    for hostile in ('a"}) or vector(1', "x y", "../etc", "-rf"):
        refused = resolve(served_model=hostile)
        assert isinstance(refused, Rejection) and "is not a model id" in refused.reason


def test_the_canary_forgets_a_model_the_router_no_longer_lists() -> None:
    """A model removed from the router (a swap): its last result is no longer exported and
    nothing of it is kept. The router's answers here are the recorded real server's
    (tests/recorded_llama.py), as a router sends them, since the real router cannot drop a
    model without a restart."""
    props = json.loads((FIXTURES / "props.json").read_text())
    props["role"] = "router"
    models = {"data": [{"id": "kept", "status": {"value": "unloaded"}}]}
    bodies = {
        "/props": (json.dumps(props).encode(), JSON),
        "/models": (json.dumps(models).encode(), JSON),
    }
    settings = Canary(interval_seconds=10, max_tokens=8, timeout_seconds=5)
    with RecordedLlama(bodies) as router:
        probe = CanaryProbe("hub", entry(router.url, canary=settings.model_dump()), settings)
        earlier = CanaryResult(50.0, 500.0, time.time())
        probe._latest = {"kept": earlier, "removed": earlier}
        probe._after_last_run = {"kept": (1.0,), "removed": (2.0,)}
        assert probe.run_once() == "skipped_sleeping"  # nothing loaded: nothing measured
    results, _ = probe.snapshot()
    assert set(results) == {"kept"}  # its last measurement stands; the removed one is gone
    assert set(probe._after_last_run) == {"kept"}
