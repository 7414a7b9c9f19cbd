"""A local HTTP server answering with the real llama-server's recorded answers, some changed.

The answers are the pinned build's (tests/fixtures/llama/: `/health`, `/props`, `/metrics`,
`/slots`, with their content types); a test replaces one path's body with what a hostile or
broken server would send (a lone surrogate in `/props`, an 8 MB `/metrics`), which the real
server cannot be made to send. `http.server` on 127.0.0.1, port 0, a thread per request.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import TracebackType

FIXTURES = Path(__file__).parent / "fixtures" / "llama"
JSON = "application/json; charset=utf-8"
TEXT = "text/plain; version=0.0.4"


class RecordedLlama:
    """Serves `bodies` (path without query → (body, content type)) over the recorded ones."""

    def __init__(
        self, bodies: Mapping[str, tuple[bytes, str]] | None = None, *, busy: bool = False
    ):
        state = "busy" if busy else "idle"
        self.bodies: dict[str, tuple[bytes, str]] = {
            "/health": (b'{"status":"ok"}', JSON),
            "/props": ((FIXTURES / "props.json").read_bytes(), JSON),
            "/metrics": ((FIXTURES / f"metrics-{state}.txt").read_bytes(), TEXT),
            "/slots": ((FIXTURES / f"slots-{state}.json").read_bytes(), JSON),
            **(bodies or {}),
        }
        self.hits: dict[str, int] = {}
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                path = self.path.split("?", 1)[0]
                outer.hits[path] = outer.hits.get(path, 0) + 1
                if path not in outer.bodies:
                    self.send_error(404)
                    return
                body, kind = outer.bodies[path]
                self.send_response(200)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                with contextlib.suppress(OSError):  # the client stopped reading (a capped answer)
                    self.wfile.write(body)

            def log_message(self, format: str, *args: object) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def __enter__(self) -> RecordedLlama:
        self._thread.start()
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        self._server.shutdown()
        self._server.server_close()
