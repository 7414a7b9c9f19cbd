"""The journal against both databases it supports: a SQLite file and the real PostgreSQL.

Every test runs twice (the `journal_url` fixture): on a fresh SQLite file under tmp_path and
on a fresh PostgreSQL database made by `tests.pg` (dropped afterwards). A machine without
PostgreSQL fails the PostgreSQL half loudly; nothing is skipped. Time is the injected `Clock`,
moved by hand: no test sleeps.

Sections: admission (occurrences and their dedupe window), claims and a run's life, the rails
(`admit_to_act`, one rail at a time), a run's end (`finish_run` with its plan), people's acts,
events and leases, recovery and pruning, then the database itself. Races are real: threads
share one `Journal`, and child processes (spawned, each with its own `Journal`, as replicas
are) are released together behind a `multiprocessing.Barrier`. The rails under many workers
and replicas at once are in `test_rails_concurrency.py`, the upgrade from released journals
in `test_journal_migration.py`.
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing
import queue
import sqlite3
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from remediator.alerts import parse_notification
from remediator.config import Limits
from remediator.journal import (
    Claim,
    Journal,
    JournalError,
    QueuedReport,
    QueueState,
    RunStateError,
    Verdict,
    bound_output,
    schema,
)
from tests.journal_lab import (
    ALPHA,
    BETA,
    GPU0,
    GPU0_SET,
    HOST,
    HOST_SET,
    T0,
    Clock,
    admit,
    alert,
    body,
    claim,
    counts,
    engine,
    judge,
    plan,
    rows,
    start,
)
from tests.pg import drop_database, throwaway_database

SPAWN = multiprocessing.get_context("spawn")  # fork would copy the parent's pooled sockets
CHILD_TIMEOUT_S = 60

MakeJournal = Callable[..., Journal]


def _gather(children: list[Any], results: Any) -> list[Any]:
    """Start the children; their results, failing at once (not after a timeout) if one dies."""
    for child in children:
        child.start()
    got: list[Any] = []
    deadline = time.monotonic() + CHILD_TIMEOUT_S
    try:
        while len(got) < len(children):
            try:
                got.append(results.get(timeout=0.2))
            except queue.Empty:
                dead = [c.exitcode for c in children if c.exitcode not in (None, 0)]
                assert not dead, f"a child process failed (exit codes {dead}); see its stderr"
                assert time.monotonic() < deadline, "the child processes did not answer in time"
        for child in children:
            child.join(CHILD_TIMEOUT_S)
            assert child.exitcode == 0
    finally:
        for child in children:
            if child.is_alive():  # only after a failure: do not leave it behind
                child.kill()
                child.join()
    return got


@pytest.fixture(params=["sqlite", "postgresql"])
def journal_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """A fresh journal database: a SQLite file (in a directory not yet made), or PostgreSQL."""
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'state' / 'journal.db'}"
    else:
        with throwaway_database() as url:
            yield url


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def make_journal(journal_url: str, clock: Clock) -> Iterator[MakeJournal]:
    """Open journals on the test's database (replica `r1` and the test's clock by default)."""
    opened: list[Journal] = []

    def make(**options: Any) -> Journal:
        options.setdefault("replica_id", "r1")
        options.setdefault("clock", clock)
        journal = Journal(journal_url, **options)
        opened.append(journal)
        return journal

    yield make
    for journal in opened:
        journal.close()


@pytest.fixture
def journal(make_journal: MakeJournal) -> Journal:
    return make_journal()


class _Reports:
    """A rails `reports` callback (as the engine's `_verdict_reports`) that keeps what it saw."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.asked: list[Verdict] = []

    def __call__(self, verdict: Verdict) -> list[QueuedReport]:
        self.asked.append(verdict)
        return [QueuedReport("alerts-gpu", f"{self.text}: {verdict.decision}")]


def _outbox(url: str) -> list[tuple[int | None, str]]:
    return [
        (r["run_id"], r["content"]) for r in sorted(rows(url, schema.outbox), key=lambda r: r["id"])
    ]


# -- admission: occurrences ------------------------------------------------------------------


def test_repeat_interval_and_ha_duplicate_make_one_run(
    journal: Journal, make_journal: MakeJournal, journal_url: str, clock: Clock
) -> None:
    first = admit(journal, alert("fp1"))
    assert len(first.new_run_ids) == 1 and first.duplicates == 0
    clock.advance(minutes=5)  # Alertmanager's repeat interval: the same occurrence again
    again = admit(journal, alert("fp1"))
    # The HA peer sends it too, through another replica.
    twin = admit(make_journal(replica_id="r2"), alert("fp1"))
    assert (again.new_run_ids, again.duplicates) == ([], 1)
    assert (twin.new_run_ids, twin.duplicates) == ([], 1)
    runs = journal.recent_runs()
    assert [r.id for r in runs] == first.new_run_ids
    found = runs[0].alert
    assert found.first_seen == T0 and found.last_seen == T0 + timedelta(minutes=5)
    assert found.starts_at == T0 and found.starts_at.tzinfo is not None
    assert found.status == "firing" and found.alertname == "LlamaServerDown"
    assert len(rows(journal_url, schema.notifications)) == 3  # each one is kept, raw
    assert journal.queue_depth() == 1


def test_an_ha_twin_within_the_dedupe_window_joins_the_open_occurrence(
    journal: Journal, journal_url: str
) -> None:
    # HA Prometheus stamps one problem 30 s apart, and Alertmanager may send the later
    # startsAt first and the earlier one afterwards (it keeps the earliest when merging).
    (run_id,) = admit(journal, alert("fp1", starts="2026-01-01T00:00:30Z")).new_run_ids
    earlier = admit(journal, alert("fp1", starts="2026-01-01T00:00:00Z"))
    later = admit(journal, alert("fp1", starts="2026-01-01T00:09:59Z"))
    # The same instant written with another zone is the same occurrence.
    zoned = admit(journal, alert("fp1", starts="2026-01-01T01:00:30+01:00"))
    for copy in (earlier, later, zoned):
        assert (copy.new_run_ids, copy.duplicates, copy.closed_run_ids) == ([], 1, [])
    (occurrence,) = rows(journal_url, schema.alerts)
    assert occurrence["status"] == "firing"
    assert [r.id for r in journal.recent_runs()] == [run_id]


def test_a_starts_at_past_the_window_closes_the_old_occurrence_and_opens_a_new_one(
    journal: Journal, clock: Clock
) -> None:
    (old,) = admit(journal, alert("fp1")).new_run_ids
    clock.advance(minutes=30)
    # Exactly the window after: the old one ended without its resolution reaching us.
    result = admit(journal, alert("fp1", starts="2026-01-01T00:10:00Z"))
    (new,) = result.new_run_ids
    assert result.closed_run_ids == [old]
    closed = journal.get_run(old)
    assert closed is not None and (closed.state, closed.decision) == ("done", "resolved")
    assert "later occurrence" in closed.reason and closed.finished_at == clock()
    assert closed.alert.status == "resolved"
    assert closed.alert.resolved_at == datetime(2026, 1, 1, 0, 10, tzinfo=UTC)  # the new start
    fresh = journal.get_run(new)
    assert fresh is not None and (fresh.state, fresh.alert.status) == ("pending", "firing")
    assert journal.queue_depth() == 1


def test_a_dedupe_window_of_the_journal_is_configurable(
    make_journal: MakeJournal, clock: Clock
) -> None:
    journal = make_journal(dedupe_window=timedelta(minutes=1))
    admit(journal, alert("fp1"))
    clock.advance(minutes=1)  # each copy received when it could be: not before it started
    assert admit(journal, alert("fp1", starts="2026-01-01T00:00:59Z")).duplicates == 1
    clock.advance(minutes=1)
    assert len(admit(journal, alert("fp1", starts="2026-01-01T00:02:00Z")).new_run_ids) == 1


def test_a_resolution_closes_the_occurrence_and_its_pending_runs(
    journal: Journal, clock: Clock
) -> None:
    (run_id,) = admit(journal, alert("fp1")).new_run_ids
    clock.advance(minutes=10)
    result = admit(journal, alert("fp1", status="resolved"))
    assert (result.new_run_ids, result.resolved, result.closed_run_ids) == ([], 1, [run_id])
    run = journal.get_run(run_id)
    assert run is not None and run.alert.status == "resolved"
    assert (run.state, run.decision, run.finished_at) == ("done", "resolved", clock())
    assert run.alert.resolved_at == datetime(2026, 1, 1, 0, 10, tzinfo=UTC)  # its endsAt
    assert admit(journal, alert("fp1", status="resolved")).resolved == 0  # a resend
    assert journal.queue_depth() == 0 and len(journal.recent_runs()) == 1


def test_a_resolution_queues_the_closing_report_in_its_transaction(
    journal: Journal, journal_url: str
) -> None:
    journal.resolved_reports = lambda run: [("alerts-gpu", f"closed {run.id} {run.state}")]
    (run_id,) = admit(journal, alert("fp1")).new_run_ids
    admit(journal, alert("fp1", status="resolved"))
    assert _outbox(journal_url) == [(run_id, f"closed {run_id} done")]
    admit(journal, alert("fp2", status="resolved"))  # a tombstone: no run, no story to close

    def broken(run: Any) -> list[tuple[str, str]]:
        raise RuntimeError("a rendering bug")

    # A rendering bug must not refuse the resolution (Alertmanager would retry it forever).
    journal.resolved_reports = broken
    (other,) = admit(journal, alert("fp3")).new_run_ids
    assert admit(journal, alert("fp3", status="resolved")).closed_run_ids == [other]
    assert _outbox(journal_url) == [(run_id, f"closed {run_id} done")]


def test_a_resolution_reaches_a_claimed_run_at_the_rails(journal: Journal) -> None:
    (run_id,) = admit(journal, alert("fp1")).new_run_ids
    claim(journal, run_id)
    # Claimed, not started: admission leaves it to its worker, which learns it at the rails.
    assert admit(journal, alert("fp1", status="resolved")).closed_run_ids == []
    verdict = journal.admit_to_act(run_id, plan())
    assert (verdict.decision, verdict.may_act) == ("resolved", False)
    run = journal.get_run(run_id)
    assert run is not None and (run.state, run.decision, run.started_at) == (
        "done",
        "resolved",
        None,
    )
    assert journal.count_running() == 0


def test_a_resolution_with_another_starts_at_closes_the_open_one(
    journal: Journal, clock: Clock
) -> None:
    clock.advance(hours=1)  # received when they started, never before (see the next test)
    (run_id,) = admit(journal, alert("fp1", starts="2026-01-01T01:00:00Z")).new_run_ids
    # A resolution stamped by the HA twin (earlier, within the window) closes it …
    result = admit(journal, alert("fp1", status="resolved", starts="2026-01-01T00:55:00Z",
                                  ends="2026-01-01T01:20:00Z"))  # fmt: skip
    assert (result.resolved, result.closed_run_ids) == (1, [run_id])
    # … one of an occurrence long before it does not: it is kept, resolved, beside it.
    clock.advance(hours=1)
    (newer,) = admit(journal, alert("fp1", starts="2026-01-01T02:00:00Z")).new_run_ids
    stale = admit(journal, alert("fp1", status="resolved", starts="2026-01-01T00:00:00Z"))
    assert (stale.resolved, stale.closed_run_ids) == (1, [])
    run = journal.get_run(newer)
    assert run is not None and (run.state, run.alert.status) == ("pending", "firing")


def test_a_starts_at_ahead_of_the_clock_counts_as_received_now(
    journal: Journal, clock: Clock
) -> None:
    """Time from the network is bounded by this clock: a copy dated a day ahead opens an
    occurrence that started when it was received, and a real fault later is not its copy."""
    forged = admit(journal, alert("fp1", starts="2026-01-02T00:00:00Z"))
    (forged_run,) = forged.new_run_ids
    run = journal.get_run(forged_run)
    assert run is not None and run.alert.starts_at == clock()  # received now
    clock.advance(minutes=30)
    (real_run,) = admit(journal, alert("fp1", starts="2026-01-01T00:30:00Z")).new_run_ids
    assert real_run != forged_run
    # Within the skew allowed (an HA pair's clocks): as given.
    clock.advance(minutes=30)
    (ahead,) = admit(journal, alert("fp2", starts="2026-01-01T01:00:30Z")).new_run_ids
    run = journal.get_run(ahead)
    assert run is not None and run.alert.starts_at == datetime(2026, 1, 1, 1, 0, 30, tzinfo=UTC)


def test_a_resolution_never_seen_firing_is_a_tombstone(journal: Journal, journal_url: str) -> None:
    # Alertmanager retried the firing notification (our 5xx) after the resolved one got in.
    assert admit(journal, alert("fp1", status="resolved")).resolved == 1
    (tombstone,) = rows(journal_url, schema.alerts)
    assert tombstone["status"] == "resolved"
    late = admit(journal, alert("fp1"))
    assert (late.new_run_ids, late.duplicates) == ([], 1)
    assert journal.queue_depth() == 0 and journal.recent_runs() == []


def test_a_late_firing_copy_of_a_resolved_occurrence_starts_nothing(
    journal: Journal, clock: Clock
) -> None:
    (run_id,) = admit(journal, alert("fp1", starts="2026-01-01T00:00:30Z")).new_run_ids
    clock.advance(minutes=10)
    admit(journal, alert("fp1", status="resolved", starts="2026-01-01T00:00:30Z"))
    # A retried copy, and the HA twin's earlier stamp of the same (now resolved) problem.
    for starts in ("2026-01-01T00:00:30Z", "2026-01-01T00:00:00Z"):
        late = admit(journal, alert("fp1", starts=starts))
        assert (late.new_run_ids, late.duplicates) == ([], 1), starts
    # Firing again after it ended is a new occurrence.
    again = admit(journal, alert("fp1", starts="2026-01-01T00:11:00Z"))
    assert len(again.new_run_ids) == 1 and again.new_run_ids != [run_id]


def test_a_grouped_notification_with_three_alerts_makes_three_runs(
    journal: Journal, journal_url: str
) -> None:
    result = admit(
        journal,
        alert("fpa", server="alpha"),
        alert("fpb", server="beta"),
        alert("fpc", server="gamma"),
    )
    assert len(set(result.new_run_ids)) == 3 and result.duplicates == 0
    runs = {r.alert.labels["server"]: r for r in journal.recent_runs()}
    assert sorted(runs) == ["alpha", "beta", "gamma"]
    assert all(r.state == "pending" and r.steps == [] for r in runs.values())
    assert runs["beta"].alert.annotations == {"summary": "LlamaServerDown on dioscuri/alpha"}
    (stored,) = rows(journal_url, schema.notifications)
    assert stored["id"] == result.notification_id and stored["ingested_at"] == T0
    assert json.loads(stored["raw"])["groupKey"] == '{}:{alertname="LlamaServerDown"}'


def test_text_a_database_refuses_is_made_storable(journal: Journal) -> None:
    # PostgreSQL refuses NUL in text; a label or an output with one must not 5xx forever.
    result = admit(journal, alert("fp\u0000nul", server="a\u0000b"))
    (run_id,) = result.new_run_ids
    claimed = claim(journal, run_id)
    assert claimed.alert.labels["server"] == "a\u0000b"
    assert journal.admit_to_act(run_id, plan()).may_act
    journal.record_step(
        run_id,
        0,
        "probe",
        {},
        started_at=T0,
        finished_at=T0,
        result="ok",
        output="bin\u0000ary \udcff",
    )
    run = journal.get_run(run_id)
    assert run is not None and run.steps[0].output == "bin\ufffdary ?"


def test_a_refused_notification_is_kept_with_its_reason(journal: Journal, journal_url: str) -> None:
    notification_id = journal.reject_notification(b'{"alerts": "\xff"}', "ValueError: odd")
    (stored,) = rows(journal_url, schema.notifications)
    assert (stored["id"], stored["rejected"]) == (notification_id, "ValueError: odd")
    (event,) = journal.events(kind="rejected_notification")
    assert event.ref_id == notification_id and "ValueError: odd" in event.detail
    assert journal.queue_depth() == 0


def _admit_in_process(
    url: str, replica: str, barrier: Any, results: Any, bodies: list[bytes]
) -> None:
    journal = Journal(url, replica_id=replica)
    parsed = [(parse_notification(b), b) for b in bodies]
    barrier.wait(CHILD_TIMEOUT_S)
    outcome = [journal.admit(n, b) for n, b in parsed]
    results.put((replica, [len(r.new_run_ids) for r in outcome], [r.duplicates for r in outcome]))
    journal.close()


def test_two_processes_admitting_the_same_notifications_make_one_run_each(
    journal: Journal, journal_url: str
) -> None:
    # The HA twin's stamps differ per replica: one opens, the other must join it.
    bodies = {
        replica: [body(alert(f"fp{i}", starts=f"2026-01-01T00:00:{offset}Z")) for i in range(20)]
        for replica, offset in (("r1", "00"), ("r2", "15"))
    }
    barrier = SPAWN.Barrier(2)
    results = SPAWN.Queue()
    children = [
        SPAWN.Process(target=_admit_in_process, args=(journal_url, r, barrier, results, bodies[r]))
        for r in ("r1", "r2")
    ]
    got = _gather(children, results)
    new = [sum(pair) for pair in zip(got[0][1], got[1][1], strict=True)]
    duplicates = [sum(pair) for pair in zip(got[0][2], got[1][2], strict=True)]
    assert new == [1] * 20 and duplicates == [1] * 20
    assert journal.queue_depth() == 20


# -- claims and a run's life -----------------------------------------------------------------


def _fifty_pending(journal: Journal) -> list[int]:
    ids = admit(journal, *[alert(f"fp{i:02}") for i in range(50)]).new_run_ids
    assert len(ids) == 50
    return sorted(ids)


def _claim_all(journal: Journal, threads: int) -> list[int]:
    claimed: list[int] = []
    guard = threading.Lock()
    errors: list[BaseException] = []

    def work() -> None:
        try:
            while (run := journal.claim_next_run()) is not None:
                with guard:
                    claimed.append(run.id)
        except JournalError as exc:
            errors.append(exc)

    workers = [threading.Thread(target=work) for _ in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    assert errors == []
    return claimed


def test_claim_is_exclusive_between_threads(journal: Journal) -> None:
    ids = _fifty_pending(journal)
    claimed = _claim_all(journal, threads=8)
    assert Counter(claimed) == Counter(ids)  # every run exactly once
    runs = journal.recent_runs(100)
    assert {(r.state, r.owner) for r in runs} == {("claimed", "r1")}
    assert journal.queue_depth() == 50 and journal.claim_next_run() is None


def _claim_in_process(url: str, replica: str, barrier: Any, results: Any) -> None:
    journal = Journal(url, replica_id=replica)
    barrier.wait(CHILD_TIMEOUT_S)
    results.put((replica, _claim_all(journal, threads=4)))
    journal.close()


def test_claim_is_exclusive_between_processes(journal: Journal, journal_url: str) -> None:
    ids = _fifty_pending(journal)
    barrier = SPAWN.Barrier(2)
    results = SPAWN.Queue()
    children = [
        SPAWN.Process(target=_claim_in_process, args=(journal_url, r, barrier, results))
        for r in ("p1", "p2")
    ]
    got = dict(_gather(children, results))
    assert Counter(got["p1"] + got["p2"]) == Counter(ids)
    owners = {r.id: r.owner for r in journal.recent_runs(100)}
    assert all(owners[i] == "p1" for i in got["p1"]) and all(owners[i] == "p2" for i in got["p2"])


def test_claim_takes_the_oldest_due_first_and_a_waiting_run_when_due(
    journal: Journal, clock: Clock
) -> None:
    (first,) = admit(journal, alert("a")).new_run_ids
    (second,) = admit(journal, alert("b")).new_run_ids
    journal.set_paused(True, by="api")
    run = claim(journal, first)
    assert run.claimed_at == T0
    verdict = journal.admit_to_act(first, plan())
    assert (verdict.decision, verdict.wait_reason) == ("wait", "paused")
    assert verdict.not_before == T0 + timedelta(seconds=30)
    back = journal.get_run(first)
    assert back is not None and back.waiting
    assert (back.state, back.owner, back.claimed_at, back.waiting_since) == (
        "pending",
        None,
        None,
        T0,
    )
    assert journal.waiting_runs() == [back] and journal.next_due() == verdict.not_before
    assert journal.waiting_stats() == ({"paused": 1}, T0)
    claim(journal, second)  # the waiting one is not due yet
    assert journal.claim_next_run() is None
    clock.advance(seconds=30)
    again = claim(journal, first)
    assert again.waiting_since == T0  # it keeps its place in the wait


def test_a_claim_says_whether_another_run_is_due(journal: Journal, clock: Clock) -> None:
    # The engine wakes a second worker only on `more_due`: a claim that saw nothing else due
    # spares it a write transaction that would find nothing (bench/webhook.py).
    first, second = admit(journal, alert("a"), alert("b")).new_run_ids
    assert journal.queue_state() == QueueState(due=True, next_due=None)
    taken = journal.claim_next()
    assert (taken.run is not None and taken.run.id, taken.more_due) == (first, True)
    taken = journal.claim_next()
    assert (taken.run is not None and taken.run.id, taken.more_due) == (second, False)
    assert journal.claim_next() == Claim(None, False)
    # A waiting run is not due: the queue says when it will be.
    journal.set_paused(True, by="api")
    verdict = journal.admit_to_act(first, plan())
    assert journal.queue_state() == QueueState(due=False, next_due=verdict.not_before)
    clock.advance(seconds=30)
    assert journal.queue_state() == QueueState(due=True, next_due=verdict.not_before)


def test_reading_the_queue_never_waits_for_the_writer(journal_url: str, clock: Clock) -> None:
    # An idle worker looks at the queue with a read: it never queues for the one SQLite writer
    # in front of an admission (held here). PostgreSQL has no such writer: there only the
    # answer is checked.
    journal = Journal(journal_url, replica_id="r1", clock=clock)
    try:
        admit(journal, alert("a"))
        seen: list[QueueState] = []
        writer = journal._writer
        hold = writer.hold(urgent=False) if writer is not None else contextlib.nullcontext()
        with hold:
            reader = threading.Thread(target=lambda: seen.append(journal.queue_state()))
            reader.start()
            reader.join(5)
            assert not reader.is_alive(), "the queue's read waited for the writer"
        assert seen == [QueueState(due=True, next_due=None)]
    finally:
        journal.close()


def test_run_life_cycle_and_state_errors(
    journal: Journal, make_journal: MakeJournal, clock: Clock
) -> None:
    (run_id,) = admit(journal, alert("fp1")).new_run_ids
    with pytest.raises(RunStateError, match="is pending"):
        journal.admit_to_act(run_id, plan())
    claim(journal, run_id)
    with pytest.raises(RunStateError, match=r"claimed \(r1\), not claimed"):
        make_journal(replica_id="r2").admit_to_act(run_id, plan())  # another replica's claim
    clock.advance(seconds=1)
    assert journal.admit_to_act(run_id, plan()).may_act
    assert journal.count_running() == 1 and journal.count_started_since(T0) == 1
    assert journal.count_started_since(T0 + timedelta(seconds=2)) == 0
    with pytest.raises(RunStateError, match="is running"):
        journal.decide(run_id, "rejected", "too late")
    with pytest.raises(RunStateError, match="no run 999999"):
        journal.decide(999999, "rejected", "x")
    with pytest.raises(RunStateError, match="is running"):
        journal.admit_to_act(run_id, plan())
    clock.advance(seconds=1)
    journal.heartbeat(run_id)
    for finished, result, output in ((None, "running", ""), (clock(), "ok", "x" * 200_000 + "end")):
        journal.record_step(
            run_id,
            0,
            "restart_unit",
            {"unit": "llama-server@alpha.service"},
            started_at=clock(),
            finished_at=finished,
            result=result,
            output=output,
        )
    journal.finish_run(run_id, outcome="healed", verification="PromQL held")
    run = journal.get_run(run_id)
    assert run is not None
    assert (run.state, run.decision, run.outcome, run.playbook, run.target, run.disruptive) == (
        "done",
        "run",
        "healed",
        "restart-llama",
        ALPHA,
        True,
    )
    (step,) = run.steps
    assert (step.index, step.result, step.params) == (
        0,
        "ok",
        {"unit": "llama-server@alpha.service"},
    )
    assert len(step.output.encode()) <= 64 * 1024 and step.output.endswith("end")
    assert run.started_at == T0 + timedelta(seconds=1) and run.finished_at == clock()
    assert journal.count_running() == 0 and journal.queue_depth() == 0
    journal.heartbeat(run_id)  # a late tick after the end is harmless
    with pytest.raises(RunStateError, match="is done"):
        journal.finish_run(run_id, outcome="failed", verification="twice")


def test_decide_finishes_a_run_that_will_not_execute(journal: Journal, journal_url: str) -> None:
    (run_id,) = admit(journal, alert("fp1")).new_run_ids
    claim(journal, run_id)
    journal.decide(run_id, "notify_only", "no playbook", playbook="restart-llama", target="t",
                   reports=[("alerts-gpu", "told")])  # fmt: skip
    run = journal.get_run(run_id)
    assert run is not None
    assert (run.state, run.decision, run.reason, run.playbook, run.target) == (
        "done",
        "notify_only",
        "no playbook",
        "restart-llama",
        "t",
    )
    assert run.finished_at == T0 and run.started_at is None
    assert journal.count_started_since(T0 - timedelta(hours=1)) == 0
    assert _outbox(journal_url) == [(run_id, "told")]


def test_recent_runs_reads_in_a_few_queries(journal: Journal) -> None:
    for i in range(30):
        run_id = start(journal, f"fp{i}", plan(f"server/dioscuri/s{i}"))
        journal.finish_run(run_id, outcome="healed", verification="")  # under the caps
        for index in range(3):
            journal.record_step(
                run_id,
                index,
                "probe",
                {"i": index},
                started_at=T0,
                finished_at=T0,
                result="ok",
                output="",
            )
    statements: list[str] = []

    def count(*args: Any) -> None:
        statements.append(str(args[2]))

    pool = journal._engine  # the journal's own pool: every statement it sends
    sa.event.listen(pool, "before_cursor_execute", count)
    try:
        runs = journal.recent_runs(50)
    finally:
        sa.event.remove(pool, "before_cursor_execute", count)
    assert len(runs) == 30 and [r.id for r in runs] == sorted((r.id for r in runs), reverse=True)
    assert all([s.index for s in r.steps] == [0, 1, 2] for r in runs)
    assert len([s for s in statements if "SELECT" in s.upper()]) <= 3, statements


# -- the rails: one rail at a time -----------------------------------------------------------


def test_pause_makes_runs_wait_and_resume_makes_them_due(journal: Journal, clock: Clock) -> None:
    (run_id,) = admit(journal, alert("fp1")).new_run_ids
    journal.set_paused(True, by="api", reason="datacenter work")
    verdict = judge(journal, run_id, plan())
    assert (verdict.decision, verdict.wait_reason) == (
        "wait",
        "paused",
    ) and "paused" in verdict.reason
    clock.advance(seconds=5)
    assert journal.claim_next_run() is None  # rechecked in 30 s, not before …
    journal.set_paused(False, by="api")  # … unless the pause ends
    assert journal.next_due() == clock()
    assert judge(journal, run_id, plan()).may_act
    run = journal.get_run(run_id)
    assert run is not None and (run.wait_reason, run.not_before) == (None, None)


def test_a_read_only_run_waits_for_the_pause_too(journal: Journal) -> None:
    (run_id,) = admit(journal, alert("fp1")).new_run_ids
    journal.set_paused(True, by="api")
    assert judge(journal, run_id, plan(disruption=())).wait_reason == "paused"


def test_maintenance_without_an_end_waits_until_turned_off(journal: Journal, clock: Clock) -> None:
    (run_id,) = admit(journal, alert("fp1")).new_run_ids
    (elsewhere,) = admit(journal, alert("fp2", host="castor")).new_run_ids
    journal.set_maintenance("dioscuri", True, by="alice", reason="swapping a GPU")
    verdict = judge(journal, run_id, plan())
    assert (verdict.wait_reason, verdict.not_before) == ("maintenance", T0 + timedelta(seconds=30))
    assert "until turned off" in verdict.reason and "swapping a GPU" in verdict.reason
    # Another host is not in maintenance.
    assert judge(journal, elsewhere, plan("server/castor/gamma", host="castor")).may_act
    clock.advance(seconds=30)
    assert judge(journal, run_id, plan()).wait_reason == "maintenance"  # still on: waits again
    clock.advance(seconds=1)
    journal.set_maintenance("dioscuri", False, by="alice")
    assert judge(journal, run_id, plan()).may_act


def test_maintenance_with_an_end_wakes_its_runs_when_it_ends(
    journal: Journal, clock: Clock
) -> None:
    (run_id,) = admit(journal, alert("fp1")).new_run_ids
    journal.set_maintenance("dioscuri", True, by="alice", until=T0 + timedelta(minutes=45))
    verdict = judge(journal, run_id, plan())
    assert (verdict.wait_reason, verdict.not_before) == ("maintenance", T0 + timedelta(minutes=45))
    # Shortened: the waiting run is due at the new end, not at the old one.
    journal.set_maintenance("dioscuri", True, by="alice", until=T0 + timedelta(minutes=20))
    assert journal.next_due() == T0 + timedelta(minutes=20)
    clock.advance(minutes=20)
    assert journal.maintenance() == {}  # ended by itself
    assert judge(journal, run_id, plan()).may_act


def test_an_open_breaker_on_any_target_of_the_set_ends_the_run(
    journal: Journal, journal_url: str, clock: Clock
) -> None:
    # Three failed server runs open the server's breaker …
    for i in range(3):
        run_id = start(journal, f"fail{i}")
        journal.finish_run(run_id, outcome="failed", verification="", plan=plan())
    # … which stops a host-wide run (its set holds the server), not a read-only one.
    (host_run,) = admit(journal, alert("host", server="")).new_run_ids
    (probe,) = admit(journal, alert("probe")).new_run_ids
    render = _Reports("refused")
    verdict = judge(journal, host_run, plan(HOST, disruption=HOST_SET), reports=render)
    assert (verdict.decision, verdict.opened) == ("breaker_open", False)
    assert ALPHA in verdict.reason and "reset" in verdict.reason
    run = journal.get_run(host_run)
    assert run is not None and (run.state, run.decision, run.target) == (
        "done",
        "breaker_open",
        HOST,
    )
    assert (host_run, "refused: breaker_open") in _outbox(journal_url)
    assert judge(journal, probe, plan(disruption=())).may_act


def test_failures_counted_from_runs_open_the_breaker_at_the_rails(
    journal: Journal, journal_url: str, clock: Clock
) -> None:
    # Two heals that did not stick: the alert came back after each (max_failures 2).
    for i in range(2):
        run_id = start(journal, f"back{i}", plan(max_failures=2))
        clock.advance(minutes=1)
        journal.finish_run(run_id, outcome="healed", verification="", plan=plan(max_failures=2))
        clock.advance(minutes=1)
    (third,) = admit(journal, alert("back2")).new_run_ids
    render = _Reports("escalated")
    verdict = judge(journal, third, plan(max_failures=2), reports=render)
    assert (verdict.decision, verdict.opened) == ("breaker_open", True)
    assert "2 disruptive runs" in verdict.reason
    (breaker,) = journal.breakers()
    assert (breaker.target, breaker.open, breaker.playbook, breaker.opened_at) == (
        ALPHA,
        True,
        "restart-llama",
        clock(),
    )
    (event,) = journal.events(kind="escalation")
    assert (event.run_id, event.target) == (third, ALPHA)
    assert (third, "escalated: breaker_open") in _outbox(journal_url)
    assert journal.open_breakers() == [(ALPHA, "restart-llama", clock())]


def test_failures_outside_the_window_or_before_a_reset_do_not_count(
    journal: Journal, clock: Clock
) -> None:
    the_plan = plan(max_failures=2, window=600)
    for i in range(2):
        run_id = start(journal, f"f{i}", the_plan)
        journal.finish_run(run_id, outcome="failed", verification="", plan=the_plan)
    assert [b.target for b in journal.breakers()] == [ALPHA]
    clock.advance(minutes=1)
    assert journal.reset_breaker(ALPHA, by="alice", reason="replaced the PSU")
    assert not journal.reset_breaker(ALPHA, by="alice")  # not open any more
    clock.advance(minutes=1)
    # The failures before the reset no longer count: one more does not reopen it.
    run_id = start(journal, "f2", the_plan)
    assert not journal.finish_run(run_id, outcome="not_healed", verification="", plan=the_plan)
    clock.advance(minutes=11)  # and that one leaves the 10-minute window
    run_id = start(journal, "f3", the_plan)
    assert not journal.finish_run(run_id, outcome="interrupted", verification="", plan=the_plan)
    (breaker,) = journal.breakers(only_open=False)
    assert (breaker.open, breaker.reset_by, breaker.reset_at) == (
        False,
        "alice",
        T0 + timedelta(minutes=1),
    )
    (event,) = journal.events(kind="breaker_reset")
    assert (event.actor, event.target) == ("alice", ALPHA) and "replaced the PSU" in event.detail


def test_a_heal_that_stuck_does_not_count(journal: Journal, clock: Clock) -> None:
    # Heals finished after the judged run's alert came are not "came back" failures.
    the_plan = plan(max_failures=1)
    run_id = start(journal, "healed", the_plan)
    (later,) = admit(journal, alert("later")).new_run_ids  # came while that one acted
    clock.advance(minutes=1)
    journal.finish_run(run_id, outcome="healed", verification="", plan=the_plan)
    assert judge(journal, later, the_plan).may_act


def test_a_cooldown_belongs_to_the_target_whatever_the_playbook(
    journal: Journal, clock: Clock
) -> None:
    run_id = start(journal, "down", plan(cooldown=600))
    journal.finish_run(run_id, outcome="healed", verification="", plan=plan(cooldown=600))
    assert journal.cooldowns() == [(ALPHA, T0 + timedelta(minutes=10), "restart-llama")]
    (stuck,) = admit(journal, alert("stuck", name="LlamaServerStuck")).new_run_ids
    verdict = judge(journal, stuck, plan(playbook="kill-stuck"))
    assert (verdict.wait_reason, verdict.not_before) == ("cooldown", T0 + timedelta(minutes=10))
    assert "restart-llama" in verdict.reason
    # A read-only playbook spends no budget: it runs inside the cooldown.
    (probe,) = admit(journal, alert("probe")).new_run_ids
    assert judge(journal, probe, plan(disruption=())).may_act
    clock.advance(minutes=10)
    assert judge(journal, stuck, plan(playbook="kill-stuck")).may_act


def test_budgets_nest_host_over_gpu_over_server(journal: Journal, clock: Clock) -> None:
    # A host-wide run cools down everything beneath it …
    host_run = start(journal, "host", plan(HOST, disruption=HOST_SET, cooldown=600))
    journal.finish_run(host_run, outcome="healed", verification="",
                       plan=plan(HOST, disruption=HOST_SET, cooldown=600))  # fmt: skip
    assert {target for target, _, _ in journal.cooldowns()} == set(HOST_SET)
    (on_gpu,) = admit(journal, alert("gpu")).new_run_ids
    (on_beta,) = admit(journal, alert("beta", server="beta")).new_run_ids
    assert judge(journal, on_gpu, plan(GPU0, disruption=GPU0_SET)).wait_reason == "cooldown"
    assert judge(journal, on_beta, plan(BETA)).wait_reason == "cooldown"
    clock.advance(minutes=10)
    # … a server's run cools only the server: its GPU's run waits, the other server is free.
    alpha_run = start(journal, "alpha", plan(cooldown=600))
    journal.finish_run(alpha_run, outcome="healed", verification="", plan=plan(cooldown=600))
    assert [target for target, _, _ in journal.cooldowns()] == [ALPHA]
    assert judge(journal, on_gpu, plan(GPU0, disruption=GPU0_SET)).wait_reason == "cooldown"
    assert judge(journal, on_beta, plan(BETA)).may_act


def test_a_longer_cooldown_is_kept(journal: Journal, clock: Clock) -> None:
    # A silent GPU run is taken over on its server; the server's run ends first, with a
    # long cooldown, and the GPU run's late end must not shorten it.
    gpu_plan = plan(GPU0, disruption=GPU0_SET, playbook="cap-gpu", cooldown=60)
    silent = start(journal, "gpu", gpu_plan)
    clock.advance(seconds=901)
    taker = start(journal, "alpha", plan(cooldown=3600))
    journal.finish_run(taker, outcome="healed", verification="", plan=plan(cooldown=3600))
    journal.finish_run(silent, outcome="healed", verification="", plan=gpu_plan)
    now = T0 + timedelta(seconds=901)
    assert journal.cooldowns() == [
        (GPU0, now + timedelta(seconds=60), "cap-gpu"),
        (ALPHA, now + timedelta(hours=1), "restart-llama"),
    ]


def test_the_hourly_cap_counts_only_disruptive_runs(
    make_journal: MakeJournal, clock: Clock
) -> None:
    journal = make_journal(limits=Limits(max_runs_per_hour=2))
    for i, delay in enumerate((0, 10)):
        clock.advance(minutes=delay)
        run_id = start(journal, f"d{i}", plan(f"server/dioscuri/s{i}"))
        journal.finish_run(run_id, outcome="healed", verification="")
    probe = start(journal, "probe", plan(disruption=()))  # read-only: not capped, not counted
    journal.finish_run(probe, outcome="healed", verification="")
    assert journal.count_started_since(T0) == 2
    (third,) = admit(journal, alert("d2")).new_run_ids
    verdict = judge(journal, third, plan("server/dioscuri/s2"))
    # Free again when the oldest start leaves the hour.
    assert (verdict.wait_reason, verdict.not_before) == ("rate_limited", T0 + timedelta(hours=1))
    assert "max_runs_per_hour 2" in verdict.reason
    clock.now = T0 + timedelta(hours=1)
    assert judge(journal, third, plan("server/dioscuri/s2")).may_act


def test_the_concurrency_cap_counts_every_running_run(
    make_journal: MakeJournal, journal_url: str, clock: Clock
) -> None:
    journal = make_journal(limits=Limits(max_concurrent_runs=1))
    probe = start(journal, "probe", plan(disruption=()))  # read-only runs take a place too
    (other,) = admit(journal, alert("other", server="beta")).new_run_ids
    verdict = judge(journal, other, plan(BETA))
    assert (verdict.wait_reason, verdict.not_before) == ("busy", T0 + timedelta(seconds=5))
    assert "max_concurrent_runs 1" in verdict.reason
    # Another replica sees the same cap.
    peer = make_journal(replica_id="r2", limits=Limits(max_concurrent_runs=1))
    (third,) = admit(peer, alert("third", server="gamma")).new_run_ids
    assert judge(peer, third, plan("server/dioscuri/gamma")).wait_reason == "busy"
    clock.advance(seconds=1)
    journal.finish_run(probe, outcome="healed", verification="")
    assert journal.next_due() == clock()  # the place it held is free: both are due
    assert judge(journal, other, plan(BETA)).may_act
    assert judge(peer, third, plan("server/dioscuri/gamma")).wait_reason == "busy"


def test_the_per_target_lock_holds_the_whole_set(journal: Journal, clock: Clock) -> None:
    gpu_run = start(journal, "gpu", plan(GPU0, disruption=GPU0_SET))
    (on_alpha,) = admit(journal, alert("alpha")).new_run_ids
    (on_beta,) = admit(journal, alert("beta", server="beta")).new_run_ids
    verdict = judge(journal, on_alpha, plan())
    assert (verdict.wait_reason, verdict.not_before) == ("locked", T0 + timedelta(seconds=5))
    assert verdict.reason == f"run {gpu_run} is acting on {ALPHA}"
    assert judge(journal, on_beta, plan(BETA)).may_act  # not in the GPU's set
    clock.advance(seconds=1)
    journal.finish_run(
        gpu_run, outcome="healed", verification="", plan=plan(GPU0, disruption=GPU0_SET)
    )
    assert judge(journal, on_alpha, plan()).may_act


def test_a_live_heartbeat_keeps_the_targets_held(journal: Journal, clock: Clock) -> None:
    holder = start(journal, "holder")
    (waiting,) = admit(journal, alert("waiting")).new_run_ids
    for _ in range(3):
        clock.advance(seconds=800)  # under lock_ttl (900 s) each time
        journal.heartbeat(holder)
        assert judge(journal, waiting, plan()).wait_reason == "locked"
    assert journal.events(kind="lock_takeover") == []


def test_a_silent_holder_is_taken_over_with_an_event(
    journal: Journal, make_journal: MakeJournal, clock: Clock
) -> None:
    holder = start(journal, "holder")
    clock.advance(seconds=901)  # its replica died: no heartbeat for over lock_ttl
    # Nor does the silent run hold a place under the concurrency cap.
    peer = make_journal(replica_id="r2", limits=Limits(max_concurrent_runs=1))
    (taker,) = admit(peer, alert("taker")).new_run_ids
    assert judge(peer, taker, plan()).may_act
    (event,) = journal.events(kind="lock_takeover")
    assert (event.run_id, event.target) == (taker, ALPHA)
    assert f"run {holder} (r1)" in event.detail
    assert peer.count_running() == 2  # the silent one is still `running` until recovered


def test_a_run_waits_at_most_max_wait_seconds(
    make_journal: MakeJournal, journal_url: str, clock: Clock
) -> None:
    journal = make_journal(limits=Limits(max_wait_seconds=100, wait_report_after_seconds=3600))
    (run_id,) = admit(journal, alert("fp1")).new_run_ids
    journal.set_paused(True, by="api")
    render = _Reports("told")
    for not_before in (30, 60, 90, 100):  # the last wait is cut to the limit
        verdict = judge(journal, run_id, plan(), reports=render)
        assert verdict.not_before == T0 + timedelta(seconds=not_before)
        clock.now = verdict.not_before
    verdict = judge(journal, run_id, plan(), reports=render)
    assert verdict.decision == "expired" and "waited 100 s" in verdict.reason
    assert "paused" in verdict.reason
    run = journal.get_run(run_id)
    assert run is not None and (run.state, run.decision) == ("done", "expired")
    assert _outbox(journal_url) == [(run_id, "told: expired")]  # no wait report: too short


def test_a_waiting_run_is_reported_once_past_the_report_delay(
    make_journal: MakeJournal, journal_url: str, clock: Clock
) -> None:
    journal = make_journal(limits=Limits(wait_report_after_seconds=60))
    (run_id,) = admit(journal, alert("fp1")).new_run_ids
    journal.set_paused(True, by="api")
    render = _Reports("waits")
    for _ in range(5):  # judged at 0, 30, 60, 90, 120 s
        assert judge(journal, run_id, plan(), reports=render).decision == "wait"
        clock.advance(seconds=30)
    assert _outbox(journal_url) == [(run_id, "waits: wait")]
    (asked,) = render.asked
    assert asked.wait_reason == "paused"


# -- a run's end -----------------------------------------------------------------------------


def test_finish_run_opens_the_breaker_only_at_max_failures(
    journal: Journal, journal_url: str, clock: Clock
) -> None:
    the_plan = plan(cooldown=60)
    opened = []
    for i in range(3):
        clock.advance(minutes=1)  # past the cooldown each time
        run_id = start(journal, f"f{i}", the_plan)
        opened.append(journal.finish_run(
            run_id, outcome="failed", verification="", plan=the_plan,
            reports=[("alerts-gpu", f"report {i}")], on_open=[("alerts-gpu", f"escalation {i}")],
        ))  # fmt: skip
    assert opened == [False, False, True]
    assert [content for _, content in _outbox(journal_url)] == [
        "report 0",
        "report 1",
        "report 2",
        "escalation 2",
    ]
    (event,) = journal.events(kind="escalation")
    assert event.target == ALPHA and "3 disruptive runs" in event.detail
    assert [b.opened_at for b in journal.breakers()] == [T0 + timedelta(minutes=3)]


def test_finish_run_cools_every_target_of_the_set(journal: Journal, clock: Clock) -> None:
    the_plan = plan(HOST, disruption=HOST_SET, cooldown=300)
    run_id = start(journal, "host", the_plan)
    clock.advance(minutes=1)
    journal.finish_run(run_id, outcome="not_healed", verification="", plan=the_plan)
    until = T0 + timedelta(minutes=6)
    assert sorted(journal.cooldowns()) == sorted((t, until, "restart-llama") for t in HOST_SET)
    # Without a plan (an engine error, a run that never acted) nothing cools down.
    other = start(journal, "other", plan("server/castor/gamma", host="castor"))
    journal.finish_run(other, outcome="failed", verification="engine error")
    assert len(journal.cooldowns()) == len(HOST_SET) and journal.breakers() == []


def test_finish_run_makes_the_runs_waiting_for_it_due(
    make_journal: MakeJournal, clock: Clock
) -> None:
    journal = make_journal(limits=Limits(max_concurrent_runs=2))
    holder = start(journal, "holder")
    (locked,) = admit(journal, alert("locked")).new_run_ids
    assert judge(journal, locked, plan()).wait_reason == "locked"
    start(journal, "second", plan("server/dioscuri/gamma"))  # two running now: the cap
    (busy,) = admit(journal, alert("busy", server="beta")).new_run_ids
    assert judge(journal, busy, plan(BETA)).wait_reason == "busy"
    (paused,) = admit(journal, alert("paused", server="delta")).new_run_ids
    journal.set_paused(True, by="api")
    assert judge(journal, paused, plan("server/dioscuri/delta")).wait_reason == "paused"
    clock.advance(seconds=1)
    journal.finish_run(holder, outcome="healed", verification="", plan=plan())
    due = {r.id: r.not_before for r in journal.waiting_runs()}
    # The pause is not the run's to end: that one waits on.
    assert due == {locked: clock(), busy: clock(), paused: T0 + timedelta(seconds=30)}


def test_finish_run_queues_its_reports_in_the_same_transaction(
    journal: Journal, journal_url: str
) -> None:
    run_id = start(journal, "fp1")
    journal.finish_run(
        run_id,
        outcome="healed",
        verification="held",
        reports=[("alerts-gpu", "**healed**"), ("alerts-infra", "copy")],
    )
    outbox = sorted(rows(journal_url, schema.outbox), key=lambda r: r["id"])
    assert [(r["topic"], r["content"], r["run_id"], r["state"]) for r in outbox] == [
        ("alerts-gpu", "**healed**", run_id, "pending"),
        ("alerts-infra", "copy", run_id, "pending"),
    ]
    run = journal.get_run(run_id)
    assert run is not None and run.outcome == "healed"
    # A run that cannot finish (already done) leaves no report, cooldown or breaker behind.
    with pytest.raises(RunStateError):
        journal.finish_run(run_id, outcome="failed", verification="", reports=[("t", "lost")],
                           plan=plan(cooldown=600, max_failures=1))  # fmt: skip
    assert len(rows(journal_url, schema.outbox)) == 2
    assert journal.cooldowns() == [] and journal.breakers() == []
    report = journal.enqueue_report("alerts-gpu", "notify only", run_id=None)
    assert report > outbox[-1]["id"]


# -- people's acts, events, leases -----------------------------------------------------------


def test_pause_and_maintenance_round_trip_with_events(journal: Journal, clock: Clock) -> None:
    assert journal.paused() is False and journal.maintenance() == {}
    journal.set_paused(True, by="api", reason="datacenter work")
    assert journal.paused() is True
    clock.advance(minutes=1)
    journal.set_maintenance("dioscuri", True, by="api", reason="swapping a GPU")
    clock.advance(minutes=1)
    end = T0 + timedelta(hours=1)
    journal.set_maintenance("dioscuri", True, by="alice", reason="still swapping", until=end)
    since = T0 + timedelta(minutes=1)  # kept when it is turned on again
    assert journal.maintenance() == {"dioscuri": (since, "still swapping")}
    assert journal.maintenance_windows() == {"dioscuri": (since, end, "still swapping", "alice")}
    journal.set_maintenance("dioscuri", False, by="api")
    journal.set_paused(False, by="api")
    assert journal.paused() is False and journal.maintenance() == {}
    kinds = [e.kind for e in journal.events()]
    assert kinds == ["resumed", "maintenance_off", "maintenance_on", "maintenance_on", "paused"]
    (paused,) = journal.events(kind="paused")
    assert paused.detail == "remediation paused by api: datacenter work" and paused.at == T0
    assert paused.actor == "api"
    latest = journal.events(kind="maintenance_on", limit=1)[0]
    assert (latest.target, latest.actor) == ("dioscuri", "alice")
    assert "until 2026-01-01 01:00:00Z" in latest.detail


def test_a_window_turned_on_after_it_ended_starts_again(journal: Journal, clock: Clock) -> None:
    journal.set_maintenance("dioscuri", True, by="alice", until=T0 + timedelta(minutes=5))
    clock.advance(minutes=10)
    assert journal.maintenance_windows() == {}
    journal.set_maintenance("dioscuri", True, by="bob", reason="again")
    assert journal.maintenance_windows() == {"dioscuri": (clock(), None, "again", "bob")}


def test_a_person_cancels_a_waiting_run(journal: Journal) -> None:
    (run_id,) = admit(journal, alert("fp1")).new_run_ids
    journal.set_paused(True, by="api")
    assert judge(journal, run_id, plan()).decision == "wait"
    journal.cancel_run(run_id, by="alice", reason="fixed by hand")
    run = journal.get_run(run_id)
    assert run is not None and (run.state, run.decision, run.not_before) == (
        "done",
        "cancelled",
        None,
    )
    (event,) = journal.events(kind="run_cancelled")
    assert (event.run_id, event.actor) == (run_id, "alice") and "fixed by hand" in event.detail
    with pytest.raises(RunStateError, match="is done"):
        journal.cancel_run(run_id, by="alice", reason="")
    journal.set_paused(False, by="api")
    running = start(journal, "running")
    with pytest.raises(RunStateError, match="is running"):
        journal.cancel_run(running, by="alice", reason="")
    assert journal.events(kind="run_cancelled") == [event]


def test_a_person_acknowledges_an_escalation(journal: Journal) -> None:
    escalation = journal.add_event("escalation", "breaker opened", target=ALPHA, run_id=7)
    ack = journal.acknowledge(escalation, by="alice", reason="on it")
    (event,) = journal.events(ref_id=escalation)
    assert (event.id, event.kind, event.actor, event.run_id, event.target) == (
        ack,
        "escalation_ack",
        "alice",
        7,
        ALPHA,
    )
    with pytest.raises(RunStateError, match="not an escalation"):
        journal.acknowledge(ack, by="alice")
    with pytest.raises(RunStateError, match="not an escalation"):
        journal.acknowledge(999999, by="alice")


def test_add_event_and_events(journal: Journal) -> None:
    first = journal.add_event("escalation", "breaker opened", playbook="p", target="t")
    second = journal.add_event("escalation", "again", run_id=7)
    assert second > first
    assert [(e.id, e.run_id, e.playbook) for e in journal.events(kind="escalation")] == [
        (second, 7, None),
        (first, None, "p"),
    ]
    assert journal.events(kind="nothing") == []
    assert [e.id for e in journal.events(limit=1)] == [second]


def test_a_lease_is_held_by_one_replica_until_it_expires(
    journal: Journal, make_journal: MakeJournal, journal_url: str, clock: Clock
) -> None:
    peer = make_journal(replica_id="r2")
    ttl = timedelta(seconds=60)
    assert journal.take_lease("outbox", ttl)
    assert not peer.take_lease("outbox", ttl)
    assert peer.take_lease("restore", ttl)  # another name
    clock.advance(seconds=50)
    assert journal.take_lease("outbox", ttl)  # renewed: now until 110 s
    clock.advance(seconds=50)
    assert not peer.take_lease("outbox", ttl)
    peer.release_lease("outbox")  # not its lease: nothing happens
    assert not peer.take_lease("outbox", ttl)
    clock.advance(seconds=10)
    assert peer.take_lease("outbox", ttl)  # expired: taken over
    journal.release_lease("outbox")  # the old holder's late release frees nothing
    assert not journal.take_lease("outbox", ttl)
    held = {r["target"]: (r["owner"], r["acquired_at"]) for r in rows(journal_url, schema.locks)}
    assert held == {"lease/outbox": ("r2", clock()), "lease/restore": ("r2", T0)}
    peer.release_lease("outbox")
    assert journal.take_lease("outbox", ttl)


def test_a_lease_is_exclusive_between_threads(journal: Journal, make_journal: MakeJournal) -> None:
    replicas = [journal] + [make_journal(replica_id=f"r{i}") for i in range(2, 9)]
    barrier = threading.Barrier(len(replicas))
    won: list[str] = []
    errors: list[BaseException] = []

    def take(replica: Journal) -> None:
        barrier.wait()
        try:
            if replica.take_lease("outbox", timedelta(minutes=5)):
                won.append(replica.replica_id)
        except JournalError as exc:
            errors.append(exc)

    threads = [threading.Thread(target=take, args=(r,)) for r in replicas]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == [] and len(won) == 1


# -- recovery, pruning -----------------------------------------------------------------------


def test_recover_interrupted(
    journal: Journal, make_journal: MakeJournal, journal_url: str, clock: Clock
) -> None:
    (claimed_id,) = admit(journal, alert("claimed", server="beta")).new_run_ids
    claim(journal, claimed_id)
    running_id = start(journal, "running")
    journal.record_step(running_id, 0, "kill_process", {}, started_at=T0, finished_at=None,
                        result="running", output="")  # fmt: skip
    assert journal.take_lease("outbox", timedelta(minutes=5))
    peer = make_journal(replica_id="r2")
    others = start(peer, "others", plan("server/castor/gamma", host="castor"), host="castor")
    assert peer.take_lease("restore", timedelta(minutes=5))

    clock.advance(minutes=1)
    restarted = make_journal()  # the same replica, again
    told = restarted.recover_interrupted(lambda run: [("alerts-gpu", f"{run.id} interrupted")])
    assert told == [running_id]
    assert restarted.recover_interrupted() == []
    back = restarted.get_run(claimed_id)
    assert back is not None and (back.state, back.owner) == ("pending", None)
    claim(restarted, claimed_id)  # decided afresh (out of the way of the runs below)
    restarted.decide(claimed_id, "notify_only", "")
    cut = restarted.get_run(running_id)
    assert cut is not None
    assert (cut.state, cut.outcome, cut.finished_at) == ("done", "interrupted", clock())
    assert cut.steps[0].result == "interrupted"
    (event,) = restarted.events(kind="interrupted")
    assert (event.run_id, event.target) == (running_id, ALPHA)
    assert _outbox(journal_url) == [(running_id, f"{running_id} interrupted")]
    # Its target is free, and the interruption counts as a failure there (max_failures 1).
    (after,) = admit(restarted, alert("after")).new_run_ids
    assert judge(restarted, after, plan(max_failures=1)).decision == "breaker_open"
    # Another replica's run and lease are untouched; its target is still held.
    other = restarted.get_run(others)
    assert other is not None and other.state == "running"
    (blocked,) = admit(restarted, alert("blocked", host="castor")).new_run_ids
    verdict = judge(restarted, blocked, plan("server/castor/gamma", host="castor"))
    assert verdict.wait_reason == "locked"
    assert [r["target"] for r in rows(journal_url, schema.locks)] == ["lease/restore"]


def test_prune_keeps_open_state_and_deletes_old_rows(
    journal: Journal, journal_url: str, clock: Clock
) -> None:
    # Thirty-one days ago: a healed run of a resolved alert (all of it goes) …
    healed = start(journal, "healed")
    journal.record_step(healed, 0, "probe", {}, started_at=T0, finished_at=T0, result="ok",
                        output="")  # fmt: skip
    journal.finish_run(healed, outcome="healed", verification="ok", reports=[("t", "sent")],
                       plan=plan(cooldown=600))  # fmt: skip
    admit(journal, alert("healed", status="resolved"))
    # … a run still waiting, and a done run of an alert that still fires (both stay) …
    (waiting,) = admit(journal, alert("waiting", server="beta")).new_run_ids
    (firing,) = admit(journal, alert("firing", server="gamma")).new_run_ids
    journal.set_maintenance("dioscuri", True, by="api", until=T0 + timedelta(hours=1))
    assert judge(journal, waiting, plan(BETA)).wait_reason == "maintenance"
    claim(journal, firing)
    journal.decide(firing, "notify_only", "no playbook")
    journal.enqueue_report("t", "unsent")  # stays: never sent
    journal.set_maintenance("castor", True, by="api")  # no end: stays
    # A breaker opened and reset long ago goes; one still open stays.
    for target in ("x", "y"):
        for i in range(3):
            run_id = start(journal, f"{target}{i}", plan(target, host="elsewhere"))
            journal.finish_run(run_id, outcome="failed", verification="",
                               plan=plan(target, host="elsewhere"))  # fmt: skip
    assert journal.reset_breaker("x", by="alice")
    journal.set_paused(True, by="api")  # an old event
    assert journal.take_lease("outbox", timedelta(minutes=5))
    plain = engine(journal_url)
    try:
        with plain.begin() as conn:
            conn.execute(
                sa.update(schema.outbox)
                .where(schema.outbox.c.content == "sent")
                .values(state="sent")
            )
    finally:
        plain.dispose()

    clock.advance(days=31)
    (recent,) = admit(journal, alert("recent", server="delta")).new_run_ids
    journal.add_event("escalation", "recent")
    before = counts(journal_url)
    deleted = journal.prune()
    after = counts(journal_url)
    assert deleted == sum(before.values()) - sum(after.values()) > 0
    assert journal.prune() == 0

    assert journal.get_run(healed) is None
    kept_runs = {r.id for r in journal.recent_runs()}
    assert {waiting, firing, recent} <= kept_runs and healed not in kept_runs
    fingerprints = {a["fingerprint"] for a in rows(journal_url, schema.alerts)}
    assert "healed" not in fingerprints and {"waiting", "firing", "recent"} <= fingerprints
    assert len(rows(journal_url, schema.notifications)) == 1  # the recent one
    assert [e.detail for e in journal.events()] == ["recent"]
    assert [r["content"] for r in rows(journal_url, schema.outbox)] == ["unsent"]
    assert [b.target for b in journal.breakers(only_open=False)] == ["y"]
    assert rows(journal_url, schema.target_cooldowns) == []
    assert {r["host"] for r in rows(journal_url, schema.maintenance)} == {"castor"}
    assert healed not in {r["run_id"] for r in rows(journal_url, schema.run_targets)}
    assert [r["target"] for r in rows(journal_url, schema.locks)] == ["lease/outbox"]
    assert journal.paused() is True  # settings are state, never pruned


# -- schema, errors, SQLite ------------------------------------------------------------------


def test_schema_version_is_recorded(
    journal: Journal, make_journal: MakeJournal, journal_url: str
) -> None:
    assert journal.schema_version() == schema.SCHEMA_VERSION == 3
    assert [r["version"] for r in rows(journal_url, schema.schema_version)] == [1, 2, 3]
    make_journal(replica_id="r2")  # opening again migrates nothing
    assert len(rows(journal_url, schema.schema_version)) == 3


def test_a_newer_schema_is_refused(journal: Journal, journal_url: str) -> None:
    plain = engine(journal_url)
    try:
        with plain.begin() as conn:
            conn.execute(sa.insert(schema.schema_version).values(version=99, applied_at=T0))
    finally:
        plain.dispose()
    with pytest.raises(JournalError, match=r"schema is version 99, newer than .* knows \(3\)"):
        Journal(journal_url, replica_id="r2")


def test_an_unwritable_sqlite_path_is_a_journal_error(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory\n")
    with pytest.raises(JournalError, match="cannot create the directory"):
        Journal(f"sqlite:///{blocker / 'sub' / 'journal.db'}", replica_id="r1")
    with pytest.raises(JournalError, match=r"cannot open the schema: .*unable to open database"):
        Journal(f"sqlite:///{tmp_path}", replica_id="r1")  # a directory, not a file


def test_errors_never_show_the_password() -> None:
    url = "postgresql://postgres:s3cret-pw@127.0.0.1:5432/gpufleet_test_does_not_exist"
    with pytest.raises(JournalError) as caught:
        Journal(url, replica_id="r1")
    message = str(caught.value)
    assert "s3cret-pw" not in message and "***" in message
    assert "gpufleet_test_does_not_exist" in message and "does not exist" in message
    with pytest.raises(JournalError, match="unsupported database 'mysql'"):
        Journal("mysql://u:pw@127.0.0.1/db", replica_id="r1")
    with pytest.raises(JournalError, match="not a database URL") as caught:
        Journal("::s3cret-pw::", replica_id="r1")
    assert "s3cret-pw" not in str(caught.value)


def test_a_vanished_postgresql_database_is_a_journal_error(clock: Clock) -> None:
    with throwaway_database() as url:
        journal = Journal(url, replica_id="r1", clock=clock)
        drop_database(url)
        raw = body(alert("fp1"))
        with pytest.raises(JournalError, match="cannot admit a notification"):
            journal.admit(parse_notification(raw), raw)
        with pytest.raises(JournalError, match=r"cannot write \(health check\)"):
            journal.check_writable()
        journal.close()


def test_sqlite_pragmas_are_in_effect(tmp_path: Path) -> None:
    path = tmp_path / "journal.db"
    journal = Journal(f"sqlite:///{path}", replica_id="r1")
    try:
        pool = journal._engine  # the journal's own pool: pragmas are per connection
        with pool.connect() as a, pool.connect() as b:
            for conn in (a, b):
                pragma = {
                    name: conn.exec_driver_sql(f"PRAGMA {name}").scalar()
                    for name in ("journal_mode", "synchronous", "foreign_keys", "busy_timeout")
                }
                assert pragma == {
                    "journal_mode": "wal",
                    "synchronous": 1,  # NORMAL
                    "foreign_keys": 1,
                    "busy_timeout": 10_000,
                }
    finally:
        journal.close()
    with sqlite3.connect(path) as plain:  # WAL is a property of the file itself
        assert plain.execute("PRAGMA journal_mode").fetchone() == ("wal",)


def test_in_memory_sqlite_serves_several_threads() -> None:
    journal = Journal("sqlite://", replica_id="r1")
    try:
        admit(journal, *[alert(f"fp{i}") for i in range(20)])
        assert len(_claim_all(journal, threads=4)) == 20
    finally:
        journal.close()


def test_bound_output_keeps_head_and_tail_within_the_limit() -> None:
    assert bound_output("short") == "short"
    text = "é" * 50_000 + "MIDDLE" + "ü" * 50_000
    cut = bound_output(text, limit=1000)
    assert len(cut.encode()) <= 1000
    assert cut.startswith("é") and cut.endswith("ü") and "bytes cut" in cut
