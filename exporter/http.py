"""Serving the exporter over HTTP: `/metrics`, a landing page on `/`, 404 elsewhere.

The text format comes from `exporter.exposition` (gzip when the scraper asks for it), served by
the bounded front both sides share (`fleet.http_front.BoundedWsgiServer`: one deadline per
connection, a cap on connections, a few workers; see there).

With a web config (`fleet.webconfig`, `--web.config.file`): TLS on the listening socket, the
context re-read when its files change; basic auth on every path (good credentials are cached;
one bcrypt check at a time, and a request whose credentials would wait for it is answered 429
at once, so wrong passwords never queue good scrapes); the file's extra headers on every
response, 401, 404 and 429 included.

Check by hand: `curl -s 127.0.0.1:9445/metrics | head -1`.
"""

from __future__ import annotations

import gzip
import math
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING
from wsgiref.types import StartResponse, WSGIApplication, WSGIEnvironment

from prometheus_client import CollectorRegistry

from exporter import __version__
from exporter.exposition import CONTENT_TYPE, TextWriter
from exporter.registry import SCRAPE_TIMEOUT
from fleet.http_front import (
    MAX_CONNECTIONS,
    READ_TIMEOUT_SECONDS,
    WORKERS,
    WRITE_TIMEOUT_SECONDS,
    BoundedWsgiServer,
)
from fleet.webconfig import (
    WWW_AUTHENTICATE,
    AuthVerdict,
    BasicAuthChecker,
    TLSContextProvider,
    WebConfig,
)

if TYPE_CHECKING:
    from _typeshed import OptExcInfo

_LANDING = f"""<!doctype html>
<html><head><title>gpu-fleet-exporter</title></head>
<body><h1>gpu-fleet-exporter {__version__}</h1>
<p><a href="/metrics">Metrics</a></p></body></html>
""".encode()


def scrape_timeout(header: str) -> float | None:
    """Prometheus' `X-Prometheus-Scrape-Timeout-Seconds` as seconds; None when absent or bad."""
    try:
        value = float(header)
    except ValueError:
        return None
    return value if math.isfinite(value) and value > 0 else None


def accepts_gzip(header: str) -> bool:
    """Whether an `Accept-Encoding` value accepts gzip (RFC 9110 §12.5.3, q-values heeded).

    `gzip;q=0` refuses it; `*` stands for every coding the header does not name; a q-value
    that is not a number reads as 0 (refused), the safe side: the plain text always works.
    """
    named: float | None = None
    anything: float | None = None
    for item in header.split(","):
        coding, _, params = item.partition(";")
        coding = coding.strip().lower()
        q = 1.0
        for param in params.split(";"):
            key, _, value = param.strip().partition("=")
            if key.strip().lower() == "q":
                try:
                    q = float(value.strip())
                except ValueError:
                    q = 0.0
                if not 0.0 <= q <= 1.0:  # also NaN
                    q = 0.0
        if coding in ("gzip", "x-gzip"):
            named = q if named is None else max(named, q)
        elif coding == "*":
            anything = q
    if named is not None:
        return named > 0
    return anything is not None and anything > 0


def _secured(app: WSGIApplication, config: WebConfig) -> WSGIApplication:
    """`app` behind the config's basic auth, adding its headers to every response."""
    extra = list(config.headers)
    checker = BasicAuthChecker(config.users) if config.users else None

    def secured(environ: WSGIEnvironment, start_response: StartResponse) -> Iterable[bytes]:
        def start(
            status: str, headers: list[tuple[str, str]], exc_info: OptExcInfo | None = None, /
        ) -> Callable[[bytes], object]:
            return start_response(status, [*headers, *extra], exc_info)

        verdict = (
            AuthVerdict.OK
            if checker is None
            # Never waits for bcrypt: a flood of wrong passwords must not queue good scrapes.
            else checker.verdict(environ.get("HTTP_AUTHORIZATION"), wait=False)
        )
        if verdict is AuthVerdict.BUSY:
            start(
                "429 Too Many Requests",
                [("Content-Type", "text/plain; charset=utf-8"), ("Retry-After", "1")],
            )
            return [b"429 Too Many Requests: credentials not checked now (another check runs)\n"]
        if verdict is not AuthVerdict.OK:
            start(
                "401 Unauthorized",
                [
                    ("Content-Type", "text/plain; charset=utf-8"),
                    ("WWW-Authenticate", WWW_AUTHENTICATE),
                ],
            )
            return [b"401 Unauthorized: this endpoint needs basic auth\n"]
        return app(environ, start)

    return secured


class MetricsServer:
    """A running exporter endpoint; `port` is the bound one (useful with port 0).

    `web_config` adds TLS, basic auth and headers; without one, plain HTTP as before. The
    bounds of the front default to `fleet.http_front`'s constants.
    """

    def __init__(
        self,
        registry: CollectorRegistry,
        host: str,
        port: int,
        web_config: WebConfig | None = None,
        *,
        read_timeout_seconds: float = READ_TIMEOUT_SECONDS,
        write_timeout_seconds: float = WRITE_TIMEOUT_SECONDS,
        max_connections: int = MAX_CONNECTIONS,
        workers: int = WORKERS,
    ) -> None:
        writer = TextWriter()

        def metrics_app(environ: WSGIEnvironment, start_response: StartResponse) -> Iterable[bytes]:
            path = environ.get("PATH_INFO", "/")
            if path == "/metrics":
                token = SCRAPE_TIMEOUT.set(
                    scrape_timeout(environ.get("HTTP_X_PROMETHEUS_SCRAPE_TIMEOUT_SECONDS", ""))
                )
                try:
                    body = writer.render_registry(registry)
                finally:
                    SCRAPE_TIMEOUT.reset(token)
                # The answer depends on Accept-Encoding: a cache between must know (RFC 9110).
                headers = [("Content-Type", CONTENT_TYPE), ("Vary", "Accept-Encoding")]
                if accepts_gzip(environ.get("HTTP_ACCEPT_ENCODING", "")):
                    body = gzip.compress(body, compresslevel=6)
                    headers.append(("Content-Encoding", "gzip"))
                headers.append(("Content-Length", str(len(body))))
                start_response("200 OK", headers)
                # HEAD: the headers GET would get, Content-Length included, and no body.
                return [] if environ.get("REQUEST_METHOD") == "HEAD" else [body]
            if path == "/":
                start_response("200 OK", [("Content-Type", "text/html; charset=utf-8")])
                return [_LANDING]
            start_response("404 Not Found", [("Content-Type", "text/plain; charset=utf-8")])
            return [b"not found: the metrics are at /metrics\n"]

        app: WSGIApplication = metrics_app
        self.tls: TLSContextProvider | None = None
        """The TLS context's provider, None for plain HTTP."""
        if web_config is not None:
            app = _secured(metrics_app, web_config)
            if web_config.tls is not None:
                self.tls = TLSContextProvider(web_config.tls)
        self.scheme = "http" if self.tls is None else "https"
        self._front = BoundedWsgiServer(
            app,
            host,
            port,
            tls=self.tls,
            read_timeout_seconds=read_timeout_seconds,
            write_timeout_seconds=write_timeout_seconds,
            max_connections=max_connections,
            workers=workers,
        )
        self.port: int = self._front.port

    def start(self) -> None:
        """Serve in a background thread."""
        self._front.start()

    def stop(self) -> None:
        """Stop serving and release the socket."""
        self._front.stop()
