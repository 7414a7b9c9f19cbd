"""AMD GPUs (amdgpu driver) from sysfs: identity, utilisation, memory, temperatures, power, clocks.

Cards are discovered once in the constructor (libudev on the real `/sys`, else a walk of
`<sysfs>/class/drm`), then again at most every `rediscover_seconds` to pick up new ones; a
scrape reads only the changing files of the known cards. A card is up when amdgpu still drives
it (its `driver` link) and at least one changing value was read this scrape. A card whose PCI
device directory disappears (fell off the bus, removed), that was unbound from amdgpu, or that
answers nothing keeps its `gpu` index and info, shows `gpufleet_gpu_up 0`, counts in
`gpufleet_gpus_lost`, and its cached totals and limits are no longer exported.

Sample output (one discrete card)::

    gpufleet_gpu_info{gpu="0",uuid="5c0b2a1f6e8d4a31",pci_bus_id="0000:03:00.0",vendor="amd",
                      model="",pci_id="1002:744c",card="card0",vbios="113-D7020100-102"} 1.0
    gpufleet_gpu_up{gpu="0"} 1.0
    gpufleet_gpu_temperature_celsius{gpu="0",sensor="junction"} 71.0
    gpufleet_gpu_power_watts{gpu="0"} 215.0

Reads run off the scrape thread, under a deadline. amdgpu answers a sysfs read by asking the
GPU's SMU, and a card in trouble (a hung SMU, a reset in progress, a card falling off the bus)
can block that read in the kernel for seconds or for good. So the cards are read in turn off
the scrape thread (`exporter.sources.deadline`): a card's read still running after half of
`timeout_seconds` (at most 1 s) is left behind with its worker and a fresh one reads the
others; `collect()` waits at most `timeout_seconds`, exports the cards read by then, and
raises `CollectorError` naming the others. As for NVIDIA, "not read this scrape" is not "read
and failed": a card left behind has no `gpufleet_gpu_up` and `gpufleet_gpu_read_timeout 1`.
While that read stays stuck the card is not read again (nothing queues behind it: one thread
per stuck card, not one per scrape) and, from the next scrape on, it is hung:
`gpufleet_gpu_up 0`, counted in `gpufleet_gpus_lost`.

Check by hand: `cat /sys/class/drm/card0/device/gpu_busy_percent`,
`sensors amdgpu-pci-0300` (lm-sensors shows the same hwmon values in °C and W).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial

from prometheus_client.metrics_core import Metric

from exporter.collectors import catalogue
from exporter.collectors.base import CollectorError, Rediscovery
from exporter.sources.amdgpu import AmdCard, AmdIdentity, AmdReading, discover_cards
from exporter.sources.deadline import SerialReads, read_devices
from fleet.gpu_index import GpuIndex

log = logging.getLogger(__name__)

VENDOR = "amd"


@dataclass(frozen=True, slots=True)
class _CardRead:
    """Everything one scrape read of one card (on the worker thread)."""

    identity: AmdIdentity
    present: bool  # up: bound to amdgpu and a changing value read (else nothing but info)
    reading: AmdReading | None = None
    totals: tuple[tuple[str, int], ...] = ()
    temperature_limits: tuple[tuple[str, float | None, float | None], ...] = ()
    power_limits: tuple[tuple[str, float], ...] = ()
    clock_max: tuple[tuple[str, float], ...] = ()


def _read_card(card: AmdCard) -> _CardRead:
    identity = card.identity()
    if not card.present() or not card.bound():
        return _CardRead(identity, present=False)  # every read would fail: skip them
    reading = card.read()
    if not reading.any():
        # Bound, yet not one changing value read (a card going away, attributes gone):
        # not up, and its cached statics are not a reading of a live card.
        return _CardRead(identity, present=False)
    return _CardRead(
        identity,
        present=True,
        reading=reading,
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
        self._reads = SerialReads("amdgpu")
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
        if self._closed:
            return
        scrape = read_devices(
            self._reads,
            # The cards known after rediscovery: discovery replaces the tuple, never mutates it.
            lambda: [(c.location.pci_slot, partial(_read_card, c)) for c in self._cards],
            timeout=self._timeout,
            discovery_due=self._rediscovery.due,
            discover=self._rediscovery.run_if_due,
        )
        got, patience = scrape.got, scrape.patience
        hung = set(got.refused)  # its read of an earlier scrape is still stuck
        done: dict[str, _CardRead] = got.results
        timed_out = set(got.stuck)
        problems = [
            # A bug here costs that card's reading, said once per scrape, never the others.
            f"card {slot}: read failed: {type(error).__name__}: {error}"
            for slot, error in got.errors.items()
        ]
        yield from self._families(done, timed_out, hung)
        if timed_out:
            problems.insert(
                0,
                f"amdgpu sysfs read of card {', '.join(sorted(timed_out))} did not return "
                f"within {patience:g} s",
            )
        if hung:
            problems.insert(
                0,
                f"amdgpu sysfs read still stuck on card {', '.join(sorted(hung))} since an "
                "earlier scrape; not read again until it returns",
            )
        if scrape.discovery_stuck:
            problems.append("amdgpu rediscovery stuck in the kernel; not waited on again")
        if problems:
            raise CollectorError("; ".join(problems))

    # -- families ------------------------------------------------------------------------------

    def _families(
        self, reads: dict[str, _CardRead], timed_out: set[str], hung: set[str]
    ) -> Iterator[Metric]:
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
                if slot in hung:
                    # Stuck since an earlier scrape: not a slow read any more, a hung card.
                    read_timeout.add_metric((gpu,), 1)
                    up.add_metric((gpu,), 0)
                    continue
                unread += 1  # timed out this once (or its read failed): unknown, not lost
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
        """Stop taking reads; workers end (a read stuck in the kernel stays so, on a daemon)."""
        self._closed = True
        self._reads.close()
