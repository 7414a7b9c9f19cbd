"""The journal's tables (SQLAlchemy Core), its schema version, and the migrations to it.

One schema for SQLite and PostgreSQL, so nothing here is dialect-specific except what the
column types below hide:

- times are `UTCDateTime`: timezone-aware UTC datetimes in Python; `timestamptz` on
  PostgreSQL, a fixed-width UTC text on SQLite (SQLite has no time type, and SQLAlchemy's
  text form has a constant width, so text order is time order and the unique key
  (fingerprint, starts_at) compares equal instants as equal);
- JSON is `JSONText`: a JSON document in a text column (labels, annotations, step params);
  nothing queries inside it, and plain text behaves the same on both databases.

`schema_version` holds one row per applied migration. `upgrade()` brings a database to
`SCHEMA_VERSION` and refuses one that is newer: an older remediator must not write to a
schema it does not know (a rolling upgrade runs the new version's migration first).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Dialect

SCHEMA_VERSION = 3
"""The version this code reads and writes; `upgrade()` migrates older ones up to it.

Version 2 (Zulip reports): the outbox learns direct messages (`recipients`), the picture of
an incident (`graph`, `picture`), who is sending an entry (`owner`) and why it last failed
(`last_error`), and an index for the sender's per-topic order.

Version 3 (one admission): one open occurrence per fingerprint (a partial unique index);
runs that wait (`not_before`, `wait_reason`, `waiting_since`, `wait_reported`) and whether a
run disrupts (`disruptive`); the targets a disruptive run touches (`run_targets`); budgets
per target instead of per (target, playbook) (`target_cooldowns`, `target_breakers`, which
replace `cooldowns` and `breakers`); notifications refused after acceptance (`rejected`);
maintenance that ends (`until`); who acted on an event and what it refers to (`actor`,
`ref_id`); durable immediate undos (`undos`) and whether an interrupted run was reported
(`interrupt_reported`); Alertmanager's `truncatedAlerts` per notification (`truncated`).
"""

# SQLite's rowid alias must be spelled INTEGER PRIMARY KEY; PostgreSQL gets a 64-bit identity.
_ID = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


class UTCDateTime(sa.TypeDecorator[datetime]):
    """A timezone-aware UTC datetime on both databases (a naive one is taken as UTC)."""

    impl = sa.DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        """Normalise to UTC; SQLite stores it naive (its text form has no zone)."""
        if value is None:
            return None
        value = value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)
        return value.replace(tzinfo=None) if dialect.name == "sqlite" else value

    def process_result_value(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        """Aware UTC whatever the database or its session time zone returned."""
        if value is None:
            return None
        return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)


class JSONText(sa.TypeDecorator[Any]):
    """A JSON document stored as text (keys sorted, so equal documents are equal text)."""

    impl = sa.Text()
    cache_ok = True

    def process_bind_param(self, value: Any, dialect: Dialect) -> str | None:
        """Serialise; values JSON cannot hold (a Path, a datetime) are written as strings."""
        if value is None:
            return None
        # Escaped, so a NUL in a label becomes the six characters \u0000, which a
        # PostgreSQL text column accepts (a raw NUL it refuses).
        return json.dumps(value, sort_keys=True, default=str, ensure_ascii=True)

    def process_result_value(self, value: str | None, dialect: Dialect) -> Any:
        """Parse back."""
        return None if value is None else json.loads(value)


metadata = sa.MetaData(
    # Named constraints, so a later migration can drop or alter them by name on both databases.
    naming_convention={
        "ix": "ix_%(table_name)s_%(column_0_N_name)s",
        "uq": "uq_%(table_name)s_%(column_0_N_name)s",
        "ck": "ck_%(table_name)s_%(constraint_name)s",
        "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
        "pk": "pk_%(table_name)s",
    }
)

schema_version = sa.Table(
    "schema_version",
    metadata,
    sa.Column("version", sa.Integer, primary_key=True, autoincrement=False),
    sa.Column("applied_at", UTCDateTime, nullable=False),
)

notifications = sa.Table(
    "notifications",
    metadata,
    sa.Column("id", _ID, primary_key=True, autoincrement=True),
    sa.Column("received_at", UTCDateTime, nullable=False, index=True),
    sa.Column("group_key", sa.Text, nullable=False),
    sa.Column("receiver", sa.Text, nullable=False),
    sa.Column("raw", sa.Text, nullable=False),  # the webhook body as received (JSON text)
    # The webhook only stores the body (one INSERT before answering 200); the replica that
    # stored it turns it into alerts and runs right after, and marks it ingested.
    sa.Column("replica", sa.Text, nullable=True),
    sa.Column("ingested_at", UTCDateTime, nullable=True, index=True),
    # Version 3: admission happens in the request; a body that failed in an unforeseen way
    # after it parsed is kept with the reason (answered 400), never blocking another.
    sa.Column("rejected", sa.Text, nullable=True),
    # Alertmanager's `truncatedAlerts`: alerts of the group it left out of this body.
    sa.Column("truncated", sa.Integer, nullable=True),
)

alerts = sa.Table(
    "alerts",
    metadata,
    sa.Column("id", _ID, primary_key=True, autoincrement=True),
    sa.Column("fingerprint", sa.Text, nullable=False),
    sa.Column("starts_at", UTCDateTime, nullable=False),
    sa.Column("status", sa.String(16), nullable=False),
    sa.Column("alertname", sa.Text, nullable=False),
    sa.Column("labels", JSONText, nullable=False),
    sa.Column("annotations", JSONText, nullable=False),
    sa.Column("generator_url", sa.Text, nullable=False),
    sa.Column("first_seen", UTCDateTime, nullable=False),
    sa.Column("last_seen", UTCDateTime, nullable=False),
    sa.Column("resolved_at", UTCDateTime, nullable=True),
    # The notification that first told us; pruning old notifications keeps the alert.
    sa.Column(
        "notification_id",
        _ID,
        sa.ForeignKey("notifications.id", ondelete="SET NULL"),
        nullable=True,
    ),
    # The dedupe key (DESIGN.md): HA pairs and repeat intervals resend the same occurrence.
    sa.UniqueConstraint("fingerprint", "starts_at"),
    sa.CheckConstraint("status IN ('firing', 'resolved')", name="status"),
    sa.Index(None, "fingerprint", "status"),
    sa.Index(None, "notification_id"),
)

# One open occurrence per fingerprint: HA Prometheus replicas stamp one problem with startsAt
# that differ, and two replicas admitting them at once must not open two (version 3).
OPEN_OCCURRENCE_INDEX = sa.Index(
    "uq_alerts_open_fingerprint",
    alerts.c.fingerprint,
    unique=True,
    sqlite_where=alerts.c.status == "firing",
    postgresql_where=alerts.c.status == "firing",
)

RUN_STATES = ("pending", "claimed", "running", "done")

runs = sa.Table(
    "runs",
    metadata,
    sa.Column("id", _ID, primary_key=True, autoincrement=True),
    sa.Column("alert_id", _ID, sa.ForeignKey("alerts.id", ondelete="CASCADE"), nullable=False),
    sa.Column("state", sa.String(16), nullable=False),
    sa.Column("decision", sa.Text, nullable=True),
    sa.Column("reason", sa.Text, nullable=False, default=""),
    sa.Column("playbook", sa.Text, nullable=True),
    sa.Column("target", sa.Text, nullable=True),
    sa.Column("owner", sa.Text, nullable=True),  # the replica that claimed it
    sa.Column("created_at", UTCDateTime, nullable=False),
    sa.Column("claimed_at", UTCDateTime, nullable=True),
    sa.Column("started_at", UTCDateTime, nullable=True),
    sa.Column("heartbeat_at", UTCDateTime, nullable=True),
    sa.Column("finished_at", UTCDateTime, nullable=True),
    sa.Column("outcome", sa.Text, nullable=True),
    sa.Column("verification", sa.Text, nullable=True),
    # Version 3, all nullable (ALTER TABLE … ADD COLUMN). A pending run with `not_before`
    # waits for a passing reason (`wait_reason`: paused, maintenance, cooldown, rate_limited,
    # locked, busy) since `waiting_since`; `wait_reported` once its short report is queued.
    sa.Column("not_before", UTCDateTime, nullable=True),
    sa.Column("wait_reason", sa.Text, nullable=True),
    sa.Column("waiting_since", UTCDateTime, nullable=True),
    sa.Column("wait_reported", sa.Boolean, nullable=True),
    sa.Column("disruptive", sa.Boolean, nullable=True),  # set when it starts running
    # An interrupted run is reported once its immediate undos ran (at stop, at the next start,
    # or by the replica that took it over); True once that report is queued.
    sa.Column("interrupt_reported", sa.Boolean, nullable=True),
    sa.CheckConstraint("state IN (" + ", ".join(f"'{s}'" for s in RUN_STATES) + ")", name="state"),
    sa.Index(None, "state", "id"),  # claim: oldest pending first
    sa.Index(None, "alert_id"),
    sa.Index(None, "started_at"),  # the hourly cap
    sa.Index(None, "owner", "state"),  # recovery at start-up
    sa.Index(None, "state", "not_before"),  # claim: pending runs that are due
)

run_targets = sa.Table(
    "run_targets",
    metadata,
    # The disruption set of a disruptive run: every target key its steps touch. A running
    # run holds these targets (the per-target lock); a finished one counts in their breakers.
    sa.Column("run_id", _ID, sa.ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True),
    sa.Column("target", sa.Text, primary_key=True),
    sa.Index(None, "target", "run_id"),
)

STEP_OUTPUT_MAX_BYTES = 64 * 1024
"""A step's output is cut to this many bytes of UTF-8 (its head and tail are kept)."""

steps = sa.Table(
    "steps",
    metadata,
    sa.Column("run_id", _ID, sa.ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True),
    sa.Column("idx", sa.Integer, primary_key=True, autoincrement=False),
    sa.Column("action", sa.Text, nullable=False),
    sa.Column("params", JSONText, nullable=False),
    sa.Column("started_at", UTCDateTime, nullable=False),
    sa.Column("finished_at", UTCDateTime, nullable=True),
    sa.Column("result", sa.Text, nullable=False),
    sa.Column("output", sa.Text, nullable=False),
)

undos = sa.Table(
    "undos",
    metadata,
    # Immediate undos (a deployment back into routing): journaled in the transaction of the
    # step result that asked for one, run at the end of the run whatever happened, at a
    # graceful stop, or after a crash by the next start or the replica that takes over.
    sa.Column("run_id", _ID, sa.ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True),
    sa.Column("idx", sa.Integer, primary_key=True, autoincrement=False),
    sa.Column("asked_by", sa.Integer, nullable=False),  # the step's index
    sa.Column("action", sa.Text, nullable=False),
    sa.Column("params", JSONText, nullable=False),
    sa.Column("timeout_seconds", sa.Float, nullable=False),
    sa.Column("why", sa.Text, nullable=False),
    sa.Column("state", sa.String(16), nullable=False),
    sa.Column("output", sa.Text, nullable=True),
    sa.Column("created_at", UTCDateTime, nullable=False),
    sa.Column("done_at", UTCDateTime, nullable=True),
    sa.CheckConstraint("state IN ('pending', 'done', 'failed')", name="state"),
    sa.Index(None, "state", "run_id"),
)

locks = sa.Table(
    "locks",
    metadata,
    sa.Column("target", sa.Text, primary_key=True),
    sa.Column("run_id", _ID, nullable=False),
    sa.Column("owner", sa.Text, nullable=False),
    sa.Column("acquired_at", UTCDateTime, nullable=False),
    sa.Column("expires_at", UTCDateTime, nullable=False),
    # Added to the brief's columns: the lease length, so a heartbeat can renew the lock of a
    # run that is still alive (a lock is a lease, not a fixed deadline).
    sa.Column("ttl_seconds", sa.Float, nullable=False),
)

target_cooldowns = sa.Table(
    "target_cooldowns",
    metadata,
    # The cooldown of a target, shared by every disruptive playbook: nothing disrupts it
    # again before `until` (left by run `run_id` of `playbook`).
    sa.Column("target", sa.Text, primary_key=True),
    sa.Column("until", UTCDateTime, nullable=False),
    sa.Column("run_id", _ID, nullable=True),
    sa.Column("playbook", sa.Text, nullable=True),
)

target_breakers = sa.Table(
    "target_breakers",
    metadata,
    # The circuit breaker of a target. Failures are counted from the runs themselves (see
    # rails.py); this row says whether it is open, and since when a person last reset it.
    sa.Column("target", sa.Text, primary_key=True),
    sa.Column("state", sa.String(16), nullable=False),
    sa.Column("opened_at", UTCDateTime, nullable=True),
    sa.Column("playbook", sa.Text, nullable=True),  # the playbook whose judgement opened it
    sa.Column("run_id", _ID, nullable=True),  # the run that found it open
    sa.Column("reason", sa.Text, nullable=True),
    sa.Column("reset_at", UTCDateTime, nullable=True),
    sa.Column("reset_by", sa.Text, nullable=True),
    sa.CheckConstraint("state IN ('closed', 'open')", name="state"),
)

events = sa.Table(
    "events",
    metadata,
    sa.Column("id", _ID, primary_key=True, autoincrement=True),
    sa.Column("at", UTCDateTime, nullable=False, index=True),
    sa.Column("kind", sa.Text, nullable=False),
    sa.Column("run_id", _ID, nullable=True),  # no foreign key: events outlive pruned runs
    sa.Column("playbook", sa.Text, nullable=True),
    sa.Column("target", sa.Text, nullable=True),
    sa.Column("detail", sa.Text, nullable=False),
    # Version 3: who did it (a person's credential name, `cli:USER`), and the event or run
    # it refers to (an acknowledgement names its escalation).
    sa.Column("actor", sa.Text, nullable=True),
    sa.Column("ref_id", _ID, nullable=True),
    sa.Index(None, "kind", "id"),
)

settings = sa.Table(
    "settings",
    metadata,
    sa.Column("key", sa.Text, primary_key=True),
    sa.Column("value", sa.Text, nullable=False),
)

maintenance = sa.Table(
    "maintenance",
    metadata,
    sa.Column("host", sa.Text, primary_key=True),
    sa.Column("since", UTCDateTime, nullable=False),
    sa.Column("reason", sa.Text, nullable=False),
    sa.Column("by", sa.Text, nullable=False),
    sa.Column("until", UTCDateTime, nullable=True),  # version 3: None = until turned off
)

OUTBOX_STATES = ("pending", "sending", "sent", "failed")
"""`pending`: not sent yet; `sending`: a send may have happened (look it up in Zulip before
sending again); `sent`: Zulip has it; `failed`: Zulip refused it for good (kept for people)."""


def _outbox_v1_columns() -> list[sa.schema.SchemaItem]:
    return [
        sa.Column("id", _ID, primary_key=True, autoincrement=True),
        sa.Column("created_at", UTCDateTime, nullable=False),
        sa.Column("topic", sa.Text, nullable=False),
        sa.Column("content", sa.Text, nullable=False),
        sa.Column("run_id", _ID, nullable=True),  # no foreign key: a report outlives its run
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("attempts", sa.Integer, nullable=False),
        sa.Column("next_attempt_at", UTCDateTime, nullable=False),
        sa.Column("sent_at", UTCDateTime, nullable=True),
        sa.Column("zulip_message_id", sa.BigInteger, nullable=True),
        sa.CheckConstraint(
            "state IN (" + ", ".join(f"'{s}'" for s in OUTBOX_STATES) + ")", name="state"
        ),
        sa.Index(None, "state", "next_attempt_at"),
        sa.Index(None, "created_at"),
    ]


# Version 2's columns, all nullable so that ALTER TABLE … ADD COLUMN works on both databases.
_OUTBOX_V2_COLUMNS = (
    # JSON list of e-mail addresses: a direct message to them; NULL: a message in the stream.
    ("recipients", JSONText),
    # JSON {"query", "start", "end"}: the picture of the incident, drawn when it is sent.
    ("graph", JSONText),
    # The Markdown that shows the uploaded picture (a /user_uploads/… link and its caption),
    # or "" when none could be drawn: set once, so a retry does not draw and upload again.
    ("picture", sa.Text),
    ("owner", sa.Text),  # the replica that last started sending it
    ("last_error", sa.Text),
)

outbox = sa.Table(
    "outbox",
    metadata,
    *_outbox_v1_columns(),
    *(sa.Column(name, type_, nullable=True) for name, type_ in _OUTBOX_V2_COLUMNS),
    # The sender's question: the oldest unsent entry of each topic.
    sa.Index(None, "topic", "id"),
)


class NewerSchemaError(Exception):
    """The database's schema is newer than this code knows."""

    def __init__(self, found: int, known: int) -> None:
        super().__init__(
            f"the journal's schema is version {found}, newer than this remediator knows "
            f"({known}): a newer remediator migrated it; run that version (or restore a "
            "backup) — an older one must not write to a schema it does not know"
        )
        self.found = found
        self.known = known


def _add_columns(conn: Connection, table: str, columns: list[tuple[str, Any]]) -> None:
    # ADD COLUMN of a nullable column without a default: instant on both databases.
    preparer = conn.dialect.identifier_preparer
    for name, type_ in columns:
        column_type = type_.compile(dialect=conn.dialect)
        conn.exec_driver_sql(
            f"ALTER TABLE {preparer.quote(table)} ADD COLUMN {preparer.quote(name)} {column_type}"
        )


def _migrate_to_2(conn: Connection, now: datetime) -> None:
    del now  # nothing to date
    _add_columns(conn, outbox.name, [(name, type_()) for name, type_ in _OUTBOX_V2_COLUMNS])
    for index in outbox.indexes:
        if [c.name for c in index.columns] == ["topic", "id"]:
            index.create(conn, checkfirst=True)


def _migrate_to_3(conn: Connection, now: datetime) -> None:
    """Budgets per target, runs that wait, one open occurrence per fingerprint.

    History is kept: every notification, alert, run, step, event and report stays. Open
    breakers stay open (now on their target, whatever playbook opened them); cooldowns become
    the target's (the latest end wins); a running run keeps its target as its disruption set.
    `now` is the journal's clock (not the database's: on SQLite, CURRENT_TIMESTAMP is not
    the fixed-width text UTCDateTime compares by).
    """
    _add_columns(
        conn,
        runs.name,
        [(c.name, c.type) for c in (runs.c.not_before, runs.c.wait_reason,
         runs.c.waiting_since, runs.c.wait_reported, runs.c.disruptive)],
    )  # fmt: skip
    _add_columns(conn, notifications.name, [("rejected", sa.Text())])
    _add_columns(conn, maintenance.name, [("until", maintenance.c.until.type)])
    _add_columns(conn, events.name, [("actor", sa.Text()), ("ref_id", events.c.ref_id.type)])
    for index in runs.indexes:
        if [c.name for c in index.columns] == ["state", "not_before"]:
            index.create(conn, checkfirst=True)
    # Before the unique index: an older journal may hold two open occurrences of one
    # fingerprint (an HA twin's startsAt); the newest stays open, the others are closed.
    newest_open = (
        sa.select(sa.func.max(alerts.c.id))
        .where(alerts.c.status == "firing")
        .group_by(alerts.c.fingerprint)
    )
    merged = sa.and_(alerts.c.status == "firing", alerts.c.id.not_in(newest_open))
    twins = [int(row.id) for row in conn.execute(sa.select(alerts.c.id).where(merged))]
    conn.execute(sa.update(alerts).where(merged).values(status="resolved", resolved_at=now))
    # Their runs that had not started duplicate the open one's: ended, as admission ends the
    # runs of an occurrence it closes (claimed and running ones find out at the rails).
    conn.execute(
        sa.update(runs)
        .where(runs.c.alert_id.in_(twins), runs.c.state == "pending")
        .values(
            state="done",
            decision="resolved",
            reason="a twin of a newer occurrence of the same alert (an HA startsAt), merged "
            "into it at the upgrade to schema 3; nothing was done",
            finished_at=now,
        )
    )
    OPEN_OCCURRENCE_INDEX.create(conn, checkfirst=True)
    for table in (run_targets, target_cooldowns, target_breakers):
        table.create(conn, checkfirst=True)
    old_cooldowns = sa.table("cooldowns", sa.column("target"), sa.column("until"))
    old_breakers = sa.table(
        "breakers", sa.column("target"), sa.column("playbook"), sa.column("state"),
        sa.column("opened_at"),
    )  # fmt: skip
    conn.execute(
        target_cooldowns.insert().from_select(
            ["target", "until"],
            sa.select(old_cooldowns.c.target, sa.func.max(old_cooldowns.c.until)).group_by(
                old_cooldowns.c.target
            ),
        )
    )
    conn.execute(
        target_breakers.insert().from_select(
            ["target", "state", "opened_at", "playbook", "reason"],
            sa.select(
                old_breakers.c.target,
                sa.literal("open"),
                sa.func.min(old_breakers.c.opened_at),
                sa.func.min(old_breakers.c.playbook),
                sa.literal("open before the upgrade to per-target budgets"),
            )
            .where(old_breakers.c.state == "open")
            .group_by(old_breakers.c.target),
        )
    )
    conn.exec_driver_sql("DROP TABLE cooldowns")
    conn.exec_driver_sql("DROP TABLE breakers")
    # Target locks are now the disruption sets of running runs; the table keeps leases only.
    running = sa.select(runs.c.id, runs.c.target).where(
        runs.c.state == "running", runs.c.target.is_not(None)
    )
    conn.execute(run_targets.insert().from_select(["run_id", "target"], running))
    conn.execute(sa.update(runs).where(runs.c.state == "running").values(disruptive=True))
    conn.execute(sa.delete(locks).where(~locks.c.target.startswith("lease/")))
    _add_columns(conn, runs.name, [("interrupt_reported", sa.Boolean())])
    _add_columns(conn, notifications.name, [("truncated", sa.Integer())])
    undos.create(conn, checkfirst=True)


MIGRATIONS: dict[int, Callable[[Connection, datetime], None]] = {2: _migrate_to_2, 3: _migrate_to_3}
"""Version N -> the step that migrates a version N-1 database to N (inside one transaction),
given the journal's clock's now.

An empty database is created at `SCHEMA_VERSION` directly from `metadata`; version 1 was the
first release's shape, which the steps from 2 on migrate.
"""


def current_version(conn: Connection) -> int:
    """The highest applied version; 0 for an empty database."""
    if not sa.inspect(conn).has_table(schema_version.name):
        return 0
    found = conn.execute(sa.select(sa.func.max(schema_version.c.version))).scalar_one_or_none()
    return int(found or 0)


def upgrade(conn: Connection, now: datetime) -> int:
    """Migrate to `SCHEMA_VERSION` inside the caller's transaction; returns the version.

    The caller serialises concurrent start-ups (an advisory lock on PostgreSQL, `BEGIN
    IMMEDIATE` on SQLite): both databases run DDL inside a transaction, so two replicas
    starting together apply each step once, and a failed step leaves nothing half-done.
    Raises `NewerSchemaError` for a schema newer than this code.
    """
    found = current_version(conn)
    if found > SCHEMA_VERSION:
        raise NewerSchemaError(found, SCHEMA_VERSION)
    if found == 0:
        metadata.create_all(conn, checkfirst=True)  # OPEN_OCCURRENCE_INDEX included
        for version in range(1, SCHEMA_VERSION + 1):
            conn.execute(sa.insert(schema_version).values(version=version, applied_at=now))
        return SCHEMA_VERSION
    for version in range(found + 1, SCHEMA_VERSION + 1):
        MIGRATIONS[version](conn, now)
        conn.execute(sa.insert(schema_version).values(version=version, applied_at=now))
    return SCHEMA_VERSION
