"""`gpu-fleet-node power-cap` / `power-cap-restore` on an amdgpu sysfs tree and the fake NVML.

No GPU runs here: the AMD card is a writable fixture tree in the kernel's layout
(tests/sysfs_tree.py), the NVIDIA cards are the fake NVML backend (a stand-in for a GPU,
`--nvml.fake-scenario`). The roster's host has both: GPU 0 is the AMD card (PCI 0000:03:00.0),
GPUs 1 and 2 the NVIDIA cards (0000:41:00.0, 0000:c1:00.0): one numbering in PCI bus order,
the exporter's. Every request names the GPU by index and bus id; a mismatch is refused.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from exporter.sources.nvml_fake import FakeNvml
from tests.llama_lab import free_port
from tests.sysfs_tree import WrittenCard, discrete_spec, remove_device, write_amd_card
from tests.systemctl_stand_in import SystemctlStandIn
from tests.test_node_verbs import Answer, run_node, write_roster

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "nvml"
AMD_BUS = "0000:03:00.0"
NVIDIA_BUS = "0000:41:00.0"
OTHER_NVIDIA_BUS = "0000:c1:00.0"


@dataclass
class PowerLab:
    """The roster, the sysfs tree with its AMD card, the fake NVML scenario, the state dir."""

    stand_in: SystemctlStandIn
    roster: Path
    sysfs: Path
    card: WrittenCard
    scenario: Path
    state_dir: Path

    def node(self, *args: str, ssh: str | None = None) -> Answer:
        options = (
            "--sysfs", str(self.sysfs),
            "--nvml.fake-scenario", str(self.scenario),
            "--state-dir", str(self.state_dir),
        )  # fmt: skip
        return run_node(self.stand_in, self.roster, *args, ssh=ssh, options=options)

    def amd_cap(self) -> int:
        """amdgpu's power1_cap, microwatts."""
        return int(self.card.hwmon_file("power1_cap").read_text())

    def nvidia_cap(self, bus_id: str = NVIDIA_BUS) -> int:
        """The enforced limit (mW) as a fresh user of the same fake NVML sees it."""
        nvml = FakeNvml(self.scenario)
        nvml.nvmlInit()
        try:
            for i in range(nvml.nvmlDeviceGetCount()):
                handle = nvml.nvmlDeviceGetHandleByIndex(i)
                if nvml.nvmlDeviceGetPciInfo(handle).busId.lower().endswith(bus_id[5:]):
                    return nvml.nvmlDeviceGetEnforcedPowerLimit(handle)
        finally:
            nvml.nvmlShutdown()
        raise AssertionError(f"no fake GPU {bus_id}")

    def record(self, gpu: int) -> Path:
        return self.state_dir / f"power-cap-gpu{gpu}.json"


def _lab(tmp_path: Path, gpus: str | None = None) -> PowerLab:
    sysfs = tmp_path / "sys"
    card = write_amd_card(sysfs, discrete_spec(card=0, pci_slot=AMD_BUS))
    scenario = tmp_path / "two_gpus.yaml"
    shutil.copy(FIXTURES / "two_gpus.yaml", scenario)
    roster = write_roster(tmp_path, free_port())
    if gpus is not None:  # this host's gpus and power_cap_watts replaced
        lines = roster.read_text().splitlines(keepends=True)
        kept = [line for line in lines if not line.startswith(("    gpus:", "    power_cap"))]
        at = kept.index("    address: 127.0.0.1\n") + 1
        roster.write_text("".join([*kept[:at], gpus, *kept[at:]]))
    return PowerLab(SystemctlStandIn(tmp_path), roster, sysfs, card, scenario, tmp_path / "state")


@pytest.fixture
def power_lab(tmp_path: Path) -> PowerLab:
    return _lab(tmp_path)


def test_amd_cap_is_recorded_set_and_restored(power_lab: PowerLab) -> None:
    assert power_lab.amd_cap() == 303_000_000
    capped = power_lab.node(ssh=f"power-cap 0 250 {AMD_BUS}")
    assert capped.code == 0, capped.stderr
    assert power_lab.amd_cap() == 250_000_000
    result = capped.result
    assert (result["gpu"], result["vendor"], result["pci_bus_id"]) == (0, "amd", AMD_BUS)
    assert result["before_watts"] == 303 and result["current_watts"] == 250
    assert (result["device_min_watts"], result["device_max_watts"]) == (180, 345)
    record = json.loads(power_lab.record(0).read_text())
    assert record["previous_watts"] == 303 and record["pci_bus_id"] == AMD_BUS

    # A second step down keeps the first record: restore goes back to before the remediation.
    second = power_lab.node("power-cap", "0", "200", AMD_BUS)
    assert second.code == 0, second.stderr
    assert second.result["previous_watts"] == 303 and power_lab.amd_cap() == 200_000_000

    restored = power_lab.node(ssh=f"power-cap-restore 0 {AMD_BUS}")
    assert restored.code == 0, restored.stderr
    assert restored.result["restored"] is True and restored.result["current_watts"] == 303
    assert power_lab.amd_cap() == 303_000_000
    assert not power_lab.record(0).exists()

    nothing = power_lab.node(ssh=f"power-cap-restore 0 {AMD_BUS}")
    assert nothing.code == 0 and nothing.json["ok"]
    assert nothing.result["restored"] is False
    assert "nothing to restore" in nothing.result["message"]


def test_nvidia_cap_through_the_fake_nvml_and_restore(power_lab: PowerLab) -> None:
    assert power_lab.nvidia_cap() == 650_000
    capped = power_lab.node(ssh=f"power-cap 1 500 {NVIDIA_BUS}")
    assert capped.code == 0, capped.stderr
    assert capped.result["vendor"] == "nvidia" and capped.result["pci_bus_id"] == NVIDIA_BUS
    assert capped.result["before_watts"] == 650 and capped.result["current_watts"] == 500
    assert power_lab.nvidia_cap() == 500_000
    assert power_lab.nvidia_cap("0000:c1:00.0") == 700_000  # the other card is left alone
    restored = power_lab.node(ssh=f"power-cap-restore 1 {NVIDIA_BUS}")
    assert restored.code == 0, restored.stderr
    assert power_lab.nvidia_cap() == 650_000 and not power_lab.record(1).exists()


@pytest.mark.parametrize(
    ("command", "complaint"),
    [
        # Within the roster's 150-300 W, below the card's own power1_cap_min (180 W).
        (f"power-cap 0 160 {AMD_BUS}", "160 W is outside GPU 0's own range 180-345 W"),
        # Within the roster's 100-600 W, below NVML's constraint (200 W).
        (f"power-cap 1 150 {NVIDIA_BUS}", "150 W is outside GPU 1's own range 200-700 W"),
        (f"power-cap 0 301 {AMD_BUS}", "outside the roster's bounds for GPU 0: 150-300 W"),
        (f"power-cap 2 300 {OTHER_NVIDIA_BUS}", "GPU 2 (0000:c1:00.0) has no power_cap_watts"),
        # The alert's GPU 1 is the NVIDIA card; the request's bus id is the AMD card's.
        (f"power-cap 1 300 {AMD_BUS}", "GPU 1 is 0000:41:00.0 on this host, but the request"),
        ("power-cap 1 300", "power-cap takes 3 argument(s), got 2"),
        ("power-cap 1 300 41.00", "PCI_BUS_ID must be a PCI bus id"),
    ],
)
def test_out_of_bounds_is_refused_and_nothing_changes(
    power_lab: PowerLab, command: str, complaint: str
) -> None:
    answer = power_lab.node(ssh=command)
    assert answer.code == 2, answer.stderr
    assert not answer.json["ok"] and complaint in answer.json["error"]
    assert power_lab.amd_cap() == 303_000_000 and power_lab.nvidia_cap() == 650_000
    assert not power_lab.state_dir.exists() or not list(power_lab.state_dir.iterdir())


def test_a_missing_gpu_renumbers_and_the_bus_id_refuses_the_other_card(power_lab: PowerLab) -> None:
    # The AMD card fell off the bus and the roster does not list bus ids: the NVIDIA cards move
    # down one index on this host. The request (made when GPU 1 was 0000:41:00.0) is refused
    # rather than capping 0000:c1:00.0, which is GPU 1 now.
    remove_device(power_lab.card)
    answer = power_lab.node(ssh=f"power-cap 1 500 {NVIDIA_BUS}")
    assert answer.code == 2, answer.stderr
    assert answer.json["error"].startswith(
        f"GPU 1 is {OTHER_NVIDIA_BUS} on this host, but the request names {NVIDIA_BUS}"
    )
    assert power_lab.nvidia_cap() == 650_000 and power_lab.nvidia_cap(OTHER_NVIDIA_BUS) == 700_000
    restore = power_lab.node(ssh=f"power-cap-restore 0 {AMD_BUS}")
    assert restore.code == 0 and restore.result["restored"] is False  # nothing recorded


def test_listed_bus_ids_keep_the_numbering_while_a_card_is_missing(tmp_path: Path) -> None:
    lab = _lab(
        tmp_path,
        "    gpus:\n"
        f"      nvidia: {{count: 2, pci_bus_ids: ['{NVIDIA_BUS}', '{OTHER_NVIDIA_BUS}']}}\n"
        f"      amd: {{count: 1, pci_bus_ids: ['{AMD_BUS}']}}\n"
        f"    power_cap_watts: {{'{OTHER_NVIDIA_BUS}': {{min: 250, max: 400}},\n"
        "                      0: {min: 150, max: 300}}\n",
    )
    remove_device(lab.card)
    # GPU 0 stays the (missing) AMD card, so the NVIDIA cards keep indices 1 and 2.
    capped = lab.node(ssh=f"power-cap 2 400 {OTHER_NVIDIA_BUS}")
    assert capped.code == 0, capped.stderr
    assert (capped.result["roster_min_watts"], capped.result["roster_max_watts"]) == (250, 400)
    assert lab.nvidia_cap(OTHER_NVIDIA_BUS) == 400_000 and lab.nvidia_cap() == 650_000
    # Bounds keyed by bus id: 401 W is outside them (the index key 0 is another card's).
    over = lab.node(ssh=f"power-cap 2 401 {OTHER_NVIDIA_BUS}")
    assert (
        over.code == 2 and "outside the roster's bounds for GPU 2: 250-400 W" in over.json["error"]
    )
    missing = lab.node(ssh=f"power-cap 0 200 {AMD_BUS}")
    assert missing.code == 2
    assert missing.json["error"] == (
        f"GPU 0 ({AMD_BUS}) is not present (off the bus, or no driver sees it)"
    )


def test_a_write_the_device_refuses_exits_1_and_leaves_no_record(power_lab: PowerLab) -> None:
    scenario = yaml.safe_load(power_lab.scenario.read_text())
    scenario["gpus"][0]["power_limit_read_only"] = True  # NO_PERMISSION, as without root
    power_lab.scenario.write_text(yaml.safe_dump(scenario))
    answer = power_lab.node(ssh=f"power-cap 1 500 {NVIDIA_BUS}")
    assert answer.code == 1
    assert "nvmlDeviceSetPowerManagementLimit" in answer.json["error"]
    assert answer.result["before_watts"] == 650  # how far it got
    assert power_lab.nvidia_cap() == 650_000
    assert not power_lab.record(1).exists()  # no record of a change that did not happen
