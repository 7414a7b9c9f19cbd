"""The journal: the remediator's durable state, shared by every replica through one database.

`Journal(url, replica_id=…)` opens SQLite (`sqlite:////var/lib/gpu-fleet/journal.db`, the
embedded default) or PostgreSQL (`postgresql://user@host/db`, for several replicas), creates
or migrates the schema, and offers one method per thing the webhook, the engine and the web
app need. Each method is one short transaction; everything replicas must agree on (dedupe,
claims, locks, cooldowns, breakers, pause, maintenance) is decided by the database — by a
unique key or a conditional UPDATE whose row count says who won — never by process memory.

Run states: `pending` (journaled, waiting) -> `claimed` (a replica's worker owns it) ->
`running` (its steps execute) -> `done`; `decide()` takes a pending or claimed run straight
to `done` (it will not execute), `requeue()` gives a claimed run back.

Events the journal writes itself: `paused`, `resumed`, `maintenance_on`, `maintenance_off`,
`interrupted` (a run cut short by a restart) and `lock_takeover` (an expired lock taken).

Reports for Zulip join the `outbox` in the transaction that journals what they tell
(`finish_run`, `decide`, `record_breaker_outcome`, `recover_interrupted`, and a resolution
through the `resolved_reports` hook); the sender (`remediator.notify.sender`) takes them out
in order per topic, under a lease (`take_lease`) that only one replica holds at a time.

Every database or file-system failure is raised as `JournalError`, whose message names the
operation and the database (never its password); the webhook answers 5xx on it so that
Alertmanager retries. `RunStateError`, a `JournalError`, says a run was not in the state an
operation needs (a bug in the caller, or a run already finished).
"""

from __future__ import annotations

import contextlib
import logging
import sqlite3
import threading
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, TypeVar

import sqlalchemy as sa
from sqlalchemy import event as sa_event
from sqlalchemy.dialects import postgresql as pg_dialect
from sqlalchemy.dialects import sqlite as sqlite_dialect
from sqlalchemy.engine import URL, Connection, Engine, make_url
from sqlalchemy.pool import StaticPool

from remediator.alerts import Alert, Notification, PayloadError, parse_notification
from remediator.journal.schema import (
    STEP_OUTPUT_MAX_BYTES,
    NewerSchemaError,
    UTCDateTime,
    alerts,
    breakers,
    cooldowns,
    current_version,
    events,
    locks,
    maintenance,
    notifications,
    outbox,
    runs,
    settings,
    steps,
    upgrade,
)

T = TypeVar("T")

SQLITE_BUSY_TIMEOUT_MS = 10_000
"""How long a SQLite writer waits for another one before failing (the webhook then 5xx)."""

# PostgreSQL: a connection attempt, a row lock and a statement each give up in bounded time,
# so a wedged database turns into a JournalError (and a 5xx Alertmanager retries), not a hang.
_PG_CONNECT_TIMEOUT_S = 10
_PG_OPTIONS = "-c lock_timeout=10s -c statement_timeout=60s"

# SQLSTATEs after which the whole transaction may simply be run again: serialization_failure
# and deadlock_detected (PostgreSQL, appendix A "Error codes"). Each method's body is
# replayable: it reads what it needs inside the transaction.
_RETRY_SQLSTATES = frozenset({"40001", "40P01"})
log = logging.getLogger(__name__)
_ATTEMPTS = 3

# Any constant: the key of the advisory lock that serialises schema migrations between
# replicas starting together (held for the migrating transaction only).
_MIGRATION_LOCK_KEY = 0x6770_7566_6C65_6574  # "gpufleet"

_CLAIM_ATTEMPTS = 20


class JournalError(Exception):
    """The journal cannot read or write (the webhook answers 5xx so Alertmanager retries)."""


class RunStateError(JournalError):
    """A run is missing, or not in the state the operation needs."""


@dataclass(frozen=True)
class AlertRecord:
    """One alert occurrence: identity (fingerprint, starts_at)."""

    id: int
    fingerprint: str
    starts_at: datetime
    status: str
    alertname: str
    labels: dict[str, str]
    annotations: dict[str, str]
    generator_url: str
    first_seen: datetime
    last_seen: datetime
    resolved_at: datetime | None


@dataclass(frozen=True)
class StepRecord:
    """One step of a run, as last written."""

    index: int
    action: str
    params: dict[str, Any]
    started_at: datetime
    finished_at: datetime | None
    result: str
    output: str


@dataclass(frozen=True)
class RunRecord:
    """One run: what an alert caused, with the alert and its steps."""

    id: int
    alert: AlertRecord
    state: str
    decision: str | None
    reason: str
    playbook: str | None
    target: str | None
    owner: str | None
    created_at: datetime
    claimed_at: datetime | None
    started_at: datetime | None
    finished_at: datetime | None
    outcome: str | None
    verification: str | None
    steps: list[StepRecord]


@dataclass(frozen=True)
class RecordResult:
    """What `record_notification` did."""

    new_run_ids: list[int]
    duplicates: int
    resolved: int
    notification_id: int


@dataclass(frozen=True)
class BreakerState:
    """The circuit breaker of one (target, playbook)."""

    open: bool
    failures: int
    window_start: datetime | None
    opened_at: datetime | None


@dataclass(frozen=True)
class QueuedReport:
    """A report for the outbox: a message in `topic` of the stream, or a direct message.

    `recipients` (e-mail addresses) make it a direct message; `topic` then only orders it
    among the reports of its story. `graph` (`{"query", "start", "end"}`) asks the sender for
    a picture of the metric, drawn and uploaded when the report is sent.
    """

    topic: str
    content: str
    recipients: tuple[str, ...] | None = None
    graph: Mapping[str, Any] | None = None


ReportLike = QueuedReport | tuple[str, str]
"""A report to queue: a `QueuedReport`, or `(topic, content)` for a plain stream message."""


@dataclass(frozen=True)
class OutboxEntry:
    """One report in the outbox, as last written."""

    id: int
    created_at: datetime
    topic: str
    content: str
    run_id: int | None
    state: str
    attempts: int
    next_attempt_at: datetime
    sent_at: datetime | None
    zulip_message_id: int | None
    recipients: tuple[str, ...] | None
    graph: dict[str, Any] | None
    picture: str | None
    owner: str | None
    last_error: str | None


@dataclass(frozen=True)
class Event:
    """A journaled event (pause, maintenance, escalation, interruption …)."""

    id: int
    at: datetime
    kind: str
    run_id: int | None
    playbook: str | None
    target: str | None
    detail: str


def _utcnow() -> datetime:
    return datetime.now(UTC)


def _utc(value: datetime) -> datetime:
    """Aware UTC; a naive time from a payload is taken as UTC (Alertmanager writes UTC)."""
    return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)


def _clean(text: str) -> str:
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
    text = _clean(text)
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


def _ended_at(alert: Alert, now: datetime) -> datetime:
    """When a resolved alert ended: Alertmanager's `endsAt`, unless it is missing or bogus."""
    if alert.endsAt is not None and _utc(alert.endsAt) > _utc(alert.startsAt):
        return _utc(alert.endsAt)
    return now


class Journal:
    """The remediator's durable state in SQLite or PostgreSQL; safe to share between threads.

    `replica_id` names this process among the replicas (claims and locks record it, and
    `recover_interrupted` takes back only its own runs): it must be stable across restarts of
    the same replica and unique among live ones. `clock` is injected for tests; every time the
    journal writes comes from it.
    """

    def __init__(
        self,
        url: str,
        *,
        replica_id: str,
        retention: timedelta = timedelta(days=30),
        clock: Callable[[], datetime] = _utcnow,
    ) -> None:
        self.replica_id = replica_id
        self.retention = retention
        self._clock = clock
        self.resolved_reports: Callable[[RunRecord], Sequence[ReportLike]] | None = None
        """Reports that close the story of an alert that resolved, given its newest run.

        Called inside the transaction that marks the alert resolved (so the closing report
        is queued exactly when the resolution is journaled); only for alerts that had a run.
        It must not block: it renders text, nothing more.
        """
        # Only for an in-memory SQLite database, where every thread shares one connection.
        self._serial: threading.Lock | None = None
        # The webhook's own SQLite connections, one per web server thread, kept out of the pool
        # (see _accept_sqlite); all of them, to close with the journal.
        self._accept_local = threading.local()
        self._accept_connections: list[Any] = []
        self._accept_lock = threading.Lock()
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
        # The webhook path's statements, built once: SQLAlchemy then only binds values
        # (building a statement per call cost more than the database's own work on SQLite).
        self._add_notification = sa.insert(notifications).returning(notifications.c.id)
        self._add_alert = (
            self._insert(alerts)
            .on_conflict_do_nothing(index_elements=["fingerprint", "starts_at"])
            .returning(alerts.c.id)
        )
        self._add_run = sa.insert(runs).returning(runs.c.id)
        self._touch_alert = (
            sa.update(alerts)
            .where(
                alerts.c.fingerprint == sa.bindparam("b_fingerprint"),
                alerts.c.starts_at == sa.bindparam("b_starts_at", type_=UTCDateTime()),
            )
            .values(last_seen=sa.bindparam("b_now", type_=UTCDateTime()))
        )
        try:
            self._version = self._tx("open the schema", self._open_schema)
        except NewerSchemaError as exc:
            self._engine.dispose()
            raise JournalError(f"journal {self.safe_url}: {exc}") from None
        except JournalError:
            self._engine.dispose()
            raise

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
                # #pragma_synchronous): "WAL mode is always consistent with
                # synchronous=NORMAL, but WAL mode does lose durability. A transaction
                # committed in WAL mode with synchronous=NORMAL might roll back following a
                # power loss or system crash. Transactions are durable across application
                # crashes regardless of the synchronous setting or journal mode." That is the
                # promise DESIGN.md makes (durable across a process crash) at a fraction of
                # FULL's fsync per commit; Alertmanager resends what an OS crash loses.
                cursor.execute("PRAGMA synchronous = NORMAL")
                # Per connection, off by default: cascades and SET NULL need it.
                cursor.execute("PRAGMA foreign_keys = ON")
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

    def _tx(self, what: str, body: Callable[[Connection], T], *, write: bool = True) -> T:
        """Run `body` in one transaction (retried on a deadlock); errors -> JournalError."""
        serial = self._serial if self._serial is not None else contextlib.nullcontext()
        for attempt in range(1, _ATTEMPTS + 1):
            try:
                with serial, self._engine.connect() as conn:
                    conn.execution_options(journal_write=write)
                    with conn.begin():
                        return body(conn)
            except sa.exc.DBAPIError as exc:
                sqlstate = getattr(exc.orig, "sqlstate", None)
                if sqlstate in _RETRY_SQLSTATES and attempt < _ATTEMPTS:
                    continue
                raise self._error(what, exc) from exc
            except (sa.exc.SQLAlchemyError, OSError) as exc:
                raise self._error(what, exc) from exc
        raise AssertionError("unreachable: the last attempt returns or raises")

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

    def close(self) -> None:
        """Close every pooled connection, and the webhook's own."""
        with self._accept_lock:
            kept, self._accept_connections = self._accept_connections, []
        for connection in kept:
            with contextlib.suppress(Exception):
                connection.close()
        self._engine.dispose()

    def schema_version(self) -> int:
        """The schema version the database holds."""
        return self._tx("read the schema version", current_version, write=False)

    # -- the webhook path --------------------------------------------------------------------

    def accept_notification(self, notification: Notification, raw: bytes) -> int:
        """Journal a validated webhook body: one INSERT, the webhook's whole cost before 200.

        The notification is durable once this returns (SQLite: WAL, synchronous=NORMAL). Its
        alerts and runs are made by `ingest_pending` right after, in this replica; a crash in
        between loses nothing, the next start ingests it.
        """
        now = self._clock()
        values = {
            "received_at": now,
            "group_key": _clean(notification.groupKey),
            "receiver": _clean(notification.receiver),
            "raw": _clean(raw.decode("utf-8", errors="replace")),
            "replica": self.replica_id,
        }

        if self._dialect == "sqlite":
            return self._accept_sqlite(values)

        def body(conn: Connection) -> int:
            return int(conn.execute(self._add_notification, values).scalar_one())

        return self._tx("accept a notification", body)

    # Through the driver itself: the webhook's hot path. SQLAlchemy's execution machinery
    # costs ~120 µs per statement here, more than SQLite's own insert and commit (~10 µs), and
    # this one INSERT is all that stands between Alertmanager and its 200 (bench/webhook.py).
    _ACCEPT_SQL = (
        "INSERT INTO notifications (received_at, group_key, receiver, raw, replica) "
        "VALUES (?, ?, ?, ?, ?)"
    )

    def _accept_sqlite(self, values: Mapping[str, Any]) -> int:
        received = values["received_at"].astimezone(UTC).replace(tzinfo=None)
        params = (
            # SQLAlchemy's SQLite DateTime text form, so UTCDateTime reads it back alike.
            received.strftime("%Y-%m-%d %H:%M:%S.%f"),
            values["group_key"],
            values["receiver"],
            values["raw"],
            values["replica"],
        )
        if self._serial is not None:  # in-memory: the one shared connection, from the pool
            try:
                with self._serial:
                    connection = self._engine.raw_connection()
                    try:
                        new_id = self._insert_notification(connection, params)
                    finally:
                        connection.close()  # back to the pool
            except (sqlite3.Error, sa.exc.SQLAlchemyError, OSError) as exc:
                raise self._error("accept a notification", exc) from exc
        else:
            # A connection of this thread's own, kept between requests: the pool's checkout
            # and checkin cost about as much as the INSERT itself. Dropped on any error, so
            # the next request starts from a fresh one.
            own: Any = getattr(self._accept_local, "connection", None)
            try:
                if own is None:
                    own = self._engine.raw_connection()
                    own.detach()  # this thread's for good; not counted in the pool
                    self._accept_local.connection = own
                    with self._accept_lock:
                        self._accept_connections.append(own)
                new_id = self._insert_notification(own, params)
            except (sqlite3.Error, sa.exc.SQLAlchemyError, OSError) as exc:
                self._drop_accept_connection()
                raise self._error("accept a notification", exc) from exc
        if new_id is None:
            raise JournalError(f"journal {self.safe_url}: cannot accept a notification: no id")
        return int(new_id)

    def _insert_notification(self, connection: Any, params: tuple[Any, ...]) -> int | None:
        """The INSERT, committed on its own (the connection is in autocommit mode, _on_connect).

        One statement is its own transaction in SQLite: it takes the write lock (waiting up to
        busy_timeout) and commits when it ends, with no BEGIN and COMMIT round trips.
        """
        cursor = connection.cursor()
        try:
            cursor.execute(self._ACCEPT_SQL, params)
            new_id: int | None = cursor.lastrowid
            return new_id
        finally:
            cursor.close()

    def _drop_accept_connection(self) -> None:
        connection = getattr(self._accept_local, "connection", None)
        self._accept_local.connection = None
        if connection is None:
            return
        with self._accept_lock:
            if connection in self._accept_connections:
                self._accept_connections.remove(connection)
        with contextlib.suppress(Exception):
            connection.close()

    def ingest_pending(self, limit: int = 500) -> RecordResult:
        """Turn this replica's accepted, not yet ingested notifications into alerts and runs.

        One transaction for the whole batch: under a burst (an HA pair resending a group) one
        commit serves hundreds of notifications, and the webhook's own INSERTs wait less.
        """
        now = self._clock()

        def body(conn: Connection) -> RecordResult:
            # Claim the batch in one statement: a second ingester (a replay beside the
            # server) then finds nothing left of it.
            pending = (
                sa.select(notifications.c.id)
                .where(
                    notifications.c.ingested_at.is_(None),
                    notifications.c.replica == self.replica_id,
                )
                .order_by(notifications.c.id)
                .limit(limit)
                .scalar_subquery()
            )
            claimed = sorted(
                conn.execute(
                    sa.update(notifications)
                    .where(notifications.c.id.in_(pending), notifications.c.ingested_at.is_(None))
                    .values(ingested_at=now)
                    .returning(notifications.c.id, notifications.c.raw)
                ).all()
            )
            new_run_ids: list[int] = []
            duplicates = resolved = 0
            last = 0
            # Resends are byte-identical (repeat intervals, the HA twin): within a batch, a
            # body seen before can only be duplicates again, so it is not parsed twice.
            seen: dict[str, int] = {}
            for notification_id, raw in claimed:
                last = int(notification_id)
                if raw in seen:
                    duplicates += seen[raw]
                    continue
                try:
                    notification = parse_notification(str(raw).encode())
                except PayloadError as exc:
                    # Valid when accepted; one that no longer parses is kept for a human.
                    log.error("notification %d cannot be ingested: %s", notification_id, exc)
                    continue
                result = self._record_alerts(conn, notification, last, now)
                seen[raw] = sum(1 for a in notification.alerts if a.status == "firing")
                new_run_ids += result.new_run_ids
                duplicates += result.duplicates
                resolved += result.resolved
            return RecordResult(new_run_ids, duplicates, resolved, last)

        return self._tx("ingest notifications", body)

    def record_notification(self, notification: Notification, raw: bytes) -> RecordResult:
        """Journal a notification and make its alerts and runs at once (one transaction).

        Per alert: firing and new (fingerprint, startsAt) -> the alert and a `pending` run;
        firing and known -> a duplicate (last_seen updated); resolved -> that occurrence
        (else the newest open one with its fingerprint) is marked resolved, nothing starts.
        A resolved alert never seen firing is journaled resolved, so a late or retried
        firing of the same occurrence is a duplicate and starts nothing.
        """
        now = self._clock()
        raw_text = _clean(raw.decode("utf-8", errors="replace"))

        def body(conn: Connection) -> RecordResult:
            notification_id = conn.execute(
                self._add_notification,
                {
                    "received_at": now,
                    "group_key": _clean(notification.groupKey),
                    "receiver": _clean(notification.receiver),
                    "raw": raw_text,
                    "replica": self.replica_id,
                    "ingested_at": now,
                },
            ).scalar_one()
            return self._record_alerts(conn, notification, int(notification_id), now)

        return self._tx("record a notification", body)

    def _record_alerts(
        self, conn: Connection, notification: Notification, notification_id: int, now: datetime
    ) -> RecordResult:
        # Sorted, so two replicas journaling the same group take the unique-index entries in
        # the same order and cannot deadlock on PostgreSQL.
        ordered = sorted(notification.alerts, key=lambda a: (a.fingerprint, _utc(a.startsAt)))
        new_run_ids: list[int] = []
        duplicates = resolved = 0
        for alert in ordered:
            if alert.status == "firing":
                alert_id = self._insert_alert(conn, alert, notification_id, now)
                if alert_id is None:
                    conn.execute(
                        self._touch_alert,
                        {
                            "b_fingerprint": _clean(alert.fingerprint),
                            "b_starts_at": _utc(alert.startsAt),
                            "b_now": now,
                        },
                    )
                    duplicates += 1
                    continue
                run_id = conn.execute(
                    self._add_run,
                    {"alert_id": alert_id, "state": "pending", "reason": "", "created_at": now},
                ).scalar_one()
                new_run_ids.append(int(run_id))
            elif self._resolve(conn, alert, notification_id, now):
                resolved += 1
        return RecordResult(new_run_ids, duplicates, resolved, notification_id)

    @staticmethod
    def _occurrence(alert: Alert) -> tuple[sa.ColumnElement[bool], ...]:
        return (
            alerts.c.fingerprint == _clean(alert.fingerprint),
            alerts.c.starts_at == _utc(alert.startsAt),
        )

    def _insert_alert(
        self,
        conn: Connection,
        alert: Alert,
        notification_id: int,
        now: datetime,
        *,
        resolved_at: datetime | None = None,
    ) -> int | None:
        """Insert an occurrence unless (fingerprint, starts_at) exists; its id, or None.

        ON CONFLICT DO NOTHING, not check-then-insert: when two replicas insert the same
        occurrence at once, the unique index makes the second wait for the first and then
        insert nothing, so exactly one of them starts a run.
        """
        values = {
            "fingerprint": _clean(alert.fingerprint),
            "starts_at": _utc(alert.startsAt),
            "status": "firing" if resolved_at is None else "resolved",
            "alertname": _clean(alert.alertname),
            "labels": alert.labels,
            "annotations": alert.annotations,
            "generator_url": _clean(alert.generatorURL),
            "first_seen": now,
            "last_seen": now,
            "resolved_at": resolved_at,
            "notification_id": notification_id,
        }
        found = conn.execute(self._add_alert, values).scalar_one_or_none()
        return None if found is None else int(found)

    def _resolve(self, conn: Connection, alert: Alert, notification_id: int, now: datetime) -> bool:
        """Mark an occurrence resolved; True when an alert became resolved."""
        ended = _ended_at(alert, now)
        closing = {"status": "resolved", "resolved_at": ended, "last_seen": now}
        exact = sa.update(alerts).where(*self._occurrence(alert), alerts.c.status == "firing")
        closed = conn.execute(exact.values(closing).returning(alerts.c.id)).scalar()
        if closed is not None:
            self._queue_closing_reports(conn, int(closed), now)
            return True
        known = conn.execute(sa.select(alerts.c.id).where(*self._occurrence(alert))).first()
        if known is not None:  # already resolved: a resend
            conn.execute(sa.update(alerts).where(alerts.c.id == known.id).values(last_seen=now))
            return False
        # Not this startsAt (a restarted Prometheus may restamp it): the newest open
        # occurrence with this fingerprint.
        newest_open = (
            sa.select(alerts.c.id)
            .where(alerts.c.fingerprint == _clean(alert.fingerprint), alerts.c.status == "firing")
            .order_by(alerts.c.starts_at.desc(), alerts.c.id.desc())
            .limit(1)
            .scalar_subquery()
        )
        fallback = sa.update(alerts).where(alerts.c.id == newest_open, alerts.c.status == "firing")
        closed = conn.execute(fallback.values(closing).returning(alerts.c.id)).scalar()
        if closed is not None:
            self._queue_closing_reports(conn, int(closed), now)
            return True
        tombstone = self._insert_alert(conn, alert, notification_id, now, resolved_at=ended)
        if tombstone is not None:
            return True  # never seen firing: no run, nothing was reported, nothing to close
        # A concurrent transaction inserted the firing occurrence just now (we waited for
        # it on the unique index): it is committed and visible to this new statement.
        closed = conn.execute(exact.values(closing).returning(alerts.c.id)).scalar()
        if closed is not None:
            self._queue_closing_reports(conn, int(closed), now)
            return True
        return False

    def _queue_closing_reports(self, conn: Connection, alert_id: int, now: datetime) -> None:
        hook = self.resolved_reports
        if hook is None:
            return
        newest = self._select_runs(conn, runs.c.alert_id == alert_id, limit=1)
        if not newest:
            return
        try:
            reports = list(hook(newest[0]))
        except Exception:
            # A bug in rendering must not refuse the resolution (Alertmanager would retry the
            # whole notification forever); the story stays open in Zulip, the log says why.
            log.exception("cannot render the closing report of alert %d", alert_id)
            return
        for report in reports:
            self._enqueue(conn, report, newest[0].id, now)

    # -- the engine path ---------------------------------------------------------------------

    def claim_next_run(self) -> RunRecord | None:
        """Take the oldest pending run (pending -> claimed by this replica); None if none.

        A conditional UPDATE (… WHERE state = 'pending') whose row count says whether this
        replica won; a loser tries the next candidate. On PostgreSQL the candidate is read
        with FOR UPDATE SKIP LOCKED, so concurrent claimers do not even queue on one row; on
        SQLite the write transaction (BEGIN IMMEDIATE) already serialises them.
        """
        now = self._clock()

        def body(conn: Connection) -> RunRecord | None:
            for _ in range(_CLAIM_ATTEMPTS):
                candidate = conn.execute(
                    sa.select(runs.c.id)
                    .where(runs.c.state == "pending")
                    .order_by(runs.c.id)
                    .limit(1)
                    .with_for_update(skip_locked=True)
                ).scalar_one_or_none()
                if candidate is None:
                    return None
                won = conn.execute(
                    sa.update(runs)
                    .where(runs.c.id == candidate, runs.c.state == "pending")
                    .values(state="claimed", owner=self.replica_id, claimed_at=now)
                ).rowcount
                if won == 1:
                    return self._select_runs(conn, runs.c.id == candidate)[0]
            return None

        return self._tx("claim a run", body)

    def _transition(
        self,
        conn: Connection,
        run_id: int,
        from_states: Sequence[str],
        values: Mapping[str, Any],
        what: str,
    ) -> None:
        """Move a run between states with a conditional UPDATE, or raise RunStateError."""
        changed = conn.execute(
            sa.update(runs)
            .where(runs.c.id == run_id, runs.c.state.in_(from_states))
            .values(**values)
        ).rowcount
        if changed == 1:
            return
        state = conn.execute(sa.select(runs.c.state).where(runs.c.id == run_id)).scalar()
        if state is None:
            raise RunStateError(f"cannot {what}: there is no run {run_id}")
        raise RunStateError(
            f"cannot {what}: run {run_id} is {state}, not {' or '.join(from_states)}"
        )

    def decide(
        self,
        run_id: int,
        decision: str,
        reason: str,
        *,
        playbook: str | None = None,
        target: str | None = None,
        reports: Sequence[ReportLike] = (),
    ) -> None:
        """A run that will not execute (notify-only, paused, cooldown …): state `done`.

        `reports` join the outbox in the same transaction (see `finish_run`).
        """
        now = self._clock()
        values: dict[str, Any] = {
            "state": "done",
            "decision": decision,
            "reason": _clean(reason),
            "finished_at": now,
        }
        if playbook is not None:
            values["playbook"] = playbook
        if target is not None:
            values["target"] = target

        def body(conn: Connection) -> None:
            for report in reports:
                self._enqueue(conn, report, run_id, now)
            # After the reports: a run in the wrong state rolls them back with it.
            self._transition(conn, run_id, ("pending", "claimed"), values, f"decide run {run_id}")

        self._tx("decide a run", body)

    def requeue(self, run_id: int, reason: str) -> None:
        """Give a claimed run back (claimed -> pending), keeping `reason` on it."""
        values = {"state": "pending", "owner": None, "claimed_at": None, "reason": _clean(reason)}
        self._tx(
            "requeue a run",
            lambda conn: self._transition(
                conn, run_id, ("claimed",), values, f"requeue run {run_id}"
            ),
        )

    def try_lock(self, target: str, run_id: int, ttl: timedelta) -> bool:
        """Take the lock on `target` for `run_id` until now + `ttl`; False if another holds it.

        One holder per target across replicas: an INSERT that the primary key lets only one
        replica make. An expired lock (its holder died without releasing it) is taken over
        with a compare-and-set UPDATE on the holder seen, so two replicas cannot both take it.
        The same run asking again renews its lock. `heartbeat()` renews it too.
        """

        def body(conn: Connection) -> bool:
            for _ in range(_ATTEMPTS):
                now = self._clock()
                held = {
                    "run_id": run_id,
                    "owner": self.replica_id,
                    "acquired_at": now,
                    "expires_at": now + ttl,
                    "ttl_seconds": ttl.total_seconds(),
                }
                inserted = conn.execute(
                    self._insert(locks)
                    .values(target=target, **held)
                    .on_conflict_do_nothing(index_elements=["target"])
                    .returning(locks.c.target)
                ).first()
                if inserted is not None:
                    return True
                current = conn.execute(sa.select(locks).where(locks.c.target == target)).first()
                if current is None:
                    continue  # released between our INSERT and SELECT: try again
                mine = current.run_id == run_id
                if not mine and current.expires_at > now:
                    return False
                taken = conn.execute(
                    sa.update(locks)
                    .where(
                        locks.c.target == target,
                        locks.c.run_id == current.run_id,
                        locks.c.owner == current.owner,
                        locks.c.expires_at == current.expires_at,
                    )
                    .values(**held)
                ).rowcount
                if not taken:
                    continue  # someone else changed it first: look again
                if not mine:
                    self._add_event(
                        conn,
                        "lock_takeover",
                        f"lock on {target} of run {current.run_id} ({current.owner}) expired "
                        f"at {current.expires_at:%F %T}Z; taken by run {run_id} "
                        f"({self.replica_id})",
                        run_id=run_id,
                        target=target,
                    )
                return True
            return False

        return self._tx("take a lock", body)

    def release_lock(self, target: str, run_id: int) -> None:
        """Release `target`'s lock if `run_id` holds it (a no-op otherwise)."""
        self._tx(
            "release a lock",
            lambda conn: conn.execute(
                sa.delete(locks).where(locks.c.target == target, locks.c.run_id == run_id)
            ),
        )

    def start_run(
        self,
        run_id: int,
        *,
        playbook: str,
        target: str,
        decision: str = "run",
        reason: str = "",
    ) -> None:
        """A claimed run starts executing: state `running`, started_at, heartbeat_at."""
        now = self._clock()
        values = {
            "state": "running",
            "playbook": playbook,
            "target": target,
            "decision": decision,
            "reason": _clean(reason),
            "started_at": now,
            "heartbeat_at": now,
        }
        self._tx(
            "start a run",
            lambda conn: self._transition(
                conn, run_id, ("claimed",), values, f"start run {run_id}"
            ),
        )

    def heartbeat(self, run_id: int) -> None:
        """A running run is alive: heartbeat_at, and its locks renewed for their ttl.

        A no-op for a run no longer running (the heartbeat may tick once after it finished).
        """
        now = self._clock()

        def body(conn: Connection) -> None:
            alive = conn.execute(
                sa.update(runs)
                .where(runs.c.id == run_id, runs.c.state == "running")
                .values(heartbeat_at=now)
            ).rowcount
            if not alive:
                return
            held = conn.execute(
                sa.select(locks.c.target, locks.c.ttl_seconds).where(locks.c.run_id == run_id)
            ).all()
            for target, ttl_seconds in held:
                conn.execute(
                    sa.update(locks)
                    .where(locks.c.target == target, locks.c.run_id == run_id)
                    .values(expires_at=now + timedelta(seconds=ttl_seconds))
                )

        self._tx("heartbeat a run", body)

    def record_step(
        self,
        run_id: int,
        index: int,
        action: str,
        params: Mapping[str, Any],
        *,
        started_at: datetime,
        finished_at: datetime | None,
        result: str,
        output: str,
    ) -> None:
        """Write a step (by run and index): when it starts (result `running`) and when it ends.

        The output is cut to `STEP_OUTPUT_MAX_BYTES` (64 KiB) of UTF-8, head and tail kept.
        """
        stmt = self._upsert(
            steps,
            ("run_id", "idx"),
            {
                "run_id": run_id,
                "idx": index,
                "action": action,
                "params": dict(params),
                "started_at": started_at,
                "finished_at": finished_at,
                "result": result,
                "output": bound_output(output),
            },
        )
        self._tx("record a step", lambda conn: conn.execute(stmt))

    def finish_run(
        self,
        run_id: int,
        *,
        outcome: str,
        verification: str,
        reports: Sequence[ReportLike] = (),
    ) -> None:
        """A run ends (claimed or running -> done) with its outcome.

        `reports` (topic, content) join the outbox in the same transaction, so a finished
        run always has its reports queued and a report never tells of a run the journal lost.
        """
        now = self._clock()

        def body(conn: Connection) -> None:
            for report in reports:
                self._enqueue(conn, report, run_id, now)
            # After the reports: a run in the wrong state rolls them back with it.
            self._transition(
                conn,
                run_id,
                ("claimed", "running"),
                {
                    "state": "done",
                    "finished_at": now,
                    "outcome": outcome,
                    "verification": _clean(verification),
                },
                f"finish run {run_id}",
            )

        self._tx("finish a run", body)

    # -- cooldowns and breakers --------------------------------------------------------------

    def cooldown_until(self, target: str, playbook: str) -> datetime | None:
        """The end of the last cooldown set (even if it has passed); None if never set."""
        found: datetime | None = self._tx(
            "read a cooldown",
            lambda conn: conn.execute(
                sa.select(cooldowns.c.until).where(
                    cooldowns.c.target == target, cooldowns.c.playbook == playbook
                )
            ).scalar_one_or_none(),
            write=False,
        )
        return found

    def set_cooldown(self, target: str, playbook: str, until: datetime) -> None:
        """Set the cooldown of (target, playbook) to end at `until`."""
        stmt = self._upsert(
            cooldowns,
            ("target", "playbook"),
            {"target": target, "playbook": playbook, "until": until},
        )
        self._tx("set a cooldown", lambda conn: conn.execute(stmt))

    def breaker(self, target: str, playbook: str) -> BreakerState:
        """The breaker of (target, playbook); closed with no failures if never used."""
        row = self._tx(
            "read a breaker",
            lambda conn: conn.execute(
                sa.select(breakers).where(
                    breakers.c.target == target, breakers.c.playbook == playbook
                )
            ).first(),
            write=False,
        )
        if row is None:
            return BreakerState(open=False, failures=0, window_start=None, opened_at=None)
        return BreakerState(
            open=row.state == "open",
            failures=row.failures,
            window_start=row.window_start,
            opened_at=row.opened_at,
        )

    def record_breaker_outcome(
        self,
        target: str,
        playbook: str,
        *,
        healed: bool,
        max_failures: int,
        window: timedelta,
        on_open: Sequence[ReportLike] = (),
        run_id: int | None = None,
    ) -> bool:
        """Count a run's outcome; True when this call opened the breaker.

        `on_open` (the escalation's reports, of run `run_id`) join the outbox in the same
        transaction, only when this call opens the breaker.

        Not healed: counted in the current window, or starts a new window when the old one
        (window_start + window) has passed; the `max_failures`-th in one window opens the
        breaker. Healed: the count starts again. An open breaker stays open whatever comes
        (only `reset_breaker`, a person's decision, closes it).
        """

        def body(conn: Connection) -> bool:
            now = self._clock()
            key = (breakers.c.target == target, breakers.c.playbook == playbook)
            conn.execute(
                self._insert(breakers)
                .values(target=target, playbook=playbook, state="closed", failures=0)
                .on_conflict_do_nothing(index_elements=["target", "playbook"])
            )
            # FOR UPDATE: two replicas counting at once must not both read the same count.
            row = conn.execute(sa.select(breakers).where(*key).with_for_update()).one()
            if row.state == "open":
                return False
            if healed:
                conn.execute(sa.update(breakers).where(*key).values(failures=0, window_start=None))
                return False
            if row.window_start is None or now - row.window_start >= window:
                failures, window_start = 1, now
            else:
                failures, window_start = row.failures + 1, row.window_start
            opening = failures >= max_failures
            conn.execute(
                sa.update(breakers)
                .where(*key)
                .values(
                    failures=failures,
                    window_start=window_start,
                    state="open" if opening else "closed",
                    opened_at=now if opening else None,
                )
            )
            if opening:
                for report in on_open:
                    self._enqueue(conn, report, run_id, now)
            return opening

        return self._tx("record a breaker outcome", body)

    def reset_breaker(self, target: str, playbook: str) -> None:
        """Close the breaker of (target, playbook) and forget its failures."""
        self._tx(
            "reset a breaker",
            lambda conn: conn.execute(
                sa.delete(breakers).where(
                    breakers.c.target == target, breakers.c.playbook == playbook
                )
            ),
        )

    def open_breakers(self) -> list[tuple[str, str, datetime]]:
        """Every open breaker: (target, playbook, opened_at), oldest first."""
        rows = self._tx(
            "read the open breakers",
            lambda conn: conn.execute(
                sa.select(breakers.c.target, breakers.c.playbook, breakers.c.opened_at)
                .where(breakers.c.state == "open")
                .order_by(breakers.c.opened_at, breakers.c.target, breakers.c.playbook)
            ).all(),
            write=False,
        )
        return [(row.target, row.playbook, row.opened_at) for row in rows]

    # -- events, pause, maintenance ----------------------------------------------------------

    def _add_event(
        self,
        conn: Connection,
        kind: str,
        detail: str,
        *,
        run_id: int | None = None,
        playbook: str | None = None,
        target: str | None = None,
    ) -> int:
        return int(
            conn.execute(
                sa.insert(events)
                .values(
                    at=self._clock(),
                    kind=kind,
                    run_id=run_id,
                    playbook=playbook,
                    target=target,
                    detail=_clean(detail),
                )
                .returning(events.c.id)
            ).scalar_one()
        )

    def add_event(
        self,
        kind: str,
        detail: str,
        *,
        run_id: int | None = None,
        playbook: str | None = None,
        target: str | None = None,
    ) -> int:
        """Journal an event; its id."""
        return self._tx(
            "add an event",
            lambda conn: self._add_event(
                conn, kind, detail, run_id=run_id, playbook=playbook, target=target
            ),
        )

    def events(self, *, kind: str | None = None, limit: int = 100) -> list[Event]:
        """The newest events first (only those of `kind` if given)."""
        query = sa.select(events).order_by(events.c.id.desc()).limit(limit)
        if kind is not None:
            query = query.where(events.c.kind == kind)
        rows = self._tx("read events", lambda conn: conn.execute(query).all(), write=False)
        return [
            Event(
                id=row.id,
                at=row.at,
                kind=row.kind,
                run_id=row.run_id,
                playbook=row.playbook,
                target=row.target,
                detail=row.detail,
            )
            for row in rows
        ]

    def paused(self) -> bool:
        """True while all remediation is paused (fleet-wide)."""
        value = self._tx(
            "read the pause",
            lambda conn: conn.execute(
                sa.select(settings.c.value).where(settings.c.key == "paused")
            ).scalar_one_or_none(),
            write=False,
        )
        return value == "true"

    def set_paused(self, paused: bool, *, by: str, reason: str = "") -> None:
        """Pause or resume all remediation; journaled as a `paused`/`resumed` event."""
        kind = "paused" if paused else "resumed"
        detail = f"remediation {kind} by {by}" + (f": {reason}" if reason else "")

        def body(conn: Connection) -> None:
            value = "true" if paused else "false"
            conn.execute(self._upsert(settings, ("key",), {"key": "paused", "value": value}))
            self._add_event(conn, kind, detail)

        self._tx("set the pause", body)

    def maintenance(self) -> dict[str, tuple[datetime, str]]:
        """Hosts in maintenance: host -> (since, reason)."""
        rows = self._tx(
            "read maintenance",
            lambda conn: conn.execute(sa.select(maintenance)).all(),
            write=False,
        )
        return {row.host: (row.since, row.reason) for row in rows}

    def set_maintenance(self, host: str, on: bool, *, by: str, reason: str = "") -> None:
        """Put a host in maintenance or take it out; journaled as `maintenance_on`/`_off`.

        Turning it on again updates the reason but keeps `since`.
        """
        kind = "maintenance_on" if on else "maintenance_off"
        state = "in maintenance" if on else "out of maintenance"
        detail = f"host {host} {state} by {by}" + (f": {reason}" if reason else "")

        def body(conn: Connection) -> None:
            if on:
                stmt = self._insert(maintenance).values(
                    host=host, since=self._clock(), reason=_clean(reason), by=by
                )
                conn.execute(
                    stmt.on_conflict_do_update(
                        index_elements=["host"],
                        set_={"reason": stmt.excluded.reason, "by": stmt.excluded.by},
                    )
                )
            else:
                conn.execute(sa.delete(maintenance).where(maintenance.c.host == host))
            self._add_event(conn, kind, detail, target=host)

        self._tx("set maintenance", body)

    # -- counts ------------------------------------------------------------------------------

    def _count(self, what: str, *where: sa.ColumnElement[bool]) -> int:
        query = sa.select(sa.func.count()).select_from(runs).where(*where)
        return int(self._tx(what, lambda conn: conn.execute(query).scalar_one(), write=False))

    def count_running(self) -> int:
        """Runs executing now, fleet-wide (every replica)."""
        return self._count("count running runs", runs.c.state == "running")

    def count_started_since(self, since: datetime) -> int:
        """Runs that started executing at or after `since`, fleet-wide (the hourly cap)."""
        return self._count("count started runs", runs.c.started_at >= since)

    def queue_depth(self) -> int:
        """Runs waiting or being decided: pending + claimed."""
        return self._count("read the queue depth", runs.c.state.in_(("pending", "claimed")))

    # -- start-up, reading, outbox, retention ------------------------------------------------

    def recover_interrupted(
        self, reports_for: Callable[[RunRecord], Sequence[ReportLike]] | None = None
    ) -> list[int]:
        """At start-up, take back this replica's runs a crash or kill left behind.

        Claimed (not yet acting) -> pending again: another worker decides them afresh.
        Running -> done, outcome `interrupted`, with an `interrupted` event: never re-run,
        because a half-done action (a kill, a restart) must not be repeated blindly; people
        are told instead. Steps left `running` become `interrupted`. Every lock of those runs
        (and any other lock this replica holds: at start-up it holds none) is released.
        `reports_for(run)` gives each interrupted run's reports, queued in the same
        transaction. Returns the interrupted run ids.
        """
        now = self._clock()

        def body(conn: Connection) -> list[int]:
            mine = conn.execute(
                sa.select(runs.c.id, runs.c.state, runs.c.playbook, runs.c.target)
                .where(runs.c.owner == self.replica_id, runs.c.state.in_(("claimed", "running")))
                .order_by(runs.c.id)
            ).all()
            claimed = [row.id for row in mine if row.state == "claimed"]
            running = [row for row in mine if row.state == "running"]
            if claimed:
                conn.execute(
                    sa.update(runs)
                    .where(runs.c.id.in_(claimed), runs.c.state == "claimed")
                    .values(state="pending", owner=None, claimed_at=None)
                )
            interrupted = [int(row.id) for row in running]
            if interrupted:
                conn.execute(
                    sa.update(runs)
                    .where(runs.c.id.in_(interrupted), runs.c.state == "running")
                    .values(
                        state="done",
                        outcome="interrupted",
                        finished_at=now,
                        verification="interrupted: the remediator stopped while the run "
                        "was executing; not re-run",
                    )
                )
                conn.execute(
                    sa.update(steps)
                    .where(steps.c.run_id.in_(interrupted), steps.c.result == "running")
                    .values(result="interrupted", finished_at=now)
                )
                for row in running:
                    self._add_event(
                        conn,
                        "interrupted",
                        f"run {row.id} ({row.playbook} on {row.target}) was executing when "
                        f"replica {self.replica_id} stopped; marked interrupted, not re-run",
                        run_id=row.id,
                        playbook=row.playbook,
                        target=row.target,
                    )
                if reports_for is not None:
                    for run in self._select_runs(conn, runs.c.id.in_(interrupted)):
                        for report in reports_for(run):
                            self._enqueue(conn, report, run.id, now)
            conn.execute(
                sa.delete(locks).where(
                    sa.or_(
                        locks.c.owner == self.replica_id,
                        locks.c.run_id.in_([row.id for row in mine]),
                    )
                )
            )
            return interrupted

        return self._tx("recover interrupted runs", body)

    def _select_runs(
        self, conn: Connection, where: sa.ColumnElement[bool], limit: int | None = None
    ) -> list[RunRecord]:
        """Runs (newest first) with their alerts and steps: two queries, however many runs."""
        columns = [c.label(f"r_{c.name}") for c in runs.c]
        columns += [c.label(f"a_{c.name}") for c in alerts.c]
        query = (
            sa.select(*columns)
            .select_from(runs.join(alerts, runs.c.alert_id == alerts.c.id))
            .where(where)
            .order_by(runs.c.id.desc())
        )
        if limit is not None:
            query = query.limit(limit)
        rows = conn.execute(query).mappings().all()
        by_run: dict[int, list[StepRecord]] = defaultdict(list)
        if rows:
            found = conn.execute(
                sa.select(steps)
                .where(steps.c.run_id.in_([row["r_id"] for row in rows]))
                .order_by(steps.c.run_id, steps.c.idx)
            ).all()
            for step in found:
                by_run[step.run_id].append(
                    StepRecord(
                        index=step.idx,
                        action=step.action,
                        params=step.params,
                        started_at=step.started_at,
                        finished_at=step.finished_at,
                        result=step.result,
                        output=step.output,
                    )
                )
        return [
            RunRecord(
                id=row["r_id"],
                alert=AlertRecord(
                    id=row["a_id"],
                    fingerprint=row["a_fingerprint"],
                    starts_at=row["a_starts_at"],
                    status=row["a_status"],
                    alertname=row["a_alertname"],
                    labels=row["a_labels"],
                    annotations=row["a_annotations"],
                    generator_url=row["a_generator_url"],
                    first_seen=row["a_first_seen"],
                    last_seen=row["a_last_seen"],
                    resolved_at=row["a_resolved_at"],
                ),
                state=row["r_state"],
                decision=row["r_decision"],
                reason=row["r_reason"],
                playbook=row["r_playbook"],
                target=row["r_target"],
                owner=row["r_owner"],
                created_at=row["r_created_at"],
                claimed_at=row["r_claimed_at"],
                started_at=row["r_started_at"],
                finished_at=row["r_finished_at"],
                outcome=row["r_outcome"],
                verification=row["r_verification"],
                steps=by_run[row["r_id"]],
            )
            for row in rows
        ]

    def recent_runs(self, limit: int = 50) -> list[RunRecord]:
        """The newest runs first, each with its alert and steps."""
        return self._tx(
            "read recent runs", lambda conn: self._select_runs(conn, sa.true(), limit), write=False
        )

    def get_run(self, run_id: int) -> RunRecord | None:
        """One run with its alert and steps; None if there is no such run."""
        found = self._tx(
            "read a run", lambda conn: self._select_runs(conn, runs.c.id == run_id), write=False
        )
        return found[0] if found else None

    def _enqueue(
        self, conn: Connection, report: ReportLike, run_id: int | None, now: datetime
    ) -> int:
        if not isinstance(report, QueuedReport):
            report = QueuedReport(topic=report[0], content=report[1])
        recipients = list(report.recipients) if report.recipients is not None else None
        return int(
            conn.execute(
                sa.insert(outbox)
                .values(
                    created_at=now,
                    topic=_clean(report.topic),
                    content=_clean(report.content),
                    run_id=run_id,
                    state="pending",
                    attempts=0,
                    next_attempt_at=now,
                    recipients=recipients,
                    graph=dict(report.graph) if report.graph is not None else None,
                )
                .returning(outbox.c.id)
            ).scalar_one()
        )

    def enqueue_report(
        self,
        topic: str,
        content: str,
        *,
        run_id: int | None = None,
        recipients: Sequence[str] | None = None,
        graph: Mapping[str, Any] | None = None,
    ) -> int:
        """Queue a report for the Zulip sender on its own; its outbox id."""
        report = QueuedReport(
            topic, content, tuple(recipients) if recipients is not None else None, graph
        )
        now = self._clock()
        return self._tx("queue a report", lambda conn: self._enqueue(conn, report, run_id, now))

    # -- the outbox sender -------------------------------------------------------------------

    def take_lease(self, name: str, ttl: timedelta) -> bool:
        """Hold the lease `name` for `ttl` from now (taken, renewed, or taken over once expired).

        False while another replica holds it unexpired. One row of the `locks` table (target
        `lease/NAME`, run 0), with the same compare-and-set as `try_lock`, so two replicas
        cannot both hold it.
        """
        target = f"lease/{name}"

        def body(conn: Connection) -> bool:
            for _ in range(_ATTEMPTS):
                now = self._clock()
                held = {
                    "run_id": 0,
                    "owner": self.replica_id,
                    "expires_at": now + ttl,
                    "ttl_seconds": ttl.total_seconds(),
                }
                inserted = conn.execute(
                    self._insert(locks)
                    .values(target=target, acquired_at=now, **held)
                    .on_conflict_do_nothing(index_elements=["target"])
                    .returning(locks.c.target)
                ).first()
                if inserted is not None:
                    return True
                current = conn.execute(sa.select(locks).where(locks.c.target == target)).first()
                if current is None:
                    continue  # released in between: try again
                mine = current.owner == self.replica_id
                if not mine and current.expires_at > now:
                    return False
                values = held if mine else {**held, "acquired_at": now}
                taken = conn.execute(
                    sa.update(locks)
                    .where(
                        locks.c.target == target,
                        locks.c.owner == current.owner,
                        locks.c.expires_at == current.expires_at,
                    )
                    .values(**values)
                ).rowcount
                if taken:
                    return True
            return False

        return self._tx("take a lease", body)

    def release_lease(self, name: str) -> None:
        """Give the lease `name` up if this replica holds it (a no-op otherwise)."""
        self._tx(
            "release a lease",
            lambda conn: conn.execute(
                sa.delete(locks).where(
                    locks.c.target == f"lease/{name}", locks.c.owner == self.replica_id
                )
            ),
        )

    @staticmethod
    def _outbox_entry(row: Any) -> OutboxEntry:
        return OutboxEntry(
            id=row.id,
            created_at=row.created_at,
            topic=row.topic,
            content=row.content,
            run_id=row.run_id,
            state=row.state,
            attempts=row.attempts,
            next_attempt_at=row.next_attempt_at,
            sent_at=row.sent_at,
            zulip_message_id=row.zulip_message_id,
            recipients=tuple(row.recipients) if row.recipients is not None else None,
            graph=row.graph,
            picture=row.picture,
            owner=row.owner,
            last_error=row.last_error,
        )

    def outbox_due(self, limit: int = 50) -> list[OutboxEntry]:
        """The reports to send now, oldest first: per topic, its oldest unsent entry if due.

        Only the head of each topic: a later report of a topic never overtakes an earlier
        one that is waiting for its retry (order within a topic is the story's order).
        """
        now = self._clock()
        other = outbox.alias("other")
        heads = (
            sa.select(sa.func.min(other.c.id))
            .where(other.c.state.in_(("pending", "sending")))
            .group_by(other.c.topic)
        )
        query = (
            sa.select(outbox)
            .where(outbox.c.id.in_(heads), outbox.c.next_attempt_at <= now)
            .order_by(outbox.c.id)
            .limit(limit)
        )
        rows = self._tx("read the due reports", lambda conn: conn.execute(query).all(), write=False)
        return [self._outbox_entry(row) for row in rows]

    def outbox_entries(self, limit: int = 1000) -> list[OutboxEntry]:
        """Every outbox entry (up to `limit`), oldest first."""
        query = sa.select(outbox).order_by(outbox.c.id).limit(limit)
        rows = self._tx("read the outbox", lambda conn: conn.execute(query).all(), write=False)
        return [self._outbox_entry(row) for row in rows]

    def outbox_begin_send(self, entry_id: int) -> bool:
        """Mark an unsent entry `sending` before it goes out; False if it is not unsent any more.

        From here until `outbox_sent`, a crash leaves it `sending`: the next sender looks it
        up in Zulip before sending it again.
        """
        stmt = (
            sa.update(outbox)
            .where(outbox.c.id == entry_id, outbox.c.state.in_(("pending", "sending")))
            .values(state="sending", owner=self.replica_id)
        )
        return bool(self._tx("begin sending a report", lambda conn: conn.execute(stmt).rowcount))

    def outbox_sent(self, entry_id: int, message_id: int | None) -> None:
        """Zulip has the entry (message `message_id`)."""
        stmt = (
            sa.update(outbox)
            .where(outbox.c.id == entry_id)
            .values(
                state="sent", sent_at=self._clock(), zulip_message_id=message_id, last_error=None
            )
        )
        self._tx("mark a report sent", lambda conn: conn.execute(stmt))

    def outbox_retry(
        self, entry_id: int, *, at: datetime, error: str, maybe_sent: bool = False
    ) -> None:
        """Try the entry again at `at`; its count of failed attempts goes up by one.

        `maybe_sent`: the last attempt may have reached Zulip (a timeout, a 5xx), so it stays
        `sending` and is looked up before it is sent again.
        """
        stmt = (
            sa.update(outbox)
            .where(outbox.c.id == entry_id, outbox.c.state.in_(("pending", "sending")))
            .values(
                state="sending" if maybe_sent else "pending",
                attempts=outbox.c.attempts + 1,
                next_attempt_at=at,
                last_error=_clean(error)[:2000],
            )
        )
        self._tx("defer a report", lambda conn: conn.execute(stmt))

    def outbox_failed(self, entry_id: int, error: str) -> None:
        """Zulip refused the entry for good; it stays in the journal, state `failed`."""
        stmt = (
            sa.update(outbox)
            .where(outbox.c.id == entry_id)
            .values(state="failed", last_error=_clean(error)[:2000])
        )
        self._tx("mark a report failed", lambda conn: conn.execute(stmt))

    def outbox_set_picture(self, entry_id: int, markdown: str) -> None:
        """Remember the uploaded picture's Markdown ("" for none): a retry reuses it."""
        stmt = sa.update(outbox).where(outbox.c.id == entry_id).values(picture=_clean(markdown))
        self._tx("store a report's picture", lambda conn: conn.execute(stmt))

    def outbox_stats(self) -> tuple[int, datetime | None]:
        """(unsent entries, the oldest one's created_at or None), fleet-wide."""
        query = sa.select(sa.func.count(), sa.func.min(outbox.c.created_at)).where(
            outbox.c.state.in_(("pending", "sending"))
        )
        row = self._tx("read the outbox depth", lambda conn: conn.execute(query).one(), write=False)
        oldest = row[1]
        if oldest is not None and not isinstance(oldest, datetime):
            # min() over SQLite's text column comes back as text, not through UTCDateTime.
            oldest = datetime.fromisoformat(str(oldest)).replace(tzinfo=UTC)
        return int(row[0]), oldest

    def prune(self) -> int:
        """Delete history older than the retention; returns the rows deleted.

        Old: finished runs (and their steps) finished before now - retention; resolved
        alerts last seen before then and left without runs; notifications, events, sent or
        failed outbox entries, cooldowns that ended and closed breakers idle since then.
        Kept whatever their age: pending, claimed and running runs; every unresolved alert
        and its newest run; open breakers; locks; unsent reports.
        """
        cutoff = self._clock() - self.retention

        def body(conn: Connection) -> int:
            newest_open = (
                sa.select(sa.func.max(runs.c.id))
                .select_from(runs.join(alerts, runs.c.alert_id == alerts.c.id))
                .where(alerts.c.status == "firing")
                .group_by(runs.c.alert_id)
            )
            old_runs = sa.select(runs.c.id).where(
                runs.c.state == "done",
                sa.func.coalesce(runs.c.finished_at, runs.c.created_at) < cutoff,
                runs.c.id.not_in(newest_open),
            )
            has_run = sa.exists().where(runs.c.alert_id == alerts.c.id)
            deletes = [
                sa.delete(steps).where(steps.c.run_id.in_(old_runs)),
                sa.delete(runs).where(runs.c.id.in_(old_runs)),
                sa.delete(alerts).where(
                    alerts.c.status == "resolved", alerts.c.last_seen < cutoff, ~has_run
                ),
                # Alerts kept keep a NULL notification_id (ON DELETE SET NULL).
                sa.delete(notifications).where(notifications.c.received_at < cutoff),
                sa.delete(events).where(events.c.at < cutoff),
                sa.delete(outbox).where(
                    outbox.c.state.in_(("sent", "failed")), outbox.c.created_at < cutoff
                ),
                sa.delete(cooldowns).where(cooldowns.c.until < cutoff),
                sa.delete(breakers).where(
                    breakers.c.state == "closed",
                    sa.or_(breakers.c.window_start.is_(None), breakers.c.window_start < cutoff),
                ),
            ]
            return sum(conn.execute(stmt).rowcount for stmt in deletes)

        return self._tx("prune old rows", body)
