"""Host temperatures from hwmon: CPU (k10temp, coretemp), NVMe drives, ACPI zones, boards.

Every `temp<N>_input` of every chip under `<sysfs>/class/hwmon`, except the `amdgpu` chips
(the amd collector exports those as GPU temperatures). `chip` is the chip's `name`; chips that
share a name (two `nvme`) become `nvme`, `nvme_1`… in order of their device paths, which are
stable across boots (hwmon numbers are not). `sensor` is `temp<N>_label`, else `temp<N>`.

Two channels of one chip with the same label are told apart (`foosensor`, `foosensor_temp2`;
see exporter/sources/hwmon.py), so no scrape has two samples with one label set.

The critical value is the chip's own `temp<N>_crit`; else the roster's `thermal` entry for
`chip/sensor`; else a default — for k10temp the AMD CPU's own Tjmax by generation and package
(`k10temp_default_celsius`: 100 °C on Strix Halo and the other Zen 5 mobile APUs, 95 °C on
Zen 4 and Zen 5 desktop/server, 90 °C otherwise); else the series is absent. Its `source` label
says which (`hwmon`, `roster`, `default`): a default is our guess for a chip that reports no
limit, not the hardware's word, and a dashboard or a person must be able to tell. The alert
rules match on (host, instance, chip, sensor) and use all three alike.

Sample output::

    gpufleet_host_temperature_celsius{chip="k10temp",sensor="Tctl"} 65.25
    gpufleet_host_temperature_critical_celsius{chip="k10temp",sensor="Tctl",source="default"} 90.0
    gpufleet_host_temperature_celsius{chip="nvme_1",sensor="Composite"} 41.85

Check by hand: `sensors` (lm-sensors prints the same chips, e.g. `k10temp-pci-00c3`).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from functools import partial
from types import MappingProxyType

from prometheus_client.metrics_core import Metric

from exporter.collectors import catalogue
from exporter.collectors.base import CollectorError, Rediscovery
from exporter.sources.deadline import SerialReads, read_devices
from exporter.sources.hwmon import chip_labels, list_chips
from exporter.sources.sysfs import StaticValue, read_int

# Critical temperatures for chips that expose none. Documentation/hwmon/k10temp.rst: on
# Family 17h and later (Zen) k10temp reports Tctl (temp1), Tdie (temp2) and Tccd<N> but no
# temp*_crit (only older families, with BIOS hardware temperature control enabled, have
# one). Tctl is the control temperature the CPU throttles on; 90 °C is the Tjmax of most
# Zen 2/Zen 3 parts and below Zen 4's 95 °C, so it warns early rather than late.
DEFAULT_CRITICAL_CELSIUS: Mapping[str, float] = MappingProxyType(
    {"k10temp/Tctl": 90.0, "k10temp/Tdie": 90.0}
)
_K10TEMP_SENSORS = ("Tctl", "Tdie")
# AMD's Tjmax differs by generation and by package (AMD's product pages, "Max. Operating
# Temperature (Tjmax)"): 90 °C for most Zen 2/Zen 3 parts, 95 °C for Zen 4 (family 19h models
# 10h-1Fh Genoa, 60h-7Fh Raphael/Phoenix, A0h-AFh Bergamo) and Zen 5 desktop and server parts,
# 100 °C for the Zen 5 mobile APUs (family 1Ah models 20h-2Fh Strix Point, 60h-7Fh Krackan
# and Strix Halo, "Ryzen AI Max"), whose small chassis run hot by design: a 90 °C default
# paged critical at 85 °C under sustained inference there.
_ZEN4_MODELS = (range(0x10, 0x20), range(0x60, 0x80), range(0xA0, 0xB0))
_ZEN5_MOBILE_MODELS = (range(0x20, 0x30), range(0x60, 0x80))


def k10temp_default_celsius(procfs: str | None) -> float:
    """The default critical Tctl/Tdie for this machine's AMD CPU (`<procfs>/cpuinfo`).

    None (no procfs given) or an unreadable or non-AMD cpuinfo: the generic 90 °C.
    """
    if procfs is None:
        return DEFAULT_CRITICAL_CELSIUS["k10temp/Tctl"]
    fields: dict[str, str] = {}
    try:
        with open(os.path.join(procfs, "cpuinfo"), encoding="utf-8", errors="replace") as f:
            for line in f:
                key, sep, value = line.partition(":")
                if not sep:
                    if fields:
                        break  # the first CPU's block is enough
                    continue
                fields.setdefault(key.strip(), value.strip())
    except OSError:
        return DEFAULT_CRITICAL_CELSIUS["k10temp/Tctl"]
    try:
        family, model = int(fields["cpu family"]), int(fields["model"])
    except (KeyError, ValueError):
        return DEFAULT_CRITICAL_CELSIUS["k10temp/Tctl"]
    if fields.get("vendor_id") != "AuthenticAMD":
        return DEFAULT_CRITICAL_CELSIUS["k10temp/Tctl"]
    if family == 0x1A:
        return 100.0 if any(model in r for r in _ZEN5_MOBILE_MODELS) else 95.0
    if family == 0x19 and any(model in r for r in _ZEN4_MODELS):
        return 95.0
    return DEFAULT_CRITICAL_CELSIUS["k10temp/Tctl"]


EXCLUDED_CHIPS = frozenset({"amdgpu"})  # exported per GPU by the amd collector

_NO_THERMAL: Mapping[str, float] = MappingProxyType({})


@dataclass(frozen=True, slots=True)
class _Sensor:
    chip: str
    sensor: str
    input_path: str | None
    crit: StaticValue[float]
    fallback_crit: float | None
    fallback_source: str  # `roster` or `default`: where fallback_crit comes from


@dataclass(frozen=True, slots=True)
class _SensorRead:
    sensor: _Sensor
    celsius: float | None
    critical: float | None
    source: str


def _read_sensors(sensors: tuple[_Sensor, ...]) -> list[_SensorRead]:
    """One chip's readings (on its worker: a chip's read may block in the kernel)."""
    reads = []
    for s in sensors:
        # Documentation/hwmon/sysfs-interface.rst: temp*_input is in millidegrees Celsius.
        value = None if s.input_path is None else read_int(s.input_path)
        critical, source = s.crit.get(), "hwmon"
        if critical is None:
            critical, source = s.fallback_crit, s.fallback_source
        reads.append(_SensorRead(s, None if value is None else value / 1000, critical, source))
    return reads


class HwmonCollector:
    """Collects host temperatures and their critical values from hwmon under `sysfs`."""

    name = "hwmon"

    def __init__(
        self,
        sysfs: str = "/sys",
        *,
        thermal: Mapping[str, float] = _NO_THERMAL,
        rediscover_seconds: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
        procfs: str | None = None,
        timeout_seconds: float = 4.0,
    ) -> None:
        self._sysfs = sysfs
        self._timeout = timeout_seconds
        self._reads = SerialReads("hwmon")
        self._thermal = dict(thermal)
        # The CPU's own default for k10temp (read once: a CPU does not change under us);
        # without a procfs root, the generic defaults.
        k10temp = k10temp_default_celsius(procfs)
        own = {f"k10temp/{sensor}": k10temp for sensor in _K10TEMP_SENSORS}
        self._defaults = {**DEFAULT_CRITICAL_CELSIUS, **own}
        self._entries: frozenset[str] = frozenset()
        # The sensors by chip label, in order: the chips are read one by one (`collect`).
        self._chips: tuple[tuple[str, tuple[_Sensor, ...]], ...] = ()
        self._discover()
        self._rediscovery = Rediscovery(self._discover, rediscover_seconds, clock)

    def _list_entries(self) -> frozenset[str]:
        try:
            return frozenset(os.listdir(os.path.join(self._sysfs, "class", "hwmon")))
        except OSError:
            return frozenset()

    def _discover(self) -> None:
        """Rebuild the sensor list when the set of hwmon entries changed (a chip came or went)."""
        entries = self._list_entries()
        if entries == self._entries and self._chips:
            return
        self._entries = entries
        by_chip: dict[str, list[_Sensor]] = {}
        for label, chip in chip_labels(list_chips(self._sysfs, exclude_names=EXCLUDED_CHIPS)):
            for temp in chip.temps:
                source = "roster"
                fallback = self._thermal.get(f"{label}/{temp.sensor}")
                if fallback is None:
                    fallback = self._thermal.get(f"{chip.name}/{temp.sensor}")
                if fallback is None:
                    source = "default"
                    fallback = self._defaults.get(f"{chip.name}/{temp.sensor}")
                by_chip.setdefault(label, []).append(
                    _Sensor(label, temp.sensor, temp.input_path, temp.crit, fallback, source)
                )
        self._chips = tuple((chip, tuple(group)) for chip, group in by_chip.items())

    def collect(self) -> Iterator[Metric]:
        """Yield the temperature families; a chip not read in time costs only its own series.

        The chips are read in turn off the scrape thread (`exporter.sources.deadline`); one
        whose read is still running after half of `timeout_seconds` (at most 1 s: an nvme chip
        waiting on a wedged admin command, an I2C sensor in D state) is left behind and the
        others read: it has `gpufleet_host_temperature_read_timeout 1` and no temperatures, is
        not read again while that read stays stuck, and `CollectorError` names it.
        """
        scrape = read_devices(
            self._reads,
            # The chips known after rediscovery: discovery replaces the tuple, never mutates it.
            lambda: [(chip, partial(_read_sensors, sensors)) for chip, sensors in self._chips],
            timeout=self._timeout,
            discovery_due=self._rediscovery.due,
            discover=self._rediscovery.run_if_due,
        )
        got, patience = scrape.got, scrape.patience
        chips = self._chips
        temp = catalogue.gauge("gpufleet_host_temperature_celsius")
        crit = catalogue.gauge("gpufleet_host_temperature_critical_celsius")
        timeout = catalogue.gauge("gpufleet_host_temperature_read_timeout")
        problems = [
            f"chip {chip}: read failed: {type(error).__name__}: {error}"
            for chip, error in got.errors.items()
        ]
        late = sorted({*got.refused, *got.stuck})
        for chip, _ in chips:
            if chip not in got.results:
                if chip not in got.errors:
                    timeout.add_metric((chip,), 1)  # stuck, or not reached by the deadline
                continue
            timeout.add_metric((chip,), 0)
            for read in got.results[chip]:
                labels = (chip, read.sensor.sensor)
                if read.celsius is not None:
                    temp.add_metric(labels, read.celsius)
                if read.critical is not None:
                    crit.add_metric((*labels, read.source), read.critical)
        yield from (family for family in (temp, crit, timeout) if family.samples)
        if late:
            problems.insert(
                0,
                f"hwmon read of chip {', '.join(late)} did not return within {patience:g} s "
                "(not read again until it returns)",
            )
        if scrape.discovery_stuck:
            problems.append("hwmon rediscovery stuck in the kernel; not waited on again")
        if problems:
            raise CollectorError("; ".join(problems))

    def close(self) -> None:
        """Refuse new reads; the chips' workers end (a read stuck in the kernel stays so)."""
        self._reads.close()
