"""The journal against both databases it supports: a SQLite file and the real PostgreSQL.

Every test runs twice (the `journal_url` fixture): on a fresh SQLite file under tmp_path and
on a fresh PostgreSQL database made by `tests.pg` (dropped afterwards). A machine without
PostgreSQL fails the PostgreSQL half loudly; nothing is skipped.

Races are real: threads share one `Journal`, and child processes (spawned, each with its own
`Journal`, as replicas are) are released together behind a `multiprocessing.Barrier`.
"""

from __future__ import annotations

import json
import multiprocessing
import queue
import sqlite3
import threading
import time
from collections import Counter
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from remediator.alerts import parse_notification
from remediator.journal import schema
from remediator.journal import (
    Journal,
    JournalError,
    RunStateError,
    bound_output,
)
from tests.pg import drop_database, throwaway_database

T0 = datetime(2026, 1, 1, tzinfo=UTC)
SPAWN = multiprocessing.get_context("spawn")  # fork would copy the parent's pooled sockets
CHILD_TIMEOUT_S = 60


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


class Clock:
    """A clock the test moves by hand."""

    def __init__(self, start: datetime = T0) -> None:
        self.now = start

    def __call__(self) -> datetime:
        return self.now

    def advance(self, **delta: float) -> None:
        self.now += timedelta(**delta)


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
def journal(journal_url: str, clock: Clock) -> Iterator[Journal]:
    j = Journal(journal_url, replica_id="r1", clock=clock)
    yield j
    j.close()


def _engine(url: str) -> sa.Engine:
    """A plain engine on the journal's database, to look at (or tamper with) its tables."""
    parsed = sa.make_url(url)
    if parsed.drivername == "postgresql":
        parsed = parsed.set(drivername="postgresql+psycopg")
    return sa.create_engine(parsed)


def _rows(url: str, table: sa.Table) -> list[dict[str, Any]]:
    engine = _engine(url)
    try:
        with engine.connect() as conn:
            return [dict(row) for row in conn.execute(sa.select(table)).mappings()]
    finally:
        engine.dispose()


def _counts(url: str) -> dict[str, int]:
    engine = _engine(url)
    try:
        with engine.connect() as conn:
            return {
                table.name: int(
                    conn.execute(sa.select(sa.func.count()).select_from(table)).scalar_one()
                )
                for table in schema.metadata.sorted_tables
            }
    finally:
        engine.dispose()


def _alert(
    fingerprint: str,
    *,
    status: str = "firing",
    starts: str = "2026-01-01T00:00:00Z",
    name: str = "LlamaServerDown",
    **labels: str,
) -> dict[str, Any]:
    return {
        "status": status,
        "labels": {"alertname": name, "host": "dioscuri", "server": "alpha", **labels},
        "annotations": {"summary": f"{name} on dioscuri/alpha"},
        "startsAt": starts,
        "endsAt": "2026-01-01T00:10:00Z" if status == "resolved" else "0001-01-01T00:00:00Z",
        "generatorURL": "http://127.0.0.1:9090/graph?g0.expr=up",
        "fingerprint": fingerprint,
    }


def _body(*alerts: dict[str, Any]) -> bytes:
    status = "firing" if any(a["status"] == "firing" for a in alerts) else "resolved"
    return json.dumps(
        {
            "version": "4",
            "groupKey": '{}:{alertname="LlamaServerDown"}',
            "status": status,
            "receiver": "remediator",
            "groupLabels": {"alertname": "LlamaServerDown"},
            "externalURL": "http://127.0.0.1:9093",
            "alerts": list(alerts),
        }
    ).encode()


def _record(journal: Journal, *alerts: dict[str, Any]) -> Any:
    body = _body(*alerts)
    return journal.admit(parse_notification(body), body)


def _running_run(journal: Journal, fingerprint: str, target: str = "server/dioscuri/alpha") -> int:
    """A new run, claimed and started by `journal`'s replica."""
    (run_id,) = _record(journal, _alert(fingerprint)).new_run_ids
    claimed = journal.claim_next_run()
    assert claimed is not None and claimed.id == run_id
    journal.start_run(run_id, playbook="restart-llama", target=target)
    return int(run_id)


# -- the webhook path ------------------------------------------------------------------------


def test_repeat_interval_and_ha_duplicate_make_one_run(
    journal: Journal, journal_url: str, clock: Clock
) -> None:
    first = _record(journal, _alert("fp1"))
    assert len(first.new_run_ids) == 1 and first.duplicates == 0
    clock.advance(minutes=5)  # Alertmanager's repeat interval: the same occurrence again
    again = _record(journal, _alert("fp1"))
    # The HA peer sends it too, through another replica.
    peer = Journal(journal_url, replica_id="r2", clock=clock)
    try:
        twin = _record(peer, _alert("fp1"))
    finally:
        peer.close()
    assert (again.new_run_ids, again.duplicates) == ([], 1)
    assert (twin.new_run_ids, twin.duplicates) == ([], 1)
    runs = journal.recent_runs()
    assert [r.id for r in runs] == first.new_run_ids
    alert = runs[0].alert
    assert alert.first_seen == T0 and alert.last_seen == T0 + timedelta(minutes=5)
    assert alert.starts_at == T0 and alert.starts_at.tzinfo is not None
    assert alert.status == "firing" and alert.alertname == "LlamaServerDown"
    assert len(_rows(journal_url, schema.notifications)) == 3  # each one is kept, raw
    assert journal.queue_depth() == 1


def test_a_new_starts_at_is_a_new_occurrence(journal: Journal) -> None:
    first = _record(journal, _alert("fp1"))
    later = _record(journal, _alert("fp1", starts="2026-01-02T00:00:00+00:00"))
    assert len(first.new_run_ids) == len(later.new_run_ids) == 1
    # The same instant written with another zone is the same occurrence.
    same = _record(journal, _alert("fp1", starts="2026-01-02T01:00:00+01:00"))
    assert same.duplicates == 1 and same.new_run_ids == []


def test_resolved_closes_the_alert_and_starts_nothing(journal: Journal, journal_url: str) -> None:
    (run_id,) = _record(journal, _alert("fp1")).new_run_ids
    result = _record(journal, _alert("fp1", status="resolved"))
    assert (result.new_run_ids, result.resolved) == ([], 1)
    run = journal.get_run(run_id)
    assert run is not None and run.alert.status == "resolved"
    assert run.alert.resolved_at == datetime(2026, 1, 1, 0, 10, tzinfo=UTC)  # its endsAt
    assert _record(journal, _alert("fp1", status="resolved")).resolved == 0  # a resend
    assert journal.queue_depth() == 1 and len(journal.recent_runs()) == 1


def test_resolved_with_another_starts_at_closes_the_newest_open_one(journal: Journal) -> None:
    _record(journal, _alert("fp1", starts="2026-01-01T00:00:00Z"))
    (newer,) = _record(journal, _alert("fp1", starts="2026-01-01T01:00:00Z")).new_run_ids
    result = _record(journal, _alert("fp1", status="resolved", starts="2026-01-01T00:30:00Z"))
    assert result.resolved == 1
    by_start = {r.alert.starts_at.hour: r.alert.status for r in journal.recent_runs()}
    assert by_start == {0: "firing", 1: "resolved"}
    run = journal.get_run(newer)
    assert run is not None and run.alert.status == "resolved"


def test_a_late_firing_after_its_resolved_starts_nothing(journal: Journal) -> None:
    # Alertmanager retried the firing notification (our 5xx) after the resolved one got in.
    assert _record(journal, _alert("fp1", status="resolved")).resolved == 1
    late = _record(journal, _alert("fp1"))
    assert (late.new_run_ids, late.duplicates) == ([], 1)
    assert journal.queue_depth() == 0


def test_a_grouped_notification_with_three_alerts_makes_three_runs(
    journal: Journal, journal_url: str
) -> None:
    result = _record(
        journal,
        _alert("fpa", server="alpha"),
        _alert("fpb", server="beta"),
        _alert("fpc", server="gamma"),
    )
    assert len(set(result.new_run_ids)) == 3 and result.duplicates == 0
    runs = {r.alert.labels["server"]: r for r in journal.recent_runs()}
    assert sorted(runs) == ["alpha", "beta", "gamma"]
    assert all(r.state == "pending" and r.steps == [] for r in runs.values())
    assert runs["beta"].alert.annotations == {"summary": "LlamaServerDown on dioscuri/alpha"}
    (stored,) = _rows(journal_url, schema.notifications)
    assert stored["id"] == result.notification_id
    assert json.loads(stored["raw"])["groupKey"] == '{}:{alertname="LlamaServerDown"}'


def test_text_a_database_refuses_is_made_storable(journal: Journal) -> None:
    # PostgreSQL refuses NUL in text; a label or an output with one must not 5xx forever.
    result = _record(journal, _alert("fp\u0000nul", server="a\u0000b"))
    (run_id,) = result.new_run_ids
    claimed = journal.claim_next_run()
    assert claimed is not None and claimed.alert.labels["server"] == "a\u0000b"
    journal.start_run(run_id, playbook="p", target="t")
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


def _record_in_process(
    url: str, replica: str, barrier: Any, results: Any, bodies: list[bytes]
) -> None:
    journal = Journal(url, replica_id=replica)
    parsed = [(parse_notification(b), b) for b in bodies]
    barrier.wait(CHILD_TIMEOUT_S)
    outcome = [journal.admit(n, b) for n, b in parsed]
    results.put((replica, [len(r.new_run_ids) for r in outcome], [r.duplicates for r in outcome]))
    journal.close()


def test_two_processes_recording_the_same_notifications_make_one_run_each(
    journal: Journal, journal_url: str
) -> None:
    bodies = [_body(_alert(f"fp{i}")) for i in range(20)]
    barrier = SPAWN.Barrier(2)
    results = SPAWN.Queue()
    children = [
        SPAWN.Process(target=_record_in_process, args=(journal_url, r, barrier, results, bodies))
        for r in ("r1", "r2")
    ]
    got = _gather(children, results)
    new = [sum(pair) for pair in zip(got[0][1], got[1][1], strict=True)]
    duplicates = [sum(pair) for pair in zip(got[0][2], got[1][2], strict=True)]
    assert new == [1] * 20 and duplicates == [1] * 20
    assert journal.queue_depth() == 20


# -- the engine path -------------------------------------------------------------------------


def _fifty_pending(journal: Journal) -> list[int]:
    ids = _record(journal, *[_alert(f"fp{i:02}") for i in range(50)]).new_run_ids
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


def test_claim_takes_the_oldest_first_and_requeue_gives_it_back(journal: Journal) -> None:
    first = _record(journal, _alert("a")).new_run_ids[0]
    second = _record(journal, _alert("b")).new_run_ids[0]
    run = journal.claim_next_run()
    assert run is not None and run.id == first and run.claimed_at == T0
    journal.requeue(first, "fleet-wide concurrency cap reached")
    again = journal.get_run(first)
    assert again is not None
    assert (again.state, again.owner, again.reason) == (
        "pending",
        None,
        "fleet-wide concurrency cap reached",
    )
    assert [r.id for r in (journal.claim_next_run(), journal.claim_next_run()) if r] == [
        first,
        second,
    ]


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


def test_run_life_cycle_and_state_errors(journal: Journal, clock: Clock) -> None:
    (run_id,) = _record(journal, _alert("fp1")).new_run_ids
    with pytest.raises(RunStateError, match="is pending, not claimed"):
        journal.start_run(run_id, playbook="p", target="t")
    assert journal.claim_next_run() is not None
    clock.advance(seconds=1)
    journal.start_run(run_id, playbook="restart-llama", target="server/dioscuri/alpha")
    assert journal.count_running() == 1 and journal.count_started_since(T0) == 1
    assert journal.count_started_since(T0 + timedelta(seconds=2)) == 0
    with pytest.raises(RunStateError, match="is running"):
        journal.decide(run_id, "paused", "too late")
    with pytest.raises(RunStateError, match="no run 999999"):
        journal.requeue(999999, "x")
    clock.advance(seconds=1)
    journal.heartbeat(run_id)
    journal.record_step(
        run_id,
        0,
        "restart_unit",
        {"unit": "llama-server@alpha.service"},
        started_at=clock(),
        finished_at=None,
        result="running",
        output="",
    )
    journal.record_step(
        run_id,
        0,
        "restart_unit",
        {"unit": "llama-server@alpha.service"},
        started_at=clock(),
        finished_at=clock(),
        result="ok",
        output="x" * 200_000 + "the end",
    )
    journal.finish_run(run_id, outcome="healed", verification="PromQL held")
    run = journal.get_run(run_id)
    assert run is not None
    assert (run.state, run.decision, run.outcome, run.playbook) == (
        "done",
        "run",
        "healed",
        "restart-llama",
    )
    (step,) = run.steps
    assert (step.index, step.result, step.params) == (
        0,
        "ok",
        {"unit": "llama-server@alpha.service"},
    )
    assert len(step.output.encode()) <= 64 * 1024 and step.output.endswith("the end")
    assert run.started_at == T0 + timedelta(seconds=1) and run.finished_at == clock()
    assert journal.count_running() == 0 and journal.queue_depth() == 0
    journal.heartbeat(run_id)  # a late tick after the end is harmless


def test_decide_finishes_a_run_that_will_not_execute(journal: Journal) -> None:
    (run_id,) = _record(journal, _alert("fp1")).new_run_ids
    assert journal.claim_next_run() is not None
    journal.decide(run_id, "cooldown", "cooling down", playbook="restart-llama", target="t")
    run = journal.get_run(run_id)
    assert run is not None
    assert (run.state, run.decision, run.reason, run.playbook, run.target) == (
        "done",
        "cooldown",
        "cooling down",
        "restart-llama",
        "t",
    )
    assert run.finished_at == T0 and run.started_at is None
    assert journal.count_started_since(T0 - timedelta(hours=1)) == 0


def test_recent_runs_reads_in_a_few_queries(journal: Journal) -> None:
    for i in range(30):
        run_id = _running_run(journal, f"fp{i}")
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

    engine = journal._engine  # the journal's own pool: every statement it sends
    sa.event.listen(engine, "before_cursor_execute", count)
    try:
        runs = journal.recent_runs(50)
    finally:
        sa.event.remove(engine, "before_cursor_execute", count)
    assert len(runs) == 30 and [r.id for r in runs] == sorted((r.id for r in runs), reverse=True)
    assert all([s.index for s in r.steps] == [0, 1, 2] for r in runs)
    assert len([s for s in statements if "SELECT" in s.upper()]) <= 3, statements


def test_locks_are_exclusive_between_threads(journal: Journal) -> None:
    barrier = threading.Barrier(8)
    won: list[int] = []

    def take(run_id: int) -> None:
        barrier.wait()
        if journal.try_lock("server/dioscuri/alpha", run_id, timedelta(minutes=5)):
            won.append(run_id)

    threads = [threading.Thread(target=take, args=(i,)) for i in range(1, 9)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(won) == 1
    holder = won[0]
    other = holder % 8 + 1
    assert journal.try_lock("server/dioscuri/alpha", holder, timedelta(minutes=5))  # re-entrant
    assert not journal.try_lock("server/dioscuri/alpha", other, timedelta(minutes=5))
    assert journal.try_lock("server/dioscuri/beta", other, timedelta(minutes=5))  # another target
    journal.release_lock("server/dioscuri/alpha", other)  # not its lock: nothing happens
    assert not journal.try_lock("server/dioscuri/alpha", other, timedelta(minutes=5))
    journal.release_lock("server/dioscuri/alpha", holder)
    assert journal.try_lock("server/dioscuri/alpha", other, timedelta(minutes=5))


def test_an_expired_lock_is_taken_over(journal: Journal, journal_url: str, clock: Clock) -> None:
    assert journal.try_lock("host/dioscuri", 1, timedelta(seconds=60))
    clock.advance(seconds=59)
    assert not journal.try_lock("host/dioscuri", 2, timedelta(seconds=60))
    clock.advance(seconds=1)
    peer = Journal(journal_url, replica_id="r2", clock=clock)
    try:
        assert peer.try_lock("host/dioscuri", 2, timedelta(seconds=60))
    finally:
        peer.close()
    (lock,) = _rows(journal_url, schema.locks)
    assert (lock["run_id"], lock["owner"]) == (2, "r2")
    journal.release_lock("host/dioscuri", 1)  # the old holder's late release frees nothing
    assert not journal.try_lock("host/dioscuri", 3, timedelta(seconds=60))
    (takeover,) = journal.events(kind="lock_takeover")
    assert takeover.run_id == 2 and "run 1 (r1)" in takeover.detail


def test_a_heartbeat_renews_the_locks_of_a_live_run(journal: Journal, clock: Clock) -> None:
    run_id = _running_run(journal, "fp1")
    assert journal.try_lock("server/dioscuri/alpha", run_id, timedelta(seconds=60))
    for _ in range(3):
        clock.advance(seconds=50)
        journal.heartbeat(run_id)
    assert not journal.try_lock("server/dioscuri/alpha", run_id + 1, timedelta(seconds=60))
    run = journal.get_run(run_id)
    assert run is not None and run.state == "running"


def test_cooldown(journal: Journal) -> None:
    assert journal.cooldown_until("server/dioscuri/alpha", "restart-llama") is None
    journal.set_cooldown("server/dioscuri/alpha", "restart-llama", T0 + timedelta(minutes=15))
    journal.set_cooldown("server/dioscuri/beta", "restart-llama", T0 + timedelta(minutes=5))
    assert journal.cooldown_until("server/dioscuri/alpha", "restart-llama") == T0 + timedelta(
        minutes=15
    )
    journal.set_cooldown("server/dioscuri/alpha", "restart-llama", T0 - timedelta(minutes=1))
    # A past cooldown is still returned: the engine reads the last heal's time from it.
    assert journal.cooldown_until("server/dioscuri/alpha", "restart-llama") == T0 - timedelta(
        minutes=1
    )
    assert journal.cooldown_until("server/dioscuri/alpha", "other") is None


def _fail(journal: Journal, *, healed: bool = False) -> bool:
    return journal.record_breaker_outcome(
        "server/dioscuri/alpha",
        "restart-llama",
        healed=healed,
        max_failures=3,
        window=timedelta(hours=1),
    )


def test_breaker_opens_after_n_not_healed_in_the_window(journal: Journal, clock: Clock) -> None:
    assert journal.breaker("server/dioscuri/alpha", "restart-llama").open is False
    assert [_fail(journal), _fail(journal)] == [False, False]
    state = journal.breaker("server/dioscuri/alpha", "restart-llama")
    assert (state.open, state.failures, state.window_start) == (False, 2, T0)
    clock.advance(minutes=59)
    assert _fail(journal) is True  # this call opened it
    assert _fail(journal) is False  # already open
    assert _fail(journal, healed=True) is False
    state = journal.breaker("server/dioscuri/alpha", "restart-llama")
    assert state.open and state.opened_at == T0 + timedelta(minutes=59)
    assert journal.open_breakers() == [("server/dioscuri/alpha", "restart-llama", state.opened_at)]
    journal.reset_breaker("server/dioscuri/alpha", "restart-llama")
    assert journal.open_breakers() == []
    assert journal.breaker("server/dioscuri/alpha", "restart-llama").failures == 0


def test_breaker_window_expiry_starts_a_new_window(journal: Journal, clock: Clock) -> None:
    _fail(journal)
    _fail(journal)
    clock.advance(hours=1)  # the window has passed
    assert _fail(journal) is False
    state = journal.breaker("server/dioscuri/alpha", "restart-llama")
    assert (state.failures, state.window_start) == (1, T0 + timedelta(hours=1))
    assert [_fail(journal), _fail(journal)] == [False, True]


def test_a_heal_resets_the_count(journal: Journal) -> None:
    _fail(journal)
    _fail(journal)
    assert _fail(journal, healed=True) is False
    assert journal.breaker("server/dioscuri/alpha", "restart-llama").failures == 0
    assert [_fail(journal), _fail(journal)] == [False, False]
    assert not journal.breaker("server/dioscuri/alpha", "restart-llama").open


def test_pause_and_maintenance_round_trip_with_events(journal: Journal, clock: Clock) -> None:
    assert journal.paused() is False and journal.maintenance() == {}
    journal.set_paused(True, by="api", reason="datacenter work")
    assert journal.paused() is True
    clock.advance(minutes=1)
    journal.set_maintenance("dioscuri", True, by="api", reason="swapping a GPU")
    clock.advance(minutes=1)
    journal.set_maintenance("dioscuri", True, by="alice", reason="still swapping")
    assert journal.maintenance() == {"dioscuri": (T0 + timedelta(minutes=1), "still swapping")}
    journal.set_maintenance("dioscuri", False, by="api")
    journal.set_paused(False, by="api")
    assert journal.paused() is False and journal.maintenance() == {}
    kinds = [e.kind for e in journal.events()]
    assert kinds == ["resumed", "maintenance_off", "maintenance_on", "maintenance_on", "paused"]
    (paused,) = journal.events(kind="paused")
    assert paused.detail == "remediation paused by api: datacenter work" and paused.at == T0
    assert journal.events(kind="maintenance_on", limit=1)[0].target == "dioscuri"


def test_add_event_and_events(journal: Journal) -> None:
    first = journal.add_event("escalation", "breaker opened", playbook="p", target="t")
    second = journal.add_event("escalation", "again", run_id=7)
    assert second > first
    assert [(e.id, e.run_id, e.playbook) for e in journal.events(kind="escalation")] == [
        (second, 7, None),
        (first, None, "p"),
    ]
    assert journal.events(kind="nothing") == []


def test_recover_interrupted(journal: Journal, journal_url: str, clock: Clock) -> None:
    (claimed_id,) = _record(journal, _alert("claimed")).new_run_ids
    assert journal.claim_next_run() is not None
    assert journal.try_lock("server/dioscuri/beta", claimed_id, timedelta(minutes=5))
    running_id = _running_run(journal, "running")
    assert journal.try_lock("server/dioscuri/alpha", running_id, timedelta(minutes=5))
    journal.record_step(
        running_id,
        0,
        "kill_process",
        {},
        started_at=T0,
        finished_at=None,
        result="running",
        output="",
    )
    peer = Journal(journal_url, replica_id="r2", clock=clock)
    try:
        others = _running_run(peer, "others", target="server/castor/gamma")
        assert peer.try_lock("server/castor/gamma", others, timedelta(minutes=5))
    finally:
        peer.close()

    clock.advance(minutes=1)
    restarted = Journal(journal_url, replica_id="r1", clock=clock)  # the same replica, again
    try:
        assert restarted.recover_interrupted() == [running_id]
        assert restarted.recover_interrupted() == []
        back = restarted.get_run(claimed_id)
        assert back is not None and (back.state, back.owner) == ("pending", None)
        cut = restarted.get_run(running_id)
        assert cut is not None
        assert (cut.state, cut.outcome, cut.finished_at) == ("done", "interrupted", clock())
        assert cut.steps[0].result == "interrupted"
        (event,) = restarted.events(kind="interrupted")
        assert (event.run_id, event.target) == (running_id, "server/dioscuri/alpha")
        assert restarted.try_lock("server/dioscuri/alpha", 99, timedelta(minutes=5))
        assert restarted.try_lock("server/dioscuri/beta", 99, timedelta(minutes=5))
        assert not restarted.try_lock("server/castor/gamma", 99, timedelta(minutes=5))
        other = restarted.get_run(others)
        assert other is not None and other.state == "running"  # another replica's: untouched
    finally:
        restarted.close()


def test_finish_run_queues_its_reports_in_the_same_transaction(
    journal: Journal, journal_url: str
) -> None:
    run_id = _running_run(journal, "fp1")
    journal.finish_run(
        run_id,
        outcome="healed",
        verification="held",
        reports=[("alerts-gpu", "**healed**"), ("alerts-infra", "copy")],
    )
    outbox = sorted(_rows(journal_url, schema.outbox), key=lambda r: r["id"])
    assert [(r["topic"], r["content"], r["run_id"], r["state"]) for r in outbox] == [
        ("alerts-gpu", "**healed**", run_id, "pending"),
        ("alerts-infra", "copy", run_id, "pending"),
    ]
    run = journal.get_run(run_id)
    assert run is not None and run.outcome == "healed"
    # A run that cannot finish (already done) leaves no report behind: one transaction.
    with pytest.raises(RunStateError):
        journal.finish_run(run_id, outcome="failed", verification="", reports=[("t", "lost")])
    assert len(_rows(journal_url, schema.outbox)) == 2
    report = journal.enqueue_report("alerts-gpu", "notify only", run_id=None)
    assert report > outbox[-1]["id"]


def test_prune_keeps_open_state_and_deletes_old_rows(
    journal: Journal, journal_url: str, clock: Clock
) -> None:
    # Thirty-one days ago: a healed run of a resolved alert (all of it goes) …
    healed = _running_run(journal, "healed")
    journal.record_step(
        healed, 0, "probe", {}, started_at=T0, finished_at=T0, result="ok", output=""
    )
    journal.finish_run(healed, outcome="healed", verification="ok", reports=[("t", "sent")])
    _record(journal, _alert("healed", status="resolved"))
    # … a run still waiting, and a done run of an alert that still fires (both stay) …
    (waiting,) = _record(journal, _alert("waiting")).new_run_ids
    (firing,) = _record(journal, _alert("firing")).new_run_ids
    assert journal.claim_next_run() is not None  # `waiting`, the oldest
    journal.requeue(waiting, "cap")
    assert journal.claim_next_run() is not None
    assert journal.claim_next_run() is not None
    journal.decide(firing, "notify_only", "no playbook")
    journal.enqueue_report("t", "unsent")  # stays: never sent
    journal.set_paused(True, by="api")  # an old event
    journal.set_cooldown("x", "p", T0 + timedelta(minutes=10))
    _fail(journal)  # a closed breaker, idle since: goes
    for _ in range(3):
        journal.record_breaker_outcome(
            "y", "p", healed=False, max_failures=3, window=timedelta(hours=1)
        )
    assert journal.try_lock("z", waiting, timedelta(minutes=5))
    engine = _engine(journal_url)
    try:
        with engine.begin() as conn:
            conn.execute(
                sa.update(schema.outbox)
                .where(schema.outbox.c.content == "sent")
                .values(state="sent")
            )
    finally:
        engine.dispose()

    clock.advance(days=31)
    (recent,) = _record(journal, _alert("recent")).new_run_ids
    journal.add_event("escalation", "recent")
    before = _counts(journal_url)
    deleted = journal.prune()
    after = _counts(journal_url)
    assert deleted == sum(before.values()) - sum(after.values()) > 0
    assert journal.prune() == 0

    assert journal.get_run(healed) is None
    assert {r.id for r in journal.recent_runs()} == {waiting, firing, recent}
    assert {a["fingerprint"] for a in _rows(journal_url, schema.alerts)} == {
        "waiting",
        "firing",
        "recent",
    }
    assert len(_rows(journal_url, schema.notifications)) == 1  # the recent one
    assert [e.detail for e in journal.events()] == ["recent"]
    assert [r["content"] for r in _rows(journal_url, schema.outbox)] == ["unsent"]
    assert [(t, p) for t, p, _ in journal.open_breakers()] == [("y", "p")]
    assert len(_rows(journal_url, schema.breakers)) == 1
    assert _rows(journal_url, schema.cooldowns) == []
    assert [r["target"] for r in _rows(journal_url, schema.locks)] == ["z"]
    assert journal.paused() is True  # settings are state, never pruned


# -- schema, errors, SQLite ------------------------------------------------------------------


def test_schema_version_is_recorded(journal: Journal, journal_url: str) -> None:
    assert journal.schema_version() == schema.SCHEMA_VERSION == 2
    assert [r["version"] for r in _rows(journal_url, schema.schema_version)] == [1, 2]
    Journal(journal_url, replica_id="r2").close()  # opening again migrates nothing
    assert len(_rows(journal_url, schema.schema_version)) == 2


def test_a_newer_schema_is_refused(journal: Journal, journal_url: str) -> None:
    engine = _engine(journal_url)
    try:
        with engine.begin() as conn:
            conn.execute(sa.insert(schema.schema_version).values(version=99, applied_at=T0))
    finally:
        engine.dispose()
    with pytest.raises(JournalError, match=r"schema is version 99, newer than .* knows"):
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


def test_a_vanished_postgresql_database_is_a_journal_error(clock: Clock) -> None:
    with throwaway_database() as url:
        journal = Journal(url, replica_id="r1", clock=clock)
        drop_database(url)
        body = _body(_alert("fp1"))
        with pytest.raises(JournalError, match="cannot record a notification"):
            journal.admit(parse_notification(body), body)
        journal.close()


def test_sqlite_pragmas_are_in_effect(tmp_path: Path) -> None:
    path = tmp_path / "journal.db"
    journal = Journal(f"sqlite:///{path}", replica_id="r1")
    try:
        engine = journal._engine  # the journal's own pool: pragmas are per connection
        with engine.connect() as a, engine.connect() as b:
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
        _record(journal, *[_alert(f"fp{i}") for i in range(20)])
        assert len(_claim_all(journal, threads=4)) == 20
    finally:
        journal.close()


def test_bound_output_keeps_head_and_tail_within_the_limit() -> None:
    assert bound_output("short") == "short"
    text = "é" * 50_000 + "MIDDLE" + "ü" * 50_000
    cut = bound_output(text, limit=1000)
    assert len(cut.encode()) <= 1000
    assert cut.startswith("é") and cut.endswith("ü") and "bytes cut" in cut
