"""A small HTTP client for reading model servers (llama-server, vLLM), bounded as a whole call.

Every call returns an `Answer` instead of raising: the collectors need to tell "refused" (the
process is gone) from "timed out" (it is alive but busy, or hung) from "answered with an error
status", because those mean different things for llama-server (DESIGN.md, the llama-server
facts). TLS verification stays on for `https://` URLs.

`timeout` bounds the *whole* call (connect, headers and body), not each socket read: a server
that sends one byte a second never trips a socket timeout, so a `Watchdog` (one thread for all
calls) shuts the socket down at the call's deadline, which wakes the blocked read at once.
`exporter.sources.bounded` builds the rest of the bound on top (one call in flight per lane,
a fixed number of workers).

Check by hand: `curl -m 2 -s -o /dev/null -w '%{http_code} %{time_total}' URL/health`.
"""

from __future__ import annotations

import contextlib
import heapq
import http.client
import itertools
import socket
import ssl
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from urllib.parse import urlsplit

USER_AGENT = "gpu-fleet-exporter"
MAX_BODY_BYTES = 8 * 1024 * 1024  # /slots of a many-slot server is the largest answer we read
"""The default and the largest cap on an answer's body; each endpoint sets its own below it."""


class Outcome(Enum):
    """How a call ended."""

    ANSWERED = "answered"  # an HTTP status came back (any status)
    TIMEOUT = "timeout"  # connected (or connecting) but no whole answer within the timeout
    REFUSED = "refused"  # nothing listens: connection refused or reset before an answer
    ERROR = "error"  # anything else: DNS, TLS, a malformed or oversized answer


@dataclass(frozen=True)
class Answer:
    """The result of one call: `status` and `body` are set only when `outcome` is ANSWERED."""

    outcome: Outcome
    status: int = 0
    body: bytes = b""
    detail: str = ""

    @property
    def ok(self) -> bool:
        """True for a 200 answer."""
        return self.outcome is Outcome.ANSWERED and self.status == 200


def read_secret(path: Path | None) -> str | None:
    """A secret from a file (its whole content, stripped of surrounding whitespace).

    None without a path.

    Raises `OSError` when the file cannot be read, so the caller can say which file.
    """
    if path is None:
        return None
    return path.read_text(encoding="utf-8").strip()


@dataclass(order=True)
class _Ticket:
    """One watched socket; ordered by deadline for the watchdog's heap."""

    deadline: float
    seq: int
    sock: socket.socket | None = field(compare=False, default=None)
    expired: bool = field(compare=False, default=False)
    released: bool = field(compare=False, default=False)


class Watchdog:
    """One daemon thread that shuts down each watched socket when its call's deadline passes.

    `shutdown(SHUT_RDWR)` (not `close()`) is what wakes a thread blocked in `recv()` on Linux;
    the call then sees the ticket expired and reports a timeout. The thread starts with the
    first watched call and waits on a condition, so an idle watchdog costs nothing.
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._cond = threading.Condition()
        self._heap: list[_Ticket] = []
        self._seq = itertools.count()
        self._thread: threading.Thread | None = None
        self._closed = False

    def watch(self, sock: socket.socket, deadline: float) -> _Ticket:
        """Cut `sock` at `deadline` unless `release()`d first."""
        ticket = _Ticket(deadline, next(self._seq), sock)
        with self._cond:
            heapq.heappush(self._heap, ticket)
            if self._thread is None and not self._closed:
                self._thread = threading.Thread(target=self._run, name="http-watchdog", daemon=True)
                self._thread.start()
            self._cond.notify()
        return ticket

    def release(self, ticket: _Ticket) -> bool:
        """Stop watching; True when the deadline had already cut the socket."""
        with self._cond:
            ticket.released = True
            ticket.sock = None
            return ticket.expired

    def close(self) -> None:
        """Stop the thread (sockets still watched are cut by their own socket timeout)."""
        with self._cond:
            self._closed = True
            self._cond.notify()

    def _run(self) -> None:
        with self._cond:
            while not self._closed:
                while self._heap and self._heap[0].released:
                    heapq.heappop(self._heap)
                if not self._heap:
                    self._cond.wait()
                    continue
                first = self._heap[0]
                wait = first.deadline - self.clock()
                if wait > 0:
                    self._cond.wait(wait)
                    continue
                heapq.heappop(self._heap)
                first.expired = True
                if first.sock is not None:
                    # OSError: already closed by the call itself, nothing left to cut.
                    with contextlib.suppress(OSError):
                        first.sock.shutdown(socket.SHUT_RDWR)


def call(
    url: str,
    *,
    timeout: float,
    watchdog: Watchdog,
    method: str = "GET",
    body: bytes | None = None,
    headers: dict[str, str] | None = None,
    ssl_context: ssl.SSLContext | None = None,
    max_bytes: int = MAX_BODY_BYTES,
) -> Answer:
    """One HTTP request, finished or cut within `timeout` seconds; never raises for the network.

    A body over `max_bytes` is an ERROR answer: what is past the cap is never read.
    """
    deadline = watchdog.clock() + timeout
    parts = urlsplit(url)
    path = parts.path or "/"
    if parts.query:
        path += "?" + parts.query
    conn: http.client.HTTPConnection
    try:
        host, port = parts.hostname or "", parts.port
    except ValueError as exc:  # a port that is not a number: the roster normally stops it
        return Answer(Outcome.ERROR, detail=f"bad URL {url!r}: {exc}")
    # The socket timeout still bounds the connect (before there is a socket to watch).
    if parts.scheme == "https":
        context = ssl_context or ssl.create_default_context()
        conn = http.client.HTTPSConnection(host, port, timeout=timeout, context=context)
    else:
        conn = http.client.HTTPConnection(host, port, timeout=timeout)
    send_headers = {"User-Agent": USER_AGENT, "Accept": "*/*", **(headers or {})}
    ticket: _Ticket | None = None
    late = Answer(Outcome.TIMEOUT, detail=f"no whole answer within {timeout:g} s")
    try:
        conn.connect()
        if conn.sock is not None:
            ticket = watchdog.watch(conn.sock, deadline)
        conn.request(method, path, body=body, headers=send_headers)
        response = conn.getresponse()
        data = response.read(max_bytes + 1)
        if ticket is not None and watchdog.release(ticket):
            return late  # the cut may have ended the read early: the body is incomplete
        if len(data) > max_bytes:
            return Answer(Outcome.ERROR, detail=f"answer larger than {max_bytes} bytes")
        return Answer(Outcome.ANSWERED, response.status, data)
    except TimeoutError:
        return late
    except (ConnectionRefusedError, ConnectionResetError, BrokenPipeError) as exc:
        if ticket is not None and watchdog.release(ticket):
            return late
        return Answer(Outcome.REFUSED, detail=f"{type(exc).__name__}: {exc}")
    except (OSError, http.client.HTTPException, ValueError) as exc:
        # ssl.SSLError is an OSError; RemoteDisconnected and IncompleteRead are HTTPExceptions
        # (also what a read cut by the watchdog raises).
        if ticket is not None and watchdog.release(ticket):
            return late
        return Answer(Outcome.ERROR, detail=f"{type(exc).__name__}: {exc}")
    finally:
        if ticket is not None:
            watchdog.release(ticket)
        conn.close()
