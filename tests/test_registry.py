"""The fleet collector: supervision, merging of shared families, self metrics, GPU indices."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.metrics_core import Metric

from exporter.collectors.base import CollectorError
from exporter.registry import ExporterSettings, FleetCollector, build_registry
from fleet.gpu_index import GpuIndex, normalize_pci_bus_id


class Emits:
    """A source collector that emits one `gpufleet_gpu_up` sample, then fails as told."""

    def __init__(self, name: str, gpu: str, fail: BaseException | None = None) -> None:
        self.name = name
        self.gpu = gpu
        self.fail = fail
        self.closed = False

    def collect(self) -> Iterator[Metric]:
        up = GaugeMetricFamily("gpufleet_gpu_up", "GPU readable.", labels=["gpu"])
        up.add_metric([self.gpu], 1.0)
        yield up
        if self.fail is not None:
            raise self.fail

    def close(self) -> None:
        self.closed = True
        if self.fail is not None:
            raise RuntimeError("close failed too")


def scrape(fleet: FleetCollector) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(fleet)
    return registry


def test_families_of_several_collectors_are_merged_once() -> None:
    fleet = FleetCollector([Emits("nvidia", "0"), Emits("amd", "1")])
    registry = scrape(fleet)
    text = generate_latest(registry).decode()
    assert text.count("# TYPE gpufleet_gpu_up gauge") == 1
    assert registry.get_sample_value("gpufleet_gpu_up", {"gpu": "0"}) == 1.0
    assert registry.get_sample_value("gpufleet_gpu_up", {"gpu": "1"}) == 1.0


def test_a_failing_collector_keeps_what_it_yielded_and_is_marked() -> None:
    fleet = FleetCollector(
        [
            Emits("nvidia", "0", CollectorError("NVML hung")),
            Emits("amd", "1", ValueError("a bug")),
            Emits("hwmon", "2"),
        ]
    )
    registry = scrape(fleet)
    for gpu in ("0", "1", "2"):
        assert registry.get_sample_value("gpufleet_gpu_up", {"gpu": gpu}) == 1.0
    success = "gpufleet_exporter_collector_success"
    assert registry.get_sample_value(success, {"collector": "nvidia"}) == 0.0
    assert registry.get_sample_value(success, {"collector": "amd"}) == 0.0
    assert registry.get_sample_value(success, {"collector": "hwmon"}) == 1.0
    duration = registry.get_sample_value(
        "gpufleet_exporter_collector_duration_seconds", {"collector": "hwmon"}
    )
    assert duration is not None and duration >= 0.0


def test_build_info_and_durations_from_the_injected_clock() -> None:
    ticks = itertools.cycle([10.0, 10.5])  # each scrape reads the clock before and after
    fleet = FleetCollector([Emits("amd", "0")], clock=lambda: next(ticks))
    registry = scrape(fleet)
    assert (
        registry.get_sample_value(
            "gpufleet_exporter_collector_duration_seconds", {"collector": "amd"}
        )
        == 0.5
    )
    text = generate_latest(registry).decode()
    assert 'gpufleet_exporter_build_info{nvml="nvidia-ml-py",python_version="' in text


def test_close_reaches_every_collector_even_when_one_fails() -> None:
    first, second = Emits("a", "0", CollectorError("x")), Emits("b", "1")
    FleetCollector([first, second]).close()
    assert first.closed and second.closed


def test_pci_bus_ids_are_normalised() -> None:
    assert normalize_pci_bus_id("00000000:41:00.0") == "0000:41:00.0"
    assert normalize_pci_bus_id("0000:C5:00.0") == "0000:c5:00.0"
    assert normalize_pci_bus_id("41:00.0") == "0000:41:00.0"
    for bad in ("", "41", "zz:00.0", "0000:41:00"):
        with pytest.raises(ValueError, match="not a PCI bus id"):
            normalize_pci_bus_id(bad)


def test_gpu_indices_follow_pci_order_across_vendors_and_stay_fixed() -> None:
    index = GpuIndex()
    # NVIDIA at 0x41 and 0x81, an AMD iGPU at 0xc5, one NVIDIA card at 0x01.
    index.register(["00000000:81:00.0", "0000:c5:00.0", "00000000:41:00.0", "0000:01:00.0"])
    assert index.known() == {
        "0000:01:00.0": 0,
        "0000:41:00.0": 1,
        "0000:81:00.0": 2,
        "0000:c5:00.0": 3,
    }
    # A card seen later gets the next index and shifts nobody.
    assert index.index_of("0000:02:00.0") == 4
    index.register(["0000:00:01.0", "0000:41:00.0"])
    assert index.index_of("0000:00:01.0") == 5
    assert index.index_of("00000000:41:00.0") == 1


def test_build_info_says_when_the_nvml_backend_is_a_fake(tmp_path: Path) -> None:
    """A demo or test host on the fake backend must never pass for a real GPU host."""
    fake = Path(__file__).parent / "fixtures" / "nvml" / "two_gpus.yaml"
    for scenario, backend in ((fake, "fake"), (None, "nvidia-ml-py")):
        settings = ExporterSettings(sysfs=str(tmp_path), nvml_fake_scenario=scenario)
        registry, fleet = build_registry(settings)
        try:
            text = generate_latest(registry).decode()
        finally:
            fleet.close()
        assert f'nvml="{backend}"' in text
        [line] = [x for x in text.splitlines() if x.startswith("gpufleet_exporter_build_info{")]
        assert f'nvml="{backend}"' in line
