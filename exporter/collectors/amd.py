"""AMD GPUs (amdgpu driver) from sysfs: identity, utilisation, memory, temperatures, power, clocks.

Cards are discovered once in the constructor (libudev on the real `/sys`, else a walk of
`<sysfs>/class/drm`), then again at most every `rediscover_seconds` to pick up new ones; a
scrape reads only the changing files of the known cards. A card whose PCI device directory
disappears (fell off the bus, removed) keeps its `gpu` index and info and shows
`gpufleet_gpu_up 0`.

Sample output (one discrete card)::

    gpufleet_gpu_info{gpu="0",uuid="5c0b2a1f6e8d4a31",pci_bus_id="0000:03:00.0",vendor="amd",
                      model="",pci_id="1002:744c",card="card0",vbios="113-D7020100-102"} 1.0
    gpufleet_gpu_up{gpu="0"} 1.0
    gpufleet_gpu_temperature_celsius{gpu="0",sensor="junction"} 71.0
    gpufleet_gpu_power_watts{gpu="0"} 215.0

Reads run off the scrape thread, under a deadline. amdgpu answers a sysfs read by asking the
GPU's SMU, and a card in trouble (a hung SMU, a reset in progress, a card falling off the bus)
can block that read in the kernel for seconds or for good. So every read of the cards (and
rediscovery) runs on one worker thread; `collect()` waits for it at most `timeout_seconds`,
exports the cards read by then, and raises `CollectorError`. As for NVIDIA, "not read this
scrape" is not "read and failed": the card the worker is stuck in has no `gpufleet_gpu_up`
and `gpufleet_gpu_read_timeout 1`, a card not reached has neither, and while the worker is
still stuck no new work is queued behind it. A card that timed out is read last next time.

Check by hand: `cat /sys/class/drm/card0/device/gpu_busy_percent`,
`sensors amdgpu-pci-0300` (lm-sensors shows the same hwmon values in °C and W).
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from prometheus_client.metrics_core import Metric

from exporter.collectors import catalogue
from exporter.collectors.base import CollectorError, Rediscovery
from exporter.sources.amdgpu import AmdCard, AmdIdentity, AmdReading, discover_cards
from fleet.gpu_index import GpuIndex

log = logging.getLogger(__name__)

VENDOR = "amd"
# The worker thread ends after this long without a scrape (a new one starts with the next).
_WORKER_IDLE_SECONDS = 120.0


@dataclass(frozen=True, slots=True)
class _CardRead:
    """Everything one scrape read of one card (on the worker thread)."""

    identity: AmdIdentity
    present: bool
    reading: AmdReading | None = None
    totals: tuple[tuple[str, int], ...] = ()
    temperature_limits: tuple[tuple[str, float | None, float | None], ...] = ()
    power_limits: tuple[tuple[str, float], ...] = ()
    clock_max: tuple[tuple[str, float], ...] = ()


class _Job:
    """One scrape's reads; `collect()` takes what has landed by its deadline."""

    def __init__(self, slow: frozenset[str]) -> None:
        self.slow = slow
        self.done = threading.Event()
        self.cancelled = threading.Event()
        self.failure: str | None = None
        self.cards: tuple[AmdCard, ...] = ()
        self.current: str | None = None  # PCI slot of the card being read
        self._lock = threading.Lock()
        self._reads: dict[str, _CardRead] = {}

    def record(self, slot: str, read: _CardRead) -> None:
        with self._lock:
            self._reads[slot] = read
            self.current = None

    def reads(self) -> dict[str, _CardRead]:
        with self._lock:
            return dict(self._reads)


def _read_card(card: AmdCard) -> _CardRead:
    identity = card.identity()
    if not card.present():
        return _CardRead(identity, present=False)  # every read would fail: skip them
    return _CardRead(
        identity,
        present=True,
        reading=card.read(),
        totals=tuple(card.memory_totals()),
        temperature_limits=tuple(card.temperature_limits()),
        power_limits=tuple(card.power_limits()),
        clock_max=tuple(card.clock_max()),
    )


class AmdCollector:
    """Collects every amdgpu card of the host; `gpu` labels come from the shared `GpuIndex`."""

    name = "amd"

    def __init__(
        self,
        sysfs: str = "/sys",
        *,
        gpu_index: GpuIndex,
        expected_count: int | None,
        use_udev: bool | None = None,
        rediscover_seconds: float = 60.0,
        timeout_seconds: float = 4.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._sysfs = sysfs
        # libudev only ever reads the real /sys, so a fixture root must be walked.
        self._use_udev = os.path.realpath(sysfs) == "/sys" if use_udev is None else use_udev
        self._gpu_index = gpu_index
        self._expected_count = expected_count
        # By PCI slot, in slot order (= gpu index order); replaced wholesale, never mutated,
        # so a concurrent scrape iterates a consistent snapshot.
        self._cards: tuple[AmdCard, ...] = ()
        self._gpu_labels: dict[str, str] = {}
        self._timeout = timeout_seconds
        # Identities read so far, by PCI slot: the info series of a card not read this scrape.
        self._identities: dict[str, AmdIdentity] = {}
        self._slow: frozenset[str] = frozenset()  # cards whose read timed out lately
        self._lock = threading.Lock()  # guards the worker, its queue and the busy job
        self._jobs: queue.SimpleQueue[_Job] = queue.SimpleQueue()
        self._worker: threading.Thread | None = None
        self._busy: _Job | None = None
        self._closed = False
        # Discovery at start runs here: the registry needs the bus ids before any scrape.
        self._discover()
        self._rediscovery = Rediscovery(self._discover, rediscover_seconds, clock)

    def _discover(self) -> None:
        """Add cards not seen before; re-open a known card whose sysfs location changed.

        A card keeps its slot (and so its `gpu` index) across a PCI remove/rescan, but its
        card number and hwmon directory may change; a card that vanished stays, marked down.
        """
        known = {card.location.pci_slot: card for card in self._cards}
        changed = False
        for location in discover_cards(self._sysfs, use_udev=self._use_udev):
            old = known.get(location.pci_slot)
            if old is not None and old.location == location and old.present():
                hwmon = old.hwmon_dir
                if hwmon is None or os.path.isdir(hwmon):
                    continue
            known[location.pci_slot] = AmdCard(location)
            changed = True
        if changed:
            self._cards = tuple(known[slot] for slot in sorted(known))

    def pci_bus_ids(self) -> list[str]:
        """PCI bus ids (`0000:03:00.0`) of the cards found so far, in bus order."""
        return [card.location.pci_slot for card in self._cards]

    def _gpu_label(self, pci_slot: str) -> str:
        # Indices never change for the exporter's lifetime, so ask the index once per card
        # (lazily: the registry registers all vendors' bus ids before the first scrape).
        label = self._gpu_labels.get(pci_slot)
        if label is None:
            label = str(self._gpu_index.index_of(pci_slot))
            self._gpu_labels[pci_slot] = label
        return label

    def collect(self) -> Iterator[Metric]:
        """Yield fresh families for every card read in time (see the module docstring)."""
        job = self._submit()
        if job is None:
            if self._closed:
                return
            with self._lock:
                busy = self._busy
            stuck = busy.current if busy is not None else None
            yield from self._families({}, {stuck} if stuck else set())
            raise CollectorError(
                f"amdgpu sysfs read still stuck on card {stuck or '(discovery)'} since an "
                "earlier scrape; no new reads queued"
            )
        finished = job.done.wait(self._timeout)
        timed_out: set[str] = set()
        if not finished:
            job.cancelled.set()
            current = job.current
            if current is not None:
                timed_out.add(current)
        reads = job.reads()
        timed_out -= set(reads)
        self._slow = (self._slow - set(reads)) | frozenset(timed_out)
        yield from self._families(reads, timed_out)
        if not finished:
            where = f"card {min(timed_out)}" if timed_out else "discovery"
            raise CollectorError(
                f"amdgpu sysfs read of {where} did not return within {self._timeout:g} s"
            )
        if job.failure is not None:
            raise CollectorError(job.failure)

    # -- the worker ----------------------------------------------------------------------------

    def _submit(self) -> _Job | None:
        """Queue a scrape's reads, unless closed or the worker is still stuck in earlier ones."""
        with self._lock:
            if self._closed or self._busy is not None:
                return None
            job = _Job(self._slow)
            self._busy = job
            self._jobs.put(job)
            if self._worker is None or not self._worker.is_alive():
                self._worker = threading.Thread(target=self._work, name="amdgpu-read", daemon=True)
                self._worker.start()
        return job

    def _work(self) -> None:
        while True:
            try:
                job = self._jobs.get(timeout=_WORKER_IDLE_SECONDS)
            except queue.Empty:
                with self._lock:
                    # Idle: end, unless a job was queued meanwhile (then take it).
                    if self._jobs.empty():
                        self._worker = None
                        return
                continue
            try:
                self._run(job)
            except Exception as err:
                # A bug here must not leave the collector stuck as "busy" for ever.
                log.exception("amdgpu read job failed")
                job.failure = f"amdgpu read failed: {type(err).__name__}: {err}"
            finally:
                with self._lock:
                    self._busy = None
                job.done.set()

    def _run(self, job: _Job) -> None:
        self._rediscovery.run_if_due()
        cards = sorted(self._cards, key=lambda c: (c.location.pci_slot in job.slow,))
        job.cards = tuple(cards)
        for card in cards:
            if job.cancelled.is_set():
                return  # past the deadline: nobody reads the rest
            job.current = card.location.pci_slot
            job.record(card.location.pci_slot, _read_card(card))

    # -- families ------------------------------------------------------------------------------

    def _families(self, reads: dict[str, _CardRead], timed_out: set[str]) -> Iterator[Metric]:
        cards = self._cards
        for slot, done in reads.items():
            self._identities[slot] = done.identity

        g, c = catalogue.gauge, catalogue.counter
        info, up, read_timeout = (
            g("gpufleet_gpu_info"),
            g("gpufleet_gpu_up"),
            g("gpufleet_gpu_read_timeout"),
        )
        util = g("gpufleet_gpu_utilization_ratio")
        mem_util = g("gpufleet_gpu_memory_utilization_ratio")
        mem_used = g("gpufleet_gpu_memory_used_bytes")
        mem_total = g("gpufleet_gpu_memory_total_bytes")
        temp = g("gpufleet_gpu_temperature_celsius")
        temp_crit = g("gpufleet_gpu_temperature_critical_celsius")
        temp_emergency = g("gpufleet_gpu_temperature_emergency_celsius")
        power = g("gpufleet_gpu_power_watts")
        power_limit = g("gpufleet_gpu_power_limit_watts")
        energy = c("gpufleet_gpu_energy_joules_total")
        fan = g("gpufleet_gpu_fan_speed_rpm")
        clock = g("gpufleet_gpu_clock_hertz")
        clock_max = g("gpufleet_gpu_clock_max_hertz")

        cards_up = unread = 0
        for card in cards:
            slot = card.location.pci_slot
            gpu = self._gpu_label(slot)
            read = reads.get(slot)
            identity = read.identity if read is not None else self._identities.get(slot)
            if identity is not None:
                info.add_metric(
                    (
                        gpu,
                        identity.uuid,
                        identity.pci_bus_id,
                        VENDOR,
                        identity.model,
                        identity.pci_id,
                        identity.card,
                        identity.vbios,
                    ),
                    1,
                )
            if read is None:
                unread += 1
                if slot in timed_out:
                    read_timeout.add_metric((gpu,), 1)
                continue
            read_timeout.add_metric((gpu,), 0)
            reading = read.reading
            if not read.present or reading is None:
                up.add_metric((gpu,), 0)
                continue
            up.add_metric((gpu,), 1)
            cards_up += 1

            if reading.utilization is not None:
                util.add_metric((gpu,), reading.utilization)
            if reading.memory_utilization is not None:
                mem_util.add_metric((gpu,), reading.memory_utilization)
            for pool, value in reading.memory_used:
                mem_used.add_metric((gpu, pool), value)
            for pool, value in read.totals:
                mem_total.add_metric((gpu, pool), value)
            for sensor, celsius in reading.temperatures:
                temp.add_metric((gpu, sensor), celsius)
            for sensor, crit, emergency in read.temperature_limits:
                if crit is not None:
                    temp_crit.add_metric((gpu, sensor), crit)
                if emergency is not None:
                    temp_emergency.add_metric((gpu, sensor), emergency)
            if reading.power_watts is not None:
                power.add_metric((gpu,), reading.power_watts)
            if reading.power_cap_watts is not None:
                power_limit.add_metric((gpu, "current"), reading.power_cap_watts)
            for kind, watts in read.power_limits:
                power_limit.add_metric((gpu, kind), watts)
            if reading.energy_joules is not None:
                energy.add_metric((gpu,), reading.energy_joules)
            if reading.fan_rpm is not None:
                fan.add_metric((gpu,), reading.fan_rpm)
            for name, hertz in reading.clocks:
                clock.add_metric((gpu, name), hertz)
            for name, hertz in read.clock_max:
                clock_max.add_metric((gpu, name), hertz)

        families: list[Metric] = [info, up, read_timeout]
        if self._expected_count is not None:
            expected = catalogue.gauge("gpufleet_gpus_expected")
            expected.add_metric((VENDOR,), self._expected_count)
            lost = catalogue.gauge("gpufleet_gpus_lost")
            lost.add_metric((VENDOR,), max(0, self._expected_count - cards_up - unread))
            families += (expected, lost)
        families += (
            util, mem_util, mem_used, mem_total, temp, temp_crit, temp_emergency,
            power, power_limit, energy, fan, clock, clock_max,
        )  # fmt: skip
        # An empty family would still print HELP/TYPE: yield only those with samples.
        yield from (family for family in families if family.samples)

    def close(self) -> None:
        """Let the worker end: it stops taking reads (a read stuck in the kernel stays so)."""
        with self._lock:
            self._closed = True
