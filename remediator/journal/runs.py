"""Runs: claims, transitions, steps, heartbeats, recovery, and reading runs back.

A run's states: `pending` (admitted, or waiting for a passing reason with a `not_before`) ->
`claimed` (a worker of one replica decides it) -> `running` (its steps execute; only the rails
put a run there, `rails.py`) -> `done`. Each transition is one conditional UPDATE whose row
count says whether it happened: a run in another state raises `RunStateError`.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from remediator.journal.db import ClaimUnread, JournalError, RunStateError, bound_output, clean
from remediator.journal.events import Events
from remediator.journal.outbox import Outbox
from remediator.journal.records import (
    AlertRecord,
    Claim,
    QueueState,
    ReportLike,
    RunRecord,
    StepRecord,
    UndoRecord,
)
from remediator.journal.schema import alerts, notifications, runs, steps, undos

_CLAIM_ATTEMPTS = 20
# The claim's statements, built once (each worker runs them for every run it takes).
_DUE = (
    sa.select(runs.c.id)
    .where(
        runs.c.state == "pending",
        sa.or_(
            runs.c.not_before.is_(None),
            runs.c.not_before <= sa.bindparam("b_now", type_=runs.c.not_before.type),
        ),
    )
    .order_by(runs.c.not_before.is_not(None), runs.c.id)
    .limit(1)
)
_DUE_CANDIDATE = _DUE.with_for_update(skip_locked=True)
_NEXT_WAITING = sa.select(sa.func.min(runs.c.not_before)).where(
    runs.c.state == "pending", runs.c.not_before.is_not(None)
)
# Runs with their alerts, built once: a new select of ~40 labelled columns per read cost more
# than the read itself (a claim reads its run back; /api/runs reads many).
_RUNS_WITH_ALERTS = (
    sa.select(
        *[c.label(f"r_{c.name}") for c in runs.c],
        *[c.label(f"a_{c.name}") for c in alerts.c],
        notifications.c.truncated.label("n_truncated"),
    )
    .select_from(
        runs.join(alerts, runs.c.alert_id == alerts.c.id).outerjoin(
            notifications, alerts.c.notification_id == notifications.c.id
        )
    )
    .order_by(runs.c.id.desc())
)
# A transition: the SET clause is the columns given to execute() (one compiled form per set of
# columns, cached), the WHERE bound here.
_TRANSITION = sa.update(runs).where(
    runs.c.id == sa.bindparam("b_id"), runs.c.state.in_(sa.bindparam("b_states", expanding=True))
)
_STEPS_OF = (
    sa.select(steps)
    .where(steps.c.run_id.in_(sa.bindparam("b_runs", expanding=True)))
    .order_by(steps.c.run_id, steps.c.idx)
)
_CLAIM = (
    sa.update(runs)
    .where(runs.c.id == sa.bindparam("b_id"), runs.c.state == "pending")
    .values(
        state="claimed",
        owner=sa.bindparam("b_owner"),
        claimed_at=sa.bindparam("b_now", type_=runs.c.claimed_at.type),
    )
)
CANCELLABLE = "pending"


class Runs(Outbox, Events):
    """The runs' SQL."""

    def queue_state(self) -> QueueState:
        """Whether a run is due now, and when the next waiting run will be: one read.

        A read, never the writer: a worker with nothing to do looks here first, and takes the
        writer (`claim_next`) only when something is due, so idle workers never queue in front
        of an admission. A run admitted after this read rings the workers' doorbell itself.
        """

        def body(conn: Connection) -> QueueState:
            due = conn.execute(_DUE, {"b_now": self._clock()}).first() is not None
            return QueueState(due, self._as_time(conn.execute(_NEXT_WAITING).scalar()))

        return self._tx("read the run queue", body, write=False)

    def next_due(self) -> datetime | None:
        """When the next waiting run is due (None: none waits)."""
        return self.queue_state().next_due

    def _as_time(self, found: Any) -> datetime | None:
        if found is None or isinstance(found, datetime):
            return found
        # min() over SQLite's text column comes back as text, not through UTCDateTime.
        return datetime.fromisoformat(str(found)).replace(tzinfo=self._clock().tzinfo)

    def claim_next_run(self) -> RunRecord | None:
        """Take the oldest due pending run; None if none is due (`claim_next`'s run)."""
        return self.claim_next().run

    def claim_next(self) -> Claim:
        """Take the oldest due pending run (pending -> claimed by this replica).

        Due: admitted and not waiting, or waiting with its `not_before` passed. A conditional
        UPDATE (… WHERE state = 'pending') whose row count says whether this replica won; a
        loser tries the next candidate. On PostgreSQL the candidate is read with FOR UPDATE
        SKIP LOCKED, so concurrent claimers do not even queue on one row; on SQLite the write
        transaction (BEGIN IMMEDIATE) already serialises them. The same transaction looks for
        a second due run (`more_due`): only then does the engine wake another worker, instead
        of one more claim that finds nothing.
        """

        def body(conn: Connection) -> tuple[int | None, bool]:
            now = self._clock()
            for _ in range(_CLAIM_ATTEMPTS):
                candidate = conn.execute(_DUE_CANDIDATE, {"b_now": now}).scalar_one_or_none()
                if candidate is None:
                    return None, False
                won = conn.execute(
                    _CLAIM, {"b_id": candidate, "b_owner": self.replica_id, "b_now": now}
                ).rowcount
                if won == 1:
                    # A plain read, not FOR UPDATE: a row locked here would be skipped by the
                    # other claimers (SKIP LOCKED) without being claimed by this one.
                    more = conn.execute(_DUE, {"b_now": now}).first() is not None
                    return int(candidate), more
            # Lost every race: others are claiming, so runs are still there to look at.
            return None, True

        claimed, more_due = self._tx("claim a run", body)
        if claimed is None:
            return Claim(None, more_due)
        # Read back after the claim's commit, outside the one writer: a claimed run is this
        # replica's, and nothing but its owner changes it, so the record cannot be stale, and
        # the next webhook's admission does not wait behind these reads (bench/webhook.py).
        try:
            run = self._tx(
                "read a claimed run",
                lambda conn: self._select_runs(conn, runs.c.id == claimed)[0],
                write=False,
            )
        except JournalError as exc:
            # Claimed, but no worker will hold it: say which run, so it is taken back.
            raise ClaimUnread(str(exc), claimed) from exc
        return Claim(run, more_due)

    def claim_run(self, run_id: int) -> RunRecord | None:
        """Claim this pending run; None if it is not pending any more.

        For `replay --live`, which handles its own runs and never another's.
        """

        def body(conn: Connection) -> RunRecord | None:
            won = conn.execute(
                sa.update(runs)
                .where(runs.c.id == run_id, runs.c.state == "pending")
                .values(state="claimed", owner=self.replica_id, claimed_at=self._clock())
            ).rowcount
            return self._select_runs(conn, runs.c.id == run_id)[0] if won else None

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
        params = {**values, "b_id": run_id, "b_states": list(from_states)}
        changed = conn.execute(_TRANSITION, params).rowcount
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
        """A run that will not execute (notify-only, rejected, dry-run …): state `done`.

        `reports` join the outbox in the same transaction.
        """
        values: dict[str, Any] = {"decision": decision, "reason": clean(reason)}
        if playbook is not None:
            values["playbook"] = playbook
        if target is not None:
            values["target"] = target

        def body(conn: Connection) -> None:
            self._end(
                conn, run_id, ("pending", "claimed"), values, reports, what=f"decide run {run_id}"
            )

        self._tx("decide a run", body)

    def _end(
        self,
        conn: Connection,
        run_id: int,
        from_states: Sequence[str],
        values: Mapping[str, Any],
        reports: Sequence[ReportLike],
        *,
        what: str,
    ) -> None:
        """A run ends (state `done`) with `values`, its reports queued in the same transaction."""
        now = self._clock()
        for report in reports:
            self._enqueue(conn, report, run_id, now)
        # After the reports: a run in the wrong state rolls them back with it.
        self._transition(
            conn,
            run_id,
            from_states,
            {**values, "state": "done", "finished_at": now, "not_before": None},
            what,
        )

    def cancel_run(self, run_id: int, *, by: str, reason: str) -> None:
        """A person cancels a run that has not started (waiting or queued): `done`, `cancelled`.

        Raises `RunStateError` for a run that is being decided, running or done.
        """

        def body(conn: Connection) -> None:
            detail = f"run {run_id} cancelled by {by}" + (f": {reason}" if reason else "")
            values = {"decision": "cancelled", "reason": clean(detail)}
            self._end(conn, run_id, (CANCELLABLE,), values, (), what=f"cancel run {run_id}")
            self._add_event(conn, "run_cancelled", detail, run_id=run_id, actor=by)

        self._tx("cancel a run", body)

    def heartbeat(self, run_id: int) -> None:
        """A running run is alive: heartbeat_at (a no-op for a run no longer running).

        The targets a running run holds stay held while its heartbeat is fresh (rails.py).
        """
        stmt = (
            sa.update(runs)
            .where(runs.c.id == run_id, runs.c.state == "running")
            .values(heartbeat_at=self._clock())
        )
        self._tx("heartbeat a run", lambda conn: conn.execute(stmt))

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
        undo: UndoRecord | None = None,
    ) -> None:
        """Write a step (by run and index): when it starts (result `running`) and when it ends.

        The output is cut to `STEP_OUTPUT_MAX_BYTES` (64 KiB) of UTF-8, head and tail kept.
        `undo`, the immediate undo the step's result asks for, is journaled in the same
        transaction (its `index` is assigned here), so a crash can never keep the one
        without the other.
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

        def body(conn: Connection) -> None:
            conn.execute(stmt)
            if undo is None:
                return
            count = conn.execute(
                sa.select(sa.func.count()).select_from(undos).where(undos.c.run_id == run_id)
            ).scalar_one()
            conn.execute(
                sa.insert(undos).values(
                    run_id=run_id,
                    idx=int(count),
                    asked_by=undo.asked_by,
                    action=undo.action,
                    params=dict(undo.params),
                    timeout_seconds=undo.timeout_seconds,
                    why=clean(undo.why),
                    state="pending",
                    created_at=self._clock(),
                )
            )

        self._tx("record a step", body)

    def undos(self, run_id: int, *, pending_only: bool = True) -> list[UndoRecord]:
        """A run's immediate undos, newest first (only those not yet run, by default)."""
        query = sa.select(undos).where(undos.c.run_id == run_id).order_by(undos.c.idx.desc())
        if pending_only:
            query = query.where(undos.c.state == "pending")
        rows = self._tx("read undos", lambda conn: conn.execute(query).all(), write=False)
        return [
            UndoRecord(
                index=row.idx,
                asked_by=row.asked_by,
                action=row.action,
                params=row.params,
                timeout_seconds=row.timeout_seconds,
                why=row.why,
                state=row.state,
                output=row.output,
            )
            for row in rows
        ]

    def finish_undo(self, run_id: int, index: int, *, ok: bool, output: str) -> None:
        """An undo ran: `done` or `failed`, with what it said."""
        stmt = (
            sa.update(undos)
            .where(undos.c.run_id == run_id, undos.c.idx == index, undos.c.state == "pending")
            .values(state="done" if ok else "failed", output=bound_output(output),
                    done_at=self._clock())
        )  # fmt: skip
        self._tx("finish an undo", lambda conn: conn.execute(stmt))

    def owns(self, run_id: int) -> bool:
        """The fence: True while this replica holds run `run_id` running.

        A replica checks it before each step; once another replica took the run over (its
        heartbeat was silent past `lock_ttl_seconds`, e.g. SIGSTOPped) it is `done` and this
        one must act on it no more.
        """
        query = sa.select(runs.c.state, runs.c.owner).where(runs.c.id == run_id)
        row = self._tx("check a run's owner", lambda conn: conn.execute(query).first(),
                       write=False)  # fmt: skip
        return row is not None and row.state == "running" and row.owner == self.replica_id

    def _readmit(
        self, conn: Connection, run_id: int, now: datetime, *, how: str = "interrupted"
    ) -> int | None:
        """After an interruption (or a person's stop): a new pending run if it still fires.

        It goes through admission's rails like any run (the interrupted one counts in the
        breaker and left a cooldown): never re-run blindly. None when the alert resolved or
        another run of it is still to come.
        """
        alert_id = conn.execute(sa.select(runs.c.alert_id).where(runs.c.id == run_id)).scalar()
        if alert_id is None:
            return None
        status = conn.execute(sa.select(alerts.c.status).where(alerts.c.id == alert_id)).scalar()
        unfinished = conn.execute(
            sa.select(sa.func.count()).where(
                runs.c.alert_id == alert_id, runs.c.state.in_(("pending", "claimed", "running"))
            )
        ).scalar_one()
        if status != "firing" or unfinished:
            return None
        return int(
            conn.execute(
                sa.insert(runs)
                .values(alert_id=alert_id, state="pending", reason=f"after run {run_id} was "
                        f"{how}: judged again", created_at=now)
                .returning(runs.c.id)
            ).scalar_one()
        )  # fmt: skip

    def _select_runs(
        self, conn: Connection, where: sa.ColumnElement[bool], limit: int | None = None
    ) -> list[RunRecord]:
        """Runs (newest first) with their alerts and steps: two queries, however many runs."""
        query = _RUNS_WITH_ALERTS.where(where)
        if limit is not None:
            query = query.limit(limit)
        rows = conn.execute(query).mappings().all()
        by_run: dict[int, list[StepRecord]] = defaultdict(list)
        if rows:
            found = conn.execute(_STEPS_OF, {"b_runs": [row["r_id"] for row in rows]}).all()
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
                not_before=row["r_not_before"],
                wait_reason=row["r_wait_reason"],
                waiting_since=row["r_waiting_since"],
                disruptive=row["r_disruptive"],
                truncated_alerts=row["n_truncated"],
            )
            for row in rows
        ]

    def recent_runs(self, limit: int = 50) -> list[RunRecord]:
        """The newest runs first, each with its alert and steps."""
        return self._tx(
            "read recent runs", lambda conn: self._select_runs(conn, sa.true(), limit), write=False
        )

    def waiting_runs(self, limit: int = 200) -> list[RunRecord]:
        """Runs waiting for a passing reason, newest first."""
        where = sa.and_(runs.c.state == "pending", runs.c.wait_reason.is_not(None))
        return self._tx(
            "read waiting runs", lambda conn: self._select_runs(conn, where, limit), write=False
        )

    def get_run(self, run_id: int) -> RunRecord | None:
        """One run with its alert and steps; None if there is no such run."""
        found = self._tx(
            "read a run", lambda conn: self._select_runs(conn, runs.c.id == run_id), write=False
        )
        return found[0] if found else None

    def _count(self, what: str, *where: sa.ColumnElement[bool]) -> int:
        query = sa.select(sa.func.count()).select_from(runs).where(*where)
        return int(self._tx(what, lambda conn: conn.execute(query).scalar_one(), write=False))

    def count_running(self) -> int:
        """Runs executing now, fleet-wide (every replica)."""
        return self._count("count running runs", runs.c.state == "running")

    def queue_depth(self) -> int:
        """Runs waiting or being decided: pending (waiting included) + claimed."""
        return self._count("read the queue depth", runs.c.state.in_(("pending", "claimed")))

    def waiting_stats(self) -> tuple[dict[str, int], datetime | None]:
        """Waiting runs by reason, and when the longest-waiting one began to wait."""

        def body(conn: Connection) -> tuple[dict[str, int], Any]:
            waiting = sa.and_(runs.c.state == "pending", runs.c.wait_reason.is_not(None))
            rows = conn.execute(
                sa.select(runs.c.wait_reason, sa.func.count()).where(waiting)
                .group_by(runs.c.wait_reason)
            ).all()  # fmt: skip
            oldest = conn.execute(sa.select(sa.func.min(runs.c.waiting_since)).where(waiting))
            return {str(r[0]): int(r[1]) for r in rows}, oldest.scalar()

        counts, oldest = self._tx("read the waiting runs", body, write=False)
        if oldest is not None and not isinstance(oldest, datetime):
            oldest = datetime.fromisoformat(str(oldest)).replace(tzinfo=self._clock().tzinfo)
        return counts, oldest
