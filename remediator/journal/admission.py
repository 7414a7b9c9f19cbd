"""Admission: a validated notification recorded, its alerts deduped into occurrences, runs made.

`admit(notification, raw)` does all of it in one write transaction, inside the webhook's
request: when it returns, the notification, its occurrences and its runs are committed, and
only then does the webhook answer 200 (DESIGN.md, "Admission is one transaction").

Occurrences. One problem is one occurrence, however many copies of it arrive: Alertmanager
resends every group on each group and repeat interval, both members of an HA pair send it, and
an HA Prometheus pair stamps it with `startsAt` that differ by up to an evaluation (and
Alertmanager keeps the earliest one it saw when it merges them, so the same pair can send a
later `startsAt` first and an earlier one afterwards). Hence, per fingerprint:

- at most one *open* occurrence (a partial unique index, so two replicas admitting at once
  cannot open two);
- a firing alert whose `startsAt` lies within `dedupe_window` of the open occurrence's, or
  before it, joins it (a duplicate: `last_seen` moves, nothing starts);
- a firing alert that started `dedupe_window` or more after the open one means the old one
  ended without its resolution reaching us: the old one is closed, a new one opens;
- with nothing open, a firing alert that started before a resolved occurrence ended (and
  within the window of its start) is a late copy of it: a duplicate; anything else opens a new
  occurrence and a `pending` run;
- a resolved alert closes the open occurrence of its fingerprint; runs of it that have not
  started end at once as `resolved` (a claimed run finds out at the rails, which read the
  occurrence in their own transaction). A resolution never seen firing is journaled
  resolved, so a late or retried firing of it starts nothing.

Alerts are handled in (fingerprint, startsAt) order, so two replicas admitting the same group
take the index entries in the same order and cannot deadlock on PostgreSQL.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from datetime import datetime, timedelta
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql as pg_dialect
from sqlalchemy.dialects import sqlite as sqlite_dialect
from sqlalchemy.engine import Connection

from remediator.alerts import Alert, Notification, minus
from remediator.journal.db import clean
from remediator.journal.records import Admission, ReportLike, RunRecord
from remediator.journal.runs import Runs
from remediator.journal.schema import alerts, notifications, runs

log = logging.getLogger(__name__)

# The statements every notification runs, built once: SQLAlchemy then only binds values
# (building and caching a statement per call cost more than SQLite's own work, bench/webhook.py).
_ADD_NOTIFICATION = sa.insert(notifications).returning(notifications.c.id)
_OPEN_OCCURRENCE = (
    sa.select(alerts.c.id, alerts.c.starts_at)
    .where(alerts.c.fingerprint == sa.bindparam("b_fingerprint"), alerts.c.status == "firing")
    # FOR UPDATE: a concurrent resolution or takeover of this occurrence waits for us.
    .with_for_update()
)
_TOUCH = (
    sa.update(alerts)
    .where(alerts.c.id == sa.bindparam("b_id"))
    .values(last_seen=sa.bindparam("b_now", type_=alerts.c.last_seen.type))
)

# A new alert's statements too: its first sighting is the slowest admission (bench/webhook.py's
# sequential p99). Values come as bound parameters, never by `.values()` per call.
_KNOWN_ALERT = sa.select(alerts.c.id).where(
    alerts.c.fingerprint == sa.bindparam("b_fingerprint"),
    sa.or_(
        alerts.c.starts_at == sa.bindparam("b_starts", type_=alerts.c.starts_at.type),
        # A late copy of an occurrence that has since resolved.
        sa.and_(
            alerts.c.starts_at > sa.bindparam("b_window_start", type_=alerts.c.starts_at.type),
            alerts.c.resolved_at > sa.bindparam("b_starts"),
        ),
    ),
)
_INSERT_ALERT = {
    # ON CONFLICT DO NOTHING is spelt by each dialect's own insert.
    "sqlite": sqlite_dialect.insert(alerts).on_conflict_do_nothing().returning(alerts.c.id),
    "postgresql": pg_dialect.insert(alerts).on_conflict_do_nothing().returning(alerts.c.id),
}
_INSERT_RUN = sa.insert(runs).returning(runs.c.id)

DEFAULT_DEDUPE_WINDOW = timedelta(minutes=10)
MAX_CLOCK_SKEW = timedelta(seconds=60)
"""How far ahead of the receipt time an alert's `startsAt` may be (clocks in sync are within
a second; a Prometheus of an HA pair evaluates up to an interval apart, and says when)."""
RESOLVED_BEFORE_ACTING = "the alert resolved before the run could act; nothing was done"


class Admissions(Runs):
    """The admission's SQL."""

    dedupe_window: timedelta = DEFAULT_DEDUPE_WINDOW
    resolved_reports: Callable[[RunRecord], Sequence[ReportLike]] | None = None
    """Reports that close the story of an alert that resolved, given its newest run.

    Called inside the transaction that marks the alert resolved (so the closing report is
    queued exactly when the resolution is journaled); only for alerts that had a run. It must
    not block: it renders text, nothing more.
    """

    def admit(
        self, notification: Notification, raw: bytes, *, recorded: int | None = None
    ) -> Admission:
        """Record a notification, dedupe its alerts and make or close runs: one transaction.

        `recorded`: the id of a notification already in the journal (one an older version
        accepted without making its runs), admitted as itself and marked in this transaction.
        """
        raw_text = clean(raw.decode("utf-8", errors="replace"))

        def body(conn: Connection) -> Admission:
            now = self._clock()
            if recorded is not None:
                notification_id = recorded
                marked = conn.execute(
                    sa.update(notifications)
                    .where(notifications.c.id == recorded, notifications.c.ingested_at.is_(None))
                    .values(ingested_at=now)
                ).rowcount
                if not marked:  # another replica admitted it first
                    return Admission(notification_id, [], 0, 0, [])
            else:
                notification_id = int(
                    conn.execute(
                        _ADD_NOTIFICATION,
                        {
                            "received_at": now,
                            "group_key": clean(notification.groupKey),
                            "receiver": clean(notification.receiver),
                            "raw": raw_text,
                            "replica": self.replica_id,
                            "ingested_at": now,
                            "truncated": notification.truncatedAlerts or None,
                        },
                    ).scalar_one()
                )
            new_runs: list[int] = []
            closed: list[int] = []
            duplicates = resolved = 0
            bounded = [self._bounded(conn, a, notification_id, now) for a in notification.alerts]
            for alert in sorted(bounded, key=lambda a: (a.fingerprint, a.startsAt)):
                if alert.status == "firing":
                    run_id = self._admit_firing(conn, alert, notification_id, now, closed)
                    if run_id is None:
                        duplicates += 1
                    else:
                        new_runs.append(run_id)
                else:
                    ended = self._admit_resolved(conn, alert, notification_id, now)
                    if ended is not None:
                        resolved += 1
                        closed += ended
            return Admission(notification_id, new_runs, duplicates, resolved, closed)

        return self._tx("admit a notification", body, urgent=True)

    def reject_notification(self, raw: bytes, reason: str) -> int:
        """Keep a body that failed admission in an unforeseen way, with the reason; its id.

        The webhook answers it 400 (a retry cannot help); it is journaled so a person can see
        what was refused, and an event says so.
        """
        raw_text = clean(raw.decode("utf-8", errors="replace"))

        def body(conn: Connection) -> int:
            now = self._clock()
            notification_id = int(
                conn.execute(
                    sa.insert(notifications)
                    .values(
                        received_at=now,
                        group_key="",
                        receiver="",
                        raw=raw_text,
                        replica=self.replica_id,
                        ingested_at=now,
                        rejected=clean(reason)[:2000],
                    )
                    .returning(notifications.c.id)
                ).scalar_one()
            )
            self._add_event(
                conn,
                "rejected_notification",
                f"notification {notification_id} refused after it parsed: {reason}",
                ref_id=notification_id,
            )
            return notification_id

        return self._tx("journal a refused notification", body, urgent=True)

    # -- one alert ---------------------------------------------------------------------------

    def _bounded(
        self, conn: Connection, alert: Alert, notification_id: int, now: datetime
    ) -> Alert:
        """`alert` with a `startsAt` no later than the receipt time allows.

        Time from the network is bounded by this clock: a `startsAt` more than
        `MAX_CLOCK_SKEW` ahead of receipt (a forged alert through Alertmanager's API, a
        Prometheus whose clock runs ahead) would open an occurrence that every later real
        fault joins as a duplicate. It counts as received now, and an event says so.
        """
        if alert.startsAt <= now + MAX_CLOCK_SKEW:
            return alert
        self._add_event(
            conn,
            "future_starts_at",
            f"alert {clean(alert.alertname)!r} ({clean(alert.fingerprint)}) said it started at "
            f"{alert.startsAt.isoformat()}, {alert.startsAt - now} after it was received: "
            "taken as started when received",
            ref_id=notification_id,
        )
        return alert.model_copy(update={"startsAt": now})

    def _open_occurrence(self, conn: Connection, fingerprint: str) -> Any:
        return conn.execute(_OPEN_OCCURRENCE, {"b_fingerprint": fingerprint}).first()

    def _touch(self, conn: Connection, alert_id: int, now: datetime) -> None:
        conn.execute(_TOUCH, {"b_id": alert_id, "b_now": now})

    def _admit_firing(
        self,
        conn: Connection,
        alert: Alert,
        notification_id: int,
        now: datetime,
        closed: list[int],
    ) -> int | None:
        """The new run's id, or None for a copy of an occurrence already known.

        Runs of an older occurrence that this one closes are added to `closed`.
        """
        fingerprint = clean(alert.fingerprint)
        starts = alert.startsAt
        window = self.dedupe_window
        for _ in range(2):  # a second look only after losing an insert race
            current = self._open_occurrence(conn, fingerprint)
            if current is not None:
                if starts - current.starts_at < window:  # within the window, or earlier
                    self._touch(conn, current.id, now)
                    return None
                # Started well after the open one: that one ended without its resolution
                # reaching us. It is closed, with its runs that have not started.
                closed += self._close(conn, current.id, ended=starts, now=now, reason=(
                    "a later occurrence of the same alert arrived; this one had ended"
                ))  # fmt: skip
            else:
                known = conn.execute(
                    _KNOWN_ALERT,
                    {
                        "b_fingerprint": fingerprint,
                        "b_starts": starts,
                        "b_window_start": minus(starts, window),
                    },
                ).first()
                if known is not None:
                    self._touch(conn, known.id, now)
                    return None
            alert_id = self._insert_alert(conn, alert, notification_id, now)
            if alert_id is not None:
                return int(
                    conn.execute(
                        _INSERT_RUN,
                        {"alert_id": alert_id, "state": "pending", "reason": "", "created_at": now},
                    ).scalar_one()
                )
            # Another replica opened it between our look and our insert (we waited for it on
            # the unique index; it is committed and visible now): look again.
        return None

    def _admit_resolved(
        self, conn: Connection, alert: Alert, notification_id: int, now: datetime
    ) -> list[int] | None:
        """Close the occurrence; the runs that ended with it, or None if nothing resolved."""
        fingerprint = clean(alert.fingerprint)
        ended = _ended_at(alert, now)
        for _ in range(2):
            current = self._open_occurrence(conn, fingerprint)
            if current is not None and alert.startsAt >= minus(
                current.starts_at, self.dedupe_window
            ):
                return self._close(conn, current.id, ended=ended, now=now)
            exact = conn.execute(
                sa.select(alerts.c.id).where(
                    alerts.c.fingerprint == fingerprint, alerts.c.starts_at == alert.startsAt
                )
            ).first()
            if exact is not None:  # already resolved: a resend
                self._touch(conn, exact.id, now)
                return None
            # Never seen firing: journaled resolved, so a late firing of it starts nothing.
            if self._insert_alert(conn, alert, notification_id, now, resolved_at=ended):
                return []
        return None

    def _close(
        self,
        conn: Connection,
        alert_id: int,
        *,
        ended: datetime,
        now: datetime,
        reason: str = RESOLVED_BEFORE_ACTING,
    ) -> list[int]:
        """Mark an open occurrence resolved; end its runs that have not started."""
        conn.execute(
            sa.update(alerts)
            .where(alerts.c.id == alert_id, alerts.c.status == "firing")
            .values(status="resolved", resolved_at=ended, last_seen=now)
        )
        unstarted = [
            int(row.id)
            for row in conn.execute(
                sa.update(runs)
                .where(runs.c.alert_id == alert_id, runs.c.state == "pending")
                .values(
                    state="done",
                    decision="resolved",
                    reason=reason,
                    finished_at=now,
                    not_before=None,
                )
                .returning(runs.c.id)
            )
        ]
        self._queue_closing_reports(conn, alert_id, now)
        return unstarted

    def _insert_alert(
        self,
        conn: Connection,
        alert: Alert,
        notification_id: int,
        now: datetime,
        *,
        resolved_at: datetime | None = None,
    ) -> int | None:
        """Insert an occurrence unless one conflicts (same start, or one open); its id or None.

        ON CONFLICT DO NOTHING, not check-then-insert: when two replicas insert at once, the
        unique indexes make the second wait for the first and then insert nothing.
        """
        values = {
            "fingerprint": clean(alert.fingerprint),
            "starts_at": alert.startsAt,
            "status": "firing" if resolved_at is None else "resolved",
            "alertname": clean(alert.alertname),
            "labels": alert.labels,
            "annotations": alert.annotations,
            "generator_url": clean(alert.generatorURL),
            "first_seen": now,
            "last_seen": now,
            "resolved_at": resolved_at,
            "notification_id": notification_id,
        }
        found = conn.execute(_INSERT_ALERT[self._dialect], values).scalar_one_or_none()
        return None if found is None else int(found)

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


def _ended_at(alert: Alert, now: datetime) -> datetime:
    """When a resolved alert ended: Alertmanager's `endsAt`, unless it is missing or bogus."""
    if alert.endsAt is not None and alert.endsAt > alert.startsAt:
        return alert.endsAt
    return now
