"""The engine: workers that take admitted runs, judge them at the rails, act, verify, report.

A run's life, all of it in the journal (so replicas agree and a crash loses nothing):
`pending` (admitted by the webhook, `remediator.journal.admission`) → `claimed` by one worker
of one replica → a decision: `notify_only` (no playbook), `rejected` (target not in the
roster), `resolved` (its alert no longer fires), `dry_run` — or the rails
(`remediator.journal.rails`, one transaction): `running`, or back to `pending` to wait for a
passing reason (pause, maintenance, cooldown, the hourly cap, a busy fleet, a held target),
or an end (`breaker_open`, `expired` after waiting too long). A running run executes its
steps one by one — asking first, before each step that changes something, whether its alert
still fires (`remediator.firing`) — then verifies, then ends with an outcome (`healed`,
`not_healed`, `failed`, `done_unverified`, `resolved`), its budgets and its reports in one
transaction. A run that was executing when the process died is marked `interrupted` at the
next start and reported, never re-run blindly.

Every loop (the workers, the heartbeat) survives any exception: it is logged and counted
(`gpufleet_remediator_loop_errors_total{loop}`) and the loop goes on; `alive()` says whether
every loop thread still runs (`/healthz` answers 503 otherwise).

The engine does not care which kind of action a step is: actions are looked up by name in the
registry and run with typed params filled from the roster-resolved target only.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import socket
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta

from fleet.roster import Roster
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
from remediator.doorbell import Doorbell
from remediator.firing import Firing, FiringCheck
from remediator.journal import (
    AlertRecord,
    ClaimUnread,
    Journal,
    JournalError,
    Plan,
    QueuedReport,
    RunRecord,
    RunStateError,
    UndoRecord,
    Verdict,
)
from remediator.metrics import RemediatorMetrics
from remediator.notify.report import Reporter
from remediator.playbooks.budget import disruption_set
from remediator.playbooks.loader import Rejection, Target, match_playbook, resolve_target
from remediator.playbooks.model import Playbook
from remediator.prometheus_api import promql_holds

log = logging.getLogger(__name__)

# After an unexpected error a loop waits this long before its next pass (no hot error loop).
_LOOP_BACKOFF_SECONDS = 1.0


def _utcnow() -> datetime:
    return datetime.now(UTC)


@dataclass(frozen=True)
class EngineSettings:
    """How the engine works; from the config (the rails' limits live in the journal)."""

    workers: int
    dry_run: bool
    prometheus_url: str
    poll_seconds: float = 1.0
    heartbeat_seconds: float = 5.0
    prune_seconds: float = 3600.0
    # A "not firing" from Prometheus while Alertmanager's last word is "firing" is asked again
    # after this long before it ends a run: one read is no verdict (a scrape missed, a rule
    # group evaluated late).
    recheck_seconds: float = 5.0
    # What host actions need (executors, allow-lists); the default lets them refuse clearly.
    actions: ActionSettings = field(default_factory=ActionSettings)


@dataclass
class RunEffects:
    """What a run's steps asked of the engine beyond their verdicts (see actions/registry.py).

    The undos themselves are in the journal (journaled with the step that asked for one).
    `escalations`: reasons to call people; `finished`: the run ended early and successfully
    (a false alarm), no further steps and no verification; `resolved`: the alert stopped
    firing before a step that changes something; `stopped`: the remediator is stopping, the
    run ends `interrupted` once its undos ran; `cancelled`: a person paused remediation or put
    the host in maintenance while the run was acting: it does no further step that changes
    something, runs its undos and ends `cancelled`, saying who and why; `fenced`: another
    replica took the run over (this one was silent too long): it acts on it no more, not even
    its undos.
    """

    escalations: list[str] = field(default_factory=list)
    finished: str | None = None
    resolved: str | None = None
    stopped: str | None = None
    cancelled: str | None = None
    fenced: str | None = None
    undone: list[str] = field(default_factory=list)


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


def _undo_record(step_index: int, undo: Undo | None) -> UndoRecord | None:
    """The journal's record of an undo a step asked for (its index is the journal's to give)."""
    if undo is None:
        return None
    return UndoRecord(
        index=0,
        asked_by=step_index,
        action=undo.action,
        params=undo.params.model_dump(mode="json"),
        timeout_seconds=undo.timeout_seconds,
        why=undo.why,
    )


class Loop:
    """A background loop that survives any exception in its body (logged and counted)."""

    def __init__(
        self,
        name: str,
        body: Callable[[], None],
        stop: threading.Event,
        metrics: RemediatorMetrics,
    ) -> None:
        self.name = name
        self._body = body
        self._stop = stop
        self._metrics = metrics
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> None:
        """Start the thread."""
        self._thread.start()

    def join(self, timeout: float) -> None:
        """Wait (bounded) for the thread to end."""
        self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        """True while the thread runs."""
        return self._thread.is_alive()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._body()
            except JournalError as exc:
                self._metrics.loop_errors.labels(self.name).inc()
                log.error("%s: journal unavailable: %s", self.name, exc)
                self._stop.wait(_LOOP_BACKOFF_SECONDS)
            except Exception:
                self._metrics.loop_errors.labels(self.name).inc()
                log.exception("%s: unexpected error; the loop goes on", self.name)
                self._stop.wait(_LOOP_BACKOFF_SECONDS)


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
        firing: FiringCheck | None = None,
    ) -> None:
        self.journal = journal
        self.reporter = reporter
        self._on_report = on_report
        self.roster = roster
        self.playbooks = playbooks
        self.settings = settings
        self.metrics = metrics
        self.firing = firing if firing is not None else FiringCheck(settings.prometheus_url)
        self._clock = clock
        # Runs are queued or became due: one ring wakes one worker (remediator/doorbell.py).
        self._wake = Doorbell(limit=max(1, settings.workers))
        self._stop = threading.Event()
        self._loops: list[Loop] = []
        # The runs acting now, with their cancel flags (set at stop).
        self._active: dict[int, threading.Event] = {}
        # Runs whose handling a JournalError cut short (the database went away mid-run): no
        # thread acts on them; the heartbeat ends them once the journal is back.
        self._orphans: set[int] = set()
        self._active_lock = threading.Lock()
        # This process's claim on its replica id (a lease): two live processes must never act
        # as one replica. `instance` tells this process from a predecessor with the same id.
        self.instance = (
            f"{journal.replica_id}#{socket.gethostname()}:{os.getpid()}.{secrets.token_hex(4)}"
        )
        self._identity_lost = False

    # -- life cycle ---------------------------------------------------------------------------

    def recover(self) -> list[int]:
        """This replica's runs a crash left executing: interrupted, undone, reported.

        Each is judged again through a new run while its alert fires (never re-run blindly).
        """
        interrupted = self.journal.recover_interrupted()
        for run_id in interrupted:
            log.warning("run %d was interrupted by a restart; undoing, not repeating", run_id)
        self.complete_interruptions()
        return interrupted

    def take_over(self) -> list[int]:
        """Take over the runs of silent replicas (heartbeat past `lock_ttl_seconds`)."""
        taken = self.journal.take_over_stale()
        for run_id in taken:
            log.warning("run %d of a silent replica taken over: undoing, not repeating", run_id)
        if taken:
            self.complete_interruptions()
        return taken

    def recover_orphans(self) -> list[int]:
        """Runs a journal failure cut short in this process: interrupted now (see `process_one`)."""
        with self._active_lock:
            orphans = set(self._orphans)
        if not orphans:
            return []
        interrupted = self.journal.recover_orphans(sorted(orphans))
        with self._active_lock:
            self._orphans -= orphans
        for run_id in interrupted:
            log.warning("run %d lost its journal mid-run: undoing, not repeating", run_id)
        return interrupted

    def complete_interruptions(self) -> int:
        """Undo and report every interrupted run this replica must finish; how many."""
        count = 0
        for run in self.journal.interruptions_to_complete():
            playbook = next((p for p in self.playbooks if p.name == run.playbook), None)
            target = self._target_of(run)
            escalations: list[str] = []
            if target is not None:
                self._run_undos(run, target, escalations)
            else:
                gone = "not run: its target left the roster"
                for undo in self.journal.undos(run.id):
                    self.journal.finish_undo(run.id, undo.index, ok=False, output=gone)
            current = self.journal.get_run(run.id) or run
            reports = self._reports(self.reporter.interrupted_reports, current) if (
                self.reporter is not None) else []  # fmt: skip
            cooldown = playbook.policy.cooldown_seconds if playbook is not None else 0.0
            readmitted = self.journal.complete_interruption(
                run.id, reports=reports, cooldown_seconds=cooldown
            )
            name = run.playbook or "unknown"
            self.metrics.runs.labels(name, "interrupted").inc()
            if playbook is not None and target is not None:
                for why in escalations:
                    self._step_escalation(current, playbook, target, why)
            if readmitted is not None:
                log.info("run %d: its alert still fires, judged again as run %d", run.id,
                         readmitted)  # fmt: skip
            count += 1
        if count:
            self._reported()
            self._wake.ring()
        return count

    def _target_of(self, run: RunRecord) -> Target | None:
        """The roster target a run's key names now; None when it is no longer there."""
        parts = (run.target or "").split("/")
        host = self.roster.hosts.get(parts[1]) if len(parts) > 1 else None
        if host is None:
            return None
        if parts[0] == "host" and len(parts) == 2:
            return Target("host", parts[1], host)
        if parts[0] == "server" and len(parts) == 3 and parts[2] in host.servers:
            return Target("server", parts[1], host, server=parts[2],
                          server_entry=host.servers[parts[2]])  # fmt: skip
        if parts[0] == "gpu" and len(parts) == 3 and parts[2].isdigit():
            return Target("gpu", parts[1], host, gpu=int(parts[2]))
        return None

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

    def claim_identity(self, wait_seconds: float | None = None) -> None:
        """Hold this replica id's lease, waiting out a dead predecessor's.

        Raises JournalError if a live process holds it: two processes acting as one replica
        would take each other's runs for their own.
        """
        ttl = self._identity_ttl()
        if wait_seconds is None:
            wait_seconds = ttl.total_seconds() + self.settings.heartbeat_seconds
        deadline = time.monotonic() + wait_seconds
        self._release_dead_predecessor()
        while not self.journal.take_lease(self._identity, ttl, owner=self.instance):
            if time.monotonic() >= deadline:
                raise JournalError(
                    f"replica id {self.journal.replica_id!r} is held by another live process "
                    "(its lease is being renewed): give each replica its own replica_id"
                )
            self._stop.wait(1.0)

    def _release_dead_predecessor(self) -> None:
        """A holder that was this machine's process and is gone (a crash) leaves its lease now.

        No need to wait out its TTL (a systemd restart after a crash would otherwise wait):
        the instance names its host and pid, and a pid that is not running on this host is
        not a live holder. A holder on another host is waited out as before.
        """
        holder = self.journal.lease_holder(self._identity)
        if holder is None or "#" not in holder:
            return
        host, _, rest = holder.split("#", 1)[1].partition(":")
        pid_text = rest.split(".", 1)[0]
        if host != socket.gethostname() or not pid_text.isdigit():
            return
        try:
            os.kill(int(pid_text), 0)
        except ProcessLookupError:
            log.info("the previous holder of replica id %s (pid %s) is gone: taking over",
                     self.journal.replica_id, pid_text)  # fmt: skip
            self.journal.release_lease(self._identity, owner=holder)
        except PermissionError:
            return  # a process of another user has that pid: not ours to judge

    @property
    def _identity(self) -> str:
        return f"replica/{self.journal.replica_id}"

    def _identity_ttl(self) -> timedelta:
        return timedelta(seconds=max(15.0, 3 * self.settings.heartbeat_seconds))

    def start(self) -> None:
        """Claim the replica id, recover from a crash, then start the workers and the heartbeat."""
        self.claim_identity()
        admitted = self.journal.admit_leftovers()  # accepted by an older version, not yet runs
        if admitted:
            log.info("admitted %d notifications an older version had accepted", admitted)
            self._reported()
        self.recover()
        self._loops = [
            Loop(f"engine-{index}", self._work_once, self._stop, self.metrics)
            for index in range(self.settings.workers)
        ]
        self._loops.append(Loop("engine-heartbeat", self._heartbeat_once, self._stop,
                                self.metrics))  # fmt: skip
        self._next_prune = time.monotonic()
        self._next_restore = time.monotonic()
        for loop in self._loops:
            loop.start()

    def stop(self, timeout: float = 60.0) -> None:
        """Stop: cancel every active run, let its step return and its undos run, then end.

        The runs cut short end `interrupted` (reported, judged again at the next start while
        their alert fires). Bounded by `timeout`: the unit's TimeoutStopSec must be longer.
        """
        self._stop.set()
        with self._active_lock:
            for cancel in self._active.values():
                cancel.set()
        self._wake.ring_all()
        deadline = time.monotonic() + timeout
        for loop in self._loops:
            loop.join(max(0.0, deadline - time.monotonic()))
        if self._loops:
            try:
                self.journal.release_lease(self._identity, owner=self.instance)
            except JournalError as exc:
                log.warning("cannot release the replica id's lease (it expires): %s", exc)

    def loop_states(self) -> dict[str, bool]:
        """Each background loop (and the replica id's lease): running or not."""
        if self._stop.is_set() or not self._loops:
            return {}
        states = {loop.name: loop.alive for loop in self._loops}
        states["replica-identity"] = not self._identity_lost
        return states

    def dead_loops(self) -> list[str]:
        """The loops whose thread ended although the engine was not stopped (`/healthz`)."""
        return [name for name, alive in self.loop_states().items() if not alive]

    def wake(self) -> None:
        """Runs were admitted or became due: a sleeping worker looks now."""
        self._wake.ring()

    def _work_once(self) -> None:
        # A read first: the writer (a claim) only when a run is due, so idle workers never
        # queue in front of an admission (issue 12's benchmark).
        queue = self.journal.queue_state()
        if queue.due and not self._identity_lost and self.process_one():
            return
        # Nothing due: sleep until woken, the next waiting run is due, or the poll interval.
        pause = self.settings.poll_seconds
        due = queue.next_due
        if due is not None:
            pause = max(0.05, min(pause, (due - self._clock()).total_seconds()))
        self._wake.wait(pause)

    def _heartbeat_once(self) -> None:
        # Another replica must be able to tell a live run from a dead one. The same loop
        # restores power caps when due and prunes the journal past its retention now and then.
        if self._stop.wait(self.settings.heartbeat_seconds):
            return
        if not self.journal.take_lease(self._identity, self._identity_ttl(), owner=self.instance):
            # Another process acts as this replica now (this one was stopped past the lease):
            # acting on would be two replicas in one. Workers take no more runs; /healthz 503.
            if not self._identity_lost:
                log.error("replica id %s was taken by another process: taking no more runs",
                          self.journal.replica_id)  # fmt: skip
            self._identity_lost = True
            return
        self._identity_lost = False
        with self._active_lock:
            active = list(self._active)
        for run_id in active:
            self.journal.heartbeat(run_id)
        self.take_over()
        self.recover_orphans()
        self.complete_interruptions()
        if time.monotonic() >= self._next_restore:
            interval = self.settings.actions.power_cap_check_interval_seconds
            self._next_restore = time.monotonic() + interval
            self.restore_power_caps()
        if time.monotonic() >= self._next_prune:
            self._next_prune = time.monotonic() + self.settings.prune_seconds
            pruned = self.journal.prune()
            if pruned:
                log.info("journal: pruned %d rows past the retention", pruned)

    def restore_power_caps(self) -> list[str]:
        """Restore due power caps (actions/power.py); never raises (the heartbeat calls it)."""
        try:
            done = restore_due_power_caps(
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
        self._report_restores(done)
        return done

    def _report_restores(self, done: Sequence[str]) -> None:
        """One line in the GPU topic per cap given back (or dropped).

        The run's report said the cap was lowered and a restore scheduled; people must also
        learn that it came back (or why not).
        """
        if self.reporter is None:
            return
        topic = self.reporter.topic({"category": "gpu"})
        for line in done:
            target, _, what = line.partition(": ")
            if what == "restored":
                text = (
                    f"🔋 **Power cap restored** — `{target}`: its temperature stayed normal "
                    "through the playbook's window; the cap from before the remediation is back."
                )
            else:
                text = f"⚠️ **Power-cap restore {what}** — `{target}`: its cap stays as it is."
            try:
                self.journal.enqueue_report(topic, text)
            except JournalError as exc:
                log.warning("cannot queue the report of %s: %s", line, exc)
        if done:
            self._reported()  # the sender goes now, not at its next poll

    # -- one run ------------------------------------------------------------------------------

    def process_one(self) -> bool:
        """Claim and handle one due run; False when none is due (or the engine stops)."""
        if self._stop.is_set() and self._loops:
            return False
        try:
            claim = self.journal.claim_next()
        except ClaimUnread as exc:
            with self._active_lock:
                self._orphans.add(exc.run_id)  # claimed, never handled: taken back (heartbeat)
            raise
        if claim.more_due:
            # Another run is due as well: the next sleeping worker takes it while this one
            # acts (a ring wakes one worker; the chain ends with the last run due).
            self._wake.ring()
        run = claim.run
        if run is None:
            return False
        try:
            self.handle(run)
        except JournalError:
            # Left claimed or running in the journal, with no thread on it: the heartbeat
            # takes it back as soon as the journal answers (not after lock_ttl_seconds, while
            # its drain stays in place and it holds a place under the concurrency cap).
            with self._active_lock:
                self._orphans.add(run.id)
            raise
        except Exception as exc:
            log.exception("run %d failed in the engine", run.id)
            self.metrics.loop_errors.labels("run").inc()
            # Already decided or finished before the error (RunStateError): keep that.
            with contextlib.suppress(RunStateError):
                self.journal.finish_run(
                    run.id, outcome="failed", verification=f"engine error: {exc}"
                )
            self.metrics.runs.labels(run.playbook or "unknown", "failed").inc()
        return True

    def process_runs(self, run_ids: Sequence[int]) -> int:
        """Handle exactly these runs, if still pending (`replay --live`); how many."""
        count = 0
        for run_id in run_ids:
            run = self.journal.claim_run(run_id)
            if run is not None:
                self.handle(run)
                count += 1
        return count

    def process_all(self) -> int:
        """Handle due runs until none is left (`replay`, tests); how many were handled.

        A run that waits is not due again at once, so this ends.
        """
        count = 0
        while self.process_one():
            count += 1
        return count

    def _final_reports(
        self,
        run: RunRecord,
        playbook: Playbook | None,
        target: Target | None,
        **changes: object,
    ) -> list[QueuedReport]:
        """The report of a run as it will read once ended with `changes`."""
        if self.reporter is None:
            return []
        current = self.journal.get_run(run.id) or run
        final = replace(
            current,
            state="done",
            playbook=playbook.name if playbook is not None else current.playbook,
            target=target.key if target is not None else current.target,
            finished_at=self._clock(),
            **changes,  # type: ignore[arg-type]
        )
        return self._reports(
            self.reporter.run_report, final, verify_query=self._verify_query(playbook, target)
        )

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
        reports = self._final_reports(run, playbook, target, decision=decision, reason=reason)
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

    def plan(self, playbook: Playbook, target: Target) -> Plan:
        """What a run of `playbook` on `target` asks of the rails."""
        breaker = playbook.policy.breaker
        return Plan(
            playbook=playbook.name,
            host=target.host,
            target=target.key,
            disruption=disruption_set(playbook, target, self.roster),
            cooldown_seconds=playbook.policy.cooldown_seconds,
            max_failures=breaker.max_failures,
            window_seconds=breaker.window_seconds,
        )

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
        firing, detail = self._still_firing(run)
        if not firing:
            self._decide(run, "resolved", f"the alert no longer fires ({detail})",
                         playbook=playbook, target=target)  # fmt: skip
            return
        if self.settings.dry_run or playbook.policy.dry_run:
            self._dry_run(run, playbook, target, "dry-run: the steps were journaled, none was run")
            return
        plan = self.plan(playbook, target)
        verdict = self.journal.admit_to_act(
            run.id, plan, reports=lambda v: self._verdict_reports(run, playbook, target, v)
        )
        if verdict.may_act:
            self._execute(run, playbook, target, plan)
            return
        self.metrics.runs.labels(playbook.name, verdict.wait_reason or verdict.decision).inc()
        if verdict.decision == "wait":
            log.info("run %d waits (%s) until %s: %s", run.id, verdict.wait_reason,
                     verdict.not_before, verdict.reason)  # fmt: skip
            return
        log.info("run %d: %s (%s)", run.id, verdict.decision, verdict.reason)
        if verdict.opened:
            self.metrics.escalations.labels(playbook.name).inc()
            log.error("circuit breaker opened for %s: %s", target.key, verdict.reason)
        self._reported()

    def _verdict_reports(
        self, run: RunRecord, playbook: Playbook, target: Target, verdict: Verdict
    ) -> list[QueuedReport]:
        """The reports of a rails decision (rendered inside its transaction: text only)."""
        if self.reporter is None:
            return []
        reporter = self.reporter
        if verdict.decision == "wait":
            return self._reports(reporter.waiting_report, run, playbook=playbook.name,
                                 target=target.key, verdict=verdict)  # fmt: skip
        final = replace(run, state="done", decision=verdict.decision, reason=verdict.reason,
                        playbook=playbook.name, target=target.key,
                        finished_at=self._clock())  # fmt: skip
        reports = self._reports(reporter.run_report, final,
                                verify_query=self._verify_query(playbook, target))  # fmt: skip
        if verdict.opened:
            reports += self._reports(reporter.escalation_reports, final, playbook=playbook.name,
                                     target=target.key, why=verdict.reason)  # fmt: skip
        return reports

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

    def _execute(self, run: RunRecord, playbook: Playbook, target: Target, plan: Plan) -> None:
        journal = self.journal
        cancel = threading.Event()
        with self._active_lock:
            self._active[run.id] = cancel
            if self._stop.is_set():
                cancel.set()  # stopping began between the claim and now
        started = time.monotonic()
        deadline = started + playbook.policy.timeout_seconds
        outcome = "done_unverified"
        verification = "no verification configured"
        effects = RunEffects()
        undone = False
        try:
            failed_at = self._steps(run, playbook, target, cancel, deadline, effects=effects)
            if effects.fenced is None and not self.journal.owns(run.id):
                # Lost in its last step (a wait): the taker ran the undos and reported the run;
                # a verification now would end in a finish the journal refuses.
                effects.fenced = f"another replica took run {run.id} over in its last step"
            if effects.fenced is not None:
                log.error("run %d: %s; acting on it no more", run.id, effects.fenced)
                return
            # Undos (a deployment back into routing) before verification: it checks the whole.
            self._run_undos(run, target, effects.escalations, effects.undone)
            undone = True
            if self._stop.is_set() and failed_at is not None and effects.stopped is None:
                effects.stopped = f"the remediator stopped during step {failed_at}"
            if effects.stopped is not None:
                outcome, verification = "interrupted", effects.stopped + self._undone_text(run)
            elif effects.cancelled is not None:
                outcome, verification = "cancelled", effects.cancelled + self._undone_text(run)
            elif effects.resolved is not None:
                outcome, verification = "resolved", effects.resolved
            elif failed_at is not None:
                outcome, verification = "failed", f"step {failed_at} failed; verification skipped"
            elif effects.finished is not None:
                verification = effects.finished
            elif playbook.verify is not None:
                healed, verification = self._verify(playbook, target, cancel, deadline)
                owed = self._not_undone(run)
                if healed and owed:
                    # Healthy, yet something this run changed is not put back (a deployment
                    # out of routing): not healed, and the failed undo already calls people.
                    healed = False
                    verification += f"; but NOT undone: {', '.join(owed)}"
                outcome = "healed" if healed else "not_healed"
                if self._stop.is_set() and not healed:
                    # Cut short by the stop, not judged: the run did not fail, it was stopped.
                    outcome = "interrupted"
                    verification = (
                        "the remediator stopped during the verification" + self._undone_text(run)
                    )
        finally:
            try:
                if not undone and effects.fenced is None:
                    # An exception cut the run short: its undos all the same.
                    self._run_undos(run, target, effects.escalations, effects.undone)
            finally:
                # Even when the undos cannot run (the journal is gone): a run left in _active
                # had its heartbeat renewed for ever, never taken back, a place under the
                # concurrency cap held until the process restarted.
                with self._active_lock:
                    self._active.pop(run.id, None)
        reports = self._final_reports(run, playbook, target, outcome=outcome,
                                      verification=verification)  # fmt: skip
        final = replace(journal.get_run(run.id) or run, state="done", outcome=outcome)
        why = f"{playbook.policy.breaker.max_failures} runs on {target.key} did not heal"
        opened = journal.finish_run(
            run.id,
            outcome=outcome,
            verification=verification,
            plan=plan,
            reports=reports,
            on_open=self._escalation_reports(final, playbook, target.key, why),
        )
        if opened:
            self.metrics.escalations.labels(playbook.name).inc()
            log.error("circuit breaker opened for %s: %s", target.key, why)
        for step_why in effects.escalations:
            self._step_escalation(final, playbook, target, step_why)
        self._wake.ring()  # runs that waited for this target or place are due
        if reports or opened or effects.escalations:
            self._reported()
        self.metrics.runs.labels(playbook.name, outcome).inc()
        self.metrics.run_duration.labels(playbook.name).observe(time.monotonic() - started)
        log.info("run %d: %s on %s: %s", run.id, playbook.name, target.key, outcome)

    def _escalation_reports(
        self, run: RunRecord, playbook: Playbook, target_key: str, why: str
    ) -> list[QueuedReport]:
        if self.reporter is None:
            return []
        return self._reports(
            self.reporter.escalation_reports, run, playbook=playbook.name, target=target_key,
            why=why,
        )  # fmt: skip

    def _still_firing(self, run: RunRecord) -> tuple[bool, str]:
        """Whether the alert still fires, and who says: before acting and before a step.

        When Prometheus says no while the journal holds the alert firing (no resolution from
        Alertmanager), it is asked once more after `recheck_seconds`: two answers in a row end
        a run, not one.
        """
        answer = self._firing_once(run)
        if answer.firing or answer.source != "prometheus" or not self._journal_firing(run):
            return answer.firing, answer.detail
        if self._stop.wait(self.settings.recheck_seconds):
            return answer.firing, answer.detail  # stopping: the first answer stands
        again = self._firing_once(run)
        asked = f"asked twice, {self.settings.recheck_seconds:g} s apart"
        return again.firing, f"{again.detail}; {asked}"

    def _journal_firing(self, run: RunRecord) -> bool:
        current = self.journal.get_run(run.id)
        status = current.alert.status if current is not None else run.alert.status
        return status == "firing"

    def _firing_once(self, run: RunRecord) -> Firing:
        return self.firing.check(run.alert.labels, journal_firing=self._journal_firing(run))

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
        # Until a step that clears its own alert has acted (a ghost killed): after it, the
        # alert's resolving is this run's doing, and the rest of its remedy must still run.
        asking = True
        for index, step in enumerate(playbook.steps):
            registered = get_action(step.action)
            params = registered.params_model.model_validate(render_params(step.params, target))
            shown = params.model_dump(mode="json")
            if effects is not None and self._stop.is_set():
                effects.stopped = f"the remediator stopped before step {index}"
                self._skip_rest(run, playbook, target, index - 1, "the remediator stopped")
                return None
            if effects is not None and not self.journal.owns(run.id):
                effects.fenced = f"another replica took run {run.id} over before step {index}"
                return None
            if effects is not None and not registered.read_only:
                held = self._held_by_people(target)
                if held is not None:
                    # Stop buttons stop: nothing more that changes something, undos still.
                    effects.cancelled = f"{held}; stopped before step {index}"
                    self._skip_rest(run, playbook, target, index - 1, held)
                    return None
            if effects is not None and asking and not registered.read_only:
                firing, detail = self._still_firing(run)
                if not firing:
                    effects.resolved = f"the alert resolved before step {index} ({detail})"
                    self._skip_rest(run, playbook, target, index - 1, "the alert resolved")
                    return None
                # That question may take Prometheus' timeout (5 s; a hung one holds it that
                # long): a replica paused in it (SIGSTOP, a frozen VM) can wake to a run another
                # replica took over and undid meanwhile. So the fence again, right before the
                # act: a drain now would never be undone, a restart would act twice as a run.
                if not self.journal.owns(run.id):
                    effects.fenced = f"another replica took run {run.id} over before step {index}"
                    return None
            begun = self._clock()
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
            # An undo the action names before it runs is journaled with the step's start: a
            # crash in the middle of the step must still leave it to run.
            first = registered.undo_first(context, params) if registered.undo_first else None
            self.journal.record_step(
                run.id, index, step.action, shown, started_at=begun, finished_at=None,
                result="running", output="", undo=_undo_record(index, first),
            )  # fmt: skip
            result: StepResult = run_action(context, step.action, params, timeout)
            undo = _undo_record(index, result.undo) if first is None else None
            if first is not None and result.undo is None:
                unneeded = "not needed: the step changed nothing"
                for pending in self.journal.undos(run.id):
                    if pending.asked_by == index:
                        self.journal.finish_undo(run.id, pending.index, ok=True, output=unneeded)
            if effects is not None:
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
                undo=undo,
            )
            if result.ok and registered.clears_alert:
                asking = False
            finished = effects is not None and effects.finished is not None and result.ok
            if not result.ok or finished:
                why = f"step {index} failed" if not result.ok else f"step {index} ended the run"
                self._skip_rest(run, playbook, target, index, why)
                return index if not result.ok else None
        return None

    def _held_by_people(self, target: Target) -> str | None:
        """Who stopped remediation of `target` while its run acts (pause, maintenance), and why."""
        if self.journal.paused():
            events = self.journal.events(kind="paused", limit=1)
            return events[0].detail if events else "remediation was paused"
        window = self.journal.maintenance_windows().get(target.host)
        if window is not None:
            _, _, reason, by = window
            why = f": {reason}" if reason else ""
            return f"host {target.host} went into maintenance by {by}{why}"
        return None

    def _skip_rest(
        self, run: RunRecord, playbook: Playbook, target: Target, after: int, why: str
    ) -> None:
        """Journal the steps after `after` as skipped, saying why."""
        for later, rest in enumerate(playbook.steps[after + 1 :], start=after + 1):
            self.journal.record_step(
                run.id, later, rest.action, render_params(rest.params, target),
                started_at=self._clock(), finished_at=self._clock(), result="skipped",
                output=f"not run: {why}",
            )  # fmt: skip

    def _run_undos(
        self,
        run: RunRecord,
        target: Target,
        escalations: list[str],
        undone: list[str] | None = None,
    ) -> None:
        """Run the run's pending immediate undos, newest first, each journaled as a step.

        Each gets its own time limit and cancel flag: the run's may be spent or set (a stop),
        and a deployment must go back into routing all the same. Each is marked done or
        failed in the journal as it ends, so a crash in between repeats none that finished.
        """
        for undo in self.journal.undos(run.id):
            current = self.journal.get_run(run.id)
            index = 1 + max((step.index for step in (current.steps if current else [])),
                            default=-1)  # fmt: skip
            registered = get_action(undo.action)
            params = registered.params_model.model_validate(undo.params)
            begun = self._clock()
            self.journal.record_step(
                run.id, index, undo.action, undo.params, started_at=begun, finished_at=None,
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
            result = run_action(context, undo.action, params, undo.timeout_seconds)
            output = f"undo of step {undo.asked_by} ({undo.why}): {result.output}"
            self.journal.record_step(
                run.id, index, undo.action, undo.params, started_at=begun,
                finished_at=self._clock(), result="ok" if result.ok else "failed", output=output,
            )  # fmt: skip
            self.journal.finish_undo(run.id, undo.index, ok=result.ok, output=result.output)
            if undone is not None:
                undone.append(f"{undo.why}: {'done' if result.ok else 'FAILED'}")
            if not result.ok:
                escalations.append(f"could not undo step {undo.asked_by}: {undo.why}")

    def _not_undone(self, run: RunRecord) -> list[str]:
        """What this run owes: its undos still pending or failed, by why."""
        return [u.why for u in self.journal.undos(run.id, pending_only=False) if u.state != "done"]

    def _undone_text(self, run: RunRecord) -> str:
        """What an interrupted run undid and what is still pending, for its verification."""
        every = self.journal.undos(run.id, pending_only=False)
        done = [u.why for u in every if u.state == "done"]
        left = [u.why for u in every if u.state != "done"]
        text = f"; undone: {', '.join(done)}" if done else "; nothing to undo" if not left else ""
        return text + (f"; NOT undone: {', '.join(left)}" if left else "")

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
