"""The SQLite journal's WAL checkpoints, taken in a thread of their own, off the request path.

In WAL mode a commit appends its pages to the write-ahead log; a *checkpoint* copies them back
into the database file. SQLite's automatic checkpoint runs inside the commit that takes the log
past 1,000 pages: every few hundred admissions, one webhook's answer waited while 4 MB were
copied and two fsyncs done (5-9 ms instead of about one, bench/webhook.py).

`WalCheckpointer` runs a PASSIVE checkpoint every `interval` seconds on a connection of its own.
PASSIVE never waits for a lock and never blocks a reader or a writer (it copies what no reader
still needs and stops there; https://www.sqlite.org/c3ref/wal_checkpoint_v2.html), and the
pages' copy is no part of a commit's durability: a committed transaction is in the log, which
is what a crash recovers from. Connections of a process that runs it keep SQLite's automatic
checkpoint, but far out (`BACKSTOP_PAGES`): should this thread fall behind or die, the log still
stops growing. `serve` starts it (`Services.start`); `replay` and the tests keep SQLite's default.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from sqlalchemy.engine import Engine

log = logging.getLogger(__name__)

BACKSTOP_PAGES = 10_000  # about 40 MB of log: far beyond what a second of a storm writes
INTERVAL_SECONDS = 1.0
LOOP_NAME = "journal-checkpoint"


class WalCheckpointer:
    """A thread that checkpoints the journal's WAL every `interval` seconds until stopped."""

    def __init__(
        self,
        engine: Engine,
        *,
        interval: float = INTERVAL_SECONDS,
        on_error: Callable[[], None] | None = None,
    ) -> None:
        self._engine = engine
        self._interval = interval
        self._on_error = on_error
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=LOOP_NAME, daemon=True)
        self.checkpoints = 0
        """PASSIVE checkpoints done so far."""

    def start(self) -> None:
        """Checkpoint in the background from now on."""
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Stop after the checkpoint in flight."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        """True while the thread runs (`/healthz`)."""
        return self._thread.is_alive()

    def checkpoint(self) -> tuple[int, int, int]:
        """One PASSIVE checkpoint: (busy, pages in the log, pages copied back), as SQLite says."""
        raw = self._engine.raw_connection()
        try:
            # Not in a transaction: the connections are in autocommit (`Database`), and a
            # checkpoint cannot run inside one.
            busy, in_log, copied = raw.driver_connection.execute(  # type: ignore[union-attr]
                "PRAGMA wal_checkpoint(PASSIVE)"
            ).fetchone()
        finally:
            raw.close()
        self.checkpoints += 1
        return int(busy), int(in_log), int(copied)

    def _loop(self) -> None:
        while not self._stop.wait(self._interval):
            try:
                self.checkpoint()
            except Exception:
                # The thread outlives any failure (a full disk, a database gone for a moment):
                # the next interval tries again, and the backstop bounds the log meanwhile.
                if self._on_error is not None:
                    self._on_error()
                log.exception("journal: WAL checkpoint failed; retried in %g s", self._interval)
