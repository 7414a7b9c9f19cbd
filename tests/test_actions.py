"""Actions: the registry, run_action's bounds, and the built-ins against real servers.

`prometheus_check` and `verify.promql_holds` run against a real Prometheus (Debian's binary)
scraping a local endpoint whose text the test changes; `http_probe` against local stdlib
servers: one answering, one that accepts and never answers, a closed port, a redirect, a
self-signed TLS server.
"""

from __future__ import annotations

import http.server
import shutil
import socket
import ssl
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel, ValidationError

from fleet.roster import parse_roster
from remediator.actions.builtin import HttpProbeParams, PrometheusCheckParams, WaitParams
from remediator.actions.registry import (
    ActionContext,
    ActionParams,
    StepResult,
    UnknownActionError,
    action,
    get_action,
    registered,
    render_params,
    run_action,
)
from remediator.prometheus_api import promql_holds
from remediator.targets import Target
from tests.llama_lab import free_port
from tests.prometheus_lab import MetricsEndpoint, PrometheusServer

ROSTER = parse_roster(
    {
        "hosts": {
            "dioscuri": {
                "address": "127.0.0.1",
                "servers": {
                    "alpha": {
                        "engine": "llama",
                        "url": "http://127.0.0.1:31001",
                        "unit": "llama-server@alpha.service",
                        "role": "gpu-dense",
                        "model": "{host} Gemma4",  # a brace in a roster value stays literal
                    }
                },
            }
        }
    },
    "test",
)
HOST = ROSTER.hosts["dioscuri"]
TARGET = Target("server", "dioscuri", HOST, server="alpha", server_entry=HOST.servers["alpha"])


def context(
    *, seconds: float = 30.0, cancel: threading.Event | None = None, dry_run: bool = False,
    prometheus_url: str = "http://127.0.0.1:9",
) -> ActionContext:  # fmt: skip
    return ActionContext(
        target=TARGET,
        prometheus_url=prometheus_url,
        deadline=time.monotonic() + seconds,
        cancel=cancel or threading.Event(),
        dry_run=dry_run,
    )


# --- actions registered only for these tests -----------------------------------------------


class _TestParams(ActionParams):
    seconds: float = 0.0


@action("test_raises", _TestParams)
def _raises(ctx: ActionContext, params: _TestParams) -> StepResult:
    raise RuntimeError("the action's own bug")


CALLS: list[str] = []


@action("test_changes_something", _TestParams)
def _changes_something(ctx: ActionContext, params: _TestParams) -> StepResult:
    CALLS.append("changed")
    return StepResult(True, "changed something")


@action("test_ignores_deadline", _TestParams)
def _ignores_deadline(ctx: ActionContext, params: _TestParams) -> StepResult:
    time.sleep(params.seconds)  # breaks the contract on purpose: run_action must say so
    return StepResult(True, "done, late")


# --- the registry ---------------------------------------------------------------------------


def test_builtins_are_registered_read_only_with_their_models() -> None:
    actions = registered()
    assert {"wait", "prometheus_check", "http_probe"} <= set(actions)
    assert actions["wait"].params_model is WaitParams
    assert actions["http_probe"].params_model is HttpProbeParams
    assert actions["prometheus_check"].params_model is PrometheusCheckParams
    assert all(actions[n].read_only for n in ("wait", "prometheus_check", "http_probe"))
    assert actions["test_changes_something"].read_only is False
    assert get_action("wait").default_timeout_seconds > 0
    with pytest.raises(UnknownActionError):
        get_action("restart_the_world")


def test_registration_refuses_bad_names_duplicates_and_lax_models() -> None:
    def fn(ctx: ActionContext, params: _TestParams) -> StepResult:
        return StepResult(True, "")

    with pytest.raises(ValueError, match="already registered"):
        action("wait", _TestParams)(fn)
    with pytest.raises(ValueError, match="lower_snake_case"):
        action("Restart-Unit", _TestParams)
    with pytest.raises(ValueError, match="read-only action cannot be disruptive"):
        action("look_and_touch", _TestParams, read_only=True, disruptive=True)
    with pytest.raises(ValueError, match="clears nothing"):
        action("look_and_clear", _TestParams, read_only=True, clears_alert=True)
    with pytest.raises(ValueError, match="reserved"):
        action("timeout_seconds", _TestParams)

    class Lax(BaseModel):
        seconds: float

    with pytest.raises(ValueError, match="forbid extra keys"):
        action("test_lax", Lax)
    assert "test_lax" not in registered()


def test_params_models_refuse_unknown_keys_and_bad_values() -> None:
    with pytest.raises(ValidationError, match="Extra inputs"):
        WaitParams.model_validate({"seconds": 1, "second": 2})
    for bad in ({"seconds": 0}, {"seconds": 3601}, {"seconds": "soon"}):
        with pytest.raises(ValidationError):
            WaitParams.model_validate(bad)
    for url in ("file:///etc/passwd", "ftp://127.0.0.1/x", "127.0.0.1:80/health", "http://"):
        with pytest.raises(ValidationError, match="http:// or https://"):
            HttpProbeParams.model_validate({"url": url})
    with pytest.raises(ValidationError, match="credentials"):
        HttpProbeParams.model_validate({"url": "http://user:secret@127.0.0.1/"})
    with pytest.raises(ValidationError):
        HttpProbeParams.model_validate({"url": "http://127.0.0.1/", "method": "DELETE"})
    with pytest.raises(ValidationError):
        PrometheusCheckParams.model_validate({"query": "up", "expect": "some"})


def test_render_params_fills_every_string_from_the_target_only() -> None:
    raw = {
        "url": "{server.url}/health",
        "nested": {"list": ["{host}", 3, {"deep": "{server.unit} on {host.address}"}]},
        "count": 2,
        "{host}": "keys are not templates",
        "model": "{server.model}",
        "promql": 'gpufleet_llama_up{host="{host}",server="{server}"} == 1',
    }
    filled = render_params(raw, TARGET)
    assert filled == {
        "url": "http://127.0.0.1:31001/health",
        "nested": {"list": ["dioscuri", 3, {"deep": "llama-server@alpha.service on 127.0.0.1"}]},
        "count": 2,
        "{host}": "keys are not templates",
        # Filled in one pass: a roster value holding `{host}` is not filled again.
        "model": "{host} Gemma4",
        "promql": 'gpufleet_llama_up{host="dioscuri",server="alpha"} == 1',
    }
    assert raw["url"] == "{server.url}/health"  # the playbook's own params are not changed


# --- run_action -----------------------------------------------------------------------------


def test_a_raising_action_becomes_a_failed_step() -> None:
    result = run_action(context(), "test_raises", _TestParams(), 5)
    assert result.ok is False
    assert result.output == "error: RuntimeError: the action's own bug"


def test_an_overrun_is_reported_as_timeout() -> None:
    result = run_action(context(), "test_ignores_deadline", _TestParams(seconds=0.6), 0.1)
    assert result.ok is False
    assert result.output.startswith("timeout after 0.")
    assert result.details["timeout"] is True


def test_the_earlier_deadline_wins_and_wait_honours_it() -> None:
    start = time.monotonic()
    result = run_action(context(seconds=0.2), "wait", WaitParams(seconds=30), 60)
    assert time.monotonic() - start < 2
    assert not result.ok and result.output.startswith("timeout")


def test_wait_returns_early_when_cancelled() -> None:
    cancel = threading.Event()
    threading.Timer(0.1, cancel.set).start()
    start = time.monotonic()
    result = run_action(context(cancel=cancel), "wait", WaitParams(seconds=20), 30)
    assert time.monotonic() - start < 2
    assert not result.ok and result.output.startswith("cancelled")
    assert run_action(context(cancel=cancel), "wait", WaitParams(seconds=1), 5).output == (
        "cancelled before it started"
    )


def test_wait_waits() -> None:
    start = time.monotonic()
    result = run_action(context(), "wait", WaitParams(seconds=0.2), 5)
    assert result == StepResult(True, "waited 0.2 s")
    assert time.monotonic() - start >= 0.2


def test_dry_run_calls_only_read_only_actions() -> None:
    CALLS.clear()
    result = run_action(context(dry_run=True), "test_changes_something", _TestParams(), 5)
    assert result.ok and result.output.startswith("dry run: would run test_changes_something")
    assert CALLS == []
    run_action(context(dry_run=False), "test_changes_something", _TestParams(), 5)
    assert CALLS == ["changed"]
    assert run_action(context(dry_run=True), "wait", WaitParams(seconds=0.01), 5).output == (
        "waited 0.01 s"
    )


def test_unknown_action_and_wrong_params_are_failed_steps() -> None:
    assert run_action(context(), "nope", _TestParams(), 5).output.startswith("error: no action")
    result = run_action(context(), "wait", _TestParams(), 5)
    assert not result.ok and "takes WaitParams" in result.output


# --- http_probe -----------------------------------------------------------------------------


class _Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        if self.path == "/health":
            self._answer(200, b'{"status":"ok"}')
        elif self.path == "/loading":
            self._answer(503, b'{"error":{"message":"Loading model"}}')
        elif self.path == "/moved":
            self.send_response(302)
            self.send_header("Location", "/health")
            self.send_header("Content-Length", "0")
            self.end_headers()
        else:
            self._answer(404, b"not found")

    def do_POST(self) -> None:
        length = int(self.headers.get("Content-Length", "0"))
        self._answer(200 if length == 0 else 400, b"posted")

    def _answer(self, status: int, body: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        pass


@pytest.fixture(scope="module")
def web() -> Iterator[str]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def probe(**params: Any) -> StepResult:
    return run_action(context(), "http_probe", HttpProbeParams.model_validate(params), 10)


def test_http_probe_status_and_body(web: str) -> None:
    ok = probe(url=f"{web}/health", body_contains='"status":"ok"')
    assert ok.ok, ok.output
    assert ok.output.startswith(f"GET {web}/health answered 200 in ")
    assert ok.details["status"] == 200 and ok.details["body_excerpt"] == '{"status":"ok"}'

    loading = probe(url=f"{web}/loading")
    assert not loading.ok and "answered 503" in loading.output and "expected 200" in loading.output
    assert probe(url=f"{web}/loading", expect_status=503).ok

    lacking = probe(url=f"{web}/health", body_contains="slots")
    assert not lacking.ok and "body lacks 'slots'" in lacking.output

    assert probe(url=f"{web}/anything", method="POST").ok


def test_http_probe_does_not_follow_redirects(web: str) -> None:
    moved = probe(url=f"{web}/moved")
    assert not moved.ok and "answered 302" in moved.output
    assert probe(url=f"{web}/moved", expect_status=302).ok


def test_http_probe_refused() -> None:
    result = probe(url=f"http://127.0.0.1:{free_port()}/health")
    assert not result.ok
    assert "connection refused" in result.output


def test_http_probe_times_out_on_a_server_that_never_answers() -> None:
    # A listening socket nobody accepts from: the kernel completes the handshake (backlog),
    # the request is sent, and no answer ever comes: a hung llama-server.
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        url = f"http://127.0.0.1:{silent.getsockname()[1]}/health"
        start = time.monotonic()
        result = probe(url=url, timeout_seconds=0.5)
        took = time.monotonic() - start
    assert not result.ok
    assert result.output.startswith(f"timeout: GET {url} did not answer within 0.5 s")
    assert took < 3


def test_http_probe_verifies_tls(tmp_path: Path) -> None:
    openssl = shutil.which("openssl")
    if openssl is None:
        pytest.fail("the openssl CLI is missing: this test makes its certificate with it")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        [openssl, "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256",
         "-nodes", "-keyout", str(key), "-out", str(cert), "-days", "1",
         "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
        check=True, capture_output=True,
    )  # fmt: skip
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    tls.load_cert_chain(cert, key)
    server.socket = tls.wrap_socket(server.socket, server_side=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        result = probe(url=f"https://127.0.0.1:{server.server_address[1]}/health")
    finally:
        server.shutdown()
        server.server_close()
    # Self-signed: not trusted, so the probe fails rather than talk to an unknown server.
    assert not result.ok
    assert "certificate" in result.output.lower()


# --- Prometheus: prometheus_check and promql_holds ------------------------------------------


@pytest.fixture(scope="module")
def lab(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[MetricsEndpoint, str]]:
    """A real Prometheus scraping an endpoint every second; yields (endpoint, Prometheus URL)."""
    text = 'gpufleet_llama_up{server="alpha"} 1\ngpufleet_llama_up{server="beta"} 0\n'
    with (
        MetricsEndpoint(text) as endpoint,
        PrometheusServer(
            tmp_path_factory.mktemp("prometheus"), [endpoint.target], labels={"host": "dioscuri"}
        ) as prometheus,
    ):
        prometheus.wait_for("gpufleet_llama_up", count=2)
        yield endpoint, prometheus.url


def check(url: str, **params: Any) -> StepResult:
    return run_action(
        context(prometheus_url=url),
        "prometheus_check",
        PrometheusCheckParams.model_validate(params),
        30,
    )


def test_prometheus_check_nonempty_and_empty(lab: tuple[MetricsEndpoint, str]) -> None:
    _, url = lab
    up = check(url, query='gpufleet_llama_up{host="dioscuri",server="alpha"} == 1')
    assert up.ok, up.output
    assert up.details["samples"] == 1
    assert 'gpufleet_llama_up{host="dioscuri",instance=' in up.output

    down = check(url, query='gpufleet_llama_up{server="beta"} == 1')
    assert not down.ok and "no series" in down.output

    assert check(url, query='gpufleet_llama_up{server="beta"} == 1', expect="empty").ok
    present = check(url, query='gpufleet_llama_up{server="alpha"} == 1', expect="empty")
    assert not present.ok and "expected none" in present.output


def test_prometheus_check_passes_within_when_the_value_changes(
    lab: tuple[MetricsEndpoint, str],
) -> None:
    endpoint, url = lab
    query = 'gpufleet_llama_up{server="gamma"} == 1'
    endpoint.set('gpufleet_llama_up{server="alpha"} 1\ngpufleet_llama_up{server="gamma"} 0\n')
    try:
        assert not check(url, query=query).ok  # once, now: gamma is not up (or not there yet)
        # Gamma comes up a moment later; the next scrape (1 s) brings it to Prometheus.
        threading.Timer(
            0.5,
            endpoint.set,
            ('gpufleet_llama_up{server="alpha"} 1\ngpufleet_llama_up{server="gamma"} 1\n',),
        ).start()
        start = time.monotonic()
        result = check(url, query=query, within_seconds=15, interval_seconds=0.25)
        assert result.ok, result.output
        assert time.monotonic() - start < 10
        assert "holds after" in result.output
    finally:
        endpoint.set('gpufleet_llama_up{server="alpha"} 1\ngpufleet_llama_up{server="beta"} 0\n')


def test_promql_holds_gives_up_after_within(lab: tuple[MetricsEndpoint, str]) -> None:
    _, url = lab
    start = time.monotonic()
    result = promql_holds(url, "gpufleet_llama_up == 7", within_seconds=0.6, interval_seconds=0.2)
    took = time.monotonic() - start
    assert not result.ok and result.samples == 0
    assert result.detail.startswith("did not hold within 0.6 s (")
    assert 0.5 < took < 3


def test_promql_holds_stops_when_cancelled(lab: tuple[MetricsEndpoint, str]) -> None:
    _, url = lab
    cancel = threading.Event()
    threading.Timer(0.2, cancel.set).start()
    start = time.monotonic()
    result = promql_holds(
        url, "gpufleet_llama_up == 7", within_seconds=30, interval_seconds=0.5, cancel=cancel
    )
    assert not result.ok and result.detail.startswith("cancelled")
    assert time.monotonic() - start < 3


def test_promql_errors_are_reasons_not_exceptions(lab: tuple[MetricsEndpoint, str]) -> None:
    _, url = lab
    bad = promql_holds(url, "gpufleet_llama_up{", within_seconds=0, interval_seconds=1)
    assert not bad.ok and "bad_data" in bad.detail
    scalar = promql_holds(url, "1", within_seconds=0, interval_seconds=1)
    assert not scalar.ok and "scalar" in scalar.detail
    # Not Prometheus at all: the answer is not the API's JSON.
    with MetricsEndpoint("not json") as other:
        wrong = promql_holds(f"http://{other.target}", "up", within_seconds=0, interval_seconds=1)
    assert not wrong.ok and "not JSON" in wrong.detail


def test_prometheus_stopped_is_not_ok_with_a_reason(tmp_path: Path) -> None:
    # No scrape targets: this Prometheus is ready in a fraction of a second (the first scrape
    # of a target waits for service discovery's 5 s tick), and `vector(1)` needs no data.
    prometheus = PrometheusServer(tmp_path, []).start()
    try:
        assert promql_holds(prometheus.url, "vector(1)", within_seconds=0, interval_seconds=1).ok
    finally:
        prometheus.stop()
    for expect in ("nonempty", "empty"):
        result = promql_holds(
            prometheus.url,
            "vector(1)",
            within_seconds=0.3,
            interval_seconds=0.1,
            expect=expect,
        )
        # Unreachable is never mistaken for "empty".
        assert not result.ok, expect
        assert "unreachable" in result.detail and "refused" in result.detail.lower()
    step = check(prometheus.url, query="up", expect="empty")
    assert not step.ok and "unreachable" in step.output
