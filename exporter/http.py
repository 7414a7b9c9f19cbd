"""Serving the exporter over HTTP: `/metrics`, a landing page on `/`, 404 elsewhere.

The text format comes from `exporter.exposition` (gzip when the scraper asks for it), served by
`prometheus_client`'s threading WSGI server, so a slow scraper cannot block a second one.
TLS and basic auth from a web config file are planned work (`--web.config.file`).
"""

from __future__ import annotations

import gzip
import socket
import threading
from collections.abc import Iterable
from wsgiref.simple_server import WSGIRequestHandler, make_server
from wsgiref.types import StartResponse, WSGIEnvironment

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import ThreadingWSGIServer

from exporter import __version__
from exporter.exposition import CONTENT_TYPE, TextWriter

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


def _server_class(host: str, port: int) -> type[ThreadingWSGIServer]:
    # Pick IPv4 or IPv6 from the address itself, so `[::1]:9445` works as well as 127.0.0.1.
    family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]

    class Server(ThreadingWSGIServer):
        address_family = family

    return Server


class MetricsServer:
    """A running exporter endpoint; `port` is the bound one (useful with port 0)."""

    def __init__(self, registry: CollectorRegistry, host: str, port: int) -> None:
        writer = TextWriter()

        def app(environ: WSGIEnvironment, start_response: StartResponse) -> Iterable[bytes]:
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

        self._server = make_server(
            host, port, app, _server_class(host, port), handler_class=_QuietHandler
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
