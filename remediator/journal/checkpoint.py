"""The SQLite journal's WAL checkpoints, taken in a thread of their own, off the request path.

In WAL mode a commit appends its pages to the write-ahead log; a *checkpoint* copies them back
into the database file. SQLite's automatic checkpoint runs inside the commit that takes the log
past 1,000 pages: every few dozen new alerts or few hundred duplicates, one webhook's answer
waited while 4 MB were copied and two fsyncs done (5-9 ms instead of about one, bench/webhook.py).

`WalCheckpointer` runs a PASSIVE checkpoint in its own thread every `interval` seconds, and
sooner after `COMMITS` write transactions (a storm writes some 15 pages per admission: about
SQLite's own 1,000 pages a checkpoint). PASSIVE never waits for a lock and never blocks a reader
or a writer (it copies what no reader still needs and stops there;
https://www.sqlite.org/c3ref/wal_checkpoint_v2.html), and the pages' copy is no part of a
commit's durability: a committed transaction is in the log, which is what a crash recovers from.
But SQLite starts the log over only for a writer whose transaction *began* with the log copied
back whole, and transactions go on during the copy: a checkpoint that only ran beside them would
let the log grow for ever. So once the log is `RESTART_PAGES` long, a copy is finished with this
process's writers held back (`hold_writer`, the journal's `WriterLock`), and the next one to
begin starts the log over: the bulk runs beside the commits; the rest (the few frames appended
meanwhile and two fsyncs, about 1 ms: measured, bench/webhook.py) is all a writer may wait for.
Not at every copy: done every 64 commits, that millisecond fell on one webhook answer in 64, more
than the 1 in 100 a p99 may have. A long log costs disk, not reads: a reader skips the frames
already copied back (SQLite's `minFrame`), and the log is written over from its start, not grown.

Connections of a process that runs it keep SQLite's automatic checkpoint, but far out
(`BACKSTOP_PAGES`): should this thread fall behind or die, the log still stops growing.
`serve` starts it (`Services.start`); a journal opened otherwise (`replay`) keeps SQLite's default.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from contextlib import AbstractContextManager

from sqlalchemy.engine import Engine

log = logging.getLogger(__name__)

RESTART_PAGES = 4096  # 16 MB of log at 4 KiB pages; a storm fills it in about a second
BACKSTOP_PAGES = 10_000  # about 40 MB of log: over twice what the thread lets it reach
INTERVAL_SECONDS = 1.0
COMMITS = 64
LOOP_NAME = "journal-checkpoint"


class WalCheckpointer:
    """A thread that checkpoints the journal's WAL every `interval` seconds or `commits` commits."""

    def __init__(
        self,
        engine: Engine,
        hold_writer: Callable[[], AbstractContextManager[object]],
        *,
        interval: float = INTERVAL_SECONDS,
        commits: int = COMMITS,
        restart_pages: int = RESTART_PAGES,
        on_error: Callable[[], None] | None = None,
    ) -> None:
        self._engine = engine
        self._hold_writer = hold_writer
        self._interval = interval
        self._commits_per_checkpoint = commits
        self._restart_pages = restart_pages
        self._on_error = on_error
        self._stop = threading.Event()
        self._due = threading.Event()
        self._commits = 0
        self._thread = threading.Thread(target=self._loop, name=LOOP_NAME, daemon=True)
        self.checkpoints = 0
        """Checkpoints done so far."""
        self.restarts = 0
        """Of those, the ones finished with the writers held back, to start the log over."""

    def start(self) -> None:
        """Checkpoint in the background from now on."""
        self._thread.start()

    def committed(self) -> None:
        """A write transaction committed: after `commits` of them, checkpoint now."""
        # Unlocked: a count off by one only moves a checkpoint by a commit.
        self._commits += 1
        if self._commits >= self._commits_per_checkpoint:
            self._commits = 0
            self._due.set()

    def stop(self, timeout: float = 10.0) -> None:
        """Stop after the checkpoint in flight."""
        self._stop.set()
        self._due.set()
        if self._thread.is_alive():
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        """True while the thread runs (`/healthz`)."""
        return self._thread.is_alive()

    def checkpoint(self) -> tuple[int, int, int]:
        """Copy the log back: (busy, pages in the log, pages copied back), as SQLite says.

        A PASSIVE checkpoint beside the commits; once the log is `restart_pages` long, another
        with this process's writers held back (it copies what they appended meanwhile), so that
        the next writer to begin finds the log copied back whole and starts it over.
        """
        busy, in_log, copied = self._passive()
        if in_log >= self._restart_pages:
            with self._hold_writer():
                busy, in_log, copied = self._passive()
            self.restarts += 1
        self.checkpoints += 1
        return busy, in_log, copied

    def _passive(self) -> tuple[int, int, int]:
        raw = self._engine.raw_connection()
        try:
            # Not in a transaction: the connections are in autocommit (`Database`), and a
            # checkpoint cannot run inside one.
            busy, in_log, copied = raw.driver_connection.execute(  # type: ignore[union-attr]
                "PRAGMA wal_checkpoint(PASSIVE)"
            ).fetchone()
        finally:
            raw.close()
        return int(busy), int(in_log), int(copied)

    def _loop(self) -> None:
        while not self._stop.is_set():
            self._due.wait(self._interval)
            self._due.clear()
            if self._stop.is_set():
                return
            try:
                self.checkpoint()
            except Exception:
                # The thread outlives any failure (a full disk, a database gone for a moment):
                # the next interval tries again, and the backstop bounds the log meanwhile.
                if self._on_error is not None:
                    self._on_error()
                log.exception("journal: WAL checkpoint failed; retried in %g s", self._interval)
