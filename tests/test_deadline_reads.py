"""`SerialReads`, the one mechanism for reads that can block: jobs in turn, a stuck one left
behind with its worker, refused until it returns, and no thread per scrape.

A job that blocks on an event stands for a read stuck in the kernel.
"""

from __future__ import annotations

import functools
import threading
import time

from exporter.sources.deadline import SerialReads


def test_jobs_run_in_turn_and_errors_stay_with_their_key() -> None:
    reads = SerialReads("t")
    order: list[str] = []

    def job(key: str) -> str:
        order.append(key)
        if key == "b":
            raise OSError("EIO")
        return key.upper()

    batch = reads.submit([(k, functools.partial(job, k)) for k in "abc"], patience=1.0)
    assert batch.wait(time.monotonic() + 5)
    got = batch.finish()
    assert order == ["a", "b", "c"]
    assert got.results == {"a": "A", "c": "C"}
    assert isinstance(got.errors["b"], OSError)
    assert got.stuck == got.refused == frozenset()
    assert reads.threads() == 1


def test_a_stuck_job_is_left_behind_refused_then_read_again() -> None:
    reads = SerialReads("t")
    release = threading.Event()
    calls: list[str] = []

    def stuck() -> str:
        calls.append("stuck")
        release.wait(10)
        return "late"

    start = time.monotonic()
    first = reads.submit([("x", stuck), ("y", lambda: "y")], patience=0.2)
    first.wait(start + 3)
    got = first.finish()
    assert 0.15 < time.monotonic() - start < 1.5
    assert got.stuck == {"x"} and got.results == {"y": "y"}
    for _ in range(5):
        batch = reads.submit([("x", stuck), ("y", lambda: "y")], patience=0.2)
        assert batch.wait(time.monotonic() + 1)
        got = batch.finish()
        assert got.refused == {"x"} and got.results == {"y": "y"}
    assert calls == ["stuck"]  # never started again while stuck
    assert reads.threads() == 2  # the stuck one and the fresh one
    release.set()  # the stuck read returns: its worker ends, and x is read again
    deadline = time.monotonic() + 5
    while reads.stuck() and time.monotonic() < deadline:
        time.sleep(0.01)
    release.clear()
    again = reads.submit([("x", lambda: "x")], patience=0.2)
    assert again.wait(time.monotonic() + 1)
    assert again.finish().results == {"x": "x"}
    assert reads.threads() == 1


def test_at_the_deadline_the_running_job_is_left_behind() -> None:
    reads = SerialReads("t")
    release = threading.Event()
    batch = reads.submit([("x", lambda: release.wait(10))])  # no patience: the deadline only
    assert not batch.wait(time.monotonic() + 0.2)
    assert batch.finish().stuck == {"x"}
    follow = reads.submit([("y", lambda: "y")])
    assert follow.wait(time.monotonic() + 1)  # not queued behind the stuck one
    release.set()


def test_an_idle_worker_ends() -> None:
    reads = SerialReads("t", idle_seconds=0.1)
    assert reads.submit([("a", lambda: 1)]).wait(time.monotonic() + 1)
    deadline = time.monotonic() + 3
    while reads.threads() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert reads.threads() == 0
    assert reads.submit([("a", lambda: 2)]).wait(time.monotonic() + 1)
