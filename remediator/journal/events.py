"""Events: what happened besides runs — pauses, maintenance, escalations, takeovers, people's acts.

Kinds the journal writes: `paused`, `resumed`, `maintenance_on`, `maintenance_off`,
`interrupted`, `lock_takeover`, `escalation`, `escalation_ack`, `breaker_reset`,
`run_cancelled`, `rejected_notification`; actions add their own (power-cap schedules).
`actor` names who acted (a person's credential name, `cli:USER`); `ref_id` what an event
refers to (an acknowledgement, its escalation).
"""

from __future__ import annotations

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from remediator.journal.db import Database, clean
from remediator.journal.records import Event
from remediator.journal.schema import events


class Events(Database):
    """The events table's SQL."""

    def _add_event(
        self,
        conn: Connection,
        kind: str,
        detail: str,
        *,
        run_id: int | None = None,
        playbook: str | None = None,
        target: str | None = None,
        actor: str | None = None,
        ref_id: int | None = None,
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
                    detail=clean(detail),
                    actor=None if actor is None else clean(actor)[:200],
                    ref_id=ref_id,
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

    def events(
        self, *, kind: str | None = None, limit: int = 100, ref_id: int | None = None
    ) -> list[Event]:
        """The newest events first (only those of `kind`, or referring to `ref_id`, if given)."""
        query = sa.select(events).order_by(events.c.id.desc()).limit(limit)
        if kind is not None:
            query = query.where(events.c.kind == kind)
        if ref_id is not None:
            query = query.where(events.c.ref_id == ref_id)
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
                actor=row.actor,
                ref_id=row.ref_id,
            )
            for row in rows
        ]
