"""The lab's GPU hosts: an NVIDIA host, an AMD dGPU host and a Strix-Halo-like APU host.

Each host has its own loopback address (127.0.0.2, .3, .4), its own roster section, its own
exporter (the real `MetricsServer` and collectors, in-process, bound to that address and the
roster's `exporter_port`) and its own real `sshd` (tests/ssh_lab.py) whose one authorized key,
the remediator's, forces `gpu-fleet-node --config ROSTER --host NAME --ssh` with the host's
own `--sysfs` tree (and, on the NVIDIA host, `--nvml.fake-scenario`), so the remediator acts
on a host exactly as in production: the SSH executor, strict host-key checking, the node's
allow-list. What cannot run here is a GPU; it is stood in for with data:

- **nvidia** (127.0.0.2): the fake NVML backend (exporter/sources/nvml_fake.py) reading a
  scenario file of two H200s, listed in NVML's order `c1` then `41` (not bus order: `gpu` 1 is
  NVML's device 0, so a cap on "the right card" is a cap by bus id); `set_temperature` edits
  the file, the node's `power-cap` records the new limit beside it, as a real card would keep it;
- **amd** (127.0.0.3): a fixture sysfs tree (tests/sysfs_tree.py) with a discrete RDNA3 card
  (hwmon `edge`/`junction`/`mem` with their crits, `power1_cap*` the node writes) and k10temp;
- **apu** (127.0.0.4): a Strix-Halo-like APU (amdgpu `edge`, `power1_cap*`) and k10temp `Tctl`,
  whose critical value the roster gives (`thermal:`), so it does not depend on this machine's
  CPU.

No host runs a llama-server (no scenario here needs one; the lab's dioscuri has one). The
hosts share one `/proc` and one systemd stand-in with dioscuri.

    hosts = LabHosts(tmp_path)
    with Lab(tmp_path, llama_binary, tiny_model, monkeypatch, hosts=hosts) as lab:
        hosts.nvidia.set_temperature(NVIDIA_HOT_BUS, 90)
        hosts.apu.set_tctl(93)
        ...

**Lab time for playbooks**: `tests.lab.lab_playbook`, the one rule of every lab (its waits
divided by 60, `restore_after_seconds: 900` → 15; its deadlines the product's), named
`<name>-lab`: `Lab(..., playbooks=lab_playbooks("gpu-temperature-critical"))`. The
`lab_playbook(name, directory)` here writes that same copy into a directory.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from exporter.http import MetricsServer
from exporter.registry import ExporterSettings, FleetCollector, build_registry
from exporter.sources.nvml_fake import FakeNvml
from fleet.roster import load_roster
from tests.lab import lab_playbooks
from tests.llama_lab import free_port
from tests.ssh_lab import SshLab, keygen, node_forced_command
from tests.sysfs_tree import (
    WrittenCard,
    discrete_spec,
    set_value,
    strix_halo_spec,
    write_amd_card,
    write_k10temp,
    write_nvidia_gpu,
)

REPO = Path(__file__).resolve().parent.parent

NVIDIA_BUSES = ("0000:41:00.0", "0000:c1:00.0")  # gpu 0 and gpu 1 (bus order)
NVIDIA_SHUTDOWN_CELSIUS = 92  # the scenario's NVML shutdown threshold: the critical value
APU_CRITICAL_CELSIUS = 95  # the roster's `thermal: k10temp/Tctl`


def _h200(bus_id: str, uuid: str, temperature: int) -> dict[str, Any]:
    """A calm H200 (no throttling, no ECC errors, no Xids): only what the test injects fires."""
    return {
        "pci_bus_id": bus_id,
        "pci_device_id": 0x233510DE,
        "name": "NVIDIA H200",
        "uuid": uuid,
        "vbios_version": "96.00.AF.00.01",
        "utilization_percent": {"gpu": 30, "memory": 10},
        "memory_bytes": {"total": 150754820096, "used": 21474836480, "reserved": 564133888},
        "temperature_celsius": temperature,
        "memory_temperature_celsius": temperature + 4,
        "temperature_thresholds_celsius": {
            "shutdown": NVIDIA_SHUTDOWN_CELSIUS, "slowdown": 89, "mem_max": 95,
        },
        "power_usage_milliwatts": 310000,
        "power_limit_milliwatts": {
            "enforced": 700000, "default": 700000, "min": 200000, "max": 700000,
        },
        "fan_speed_percent": 30,
        "clocks_mhz": {"graphics": 1755, "sm": 1755, "memory": 3201},
        "max_clocks_mhz": {"graphics": 1980, "sm": 1980, "memory": 3201},
        "clocks_event_reasons": [],
        "pcie_link": {"generation": 5, "width": 16},
        "pcie_replay_counter": 0,
        "ecc_errors": {"corrected": 0, "uncorrected": 0},
        "retired_pages": {"single_bit_ecc": 0, "double_bit_ecc": 0, "pending": False},
        "remapped_rows": {"correctable": 0, "uncorrectable": 0, "pending": False, "failed": False},
    }  # fmt: skip


class LabHost:
    """One host: its address, sysfs tree, node state dir, sshd and exporter."""

    vendor_gpus = ""  # the roster's `gpus:` value
    power_caps = ""  # the roster's `power_cap_watts:` value
    thermal = ""  # the roster's `thermal:` value, if any

    def __init__(self, directory: Path, name: str, address: str) -> None:
        self.name = name
        self.address = address
        self.directory = directory
        directory.mkdir(parents=True, exist_ok=True)
        self.sysfs = directory / "sys"
        self.state_dir = directory / "node-state"
        self.exporter_port = free_port()
        self.sshd = SshLab(directory / "ssh", address=address)
        self.exporter: MetricsServer | None = None
        self.fleet: FleetCollector | None = None

    def roster_section(self) -> str:
        """This host's lines under the roster's `hosts:`."""
        lines = [
            f"  {self.name}:",
            f"    address: {self.address}",
            f"    exporter_port: {self.exporter_port}",
            f"    ssh: {{user: {self.sshd.user}, port: {self.sshd.port}}}",
            f"    gpus: {self.vendor_gpus}",
            f"    power_cap_watts: {self.power_caps}",
        ]
        if self.thermal:
            lines.append(f"    thermal: {self.thermal}")
        return "\n".join(lines) + "\n"

    def node_options(self) -> list[str]:
        """The node's options beyond roster and host: this host's device roots."""
        return ["--sysfs", str(self.sysfs), "--state-dir", str(self.state_dir)]

    def exporter_settings(self, roster: Path) -> ExporterSettings:
        """What this host's exporter is built from."""
        return ExporterSettings(host=load_roster(roster).hosts[self.name], sysfs=str(self.sysfs))

    def start(self, roster: Path, client_key: Path, env: Mapping[str, str]) -> None:
        """Start the sshd (the remediator's key forced to this host's node) and the exporter."""
        command = node_forced_command(
            self.directory, roster, self.name, env, extra=self.node_options()
        )
        self.sshd.add_key("remediator", command, private=client_key)
        self.sshd.start()
        registry, self.fleet = build_registry(self.exporter_settings(roster))
        self.exporter = MetricsServer(registry, self.address, self.exporter_port)
        self.exporter.start()

    @property
    def target(self) -> str:
        """Where Prometheus scrapes this host's exporter."""
        return f"{self.address}:{self.exporter_port}"

    def close(self) -> None:
        """Stop what `start` started (each part apart)."""
        with contextlib.ExitStack() as stack:
            stack.callback(self.sshd.stop)
            if self.fleet is not None:
                stack.callback(self.fleet.close)
            if self.exporter is not None:
                stack.callback(self.exporter.stop)


class NvidiaHost(LabHost):
    """Two H200s through the fake NVML; the test edits their temperatures."""

    vendor_gpus = "{nvidia: {count: 2}}"
    power_caps = "{0: {min: 300, max: 700}, 1: {min: 300, max: 700}}"

    def __init__(self, directory: Path, name: str = "nvhost", address: str = "127.0.0.2") -> None:
        super().__init__(directory, name, address)
        for bus_id in NVIDIA_BUSES:  # PCI sysfs numbers them (exporter/gpu_index.py)
            write_nvidia_gpu(self.sysfs, bus_id)
        self.scenario = directory / "nvml.yaml"
        # NVML's own order: c1 first. The `gpu` label follows bus order: 41 is 0, c1 is 1.
        self._gpus = {
            NVIDIA_BUSES[1]: _h200(NVIDIA_BUSES[1], "GPU-7a0e9c55-1b2d-4f3a-8c6e-5d4b3a291807", 41),
            NVIDIA_BUSES[0]: _h200(NVIDIA_BUSES[0], "GPU-2f6c1a4e-8d3b-4c1e-9a7f-0b5d6e7f8a91", 45),
        }
        self._write()

    def _write(self) -> None:
        text = "# The lab's NVIDIA host (tests/lab_hosts.py): a STAND-IN FOR A GPU.\n"
        text += yaml.safe_dump({"gpus": list(self._gpus.values())}, sort_keys=False)
        # Whole files only: the exporter and the node re-read it when it changes.
        partial = self.scenario.with_suffix(".tmp")
        partial.write_text(text)
        os.replace(partial, self.scenario)

    def set_temperature(self, bus_id: str, celsius: int, memory: int | None = None) -> None:
        """The card's core and memory temperatures (default: memory 4 °C above the core), from
        the next read on."""
        self._gpus[bus_id]["temperature_celsius"] = celsius
        self._gpus[bus_id]["memory_temperature_celsius"] = celsius + 4 if memory is None else memory
        self._write()

    def power_limit_watts(self, bus_id: str) -> float:
        """The enforced power limit as a fresh NVML user sees it (the node's writes included)."""
        nvml = FakeNvml(self.scenario)
        nvml.nvmlInit()
        try:
            for index in range(nvml.nvmlDeviceGetCount()):
                handle = nvml.nvmlDeviceGetHandleByIndex(index)
                if nvml.nvmlDeviceGetPciInfo(handle).busId.lower().endswith(bus_id[5:]):
                    return nvml.nvmlDeviceGetEnforcedPowerLimit(handle) / 1000
        finally:
            nvml.nvmlShutdown()
        raise AssertionError(f"no fake GPU {bus_id}")

    def node_options(self) -> list[str]:
        """Device roots, and the fake NVML (a STAND-IN FOR A GPU)."""
        return [*super().node_options(), "--nvml.fake-scenario", str(self.scenario)]

    def exporter_settings(self, roster: Path) -> ExporterSettings:
        """The sysfs tree and the fake NVML."""
        host = load_roster(roster).hosts[self.name]
        return ExporterSettings(host=host, sysfs=str(self.sysfs), nvml_fake_scenario=self.scenario)


class AmdHost(LabHost):
    """A discrete RDNA3 card (edge, junction, mem; power1_cap) and the CPU's k10temp."""

    vendor_gpus = "{amd: {count: 1}}"
    power_caps = "{0: {min: 180, max: 345}}"

    def __init__(self, directory: Path, name: str = "amdhost", address: str = "127.0.0.3") -> None:
        super().__init__(directory, name, address)
        self.card: WrittenCard = write_amd_card(self.sysfs, discrete_spec(card=0))
        self.k10temp = write_k10temp(self.sysfs)

    def power_cap_watts(self) -> float:
        """amdgpu's `power1_cap` now."""
        return int(self.card.hwmon_file("power1_cap").read_text()) / 1e6


class ApuHost(LabHost):
    """A Strix-Halo-like APU (amdgpu edge, power1_cap) and k10temp `Tctl`."""

    vendor_gpus = "{amd: {count: 1}}"
    power_caps = "{0: {min: 45, max: 140}}"
    thermal = f"{{k10temp/Tctl: {{critical_celsius: {APU_CRITICAL_CELSIUS}}}}}"

    def __init__(self, directory: Path, name: str = "apuhost", address: str = "127.0.0.4") -> None:
        super().__init__(directory, name, address)
        self.card: WrittenCard = write_amd_card(self.sysfs, strix_halo_spec(card=0))
        self.k10temp = write_k10temp(self.sysfs)

    def set_tctl(self, celsius: float) -> None:
        """k10temp's `Tctl` (temp1), from the next scrape on."""
        set_value(self.k10temp / "temp1_input", int(celsius * 1000))

    def power_cap_watts(self) -> float:
        """amdgpu's `power1_cap` now."""
        return int(self.card.hwmon_file("power1_cap").read_text()) / 1e6


class LabHosts:
    """The three hosts, one remediator key and one `known_hosts` for all of them.

    Handed to `Lab(..., hosts=...)`: it adds `roster_text()` to the roster, `config_text()`
    to the remediator's config, starts them (`start`) before the remediator, has Prometheus
    scrape `targets()` and closes them with the rest.
    """

    def __init__(self, directory: Path) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self.nvidia = NvidiaHost(directory / "nvhost")
        self.amd = AmdHost(directory / "amdhost")
        self.apu = ApuHost(directory / "apuhost")
        self.all: list[LabHost] = [self.nvidia, self.amd, self.apu]
        self.client_key = keygen(directory / "remediator_ed25519", "lab remediator")
        self.known_hosts = directory / "known_hosts"
        self.known_hosts.write_text("")  # filled at start, when each sshd writes its own

    def roster_text(self) -> str:
        """The hosts' sections, to append under the roster's `hosts:`."""
        return "".join(host.roster_section() for host in self.all)

    def config_text(self) -> str:
        """The remediator's `ssh:` (one key, strict host keys) and a lab-time restore check."""
        return (
            f"ssh: {{identity_file: {self.client_key}, known_hosts_file: {self.known_hosts}, "
            "connect_timeout_seconds: 5}\n"
            "power_cap: {check_interval_seconds: 1}\n"
        )

    def start(self, roster: Path, env: Mapping[str, str]) -> None:
        """Start every host; `env` carries the systemctl stand-in for the node's sessions."""
        for host in self.all:
            host.start(roster, self.client_key, env)
        self.known_hosts.write_text("".join(h.sshd.known_hosts.read_text() for h in self.all))

    def targets(self) -> dict[str, str]:
        """Host name → its exporter's scrape target."""
        return {host.name: host.target for host in self.all}

    def close(self) -> None:
        """Stop every host, each apart."""
        with contextlib.ExitStack() as stack:
            for host in self.all:
                stack.callback(host.close)


# -- lab-time playbooks -------------------------------------------------------------------------


def lab_playbook(name: str, directory: Path) -> Path:
    """Write built-in `name` in lab time (`tests.lab.lab_playbook`) into `directory`; its path.

    The same copy as `Lab(playbooks=lab_playbooks(name))`, named `<name>-lab`: for a caller
    that holds a lab's playbooks_dir (bench/time_to_heal.py) rather than its options.
    """
    ((file_name, text),) = lab_playbooks(name).items()
    target = directory / file_name
    target.write_text(text)
    return target
