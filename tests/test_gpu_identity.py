"""GPU identity end to end: one numbering from PCI sysfs, shared by the exporter and the node.

The reproduction of issue 14: an NVIDIA card at 0000:41:00.0 and an AMD card at 0000:c1:00.0,
NVML's enumeration slower than the exporter's deadline at start. The exporter used to number
the AMD card 0 and the NVIDIA card 1 (the cards NVML had not listed yet came last), while the
node numbered them in PCI order: a power cap for the NVIDIA card's alert capped the AMD one.
Now both number from PCI sysfs (tests/sysfs_tree.py writes `bus/pci/devices` as the kernel
does), and the fake NVML stands in for the NVIDIA driver.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import yaml

from exporter.registry import ExporterSettings, build_registry
from exporter.sources.pci import number_host_gpus, pci_gpus
from fleet.gpu_index import GpuIndex
from fleet.roster import load_roster
from tests.sysfs_tree import (
    apu_spec,
    discrete_spec,
    set_value,
    write_amd_card,
    write_nvidia_gpu,
    write_other_drm_card,
)
from tests.systemctl_stand_in import SystemctlStandIn
from tests.test_node_verbs import run_node

NVIDIA_BUS = "0000:41:00.0"
AMD_BUS = "0000:c1:00.0"


def slow_nvml_scenario(path: Path, seconds: float) -> Path:
    """One NVIDIA GPU whose enumeration (its first nvmlDeviceGetPciInfo) takes `seconds`."""
    scenario = {
        "gpus": [
            {
                "pci_bus_id": "00000000:41:00.0",
                "pci_device_id": 0x233510DE,
                "name": "NVIDIA H200",
                "uuid": "GPU-2f6c1a4e-8d3b-4c1e-9a7f-0b5d6e7f8a91",
                "compute_mode": "default",
                "temperature_celsius": 54,
                "power_limit_milliwatts": {
                    "enforced": 650000,
                    "default": 700000,
                    "min": 200000,
                    "max": 700000,
                },
                "hang": {"call": "nvmlDeviceGetPciInfo", "seconds": seconds, "times": 1},
            }
        ]
    }
    path.write_text(yaml.safe_dump(scenario))
    return path


def write_roster(tmp_path: Path) -> Path:
    path = tmp_path / "fleet.yaml"
    path.write_text(
        "hosts:\n"
        "  lab:\n"
        "    address: 127.0.0.1\n"
        "    gpus: {nvidia: {count: 1}, amd: {count: 1}}\n"
        "    power_cap_watts: {0: {min: 300, max: 700}, 1: {min: 150, max: 300}}\n"
    )
    return path


def exporter_numbering(settings: ExporterSettings, want: int, within: float) -> dict[str, str]:
    """`pci_bus_id` -> `gpu` from the exporter's `gpufleet_gpu_info`, once `want` GPUs show."""
    registry, fleet = build_registry(settings)
    try:
        deadline = time.monotonic() + within
        while True:
            found = {
                sample.labels["pci_bus_id"]: sample.labels["gpu"]
                for family in registry.collect()
                if family.name == "gpufleet_gpu_info"
                for sample in family.samples
            }
            if len(found) >= want or time.monotonic() > deadline:
                return found
            time.sleep(0.2)
    finally:
        fleet.close()


def test_slow_nvml_numbers_the_nvidia_card_first_in_exporter_and_node(tmp_path: Path) -> None:
    sysfs = tmp_path / "sys"
    amd = write_amd_card(sysfs, apu_spec(card=0, pci_slot=AMD_BUS))
    write_nvidia_gpu(sysfs, NVIDIA_BUS)
    scenario = slow_nvml_scenario(tmp_path / "slow.yaml", seconds=3)
    roster = write_roster(tmp_path)
    settings = ExporterSettings(
        host=load_roster(roster).hosts["lab"],
        sysfs=str(sysfs),
        procfs=str(tmp_path / "no-proc"),
        nvml_fake_scenario=scenario,
        collector_timeout_seconds=0.5,  # NVML's start (3 s) outlives it
    )
    numbering = exporter_numbering(settings, want=2, within=20)
    assert numbering == {NVIDIA_BUS: "0", AMD_BUS: "1"}

    # The node, just as slow to enumerate, numbers them alike: GPU 0 is the NVIDIA card.
    stand_in = SystemctlStandIn(tmp_path)
    options = (
        "--sysfs", str(sysfs), "--nvml.fake-scenario", str(scenario),
        "--state-dir", str(tmp_path / "state"),
    )  # fmt: skip
    capped = run_node(stand_in, roster, ssh=f"power-cap 0 500 {NVIDIA_BUS}", options=options)
    assert capped.code == 0, capped.stderr
    assert (capped.result["vendor"], capped.result["pci_bus_id"]) == ("nvidia", NVIDIA_BUS)
    # The AMD card's cap (an APU without power1_cap files here) was never touched, and a
    # request that names the AMD card as GPU 0 is refused.
    wrong = run_node(stand_in, roster, ssh=f"power-cap 0 500 {AMD_BUS}", options=options)
    assert wrong.code == 2
    assert wrong.json["error"].startswith(f"GPU 0 is {NVIDIA_BUS} on this host")
    assert not (amd.hwmon_dir / "power1_cap").exists()


def test_pci_gpus_are_the_nvidia_and_amd_display_devices(tmp_path: Path) -> None:
    sysfs = tmp_path / "sys"
    write_amd_card(sysfs, discrete_spec(card=0, pci_slot="0000:03:00.0"))
    write_nvidia_gpu(sysfs, NVIDIA_BUS)
    write_other_drm_card(sysfs, 1, "0000:00:02.0", "i915")  # Intel iGPU: not ours
    # An NVIDIA card's HDMI audio function: NVIDIA's, but class 0x0403 (audio), not a GPU.
    audio = write_nvidia_gpu(sysfs, "0000:41:00.1")
    set_value(audio / "class", "0x040300")
    assert pci_gpus(str(sysfs)) == {"0000:03:00.0": "amd", NVIDIA_BUS: "nvidia"}
    assert pci_gpus(str(tmp_path / "nothing")) == {}


def test_numbering_is_the_sorted_union_and_fixed_once_made(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    sysfs = tmp_path / "sys"
    write_amd_card(sysfs, apu_spec(card=0, pci_slot=AMD_BUS))
    index = GpuIndex()
    numbering = number_host_gpus(
        index,
        sysfs=str(sysfs),
        expected=["0000:81:00.0"],  # listed by the roster, missing now: keeps its place
        found=["00000000:41:00.0"],  # NVML's spelling, a device sysfs lacks (the fake)
    )
    assert numbering == {NVIDIA_BUS: 0, "0000:81:00.0": 1, AMD_BUS: 2}
    # The listed card PCI sysfs lacks is named (a missing card, or a typo in the roster).
    [warning] = [r for r in caplog.records if r.name == "exporter.sources.pci"]
    assert warning.levelname == "WARNING"
    assert warning.getMessage().startswith("the roster lists GPU(s) 0000:81:00.0 that ")
    # A card seen later (hot-plugged, or NVML slower than sysfs lacks) comes after the others.
    assert index.index_of("0000:05:00.0") == 3
    assert index.index_of(AMD_BUS) == 2
