"""The bounded HTTP front that the exporter's `/metrics` and the remediator's TLS listener share.

`BoundedWsgiServer` serves any WSGI app: one thread accepts every connection, does its TLS
handshake and reads its request head without blocking, under one deadline per connection
(`READ_TIMEOUT_SECONDS` from accept to the last request byte, handshake included) and a cap on
connections (`MAX_CONNECTIONS`; when full, the one that has waited longest for its head goes);
a few worker threads answer complete requests, with timeouts on every read and write. So idle
connections cost no thread, a slow client (slowloris) is cut at its deadline, and the app
answers while they are open; a slow client cannot block a second one.

TLS comes from `fleet.webconfig` (`TLSContextProvider`, the context re-read when its files
change); what to serve and who may ask is the app's business (`exporter.http`,
`remediator.front`).

Check by hand: `for i in $(seq 300); do exec {fd}<>/dev/tcp/127.0.0.1/9445; done` in one shell,
`curl -s 127.0.0.1:9445/metrics | head -1` in another, and `ls /proc/$(pidof -s python3)/task`.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import io
import logging
import selectors
import socket
import ssl
import threading
import time
from typing import TYPE_CHECKING
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer
from wsgiref.types import WSGIApplication

from fleet.webconfig import HANDSHAKE_TIMEOUT_SECONDS, TLSContextProvider

if TYPE_CHECKING:
    from socket import _RetAddress

    from _typeshed import ReadableBuffer, WriteableBuffer

log = logging.getLogger(__name__)


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

# The front's bounds (the defaults of every server on it). A scrape sends a few hundred bytes
# of request at once; 10 s from the connection's accept to its last request byte is generous
# for it and is the longest an idle or trickling client (slowloris) can hold a connection slot,
# the TLS handshake included. The answer must be taken within its own limit.
READ_TIMEOUT_SECONDS = HANDSHAKE_TIMEOUT_SECONDS
WRITE_TIMEOUT_SECONDS = 30.0
MAX_CONNECTIONS = 256
WORKERS = 4
MAX_HEAD_BYTES = 64 * 1024  # request line and headers (Go's net/http allows 1 MiB, wsgiref 64 KiB)
# An answer up to this size goes out in one write: a host's scrape is tens of KiB.
ANSWER_BUFFER_BYTES = 256 * 1024


class _Pending:
    """A connection whose request head is still arriving, watched by the front's selector."""

    __slots__ = ("deadline", "head", "peer", "sock", "state")

    def __init__(self, sock: socket.socket, peer: _RetAddress, deadline: float, state: str):
        self.sock = sock
        self.peer = peer
        self.deadline = deadline
        self.head = bytearray()
        self.state = state  # "peek" (TLS port, nothing read), "handshake", "head"


class _DeadlineReader(io.RawIOBase):
    """The request's bytes: the head already read, then the socket until the read deadline.

    Each read gets the time that is left, so a body trickling in byte by byte is cut at the
    deadline like a slow head, not after one timeout per byte.
    """

    def __init__(self, sock: socket.socket, head: bytes, deadline: float) -> None:
        self._sock = sock
        self._head = memoryview(head)
        self._deadline = deadline

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: WriteableBuffer) -> int:
        out = memoryview(buffer).cast("B")
        if self._head:
            n = min(len(out), len(self._head))
            out[:n] = self._head[:n]
            self._head = self._head[n:]
            return n
        left = self._deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("the request was not read within its deadline")
        self._sock.settimeout(left)
        return self._sock.recv_into(out)


class _TimedWriter(io.RawIOBase):
    """Writes the answer with `sendall` under a timeout (the total for each write)."""

    def __init__(self, sock: socket.socket, timeout: float) -> None:
        self._sock = sock
        self._timeout = timeout

    def writable(self) -> bool:
        return True

    def write(self, data: ReadableBuffer) -> int:
        self._sock.settimeout(self._timeout)
        self._sock.sendall(data)
        with memoryview(data) as view:
            return view.nbytes


class _Handler(_QuietHandler):
    """wsgiref's handler on a connection the front has read the head of."""

    server: _BoundedServer

    def __init__(self, pending: _Pending, server: _BoundedServer) -> None:
        self._pending = pending  # before the base class's __init__, which runs the request
        super().__init__(pending.sock, pending.peer, server)

    def setup(self) -> None:
        pending = self._pending
        self.connection = pending.sock
        self.rfile = io.BufferedReader(
            _DeadlineReader(pending.sock, bytes(pending.head), pending.deadline)
        )
        # Buffered: wsgiref writes the status line, Date, Server, the other headers and the
        # body one by one, which unbuffered is five sendall calls (five segments for the
        # scraper to read); buffered, an answer up to the buffer's size leaves in one.
        # StreamRequestHandler.finish() flushes it before the socket is shut.
        self.wfile = io.BufferedWriter(
            _TimedWriter(pending.sock, self.server.write_timeout), ANSWER_BUFFER_BYTES
        )


def _close(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.close()


class _BoundedServer(WSGIServer):
    """The bounded HTTP front: one selector thread for every connection's head, a few workers.

    - Accepting, the TLS handshake and reading the request head happen without blocking on one
      thread (`http-front`): an idle or slow client costs a socket, never a thread.
    - A connection must have sent its whole request (head and body) within `read_timeout` of
      being accepted, the TLS handshake included, or it is closed.
    - At most `max_connections` at once; when full, the connection that has waited longest
      for its head is closed to make room, so a flood of idle connections cannot lock a scraper
      out (a scraper sends its request at once).
    - A complete request goes to one of `workers` threads, which runs the WSGI app with the
      socket under timeouts (after a TLS handshake too: never blocking without one).
    """

    request_queue_size = 128  # the listen backlog (socketserver's default is 5)

    def __init__(
        self,
        address: tuple[str, int],
        family: socket.AddressFamily,
        app: WSGIApplication,
        *,
        tls: TLSContextProvider | None,
        read_timeout: float,
        write_timeout: float,
        max_connections: int,
        workers: int,
    ) -> None:
        self.address_family = family
        # The handler class is socketserver's to call; the front builds `_Handler`s itself.
        super().__init__(address, _QuietHandler)
        self.set_app(app)
        self.socket.setblocking(False)
        self.tls = tls
        self.read_timeout = read_timeout
        self.write_timeout = write_timeout
        self.max_connections = max_connections
        self._pending: dict[socket.socket, _Pending] = {}  # the front thread's own
        self._in_flight = 0  # handed to workers, not yet closed
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._selector = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._selector.register(self.socket, selectors.EVENT_READ, "accept")
        self._selector.register(self._wake_r, selectors.EVENT_READ, "wake")
        self._workers = concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="http")

    # -- the front thread -----------------------------------------------------------------

    def run(self) -> None:
        """The front's loop, until `stop()`."""
        try:
            while not self._stopping.is_set():
                for key, events in self._selector.select(self._wait()):
                    del events
                    try:
                        self._event(key.data)
                    except Exception:
                        # A bug met by one connection must not stop the front for all of them.
                        log.exception("HTTP front: %s failed", getattr(key.data, "peer", key.data))
                        if isinstance(key.data, _Pending):
                            self._drop(key.data)
                self._expire()
        finally:
            for pending in list(self._pending.values()):
                self._drop(pending)
            self._selector.close()

    def _event(self, data: object) -> None:
        if isinstance(data, _Pending):
            self._advance(data)
        elif data == "accept":
            self._accept()
        else:  # "wake": stop() was called
            with contextlib.suppress(OSError):
                self._wake_r.recv(64)

    def _wait(self) -> float:
        if not self._pending:
            return 1.0
        soonest = min(p.deadline for p in self._pending.values())
        return max(0.0, min(1.0, soonest - time.monotonic()))

    def _accept(self) -> None:
        while True:
            try:
                sock, peer = self.socket.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # EMFILE and friends: try again on the next wake-up
                log.warning("cannot accept a connection: %s", exc)
                return
            sock.setblocking(False)
            with self._lock:
                full = len(self._pending) + self._in_flight >= self.max_connections
            if full and self._pending:
                # The one that has waited longest for its head (dicts keep accept order).
                self._drop(next(iter(self._pending.values())))
            elif full:
                _close(sock)  # every slot is a request being answered: come back later
                continue
            state = "head" if self.tls is None else "peek"
            pending = _Pending(sock, peer, time.monotonic() + self.read_timeout, state)
            self._pending[sock] = pending
            self._selector.register(sock, selectors.EVENT_READ, pending)

    def _watch(self, pending: _Pending, events: int) -> None:
        self._selector.modify(pending.sock, events, pending)

    def _advance(self, pending: _Pending) -> None:
        try:
            if pending.state == "peek" and not self._peek(pending):
                return
            if pending.state == "handshake":
                assert isinstance(pending.sock, ssl.SSLSocket)
                try:
                    pending.sock.do_handshake()
                except ssl.SSLWantReadError:
                    self._watch(pending, selectors.EVENT_READ)
                    return
                except ssl.SSLWantWriteError:
                    self._watch(pending, selectors.EVENT_WRITE)
                    return
                pending.state = "head"
                self._watch(pending, selectors.EVENT_READ)
            self._read_head(pending)
        except OSError as exc:  # ssl.SSLError included: a bad handshake, a missing client cert
            log.debug("connection from %s closed: %s", pending.peer, exc)
            self._drop(pending)

    def _peek(self, pending: _Pending) -> bool:
        """On a TLS port: start the handshake if the client speaks TLS; False when dropped."""
        first = pending.sock.recv(1, socket.MSG_PEEK)
        if not first or first[0] != _TLS_HANDSHAKE_RECORD:
            if first.isalpha():  # a request line: "GET /metrics HTTP/1.1"
                with contextlib.suppress(OSError):
                    pending.sock.recv(65536)  # read it, so closing does not reset the answer
                    pending.sock.send(_PLAIN_HTTP_ON_TLS)  # small: fits the empty send buffer
            self._drop(pending)
            return False
        assert self.tls is not None
        # wrap_socket detaches the plain socket: watch the TLS one (the same descriptor).
        self._selector.unregister(pending.sock)
        del self._pending[pending.sock]
        pending.sock = self.tls.context().wrap_socket(
            pending.sock, server_side=True, do_handshake_on_connect=False
        )
        pending.state = "handshake"
        self._pending[pending.sock] = pending
        self._selector.register(pending.sock, selectors.EVENT_READ, pending)
        return True

    def _read_head(self, pending: _Pending) -> None:
        while True:
            try:
                chunk = pending.sock.recv(65536)
            except (BlockingIOError, ssl.SSLWantReadError):
                return
            except ssl.SSLWantWriteError:  # a renegotiation wants to write first
                self._watch(pending, selectors.EVENT_WRITE)
                return
            if not chunk:
                self._drop(pending)
                return
            pending.head += chunk
            if b"\r\n\r\n" in pending.head or b"\n\n" in pending.head:
                self._dispatch(pending)
                return
            if len(pending.head) > MAX_HEAD_BYTES:
                log.debug(
                    "connection from %s: request head over %d B", pending.peer, MAX_HEAD_BYTES
                )
                self._drop(pending)
                return

    def _expire(self) -> None:
        now = time.monotonic()
        for pending in [p for p in self._pending.values() if p.deadline <= now]:
            log.debug("connection from %s: no complete request in time", pending.peer)
            self._drop(pending)

    def _forget(self, pending: _Pending) -> None:
        self._pending.pop(pending.sock, None)
        with contextlib.suppress(KeyError, ValueError):
            self._selector.unregister(pending.sock)

    def _drop(self, pending: _Pending) -> None:
        self._forget(pending)
        _close(pending.sock)

    def _dispatch(self, pending: _Pending) -> None:
        self._forget(pending)
        with self._lock:
            self._in_flight += 1
        try:
            self._workers.submit(self._answer, pending)
        except RuntimeError:  # shutting down
            self._done(pending)

    # -- the workers --------------------------------------------------------------------------

    def _answer(self, pending: _Pending) -> None:
        try:
            _Handler(pending, self)
        except OSError as exc:  # the client went away, or was too slow with its body
            log.debug("connection from %s: %s", pending.peer, exc)
        finally:
            self._done(pending)

    def _done(self, pending: _Pending) -> None:
        with contextlib.suppress(OSError):
            pending.sock.shutdown(socket.SHUT_WR)
        _close(pending.sock)
        with self._lock:
            self._in_flight -= 1

    # -- stopping -----------------------------------------------------------------------------

    def stop(self) -> None:
        """Stop the front (after `run` returns, the caller joins its thread), close the rest."""
        self._stopping.set()
        with contextlib.suppress(OSError):
            self._wake_w.send(b"x")

    def close(self) -> None:
        """Release the listening socket and the workers (after the front thread ended)."""
        self._workers.shutdown(wait=True, cancel_futures=True)
        self.server_close()
        _close(self._wake_r)
        _close(self._wake_w)


class BoundedWsgiServer:
    """Any WSGI app behind the bounded front (`_BoundedServer`), on TLS when `tls` is given.

    The exporter's `MetricsServer` and the remediator's TLS listener both serve through it.
    `port` is the bound one (useful with port 0).
    """

    def __init__(
        self,
        app: WSGIApplication,
        host: str,
        port: int,
        *,
        tls: TLSContextProvider | None = None,
        read_timeout_seconds: float = READ_TIMEOUT_SECONDS,
        write_timeout_seconds: float = WRITE_TIMEOUT_SECONDS,
        max_connections: int = MAX_CONNECTIONS,
        workers: int = WORKERS,
    ) -> None:
        # Pick IPv4 or IPv6 from the address itself, so `[::1]:9445` works as well as 127.0.0.1.
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        self._server = _BoundedServer(
            (host, port),
            family,
            app,
            tls=tls,
            read_timeout=read_timeout_seconds,
            write_timeout=write_timeout_seconds,
            max_connections=max_connections,
            workers=workers,
        )
        self.port: int = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.run, name="http-front", daemon=True)

    def start(self) -> None:
        """Serve in a background thread."""
        self._thread.start()

    def serve_forever(self) -> None:
        """Serve in this thread until `stop()` is called from another (or a signal handler)."""
        self._server.run()

    def stop(self) -> None:
        """Stop serving and release the socket."""
        self._server.stop()
        if self._thread.is_alive():
            self._thread.join()
        self._server.close()
