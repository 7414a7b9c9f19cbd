"""Reads that can block in the kernel, run in turn on a worker that is left behind when stuck.

amdgpu answers a sysfs read by asking the card's SMU; an nvme or I2C hwmon chip answers by
asking the device; a hung one blocks the reading thread in the kernel for seconds or for good,
and no signal ends that read. So a collector never reads such a device on the scrape thread.
It hands the scrape's reads, one job per device, to `SerialReads.submit`, and waits for the
batch under its deadline (`Batch.wait`):

- the jobs run in turn on one worker thread: a healthy scrape costs one hand-off, not one per
  device (a thread switch costs about 0.1 ms here; eight per scrape doubled an 8-card scrape);
- a job still running after `patience` seconds is stuck: its worker is left behind with it,
  a fresh worker takes the rest of the batch, so the other devices are read on time;
- a device whose read is still stuck is refused at once by later batches (`Batch.refused`),
  never waited on again and never queued behind: a stuck device costs one thread, not one per
  scrape. When its read returns, that worker ends and the device is read again.

Workers are daemon threads (a read stuck for good must not keep the process from exiting);
an idle one ends after `IDLE_SECONDS`. Users: `collectors/amd.py` (a job per card),
`collectors/hwmon.py` (per chip) and `exporter/registry.py` (per collector, for the scrape).
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

IDLE_SECONDS = 120.0
"""A worker ends after this long without work (the next batch starts a new one)."""
DISCOVERY = "(discovery)"
"""The key of rediscovery's job (`read_devices`), beside one per device."""


@dataclass(frozen=True)
class Finished:
    """What a batch got by its caller's deadline, by key."""

    results: dict[str, Any]
    errors: dict[str, Exception]
    stuck: frozenset[str]  # left behind on a worker: past its patience, or at the deadline
    refused: frozenset[str]  # not run: stuck since an earlier batch


class Batch:
    """One scrape's jobs; results land in `results` / `errors` by key as they finish."""

    def __init__(
        self,
        reads: SerialReads,
        jobs: Sequence[tuple[str, Callable[[], Any]]],
        patience: float,
        refused: frozenset[str],
    ) -> None:
        self._reads = reads
        self.jobs = list(jobs)
        self.patience = patience
        self.refused = refused
        """Keys not run: their read of an earlier batch is still stuck."""
        # Written by the workers under the reads' lock: read them through `finish()`.
        self.results: dict[str, Any] = {}
        self.errors: dict[str, Exception] = {}
        self.stuck: set[str] = set()
        self.next = 0  # index of the next job not started
        self.current: str | None = None
        self.started_at = 0.0
        self.owner: _Worker | None = None
        self.done = False

    def wait(self, until: float) -> bool:
        """Wait until every job has finished or `until` (monotonic); True when all finished.

        A job past its patience meanwhile is left behind (`stuck`) and the rest go on.
        """
        return self._reads.wait(self, until)

    def finish(self) -> Finished:
        """At the caller's deadline, what the batch got.

        A job still running is left behind (`stuck`), so that the next batch is never queued
        behind it; jobs not yet started go on in the background, and whatever they give lands
        after this snapshot, not in it.
        """
        return self._reads.finish(self)


@dataclass(eq=False)
class _Worker:
    batches: deque[Batch] = field(default_factory=deque)
    abandoned: bool = False  # left behind with a stuck job: ends when that job returns


class SerialReads:
    """Jobs run in turn on one worker, a stuck one left behind; see the module docstring."""

    def __init__(self, name: str, *, idle_seconds: float = IDLE_SECONDS) -> None:
        self._name = name
        self._idle = idle_seconds
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._worker: _Worker | None = None
        self._stuck: set[str] = set()
        self._threads = 0
        self._closed = False

    def submit(
        self, jobs: Sequence[tuple[str, Callable[[], Any]]], *, patience: float = math.inf
    ) -> Batch:
        """Queue a batch of `(key, job)`; keys still stuck from earlier are refused."""
        with self._lock:
            refused = frozenset(k for k, _ in jobs if k in self._stuck)
            batch = Batch(self, [(k, j) for k, j in jobs if k not in refused], patience, refused)
            if self._closed or not batch.jobs:
                batch.done = True
                return batch
            worker = self._worker
            if worker is None:
                worker = self._worker = self._start_worker()
            worker.batches.append(batch)
            self._changed.notify_all()
            return batch

    def stuck(self) -> set[str]:
        """Keys whose job is stuck on a worker left behind."""
        with self._lock:
            return set(self._stuck)

    def threads(self) -> int:
        """Worker threads alive (for tests and the benchmark: flat while a device is stuck)."""
        with self._lock:
            return self._threads

    def wait(self, batch: Batch, until: float) -> bool:
        """See `Batch.wait`."""
        with self._lock:
            while not batch.done:
                now = time.monotonic()
                if now >= until:
                    return False
                check = until
                if batch.current is not None:
                    overdue = batch.started_at + batch.patience
                    if now >= overdue:
                        self._abandon(batch)
                        continue
                    check = min(check, overdue)
                elif math.isfinite(batch.patience):
                    # No job started yet (the worker is getting to it): a worker does not wake
                    # us per job, so look again soon to see the one that will start.
                    check = min(check, now + batch.patience / 4)
                self._changed.wait(check - now)
            return True

    def finish(self, batch: Batch) -> Finished:
        """See `Batch.finish`."""
        with self._lock:
            if not batch.done and batch.current is not None:
                self._abandon(batch)
            return Finished(
                dict(batch.results), dict(batch.errors), frozenset(batch.stuck), batch.refused
            )

    def _abandon(self, batch: Batch) -> None:
        # Under the lock. The worker keeps the stuck job; a fresh one takes its batches.
        key, old = batch.current, batch.owner
        assert key is not None and old is not None
        self._stuck.add(key)
        batch.stuck.add(key)
        batch.current = None
        old.abandoned = True
        fresh = self._start_worker()
        fresh.batches, old.batches = old.batches, deque()
        if self._worker is old:
            self._worker = fresh
        self._changed.notify_all()

    def _start_worker(self) -> _Worker:
        # Under the lock.
        worker = _Worker()
        thread = threading.Thread(
            target=self._work, args=(worker,), name=f"{self._name}-read", daemon=True
        )
        self._threads += 1
        thread.start()
        return worker

    def _work(self, worker: _Worker) -> None:
        with self._lock:
            while True:
                if not worker.batches:
                    idle = self._closed or not self._changed.wait(self._idle)
                    if idle and not worker.batches:
                        self._end(worker)
                        return
                    continue
                batch = worker.batches[0]
                if batch.next >= len(batch.jobs):
                    batch.done = True
                    worker.batches.popleft()
                    self._changed.notify_all()
                    continue
                key, job = batch.jobs[batch.next]
                batch.next += 1
                batch.current, batch.owner, batch.started_at = key, worker, time.monotonic()
                self._lock.release()
                error: Exception | None = None
                value: Any = None
                try:
                    value = job()
                except Exception as exc:  # noqa: BLE001 - the collector decides what it means
                    error = exc
                finally:
                    self._lock.acquire()
                if worker.abandoned:
                    # Left behind while this job was stuck: its answer is too late to count.
                    self._stuck.discard(key)
                    self._end(worker)
                    return
                if error is not None:
                    batch.errors[key] = error
                else:
                    batch.results[key] = value
                batch.current = None

    def _end(self, worker: _Worker) -> None:
        # Under the lock.
        self._threads -= 1
        if self._worker is worker:
            self._worker = None
        self._changed.notify_all()

    def close(self) -> None:
        """Refuse new batches; idle workers end, stuck ones with the process."""
        with self._lock:
            self._closed = True
            self._changed.notify_all()


@dataclass(frozen=True)
class DeviceScrape:
    """One scrape's reads of a collector's devices (`read_devices`)."""

    got: Finished
    patience: float  # how long one device's read could take before it was left behind
    discovery_stuck: bool  # rediscovery was left behind, or is still stuck from earlier


def device_patience(timeout: float) -> float:
    """How long one device's read may take before it is left behind: timeout / 2, <= 1 s.

    A healthy read takes well under a millisecond: a stuck device costs this, not the scrape.
    """
    return min(timeout / 2, 1.0)


def read_devices(
    reads: SerialReads,
    jobs: Callable[[], Sequence[tuple[str, Callable[[], Any]]]],
    *,
    timeout: float,
    discovery_due: Callable[[], bool],
    discover: Callable[[], None],
) -> DeviceScrape:
    """Rediscovery when due, then one job per device, all within `timeout` seconds.

    Rediscovery runs first, in its batch of its own, so that a new device is read this very
    scrape; a walk that hangs costs half the timeout once, then is refused (never waited on)
    again. `jobs` is called after it, for the devices known then.
    """
    deadline = time.monotonic() + timeout
    discovery_stuck = False
    if discovery_due():
        walk = reads.submit([(DISCOVERY, discover)])
        walk.wait(time.monotonic() + timeout / 2)
        walked = walk.finish()
        discovery_stuck = bool(walked.refused or walked.stuck)
    patience = device_patience(timeout)
    batch = reads.submit(jobs(), patience=patience)
    batch.wait(deadline)
    return DeviceScrape(batch.finish(), patience, discovery_stuck)
