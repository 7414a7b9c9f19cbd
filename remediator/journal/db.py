"""The journal's database: engines, transactions, dialect helpers, errors and storable text.

`Database(url, replica_id=…)` opens SQLite (`sqlite:////var/lib/gpu-fleet/journal.db`, the
embedded default) or PostgreSQL (`postgresql://user@host/db`, for several replicas) and gives
the concern modules (`admission`, `runs`, `rails`, `outbox`, `events`) the one way they touch
it: `_tx(what, body)`, one transaction, retried on a deadlock, every failure raised as
`JournalError` whose message names the operation and the database (never its password).

Writers take the write lock when they begin (SQLite `BEGIN IMMEDIATE`), so a transaction that
reads and then writes never fails half-way on a lock upgrade; `_serialise(conn)` additionally
makes the transaction the only one of its kind fleet-wide on PostgreSQL (a transaction-level
advisory lock), which is how the rails decide "may this act now?" without check-then-act.

This process's SQLite writers queue on `WriterLock`, where a webhook's admission
(`_tx(..., urgent=True)`) goes ahead of the engine's own transactions: Alertmanager waits for
the answer, a worker's claim does not (see the class).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TypeVar

import sqlalchemy as sa
from sqlalchemy import event as sa_event
from sqlalchemy.dialects import postgresql as pg_dialect
from sqlalchemy.dialects import sqlite as sqlite_dialect
from sqlalchemy.engine import URL, Connection, Engine, make_url
from sqlalchemy.pool import StaticPool

from remediator.journal.checkpoint import (
    BACKSTOP_PAGES,
    LOOP_NAME,
    WalCheckpointer,
)
from remediator.journal.checkpoint import COMMITS as CHECKPOINT_COMMITS
from remediator.journal.checkpoint import INTERVAL_SECONDS as CHECKPOINT_INTERVAL_SECONDS
from remediator.journal.checkpoint import RESTART_PAGES as CHECKPOINT_RESTART_PAGES
from remediator.journal.schema import STEP_OUTPUT_MAX_BYTES, NewerSchemaError, upgrade

T = TypeVar("T")
log = logging.getLogger(__name__)

SQLITE_BUSY_TIMEOUT_MS = 10_000
"""How long a SQLite writer waits for another one before failing (the webhook then 5xx)."""

# PostgreSQL: a connection attempt, a row lock and a statement each give up in bounded time,
# so a wedged database turns into a JournalError (and a 5xx Alertmanager retries), not a hang.
# And a replica stopped in the middle of a transaction (SIGSTOP, a frozen VM) loses it after
# 5 s idle, before a blocked writer's 10 s lock_timeout: the server ends that session and frees
# its row and advisory locks, or the other replicas could never take its runs over. None of our
# transactions waits on anything but the database between its statements.
_PG_CONNECT_TIMEOUT_S = 10
_PG_OPTIONS = (
    "-c lock_timeout=10s -c statement_timeout=60s -c idle_in_transaction_session_timeout=5s"
)

# SQLSTATEs after which the whole transaction may simply be run again: serialization_failure
# and deadlock_detected (PostgreSQL, appendix A "Error codes"). Each transaction's body is
# replayable: it reads what it needs inside the transaction.
_RETRY_SQLSTATES = frozenset({"40001", "40P01"})
ATTEMPTS = 3  # tries of a transaction (or of a compare-and-set inside one)

# Any constants: the keys of the advisory locks that serialise schema migrations between
# replicas starting together, and the rails' decisions (both held for one transaction only).
_MIGRATION_LOCK_KEY = 0x6770_7566_6C65_6574  # "gpufleet"
RAILS_LOCK_KEY = 0x6770_7566_7261_696C  # "gpufrail"


class JournalError(Exception):
    """The journal cannot read or write (the webhook answers 5xx so Alertmanager retries)."""


class RunStateError(JournalError):
    """A run is missing, or not in the state the operation needs."""


class ClaimUnread(JournalError):
    """A run was claimed (committed) but could not be read back: the journal went away between.

    `run_id` is the run, now this replica's and claimed, which no worker holds: the engine
    takes it back once the journal answers again.
    """

    def __init__(self, message: str, run_id: int) -> None:
        super().__init__(message)
        self.run_id = run_id


def utcnow() -> datetime:
    """Now, aware UTC: the journal's default clock."""
    return datetime.now(UTC)


def utc(value: datetime) -> datetime:
    """Aware UTC; a naive time is taken as UTC (Alertmanager writes UTC)."""
    return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)


def clean(text: str) -> str:
    """Text a database accepts.

    PostgreSQL refuses NUL in text, and lone surrogates (from output decoded with
    `surrogateescape`) cannot be encoded as UTF-8 at all.
    """
    if "\x00" in text:
        text = text.replace("\x00", "\ufffd")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        text = text.encode("utf-8", errors="replace").decode("utf-8")
    return text


def bound_output(text: str, limit: int = STEP_OUTPUT_MAX_BYTES) -> str:
    """`text` cut to at most `limit` bytes of UTF-8, keeping its head and (most of) its tail.

    The tail is usually where a command says why it failed, the head what it was doing.
    """
    text = clean(text)
    data = text.encode("utf-8")
    if len(data) <= limit:
        return text
    budget = limit - 64  # room for the marker
    head_len = budget // 4
    tail_len = budget - head_len
    cut = len(data) - head_len - tail_len
    # errors="ignore" drops the partial character a byte cut may leave at either edge.
    head = data[:head_len].decode("utf-8", errors="ignore")
    tail = data[len(data) - tail_len :].decode("utf-8", errors="ignore")
    return f"{head}\n… [{cut} bytes cut] …\n{tail}"


class WriterLock:
    """The process's one SQLite writer: admissions first, the engine's writers after.

    SQLite has one writer at a time. A webhook's admission holds it for about a millisecond,
    but a worker's claim or decision, sharing 2 cores and the GIL with the runs it starts,
    can hold it for ten; with a plain FIFO lock an admission also waited for every worker
    transaction queued before it (issue 12's benchmark: a sequential p99 8-15x the floor's).
    Here the holder, when it lets go, hands the lock to the oldest waiting admission, then to
    the oldest other writer. An admission never pre-empts a holder (a transaction is never
    cut short), and no writer starves: one that has waited `patience` seconds goes before
    admissions. The order of the engine's own writers among themselves stays first come,
    first served.
    """

    def __init__(self, patience: float = 0.05) -> None:
        self._mutex = threading.Lock()
        self._patience = patience
        self._held = False
        self._waiting: list[_Waiter] = []

    @contextlib.contextmanager
    def hold(self, *, urgent: bool) -> Iterator[None]:
        """Hold the writer for the block; `urgent`: an admission, which goes first."""
        with self._mutex:
            if not self._held:
                self._held = True
            else:
                # Each waiter sleeps on a condition of its own (all on the one mutex): a hand-over
                # wakes the one writer it chose, not every waiting thread (a storm's 16).
                waiter = _Waiter(time.monotonic(), urgent, threading.Condition(self._mutex))
                self._waiting.append(waiter)
                try:
                    while not waiter.granted:
                        waiter.turn.wait()
                except BaseException:
                    if waiter.granted:  # handed over just now: pass it on
                        self._hand_over()
                    else:
                        self._waiting.remove(waiter)
                    raise
        try:
            yield
        finally:
            with self._mutex:
                self._hand_over()

    def _hand_over(self) -> None:
        # Called with the mutex held, by the holder: the next holder is chosen here, once, so
        # waiters never disagree about whose turn it is.
        if not self._waiting:
            self._held = False
            return
        now = time.monotonic()
        overdue = [w for w in self._waiting if not w.urgent and now - w.since >= self._patience]
        urgent = [w for w in self._waiting if w.urgent]
        chosen = (overdue or urgent or self._waiting)[0]
        self._waiting.remove(chosen)
        chosen.granted = True
        chosen.turn.notify()


class _Waiter:
    __slots__ = ("granted", "since", "turn", "urgent")

    def __init__(self, since: float, urgent: bool, turn: threading.Condition) -> None:
        self.since = since
        self.urgent = urgent
        self.turn = turn
        self.granted = False


class Database:
    """One SQLite or PostgreSQL database, its schema migrated; safe to share between threads.

    `replica_id` names this process among the replicas; `clock` is injected for tests, and
    every time the journal writes comes from it.
    """

    def __init__(
        self,
        url: str,
        *,
        replica_id: str,
        clock: Callable[[], datetime] = utcnow,
    ) -> None:
        self.replica_id = replica_id
        self._clock = clock
        # Only for an in-memory SQLite database, where every thread shares one connection.
        self._serial: threading.Lock | None = None
        # SQLite has one writer at a time anyway; this process's writers queue on a lock of
        # its own instead of SQLite's busy handler, which polls with sleeps of up to 100 ms
        # and turned a burst of concurrent webhooks into a long tail (bench/webhook.py).
        # Writers of other processes (a `replay`, a second replica) still meet busy_timeout.
        self._writer: WriterLock | None = None
        # A file-backed SQLite journal's WAL checkpoints, once `start_checkpointer` is called.
        self._checkpointer: WalCheckpointer | None = None
        try:
            parsed = make_url(url)
        except (sa.exc.ArgumentError, ValueError):
            # The parser's message repeats the URL, password and all: not shown.
            raise JournalError(
                "journal: not a database URL (sqlite:////PATH/journal.db or "
                "postgresql://USER@HOST:PORT/DB)"
            ) from None
        self._password = parsed.password
        self.safe_url = parsed.render_as_string(hide_password=True)
        """The URL with its password hidden, for logs and messages."""
        backend = parsed.get_backend_name()
        if backend == "sqlite":
            self._engine = self._sqlite_engine(parsed)
        elif backend in ("postgresql", "postgres"):
            self._engine = self._postgresql_engine(parsed)
        else:
            raise JournalError(
                f"journal {self.safe_url}: unsupported database {backend!r} (SQLite or PostgreSQL)"
            )
        self._dialect = self._engine.dialect.name
        try:
            self._tx("open the schema", self._open_schema)
        except NewerSchemaError as exc:
            self._engine.dispose()
            raise JournalError(f"journal {self.safe_url}: {exc}") from None
        except JournalError:
            self._engine.dispose()
            raise

    @property
    def dialect(self) -> str:
        """`sqlite` or `postgresql`."""
        return self._dialect

    # -- engines -----------------------------------------------------------------------------

    def _sqlite_engine(self, url: URL) -> Engine:
        database = url.database or ""
        memory = database in ("", ":memory:") or url.query.get("mode") == "memory"
        options: dict[str, Any] = {
            # The web server's threads and the engine's workers share the engine's pool; each
            # connection is used by one thread at a time, which is what SQLite requires.
            "connect_args": {
                "check_same_thread": False,
                "timeout": SQLITE_BUSY_TIMEOUT_MS / 1000,
            },
        }
        if memory:
            # An in-memory database lives in its one connection: share it, one transaction
            # at a time (tests and `replay` only; it is not durable).
            options["poolclass"] = StaticPool
            self._serial = threading.Lock()
        else:
            try:
                Path(database).expanduser().parent.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise JournalError(
                    f"journal {self.safe_url}: cannot create the directory of {database}: "
                    f"{exc.strerror or exc}"
                ) from None
        engine = sa.create_engine(url, **options)
        if not memory:
            self._writer = WriterLock()

        @sa_event.listens_for(engine, "connect")
        def _on_connect(dbapi_connection: Any, connection_record: Any) -> None:
            del connection_record
            # The driver would BEGIN (deferred) on its own before a write; we issue every
            # BEGIN ourselves (below) so writers can say IMMEDIATE.
            dbapi_connection.isolation_level = None
            cursor = dbapi_connection.cursor()
            try:
                # Before journal_mode: switching a new file to WAL needs a moment's lock.
                cursor.execute(f"PRAGMA busy_timeout = {SQLITE_BUSY_TIMEOUT_MS}")
                cursor.execute("PRAGMA journal_mode = WAL")
                # Durability: in WAL mode with synchronous=NORMAL, a committed transaction
                # survives a crash of the *process* (the WAL is in the OS's page cache), but
                # the last ones may roll back after a power loss or OS crash; the database is
                # never corrupted. SQLite's docs (https://www.sqlite.org/pragma.html
                # #pragma_synchronous): "Transactions are durable across application crashes
                # regardless of the synchronous setting or journal mode." That is the promise
                # DESIGN.md makes (durable across a process crash) at a fraction of FULL's
                # fsync per commit; Alertmanager resends what an OS crash loses.
                cursor.execute("PRAGMA synchronous = NORMAL")
                # Per connection, off by default: cascades and SET NULL need it.
                cursor.execute("PRAGMA foreign_keys = ON")
                if self._checkpointer is not None:
                    # The checkpointer copies the WAL back; a commit does so only past this.
                    cursor.execute(f"PRAGMA wal_autocheckpoint = {BACKSTOP_PAGES}")
            finally:
                cursor.close()

        @sa_event.listens_for(engine, "begin")
        def _on_begin(conn: Connection) -> None:
            # A deferred transaction that reads and then writes must upgrade its lock; with
            # two such writers in WAL mode one gets SQLITE_BUSY at once, without waiting
            # (https://www.sqlite.org/lang_transaction.html, "Deferred, Immediate, and
            # Exclusive Transactions"). Writers therefore take the write lock at BEGIN,
            # where busy_timeout applies; readers stay deferred and never block.
            write = conn.get_execution_options().get("journal_write", False)
            conn.exec_driver_sql("BEGIN IMMEDIATE" if write else "BEGIN")

        return engine

    def _postgresql_engine(self, url: URL) -> Engine:
        # SQLAlchemy's default PostgreSQL driver is psycopg2; the project ships psycopg 3.
        if url.drivername in ("postgresql", "postgres"):
            url = url.set(drivername="postgresql+psycopg")
        try:
            return sa.create_engine(
                url,
                # A replica outlives database restarts and fail-overs: test a pooled
                # connection before use instead of failing the next webhook on it.
                pool_pre_ping=True,
                connect_args={
                    "connect_timeout": _PG_CONNECT_TIMEOUT_S,
                    "application_name": f"gpu-fleet-remediator {self.replica_id}"[:63],
                    "options": _PG_OPTIONS,
                },
            )
        except (sa.exc.SQLAlchemyError, ImportError) as exc:
            raise JournalError(f"journal {self.safe_url}: {exc}") from None

    def _open_schema(self, conn: Connection) -> int:
        if self._dialect == "postgresql":
            conn.execute(sa.select(sa.func.pg_advisory_xact_lock(_MIGRATION_LOCK_KEY)))
        version = upgrade(conn, self._clock())
        if self._dialect == "sqlite":
            mode = conn.exec_driver_sql("PRAGMA journal_mode").scalar()
            if mode not in ("wal", "memory"):
                # The durability promise above rests on WAL; say so rather than run without.
                raise JournalError(
                    f"journal {self.safe_url}: SQLite refused WAL mode (journal_mode is "
                    f"{mode!r}); the file system may not support it (a network file system?)"
                )
        return version

    # -- transactions ------------------------------------------------------------------------

    def _tx(
        self,
        what: str,
        body: Callable[[Connection], T],
        *,
        write: bool = True,
        urgent: bool = False,
    ) -> T:
        """Run `body` in one transaction (retried on a deadlock); errors -> JournalError.

        `urgent`: a webhook's admission, which goes ahead of this process's other SQLite
        writers (`WriterLock`).
        """
        for attempt in range(1, ATTEMPTS + 1):
            serial: contextlib.AbstractContextManager[Any] = contextlib.nullcontext()
            if self._serial is not None:
                serial = self._serial
            elif write and self._writer is not None:
                serial = self._writer.hold(urgent=urgent)
            try:
                with serial, self._engine.connect() as conn:
                    conn.execution_options(journal_write=write)
                    with conn.begin():
                        result = body(conn)
                    if write and self._checkpointer is not None:
                        self._checkpointer.committed()
                    return result
            except sa.exc.DBAPIError as exc:
                sqlstate = getattr(exc.orig, "sqlstate", None)
                if sqlstate in _RETRY_SQLSTATES and attempt < ATTEMPTS:
                    continue
                raise self._error(what, exc) from exc
            except (sa.exc.SQLAlchemyError, OSError) as exc:
                raise self._error(what, exc) from exc
        raise AssertionError("unreachable: the last attempt returns or raises")

    def _serialise(self, conn: Connection) -> None:
        """Make this write transaction the only rails decision in flight, fleet-wide.

        SQLite: `BEGIN IMMEDIATE` already holds the database's one write lock. PostgreSQL: a
        transaction-level advisory lock that every rails decision takes first, so counts
        (running runs, runs this hour) and the locks read inside cannot change under it.
        """
        if self._dialect == "postgresql":
            conn.execute(sa.select(sa.func.pg_advisory_xact_lock(RAILS_LOCK_KEY)))

    def _error(self, what: str, exc: BaseException) -> JournalError:
        if isinstance(exc, sa.exc.DBAPIError) and exc.orig is not None:
            # The driver's own words, without SQLAlchemy's echo of the statement.
            detail = f"{type(exc.orig).__name__}: {exc.orig}"
        else:
            detail = f"{type(exc).__name__}: {exc}"
        detail = " ".join(detail.split()) or type(exc).__name__
        if self._password:
            detail = detail.replace(self._password, "***")
        return JournalError(f"journal {self.safe_url}: cannot {what}: {detail}")

    def _insert(self, table: sa.Table) -> Any:
        """An INSERT with `on_conflict_do_nothing/_update` (both dialects spell it alike)."""
        if self._dialect == "postgresql":
            return pg_dialect.insert(table)
        return sqlite_dialect.insert(table)

    def _upsert(self, table: sa.Table, keys: Sequence[str], values: Mapping[str, Any]) -> Any:
        """INSERT … ON CONFLICT (keys) DO UPDATE SET every non-key column given."""
        stmt = self._insert(table).values(**values)
        update = {name: stmt.excluded[name] for name in values if name not in keys}
        return stmt.on_conflict_do_update(index_elements=list(keys), set_=update)

    def start_checkpointer(
        self,
        on_error: Callable[[], None] | None = None,
        *,
        interval: float = CHECKPOINT_INTERVAL_SECONDS,
        commits: int = CHECKPOINT_COMMITS,
        restart_pages: int = CHECKPOINT_RESTART_PAGES,
    ) -> WalCheckpointer | None:
        """Checkpoint a file-backed SQLite journal's WAL in a thread, off the commits' path.

        See `remediator.journal.checkpoint`. Nothing for PostgreSQL or an in-memory journal
        (None). `on_error` counts a failed checkpoint (the thread goes on); `interval` and
        `commits`: a checkpoint at least that often; `restart_pages`: how long the log grows
        before a checkpoint holds the writers back to start it over.
        """
        writer = self._writer  # a file-backed SQLite journal's, and only its
        if writer is None or self._checkpointer is not None:
            return self._checkpointer
        self._checkpointer = WalCheckpointer(
            self._engine,
            lambda: writer.hold(urgent=False),
            interval=interval,
            commits=commits,
            restart_pages=restart_pages,
            on_error=on_error,
        )
        # Connections made from now on carry the backstop (`_on_connect`); the ones pooled
        # before (the schema's, the start-up's) are closed, none being in use yet.
        self._engine.dispose()
        self._checkpointer.start()
        return self._checkpointer

    def loop_states(self) -> dict[str, bool]:
        """The journal's own background loop, when it runs one: alive or not (`/healthz`)."""
        if self._checkpointer is None:
            return {}
        return {LOOP_NAME: self._checkpointer.alive}

    def close(self) -> None:
        """Stop the checkpointer, then close every pooled connection."""
        if self._checkpointer is not None:
            self._checkpointer.stop()
            self._checkpointer = None  # stopped on purpose: not a dead loop
        self._engine.dispose()

    def check_writable(self) -> None:
        """Raise `JournalError` unless a write transaction can begin and commit now (`/healthz`)."""
        self._tx("write (health check)", lambda conn: conn.execute(sa.text("SELECT 1")))
