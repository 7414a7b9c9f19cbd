"""The NVIDIA collector against FakeNvml scenarios (a stand-in for a GPU; no GPU runs here)."""

from __future__ import annotations

import os
import shutil
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pynvml
import pytest
import yaml

from exporter.collectors.base import GpuCollector
from exporter.collectors.nvidia import NvidiaCollector
from exporter.sources.nvml_fake import FakeNvml
from fleet.gpu_index import GpuIndex
from tests.golden import assert_golden, exposition
from tests.scraping import scrape

FIXTURES = Path(__file__).parent / "fixtures" / "nvml"


class FakeClock:
    """The collector's clock for re-init pacing: moves only when a test says so."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def copy_fixture(name: str, tmp_path: Path) -> Path:
    path = tmp_path / name
    shutil.copy(FIXTURES / name, path)
    return path


def edit_scenario(path: Path, change: Callable[[dict[str, Any]], None]) -> None:
    """Rewrite a scenario atomically, with an mtime that surely differs from the last one."""
    before = path.stat().st_mtime_ns
    data = yaml.safe_load(path.read_text())
    change(data)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(yaml.safe_dump(data))
    os.replace(tmp, path)
    # File times come from a coarse kernel clock: two writes can share one. Step it.
    os.utime(path, ns=(before + 1_000_000_000, before + 1_000_000_000))


Make = Callable[..., NvidiaCollector]


@pytest.fixture
def make() -> Iterator[Make]:
    """Build collectors the way `exporter.registry` does; close them (and end hangs) after."""
    made: list[tuple[NvidiaCollector, Any]] = []

    def build(
        backend: Any,
        *,
        gpu_index: GpuIndex | None = None,
        expected_count: int | None = 2,
        other_bus_ids: tuple[str, ...] = (),
        **kwargs: Any,
    ) -> NvidiaCollector:
        index = gpu_index if gpu_index is not None else GpuIndex()
        collector = NvidiaCollector(
            backend, gpu_index=index, expected_count=expected_count, **kwargs
        )
        made.append((collector, backend))
        index.register([*other_bus_ids, *collector.pci_bus_ids()])
        return collector

    yield build
    for collector, backend in made:
        if isinstance(backend, FakeNvml):
            backend.release_hangs()
        collector.close()


def test_is_a_gpu_collector(make: Make) -> None:
    collector = make(FakeNvml(FIXTURES / "two_gpus.yaml"))
    assert isinstance(collector, GpuCollector)
    assert collector.name == "nvidia"
    assert collector.pci_bus_ids() == ["0000:41:00.0", "0000:c1:00.0"]


def test_two_gpus_golden(make: Make) -> None:
    collector = make(
        FakeNvml(FIXTURES / "two_gpus.yaml"), expected_compute_mode="exclusive_process"
    )
    assert_golden(exposition(collector), "nvidia_two_gpus")


def test_two_gpus_values(make: Make) -> None:
    collector = make(FakeNvml(FIXTURES / "two_gpus.yaml"))
    registry, error = scrape(collector)
    assert error is None
    value = registry.get_sample_value
    assert (
        value(
            "gpufleet_gpu_info",
            {
                "gpu": "1",
                "uuid": "GPU-7a0e9c55-1b2d-4f3a-8c6e-5d4b3a291807",
                "pci_bus_id": "0000:c1:00.0",  # NVML's 00000000:C1:00.0, in sysfs form
                "vendor": "nvidia",
                "model": "NVIDIA H200",
                "pci_id": "10de:2335",
                "card": "",
                "vbios": "96.00.AF.00.01",
            },
        )
        == 1
    )
    assert value("gpufleet_gpu_up", {"gpu": "0"}) == 1
    assert value("gpufleet_gpus_expected", {"vendor": "nvidia"}) == 2
    assert value("gpufleet_gpus_lost", {"vendor": "nvidia"}) == 0
    assert value("gpufleet_gpu_utilization_ratio", {"gpu": "0"}) == 0.87
    assert value("gpufleet_gpu_memory_used_bytes", {"gpu": "0", "pool": "reserved"}) == 564133888
    assert value("gpufleet_gpu_power_watts", {"gpu": "0"}) == 412.345
    assert value("gpufleet_gpu_power_limit_watts", {"gpu": "0", "kind": "current"}) == 650
    assert value("gpufleet_gpu_energy_joules_total", {"gpu": "1"}) == 45678901.234
    assert value("gpufleet_gpu_clock_max_hertz", {"gpu": "0", "clock": "sm"}) == 1.98e9
    assert value("gpufleet_gpu_throttle_active", {"gpu": "1", "reason": "hw_thermal_slowdown"}) == 1
    assert value("gpufleet_gpu_throttle_active", {"gpu": "1", "reason": "sw_power_cap"}) == 0
    # No compute_mode_expected without a roster expectation.
    assert value("gpufleet_gpu_compute_mode_expected", {"gpu": "0", "mode": "default"}) is None
    # Values that never change are cached, and still exported on every scrape.
    again, _ = scrape(collector)
    labels = {"gpu": "0", "clock": "sm"}
    assert again.get_sample_value("gpufleet_gpu_clock_max_hertz", labels) == 1.98e9


def test_unsupported_fields_are_absent_not_zero(make: Make) -> None:
    collector = make(FakeNvml(FIXTURES / "not_supported.yaml"), expected_count=1)
    text = exposition(collector)
    assert_golden(text, "nvidia_not_supported")
    registry, error = scrape(collector)
    assert error is None
    value = registry.get_sample_value
    assert value("gpufleet_gpu_up", {"gpu": "0"}) == 1
    assert value("gpufleet_gpu_utilization_ratio", {"gpu": "0"}) == 0.5
    assert value("gpufleet_gpu_temperature_celsius", {"gpu": "0", "sensor": "gpu"}) == 60
    for name, labels in [
        ("gpufleet_gpu_fan_speed_ratio", {"gpu": "0"}),
        ("gpufleet_gpu_temperature_celsius", {"gpu": "0", "sensor": "memory"}),
        ("gpufleet_gpu_temperature_critical_celsius", {"gpu": "0", "sensor": "memory"}),
        ("gpufleet_gpu_retired_pages", {"gpu": "0", "cause": "single_bit_ecc"}),
        ("gpufleet_gpu_retired_pages_pending", {"gpu": "0"}),
        ("gpufleet_gpu_energy_joules_total", {"gpu": "0"}),
        ("gpufleet_gpu_pcie_replay_errors_total", {"gpu": "0"}),
        ("gpufleet_gpu_power_limit_watts", {"gpu": "0", "kind": "default"}),
        # Xid registration NOT_SUPPORTED: skipped for the device, no series, nothing else lost.
        ("gpufleet_gpu_xid_errors_total", {"gpu": "0", "xid": "43"}),
    ]:
        assert value(name, labels) is None, name
    assert "gpufleet_gpu_fan_speed_ratio" not in text
    assert value("gpufleet_gpu_power_limit_watts", {"gpu": "0", "kind": "max"}) == 300


def test_gpu_lost_mid_scrape(make: Make) -> None:
    clock = FakeClock()
    collector = make(FakeNvml(FIXTURES / "gpu_lost.yaml"), clock=clock)
    registry, error = scrape(collector)
    assert error is None  # a lost GPU is reported by its series, not as a collector failure
    value = registry.get_sample_value
    assert value("gpufleet_gpu_up", {"gpu": "1"}) == 0
    info = {
        "gpu": "1",
        "uuid": "GPU-66666666-7777-8888-9999-000000000000",
        "pci_bus_id": "0000:c1:00.0",
        "vendor": "nvidia",
        "model": "NVIDIA H200",
        "pci_id": "10de:2335",
        "card": "",
        "vbios": "96.00.AF.00.01",
    }
    assert value("gpufleet_gpu_info", info) == 1
    # What it answered before it fell off the bus in this scrape is not exported either.
    assert value("gpufleet_gpu_utilization_ratio", {"gpu": "1"}) is None
    assert value("gpufleet_gpus_lost", {"vendor": "nvidia"}) == 1
    # The other GPU is complete.
    assert value("gpufleet_gpu_up", {"gpu": "0"}) == 1
    assert value("gpufleet_gpu_utilization_ratio", {"gpu": "0"}) == 0.7
    assert value("gpufleet_gpu_temperature_celsius", {"gpu": "0", "sensor": "gpu"}) == 50
    assert value("gpufleet_gpu_power_watts", {"gpu": "0"}) == 300
    assert value("gpufleet_gpu_compute_mode", {"gpu": "0", "mode": "default"}) == 1

    # Within the re-init interval: still down, nothing else changes.
    registry, _ = scrape(collector)
    assert registry.get_sample_value("gpufleet_gpu_up", {"gpu": "1"}) == 0
    # After it: NVML is re-initialised, the lost GPU is gone from NVML's count, and keeps its
    # `gpu` index and info series.
    clock.now += 31
    registry, error = scrape(collector)
    assert error is None
    assert registry.get_sample_value("gpufleet_gpu_up", {"gpu": "1"}) == 0
    assert registry.get_sample_value("gpufleet_gpu_info", info) == 1
    assert registry.get_sample_value("gpufleet_gpu_power_watts", {"gpu": "0"}) == 300
    assert collector.pci_bus_ids() == ["0000:41:00.0", "0000:c1:00.0"]


def test_hung_call_does_not_hang_the_scrape(make: Make) -> None:
    fake = FakeNvml(FIXTURES / "hang.yaml")
    collector = make(fake, timeout_seconds=0.3)

    start = time.monotonic()
    registry, error = scrape(collector)
    assert time.monotonic() - start < 0.3 + 0.5
    assert error is not None
    assert "nvmlDeviceGetPowerUsage on GPU 0000:c1:00.0" in str(error)
    assert "did not return within 0.3 s" in str(error)
    value = registry.get_sample_value
    # Read before the deadline: exported normally. In progress: not read, so neither up nor
    # down (unknown is absent), and the read-timeout signal names it.
    assert value("gpufleet_gpu_up", {"gpu": "0"}) == 1
    assert value("gpufleet_gpu_read_timeout", {"gpu": "0"}) == 0
    assert value("gpufleet_gpu_power_watts", {"gpu": "0"}) == 250
    assert value("gpufleet_gpu_up", {"gpu": "1"}) is None
    assert value("gpufleet_gpu_read_timeout", {"gpu": "1"}) == 1
    assert value("gpufleet_gpu_utilization_ratio", {"gpu": "1"}) is None
    assert value("gpufleet_gpus_lost", {"vendor": "nvidia"}) == 0

    # Still stuck: answer at once, no work queued behind the stuck call. The GPU the call is
    # stuck in timed out; the other was not read: no GPU is called lost for it.
    start = time.monotonic()
    registry, error = scrape(collector)
    assert time.monotonic() - start < 0.1
    assert error is not None and "still stuck in nvmlDeviceGetPowerUsage" in str(error)
    value = registry.get_sample_value
    assert value("gpufleet_gpu_up", {"gpu": "0"}) is None
    assert value("gpufleet_gpu_up", {"gpu": "1"}) is None
    assert value("gpufleet_gpu_read_timeout", {"gpu": "0"}) is None
    assert value("gpufleet_gpu_read_timeout", {"gpu": "1"}) == 1
    assert value("gpufleet_gpus_lost", {"vendor": "nvidia"}) == 0
    assert value("gpufleet_gpu_info", {**INFO_HANG, "gpu": "1"}) == 1

    # The call returns (the fake's hang ends): the next scrape works normally.
    fake.release_hangs()
    deadline = time.monotonic() + 2
    while error is not None and time.monotonic() < deadline:
        registry, error = scrape(collector)
    assert error is None
    assert registry.get_sample_value("gpufleet_gpu_up", {"gpu": "1"}) == 1
    assert registry.get_sample_value("gpufleet_gpu_read_timeout", {"gpu": "1"}) == 0
    assert registry.get_sample_value("gpufleet_gpu_power_watts", {"gpu": "1"}) == 260


INFO_HANG = {
    "uuid": "GPU-aaaaaaaa-0000-0000-0000-000000000002",
    "pci_bus_id": "0000:c1:00.0",
    "vendor": "nvidia",
    "model": "NVIDIA H200",
    "pci_id": "10de:2335",
    "card": "",
    "vbios": "",
}


def test_a_hung_gpu_does_not_starve_the_others(make: Make, tmp_path: Path) -> None:
    """The first GPU in bus order hangs on every read: the second is read all the same."""
    scenario = copy_fixture("hang.yaml", tmp_path)

    def first_gpu_hangs(data: dict[str, Any]) -> None:
        del data["gpus"][1]["hang"]
        data["gpus"][0]["hang"] = {"call": "nvmlDeviceGetPowerUsage", "seconds": 0.4, "times": 5}

    edit_scenario(scenario, first_gpu_hangs)
    collector = make(FakeNvml(scenario), timeout_seconds=0.15)
    registry, error = scrape(collector)
    assert error is not None
    # GPU 0 is read first and hangs; GPU 1 is never reached in this scrape.
    assert registry.get_sample_value("gpufleet_gpu_read_timeout", {"gpu": "0"}) == 1
    assert registry.get_sample_value("gpufleet_gpu_read_timeout", {"gpu": "1"}) is None
    assert registry.get_sample_value("gpufleet_gpu_up", {"gpu": "1"}) is None
    for _ in range(3):
        registry, error = scrape(collector)
        deadline = time.monotonic() + 3
        while "still stuck" in str(error) and time.monotonic() < deadline:
            time.sleep(0.05)  # the last scrape's hung call has not returned yet
            registry, error = scrape(collector)
        assert error is not None and "did not return" in str(error)
        # The GPU that hung is read last: GPU 1 is read first, and GPU 0 hangs again.
        assert registry.get_sample_value("gpufleet_gpu_up", {"gpu": "1"}) == 1
        assert registry.get_sample_value("gpufleet_gpu_read_timeout", {"gpu": "1"}) == 0
        assert registry.get_sample_value("gpufleet_gpu_power_watts", {"gpu": "1"}) == 260
        assert registry.get_sample_value("gpufleet_gpu_read_timeout", {"gpu": "0"}) == 1
        assert registry.get_sample_value("gpufleet_gpu_up", {"gpu": "0"}) is None


def test_library_missing_with_gpus_expected(make: Make) -> None:
    collector = make(FakeNvml(FIXTURES / "library_missing.yaml"), expected_count=2)
    assert collector.pci_bus_ids() == []
    registry, error = scrape(collector)
    assert error is not None
    assert "NVML Shared Library Not Found" in str(error)
    assert "expects 2 NVIDIA GPUs" in str(error)
    assert registry.get_sample_value("gpufleet_gpus_expected", {"vendor": "nvidia"}) == 2
    assert registry.get_sample_value("gpufleet_gpus_lost", {"vendor": "nvidia"}) == 2


@pytest.mark.parametrize("expected_count", [None, 0])
def test_library_missing_without_gpus_expected_is_silent(
    make: Make, expected_count: int | None
) -> None:
    collector = make(FakeNvml(FIXTURES / "library_missing.yaml"), expected_count=expected_count)
    families = list(collector.collect())  # no CollectorError
    assert not any(f.name.startswith("gpufleet_gpu_") for f in families)
    if expected_count is None:
        assert families == []
    else:  # the roster's expectation is still stated: none expected, none lost
        registry, _ = scrape(collector)
        assert registry.get_sample_value("gpufleet_gpus_expected", {"vendor": "nvidia"}) == 0
        assert registry.get_sample_value("gpufleet_gpus_lost", {"vendor": "nvidia"}) == 0


def test_nvml_init_is_retried_after_the_interval(make: Make, tmp_path: Path) -> None:
    scenario = copy_fixture("two_gpus.yaml", tmp_path)
    edit_scenario(scenario, lambda data: data.update(library_missing=True))
    clock = FakeClock()
    collector = make(FakeNvml(scenario), clock=clock, reinit_interval_seconds=30)
    edit_scenario(scenario, lambda data: data.update(library_missing=False))
    _, error = scrape(collector)
    assert error is not None  # not retried before the interval has passed
    clock.now += 30
    registry, error = scrape(collector)
    assert error is None
    assert registry.get_sample_value("gpufleet_gpu_up", {"gpu": "1"}) == 1
    assert collector.pci_bus_ids() == ["0000:41:00.0", "0000:c1:00.0"]


def test_reinit_keeps_gpu_index_by_pci_bus_id(make: Make, tmp_path: Path) -> None:
    scenario = copy_fixture("reinit_renumber.yaml", tmp_path)
    fake = FakeNvml(scenario)
    clock = FakeClock()
    collector = make(fake, expected_count=3, clock=clock)
    temps = {"0": 41.0, "1": 42.0, "2": 43.0}  # 0a, 41, c1 in PCI bus order
    registry, _ = scrape(collector)
    for gpu, temp in temps.items():
        labels = {"gpu": gpu, "sensor": "gpu"}
        assert registry.get_sample_value("gpufleet_gpu_temperature_celsius", labels) == temp

    def lose_0a(data: dict[str, Any]) -> None:
        data["gpus"][1]["lost_after_calls"] = 0

    edit_scenario(scenario, lose_0a)
    registry, _ = scrape(collector)
    assert registry.get_sample_value("gpufleet_gpu_up", {"gpu": "0"}) == 0

    clock.now += 31
    registry, error = scrape(collector)
    assert error is None
    # NVML renumbered: two devices, 0000:41:00.0 moved from NVML index 2 to 1.
    assert fake.nvmlDeviceGetCount() == 2
    moved = fake.nvmlDeviceGetPciInfo(fake.nvmlDeviceGetHandleByIndex(1))
    assert moved.busId == "00000000:41:00.0"
    # The `gpu` label did not move with it.
    value = registry.get_sample_value
    assert value("gpufleet_gpu_up", {"gpu": "0"}) == 0
    assert value("gpufleet_gpu_up", {"gpu": "1"}) == 1
    assert value("gpufleet_gpu_temperature_celsius", {"gpu": "1", "sensor": "gpu"}) == 42
    assert value("gpufleet_gpu_temperature_celsius", {"gpu": "2", "sensor": "gpu"}) == 43
    assert value("gpufleet_gpus_lost", {"vendor": "nvidia"}) == 1
    info_41 = {
        "gpu": "1",
        "uuid": "GPU-cccccccc-0000-0000-0000-000000000041",
        "pci_bus_id": "0000:41:00.0",
        "vendor": "nvidia",
        "model": "NVIDIA H100 80GB HBM3",
        "pci_id": "10de:2330",
        "card": "",
        "vbios": "",  # not in the scenario: not supported
    }
    assert value("gpufleet_gpu_info", info_41) == 1
    assert (
        value(
            "gpufleet_gpu_info",
            {
                **info_41,
                "gpu": "0",
                "pci_bus_id": "0000:0a:00.0",
                "uuid": "GPU-cccccccc-0000-0000-0000-00000000000a",
            },
        )
        == 1
    )


def test_compute_mode_drift_is_visible(make: Make) -> None:
    collector = make(FakeNvml(FIXTURES / "two_gpus.yaml"), expected_compute_mode="default")
    registry, _ = scrape(collector)
    value = registry.get_sample_value
    for gpu in ("0", "1"):
        assert value("gpufleet_gpu_compute_mode", {"gpu": gpu, "mode": "exclusive_process"}) == 1
        assert value("gpufleet_gpu_compute_mode", {"gpu": gpu, "mode": "default"}) == 0
        assert value("gpufleet_gpu_compute_mode_expected", {"gpu": gpu, "mode": "default"}) == 1
        labels = {"gpu": gpu, "mode": "exclusive_process"}
        assert value("gpufleet_gpu_compute_mode_expected", labels) == 0


def test_unknown_expected_compute_mode_is_refused() -> None:
    with pytest.raises(ValueError, match="expected_compute_mode"):
        NvidiaCollector(
            FakeNvml(FIXTURES / "two_gpus.yaml"),
            gpu_index=GpuIndex(),
            expected_count=None,
            expected_compute_mode="shared",
        )


def test_xid_counter_per_code(make: Make, tmp_path: Path) -> None:
    scenario = copy_fixture("two_gpus.yaml", tmp_path)
    collector = make(FakeNvml(scenario))
    registry, _ = scrape(collector)
    value = registry.get_sample_value
    assert value("gpufleet_gpu_xid_errors_total", {"gpu": "0", "xid": "13"}) == 2
    assert value("gpufleet_gpu_xid_errors_total", {"gpu": "1", "xid": "31"}) == 1
    assert value("gpufleet_gpu_xid_errors_total", {"gpu": "1", "xid": "79"}) is None

    edit_scenario(scenario, lambda data: data["gpus"][1]["xid_events"].append(79))
    registry, _ = scrape(collector)
    value = registry.get_sample_value
    assert value("gpufleet_gpu_xid_errors_total", {"gpu": "1", "xid": "79"}) == 1
    assert value("gpufleet_gpu_xid_errors_total", {"gpu": "1", "xid": "31"}) == 1
    assert value("gpufleet_gpu_xid_errors_total", {"gpu": "0", "xid": "13"}) == 2


def test_scenario_change_shows_on_next_scrape(make: Make, tmp_path: Path) -> None:
    scenario = copy_fixture("two_gpus.yaml", tmp_path)
    collector = make(FakeNvml(scenario))
    registry, _ = scrape(collector)
    labels = {"gpu": "0", "sensor": "gpu"}
    assert registry.get_sample_value("gpufleet_gpu_temperature_celsius", labels) == 54

    def heat_up(data: dict[str, Any]) -> None:
        data["gpus"][0]["temperature_celsius"] = 83
        data["gpus"][0]["clocks_event_reasons"] = ["sw_thermal_slowdown"]

    edit_scenario(scenario, heat_up)
    registry, _ = scrape(collector)
    assert registry.get_sample_value("gpufleet_gpu_temperature_celsius", labels) == 83
    reason = {"gpu": "0", "reason": "sw_thermal_slowdown"}
    assert registry.get_sample_value("gpufleet_gpu_throttle_active", reason) == 1


def test_gpu_index_is_shared_with_other_vendors(make: Make) -> None:
    # An AMD iGPU at a lower PCI bus id takes index 0; NVIDIA's cards follow it.
    collector = make(FakeNvml(FIXTURES / "two_gpus.yaml"), other_bus_ids=("0000:03:00.0",))
    registry, _ = scrape(collector)
    value = registry.get_sample_value
    assert value("gpufleet_gpu_up", {"gpu": "0"}) is None
    assert value("gpufleet_gpu_up", {"gpu": "1"}) == 1
    assert value("gpufleet_gpu_up", {"gpu": "2"}) == 1
    assert value("gpufleet_gpu_utilization_ratio", {"gpu": "1"}) == 0.87  # 0000:41:00.0


def test_close_shuts_nvml_down(make: Make) -> None:
    fake = FakeNvml(FIXTURES / "two_gpus.yaml")
    collector = make(fake)
    assert fake.nvmlDeviceGetCount() == 2
    collector.close()
    with pytest.raises(pynvml.NVMLError_Uninitialized):
        fake.nvmlDeviceGetCount()
    assert list(collector.collect()) == []


def test_demo_scenario_two_h200(make: Make) -> None:
    demo = Path(__file__).parent.parent / "examples" / "nvml-fake" / "two-h200.yaml"
    collector = make(FakeNvml(demo), expected_compute_mode="exclusive_process")
    registry, error = scrape(collector)
    assert error is None
    value = registry.get_sample_value
    assert value("gpufleet_gpus_lost", {"vendor": "nvidia"}) == 0
    for gpu in ("0", "1"):
        assert value("gpufleet_gpu_compute_mode", {"gpu": gpu, "mode": "exclusive_process"}) == 1
        labels = {"gpu": gpu, "mode": "exclusive_process"}
        assert value("gpufleet_gpu_compute_mode_expected", labels) == 1
        # An H200 has no fan and no page retirement: absent, not 0.
        assert value("gpufleet_gpu_fan_speed_ratio", {"gpu": gpu}) is None
        assert value("gpufleet_gpu_retired_pages", {"gpu": gpu, "cause": "double_bit_ecc"}) is None


class CountingNvml(FakeNvml):
    """The fake, counting the calls whose answers never change; optionally a pre-510 driver.

    A driver older than 510 has no `nvmlDeviceGetMemoryInfo_v2`: pynvml raises
    FUNCTION_NOT_FOUND for the v2 call, and only v1 answers.
    """

    def __init__(self, scenario: Path, *, memory_v2: bool = True) -> None:
        super().__init__(scenario)
        self.counts: Counter[str] = Counter()
        self._memory_v2 = memory_v2

    def nvmlDeviceGetName(self, handle: object) -> str:
        self.counts["nvmlDeviceGetName"] += 1
        return super().nvmlDeviceGetName(handle)

    def nvmlDeviceGetMaxClockInfo(self, handle: object, type: int) -> int:
        self.counts["nvmlDeviceGetMaxClockInfo"] += 1
        return super().nvmlDeviceGetMaxClockInfo(handle, type)

    def nvmlDeviceGetTemperatureThreshold(self, handle: object, threshold: int) -> int:
        self.counts["nvmlDeviceGetTemperatureThreshold"] += 1
        return super().nvmlDeviceGetTemperatureThreshold(handle, threshold)

    def nvmlDeviceGetPowerManagementDefaultLimit(self, handle: object) -> int:
        self.counts["nvmlDeviceGetPowerManagementDefaultLimit"] += 1
        return super().nvmlDeviceGetPowerManagementDefaultLimit(handle)

    def nvmlDeviceGetPowerManagementLimitConstraints(self, handle: object) -> Sequence[int]:
        self.counts["nvmlDeviceGetPowerManagementLimitConstraints"] += 1
        return super().nvmlDeviceGetPowerManagementLimitConstraints(handle)

    def nvmlDeviceGetMemoryInfo(self, handle: object, version: int | None = None) -> Any:
        self.counts["memory v2" if version else "memory v1"] += 1
        if version and not self._memory_v2:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)
        return super().nvmlDeviceGetMemoryInfo(handle, version)


def test_what_never_changes_is_read_once_and_kept(make: Make) -> None:
    fake = CountingNvml(FIXTURES / "two_gpus.yaml")
    collector = make(fake)
    first, _ = scrape(collector)
    after_first = Counter(fake.counts)
    for _ in range(3):
        registry, error = scrape(collector)
        assert error is None
    # Per GPU: the identity (3 calls, at enumeration), 3 temperature thresholds, 3 max clocks,
    # the default power limit and the constraints, once each over four scrapes.
    assert fake.counts["nvmlDeviceGetName"] == 2
    for call in (
        "nvmlDeviceGetMaxClockInfo",
        "nvmlDeviceGetTemperatureThreshold",
        "nvmlDeviceGetPowerManagementDefaultLimit",
        "nvmlDeviceGetPowerManagementLimitConstraints",
    ):
        assert fake.counts[call] == after_first[call] > 0, call
    assert fake.counts["memory v2"] == 4 * 2 and fake.counts["memory v1"] == 0
    # ... and what was kept is exported every scrape, as it was read.
    for registry_ in (first, registry):
        value = registry_.get_sample_value
        assert value("gpufleet_gpu_clock_max_hertz", {"gpu": "0", "clock": "sm"}) == 1980e6
        assert value("gpufleet_gpu_power_limit_watts", {"gpu": "1", "kind": "min"}) == 200
        assert value("gpufleet_gpu_power_limit_watts", {"gpu": "1", "kind": "max"}) == 700
        labels = {"gpu": "0", "sensor": "memory"}
        assert value("gpufleet_gpu_temperature_critical_celsius", labels) == 95
        info = {"gpu": "1", "model": "NVIDIA H200", "pci_bus_id": "0000:c1:00.0"}
        assert any(
            s.value == 1 and info.items() <= s.labels.items()
            for f in registry_.collect()
            if f.name == "gpufleet_gpu_info"
            for s in f.samples
        )


def test_a_driver_without_memory_info_v2_is_asked_v1_from_then_on(make: Make) -> None:
    fake = CountingNvml(FIXTURES / "two_gpus.yaml", memory_v2=False)
    collector = make(fake)
    for _ in range(3):
        registry, _ = scrape(collector)
    # v2 is tried once per GPU; once v1 has answered, only v1 is asked.
    assert fake.counts["memory v2"] == 2 and fake.counts["memory v1"] == 3 * 2
    value = registry.get_sample_value
    assert value("gpufleet_gpu_up", {"gpu": "0"}) == 1
    # v1's `used` includes the reservation: no split, so no `reserved` series.
    used = value("gpufleet_gpu_memory_used_bytes", {"gpu": "0", "pool": "vram"})
    assert used == 123480309760 + 564133888
    assert value("gpufleet_gpu_memory_used_bytes", {"gpu": "0", "pool": "reserved"}) is None
