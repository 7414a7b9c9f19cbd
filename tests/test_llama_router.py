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
from typing import Any

import pytest

from exporter.canary import CanaryProbe
from exporter.collectors import catalogue
from exporter.collectors.llama import LlamaCollector
from exporter.roster import Canary
from tests.llama_lab import LlamaServer, get_json, wait_until
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
