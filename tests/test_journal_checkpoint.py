"""The SQLite journal's WAL checkpoints, moved off the commits' path (`journal/checkpoint.py`).

Real SQLite files under tmp_path. What is asserted is what a user would suffer or lose: a
commit that checkpoints (a webhook's answer waiting for it), a write-ahead log that grows
without end, a loop that dies silently, and a committed admission lost in a crash while its
pages were still only in the log.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import sqlalchemy as sa

from remediator.journal import Journal, schema
from remediator.journal.checkpoint import BACKSTOP_PAGES, LOOP_NAME
from tests.journal_lab import admit, alert
from tests.pg import throwaway_database

ROOT = Path(__file__).resolve().parent.parent


def _autocheckpoint(journal: Journal) -> int:
    with journal._engine.connect() as conn:
        return int(conn.exec_driver_sql("PRAGMA wal_autocheckpoint").scalar_one())


def _wal_pages(path: Path) -> int:
    """Frames in the write-ahead log file (its 32-byte header, then a 24-byte header a frame)."""
    wal = Path(f"{path}-wal")
    size = wal.stat().st_size if wal.exists() else 0
    return max(0, (size - 32) // (4096 + 24))


def _wait_for(condition: Any, what: str, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def test_commits_leave_the_log_to_the_checkpointer(tmp_path: Path) -> None:
    path = tmp_path / "journal.db"
    plain = Journal(f"sqlite:///{path}", replica_id="r1")
    try:
        assert _autocheckpoint(plain) == 1000  # SQLite's default: a commit may checkpoint
    finally:
        plain.close()
    journal = Journal(f"sqlite:///{path}", replica_id="r1")
    try:
        # Never by itself here: neither the interval nor the commits come.
        checkpointer = journal.start_checkpointer(interval=3600, commits=10**9, restart_pages=1000)
        assert checkpointer is not None
        assert _autocheckpoint(journal) == BACKSTOP_PAGES
        for index in range(400):
            admit(journal, alert(f"fp{index}"))
        # With SQLite's default the log would have been copied back (and restarted) past
        # 1,000 pages, inside some admission's commit: here every frame is still in it.
        assert _wal_pages(path) > 1000
        busy, in_log, copied = checkpointer.checkpoint()
        assert (busy, copied) == (0, in_log) and in_log > 1000
        admit(journal, alert("after"))  # the next writer starts the log over
        assert checkpointer.checkpoint()[1] < 50
    finally:
        journal.close()


def test_a_storm_of_commits_brings_the_checkpoint_forward(tmp_path: Path) -> None:
    # A second's storm writes thousands of pages: the thread checkpoints every `commits`
    # commits, so the log is started over soon after it passes `restart_pages` (here 500),
    # never let grow up to the backstop.
    journal = Journal(f"sqlite:///{tmp_path / 'journal.db'}", replica_id="r1")
    try:
        checkpointer = journal.start_checkpointer(interval=3600, commits=20, restart_pages=500)
        assert checkpointer is not None
        for index in range(19):
            admit(journal, alert(f"fp{index}"))
        time.sleep(0.2)
        assert checkpointer.checkpoints == 0
        admit(journal, alert("fp19"))
        _wait_for(lambda: checkpointer.checkpoints == 1, "the checkpoint of the 20th commit")
        for index in range(20, 400):
            admit(journal, alert(f"fp{index}"))
        _wait_for(lambda: checkpointer.checkpoints >= 19, "a checkpoint every 20 commits")
        assert checkpointer.restarts >= 2  # 400 admissions write some 6,000 pages
        assert checkpointer.checkpoint()[1] < 1000
    finally:
        journal.close()


def test_only_a_long_log_holds_the_writers_back(tmp_path: Path) -> None:
    # The copy beside the commits never waits for a writer: only the one that starts a long
    # log over does, so an admission waits for a checkpoint once in thousands of pages, not
    # once every `commits` commits (bench/webhook.py's sequential p99).
    journal = Journal(f"sqlite:///{tmp_path / 'journal.db'}", replica_id="r1")
    writer = journal._writer
    assert writer is not None
    try:
        checkpointer = journal.start_checkpointer(interval=3600, commits=10**9, restart_pages=1000)
        assert checkpointer is not None
        for index in range(20):
            admit(journal, alert(f"short{index}"))
        holding, release = threading.Event(), threading.Event()

        def hold() -> None:
            with writer.hold(urgent=True):  # an admission in the middle of its transaction
                holding.set()
                release.wait(60)  # longer than any wait below: only `release` ends it

        def checkpoint_while_held(
            wait: float,
        ) -> tuple[threading.Thread, threading.Thread, list[tuple[int, int, int]]]:
            """Hold the writer, then checkpoint; the holder, the copier, what it returned."""
            done: list[tuple[int, int, int]] = []
            holding.clear()
            release.clear()
            holder = threading.Thread(target=hold)
            holder.start()
            assert holding.wait(10)
            copier = threading.Thread(target=lambda: done.append(checkpointer.checkpoint()))
            copier.start()
            copier.join(wait)
            return holder, copier, done

        holder, copier, done = checkpoint_while_held(wait=10)
        assert not copier.is_alive() and checkpointer.restarts == 0  # finished beside the writer
        busy, in_log, copied = done[0]
        assert (busy, copied) == (0, in_log) and 0 < in_log < 1000
        release.set()
        holder.join(10)
        for index in range(100):
            admit(journal, alert(f"long{index}"))
        holder, copier, done = checkpoint_while_held(wait=0.5)
        assert copier.is_alive() and not done  # a log past 1,000 pages: it waits for the writer
        release.set()
        copier.join(10)
        holder.join(10)
        assert done and checkpointer.restarts == 1
        admit(journal, alert("after"))  # the next writer starts the log over
        assert checkpointer.checkpoint()[1] < 50
    finally:
        release.set()
        journal.close()


def test_the_checkpointer_runs_by_itself_and_survives_a_failure(tmp_path: Path) -> None:
    journal = Journal(f"sqlite:///{tmp_path / 'journal.db'}", replica_id="r1")
    errors: list[int] = []
    engine = journal._engine
    failures = [OSError("disk gone for a moment")]

    class Flaky:
        """The journal's engine, as the checkpointer sees it: its first connection fails."""

        def raw_connection(self) -> Any:
            if failures:
                raise failures.pop()
            return engine.raw_connection()

    try:
        admit(journal, alert("a"))
        checkpointer = journal.start_checkpointer(lambda: errors.append(1), interval=0.05)
        assert checkpointer is not None
        checkpointer._engine = Flaky()  # type: ignore[assignment]
        _wait_for(lambda: checkpointer.checkpoints >= 2, "two checkpoints after the failure")
        assert errors == [1] and journal.loop_states() == {LOOP_NAME: True}
        with engine.connect() as conn:
            busy, in_log, copied = conn.exec_driver_sql("PRAGMA wal_checkpoint(PASSIVE)").one()
        assert (busy, copied) == (0, in_log)  # nothing left that the loop did not copy
    finally:
        journal.close()
    assert journal.loop_states() == {}  # stopped on purpose: not reported as a dead loop


def test_no_checkpointer_for_postgresql_or_memory() -> None:
    with throwaway_database() as url:
        for where in (url, "sqlite://"):
            journal = Journal(where, replica_id="r1")
            try:
                assert journal.start_checkpointer() is None and journal.loop_states() == {}
            finally:
                journal.close()


def test_a_crash_loses_no_admission_still_only_in_the_log(tmp_path: Path) -> None:
    # A process that admitted and died before any checkpoint (SIGKILL: no close, no final
    # copy): what it answered 200 for is in the journal when it is opened again.
    path = tmp_path / "journal.db"
    child = textwrap.dedent(
        f"""
        import os, signal, sys
        sys.path.insert(0, {str(ROOT)!r})
        from remediator.journal import Journal
        from tests.journal_lab import admit, alert
        journal = Journal({f"sqlite:///{path}"!r}, replica_id="r1")
        journal.start_checkpointer(interval=3600, commits=10**9)
        for index in range(300):
            admit(journal, alert(f"fp{{index}}"))
        print("admitted", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", child], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.stdout.strip() == "admitted" and done.returncode == -9, done.stderr
    assert _wal_pages(path) > 1000  # the admissions were only in the log
    journal = Journal(f"sqlite:///{path}", replica_id="r1")
    try:
        with journal._engine.connect() as conn:
            count = conn.execute(sa.select(sa.func.count()).select_from(schema.runs)).scalar()
        assert count == 300
    finally:
        journal.close()
