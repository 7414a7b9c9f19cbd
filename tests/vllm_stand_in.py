"""A stand-in for a vLLM server, for tests: vLLM itself needs a GPU and cannot run here.

It is a small threaded `http.server` on 127.0.0.1, port 0 (the kernel picks), and it mimics what
the exporter reads from a real `vllm serve` (OpenAI-compatible API server, v1 engine):

- `GET /health`: 200 with an empty body, as vLLM answers while its engine is alive (503 once
  the engine died: `answer_status("/health", 503)`).
- `GET /metrics`: the Prometheus text of a recorded fixture (`tests/fixtures/vllm/`), with the
  content type prometheus_client's `make_asgi_app` serves it with. The file is read on every
  request, so a test may edit it, or point the stand-in at another, between scrapes.
- Any other path: 404 `{"detail":"Not Found"}`, as FastAPI answers.

And the ways a real server fails the exporter must survive:

- `api_key=`: `/metrics` answers 401 `{"error":"Unauthorized"}` without
  `Authorization: Bearer KEY`. (vLLM's own `--api-key` guards only `/v1/*`; a key on
  `/metrics` is what a reverse proxy in front of it enforces. This mimics that proxy, with
  vLLM's 401 body.)
- `hang(*paths)`: accept the connection and never answer until `release()`, like a process
  stopped with SIGSTOP or an event loop wedged in a long call: the kernel still accepts.
- `trickle(*paths)`: send the answer a byte at a time, each byte sooner than a socket timeout
  notices, until `release()`: a wedged proxy that only an overall deadline bounds.
- `answer_status(path, status)`: answer that status instead (500, or 404 for no `/metrics`).
- `stop()`: close the listener; connections are then refused, as when the process is gone.
"""

from __future__ import annotations

import sys
import threading
from dataclasses import dataclass
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import TracebackType
from typing import Any
from urllib.parse import urlsplit

# What prometheus_client's exposition serves to a client that accepts `*/*` (text format 0.0.4).
METRICS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
TRICKLE_INTERVAL_SECONDS = 0.1


@dataclass(frozen=True)
class Seen:
    """One request the stand-in received."""

    path: str
    authorization: str | None


class VllmStandIn:
    """A local HTTP server that answers like vLLM's `/health` and `/metrics`."""

    def __init__(self, metrics_file: Path, *, api_key: str | None = None) -> None:
        self._lock = threading.Lock()
        self._metrics_file = metrics_file
        self._metrics_text: str | None = None
        self._api_key = api_key
        self._statuses: dict[str, int] = {}
        self._hanging: set[str] = set()
        self._trickling: set[str] = set()
        self._released = threading.Event()
        self._seen: list[Seen] = []
        self._stopped = False
        self._server = _Server(("127.0.0.1", 0), _Handler)
        self._server.stand_in = self
        # A short poll interval: stop() waits for the serving loop to notice, every test.
        self._thread = threading.Thread(
            target=self._server.serve_forever, args=(0.05,), name="vllm-stand-in", daemon=True
        )
        self._thread.start()

    @property
    def url(self) -> str:
        """The base URL, as the roster would name the server."""
        host, port = self._server.server_address[:2]
        return f"http://{host!s}:{port}"

    @property
    def seen(self) -> list[Seen]:
        """The requests received so far, oldest first."""
        with self._lock:
            return list(self._seen)

    def serve_metrics_file(self, path: Path) -> None:
        """Answer `/metrics` with this file from now on (read on every request)."""
        with self._lock:
            self._metrics_file, self._metrics_text = path, None

    def serve_metrics_text(self, text: str) -> None:
        """Answer `/metrics` with this text from now on."""
        with self._lock:
            self._metrics_text = text

    def answer_status(self, path: str, status: int | None) -> None:
        """Answer `path` with `status` (and a short JSON error) instead; None to undo."""
        with self._lock:
            if status is None:
                self._statuses.pop(path, None)
            else:
                self._statuses[path] = status

    def hang(self, *paths: str) -> None:
        """Accept requests to `paths` (all paths when none) and answer nothing until release."""
        with self._lock:
            self._released.clear()
            self._hanging.update(paths or ("*",))

    def trickle(self, *paths: str) -> None:
        """Answer requests to `paths` (all when none) one byte at a time until release."""
        with self._lock:
            self._released.clear()
            self._trickling.update(paths or ("*",))

    def release(self) -> None:
        """End every hang and trickle: waiting requests are answered in full at once."""
        with self._lock:
            self._hanging.clear()
            self._trickling.clear()
            self._released.set()

    def stop(self) -> None:
        """Close the listener: new connections are refused from now on."""
        with self._lock:
            if self._stopped:
                return
            self._stopped = True
        self.release()
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)

    def __enter__(self) -> VllmStandIn:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    # Called from the handler threads.

    def _arrived(self, path: str, authorization: str | None) -> str:
        """Record a request; how to answer it: "hang", "trickle" or "" (at once)."""
        with self._lock:
            self._seen.append(Seen(path, authorization))
            if path in self._hanging or "*" in self._hanging:
                return "hang"
            if path in self._trickling or "*" in self._trickling:
                return "trickle"
            return ""

    def _answer(self, path: str, authorization: str | None) -> tuple[int, str, bytes]:
        """Status, content type and body for a GET of `path`."""
        with self._lock:
            status = self._statuses.get(path)
            text, metrics_file, api_key = self._metrics_text, self._metrics_file, self._api_key
        if status is not None:
            return status, "application/json", b'{"error":"stand-in status"}'
        if path == "/health":
            return 200, "application/json", b""
        if path == "/metrics":
            if api_key is not None and authorization != f"Bearer {api_key}":
                return 401, "application/json", b'{"error":"Unauthorized"}'
            body = text if text is not None else metrics_file.read_text(encoding="utf-8")
            return 200, METRICS_CONTENT_TYPE, body.encode()
        return 404, "application/json", b'{"detail":"Not Found"}'


class _Server(ThreadingHTTPServer):
    # Hung handler threads must not keep the test process alive or block server_close().
    daemon_threads = True
    stand_in: VllmStandIn

    def handle_error(self, request: Any, client_address: Any) -> None:
        # A client that gave up (the exporter's timeout) makes our late write fail; that is the
        # scenario under test, not an error worth a traceback on stderr. Anything else is.
        if not isinstance(sys.exc_info()[1], ConnectionError):
            super().handle_error(request, client_address)


class _Handler(BaseHTTPRequestHandler):
    server: _Server

    def do_GET(self) -> None:
        stand_in = self.server.stand_in
        path = urlsplit(self.path).path
        authorization = self.headers.get("Authorization")
        mode = stand_in._arrived(path, authorization)
        if mode == "hang":
            stand_in._released.wait()
        status, content_type, body = stand_in._answer(path, authorization)
        if mode == "trickle":
            self._trickle(_raw_response(status, content_type, body), stand_in._released)
            return
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _trickle(self, raw: bytes, released: threading.Event) -> None:
        try:
            for index in range(len(raw)):
                self.wfile.write(raw[index : index + 1])
                self.wfile.flush()
                if released.wait(TRICKLE_INTERVAL_SECONDS):
                    self.wfile.write(raw[index + 1 :])
                    return
        except OSError:
            return  # the client gave up

    def log_message(self, format: str, *args: Any) -> None:
        """Keep test output quiet."""


def _raw_response(status: int, content_type: str, body: bytes) -> bytes:
    head = (
        f"HTTP/1.0 {status} {HTTPStatus(status).phrase}\r\n"
        f"Content-Type: {content_type}\r\nContent-Length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body
