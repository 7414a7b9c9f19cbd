"""The remediator's HTTP front: bounded, counted, and on TLS when a web config asks for it.

Without TLS the app is served by waitress, bounded so that hostile or broken clients cost a
socket, never a thread, and never the webhook:

- `max_request_body_size` at the webhook's limit: a larger body is answered 413 from its
  `Content-Length`, before any of it is read (waitress' default spools up to 1 GiB to disk
  first, authenticated or not);
- `channel_timeout`: a connection idle or trickling that long is closed;
- `connection_limit` well above what a fleet's Alertmanagers and Prometheus open, so idle
  half-open connections cannot lock the webhook and `/healthz` out (waitress' default, 100,
  could), with `poll()` instead of `select()` past 1,024 descriptors;
- enough threads for the webhook's admission and the API at once.

With a web config (`web_config_file`, the exporter's `--web.config.file` format, read by the
same code: `fleet.webconfig`) that has `tls_server_config`, the app is served by the
bounded front the exporter uses too (`fleet.http_front.BoundedWsgiServer`), which does the
TLS handshake and reads
each request under a deadline on one thread — waitress has no TLS. Its
`http_server_config.headers` go on every answer; its `basic_auth_users` guard `/metrics`
(the webhook and the API have their own credentials, `auth` and `admin`; `/healthz` stays open
for probes).

Every answer the app gives is counted (`gpufleet_remediator_http_responses_total{handler,
code}`); waitress' own refusals (a 413, a closed idle connection) are logged by waitress.

Check by hand: `for i in $(seq 300); do exec {fd}<>/dev/tcp/127.0.0.1/9095; done`, then
`curl -s 127.0.0.1:9095/healthz`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, Protocol
from wsgiref.types import StartResponse, WSGIApplication, WSGIEnvironment

from fleet.http_front import BoundedWsgiServer
from fleet.webconfig import (
    WWW_AUTHENTICATE,
    BasicAuthChecker,
    TLSContextProvider,
    WebConfig,
    load_web_config,
)
from remediator.metrics import RemediatorMetrics
from remediator.webhook import MAX_BODY_BYTES
from remediator.webhook import PATH as WEBHOOK_PATH

log = logging.getLogger(__name__)

CHANNEL_TIMEOUT_SECONDS = 15
CONNECTION_LIMIT = 1000
THREADS = 8

WAITRESS_SETTINGS: dict[str, Any] = {
    "threads": THREADS,
    "max_request_body_size": MAX_BODY_BYTES,
    "channel_timeout": CHANNEL_TIMEOUT_SECONDS,
    "cleanup_interval": 5,
    "connection_limit": CONNECTION_LIMIT,
    "asyncore_use_poll": True,
    "ident": "gpu-fleet-remediator",
}
"""How `serve` runs waitress (see the module docstring for why each)."""


def _handler(path: str) -> str:
    """A small closed set of label values for the response counter."""
    if path == WEBHOOK_PATH:
        return "webhook"
    if path.startswith("/api/"):
        return "api"
    if path in ("/healthz", "/metrics"):
        return path[1:]
    if path == "/ui" or path.startswith("/ui/"):
        return "ui"
    return "other"


def counted(app: WSGIApplication, metrics: RemediatorMetrics) -> WSGIApplication:
    """`app`, counting every answer it gives by handler and status code."""

    def wrapped(environ: WSGIEnvironment, start_response: StartResponse) -> Iterable[bytes]:
        handler = _handler(str(environ.get("PATH_INFO", "")))

        def start(status: str, headers: list[tuple[str, str]], *exc: Any) -> Callable[..., Any]:
            metrics.http_responses.labels(handler, status.split(" ", 1)[0]).inc()
            return start_response(status, headers, *exc)

        return app(environ, start)

    return wrapped


def guarded(app: WSGIApplication, config: WebConfig) -> WSGIApplication:
    """`app` with the web config's headers on every answer and its users guarding /metrics."""
    extra = list(config.headers)
    checker = BasicAuthChecker(config.users) if config.users else None

    def wrapped(environ: WSGIEnvironment, start_response: StartResponse) -> Iterable[bytes]:
        def start(status: str, headers: list[tuple[str, str]], *exc: Any) -> Callable[..., Any]:
            return start_response(status, [*headers, *extra], *exc)

        if (
            checker is not None
            and environ.get("PATH_INFO") == "/metrics"
            and not checker.check_header(environ.get("HTTP_AUTHORIZATION"))
        ):
            start("401 Unauthorized", [("Content-Type", "text/plain; charset=utf-8"),
                                       ("WWW-Authenticate", WWW_AUTHENTICATE)])  # fmt: skip
            return [b"401 Unauthorized: /metrics needs basic auth\n"]
        return app(environ, start)

    return wrapped


class Front(Protocol):
    """A server `serve` runs in its main thread until a signal stops it."""

    def run(self) -> None:
        """Serve until stopped (a signal handler raises out of it)."""

    def close(self) -> None:
        """Release the listening socket."""


class _TLSFront:
    """The exporter's bounded front, on TLS, run in the calling thread."""

    def __init__(self, server: BoundedWsgiServer) -> None:
        self._server = server

    def run(self) -> None:
        self._server.serve_forever()

    def close(self) -> None:
        self._server.stop()


def make_front(
    app: WSGIApplication,
    host: str,
    port: int,
    *,
    metrics: RemediatorMetrics,
    web_config_file: Path | None,
) -> tuple[Front, str]:
    """The listening server for `serve`, and its scheme (`http` or `https`).

    Raises `OSError` when the address cannot be bound.
    """
    from waitress.server import create_server  # noqa: PLC0415 - only `serve` needs it

    served = counted(app, metrics)
    if web_config_file is not None:
        web_config = load_web_config(web_config_file)
        served = guarded(served, web_config)
        if web_config.tls is not None:
            front = BoundedWsgiServer(
                served,
                host,
                port,
                tls=TLSContextProvider(web_config.tls),
                max_connections=CONNECTION_LIMIT,
                workers=THREADS,
            )
            return _TLSFront(front), "https"
    server: Any = create_server(served, host=host, port=port, **WAITRESS_SETTINGS)
    return server, "http"
