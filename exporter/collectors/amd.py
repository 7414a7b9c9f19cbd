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

Check by hand: `cat /sys/class/drm/card0/device/gpu_busy_percent`,
`sensors amdgpu-pci-0300` (lm-sensors shows the same hwmon values in °C and W).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.metrics_core import Metric

from exporter.collectors.base import Rediscovery
from exporter.gpu_index import GpuIndex
from exporter.sources.amdgpu import AmdCard, discover_cards

VENDOR = "amd"
INFO_LABELS = ("gpu", "uuid", "pci_bus_id", "vendor", "model", "pci_id", "card", "vbios")


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
        """Yield fresh families for every known card (see the module docstring)."""
        self._rediscovery.run_if_due()
        cards = self._cards

        info = GaugeMetricFamily("gpufleet_gpu_info", "GPU identity.", labels=INFO_LABELS)
        up = GaugeMetricFamily(
            "gpufleet_gpu_up", "1 while the GPU is readable, 0 once it is lost.", labels=["gpu"]
        )
        util = GaugeMetricFamily(
            "gpufleet_gpu_utilization_ratio", "Fraction of time the GPU was busy.", labels=["gpu"]
        )
        mem_util = GaugeMetricFamily(
            "gpufleet_gpu_memory_utilization_ratio",
            "Fraction of time the GPU memory controller was busy.",
            labels=["gpu"],
        )
        mem_used = GaugeMetricFamily(
            "gpufleet_gpu_memory_used_bytes", "GPU memory in use, by pool.", labels=["gpu", "pool"]
        )
        mem_total = GaugeMetricFamily(
            "gpufleet_gpu_memory_total_bytes", "GPU memory size, by pool.", labels=["gpu", "pool"]
        )
        temp = GaugeMetricFamily(
            "gpufleet_gpu_temperature_celsius", "GPU temperature.", labels=["gpu", "sensor"]
        )
        temp_crit = GaugeMetricFamily(
            "gpufleet_gpu_temperature_critical_celsius",
            "The GPU's own critical temperature limit.",
            labels=["gpu", "sensor"],
        )
        temp_emergency = GaugeMetricFamily(
            "gpufleet_gpu_temperature_emergency_celsius",
            "The GPU's emergency (shutdown) temperature.",
            labels=["gpu", "sensor"],
        )
        power = GaugeMetricFamily("gpufleet_gpu_power_watts", "GPU power draw.", labels=["gpu"])
        power_limit = GaugeMetricFamily(
            "gpufleet_gpu_power_limit_watts",
            "GPU power limits: the enforced cap and its bounds.",
            labels=["gpu", "kind"],
        )
        energy = CounterMetricFamily(
            "gpufleet_gpu_energy_joules", "GPU energy consumed.", labels=["gpu"]
        )
        fan = GaugeMetricFamily("gpufleet_gpu_fan_speed_rpm", "GPU fan speed.", labels=["gpu"])
        clock = GaugeMetricFamily(
            "gpufleet_gpu_clock_hertz", "GPU clock frequency.", labels=["gpu", "clock"]
        )
        clock_max = GaugeMetricFamily(
            "gpufleet_gpu_clock_max_hertz", "Highest GPU clock level.", labels=["gpu", "clock"]
        )

        cards_up = 0
        for card in cards:
            identity = card.identity()
            gpu = self._gpu_label(identity.pci_bus_id)
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
            if not card.present():
                up.add_metric((gpu,), 0)
                continue  # every read would fail: skip them
            up.add_metric((gpu,), 1)
            cards_up += 1

            reading = card.read()
            if reading.utilization is not None:
                util.add_metric((gpu,), reading.utilization)
            if reading.memory_utilization is not None:
                mem_util.add_metric((gpu,), reading.memory_utilization)
            for pool, value in reading.memory_used:
                mem_used.add_metric((gpu, pool), value)
            for pool, value in card.memory_totals():
                mem_total.add_metric((gpu, pool), value)
            for sensor, celsius in reading.temperatures:
                temp.add_metric((gpu, sensor), celsius)
            for sensor, crit, emergency in card.temperature_limits():
                if crit is not None:
                    temp_crit.add_metric((gpu, sensor), crit)
                if emergency is not None:
                    temp_emergency.add_metric((gpu, sensor), emergency)
            if reading.power_watts is not None:
                power.add_metric((gpu,), reading.power_watts)
            if reading.power_cap_watts is not None:
                power_limit.add_metric((gpu, "current"), reading.power_cap_watts)
            for kind, watts in card.power_limits():
                power_limit.add_metric((gpu, kind), watts)
            if reading.energy_joules is not None:
                energy.add_metric((gpu,), reading.energy_joules)
            if reading.fan_rpm is not None:
                fan.add_metric((gpu,), reading.fan_rpm)
            for name, hertz in reading.clocks:
                clock.add_metric((gpu, name), hertz)
            for name, hertz in card.clock_max():
                clock_max.add_metric((gpu, name), hertz)

        families: list[Metric] = [info, up]
        if self._expected_count is not None:
            expected = GaugeMetricFamily(
                "gpufleet_gpus_expected", "GPUs the roster says the host has.", labels=["vendor"]
            )
            expected.add_metric((VENDOR,), self._expected_count)
            lost = GaugeMetricFamily(
                "gpufleet_gpus_lost", "Expected GPUs not up.", labels=["vendor"]
            )
            lost.add_metric((VENDOR,), max(0, self._expected_count - cards_up))
            families += (expected, lost)
        families += (
            util, mem_util, mem_used, mem_total, temp, temp_crit, temp_emergency,
            power, power_limit, energy, fan, clock, clock_max,
        )  # fmt: skip
        # An empty family would still print HELP/TYPE: yield only those with samples.
        yield from (family for family in families if family.samples)

    def close(self) -> None:
        """Nothing to release: the collector holds no open files or threads."""
