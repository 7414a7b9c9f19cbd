"""A llama-server stand-in for what the real one cannot do on demand: trickle, or fail with 500.

The real pinned llama-server (tests/llama_lab.py) covers hung (SIGSTOP), killed, loading,
sleeping and router; it cannot be made to send its answer one byte a second (a wedged proxy,
a saturated link) or to answer 500 on every endpoint (a proxy in front of a crashed backend).
This stand-in answers with the recorded captures of the real server
(`tests/fixtures/llama/`: `/health` `{"status":"ok"}`, `/props`, `/metrics`, `/slots` as the
pinned build gives them, with its headers: `Content-Type`, `Content-Length`, keep-alive off),
and a mode:

- `"trickle"`: each answer is sent one byte every `interval` seconds (headers included), so
  no socket timeout ever fires; only a deadline for the whole call bounds it;
- `"error"`: every path answers 500 with llama-server's error body shape.

`paths` limits the mode to those paths (`/metrics` trickling while `/health` answers at once).

It is a plain socket server on 127.0.0.1, port 0, one thread per connection (daemon threads,
ended by `stop()`).
"""

from __future__ import annotations

import contextlib
import socket
import threading
from pathlib import Path
from types import TracebackType
from typing import Literal

FIXTURES = Path(__file__).parent / "fixtures" / "llama"
_BODIES = {
    "/health": (b'{"status":"ok"}', "application/json; charset=utf-8"),
    "/props": ((FIXTURES / "props.json").read_bytes(), "application/json; charset=utf-8"),
    "/metrics": ((FIXTURES / "metrics-idle.txt").read_bytes(), "text/plain; version=0.0.4"),
    "/slots": ((FIXTURES / "slots-idle.json").read_bytes(), "application/json; charset=utf-8"),
}
_ERROR = b'{"error":{"code":500,"message":"stand-in failure","type":"server_error"}}'


class LlamaStandIn:
    """A local server answering like llama-server, slowly (`trickle`) or with 500 (`error`)."""

    def __init__(
        self,
        mode: Literal["trickle", "error"],
        *,
        interval: float = 1.0,
        paths: frozenset[str] | None = None,
    ) -> None:
        self.mode = mode
        self.interval = interval
        self.paths = paths  # the paths the mode applies to (None: all); the others answer at once
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self._stopped = threading.Event()
        self.connections = 0
        self._thread = threading.Thread(target=self._accept, name="llama-stand-in", daemon=True)

    def start(self) -> LlamaStandIn:
        """Start accepting connections."""
        self._thread.start()
        return self

    def __enter__(self) -> LlamaStandIn:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.stop()

    def stop(self) -> None:
        """Stop accepting and end every trickle at its next byte."""
        self._stopped.set()
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)
        self._listener.close()

    def _accept(self) -> None:
        while not self._stopped.is_set():
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return  # the listener was closed by stop()
            self.connections += 1
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            request = b""
            try:
                while b"\r\n\r\n" not in request:
                    chunk = conn.recv(4096)
                    if not chunk:
                        return
                    request += chunk
            except OSError:
                return
            path = request.split(b" ", 2)[1].decode("latin-1").split("?", 1)[0]
            mode = self.mode if self.paths is None or path in self.paths else "plain"
            if mode == "error":
                status, body, kind = "500 Internal Server Error", _ERROR, "application/json"
            elif path in _BODIES:
                body, kind = _BODIES[path]
                status = "200 OK"
            else:
                status, body, kind = "404 Not Found", b"File Not Found", "text/plain"
            raw = (
                f"HTTP/1.1 {status}\r\nContent-Type: {kind}\r\n"
                f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
            ).encode() + body
            try:
                if mode != "trickle":
                    conn.sendall(raw)
                    return
                for byte in raw:
                    if self._stopped.wait(self.interval):
                        return
                    conn.sendall(bytes([byte]))
            except OSError:
                return  # the client gave up (its deadline cut the connection)
