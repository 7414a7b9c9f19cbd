"""Who writes next: the journal's writer lock (admission first) and the workers' doorbell.

Both decide an order between threads, so the tests force the interleavings: a holder keeps the
lock while the others are seen queued (`_waiting`), then lets go, and the order in which they
got it is what is asserted.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import pytest

from remediator.doorbell import Doorbell
from remediator.journal.db import WriterLock


def _queued(lock: WriterLock, count: int) -> None:
    """Until `count` threads wait for the lock."""
    deadline = time.monotonic() + 5
    while len(lock._waiting) < count:
        assert time.monotonic() < deadline, "the writers never queued"
        time.sleep(0.001)


def _writer(lock: WriterLock, name: str, urgent: bool, order: list[str]) -> threading.Thread:
    def body() -> None:
        with lock.hold(urgent=urgent):
            order.append(name)

    thread = threading.Thread(target=body, name=name)
    thread.start()
    return thread


def _contend(
    lock: WriterLock, writers: list[tuple[str, bool]], before_release: float = 0
) -> list[str]:
    """Hold the lock, queue `writers` in this order, release; the order they wrote in."""
    order: list[str] = []
    threads = []
    with lock.hold(urgent=False):
        for index, (name, urgent) in enumerate(writers):
            threads.append(_writer(lock, name, urgent, order))
            _queued(lock, index + 1)
        time.sleep(before_release)
    for thread in threads:
        thread.join(5)
    assert not any(t.is_alive() for t in threads), "a writer never got the lock"
    return order


def test_an_admission_goes_ahead_of_the_workers_queued_before_it() -> None:
    order = _contend(
        WriterLock(patience=60),
        [("claim-1", False), ("claim-2", False), ("admit-1", True), ("admit-2", True)],
    )
    # Admissions in their own order first, then the engine's writers in theirs.
    assert order == ["admit-1", "admit-2", "claim-1", "claim-2"]


def test_a_worker_that_waited_its_patience_goes_before_admissions() -> None:
    order = _contend(
        WriterLock(patience=0.05), [("claim", False), ("admit", True)], before_release=0.1
    )
    assert order == ["claim", "admit"]


def test_one_writer_at_a_time_under_contention() -> None:
    lock = WriterLock(patience=0.001)
    inside = 0
    most = 0
    guard = threading.Lock()
    start = threading.Barrier(8)

    def body(urgent: bool) -> None:
        nonlocal inside, most
        start.wait()
        for _ in range(200):
            with lock.hold(urgent=urgent):
                with guard:
                    inside += 1
                    most = max(most, inside)
                time.sleep(0)
                with guard:
                    inside -= 1

    threads = [threading.Thread(target=body, args=(i % 2 == 0,)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert not any(t.is_alive() for t in threads)
    assert most == 1
    assert not lock._held and not lock._waiting


def test_a_writer_that_fails_inside_lets_the_next_one_in() -> None:
    lock = WriterLock()
    with pytest.raises(RuntimeError), lock.hold(urgent=True):
        raise RuntimeError("the transaction failed")
    order: list[str] = []
    _writer(lock, "next", False, order).join(5)
    assert order == ["next"]


# -- the doorbell -----------------------------------------------------------------------------


def _sleeper(bell: Doorbell, woke: list[str], name: str) -> threading.Thread:
    def body() -> None:
        if bell.wait(30):
            woke.append(name)

    thread = threading.Thread(target=body, daemon=True)
    thread.start()
    return thread


def _until(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + 5
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.005)


def _sleeping(bell: Doorbell) -> int:
    # The condition's waiters: how many workers sleep on the bell now.
    return len(bell._cond._waiters)  # type: ignore[attr-defined]


def test_a_ring_wakes_one_sleeping_worker_not_all() -> None:
    bell = Doorbell(limit=4)
    woke: list[str] = []
    threads = [_sleeper(bell, woke, name) for name in ("a", "b", "c")]
    _until(lambda: _sleeping(bell) == 3, "the workers never slept")
    bell.ring()
    _until(lambda: len(woke) == 1, "nobody woke")
    time.sleep(0.2)  # had the ring woken more than one, they would have appended by now
    assert len(woke) == 1
    bell.ring()
    bell.ring()
    _until(lambda: len(woke) == 3, "the next rings woke nobody")
    for thread in threads:
        thread.join(5)


def test_rings_made_while_every_worker_is_busy_are_kept_up_to_the_limit() -> None:
    bell = Doorbell(limit=2)
    for _ in range(10):
        bell.ring()
    assert bell.wait(0) is True
    assert bell.wait(0) is True
    assert bell.wait(0.05) is False  # the other eight would only be claims finding nothing


def test_ring_all_wakes_every_worker_for_good() -> None:
    bell = Doorbell(limit=1)
    woke: list[str] = []
    threads = [_sleeper(bell, woke, name) for name in ("a", "b", "c")]
    _until(lambda: _sleeping(bell) == 3, "the workers never slept")
    bell.ring_all()
    _until(lambda: len(woke) == 3, "ring_all did not wake every worker")
    assert bell.wait(30) is True  # at once: a stopping engine's workers do not sleep
    for thread in threads:
        thread.join(5)
