"""What the reliability suites share: many counting model servers on one thread, the
notifications they post, and a read-only look into a SQLite journal.

The test playbooks' side effects land on each server's `/health`, `/restart` and `/verify`,
counted per server, so "no action ran twice for one occurrence" is a count per server when
each occurrence has a server of its own.
"""

from __future__ import annotations

import copy
import json
import selectors
import sqlite3
import sys
import threading
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Iterable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import sqlalchemy as sa

from tests.reliability.strategies import firing_fixture


class _QuietServer(ThreadingHTTPServer):
    def handle_error(self, request: Any, client_address: Any) -> None:
        # A client SIGKILLed mid-request (the crash suite's remediator) is expected here.
        if not isinstance(sys.exc_info()[1], ConnectionError):
            super().handle_error(request, client_address)


class CountingServers:
    """Many model servers' stand-ins on one thread: `CountingServer`'s answers, a port each.

    The roster refuses two servers on one address, so each has its own listener; a selector
    accepts on all of them and each request is answered on a thread of its own, as
    `ThreadingHTTPServer` does. Requests are counted by (server, path).
    """

    def __init__(self, names: Iterable[str]) -> None:
        self.hits: Counter[tuple[str, str]] = Counter()
        self._lock = threading.Lock()
        self._servers: dict[str, _QuietServer] = {}
        outer = self
        for name in names:

            class Handler(BaseHTTPRequestHandler):
                server_name = name

                def do_GET(self) -> None:
                    with outer._lock:
                        outer.hits[(self.server_name, self.path.split("?", 1)[0])] += 1
                    body = b'{"status":"ok"}'
                    self.send_response(200)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)

                def log_message(self, format: str, *args: object) -> None:
                    del format, args

            server = _QuietServer(("127.0.0.1", 0), Handler)
            server.daemon_threads = True
            self._servers[name] = server
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="counting-servers", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        with selectors.DefaultSelector() as selector:
            for server in self._servers.values():
                selector.register(server.socket, selectors.EVENT_READ, server)
            while not self._stop.is_set():
                for key, _ in selector.select(0.05):
                    key.data._handle_request_noblock()

    def urls(self) -> dict[str, str]:
        """Each server's URL, for the roster."""
        return {n: f"http://127.0.0.1:{s.server_address[1]}" for n, s in self._servers.items()}

    def count(self, name: str, path: str) -> int:
        """How many requests reached `path` of server `name`."""
        with self._lock:
            return self.hits[(name, path)]

    def close(self) -> None:
        """Stop serving and close every listener."""
        self._stop.set()
        self._thread.join(5)
        for server in self._servers.values():
            server.server_close()


def notification(
    server: str,
    fingerprint: str,
    *,
    starts: str = "2026-11-30T07:00:00Z",
    status: str = "firing",
    ends: str = "0001-01-01T00:00:00Z",
    group_key: str | None = None,
    host: str = "dioscuri",
) -> dict[str, Any]:
    """An Alertmanager v4 notification of one LlamaServerDown alert on `host`/`server`."""
    payload = copy.deepcopy(firing_fixture())
    payload["status"] = status
    alert = payload["alerts"][0]
    alert["labels"].update(host=host, server=server)
    alert.update(status=status, fingerprint=fingerprint, startsAt=starts, endsAt=ends)
    payload["commonLabels"].update(host=host, server=server)
    if group_key is not None:
        payload["groupKey"] = group_key
    return payload


def post(port: int, token: str | None, body: bytes, *, timeout: float = 30.0) -> int:
    """POST `body` to the webhook of a `serve` process; the HTTP status."""
    headers = {"Content-Type": "application/json"}
    if token is not None:
        headers["Authorization"] = f"Bearer {token}"
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/webhook/alertmanager", data=body, method="POST", headers=headers
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            response.read()
            return int(response.status)
    except urllib.error.HTTPError as error:
        return int(error.code)


def journal_query(path: Path, sql: str, *args: Any) -> list[tuple[Any, ...]]:
    """Rows of a read-only query on the SQLite journal at `path` (the remediator keeps writing)."""
    connection = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=30)
    try:
        return list(connection.execute(sql, args))
    finally:
        connection.close()


def journaled_group_keys(path: Path) -> set[str]:
    """The group keys of every notification the journal admitted (not rejected)."""
    rows = journal_query(path, "SELECT group_key FROM notifications WHERE rejected IS NULL")
    return {str(row[0]) for row in rows}


def dumps(payload: Any) -> bytes:
    """A notification as Alertmanager sends it: compact JSON."""
    return json.dumps(payload).encode()


def journal_rows(url: str, sql: str) -> list[Any]:
    """Rows of a query on a journal (SQLite or PostgreSQL), read outside the remediator."""
    # The remediator names psycopg 3 itself; SQLAlchemy's default PostgreSQL driver is psycopg2.
    engine = sa.create_engine(
        url.replace("postgresql://", "postgresql+psycopg://", 1), poolclass=sa.pool.NullPool
    )
    try:
        with engine.connect() as conn:
            return list(conn.execute(sa.text(sql)))
    finally:
        engine.dispose()
