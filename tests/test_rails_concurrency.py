"""The rails under contention: two replicas, four workers each, released together.

`admit_to_act` decides "may this act now?" in one transaction that no other rails decision
interleaves with (`rails.py`). These tests try to make it interleave: two `Journal`s with
different `replica_id` (two replicas; in the last tests two real processes) and four worker
threads each, on one database. Every round, behind a barrier each time, the eight
workers admit an alert each, claim a run each, and then call `admit_to_act` at the same
moment; the runs allowed to act hold until the test has read the journal, then finish. The
round repeats, with the runs left waiting (made due again by the finishes) among the next
round's claims.

What must hold, every round and overall:

- the concurrency cap (`max_concurrent_runs`) and the per-target lock are never exceeded:
  counted from the workers' side (under a lock, as each learns it may act), read from the
  journal's own count while they hold, and checked afterwards from the runs' recorded
  [started_at, finished_at] intervals;
- the cap is used, not just respected: as many runs act per round as it allows;
- every run has either run once (`done`, with a start) or waits (`pending`, waiting for the
  cap or the lock); none is left claimed or running, none ran twice;
- the hourly cap (`max_runs_per_hour`) admits exactly that many disruptive runs in all.

On PostgreSQL, which several replicas share (the rails' advisory lock), and on a SQLite file,
where two processes on one journal (a `replay` beside the server) meet through `BEGIN
IMMEDIATE`. The clock is the real one: the barriers, not the time, order the workers, and
nothing sleeps.
"""

from __future__ import annotations

import multiprocessing
import queue
import threading
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from remediator.config import Limits
from remediator.journal import Journal
from tests.journal_lab import admit, alert, plan
from tests.pg import throwaway_database

SPAWN = multiprocessing.get_context("spawn")  # fork would copy the parent's pooled sockets
REPLICAS = ("r1", "r2")
WORKERS = 4  # per replica
PARTIES = len(REPLICAS) * WORKERS + 1  # the workers, and the test itself, which reads at `held`
ROUNDS = 6
BARRIER_TIMEOUT_S = 60
# The barrier's phases, per round: the test waits through the same ones.
PHASES = ("round", "admitted", "claimed", "held", "read")


@dataclass(frozen=True)
class Case:
    """One contention scenario: the limits, and whether every run targets one server."""

    name: str
    limits: dict[str, int]
    one_target: bool
    acting_per_round: int  # how many runs act each round (all judged while none acts)


CASES = [
    Case("cap 1", {"max_concurrent_runs": 1}, one_target=False, acting_per_round=1),
    Case("cap 2", {"max_concurrent_runs": 2}, one_target=False, acting_per_round=2),
    Case("one target", {"max_concurrent_runs": 8}, one_target=True, acting_per_round=1),
    Case("one target, cap 2", {"max_concurrent_runs": 2}, one_target=True, acting_per_round=1),
]


@pytest.fixture(params=["postgresql", "sqlite"])
def url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """The shared database: PostgreSQL (what replicas share), and a SQLite file for contrast."""
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'journal.db'}"
    else:
        with throwaway_database() as database:
            yield database


def _server(replica: str, worker: int, round_: int, one_target: bool) -> str:
    return "alpha" if one_target else f"{replica}-w{worker}-n{round_}"


@dataclass(frozen=True)
class Rounds:
    """What every worker of every replica shares (threads or processes alike)."""

    rounds: int
    one_target: bool
    barrier: Any  # multiprocessing Barrier(PARTIES)
    active: Any  # Value("i"): runs acting now, as the workers know it
    peak: Any  # Value("i"): the most acting at once
    results: Any  # Queue: ("verdict", round, run id, decision, wait reason) or ("error", …)


def _worker(journal: Journal, worker: int, shared: Rounds) -> None:
    """One worker's rounds (see the module); every verdict goes to `shared.results`."""
    replica = journal.replica_id
    barrier = shared.barrier
    try:
        for round_ in range(shared.rounds):
            barrier.wait(BARRIER_TIMEOUT_S)  # round
            server = _server(replica, worker, round_, shared.one_target)
            admit(journal, alert(f"{replica}-w{worker}-n{round_}", server=server))
            barrier.wait(BARRIER_TIMEOUT_S)  # admitted
            run = journal.claim_next_run()
            assert run is not None, "fewer due runs than workers"
            # Every run heals, and on one target each heal is followed by another alert: the
            # breaker would count those as heals that did not stick. It is not under test.
            the_plan = plan(f"server/dioscuri/{run.alert.labels['server']}", max_failures=1000)
            barrier.wait(BARRIER_TIMEOUT_S)  # claimed: all eight into the rails at once
            verdict = journal.admit_to_act(run.id, the_plan)
            if verdict.may_act:
                with shared.active.get_lock():
                    shared.active.value += 1
                    shared.peak.value = max(shared.peak.value, shared.active.value)
            shared.results.put(("verdict", round_, run.id, verdict.decision, verdict.wait_reason))
            barrier.wait(BARRIER_TIMEOUT_S)  # held: the test reads the journal now
            barrier.wait(BARRIER_TIMEOUT_S)  # read
            if verdict.may_act:
                with shared.active.get_lock():
                    shared.active.value -= 1
                journal.finish_run(run.id, outcome="healed", verification="", plan=the_plan)
    except Exception as exc:
        shared.results.put(("error", replica, worker, f"{type(exc).__name__}: {exc}"))
        barrier.abort()  # the others and the test stop waiting at once
        raise


def _replica(url: str, replica: str, limits: dict[str, int], shared: Rounds) -> None:
    """One replica: a `Journal` of its own and `WORKERS` threads sharing it."""
    journal = Journal(url, replica_id=replica, limits=Limits(**limits))
    try:
        threads = [
            threading.Thread(
                target=_worker, args=(journal, i, shared), name=f"{replica}-worker-{i}"
            )
            for i in range(WORKERS)
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        journal.close()


def _drain(results: Any) -> list[tuple[Any, ...]]:
    got: list[tuple[Any, ...]] = []
    while True:
        try:
            got.append(results.get(timeout=0.5))
        except queue.Empty:
            return got


def _contend(
    url: str, limits: dict[str, int], rounds: int, one_target: bool, *, processes: bool
) -> tuple[list[tuple[Any, ...]], list[tuple[int, int]], int]:
    """Run the rounds; the verdicts, (running, most on one target) read at each `held`, peak."""
    shared = Rounds(
        rounds,
        one_target,
        barrier=SPAWN.Barrier(PARTIES),
        active=SPAWN.Value("i", 0),
        peak=SPAWN.Value("i", 0),
        results=SPAWN.Queue(),
    )
    barrier = shared.barrier
    args = [(url, r, limits, shared) for r in REPLICAS]
    replicas: list[Any] = (
        [SPAWN.Process(target=_replica, args=a, name=a[1]) for a in args]
        if processes
        else [threading.Thread(target=_replica, args=a, name=a[1]) for a in args]
    )
    observer = Journal(url, replica_id="observer")
    held: list[tuple[int, int]] = []
    try:
        for replica in replicas:
            replica.start()
        for _ in range(rounds):
            for phase in PHASES:
                barrier.wait(BARRIER_TIMEOUT_S)
                if phase == "held":
                    running = [r for r in observer.recent_runs(1000) if r.state == "running"]
                    per_target = Counter(r.target for r in running)
                    held.append((observer.count_running(), max(per_target.values(), default=0)))
    except threading.BrokenBarrierError:
        pass  # a worker failed: its error is in the results, asserted below
    finally:
        for replica in replicas:
            replica.join(BARRIER_TIMEOUT_S)
        observer.close()
    got = _drain(shared.results)
    errors = [g for g in got if g[0] == "error"]
    assert errors == [], errors
    if processes:
        assert [p.exitcode for p in replicas] == [0] * len(replicas)
    return [g[1:] for g in got], held, shared.peak.value


def _check_the_journal(url: str, verdicts: list[tuple[Any, ...]], cap: int) -> None:
    """Every run ran once or waits; recorded intervals never exceed the cap or the lock."""
    journal = Journal(url, replica_id="checker")
    try:
        runs = journal.recent_runs(10_000)
    finally:
        journal.close()
    acted = Counter(run_id for _, run_id, decision, _ in verdicts if decision == "run")
    assert set(acted.values()) <= {1}, "a run was allowed to act twice"
    for run in runs:
        if run.id in acted:
            assert (run.state, run.outcome) == ("done", "healed") and run.started_at is not None
        else:
            assert run.state == "pending" and run.wait_reason in ("busy", "locked"), run
    # From the records: at no instant more runs acting than the cap, or two on one target.
    intervals = [(r.started_at, r.finished_at, r.target) for r in runs if r.started_at]
    for started, _, _ in intervals:
        at_once = [
            t for s, f, t in intervals if s is not None and f is not None and s <= started < f
        ]
        assert len(at_once) <= cap and max(Counter(at_once).values()) <= 1


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_two_replicas_never_exceed_the_cap_or_the_lock(url: str, case: Case) -> None:
    verdicts, held, peak = _contend(url, case.limits, ROUNDS, case.one_target, processes=False)
    cap = case.limits["max_concurrent_runs"]
    assert len(verdicts) == ROUNDS * len(REPLICAS) * WORKERS
    per_round = Counter(round_ for round_, _, decision, _ in verdicts if decision == "run")
    assert [per_round[r] for r in range(ROUNDS)] == [case.acting_per_round] * ROUNDS
    refused = {(d, w) for _, _, d, w in verdicts if d != "run"}
    assert refused == {("wait", "locked" if case.one_target else "busy")}
    assert peak == case.acting_per_round  # the workers' own count, under their lock
    assert all(running <= cap and on_one <= 1 for running, on_one in held), held
    assert [running for running, _ in held] == [case.acting_per_round] * ROUNDS
    _check_the_journal(url, verdicts, cap)


def test_two_replicas_never_exceed_the_hourly_cap(url: str) -> None:
    limits = {"max_concurrent_runs": 8, "max_runs_per_hour": 5}
    verdicts, _, peak = _contend(url, limits, 3, one_target=False, processes=False)
    acted = [run_id for _, run_id, decision, _ in verdicts if decision == "run"]
    assert len(acted) == 5 and peak == 5  # all five in the first round, none after
    assert {w for _, _, d, w in verdicts if d != "run"} == {"rate_limited"}
    journal = Journal(url, replica_id="checker")
    try:
        started = journal.count_started_since(journal._clock() - timedelta(hours=1))
        assert started == 5
        waiting = journal.waiting_runs(1000)
        assert len(waiting) == 3 * 8 - 5 and {r.wait_reason for r in waiting} == {"rate_limited"}
    finally:
        journal.close()


@pytest.mark.parametrize("case", [CASES[1], CASES[2]], ids=[CASES[1].name, CASES[2].name])
def test_two_replica_processes_never_exceed_the_cap_or_the_lock(url: str, case: Case) -> None:
    rounds = 4
    verdicts, held, peak = _contend(url, case.limits, rounds, case.one_target, processes=True)
    assert len(verdicts) == rounds * len(REPLICAS) * WORKERS
    per_round = Counter(round_ for round_, _, decision, _ in verdicts if decision == "run")
    assert [per_round[r] for r in range(rounds)] == [case.acting_per_round] * rounds
    assert peak == case.acting_per_round
    assert [running for running, _ in held] == [case.acting_per_round] * rounds
    assert all(on_one <= 1 for _, on_one in held)
    _check_the_journal(url, verdicts, case.limits["max_concurrent_runs"])
