"""The amd collector against fixture sysfs trees written in the kernel's layout."""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import replace
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from exporter.collectors.amd import AmdCollector
from exporter.collectors.base import GpuCollector
from exporter.sources import amdgpu
from exporter.sources.amdgpu import (
    discover_cards,
    is_card_name,
    parse_dpm_max_hz,
    parse_uevent,
    udev_cards,
    walk_cards,
)
from fleet.gpu_index import GpuIndex
from tests.golden import assert_golden, exposition
from tests.scraping import scrape as scrape_once
from tests.sysfs_tree import (
    AmdCardSpec,
    PowerFiles,
    WrittenCard,
    apu_spec,
    discrete_spec,
    fleet_specs,
    remove_device,
    set_value,
    unbind_driver,
    write_amd_card,
    write_amd_fleet,
    write_other_drm_card,
)


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def collector(
    root: Path,
    *,
    gpu_index: GpuIndex | None = None,
    expected_count: int | None = None,
    clock: FakeClock | None = None,
) -> AmdCollector:
    return AmdCollector(
        str(root),
        gpu_index=gpu_index or GpuIndex(),
        expected_count=expected_count,
        clock=clock or FakeClock(),
    )


def scrape(*collectors: AmdCollector) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    for c in collectors:
        registry.register(c)
    return registry


def samples(amd: AmdCollector) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in amd.collect()
        for s in family.samples
    }


def test_discrete_card_golden(tmp_path: Path) -> None:
    write_amd_card(tmp_path, discrete_spec(card=0))
    amd = collector(tmp_path, expected_count=1)
    assert amd.pci_bus_ids() == ["0000:03:00.0"]
    assert isinstance(amd, GpuCollector)
    assert_golden(exposition(amd), "amd_discrete")


def test_apu_golden_shares_the_index_with_nvidia(tmp_path: Path) -> None:
    write_amd_card(tmp_path, apu_spec(card=1, pci_slot="0000:c5:00.0"))
    index = GpuIndex()
    amd = collector(tmp_path, gpu_index=index)
    # The registry registers every vendor's bus ids: NVIDIA's 41 sorts before the iGPU's c5.
    index.register(["00000000:41:00.0", *amd.pci_bus_ids()])
    assert_golden(exposition(amd), "amd_apu")
    registry = scrape(amd)
    assert registry.get_sample_value("gpufleet_gpu_up", {"gpu": "1"}) == 1
    assert registry.get_sample_value("gpufleet_gpu_up", {"gpu": "0"}) is None  # NVIDIA's


def test_cards_above_nine_found_and_others_ignored(tmp_path: Path) -> None:
    write_amd_fleet(tmp_path, [0, 1, 10, 11])
    write_other_drm_card(tmp_path, 2, "0000:81:00.0", "nvidia")
    write_other_drm_card(tmp_path, 3, "0000:00:02.0", "i915")
    amd = collector(tmp_path)
    slots = [spec.pci_slot for spec in fleet_specs([0, 1, 10, 11])]
    assert amd.pci_bus_ids() == slots
    registry = scrape(amd)
    for gpu, (card, slot) in enumerate(
        zip(["card0", "card1", "card10", "card11"], slots, strict=True)
    ):
        labels = {
            "gpu": str(gpu),
            "uuid": f"5c0b2a1f6e8d4a{gpu:02x}",
            "pci_bus_id": slot,
            "vendor": "amd",
            "model": "",
            "pci_id": "1002:744c",
            "card": card,
            "vbios": "113-D7020100-102",
        }
        assert registry.get_sample_value("gpufleet_gpu_info", labels) == 1
        assert (
            registry.get_sample_value(
                "gpufleet_gpu_temperature_celsius", {"gpu": str(gpu), "sensor": "junction"}
            )
            == 71
        )
    # Connectors and render nodes are in class/drm but are not cards.
    drm = sorted(os.listdir(tmp_path / "class" / "drm"))
    assert "card0-DP-1" in drm and "renderD128" in drm
    assert [c.card for c in walk_cards(str(tmp_path))] == ["card0", "card1", "card10", "card11"]


def test_driver_named_only_by_uevent(tmp_path: Path) -> None:
    write_amd_card(tmp_path, replace(discrete_spec(card=0), driver_link=False))
    assert not (tmp_path / "class/drm/card0/device/driver").exists()
    assert collector(tmp_path).pci_bus_ids() == ["0000:03:00.0"]


def test_no_drm_at_all(tmp_path: Path) -> None:
    amd = collector(tmp_path, expected_count=2)
    registry = scrape(amd)
    assert amd.pci_bus_ids() == []
    assert registry.get_sample_value("gpufleet_gpus_lost", {"vendor": "amd"}) == 2
    assert registry.get_sample_value("gpufleet_gpus_expected", {"vendor": "amd"}) == 2


# (where, file, the one sample that must disappear)
DROPS = [
    ("device", "gpu_busy_percent", ("gpufleet_gpu_utilization_ratio", {})),
    ("device", "mem_busy_percent", ("gpufleet_gpu_memory_utilization_ratio", {})),
    ("device", "mem_info_vram_used", ("gpufleet_gpu_memory_used_bytes", {"pool": "vram"})),
    ("device", "mem_info_gtt_total", ("gpufleet_gpu_memory_total_bytes", {"pool": "gtt"})),
    ("device", "pp_dpm_sclk", ("gpufleet_gpu_clock_max_hertz", {"clock": "graphics"})),
    ("hwmon", "temp2_input", ("gpufleet_gpu_temperature_celsius", {"sensor": "junction"})),
    ("hwmon", "temp3_crit", ("gpufleet_gpu_temperature_critical_celsius", {"sensor": "mem"})),
    (
        "hwmon",
        "temp1_emergency",
        ("gpufleet_gpu_temperature_emergency_celsius", {"sensor": "edge"}),
    ),
    ("hwmon", "power1_cap", ("gpufleet_gpu_power_limit_watts", {"kind": "current"})),
    ("hwmon", "power1_cap_max", ("gpufleet_gpu_power_limit_watts", {"kind": "max"})),
    ("hwmon", "fan1_input", ("gpufleet_gpu_fan_speed_rpm", {})),
    ("hwmon", "freq2_input", ("gpufleet_gpu_clock_hertz", {"clock": "memory"})),
]


def spoil(path: Path, how: str) -> None:
    if how == "missing":
        path.unlink()
    elif how == "empty":
        path.write_text("")
    else:
        path.write_bytes(b"\xff garbage \x00\n")


def file_of(card: WrittenCard, where: str, name: str) -> Path:
    return card.file(name) if where == "device" else card.hwmon_file(name)


@pytest.mark.parametrize("how", ["missing", "empty", "garbled"])
@pytest.mark.parametrize(("where", "name", "dropped"), DROPS, ids=[d[1] for d in DROPS])
def test_a_bad_file_drops_exactly_its_field(
    tmp_path: Path,
    how: str,
    where: str,
    name: str,
    dropped: tuple[str, dict[str, str]],
) -> None:
    write_amd_card(tmp_path / "good", discrete_spec(card=0))
    bad = write_amd_card(tmp_path / "bad", discrete_spec(card=0))
    spoil(file_of(bad, where, name), how)
    expected = samples(collector(tmp_path / "good"))
    family, labels = dropped
    key = (family, tuple(sorted({"gpu": "0", **labels}.items())))
    assert key in expected
    del expected[key]
    assert samples(collector(tmp_path / "bad")) == expected


@pytest.mark.parametrize("how", ["missing", "empty", "garbled"])
def test_power_input_falls_back_to_average(tmp_path: Path, how: str) -> None:
    card = write_amd_card(tmp_path, discrete_spec(card=0))
    amd = collector(tmp_path)
    assert scrape(amd).get_sample_value("gpufleet_gpu_power_watts", {"gpu": "0"}) == 215
    if how == "missing":
        # Absent at discovery: a fresh collector reads power1_average only.
        spoil(card.hwmon_file("power1_input"), how)
        amd = collector(tmp_path)
    else:
        spoil(card.hwmon_file("power1_input"), how)  # fails on the next scrape
    assert scrape(amd).get_sample_value("gpufleet_gpu_power_watts", {"gpu": "0"}) == 212
    spoil(card.hwmon_file("power1_average"), "garbled")
    assert scrape(amd).get_sample_value("gpufleet_gpu_power_watts", {"gpu": "0"}) is None


def test_power_average_only_and_energy(tmp_path: Path) -> None:
    spec = replace(discrete_spec(card=0), power=PowerFiles.AVERAGE, energy=123_456_789_000)
    write_amd_card(tmp_path, spec)
    registry = scrape(collector(tmp_path))
    assert registry.get_sample_value("gpufleet_gpu_power_watts", {"gpu": "0"}) == 212
    assert registry.get_sample_value("gpufleet_gpu_energy_joules_total", {"gpu": "0"}) == (
        123_456.789
    )


def test_identity_files_missing_or_garbled(tmp_path: Path) -> None:
    spec = replace(discrete_spec(card=0), unique_id=None, product_name="AMD Instinct MI210")
    card = write_amd_card(tmp_path, spec)
    spoil(card.file("vbios_version"), "garbled")
    spoil(card.file("vendor"), "garbled")  # pci_id falls back to uevent's PCI_ID
    labels = {
        "gpu": "0",
        "uuid": "",
        "pci_bus_id": "0000:03:00.0",
        "vendor": "amd",
        "model": "AMD Instinct MI210",
        "pci_id": "1002:744c",
        "card": "card0",
        "vbios": "",
    }
    amd = collector(tmp_path)
    assert scrape(amd).get_sample_value("gpufleet_gpu_info", labels) == 1
    # An unreadable identity file is retried until it reads.
    set_value(card.file("vbios_version"), "113-D7020100-102")
    assert (
        scrape(amd).get_sample_value("gpufleet_gpu_info", {**labels, "vbios": "113-D7020100-102"})
        == 1
    )


def test_empty_product_name_is_no_model(tmp_path: Path) -> None:
    write_amd_card(tmp_path, replace(discrete_spec(card=0), product_name=""))
    info = [
        s for f in collector(tmp_path).collect() for s in f.samples if s.name == "gpufleet_gpu_info"
    ]
    assert info[0].labels["model"] == ""


def test_changed_values_show_on_the_next_scrape(tmp_path: Path) -> None:
    card = write_amd_card(tmp_path, discrete_spec(card=0))
    registry = scrape(collector(tmp_path))
    junction = {"gpu": "0", "sensor": "junction"}
    assert registry.get_sample_value("gpufleet_gpu_temperature_celsius", junction) == 71
    set_value(card.hwmon_file("temp2_input"), 96_500)
    set_value(card.file("gpu_busy_percent"), 100)
    set_value(card.hwmon_file("power1_cap"), 250_000_000)
    set_value(card.file("mem_info_vram_used"), 1024)
    assert registry.get_sample_value("gpufleet_gpu_temperature_celsius", junction) == 96.5
    assert registry.get_sample_value("gpufleet_gpu_utilization_ratio", {"gpu": "0"}) == 1
    assert (
        registry.get_sample_value("gpufleet_gpu_power_limit_watts", {"gpu": "0", "kind": "current"})
        == 250
    )
    assert (
        registry.get_sample_value("gpufleet_gpu_memory_used_bytes", {"gpu": "0", "pool": "vram"})
        == 1024
    )
    set_value(card.file("gpu_busy_percent"), "garbage")
    assert registry.get_sample_value("gpufleet_gpu_utilization_ratio", {"gpu": "0"}) is None


def test_a_removed_card_is_down_and_keeps_index_and_info(tmp_path: Path) -> None:
    cards = [write_amd_card(tmp_path, spec) for spec in fleet_specs([0, 1])]
    amd = collector(tmp_path, expected_count=2)
    registry = scrape(amd)
    assert registry.get_sample_value("gpufleet_gpus_lost", {"vendor": "amd"}) == 0
    remove_device(cards[0])
    assert registry.get_sample_value("gpufleet_gpu_up", {"gpu": "0"}) == 0
    assert registry.get_sample_value("gpufleet_gpu_up", {"gpu": "1"}) == 1
    info = {
        s.labels["gpu"]: s.labels["card"]
        for f in amd.collect()
        for s in f.samples
        if s.name == "gpufleet_gpu_info"
    }
    assert info == {"0": "card0", "1": "card1"}
    assert registry.get_sample_value("gpufleet_gpu_utilization_ratio", {"gpu": "0"}) is None
    assert registry.get_sample_value("gpufleet_gpu_utilization_ratio", {"gpu": "1"}) == 0.37
    assert registry.get_sample_value("gpufleet_gpus_lost", {"vendor": "amd"}) == 1
    assert registry.get_sample_value("gpufleet_gpus_expected", {"vendor": "amd"}) == 2


STATICS = (
    "gpufleet_gpu_memory_total_bytes",
    "gpufleet_gpu_temperature_critical_celsius",
    "gpufleet_gpu_power_limit_watts",
    "gpufleet_gpu_clock_max_hertz",
)


def gpus_with(amd: AmdCollector, name: str) -> set[str]:
    return {s.labels["gpu"] for f in amd.collect() for s in f.samples if s.name == name}


def test_an_unbound_card_is_lost_and_its_statics_go(tmp_path: Path) -> None:
    cards = [write_amd_card(tmp_path, spec) for spec in fleet_specs([0, 1])]
    amd = collector(tmp_path, expected_count=2)
    registry = scrape(amd)
    for name in STATICS:
        assert gpus_with(amd, name) == {"0", "1"}, name
    unbind_driver(cards[0])
    assert cards[0].device_dir.is_dir()  # the PCI directory stays
    assert registry.get_sample_value("gpufleet_gpu_up", {"gpu": "0"}) == 0
    assert registry.get_sample_value("gpufleet_gpu_up", {"gpu": "1"}) == 1
    assert registry.get_sample_value("gpufleet_gpus_lost", {"vendor": "amd"}) == 1
    for name in STATICS:
        assert gpus_with(amd, name) == {"1"}, name
    assert gpus_with(amd, "gpufleet_gpu_info") == {"0", "1"}  # index and identity kept


def test_a_bound_card_that_answers_nothing_is_not_up(tmp_path: Path) -> None:
    cards = [write_amd_card(tmp_path, spec) for spec in fleet_specs([0, 1])]
    amd = collector(tmp_path, expected_count=2)
    registry = scrape(amd)
    assert registry.get_sample_value("gpufleet_gpu_up", {"gpu": "0"}) == 1
    # Every changing file unreadable (EIO from a card going away): garbage in each.
    changing = [p for p in cards[0].device_dir.iterdir() if p.name.endswith(("_percent", "_used"))]
    changing += [
        p for p in cards[0].hwmon_dir.iterdir() if p.name.endswith(("_input", "_average", "_cap"))
    ]
    assert len(changing) >= 4
    for path in changing:
        path.write_text("garbage\n")
    assert registry.get_sample_value("gpufleet_gpu_up", {"gpu": "0"}) == 0
    assert registry.get_sample_value("gpufleet_gpus_lost", {"vendor": "amd"}) == 1
    for name in STATICS:
        assert gpus_with(amd, name) == {"1"}, name


def test_expected_count_absent_without_roster(tmp_path: Path) -> None:
    write_amd_card(tmp_path, discrete_spec(card=0))
    registry = scrape(collector(tmp_path, expected_count=None))
    assert registry.get_sample_value("gpufleet_gpus_expected", {"vendor": "amd"}) is None
    assert registry.get_sample_value("gpufleet_gpus_lost", {"vendor": "amd"}) is None


def test_new_cards_found_at_most_every_rediscover_interval(tmp_path: Path) -> None:
    write_amd_card(tmp_path, fleet_specs([0])[0])
    clock = FakeClock()
    index = GpuIndex()
    amd = collector(tmp_path, gpu_index=index, clock=clock)
    registry = scrape(amd)
    assert registry.get_sample_value("gpufleet_gpu_up", {"gpu": "0"}) == 1
    # A card that appears later (on a lower bus) gets the next index, not its bus-order one.
    write_amd_card(tmp_path, AmdCardSpec(card=10, pci_slot="0000:01:00.0"))
    clock.now += 59
    assert registry.get_sample_value("gpufleet_gpu_up", {"gpu": "1"}) is None
    clock.now += 1
    assert registry.get_sample_value("gpufleet_gpu_up", {"gpu": "1"}) == 1
    assert index.known() == {"0000:03:00.0": 0, "0000:01:00.0": 1}
    assert amd.pci_bus_ids() == ["0000:01:00.0", "0000:03:00.0"]


def test_a_card_back_after_a_rescan_is_reopened(tmp_path: Path) -> None:
    card = write_amd_card(tmp_path, discrete_spec(card=0))
    clock = FakeClock()
    amd = collector(tmp_path, clock=clock)
    registry = scrape(amd)
    remove_device(card)
    assert registry.get_sample_value("gpufleet_gpu_up", {"gpu": "0"}) == 0
    # Back on the same slot, under another card number and hwmon directory.
    write_amd_card(tmp_path, replace(discrete_spec(card=4), hwmon=7))
    clock.now += 60
    assert registry.get_sample_value("gpufleet_gpu_up", {"gpu": "0"}) == 1
    labels = {"gpu": "0", "sensor": "edge"}
    assert registry.get_sample_value("gpufleet_gpu_temperature_celsius", labels) == 54
    cards = [
        s.labels["card"] for f in amd.collect() for s in f.samples if s.name == "gpufleet_gpu_info"
    ]
    assert cards == ["card4"]


def test_udev_on_this_machines_sys() -> None:
    pyudev = pytest.importorskip("pyudev")
    try:
        pyudev.Context()
    except ImportError as err:
        pytest.skip(f"libudev cannot load: {err}")
    found = udev_cards()
    # libudev and the walk must agree on the real /sys (this container has no amdgpu: []).
    assert [c.pci_slot for c in found] == [c.pci_slot for c in walk_cards("/sys")]
    amd = AmdCollector("/sys", gpu_index=GpuIndex(), expected_count=None, use_udev=True)
    assert amd.pci_bus_ids() == [c.pci_slot for c in found]
    list(amd.collect())
    amd.close()


def test_udev_unavailable_falls_back_to_the_walk(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    write_amd_card(tmp_path, discrete_spec(card=0))
    monkeypatch.setattr(amdgpu, "pyudev", None)
    assert [c.card for c in discover_cards(str(tmp_path), use_udev=True)] == ["card0"]


def test_parsers() -> None:
    assert parse_dpm_max_hz("0: 500Mhz\n1: 1800Mhz *\n2: 2500Mhz\n") == 2_500_000_000
    # RDNA's deep-sleep line, upper-case units, trailing garbage lines.
    assert parse_dpm_max_hz("S: 19Mhz *\n0: 500MHz\n1: 2124Mhz\nxx\n") == 2_124_000_000
    assert parse_dpm_max_hz("garbage\n0: fastMhz\n") is None
    assert [is_card_name(n) for n in ("card0", "card13", "card0-DP-1", "renderD128", "card")] == [
        True,
        True,
        False,
        False,
        False,
    ]
    assert parse_uevent("DRIVER=amdgpu\nPCI_SLOT_NAME=0000:03:00.0\nnoise\n") == {
        "DRIVER": "amdgpu",
        "PCI_SLOT_NAME": "0000:03:00.0",
    }
    assert parse_uevent(None) == {}


def test_a_stuck_card_costs_only_itself_then_reads_hung(tmp_path: Path) -> None:
    """A read blocked in the kernel (a FIFO here: open() waits for a writer) costs its card
    one deadline; the other card is read on time in every scrape. While the read stays stuck
    the card is not read again and is hung: up 0, lost. One thread per card, however long."""
    cards = [write_amd_card(tmp_path, spec) for spec in fleet_specs([0, 1])]
    busy = cards[0].file("gpu_busy_percent")
    busy.unlink()
    os.mkfifo(busy)
    amd = AmdCollector(
        str(tmp_path), gpu_index=GpuIndex(), expected_count=2, timeout_seconds=1.0,
        clock=FakeClock(),
    )  # fmt: skip
    try:
        start = time.monotonic()
        registry, error = scrape_once(amd)
        assert time.monotonic() - start < 1.0  # one card left behind after 0.5 s
        assert error is not None and "card 0000:03:00.0 did not return within 0.5 s" in str(error)
        value = registry.get_sample_value
        assert value("gpufleet_gpu_read_timeout", {"gpu": "0"}) == 1
        assert value("gpufleet_gpu_up", {"gpu": "0"}) is None  # missed once: unknown, not 0
        assert value("gpufleet_gpu_up", {"gpu": "1"}) == 1  # read on time beside it
        assert value("gpufleet_gpu_utilization_ratio", {"gpu": "1"}) == 0.37
        assert value("gpufleet_gpus_lost", {"vendor": "amd"}) == 0
        for _ in range(5):
            # Still stuck: answered at once, nothing queued behind the stuck read.
            start = time.monotonic()
            registry, error = scrape_once(amd)
            assert time.monotonic() - start < 0.15
            assert error is not None and "still stuck on card 0000:03:00.0" in str(error)
            value = registry.get_sample_value
            assert value("gpufleet_gpu_read_timeout", {"gpu": "0"}) == 1
            assert value("gpufleet_gpu_up", {"gpu": "0"}) == 0  # hung
            assert value("gpufleet_gpus_lost", {"vendor": "amd"}) == 1
            assert value("gpufleet_gpu_up", {"gpu": "1"}) == 1
            assert value("gpufleet_gpu_read_timeout", {"gpu": "1"}) == 0
            assert amd._reads.threads() <= 3  # two cards and rediscovery, never one per scrape
        # The read returns (a writer comes and goes); the next read of card 0 blocks again.
        with open(busy, "w") as writer:
            writer.write("55\n")
        deadline = time.monotonic() + 2
        while "still stuck" in str(error) and time.monotonic() < deadline:
            registry, error = scrape_once(amd)  # until the worker has finished the old read
        assert error is not None and "did not return" in str(error)
        assert registry.get_sample_value("gpufleet_gpu_up", {"gpu": "1"}) == 1
        assert registry.get_sample_value("gpufleet_gpu_read_timeout", {"gpu": "0"}) == 1
    finally:
        amd.close()
        _unblock(busy)


def _unblock(fifo: Path) -> None:
    """End a read blocked on opening `fifo`: a writer that opens and closes (EOF)."""
    with contextlib.suppress(OSError):  # ENXIO: nobody waits on it
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
