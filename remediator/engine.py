"""The engine: workers that take journaled runs, decide, act, verify and journal every step.

A run's life, all of it in the journal (so replicas agree and a crash loses nothing):
`pending` (the webhook journaled a new firing alert) → `claimed` by one worker of one replica →
a decision: `notify_only` (no playbook), `rejected` (target not in the roster), `paused`,
`maintenance`, `breaker_open`, `cooldown`, `rate_limited`, `dry_run`, `locked` (another run
holds the target) — or `run`: `running`, steps one by one, verification, then `done` with an
outcome (`healed`, `not_healed`, `failed`, `done_unverified`). A run that was executing when
the process died is marked `interrupted` at the next start and reported, never re-run blindly.

The engine does not care which kind of action a step is: actions are looked up by name in the
registry and run with typed params filled from the roster-resolved target only.

With a `Reporter` (Zulip configured), every end of a run — an outcome, a decision that ran
nothing, an interruption, an escalation — queues its report in the outbox in the same
transaction that journals it; a report that cannot be rendered is logged and never stops a run.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta

from exporter.roster import Roster
from remediator.actions.power import restore_due_power_caps
from remediator.actions.registry import (
    ActionContext,
    StepResult,
    Undo,
    get_action,
    render_params,
    run_action,
)
from remediator.actions.settings import ActionSettings
from remediator.alerts import Alert
from remediator.journal.store import (
    AlertRecord,
    Journal,
    JournalError,
    QueuedReport,
    RunRecord,
    RunStateError,
)
from remediator.metrics import RemediatorMetrics
from remediator.notify.report import Reporter
from remediator.playbooks.loader import Rejection, Target, match_playbook, resolve_target
from remediator.playbooks.model import Playbook
from remediator.policy import Limits, judge
from remediator.verify import promql_holds

log = logging.getLogger(__name__)

HEALED = ("healed", "done_unverified")


def _utcnow() -> datetime:
    return datetime.now(UTC)


@dataclass(frozen=True)
class EngineSettings:
    """How the engine works; from the config."""

    workers: int
    limits: Limits
    dry_run: bool
    prometheus_url: str
    lock_ttl: timedelta
    poll_seconds: float = 1.0
    heartbeat_seconds: float = 5.0
    prune_seconds: float = 3600.0
    # A burst of notifications is ingested once it has been quiet this long, or at the latest
    # after ingest_max_delay_seconds: while Alertmanager is delivering, the webhook keeps the
    # journal's write lock (and the GIL) to itself and answers fast.
    ingest_quiet_seconds: float = 0.1
    ingest_max_delay_seconds: float = 1.0
    # What host actions need (executors, allow-lists); the default lets them refuse clearly.
    actions: ActionSettings = field(default_factory=ActionSettings)


@dataclass
class RunEffects:
    """What a run's steps asked of the engine beyond their verdicts (see actions/registry.py).

    `undos`: compensating steps, with the index of the step that asked, run at the end of the
    run whatever happened; `escalations`: reasons to call people; `finished`: the run ended
    early and successfully (a false alarm), no further steps and no verification.
    """

    undos: list[tuple[int, Undo]] = field(default_factory=list)
    escalations: list[str] = field(default_factory=list)
    finished: str | None = None
    undone: bool = False


def alert_of(record: AlertRecord) -> Alert:
    """The journaled alert as the playbooks see it."""
    return Alert(
        status="firing" if record.status == "firing" else "resolved",
        labels=record.labels,
        annotations=record.annotations,
        startsAt=record.starts_at,
        generatorURL=record.generator_url,
        fingerprint=record.fingerprint,
    )


class Engine:
    """Worker threads over the journal's queue."""

    def __init__(
        self,
        journal: Journal,
        roster: Roster,
        playbooks: list[Playbook],
        settings: EngineSettings,
        *,
        metrics: RemediatorMetrics,
        clock: Callable[[], datetime] = _utcnow,
        reporter: Reporter | None = None,
        on_report: Callable[[], None] | None = None,
    ) -> None:
        self.journal = journal
        self.reporter = reporter
        self._on_report = on_report
        self.roster = roster
        self.playbooks = playbooks
        self.settings = settings
        self.metrics = metrics
        self._clock = clock
        self._wake = threading.Event()  # runs are queued
        self._accepted = threading.Event()  # the webhook accepted a notification
        self._last_accepted = 0.0  # time.monotonic() of the latest one
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._active: set[int] = set()
        self._active_lock = threading.Lock()

    # -- life cycle ---------------------------------------------------------------------------

    def recover(self) -> list[int]:
        """Mark this replica's runs that were executing at a crash `interrupted`; report them.

        Notifications accepted but not yet ingested when the process died are ingested now.
        """
        reporter = self.reporter
        interrupted = self.journal.recover_interrupted(
            (lambda run: self._reports(reporter.interrupted_reports, run))
            if reporter is not None
            else None
        )
        self.ingest()
        for run_id in interrupted:
            run = self.journal.get_run(run_id)
            playbook = run.playbook if run and run.playbook else "unknown"
            self.metrics.runs.labels(playbook, "interrupted").inc()
            log.warning("run %d (%s) was interrupted by a restart; not repeated", run_id, playbook)
        if interrupted:
            self._reported()
        return interrupted

    def _reports(
        self, render: Callable[..., list[QueuedReport]], *args: object, **kwargs: object
    ) -> list[QueuedReport]:
        """What `render` makes of a run; nothing (logged) if it fails.

        A report never stops a run, and the journal keeps all the report would have said.
        """
        try:
            return render(*args, **kwargs)
        except Exception:
            log.exception("cannot render a report (%s)", getattr(render, "__name__", render))
            return []

    def _reported(self) -> None:
        if self._on_report is not None:
            self._on_report()

    def start(self) -> None:
        """Recover from a crash, then start the workers and the heartbeat."""
        self.recover()
        for index in range(self.settings.workers):
            thread = threading.Thread(target=self._work, name=f"engine-{index}", daemon=True)
            thread.start()
            self._threads.append(thread)
        for target, name in ((self._heartbeat, "engine-heartbeat"), (self._ingester, "ingest")):
            thread = threading.Thread(target=target, name=name, daemon=True)
            thread.start()
            self._threads.append(thread)

    def stop(self, timeout: float = 10.0) -> None:
        """Stop taking work; wait (bounded) for runs in progress to finish their step."""
        self._stop.set()
        self._wake.set()
        self._accepted.set()
        deadline = time.monotonic() + timeout
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))

    def wake(self) -> None:
        """Tell the engine that the webhook accepted a notification."""
        # A time stamp, not a signal, while the ingester already waits for quiet: waking its
        # thread on every request of a burst would cost each acknowledgement a thread switch.
        self._last_accepted = time.monotonic()
        if not self._accepted.is_set():
            self._accepted.set()

    def _ingester(self) -> None:
        # One thread turns accepted notifications into runs, in batches: a burst of resends
        # (repeat intervals, the HA pair) costs one transaction per batch, not one per
        # notification racing the webhook's INSERTs for SQLite's write lock.
        while not self._stop.is_set():
            if not self._accepted.wait(self.settings.poll_seconds):
                continue
            self._wait_for_quiet()
            try:
                if self.ingest():
                    self._wake.set()
            except JournalError as exc:
                log.error("engine: cannot ingest notifications: %s", exc)
                self._accepted.set()  # try again after the poll interval
                self._stop.wait(self.settings.poll_seconds)

    def _wait_for_quiet(self) -> None:
        """Return once no notification came for `ingest_quiet_seconds` (bounded), flag cleared.

        Ingesting while Alertmanager still delivers a burst would take SQLite's write lock and
        the GIL from the webhook between its requests and slow every acknowledgement; the runs
        start at most `ingest_max_delay_seconds` later, which an alert held for minutes by its
        `for:` does not notice.
        """
        quiet = self.settings.ingest_quiet_seconds
        deadline = time.monotonic() + self.settings.ingest_max_delay_seconds
        while not self._stop.is_set():
            now = time.monotonic()
            still = quiet - (now - self._last_accepted)  # until `quiet` after the latest
            if still <= 0 or now >= deadline:
                break
            self._stop.wait(min(still, deadline - now))
        # Cleared before the batch is read: a notification accepted from here on is either in
        # the batch or sets the flag again for the next one.
        self._accepted.clear()

    def _work(self) -> None:
        while not self._stop.is_set():
            try:
                worked = self.process_one()
            except JournalError as exc:
                log.error("engine: journal unavailable: %s", exc)
                worked = False
            if not worked:
                self._wake.wait(self.settings.poll_seconds)
                self._wake.clear()

    def _heartbeat(self) -> None:
        # Another replica's recovery must be able to tell a live run from a dead one. The same
        # thread prunes the journal past its retention now and then, so it does not grow forever.
        next_prune = time.monotonic()
        next_restore = time.monotonic()
        while not self._stop.wait(self.settings.heartbeat_seconds):
            if time.monotonic() >= next_restore:
                interval = self.settings.actions.power_cap_check_interval_seconds
                next_restore = time.monotonic() + interval
                self.restore_power_caps()
            if time.monotonic() >= next_prune:
                next_prune = time.monotonic() + self.settings.prune_seconds
                try:
                    pruned = self.journal.prune()
                    if pruned:
                        log.info("journal: pruned %d rows past the retention", pruned)
                except JournalError as exc:
                    log.warning("journal prune failed: %s", exc)
            with self._active_lock:
                active = list(self._active)
            for run_id in active:
                try:
                    self.journal.heartbeat(run_id)
                except JournalError as exc:
                    log.warning("heartbeat of run %d failed: %s", run_id, exc)

    def restore_power_caps(self) -> list[str]:
        """Restore due power caps (actions/power.py); never raises (the heartbeat calls it)."""
        try:
            return restore_due_power_caps(
                self.journal,
                self.roster,
                self.settings.actions,
                self.settings.prometheus_url,
                cancel=self._stop,
            )
        except Exception:
            # Like a broken action: logged, and the heartbeat (run liveness) goes on.
            log.exception("power-cap restores failed")
            return []

    # -- one run ------------------------------------------------------------------------------

    def ingest(self) -> int:
        """Turn notifications the webhook accepted into alerts and runs; how many new runs."""
        result = self.journal.ingest_pending()
        if result.resolved:
            self._reported()  # resolutions may have queued closing reports
        return len(result.new_run_ids)

    def process_one(self) -> bool:
        """Claim and handle one run; False when the queue is empty (or the fleet is busy)."""
        if self.journal.count_running() >= self.settings.limits.max_concurrent_runs:
            return False  # the fleet-wide cap: leave the queue to wait, don't churn claims
        run = self.journal.claim_next_run()
        if run is None:
            return False
        try:
            self.handle(run)
        except JournalError:
            raise
        except Exception as exc:
            log.exception("run %d failed in the engine", run.id)
            # Already decided or finished before the error (RunStateError): keep that.
            with contextlib.suppress(RunStateError):
                self.journal.finish_run(
                    run.id, outcome="failed", verification=f"engine error: {exc}"
                )
            self.metrics.runs.labels(run.playbook or "unknown", "failed").inc()
        return True

    def process_all(self) -> int:
        """Ingest, then handle queued runs until none is left (`replay`, tests); how many."""
        self.ingest()
        count = 0
        while self.process_one():
            count += 1
        return count

    def _decide(
        self,
        run: RunRecord,
        decision: str,
        reason: str,
        *,
        playbook: Playbook | None = None,
        target: Target | None = None,
    ) -> None:
        name = playbook.name if playbook is not None else None
        key = target.key if target is not None else None
        reports: list[QueuedReport] = []
        if self.reporter is not None:
            # The run as it will read once decided (steps of a dry-run included).
            current = self.journal.get_run(run.id) or run
            final = replace(
                current,
                state="done",
                decision=decision,
                reason=reason,
                playbook=name or current.playbook,
                target=key or current.target,
                finished_at=self._clock(),
            )
            verify_query = self._verify_query(playbook, target)
            reports = self._reports(self.reporter.run_report, final, verify_query=verify_query)
        self.journal.decide(run.id, decision, reason, playbook=name, target=key, reports=reports)
        self.metrics.runs.labels(name or "none", decision).inc()
        log.info("run %d: %s (%s)", run.id, decision, reason)
        if reports:
            self._reported()

    @staticmethod
    def _verify_query(playbook: Playbook | None, target: Target | None) -> str | None:
        """The playbook's verification PromQL for the target: the picture's fallback query."""
        if playbook is None or target is None or playbook.verify is None:
            return None
        return target.fill(playbook.verify.promql) if playbook.verify.promql else None

    def handle(self, run: RunRecord) -> None:
        """Decide what a claimed run does, and do it."""
        alert = alert_of(run.alert)
        playbook = match_playbook(self.playbooks, alert)
        if playbook is None:
            self._decide(run, "notify_only", f"no playbook handles {alert.alertname or 'it'}")
            return
        target = resolve_target(playbook, alert, self.roster)
        if isinstance(target, Rejection):
            self._decide(run, "rejected", target.reason, playbook=playbook)
            return
        now = self._clock()
        verdict = judge(
            self.journal,
            playbook,
            target_key=target.key,
            host=target.host,
            limits=self.settings.limits,
            dry_run=self.settings.dry_run,
            now=now,
        )
        if verdict.decision == "dry_run":
            self._dry_run(run, playbook, target, verdict.reason)
            return
        if not verdict.may_act:
            self._decide(run, verdict.decision, verdict.reason, playbook=playbook, target=target)
            return
        if self._recurred(run, playbook, target, now):
            self._decide(
                run,
                "breaker_open",
                "the alert keeps coming back after heals: acting stopped, people called",
                playbook=playbook,
                target=target,
            )
            return
        if self.journal.count_running() >= self.settings.limits.max_concurrent_runs:
            # Not a refusal: the run waits for a free place (another worker will claim it).
            self.journal.requeue(run.id, "fleet-wide concurrency cap reached")
            self._stop.wait(self.settings.poll_seconds)
            return
        if not self.journal.try_lock(target.key, run.id, self.settings.lock_ttl):
            self._decide(
                run,
                "locked",
                f"another run is acting on {target.key}",
                playbook=playbook,
                target=target,
            )
            return
        try:
            self._execute(run, playbook, target)
        finally:
            self.journal.release_lock(target.key, run.id)

    def _recurred(self, run: RunRecord, playbook: Playbook, target: Target, now: datetime) -> bool:
        """Count an alert that came back within the window after a heal; True if it opened.

        A heal resets the breaker's count, so a count of zero with a recent finished run means
        that run healed, and the alert is back anyway: that heal did not stick.
        """
        target_key = target.key
        until = self.journal.cooldown_until(target_key, playbook.name)
        breaker = playbook.policy.breaker
        if until is None or until > now:
            return False  # never ran, or still cooling down (judge() reports that)
        if self.journal.breaker(target_key, playbook.name).failures > 0:
            return False  # the last run did not heal: record_breaker_outcome counted it
        last_finished = until - timedelta(seconds=playbook.policy.cooldown_seconds)
        if now - last_finished > timedelta(seconds=breaker.window_seconds):
            return False
        why = "the alert keeps coming back after heals"
        opened = self.journal.record_breaker_outcome(
            target_key,
            playbook.name,
            healed=False,
            max_failures=breaker.max_failures,
            window=timedelta(seconds=breaker.window_seconds),
            on_open=self._escalation_reports(run, playbook, target_key, why),
            run_id=run.id,
        )
        if opened:
            self._escalate(playbook, target_key, why)
        return opened

    def _escalation_reports(
        self, run: RunRecord, playbook: Playbook, target_key: str, why: str
    ) -> list[QueuedReport]:
        if self.reporter is None:
            return []
        return self._reports(
            self.reporter.escalation_reports, run, playbook=playbook.name, target=target_key,
            why=why,
        )  # fmt: skip

    def _dry_run(self, run: RunRecord, playbook: Playbook, target: Target, reason: str) -> None:
        now = self._clock()
        for index, step in enumerate(playbook.steps):
            self.journal.record_step(
                run.id,
                index,
                step.action,
                render_params(step.params, target),
                started_at=now,
                finished_at=now,
                result="skipped",
                output="dry-run: would run",
            )
        self._decide(run, "dry_run", reason, playbook=playbook, target=target)

    def _execute(self, run: RunRecord, playbook: Playbook, target: Target) -> None:
        journal = self.journal
        journal.start_run(run.id, playbook=playbook.name, target=target.key)
        with self._active_lock:
            self._active.add(run.id)
        started = time.monotonic()
        cancel = threading.Event()
        deadline = started + playbook.policy.timeout_seconds
        outcome = "done_unverified"
        verification = "no verification configured"
        effects = RunEffects()
        try:
            failed_at = self._steps(run, playbook, target, cancel, deadline, effects=effects)
            # Undos (a deployment back into routing) before verification: it checks the whole.
            self._undo(run, playbook, target, effects)
            if failed_at is not None:
                outcome, verification = "failed", f"step {failed_at} failed; verification skipped"
            elif effects.finished is not None:
                verification = effects.finished
            elif playbook.verify is not None:
                healed, verification = self._verify(playbook, target, cancel, deadline)
                outcome = "healed" if healed else "not_healed"
        finally:
            if not effects.undone:
                self._undo(run, playbook, target, effects)  # an exception cut the run short
            with self._active_lock:
                self._active.discard(run.id)
        now = self._clock()
        reports: list[QueuedReport] = []
        final = run
        if self.reporter is not None:
            current = journal.get_run(run.id) or run
            final = replace(
                current, state="done", outcome=outcome, verification=verification, finished_at=now
            )
            reports = self._reports(
                self.reporter.run_report,
                final,
                verify_query=self._verify_query(playbook, target),
            )
        journal.finish_run(run.id, outcome=outcome, verification=verification, reports=reports)
        journal.set_cooldown(
            target.key, playbook.name, now + timedelta(seconds=playbook.policy.cooldown_seconds)
        )
        breaker = playbook.policy.breaker
        why = f"{breaker.max_failures} runs did not heal"
        opened = journal.record_breaker_outcome(
            target.key,
            playbook.name,
            healed=outcome in HEALED,
            max_failures=breaker.max_failures,
            window=timedelta(seconds=breaker.window_seconds),
            on_open=self._escalation_reports(final, playbook, target.key, why),
            run_id=run.id,
        )
        if opened:
            self._escalate(playbook, target.key, why)
        for why in effects.escalations:
            self._step_escalation(final, playbook, target, why)
        if reports or opened or effects.escalations:
            self._reported()
        self.metrics.runs.labels(playbook.name, outcome).inc()
        self.metrics.run_duration.labels(playbook.name).observe(time.monotonic() - started)
        log.info("run %d: %s on %s: %s", run.id, playbook.name, target.key, outcome)

    def _steps(
        self,
        run: RunRecord,
        playbook: Playbook,
        target: Target,
        cancel: threading.Event,
        deadline: float,
        *,
        effects: RunEffects | None = None,
    ) -> int | None:
        """Run the steps in order; the index of the first that failed, or None.

        What the steps ask beyond their verdicts (undos, escalations, an early finish) is
        collected in `effects`.
        """
        for index, step in enumerate(playbook.steps):
            registered = get_action(step.action)
            params = registered.params_model.model_validate(render_params(step.params, target))
            shown = params.model_dump(mode="json")
            begun = self._clock()
            self.journal.record_step(
                run.id, index, step.action, shown, started_at=begun, finished_at=None,
                result="running", output="",
            )  # fmt: skip
            timeout = min(step.timeout_seconds, max(0.0, deadline - time.monotonic()))
            context = ActionContext(
                target=target,
                prometheus_url=self.settings.prometheus_url,
                deadline=time.monotonic() + timeout,
                cancel=cancel,
                dry_run=False,
                settings=self.settings.actions,
                journal=self.journal,
                run_id=run.id,
            )
            result: StepResult = run_action(context, step.action, params, timeout)
            if effects is not None:
                if result.undo is not None:
                    effects.undos.append((index, result.undo))
                if result.escalate is not None:
                    effects.escalations.append(result.escalate)
                if result.ok and result.finish is not None:
                    effects.finished = result.finish
            self.journal.record_step(
                run.id,
                index,
                step.action,
                shown,
                started_at=begun,
                finished_at=self._clock(),
                result="ok" if result.ok else "failed",
                output=result.output,
            )
            finished = effects is not None and effects.finished is not None and result.ok
            if not result.ok or finished:
                why = f"step {index} failed" if not result.ok else f"step {index} ended the run"
                for later, rest in enumerate(playbook.steps[index + 1 :], start=index + 1):
                    self.journal.record_step(
                        run.id, later, rest.action, render_params(rest.params, target),
                        started_at=self._clock(), finished_at=self._clock(), result="skipped",
                        output=f"not run: {why}",
                    )  # fmt: skip
                return index if not result.ok else None
        return None

    def _undo(
        self, run: RunRecord, playbook: Playbook, target: Target, effects: RunEffects
    ) -> None:
        """Run the collected undos, newest first, each journaled as a step after the others.

        Each gets its own time limit and cancel flag: the run's may be spent or set, and a
        deployment must go back into routing all the same.
        """
        if effects.undone:
            return
        effects.undone = True
        for number, (asked_by, undo) in enumerate(reversed(effects.undos)):
            index = len(playbook.steps) + number
            shown = undo.params.model_dump(mode="json")
            begun = self._clock()
            self.journal.record_step(
                run.id, index, undo.action, shown, started_at=begun, finished_at=None,
                result="running", output="",
            )  # fmt: skip
            context = ActionContext(
                target=target,
                prometheus_url=self.settings.prometheus_url,
                deadline=time.monotonic() + undo.timeout_seconds,
                cancel=threading.Event(),
                dry_run=False,
                settings=self.settings.actions,
                journal=self.journal,
                run_id=run.id,
            )
            result = run_action(context, undo.action, undo.params, undo.timeout_seconds)
            self.journal.record_step(
                run.id, index, undo.action, shown, started_at=begun, finished_at=self._clock(),
                result="ok" if result.ok else "failed",
                output=f"undo of step {asked_by} ({undo.why}): {result.output}",
            )  # fmt: skip
            if not result.ok:
                effects.escalations.append(f"could not undo step {asked_by}: {undo.why}")

    def _step_escalation(
        self, run: RunRecord, playbook: Playbook, target: Target, why: str
    ) -> None:
        """A step asked for people: journal it, count it, and message `escalate_to` if set.

        The run's own report (queued when it finished) shows the step that asked.
        """
        detail = f"{playbook.name} on {target.key} asks for people: {why}"
        self.journal.add_event(
            "escalation", detail, run_id=run.id, playbook=playbook.name, target=target.key
        )
        self.metrics.escalations.labels(playbook.name).inc()
        log.error("%s", detail)
        reporter = self.reporter
        if reporter is None or not reporter.settings.escalate_to:
            return
        text = (
            f"🚨 **Escalation** — `{playbook.name}` on `{target.key}` asks for people: {why} "
            f"(run #{run.id}, **{run.alert.alertname or 'alert'}**)."
        )
        try:
            self.journal.enqueue_report(
                reporter.topic(run.alert.labels), text, run_id=run.id,
                recipients=reporter.settings.escalate_to,
            )  # fmt: skip
        except JournalError as exc:
            log.warning("cannot queue the escalation message of run %d: %s", run.id, exc)

    def _verify(
        self, playbook: Playbook, target: Target, cancel: threading.Event, deadline: float
    ) -> tuple[bool, str]:
        verify = playbook.verify
        assert verify is not None
        details = []
        healed = True
        if verify.promql:
            query = target.fill(verify.promql)
            within = min(verify.within_seconds, max(0.0, deadline - time.monotonic()))
            held = promql_holds(
                self.settings.prometheus_url,
                query,
                within_seconds=within,
                interval_seconds=verify.interval_seconds,
                cancel=cancel,
            )
            healed = healed and held.ok
            details.append(f"PromQL `{query}`: {'held' if held.ok else 'did not hold'} "
                           f"({held.detail})")  # fmt: skip
        if verify.probe is not None:
            probe = verify.probe
            params = get_action(probe.action).params_model.model_validate(
                render_params(probe.params, target)
            )
            timeout = min(probe.timeout_seconds, max(0.0, deadline - time.monotonic()))
            context = ActionContext(
                target=target,
                prometheus_url=self.settings.prometheus_url,
                deadline=time.monotonic() + timeout,
                cancel=cancel,
                dry_run=False,
            )
            result = run_action(context, probe.action, params, timeout)
            healed = healed and result.ok
            details.append(f"probe {probe.action}: {'ok' if result.ok else 'failed'} "
                           f"({result.output})")  # fmt: skip
        return healed, "; ".join(details)

    def _escalate(self, playbook: Playbook, target_key: str, why: str) -> None:
        detail = (
            f"circuit breaker opened for {playbook.name} on {target_key}: {why}. "
            "Acting on this target stopped; a person must look."
        )
        self.journal.add_event("escalation", detail, playbook=playbook.name, target=target_key)
        self.metrics.escalations.labels(playbook.name).inc()
        log.error("%s", detail)
