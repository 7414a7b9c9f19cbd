"""The outbox: Zulip reports queued in the journal, sent in order per topic by one replica.

Reports join the outbox in the transaction that journals what they tell (`_enqueue(conn, …)`,
called by the admission, the runs and the rails); the sender (`remediator.notify.sender`) takes
them out in order per topic, under the `outbox` lease (`leases.py`) that one replica holds.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from remediator.journal.db import Database, clean
from remediator.journal.records import OutboxEntry, QueuedReport, ReportLike
from remediator.journal.schema import outbox


class Outbox(Database):
    """The outbox's SQL."""

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
                    topic=clean(report.topic),
                    content=clean(report.content),
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

    def outbox_failures(self, limit: int = 20) -> list[OutboxEntry]:
        """The reports Zulip refused for good (state `failed`), newest first (the page, status)."""
        query = (
            sa.select(outbox).where(outbox.c.state == "failed").order_by(outbox.c.id.desc())
            .limit(limit)
        )  # fmt: skip
        rows = self._tx("read the failed reports", lambda conn: conn.execute(query).all(),
                        write=False)  # fmt: skip
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
                last_error=clean(error)[:2000],
            )
        )
        self._tx("defer a report", lambda conn: conn.execute(stmt))

    def outbox_failed(self, entry_id: int, error: str) -> None:
        """Zulip refused the entry for good; it stays in the journal, state `failed`."""
        stmt = (
            sa.update(outbox)
            .where(outbox.c.id == entry_id)
            .values(state="failed", last_error=clean(error)[:2000])
        )
        self._tx("mark a report failed", lambda conn: conn.execute(stmt))

    def outbox_set_picture(self, entry_id: int, markdown: str) -> None:
        """Remember the uploaded picture's Markdown ("" for none): a retry reuses it."""
        stmt = sa.update(outbox).where(outbox.c.id == entry_id).values(picture=clean(markdown))
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
