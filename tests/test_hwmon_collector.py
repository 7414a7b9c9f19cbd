"""The hwmon collector (host temperatures) and the hwmon source against fixture trees."""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.metrics_core import Metric

from exporter.collectors.base import CollectorError, SourceCollector
from exporter.collectors.hwmon import HwmonCollector, k10temp_default_celsius
from exporter.exposition import TextWriter
from exporter.sources.hwmon import chip_labels, list_chips, read_chip
from tests.golden import assert_golden, exposition
from tests.sysfs_tree import (
    ACPITZ,
    TempSpec,
    apu_spec,
    discrete_spec,
    nvme_spec,
    set_value,
    write_amd_card,
    write_hwmon_chip,
    write_k10temp,
)


class FakeClock:
    def __init__(self) -> None:
        self.now = 50.0

    def __call__(self) -> float:
        return self.now


def registry_of(
    root: Path, thermal: Mapping[str, float] | None = None, clock: FakeClock | None = None
) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(HwmonCollector(str(root), thermal=thermal or {}, clock=clock or FakeClock()))
    return registry


def temp(registry: CollectorRegistry, chip: str, sensor: str) -> float | None:
    return registry.get_sample_value(
        "gpufleet_host_temperature_celsius", {"chip": chip, "sensor": sensor}
    )


def crit(registry: CollectorRegistry, chip: str, sensor: str) -> float | None:
    """The critical value, whatever its source (`source_of` says which)."""
    for family in registry.collect():
        for sample in family.samples:
            if (
                sample.name == "gpufleet_host_temperature_critical_celsius"
                and sample.labels["chip"] == chip
                and sample.labels["sensor"] == sensor
            ):
                return sample.value
    return None


def source_of(registry: CollectorRegistry, chip: str, sensor: str) -> str | None:
    for family in registry.collect():
        for sample in family.samples:
            if (
                sample.name == "gpufleet_host_temperature_critical_celsius"
                and sample.labels["chip"] == chip
                and sample.labels["sensor"] == sensor
            ):
                return sample.labels["source"]
    return None


def write_host(root: Path) -> None:
    """A GPU host: k10temp, two NVMe drives, an ACPI zone and a discrete amdgpu card."""
    write_k10temp(root)
    # The drive on the higher PCI address is probed first and gets the lower hwmon number.
    write_hwmon_chip(root, nvme_spec(1, "0000:02:00.0", composite=44_850))
    write_hwmon_chip(root, nvme_spec(0, "0000:01:00.0", composite=38_850))
    write_hwmon_chip(root, ACPITZ)
    write_amd_card(root, discrete_spec(card=0))


def test_host_golden(tmp_path: Path) -> None:
    write_host(tmp_path)
    collector = HwmonCollector(str(tmp_path))
    assert isinstance(collector, SourceCollector)
    assert collector.name == "hwmon"
    assert_golden(exposition(collector), "hwmon_host")


def test_apu_host_golden(tmp_path: Path) -> None:
    # An APU has no GPU crit temperature: Tctl's default critical value is what guards it.
    write_amd_card(tmp_path, apu_spec())
    write_k10temp(tmp_path)
    assert_golden(exposition(HwmonCollector(str(tmp_path))), "hwmon_apu")
    assert crit(registry_of(tmp_path, thermal={"k10temp/Tctl": 100.0}), "k10temp", "Tctl") == 100


def test_namesakes_are_numbered_by_device_path_not_hwmon_number(tmp_path: Path) -> None:
    write_host(tmp_path)
    registry = registry_of(tmp_path)
    assert temp(registry, "nvme", "Composite") == 38.85  # 0000:01:00.0, hwmon2
    assert temp(registry, "nvme_1", "Composite") == 44.85  # 0000:02:00.0, hwmon1
    assert temp(registry, "nvme_2", "Composite") is None
    assert temp(registry, "amdgpu", "edge") is None  # the amd collector's


def test_k10temp_critical_default_and_roster_override(tmp_path: Path) -> None:
    write_host(tmp_path)
    registry = registry_of(tmp_path)
    assert crit(registry, "k10temp", "Tctl") == 90
    # Our default, not the hardware's word: marked as such.
    assert source_of(registry, "k10temp", "Tctl") == "default"
    assert source_of(registry, "nvme", "Composite") == "hwmon"
    assert crit(registry, "k10temp", "Tccd1") is None  # no file, no roster, no default
    roster = {"k10temp/Tctl": 95.0, "nvme/Composite": 70.0, "nvme_1/Sensor 1": 80.0}
    registry = registry_of(tmp_path, thermal=roster)
    assert crit(registry, "k10temp", "Tctl") == 95
    assert source_of(registry, "k10temp", "Tctl") == "roster"
    assert source_of(registry, "nvme", "Composite") == "hwmon"
    assert crit(registry, "nvme", "Composite") == 84.85  # the hardware's own value wins
    assert crit(registry, "nvme_1", "Sensor 1") == 80
    assert crit(registry, "nvme", "Sensor 1") is None
    assert crit(registry, "acpitz", "temp1") == 105


def test_roster_by_chip_name_covers_namesakes(tmp_path: Path) -> None:
    write_host(tmp_path)
    registry = registry_of(tmp_path, thermal={"nvme/Sensor 1": 75.0})
    assert crit(registry, "nvme", "Sensor 1") == 75
    assert crit(registry, "nvme_1", "Sensor 1") == 75


def test_changed_and_bad_values(tmp_path: Path) -> None:
    write_host(tmp_path)
    k10temp = tmp_path / "devices/pci0000:00/0000:00:18.3/hwmon/hwmon0"
    registry = registry_of(tmp_path)
    assert temp(registry, "k10temp", "Tctl") == 65.25
    set_value(k10temp / "temp1_input", 88_125)
    assert temp(registry, "k10temp", "Tctl") == 88.125
    set_value(k10temp / "temp1_input", "garbage")
    assert temp(registry, "k10temp", "Tctl") is None
    assert crit(registry, "k10temp", "Tctl") == 90  # the limit stays
    assert temp(registry, "k10temp", "Tccd1") == 58
    (k10temp / "temp2_input").write_text("")
    assert temp(registry, "k10temp", "Tccd1") is None
    assert temp(registry, "nvme", "Composite") == 38.85


def test_missing_input_keeps_the_chip_crit(tmp_path: Path) -> None:
    nvme = write_hwmon_chip(tmp_path, nvme_spec(0, "0000:01:00.0"))
    (nvme / "temp1_input").unlink()
    registry = registry_of(tmp_path)
    assert temp(registry, "nvme", "Composite") is None
    assert crit(registry, "nvme", "Composite") == 84.85
    assert temp(registry, "nvme", "Sensor 1") == 43.85


def test_new_chips_found_after_the_rediscover_interval(tmp_path: Path) -> None:
    write_k10temp(tmp_path)
    clock = FakeClock()
    registry = registry_of(tmp_path, clock=clock)
    write_hwmon_chip(tmp_path, nvme_spec(0, "0000:01:00.0"))
    clock.now += 30
    assert temp(registry, "nvme", "Composite") is None
    clock.now += 30
    assert temp(registry, "nvme", "Composite") == 41.85
    assert temp(registry, "k10temp", "Tctl") == 65.25


def test_no_hwmon_at_all(tmp_path: Path) -> None:
    assert list(HwmonCollector(str(tmp_path)).collect()) == []


def test_source_chip_listing(tmp_path: Path) -> None:
    write_host(tmp_path)
    chips = list_chips(str(tmp_path), exclude_names={"amdgpu"})
    # In device-path order: pci0000:00/0000:00:01.2/… (the drives) before 0000:00:18.3.
    assert [label for label, _ in chip_labels(chips)] == ["nvme", "nvme_1", "k10temp", "acpitz"]
    k10temp = chips[2]
    assert [(t.number, t.sensor) for t in k10temp.temps] == [(1, "Tctl"), (2, "Tccd1")]
    assert k10temp.device_path == str(tmp_path.resolve() / "devices/pci0000:00/0000:00:18.3")
    everything = list_chips(str(tmp_path))
    assert [c.name for c in everything].count("amdgpu") == 1


def test_source_chip_name_fallbacks(tmp_path: Path) -> None:
    chip_dir = write_k10temp(tmp_path)
    # Drivers on the deprecated hwmon_device_register() keep the name in device/name.
    (chip_dir / "name").rename(chip_dir / "device" / "name")
    chip = read_chip(str(chip_dir))
    assert chip is not None
    assert chip.name == "k10temp"
    (chip_dir / "device" / "name").unlink()
    # Nameless (the ABI says it may not be, captures say it happens): named by its directory,
    # which is not stable across boots but better than losing the readings.
    nameless = read_chip(str(chip_dir))
    assert nameless is not None and nameless.name == chip_dir.name
    assert read_chip(str(tmp_path / "absent")) is None


def test_channels_sharing_a_label_are_told_apart(tmp_path: Path) -> None:
    """Two channels labelled alike: the first keeps the label, the later one is qualified."""
    chip_dir = write_hwmon_chip(
        tmp_path,
        replace(
            ACPITZ,
            name="it8688",
            temps=(TempSpec("foosensor", 55_000), TempSpec("foosensor", 54_000), TempSpec(None, 1)),
        ),
    )
    (chip_dir / "temp4_input").write_text("30000\n")
    (chip_dir / "temp4_label").write_text("temp3\n")  # a label equal to another's fallback
    chip = read_chip(str(chip_dir))
    assert chip is not None
    assert [t.sensor for t in chip.temps] == [
        "foosensor",
        "foosensor_temp2",
        "temp3",
        "temp3_temp4",
    ]
    registry = registry_of(tmp_path)
    assert temp(registry, "it8688", "foosensor") == 55
    assert temp(registry, "it8688", "foosensor_temp2") == 54


STRIX_HALO = """\
processor\t: 0
vendor_id\t: AuthenticAMD
cpu family\t: 26
model\t\t: 112
model name\t: AMD RYZEN AI MAX+ 395 w/ Radeon 8060S
"""


@pytest.mark.parametrize(
    ("vendor", "family", "model", "expected"),
    [
        ("AuthenticAMD", 26, 0x70, 100.0),  # Strix Halo (Ryzen AI Max)
        ("AuthenticAMD", 26, 0x24, 100.0),  # Strix Point
        ("AuthenticAMD", 26, 0x44, 95.0),  # Granite Ridge (Ryzen 9000 desktop)
        ("AuthenticAMD", 25, 0x61, 95.0),  # Raphael (Zen 4)
        ("AuthenticAMD", 25, 0x21, 90.0),  # Vermeer (Zen 3)
        ("GenuineIntel", 6, 0x8F, 90.0),  # not AMD: the generic default
    ],
)
def test_the_k10temp_default_is_the_cpus_own_tjmax(
    tmp_path: Path, vendor: str, family: int, model: int, expected: float
) -> None:
    proc = tmp_path / "proc"
    proc.mkdir()
    (proc / "cpuinfo").write_text(
        f"processor\t: 0\nvendor_id\t: {vendor}\ncpu family\t: {family}\nmodel\t\t: {model}\n\n"
        f"processor\t: 1\nvendor_id\t: {vendor}\ncpu family\t: 1\nmodel\t\t: 1\n"
    )
    assert k10temp_default_celsius(str(proc)) == expected


def test_strix_halo_pages_at_its_own_limit_and_says_it_is_a_default(tmp_path: Path) -> None:
    write_k10temp(tmp_path)
    proc = tmp_path / "proc"
    proc.mkdir()
    (proc / "cpuinfo").write_text(STRIX_HALO)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(HwmonCollector(str(tmp_path), procfs=str(proc), clock=FakeClock()))
    labels = {"chip": "k10temp", "sensor": "Tctl", "source": "default"}
    assert registry.get_sample_value("gpufleet_host_temperature_critical_celsius", labels) == 100
    # The roster's word wins over any default.
    assert crit(registry_of(tmp_path, thermal={"k10temp/Tctl": 97.0}), "k10temp", "Tctl") == 97
    # No cpuinfo (or none given): the generic 90 °C.
    assert k10temp_default_celsius(str(tmp_path / "nowhere")) == 90.0
    assert k10temp_default_celsius(None) == 90.0


def test_a_blocking_chip_costs_only_its_own_temperatures(tmp_path: Path) -> None:
    """An nvme chip whose temp1_input blocks (a FIFO: open() waits for a writer) misses the
    deadline alone; the CPU's Tctl is read on time in every scrape, and the stuck chip is not
    read again (nor waited on) while its read stays stuck: one thread, however long."""
    write_k10temp(tmp_path)
    nvme = write_hwmon_chip(tmp_path, nvme_spec(0, "0000:01:00.0"))
    blocking = nvme / "temp1_input"
    blocking.unlink()
    os.mkfifo(blocking)
    collector = HwmonCollector(str(tmp_path), clock=FakeClock(), timeout_seconds=1.0)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    try:
        start = time.monotonic()
        text, error = scrape_text(collector)
        assert time.monotonic() - start < 1.5
        assert error is not None and "chip nvme did not return within 0.5 s" in str(error)
        assert 'gpufleet_host_temperature_read_timeout{chip="nvme"} 1.0' in text
        assert 'gpufleet_host_temperature_read_timeout{chip="k10temp"} 0.0' in text
        assert 'chip="nvme",sensor="Composite"' not in text
        assert 'gpufleet_host_temperature_celsius{chip="k10temp",sensor="Tctl"}' in text
        for _ in range(5):
            start = time.monotonic()
            text, error = scrape_text(collector)
            assert time.monotonic() - start < 0.25  # the stuck chip is not waited on again
            assert error is not None and "not read again" in str(error)
            assert 'gpufleet_host_temperature_celsius{chip="k10temp",sensor="Tctl"}' in text
            assert collector._reads.threads() <= 3  # two chips and rediscovery
        os.close(os.open(blocking, os.O_WRONLY | os.O_NONBLOCK))  # the read returns (EOF)
        blocking.unlink()
        set_value(blocking, 45_000)
        deadline = time.monotonic() + 3
        while error is not None and time.monotonic() < deadline:
            text, error = scrape_text(collector)
        assert error is None
        assert temp(registry, "nvme", "Composite") == 45.0
    finally:
        with contextlib.suppress(OSError):
            os.close(os.open(blocking, os.O_WRONLY | os.O_NONBLOCK))
        collector.close()


def scrape_text(collector: HwmonCollector) -> tuple[str, CollectorError | None]:
    """One collect() as exposition text, and the CollectorError it ended with."""
    families: list[Metric] = []
    error = None
    try:
        families.extend(collector.collect())
    except CollectorError as exc:
        error = exc
    return TextWriter().render(families).decode(), error
