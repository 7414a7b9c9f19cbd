"""Reads of devices that can block in the kernel, each device on a worker of its own.

amdgpu answers a sysfs read by asking the card's SMU; an nvme or I2C hwmon chip answers by
asking the device; a hung one blocks the reading thread in the kernel for seconds or for good,
and no signal ends that read. So a collector never reads such a device on the scrape thread:
it hands each device's read to `DeviceReads.submit`, waits for all of them under one
deadline, and exports what landed. Per device:

- one worker thread (a daemon: a read stuck for good must not keep the process from exiting),
  started with its first read and ended after `idle_seconds` without one;
- at most one outstanding read: while the last one is stuck, `submit` refuses at once
  (`None`), so a stuck device costs one thread, not one per scrape, and is never waited on
  again; the other devices are read on time.

The kernel serialises some devices per card (amdgpu's SMU mailbox) and some per bus, so a
worker per device is the finest split that buys anything. Collectors: `collectors/amd.py`
(per card) and `collectors/hwmon.py` (per chip).
"""

from __future__ import annotations

import concurrent.futures
import queue
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, TypeVar

T = TypeVar("T")

IDLE_SECONDS = 120.0
"""A device's worker ends after this long without a read (the next read starts a new one)."""


@dataclass
class _Worker:
    jobs: queue.SimpleQueue[tuple[Callable[[], Any], concurrent.futures.Future[Any]]] = field(
        default_factory=queue.SimpleQueue
    )
    thread: threading.Thread | None = None
    outstanding: concurrent.futures.Future[Any] | None = None


class DeviceReads:
    """Per-device workers with at most one outstanding read each; see the module docstring."""

    def __init__(self, name: str, *, idle_seconds: float = IDLE_SECONDS) -> None:
        self._name = name
        self._idle = idle_seconds
        self._lock = threading.Lock()
        self._workers: dict[str, _Worker] = {}
        self._closed = False

    def submit(self, device: str, read: Callable[[], T]) -> concurrent.futures.Future[T] | None:
        """Start `read` on `device`'s worker; None while its previous read is still running."""
        with self._lock:
            if self._closed:
                return None
            worker = self._workers.setdefault(device, _Worker())
            if worker.outstanding is not None and not worker.outstanding.done():
                return None
            future: concurrent.futures.Future[T] = concurrent.futures.Future()
            worker.outstanding = future
            worker.jobs.put((read, future))
            if worker.thread is None:
                worker.thread = threading.Thread(
                    target=self._work,
                    args=(device, worker),
                    name=f"{self._name}-read",
                    daemon=True,
                )
                worker.thread.start()
        return future

    def stuck(self) -> set[str]:
        """The devices whose last read has not returned."""
        with self._lock:
            return {
                device
                for device, worker in self._workers.items()
                if worker.outstanding is not None and not worker.outstanding.done()
            }

    def threads(self) -> int:
        """Worker threads alive now (for tests and the benchmark: flat while a device is stuck)."""
        with self._lock:
            return sum(1 for w in self._workers.values() if w.thread is not None)

    def _work(self, device: str, worker: _Worker) -> None:
        while True:
            try:
                read, future = worker.jobs.get(timeout=self._idle)
            except queue.Empty:
                with self._lock:
                    if worker.jobs.empty():  # else a read was queued meanwhile: take it
                        worker.thread = None
                        return
                continue
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(read())
            except Exception as exc:  # noqa: BLE001 - the collector decides what it means
                future.set_exception(exc)

    def close(self) -> None:
        """Refuse new reads; idle workers end on their own, stuck ones with the process."""
        with self._lock:
            self._closed = True


def wait_for(futures: Iterable[concurrent.futures.Future[Any]], timeout: float) -> None:
    """Wait until every future is done or `timeout` seconds have passed."""
    pending = [f for f in futures if not f.done()]
    if pending:
        concurrent.futures.wait(pending, timeout=max(0.0, timeout))
