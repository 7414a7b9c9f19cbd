"""The rails: the one place that decides "may this run act now?", and the budgets it keeps.

`admit_to_act(run_id, plan)` judges a claimed run and acts on the verdict in one write
transaction that no other rails decision can interleave with (SQLite `BEGIN IMMEDIATE`;
PostgreSQL a transaction-level advisory lock, `Database._serialise`): the counts it reads and
the targets it takes cannot change between the check and the act, across every worker of
every replica. The rails, in order:

1. the alert still fires (its occurrence is open in the journal; the engine asked Prometheus
   just before) — else the run ends `resolved`;
2. the global pause — wait (`paused`), woken on resume;
3. the host's maintenance — wait until it ends (`until`), or until it is turned off;
4. the target's disruption budget (disruptive runs only): an open breaker on any target of the
   run's disruption set ends the run (`breaker_open`); failures counted from the runs
   themselves (below) open the breaker and call people; a cooldown on any of them waits
   until it ends;
5. the fleet-wide hourly cap on disruptive runs — wait until the oldest leaves the hour;
6. the fleet-wide concurrency cap on running runs — wait (`busy`);
7. the per-target lock: a running run whose disruption set shares a target — wait (`locked`).

Passing all of them, the run is `running` and holds its disruption set (`run_targets`).

Budgets belong to targets, not to (target, playbook). A run's *disruption set* is the target
it acts on and everything beneath it in the roster: a host holds its GPUs and servers, a GPU
the servers on it, a server itself (`remediator.playbooks.budget` computes it; a playbook may
narrow it to its own target with `policy.budget_scope: target`). Read-only playbooks (every
step a read-only action) have an empty set: they take no lock, spend no budget.

- *Cooldown*: when a disruptive run ends, every target of its set cools down for its
  playbook's `cooldown_seconds` (a longer cooldown already set is kept).
- *Breaker*: the failures of a target are the disruptive runs on it (its set included it)
  that ended `failed`, `not_healed` or `interrupted` within the judging playbook's
  `window_seconds`, plus the heals in that window that did not stick (finished before the
  judged run's alert came). Reaching the playbook's `max_failures` opens the target's breaker:
  only a person closes it (`reset_breaker`), and failures before a reset no longer count.

A run refused for a passing reason waits (`pending` with `not_before` and `wait_reason`) and
is judged again when it is due, while its alert fires — at most `limits.max_wait_seconds`,
then it ends `expired`; past `wait_report_after_seconds` a short report says it waits.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from remediator.config import Limits
from remediator.journal.db import RunStateError, clean
from remediator.journal.records import Breaker, ReportLike
from remediator.journal.runs import Runs
from remediator.journal.schema import (
    alerts,
    events,
    maintenance,
    run_targets,
    runs,
    settings,
    target_breakers,
    target_cooldowns,
)

FAILED_OUTCOMES = ("failed", "not_healed", "interrupted")
HEALED_OUTCOMES = ("healed", "done_unverified")

# How soon a waiting run is looked at again when nothing tells the engine sooner: a pause or
# maintenance without an end, a busy fleet, a held target. Resume, the end of maintenance and
# a run that finishes make the runs waiting for them due at once.
RECHECK = timedelta(seconds=30)
RECHECK_SHORT = timedelta(seconds=5)


@dataclass(frozen=True)
class Plan:
    """What a claimed run asks to do, for the rails to judge whole."""

    playbook: str
    host: str
    target: str  # the target key it acts on
    disruption: tuple[str, ...]  # every target key its steps touch; () when read-only
    cooldown_seconds: float
    max_failures: int
    window_seconds: float

    @property
    def disruptive(self) -> bool:
        """True when the run's steps change something."""
        return bool(self.disruption)


@dataclass(frozen=True)
class Verdict:
    """What the rails decided: `run`, `wait`, or an end (`resolved`, `breaker_open`, `expired`)."""

    decision: str
    reason: str
    wait_reason: str | None = None
    not_before: datetime | None = None
    opened: bool = False  # this decision opened the breaker: people are called

    @property
    def may_act(self) -> bool:
        """True when the run is now `running`."""
        return self.decision == "run"


RailsReports = Callable[[Verdict], Sequence[ReportLike]]
"""The reports of a decision (a wait's short report, an expiry, an escalation), rendered in
the deciding transaction; it must not block."""


def _wait(reason: str, why: str, not_before: datetime) -> Verdict:
    return Verdict("wait", why, wait_reason=reason, not_before=not_before)


class Rails(Runs):
    """The rails' SQL: the decision, budgets, pause, maintenance, caps."""

    limits: Limits = Limits()
    lock_ttl: timedelta = timedelta(seconds=900)

    # -- the decision ------------------------------------------------------------------------

    def admit_to_act(
        self, run_id: int, plan: Plan, *, reports: RailsReports | None = None
    ) -> Verdict:
        """Judge claimed run `run_id` for `plan` and act on the verdict, in one transaction.

        `run`: the run is `running` and holds its disruption set. `wait`: it is `pending`
        again with a `not_before`. `resolved`, `breaker_open`, `expired`: it is `done`.
        Raises `RunStateError` unless this replica holds the run claimed.
        """

        def body(conn: Connection) -> Verdict:
            self._serialise(conn)
            now = self._clock()
            row = conn.execute(
                sa.select(
                    runs.c.state, runs.c.owner, runs.c.created_at, runs.c.waiting_since,
                    runs.c.wait_reported, alerts.c.status,
                ).select_from(runs.join(alerts, runs.c.alert_id == alerts.c.id))
                .where(runs.c.id == run_id)
            ).first()  # fmt: skip
            if row is None or row.state != "claimed" or row.owner != self.replica_id:
                state = "missing" if row is None else f"{row.state} ({row.owner})"
                raise RunStateError(f"cannot judge run {run_id}: it is {state}, not claimed")
            named = {"playbook": plan.playbook, "target": plan.target}
            if row.status != "firing":
                verdict = Verdict("resolved", "the alert resolved before the run could act")
                self._end(conn, run_id, ("claimed",), {**named, "decision": "resolved",
                          "reason": verdict.reason}, (), what=f"close run {run_id}")  # fmt: skip
                return verdict
            verdict = self._judge(conn, run_id, plan, row.created_at, now)
            if verdict.may_act:
                self._start(conn, run_id, plan, now)
                return verdict
            if verdict.decision == "breaker_open":
                rendered = reports(verdict) if reports is not None else ()
                values = {**named, "decision": "breaker_open", "reason": verdict.reason}
                self._end(conn, run_id, ("claimed",), values, rendered, what=f"refuse run {run_id}")
                return verdict
            since = row.waiting_since or now
            max_wait = timedelta(seconds=self.limits.max_wait_seconds)
            if now - since >= max_wait:
                waited = int((now - since).total_seconds())
                verdict = Verdict(
                    "expired", f"waited {waited} s without a chance to act; last: {verdict.reason}"
                )
                rendered = reports(verdict) if reports is not None else ()
                values = {**named, "decision": "expired", "reason": verdict.reason}
                self._end(conn, run_id, ("claimed",), values, rendered, what=f"expire run {run_id}")
                return verdict
            assert verdict.not_before is not None
            not_before = min(verdict.not_before, since + max_wait)
            report_now = not row.wait_reported and now - since >= timedelta(
                seconds=self.limits.wait_report_after_seconds
            )
            if report_now and reports is not None:
                for report in reports(verdict):
                    self._enqueue(conn, report, run_id, now)
            self._transition(
                conn,
                run_id,
                ("claimed",),
                {
                    **named,
                    "state": "pending",
                    "owner": None,
                    "claimed_at": None,
                    "reason": clean(verdict.reason),
                    "decision": None,
                    "not_before": not_before,
                    "wait_reason": verdict.wait_reason,
                    "waiting_since": since,
                    "wait_reported": bool(row.wait_reported or report_now),
                },
                f"put run {run_id} back to wait",
            )
            return Verdict("wait", verdict.reason, verdict.wait_reason, not_before)

        return self._tx("judge a run", body)

    def _judge(
        self, conn: Connection, run_id: int, plan: Plan, created_at: datetime, now: datetime
    ) -> Verdict:
        """The first rail that stops the run, or `run`."""
        if self._paused(conn):
            return _wait("paused", "remediation is paused (resume: POST /api/resume or "
                         "`gpu-fleet-remediator resume`)", now + RECHECK)  # fmt: skip
        window = self._maintenance_window(conn, plan.host, now)
        if window is not None:
            until, why = window
            ends = f"until {until:%F %T}Z" if until is not None else "until turned off"
            return _wait("maintenance", f"host {plan.host} is in maintenance {ends}: {why}",
                         until if until is not None else now + RECHECK)  # fmt: skip
        if plan.disruptive:
            stopped = self._budget(conn, run_id, plan, created_at, now)
            if stopped is not None:
                return stopped
            hour_ago = now - timedelta(hours=1)
            # Strictly within the hour: a run that started exactly an hour ago has left it,
            # so the run told to wait until then (oldest + 1 h) is free when it is due.
            started = conn.execute(
                sa.select(sa.func.count(), sa.func.min(runs.c.started_at)).where(
                    runs.c.disruptive.is_(True), runs.c.started_at > hour_ago
                )
            ).one()
            if started[0] >= self.limits.max_runs_per_hour:
                oldest = _as_time(started[1], now)
                return _wait("rate_limited", f"fleet-wide cap: {started[0]} disruptive runs "
                             f"started in the last hour (max_runs_per_hour "
                             f"{self.limits.max_runs_per_hour})",
                             oldest + timedelta(hours=1))  # fmt: skip
        alive = runs.c.heartbeat_at >= now - self.lock_ttl
        running = conn.execute(
            sa.select(sa.func.count()).where(runs.c.state == "running", alive)
        ).scalar_one()
        if running >= self.limits.max_concurrent_runs:
            return _wait("busy", f"fleet-wide concurrency cap: {running} runs acting "
                         f"(max_concurrent_runs {self.limits.max_concurrent_runs})",
                         now + RECHECK_SHORT)  # fmt: skip
        if plan.disruptive:
            holder = conn.execute(
                sa.select(run_targets.c.target, runs.c.id)
                .select_from(run_targets.join(runs, run_targets.c.run_id == runs.c.id))
                .where(run_targets.c.target.in_(plan.disruption), runs.c.state == "running",
                       alive)
                .limit(1)
            ).first()  # fmt: skip
            if holder is not None:
                return _wait("locked", f"run {holder.id} is acting on {holder.target}",
                             now + RECHECK_SHORT)  # fmt: skip
        return Verdict("run", "")

    def _budget(
        self, conn: Connection, run_id: int, plan: Plan, created_at: datetime, now: datetime
    ) -> Verdict | None:
        """The disruption budget: an open breaker, a breaker that opens now, or a cooldown."""
        open_ = conn.execute(
            sa.select(target_breakers.c.target, target_breakers.c.opened_at).where(
                target_breakers.c.target.in_(plan.disruption),
                target_breakers.c.state == "open",
            )
        ).first()
        if open_ is not None:
            return Verdict(
                "breaker_open",
                f"the circuit breaker of {open_.target} is open since {open_.opened_at:%F %T}Z; "
                "people were called, acting stays stopped until a person resets it "
                f"(`gpu-fleet-remediator breaker reset {open_.target}`)",
            )
        failures = self._failures(conn, plan.target, plan.window_seconds, now, before=created_at)
        if failures >= plan.max_failures:
            why = (
                f"{failures} disruptive runs on {plan.target} did not heal, or healed and the "
                f"problem came back, within {int(plan.window_seconds)} s"
            )
            self._open_breaker(conn, plan.target, playbook=plan.playbook, run_id=run_id, why=why,
                               now=now)  # fmt: skip
            return Verdict("breaker_open", f"circuit breaker opened: {why}; people called",
                           opened=True)  # fmt: skip
        until = conn.execute(
            sa.select(target_cooldowns.c.target, target_cooldowns.c.until,
                      target_cooldowns.c.playbook)
            .where(target_cooldowns.c.target.in_(plan.disruption),
                   target_cooldowns.c.until > now)
            .order_by(target_cooldowns.c.until.desc())
            .limit(1)
        ).first()  # fmt: skip
        if until is not None:
            return _wait("cooldown", f"{until.target} cools down until {until.until:%F %T}Z "
                         f"(after {until.playbook or 'a run'})", until.until)  # fmt: skip
        return None

    def _failures(
        self,
        conn: Connection,
        target: str,
        window_seconds: float,
        now: datetime,
        *,
        before: datetime | None = None,
    ) -> int:
        """Failures of `target` within the window since its last reset (see the module).

        Heals count as failures when they finished before `before` (the judged run's alert
        came after them: they did not stick).
        """
        since = now - timedelta(seconds=window_seconds)
        reset = conn.execute(
            sa.select(target_breakers.c.reset_at).where(target_breakers.c.target == target)
        ).scalar()
        if reset is not None and reset > since:
            since = reset
        on_target = sa.and_(
            run_targets.c.target == target,
            runs.c.state == "done",
            runs.c.finished_at >= since,
        )
        counted: sa.ColumnElement[bool] = runs.c.outcome.in_(FAILED_OUTCOMES)
        if before is not None:
            counted = sa.or_(
                counted,
                sa.and_(runs.c.outcome.in_(HEALED_OUTCOMES), runs.c.finished_at < before),
            )
        found = conn.execute(
            sa.select(sa.func.count(sa.distinct(runs.c.id)))
            .select_from(run_targets.join(runs, run_targets.c.run_id == runs.c.id))
            .where(on_target, counted)
        ).scalar_one()
        return int(found)

    def _open_breaker(
        self, conn: Connection, target: str, *, playbook: str, run_id: int, why: str,
        now: datetime,
    ) -> None:  # fmt: skip
        values = {"target": target, "state": "open", "opened_at": now, "playbook": playbook,
                  "run_id": run_id, "reason": clean(why)}  # fmt: skip
        stmt = self._insert(target_breakers).values(**values)
        keep = {k: stmt.excluded[k] for k in values if k != "target"}
        conn.execute(stmt.on_conflict_do_update(index_elements=["target"], set_=keep))
        self._add_event(
            conn,
            "escalation",
            f"circuit breaker opened for {target} ({playbook}): {why}. Acting on this target "
            "stopped; a person must look.",
            run_id=run_id,
            playbook=playbook,
            target=target,
        )

    def _start(self, conn: Connection, run_id: int, plan: Plan, now: datetime) -> None:
        alive = runs.c.heartbeat_at >= now - self.lock_ttl
        if plan.disruptive:
            stale = conn.execute(
                sa.select(run_targets.c.target, runs.c.id, runs.c.owner, runs.c.heartbeat_at)
                .select_from(run_targets.join(runs, run_targets.c.run_id == runs.c.id))
                .where(run_targets.c.target.in_(plan.disruption), runs.c.state == "running",
                       ~alive)
            ).all()  # fmt: skip
            for held in stale:
                self._add_event(
                    conn,
                    "lock_takeover",
                    f"{held.target} was held by run {held.id} ({held.owner}), silent since "
                    f"{held.heartbeat_at:%F %T}Z (over lock_ttl_seconds); taken by run {run_id} "
                    f"({self.replica_id})",
                    run_id=run_id,
                    target=held.target,
                )
            conn.execute(
                sa.insert(run_targets),
                [{"run_id": run_id, "target": target} for target in plan.disruption],
            )
        self._transition(
            conn,
            run_id,
            ("claimed",),
            {
                "state": "running",
                "playbook": plan.playbook,
                "target": plan.target,
                "decision": "run",
                "reason": "",
                "started_at": now,
                "heartbeat_at": now,
                "disruptive": plan.disruptive,
                "not_before": None,
                "wait_reason": None,
            },
            f"start run {run_id}",
        )

    # -- the end of a run --------------------------------------------------------------------

    def finish_run(
        self,
        run_id: int,
        *,
        outcome: str,
        verification: str,
        plan: Plan | None = None,
        reports: Sequence[ReportLike] = (),
        on_open: Sequence[ReportLike] = (),
    ) -> bool:
        """A run ends with its outcome, budgets and reports in one transaction.

        True when the breaker of its target opened.
        With a disruptive `plan`: every target of its set cools down for the playbook's
        `cooldown_seconds`, and a failure that brings the target to `max_failures` opens its
        breaker (`on_open`, the escalation's reports, are queued only then). Runs waiting for
        the targets or places it held become due. An `interrupted` run (a graceful stop cut
        it short, its undos done) is judged again through a new run if its alert still fires.
        """

        def body(conn: Connection) -> bool:
            now = self._clock()
            values: dict[str, Any] = {"outcome": outcome, "verification": clean(verification)}
            if outcome == "interrupted":
                values["interrupt_reported"] = True  # its report is in `reports`
            self._end(conn, run_id, ("claimed", "running"), values, reports,
                      what=f"finish run {run_id}")  # fmt: skip
            opened = False
            if plan is not None and plan.disruptive:
                until = now + timedelta(seconds=plan.cooldown_seconds)
                for target in plan.disruption:
                    self._cool(conn, target, until, run_id, plan.playbook)
                if outcome in FAILED_OUTCOMES:
                    failures = self._failures(conn, plan.target, plan.window_seconds, now)
                    already = conn.execute(
                        sa.select(target_breakers.c.state).where(
                            target_breakers.c.target == plan.target
                        )
                    ).scalar()
                    if failures >= plan.max_failures and already != "open":
                        why = f"{failures} disruptive runs on {plan.target} did not heal " \
                              f"within {int(plan.window_seconds)} s"  # fmt: skip
                        self._open_breaker(conn, plan.target, playbook=plan.playbook,
                                           run_id=run_id, why=why, now=now)  # fmt: skip
                        for report in on_open:
                            self._enqueue(conn, report, run_id, now)
                        opened = True
            self._make_due(conn, ("locked", "busy", "rate_limited"), now)
            if outcome in ("interrupted", "cancelled"):
                # Judged again, if its alert still fires: a stopped run waits for the resume
                # (or the end of maintenance) and its cooldown, never re-run blindly.
                self._readmit(conn, run_id, now, how=outcome)
            return opened

        return self._tx("finish a run", body)

    def _cool(self, conn: Connection, target: str, until: datetime, run_id: int,
              playbook: str) -> None:  # fmt: skip
        current = conn.execute(
            sa.select(target_cooldowns.c.until).where(target_cooldowns.c.target == target)
        ).scalar()
        if current is not None and current >= until:
            return  # a longer cooldown is kept
        conn.execute(self._upsert(target_cooldowns, ("target",), {
            "target": target, "until": until, "run_id": run_id, "playbook": playbook}))  # fmt: skip

    def _make_due(self, conn: Connection, reasons: Sequence[str], now: datetime) -> None:
        """Runs waiting for one of `reasons` are judged again at once."""
        conn.execute(
            sa.update(runs)
            .where(runs.c.state == "pending", runs.c.wait_reason.in_(reasons),
                   runs.c.not_before > now)
            .values(not_before=now)
        )  # fmt: skip

    # -- pause, maintenance ------------------------------------------------------------------

    def _paused(self, conn: Connection) -> bool:
        value = conn.execute(
            sa.select(settings.c.value).where(settings.c.key == "paused")
        ).scalar_one_or_none()
        return value == "true"

    def paused(self) -> bool:
        """True while all remediation is paused (fleet-wide)."""
        return self._tx("read the pause", self._paused, write=False)

    def set_paused(self, paused: bool, *, by: str, reason: str = "") -> None:
        """Pause or resume all remediation; journaled (`paused`/`resumed`) with who and why.

        Resuming makes the runs that waited for it due at once.
        """
        kind = "paused" if paused else "resumed"
        detail = f"remediation {kind} by {by}" + (f": {reason}" if reason else "")

        def body(conn: Connection) -> None:
            value = "true" if paused else "false"
            conn.execute(self._upsert(settings, ("key",), {"key": "paused", "value": value}))
            self._add_event(conn, kind, detail, actor=by)
            if not paused:
                self._make_due(conn, ("paused",), self._clock())

        self._tx("set the pause", body)

    def _maintenance_window(
        self, conn: Connection, host: str, now: datetime
    ) -> tuple[datetime | None, str] | None:
        row = conn.execute(
            sa.select(maintenance.c.until, maintenance.c.reason).where(maintenance.c.host == host)
        ).first()
        if row is None or (row.until is not None and row.until <= now):
            return None
        return row.until, row.reason

    def maintenance(self) -> dict[str, tuple[datetime, str]]:
        """Hosts in maintenance now: host -> (since, reason). Ended windows are left out."""
        return {
            host: (since, why) for host, (since, _, why, _) in self.maintenance_windows().items()
        }

    def maintenance_windows(self) -> dict[str, tuple[datetime, datetime | None, str, str]]:
        """Hosts in maintenance now: host -> (since, until or None, reason, by)."""
        now = self._clock()
        rows = self._tx(
            "read maintenance", lambda conn: conn.execute(sa.select(maintenance)).all(), write=False
        )
        return {row.host: (row.since, row.until, row.reason, row.by) for row in rows
                if row.until is None or row.until > now}  # fmt: skip

    def set_maintenance(
        self, host: str, on: bool, *, by: str, reason: str = "", until: datetime | None = None
    ) -> None:
        """Put a host in maintenance (until `until`, or until turned off) or take it out.

        Journaled as `maintenance_on`/`_off` with who and why. Turning it on again updates
        the reason and the end but keeps `since`. Taking it out makes the runs that waited for
        it due at once (a window that ends by itself wakes them at its `until`).
        """
        kind = "maintenance_on" if on else "maintenance_off"
        state = "in maintenance" if on else "out of maintenance"
        ends = f" until {until:%F %T}Z" if on and until is not None else ""
        detail = f"host {host} {state}{ends} by {by}" + (f": {reason}" if reason else "")

        def body(conn: Connection) -> None:
            now = self._clock()
            if on:
                stmt = self._insert(maintenance).values(
                    host=host, since=now, reason=clean(reason), by=by, until=until
                )
                current = conn.execute(
                    sa.select(maintenance.c.until).where(maintenance.c.host == host)
                ).first()
                if current is not None and current.until is not None and current.until <= now:
                    conn.execute(sa.delete(maintenance).where(maintenance.c.host == host))
                conn.execute(
                    stmt.on_conflict_do_update(
                        index_elements=["host"],
                        set_={"reason": stmt.excluded.reason, "by": stmt.excluded.by,
                              "until": stmt.excluded.until},
                    )
                )  # fmt: skip
                if until is not None:
                    # Waiting runs of the host become due when the window ends, not later.
                    conn.execute(
                        sa.update(runs)
                        .where(runs.c.state == "pending", runs.c.wait_reason == "maintenance",
                               runs.c.not_before > until)
                        .values(not_before=until)
                    )  # fmt: skip
            else:
                conn.execute(sa.delete(maintenance).where(maintenance.c.host == host))
                self._make_due(conn, ("maintenance",), now)
            self._add_event(conn, kind, detail, target=host, actor=by)

        self._tx("set maintenance", body)

    # -- breakers and cooldowns, as people see them ------------------------------------------

    def breakers(self, *, only_open: bool = True) -> list[Breaker]:
        """The targets' breakers (the open ones by default), oldest opening first."""
        query = sa.select(target_breakers).order_by(
            target_breakers.c.opened_at, target_breakers.c.target
        )
        if only_open:
            query = query.where(target_breakers.c.state == "open")
        rows = self._tx("read the breakers", lambda c: c.execute(query).all(), write=False)
        return [
            Breaker(
                target=row.target,
                open=row.state == "open",
                opened_at=row.opened_at,
                playbook=row.playbook,
                reason=row.reason,
                reset_at=row.reset_at,
                reset_by=row.reset_by,
            )
            for row in rows
        ]

    def open_breakers(self) -> list[tuple[str, str, datetime]]:
        """Every open breaker: (target, the playbook that opened it, opened_at), oldest first."""
        return [(b.target, b.playbook or "", b.opened_at) for b in self.breakers()
                if b.opened_at is not None]  # fmt: skip

    def reset_breaker(self, target: str, *, by: str, reason: str = "") -> bool:
        """A person closes a target's breaker; failures before now no longer count.

        Journaled (`breaker_reset`) with who and why. False when it was not open.
        """

        def body(conn: Connection) -> bool:
            now = self._clock()
            changed = conn.execute(
                sa.update(target_breakers)
                .where(target_breakers.c.target == target, target_breakers.c.state == "open")
                .values(state="closed", reset_at=now, reset_by=by)
            ).rowcount
            if changed:
                detail = f"breaker of {target} reset by {by}" + (f": {reason}" if reason else "")
                self._add_event(conn, "breaker_reset", detail, target=target, actor=by)
            return bool(changed)

        return self._tx("reset a breaker", body)

    def cooldowns(self) -> list[tuple[str, datetime, str | None]]:
        """Targets cooling down now: (target, until, the playbook that left it), soonest first."""
        now = self._clock()
        query = (
            sa.select(target_cooldowns.c.target, target_cooldowns.c.until,
                      target_cooldowns.c.playbook)
            .where(target_cooldowns.c.until > now)
            .order_by(target_cooldowns.c.until)
        )  # fmt: skip
        rows = self._tx("read the cooldowns", lambda c: c.execute(query).all(), write=False)
        return [(row.target, row.until, row.playbook) for row in rows]

    def acknowledge(self, event_id: int, *, by: str, reason: str = "") -> int:
        """A person acknowledges an escalation; the `escalation_ack` event's id.

        Raises `RunStateError` when `event_id` is not an escalation.
        """

        def body(conn: Connection) -> int:
            row = conn.execute(sa.select(events).where(events.c.id == event_id)).first()
            if row is None or row.kind != "escalation":
                raise RunStateError(f"event {event_id} is not an escalation")
            detail = f"escalation {event_id} acknowledged by {by}" + (
                f": {reason}" if reason else ""
            )
            return self._add_event(conn, "escalation_ack", detail, run_id=row.run_id,
                                   playbook=row.playbook, target=row.target, actor=by,
                                   ref_id=event_id)  # fmt: skip

        return self._tx("acknowledge an escalation", body)

    def count_started_since(self, since: datetime) -> int:
        """Disruptive runs that started at or after `since`, fleet-wide (the hourly cap)."""
        return self._count(
            "count started runs", runs.c.started_at >= since, runs.c.disruptive.is_(True)
        )


def _as_time(value: Any, fallback: datetime) -> datetime:
    """A time from an aggregate (SQLite gives text, not through UTCDateTime)."""
    if value is None:
        return fallback
    if isinstance(value, datetime):
        return value if value.tzinfo is not None else value.replace(tzinfo=fallback.tzinfo)
    return datetime.fromisoformat(str(value)).replace(tzinfo=fallback.tzinfo)
