"""A TCP proxy a test can cut and restore: a database outage without touching the database.

The machine's PostgreSQL is shared by every test and by other sessions: a test must never
restart it. To see the journal lose its database, put this proxy in front (the journal's URL
names the proxy's port), then `cut()` — every open connection is closed and new ones are
refused, as when the database host goes away — and `restore()`.

    with TcpProxy(5432) as proxy:
        url = f"postgresql://postgres@127.0.0.1:{proxy.port}/{name}"
        ...
        proxy.cut()
        ...
        proxy.restore()
"""

from __future__ import annotations

import contextlib
import socket
import threading
from types import TracebackType


class TcpProxy:
    """Forwards 127.0.0.1:`port` (a free one) to 127.0.0.1:`upstream`."""

    def __init__(self, upstream: int) -> None:
        self.upstream = upstream
        self._lock = threading.Lock()
        self._connections: list[socket.socket] = []
        self._listener: socket.socket | None = None
        probe = socket.socket()
        probe.bind(("127.0.0.1", 0))
        self.port = int(probe.getsockname()[1])
        probe.close()
        self.restore()

    def restore(self) -> None:
        """Listen (again) on the same port and forward new connections."""
        listener = socket.socket()
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", self.port))
        listener.listen(64)
        with self._lock:
            self._listener = listener
        threading.Thread(target=self._accept, args=(listener,), daemon=True).start()

    def cut(self) -> None:
        """Close every connection and stop listening: connects are refused until `restore`."""
        with self._lock:
            listener, self._listener = self._listener, None
            connections, self._connections = self._connections, []
        if listener is not None:
            # Closing alone leaves a thread blocked in accept() listening (Linux keeps the
            # socket while the call holds it): the next connect would be taken and reset
            # instead of refused. shutdown() wakes that accept first.
            with contextlib.suppress(OSError):
                listener.shutdown(socket.SHUT_RDWR)
            listener.close()
        for sock in connections:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()

    def close(self) -> None:
        """Cut, for good."""
        self.cut()

    def __enter__(self) -> TcpProxy:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        value: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return  # cut
            try:
                server = socket.create_connection(("127.0.0.1", self.upstream), timeout=5)
            except OSError:
                client.close()
                continue
            server.settimeout(None)
            with self._lock:
                if self._listener is not listener:  # cut meanwhile
                    client.close()
                    server.close()
                    return
                self._connections += [client, server]
            for source, target in ((client, server), (server, client)):
                threading.Thread(target=self._pipe, args=(source, target), daemon=True).start()

    @staticmethod
    def _pipe(source: socket.socket, target: socket.socket) -> None:
        try:
            while data := source.recv(65536):
                target.sendall(data)
        except OSError:
            pass
        finally:
            with contextlib.suppress(OSError):
                target.shutdown(socket.SHUT_WR)
