"""The journal: the remediator's durable state, shared by every replica through one database.

`Journal(url, replica_id=…)` opens SQLite (the embedded default) or PostgreSQL (for several
replicas), creates or migrates the schema, and offers what the webhook, the engine and the web
app need — each concern in a module of its own, every operation one short transaction:

- `db`: engines, transactions, dialect helpers, `JournalError`;
- `schema`: the tables and the migrations between versions;
- `admission`: notifications recorded, alerts deduped into occurrences, runs made or closed;
- `runs`: claims, transitions, steps, heartbeats, recovery, reading runs back;
- `rails`: "may this act now?" (pause, maintenance, budgets, caps, the per-target lock),
  decided and taken in one transaction, and the budgets a run's end leaves;
- `outbox` and `leases`: Zulip reports in order per topic, sent under a lease;
- `events`: what happened besides runs, with who acted;
- `records`: the frozen records all of them hand out.

Everything replicas must agree on is decided by the database — a unique key, a conditional
UPDATE whose row count says who won, or the rails' serialised transaction — never by process
memory.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from datetime import datetime, timedelta

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from remediator.alerts import PayloadError, parse_notification
from remediator.config import Limits
from remediator.journal.admission import DEFAULT_DEDUPE_WINDOW, Admissions
from remediator.journal.db import (
    ClaimUnread,
    JournalError,
    RunStateError,
    bound_output,
    utcnow,
)
from remediator.journal.leases import Leases
from remediator.journal.rails import Plan, Verdict
from remediator.journal.records import (
    Admission,
    AlertRecord,
    Breaker,
    Claim,
    Event,
    OutboxEntry,
    QueuedReport,
    QueueState,
    ReportLike,
    RunRecord,
    StepRecord,
    UndoRecord,
)
from remediator.journal.recovery import Recovery
from remediator.journal.schema import (
    alerts,
    events,
    maintenance,
    notifications,
    outbox,
    run_targets,
    runs,
    steps,
    target_breakers,
    target_cooldowns,
)

__all__ = [
    "Admission",
    "AlertRecord",
    "Breaker",
    "Claim",
    "ClaimUnread",
    "Event",
    "Journal",
    "JournalError",
    "OutboxEntry",
    "Plan",
    "QueueState",
    "QueuedReport",
    "ReportLike",
    "RunRecord",
    "RunStateError",
    "StepRecord",
    "UndoRecord",
    "Verdict",
    "bound_output",
]

log = logging.getLogger(__name__)


class Journal(Admissions, Recovery, Leases):
    """The remediator's durable state in SQLite or PostgreSQL; safe to share between threads.

    `replica_id` names this process among the replicas (claims record it, and
    `recover_interrupted` takes back only its own runs): stable across restarts of the same
    replica, unique among live ones. `limits` and `lock_ttl` are the rails', `dedupe_window`
    the admission's. `clock` is injected for tests; every time the journal writes comes from it.
    """

    def __init__(
        self,
        url: str,
        *,
        replica_id: str,
        retention: timedelta = timedelta(days=30),
        clock: Callable[[], datetime] = utcnow,
        limits: Limits | None = None,
        lock_ttl: timedelta = timedelta(seconds=900),
        dedupe_window: timedelta = DEFAULT_DEDUPE_WINDOW,
    ) -> None:
        super().__init__(url, replica_id=replica_id, clock=clock)
        self.retention = retention
        self.limits = limits if limits is not None else Limits()
        self.lock_ttl = lock_ttl
        self.dedupe_window = dedupe_window
        self.resolved_reports = None

    def schema_version(self) -> int:
        """The schema version the database holds."""
        from remediator.journal.schema import current_version  # noqa: PLC0415

        return self._tx("read the schema version", current_version, write=False)

    def admit_leftovers(self) -> int:
        """Admit notifications an older version accepted but had not ingested when it stopped.

        Before version 3 the webhook stored the body first and made runs from it later; an
        upgrade must not lose one that was answered 200. Each is admitted as itself and
        marked in the same transaction (two replicas starting together admit it once: the
        second finds it marked, or its runs deduped). The engine calls this at start, once
        its `resolved_reports` hook is set. Returns how many were admitted.
        """
        query = (
            sa.select(notifications.c.id, notifications.c.raw)
            .where(notifications.c.ingested_at.is_(None), notifications.c.rejected.is_(None))
            .order_by(notifications.c.id)
        )
        leftovers = self._tx("read notifications left to admit", lambda c: c.execute(query).all(),
                             write=False)  # fmt: skip
        for row in leftovers:
            try:
                notification = parse_notification(str(row.raw).encode())
            except PayloadError as exc:
                self._mark_leftover(row.id, f"cannot be admitted after the upgrade: {exc}")
                continue
            self.admit(notification, str(row.raw).encode(), recorded=int(row.id))
        return len(leftovers)

    def _mark_leftover(self, notification_id: int, rejected: str | None) -> None:
        stmt = (
            sa.update(notifications)
            .where(notifications.c.id == notification_id)
            .values(ingested_at=self._clock(), rejected=rejected)
        )
        self._tx("mark a notification admitted", lambda conn: conn.execute(stmt))

    def prune(self) -> int:
        """Delete history older than the retention; returns the rows deleted.

        Old: finished runs (and their steps) finished before now - retention; resolved
        alerts last seen before then and left without runs; notifications, events, sent or
        failed outbox entries, cooldowns and maintenance windows that ended and breakers
        reset since then.
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
                # Explicitly, not by the cascade: rows a cascade deletes are not in rowcount.
                sa.delete(run_targets).where(run_targets.c.run_id.in_(old_runs)),
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
                sa.delete(target_cooldowns).where(target_cooldowns.c.until < cutoff),
                sa.delete(target_breakers).where(
                    target_breakers.c.state == "closed", target_breakers.c.reset_at < cutoff
                ),
                sa.delete(maintenance).where(maintenance.c.until < cutoff),
            ]
            return sum(conn.execute(stmt).rowcount for stmt in deletes)

        return self._tx("prune old rows", body)
