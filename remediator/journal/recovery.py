"""Recovery: runs a stop, a crash or a lost replica cut short, undone and judged again.

A run is interrupted when the replica acting on it stops before it ends:

- at a graceful stop (SIGTERM) the engine itself ends it `interrupted` after its undos ran
  (`Rails.finish_run(…, outcome="interrupted")`);
- after a crash, the replica's next start takes back its own runs (`recover_interrupted`);
- when a replica goes silent — killed, its host gone, SIGSTOPped — any other replica takes its
  runs over once their heartbeat is older than `lock_ttl_seconds` (`take_over_stale`). The
  run becomes the taker's, `done`, so the silent one, should it wake, fails the fence
  (`Runs.owns`) before its next step and acts no more.

Either way the run is marked `done`, outcome `interrupted`, and owned by the replica that
finishes the job (`interruptions_to_complete`): that replica runs the run's pending immediate
undos, then `complete_interruption` queues the report (naming what was undone and what is
still pending), starts the targets' cooldown, and — if the alert still fires — makes a new
pending run that admission's rails judge like any other (the interrupted run counts as a
failure in the breaker). A half-done action is never repeated blindly.

Claims a silent replica left (`claimed` past the TTL) go back to `pending`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from datetime import timedelta

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from remediator.journal.rails import Rails
from remediator.journal.records import ReportLike, RunRecord
from remediator.journal.schema import locks, run_targets, runs, steps


class Recovery(Rails):
    """Interrupted runs: recovered, taken over, completed."""

    def _interrupt(self, conn: Connection, run_ids: Sequence[int], why: str) -> list[int]:
        """Mark running runs `done`/`interrupted`, owned by this replica; those it changed."""
        now = self._clock()
        changed = []
        for run_id in run_ids:
            row = conn.execute(
                sa.update(runs)
                .where(runs.c.id == run_id, runs.c.state == "running")
                .values(
                    state="done", outcome="interrupted", finished_at=now, owner=self.replica_id,
                    verification=f"interrupted: {why}; not re-run", interrupt_reported=False,
                )
                .returning(runs.c.id, runs.c.playbook, runs.c.target)
            ).first()  # fmt: skip
            if row is None:
                continue  # it ended or was taken meanwhile
            changed.append(int(row.id))
            conn.execute(
                sa.update(steps)
                .where(steps.c.run_id == run_id, steps.c.result == "running")
                .values(result="interrupted", finished_at=now)
            )
            self._add_event(conn, "interrupted", f"run {row.id} ({row.playbook} on {row.target}) "
                            f"{why}; marked interrupted, not re-run", run_id=row.id,
                            playbook=row.playbook, target=row.target)  # fmt: skip
        return changed

    def recover_interrupted(
        self, reports_for: Callable[[RunRecord], Sequence[ReportLike]] | None = None
    ) -> list[int]:
        """At start-up, take back this replica's runs a crash or kill left behind.

        Claimed (not yet acting) -> pending again: a worker decides them afresh. Running ->
        `interrupted`, to be completed (`interruptions_to_complete`: undos, then the report)
        — unless `reports_for(run)` gives the reports now, queued in this transaction (for a
        caller that runs no undos). Leases this replica held before it stopped are released.
        Returns the interrupted run ids.
        """

        def body(conn: Connection) -> list[int]:
            mine = conn.execute(
                sa.select(runs.c.id, runs.c.state)
                .where(runs.c.owner == self.replica_id, runs.c.state.in_(("claimed", "running")))
                .order_by(runs.c.id)
            ).all()
            self._unclaim(conn, [row.id for row in mine if row.state == "claimed"])
            running = [int(row.id) for row in mine if row.state == "running"]
            why = f"was executing when replica {self.replica_id} stopped"
            interrupted = self._interrupt(conn, running, why)
            if reports_for is not None and interrupted:
                now = self._clock()
                for run in self._select_runs(conn, runs.c.id.in_(interrupted)):
                    for report in reports_for(run):
                        self._enqueue(conn, report, run.id, now)
                conn.execute(
                    sa.update(runs)
                    .where(runs.c.id.in_(interrupted))
                    .values(interrupt_reported=True)
                )
            conn.execute(sa.delete(locks).where(locks.c.owner == self.replica_id))
            return interrupted

        return self._tx("recover interrupted runs", body)

    def _unclaim(self, conn: Connection, claimed: Sequence[int]) -> None:
        """Claimed runs no worker decides any more go back to `pending`, owned by nobody."""
        if claimed:
            conn.execute(
                sa.update(runs)
                .where(runs.c.id.in_(list(claimed)), runs.c.state == "claimed")
                .values(state="pending", owner=None, claimed_at=None)
            )

    def recover_orphans(self, run_ids: Sequence[int]) -> list[int]:
        """This replica's runs a journal failure cut short in a worker, taken back now.

        The worker's handling of each ended in a `JournalError` (the database went away in the
        middle), so no thread acts on them any more: claimed ones go back to `pending`,
        running ones become `interrupted` (to be completed: undos, then the report), as at a
        start after a crash — at once, not after `lock_ttl_seconds`. Runs that ended or are
        another replica's meanwhile are left alone. Returns the interrupted run ids.
        """

        def body(conn: Connection) -> list[int]:
            mine = conn.execute(
                sa.select(runs.c.id, runs.c.state).where(
                    runs.c.id.in_(list(run_ids)),
                    runs.c.owner == self.replica_id,
                    runs.c.state.in_(("claimed", "running")),
                )
            ).all()
            self._unclaim(conn, [row.id for row in mine if row.state == "claimed"])
            running = [int(row.id) for row in mine if row.state == "running"]
            why = f"lost its journal on replica {self.replica_id} while executing"
            return self._interrupt(conn, running, why)

        return self._tx("recover runs a journal failure cut short", body)

    def take_over_stale(self) -> list[int]:
        """Take over the runs of replicas whose heartbeat is older than `lock_ttl`.

        Their running runs become this replica's, `interrupted` (their places under the caps
        and their targets are free at once); their claims go back to `pending`. Returns the
        runs taken over.
        """

        def body(conn: Connection) -> list[int]:
            now = self._clock()
            silent_since = now - self.lock_ttl
            stale = conn.execute(
                sa.select(runs.c.id, runs.c.owner, runs.c.heartbeat_at)
                .where(runs.c.state == "running", runs.c.heartbeat_at < silent_since)
                .order_by(runs.c.id)
                .with_for_update(skip_locked=True)
            ).all()
            taken: list[int] = []
            for row in stale:
                why = (
                    f"was executing on replica {row.owner}, silent since "
                    f"{row.heartbeat_at:%F %T}Z (over lock_ttl_seconds); taken over by "
                    f"replica {self.replica_id}"
                )
                for run_id in self._interrupt(conn, [int(row.id)], why):
                    self._add_event(conn, "takeover", f"run {run_id}: {why}", run_id=run_id)
                    taken.append(run_id)
            conn.execute(
                sa.update(runs)
                .where(runs.c.state == "claimed", runs.c.claimed_at < silent_since)
                .values(state="pending", owner=None, claimed_at=None)
            )
            return taken

        return self._tx("take over silent replicas' runs", body)

    def interruptions_to_complete(self) -> list[RunRecord]:
        """This replica's interrupted runs whose undos and report are still to be done."""
        where = sa.and_(
            runs.c.state == "done",
            runs.c.outcome == "interrupted",
            runs.c.owner == self.replica_id,
            runs.c.interrupt_reported.is_(False),
        )
        return self._tx(
            "read interrupted runs", lambda conn: self._select_runs(conn, where), write=False
        )

    def complete_interruption(
        self,
        run_id: int,
        *,
        reports: Sequence[ReportLike] = (),
        cooldown_seconds: float = 0.0,
    ) -> int | None:
        """An interrupted run's undos ran: its report, cooldown and re-admission, at once.

        Once only (a second call does nothing). Returns the new run's id, if the alert still
        fires and so is judged again.
        """

        def body(conn: Connection) -> int | None:
            now = self._clock()
            done = conn.execute(
                sa.update(runs)
                .where(runs.c.id == run_id, runs.c.outcome == "interrupted",
                       runs.c.interrupt_reported.is_(False))
                .values(interrupt_reported=True)
            ).rowcount  # fmt: skip
            if not done:
                return None
            for report in reports:
                self._enqueue(conn, report, run_id, now)
            row = conn.execute(sa.select(runs.c.playbook).where(runs.c.id == run_id)).first()
            until = now + timedelta(seconds=cooldown_seconds)
            targets = conn.execute(
                sa.select(run_targets.c.target).where(run_targets.c.run_id == run_id)
            ).scalars()
            for target in targets:
                self._cool(conn, target, until, run_id, row.playbook if row else "")
            self._make_due(conn, ("locked", "busy", "rate_limited"), now)
            return self._readmit(conn, run_id, now)

        return self._tx("complete an interruption", body)
