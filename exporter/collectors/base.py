"""The contract every source collector follows, and how a partial failure is reported.

A source collector is a `prometheus_client` collector with a `name` (the `collector` label of
`gpufleet_exporter_collector_success`) and a `close()`. `collect()` yields fresh metric families
on every scrape. To report a failure while still exporting what it could read, a collector
yields what it has and then raises `CollectorError`: the supervisor in `exporter.registry`
keeps the families already yielded and marks the collector unsuccessful.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from typing import Protocol, runtime_checkable

from prometheus_client.metrics_core import Metric


class CollectorError(Exception):
    """Raised by a collector, after yielding what it could, when part of its source failed."""


@runtime_checkable
class SourceCollector(Protocol):
    """A collector of one data source."""

    name: str

    def collect(self) -> Iterable[Metric]:
        """Yield fresh metric families; raise `CollectorError` after yielding on partial failure."""
        ...

    def close(self) -> None:
        """Release what the collector holds (threads, libraries); called once on exit."""
        ...


@runtime_checkable
class GpuCollector(SourceCollector, Protocol):
    """A collector of GPUs: it reports the PCI bus ids it found so `gpu` indices can be assigned."""

    def pci_bus_ids(self) -> list[str]:
        """PCI bus ids (sysfs form, `0000:41:00.0`) of the GPUs this collector found at start."""
        ...


class Rediscovery:
    """Runs a collector's discovery again at most once per interval, from any scrape thread.

    Cards and hwmon chips rarely come and go, so a scrape normally reads only known paths; a
    listing every `seconds` catches a card that appeared after start (or a chip that went).
    """

    def __init__(
        self, discover: Callable[[], None], seconds: float, clock: Callable[[], float]
    ) -> None:
        self._discover = discover
        self._seconds = seconds
        self._clock = clock
        self._lock = threading.Lock()
        self._next = clock() + seconds

    def due(self) -> bool:
        """Whether the interval has passed (a hint: `run_if_due` decides under its lock)."""
        return self._clock() >= self._next

    def run_if_due(self) -> None:
        """Discover again if the interval has passed since the last time."""
        if self._clock() < self._next:
            return
        with self._lock:
            if self._clock() >= self._next:  # another scrape may have just done it
                self._discover()
                self._next = self._clock() + self._seconds
