"""Serving the exporter over HTTP: `/metrics`, a landing page on `/`, 404 elsewhere.

The text format comes from `exporter.exposition` (gzip when the scraper asks for it), served by
`prometheus_client`'s threading WSGI server, so a slow scraper cannot block a second one.

With a web config (`exporter.webconfig`, `--web.config.file`): TLS on the listening socket, the
handshake done in the connection's own thread (a client that never finishes one cannot stall
the accept loop), the context re-read when its files change; basic auth on every path; the
file's extra headers on every response, 401 and 404 included.
"""

from __future__ import annotations

import gzip
import logging
import socket
import ssl
import threading
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING
from wsgiref.simple_server import WSGIRequestHandler, make_server
from wsgiref.types import StartResponse, WSGIApplication, WSGIEnvironment

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import ThreadingWSGIServer

from exporter import __version__
from exporter.exposition import CONTENT_TYPE, TextWriter
from exporter.webconfig import (
    HANDSHAKE_TIMEOUT_SECONDS,
    WWW_AUTHENTICATE,
    BasicAuthChecker,
    TLSContextProvider,
    WebConfig,
)

if TYPE_CHECKING:
    from socket import _RetAddress

    from _typeshed import OptExcInfo

log = logging.getLogger(__name__)

_LANDING = f"""<!doctype html>
<html><head><title>gpu-fleet-exporter</title></head>
<body><h1>gpu-fleet-exporter {__version__}</h1>
<p><a href="/metrics">Metrics</a></p></body></html>
""".encode()


def parse_listen_address(value: str) -> tuple[str, int]:
    """Split `host:port`, `[v6]:port` or `:port` (all interfaces); raises `ValueError`."""
    host, sep, port_text = value.rpartition(":")
    if not sep:
        raise ValueError(f"{value!r}: expected host:port or :port")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    try:
        port = int(port_text)
    except ValueError:
        raise ValueError(f"{value!r}: port {port_text!r} is not a number") from None
    if not 0 <= port <= 65535:
        raise ValueError(f"{value!r}: port {port} is out of range")
    return host or "0.0.0.0", port


class _QuietHandler(WSGIRequestHandler):
    """Access lines would log every scrape; errors still go to stderr through the server."""

    def log_message(self, format: str, *args: object) -> None:
        del format, args


# What Go's net/http answers to plain HTTP on a TLS port: better than a reset for someone who
# typed http:// by mistake.
_PLAIN_HTTP_ON_TLS = (
    b"HTTP/1.0 400 Bad Request\r\nContent-Type: text/plain; charset=utf-8\r\n"
    b"Connection: close\r\n\r\nClient sent an HTTP request to an HTTPS server.\n"
)
_TLS_HANDSHAKE_RECORD = 0x16


def _start_tls(
    sock: socket.socket, tls: TLSContextProvider, peer: _RetAddress
) -> ssl.SSLSocket | None:
    """The connection after a successful handshake, or None (the caller closes `sock`)."""
    sock.settimeout(HANDSHAKE_TIMEOUT_SECONDS)
    try:
        first = sock.recv(1, socket.MSG_PEEK)
        if not first:
            return None
        if first[0] != _TLS_HANDSHAKE_RECORD:
            if first.isalpha():  # a request line: "GET /metrics HTTP/1.1"
                sock.recv(65536)  # read it, so closing does not reset before the answer
                sock.sendall(_PLAIN_HTTP_ON_TLS)
            return None
        conn = tls.context().wrap_socket(sock, server_side=True)
    except OSError as exc:  # ssl.SSLError included: a bad handshake, a missing client cert
        log.debug("TLS connection from %s refused: %s", peer, exc)
        return None
    conn.settimeout(None)  # as plain HTTP connections: blocking
    return conn


def _server_class(
    host: str, port: int, tls: TLSContextProvider | None = None
) -> type[ThreadingWSGIServer]:
    # Pick IPv4 or IPv6 from the address itself, so `[::1]:9445` works as well as 127.0.0.1.
    family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]

    class Server(ThreadingWSGIServer):
        address_family = family

        # A TCP server hands this a socket; the stub's wider type (datagrams too) is not ours.
        def finish_request(  # type: ignore[override]
            self, request: socket.socket, client_address: _RetAddress
        ) -> None:
            # Runs in the connection's thread (ThreadingMixIn), so the handshake does too.
            if tls is None:
                super().finish_request(request, client_address)
                return
            conn = _start_tls(request, tls, client_address)
            if conn is None:
                return
            try:
                super().finish_request(conn, client_address)
            finally:
                # `request` was detached into `conn`: the caller's close cannot reach it.
                self.shutdown_request(conn)

    return Server


def _secured(app: WSGIApplication, config: WebConfig) -> WSGIApplication:
    """`app` behind the config's basic auth, adding its headers to every response."""
    extra = list(config.headers)
    checker = BasicAuthChecker(config.users) if config.users else None

    def secured(environ: WSGIEnvironment, start_response: StartResponse) -> Iterable[bytes]:
        def start(
            status: str, headers: list[tuple[str, str]], exc_info: OptExcInfo | None = None, /
        ) -> Callable[[bytes], object]:
            return start_response(status, [*headers, *extra], exc_info)

        if checker is not None and not checker.check_header(environ.get("HTTP_AUTHORIZATION")):
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

    `web_config` adds TLS, basic auth and headers; without one, plain HTTP as before.
    """

    def __init__(
        self,
        registry: CollectorRegistry,
        host: str,
        port: int,
        web_config: WebConfig | None = None,
    ) -> None:
        writer = TextWriter()

        def metrics_app(environ: WSGIEnvironment, start_response: StartResponse) -> Iterable[bytes]:
            path = environ.get("PATH_INFO", "/")
            if path == "/metrics":
                body = writer.render_registry(registry)
                headers = [("Content-Type", CONTENT_TYPE)]
                if "gzip" in environ.get("HTTP_ACCEPT_ENCODING", ""):
                    body = gzip.compress(body, compresslevel=6)
                    headers.append(("Content-Encoding", "gzip"))
                headers.append(("Content-Length", str(len(body))))
                start_response("200 OK", headers)
                return [body]
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
        self._server = make_server(
            host, port, app, _server_class(host, port, self.tls), handler_class=_QuietHandler
        )
        self.port: int = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, name="http", daemon=True)

    def start(self) -> None:
        """Serve in a background thread."""
        self._thread.start()

    def stop(self) -> None:
        """Stop serving and release the socket."""
        self._server.shutdown()
        self._server.server_close()
