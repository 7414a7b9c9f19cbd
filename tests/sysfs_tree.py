"""Build sysfs fixture trees in the kernel's own layout, symlinks included.

Used by the tests and by the benchmark. A card is written where the kernel puts it::

    devices/pci0000:00/[bridges/]0000:03:00.0/     the PCI device: amdgpu's files, uevent
    devices/pci0000:00/0000:03:00.0/driver -> ../../../bus/pci/drivers/amdgpu
    devices/pci0000:00/0000:03:00.0/drm/card0/      the DRM card
    devices/pci0000:00/0000:03:00.0/drm/card0/device -> ../../../0000:03:00.0
    devices/pci0000:00/0000:03:00.0/drm/card0/card0-DP-1      a connector
    devices/pci0000:00/0000:03:00.0/hwmon/hwmon3/   amdgpu's hwmon chip
    devices/pci0000:00/0000:03:00.0/hwmon/hwmon3/device -> ../../../0000:03:00.0
    class/drm/card0 -> ../../devices/pci0000:00/0000:03:00.0/drm/card0
    class/drm/card0-DP-1 -> ../../devices/pci0000:00/0000:03:00.0/drm/card0/card0-DP-1
    class/hwmon/hwmon3 -> ../../devices/pci0000:00/0000:03:00.0/hwmon/hwmon3

File contents follow the kernel's formats: one value and a newline; temperatures in
millidegrees Celsius, power in microwatts, energy in microjoules, clocks in Hz, memory in bytes,
`pp_dpm_*` as `<level>: <MHz>Mhz` lines with ` *` on the current one.

Typical use::

    written = write_amd_card(tmp_path, discrete_spec(card=0))
    write_k10temp(tmp_path)
    set_value(written.hwmon_file("temp2_input"), 80_000)   # shows on the next scrape
    remove_device(written)                                  # the card fell off the bus
"""

from __future__ import annotations

import enum
import re
import shutil
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

GIB = 1 << 30
MIB = 1 << 20


@dataclass(frozen=True)
class TempSpec:
    """One hwmon `temp<N>` channel; N is its position in the chip's `temps`, from 1."""

    label: str | None
    millidegrees: int
    crit: int | None = None
    crit_hyst: int | None = None
    emergency: int | None = None


class PowerFiles(enum.Enum):
    """Which power reading files amdgpu's hwmon has (thermal.rst: varies by ASIC)."""

    AVERAGE = "power1_average only (older ASICs)"
    INPUT = "power1_input only (APUs, newest ASICs)"
    BOTH = "power1_average and power1_input"


@dataclass(frozen=True)
class PowerCapSpec:
    """amdgpu's `power1_cap*` files, in microwatts."""

    current: int = 303_000_000
    default: int = 303_000_000
    min: int = 180_000_000
    max: int = 345_000_000


# A discrete RDNA3 card: edge, junction (hotspot) and memory temperatures, each with crit,
# crit_hyst and emergency (lm-sensors shows hyst as -273.1 °C: amdgpu writes -273150).
DISCRETE_TEMPS = (
    TempSpec("edge", 54_000, crit=100_000, crit_hyst=-273_150, emergency=105_000),
    TempSpec("junction", 71_000, crit=110_000, crit_hyst=-273_150, emergency=115_000),
    TempSpec("mem", 62_000, crit=100_000, crit_hyst=-273_150, emergency=105_000),
)
# An APU: edge only, and no crit (amdgpu hides temp1_crit on APUs).
APU_TEMPS = (TempSpec("edge", 52_000),)


@dataclass(frozen=True)
class AmdCardSpec:
    """Everything written for one amdgpu card. None means "file absent"."""

    card: int
    pci_slot: str = "0000:03:00.0"
    bridges: tuple[str, ...] = ()  # PCIe ports from the root complex down to the card
    pci_vendor: int = 0x1002
    pci_device: int = 0x744C
    driver_link: bool = True  # False: only `uevent` says DRIVER=amdgpu
    apu: bool = False
    unique_id: str | None = "5c0b2a1f6e8d4a31"
    vbios_version: str | None = "113-D7020100-102"
    product_name: str | None = None
    gpu_busy_percent: int | None = 37
    mem_busy_percent: int | None = 12
    vram_total: int | None = 24 * GIB
    vram_used: int | None = 18 * GIB
    vis_vram_total: int | None = 24 * GIB
    vis_vram_used: int | None = 17 * GIB
    gtt_total: int | None = 64 * GIB
    gtt_used: int | None = 300 * MIB
    pp_dpm_sclk: str | None = "0: 500Mhz\n1: 1800Mhz *\n2: 2500Mhz\n"
    pp_dpm_mclk: str | None = "0: 96Mhz\n1: 456Mhz\n2: 772Mhz\n3: 1250Mhz *\n"
    hwmon: int | None = None  # hwmon number; None: the lowest free one
    temps: tuple[TempSpec, ...] = DISCRETE_TEMPS
    power: PowerFiles = PowerFiles.BOTH
    power_average: int = 212_000_000
    power_input: int = 215_000_000
    power_cap: PowerCapSpec | None = field(default_factory=PowerCapSpec)
    energy: int | None = None  # energy1_input, µJ (few amdgpu ASICs have it)
    fan_rpm: int | None = 1450
    sclk_hz: int | None = 1_800_000_000
    mclk_hz: int | None = 1_250_000_000  # freq2 (mclk): dGPUs only
    connectors: tuple[str, ...] = ("DP-1", "HDMI-A-1")


def discrete_spec(card: int, pci_slot: str = "0000:03:00.0") -> AmdCardSpec:
    """A discrete RDNA3 card (1002:744c) behind no bridge, with three temperatures."""
    return AmdCardSpec(card=card, pci_slot=pci_slot)


def apu_spec(card: int = 1, pci_slot: str = "0000:c5:00.0") -> AmdCardSpec:
    """A Strix Halo-like APU (1002:1586): edge only, power1_input only, no fan, no mclk."""
    return AmdCardSpec(
        card=card,
        pci_slot=pci_slot,
        bridges=("0000:00:08.1",),
        pci_device=0x1586,
        apu=True,
        unique_id=None,
        vbios_version="113-STRXLGEN-001",
        mem_busy_percent=None,
        vram_total=512 * MIB,
        vram_used=300 * MIB,
        vis_vram_total=512 * MIB,
        vis_vram_used=290 * MIB,
        gtt_total=96 * GIB,
        gtt_used=40 * GIB,
        pp_dpm_sclk="0: 600Mhz\n1: 1100Mhz *\n2: 2900Mhz\n",
        pp_dpm_mclk="0: 400Mhz\n1: 800Mhz\n2: 1000Mhz *\n",
        temps=APU_TEMPS,
        power=PowerFiles.INPUT,
        power_input=48_000_000,
        power_cap=None,
        fan_rpm=None,
        sclk_hz=1_100_000_000,
        mclk_hz=None,
        connectors=("eDP-1",),
    )


def strix_halo_spec(card: int = 0, pci_slot: str = "0000:c5:00.0") -> AmdCardSpec:
    """`apu_spec` with amdgpu's `power1_cap*` files (the package's sustained power limit), as a
    Strix Halo box that lets its APU's cap be lowered shows them: what the lab's APU host and
    the apu-temperature-critical playbook's `set_power_cap` need."""
    cap = PowerCapSpec(current=120_000_000, default=120_000_000, min=45_000_000, max=140_000_000)
    return replace(apu_spec(card, pci_slot), power_cap=cap)


@dataclass(frozen=True)
class WrittenCard:
    """Where a written card's files are."""

    spec: AmdCardSpec
    root: Path
    device_dir: Path
    card_dir: Path
    hwmon_dir: Path

    def file(self, name: str) -> Path:
        """A file of the PCI device directory (`gpu_busy_percent`, `mem_info_vram_used`…)."""
        return self.device_dir / name

    def hwmon_file(self, name: str) -> Path:
        """A file of the card's hwmon directory (`temp1_input`, `power1_average`…)."""
        return self.hwmon_dir / name


@dataclass(frozen=True)
class HwmonChipSpec:
    """A host hwmon chip under its parent device `devices/<device>`.

    Where the kernel puts it: below a bus device (PCI, platform) in a `hwmon/` glue directory
    (`0000:00:18.3/hwmon/hwmon2`); directly inside a parent that is itself a class device
    (`nvme/nvme0/hwmon1`, `thermal_zone0/hwmon0`) — drivers/base/core.c, get_device_parent().
    """

    name: str
    temps: tuple[TempSpec, ...]
    device: str
    class_parent: bool = False
    hwmon: int | None = None


K10TEMP = HwmonChipSpec(
    # Zen: Tctl and Tccd<N>, no temp*_crit (Documentation/hwmon/k10temp.rst).
    "k10temp",
    (TempSpec("Tctl", 65_250), TempSpec("Tccd1", 58_000)),
    device="pci0000:00/0000:00:18.3",
)
ACPITZ = HwmonChipSpec(
    # An ACPI thermal zone: one unlabelled sensor (so `temp1`), with a crit.
    "acpitz",
    (TempSpec(None, 27_800, crit=105_000),),
    device="virtual/thermal/thermal_zone0",
    class_parent=True,
)


def nvme_spec(controller: int, pci_slot: str, composite: int = 41_850) -> HwmonChipSpec:
    """An NVMe drive's chip: `Composite` with a crit, and `Sensor 1` without."""
    return HwmonChipSpec(
        "nvme",
        (TempSpec("Composite", composite, crit=84_850), TempSpec("Sensor 1", composite + 2_000)),
        device=f"pci0000:00/0000:00:01.2/{pci_slot}/nvme/nvme{controller}",
        class_parent=True,
    )


def set_value(path: Path, value: int | str) -> None:
    """Change a file in place, in the kernel's format (the value and a newline)."""
    path.write_text(f"{value}\n")


def _write(path: Path, value: int | str | None) -> None:
    if value is not None:
        set_value(path, value)


def _symlink(link: Path, target: Path) -> None:
    """A relative symlink spelled as sysfs spells it.

    kernfs_get_target_path() climbs from the link's directory to the nearest ancestor of the
    target's *parent*, then descends: `card0/device` is `../../../0000:03:00.0`, not the
    `../..` that os.path.relpath() would give.
    """
    link.parent.mkdir(parents=True, exist_ok=True)
    ancestors = set(target.parents)
    base, ups = link.parent, 0
    while base not in ancestors:
        base, ups = base.parent, ups + 1
    link.symlink_to("../" * ups + str(target.relative_to(base)))


def _next_hwmon(root: Path) -> int:
    hwmon_class = root / "class" / "hwmon"
    used = {
        int(entry.name[5:])
        for entry in (hwmon_class.iterdir() if hwmon_class.is_dir() else ())
        if entry.name.startswith("hwmon") and entry.name[5:].isdigit()
    }
    number = 0
    while number in used:
        number += 1
    return number


def _pci_device_dir(root: Path, pci_slot: str, bridges: Sequence[str]) -> Path:
    path = root / "devices" / f"pci{pci_slot[:4]}:00"
    for bridge in bridges:
        path /= bridge
    return path / pci_slot


def _write_temps(hwmon_dir: Path, temps: Sequence[TempSpec]) -> None:
    for number, temp in enumerate(temps, start=1):
        channel = f"temp{number}"
        _write(hwmon_dir / f"{channel}_input", temp.millidegrees)
        _write(hwmon_dir / f"{channel}_label", temp.label)
        _write(hwmon_dir / f"{channel}_crit", temp.crit)
        _write(hwmon_dir / f"{channel}_crit_hyst", temp.crit_hyst)
        _write(hwmon_dir / f"{channel}_emergency", temp.emergency)


def _write_hwmon_dir(
    root: Path, parent: Path, number: int | None, name: str, *, glue: bool = True
) -> Path:
    """`<parent>/hwmon/hwmon<N>` (or `<parent>/hwmon<N>`) with `name`, `device` and class links."""
    number = _next_hwmon(root) if number is None else number
    hwmon_dir = (parent / "hwmon" if glue else parent) / f"hwmon{number}"
    hwmon_dir.mkdir(parents=True)
    set_value(hwmon_dir / "name", name)
    _symlink(hwmon_dir / "device", parent)
    _symlink(root / "class" / "hwmon" / f"hwmon{number}", hwmon_dir)
    return hwmon_dir


def _write_pci_device(
    root: Path, pci_slot: str, bridges: Sequence[str], *, driver: str, pci_id: str, link: bool
) -> Path:
    device_dir = _pci_device_dir(root, pci_slot, bridges)
    device_dir.mkdir(parents=True)
    vendor, device = pci_id.split(":")
    set_value(device_dir / "vendor", f"0x{vendor.lower()}")
    set_value(device_dir / "device", f"0x{device.lower()}")
    set_value(device_dir / "class", "0x030000")
    (device_dir / "uevent").write_text(
        f"DRIVER={driver}\nPCI_CLASS=30000\nPCI_ID={pci_id.upper()}\n"
        f"PCI_SUBSYS_ID=1EAE:7901\nPCI_SLOT_NAME={pci_slot}\n"
        f"MODALIAS=pci:v0000{vendor.upper()}d0000{device.upper()}sv00001EAEsd00007901bc03sc00i00\n"
    )
    driver_dir = root / "bus" / "pci" / "drivers" / driver
    driver_dir.mkdir(parents=True, exist_ok=True)
    # Every PCI device is listed in bus/pci/devices, bound to a driver or not.
    _symlink(root / "bus" / "pci" / "devices" / pci_slot, device_dir)
    if link:
        _symlink(device_dir / "driver", driver_dir)
        _symlink(driver_dir / pci_slot, device_dir)
    return device_dir


def _write_drm_card(root: Path, device_dir: Path, card: int, connectors: Sequence[str]) -> Path:
    card_dir = device_dir / "drm" / f"card{card}"
    card_dir.mkdir(parents=True)
    (card_dir / "uevent").write_text(f"MAJOR=226\nMINOR={card}\nDEVNAME=dri/card{card}\n")
    set_value(card_dir / "dev", f"226:{card}")
    _symlink(card_dir / "device", device_dir)
    _symlink(root / "class" / "drm" / f"card{card}", card_dir)
    for connector in connectors:
        connector_dir = card_dir / f"card{card}-{connector}"
        connector_dir.mkdir()
        set_value(connector_dir / "status", "disconnected")
        _symlink(root / "class" / "drm" / connector_dir.name, connector_dir)
    render = device_dir / "drm" / f"renderD{128 + card}"
    render.mkdir()
    _symlink(root / "class" / "drm" / render.name, render)
    return card_dir


def write_amd_card(root: Path, spec: AmdCardSpec) -> WrittenCard:
    """Write one amdgpu card (PCI device, DRM card, connectors, hwmon) under `root`."""
    root = root.resolve()  # symlinks are computed from absolute paths
    pci_id = f"{spec.pci_vendor:04x}:{spec.pci_device:04x}"
    device_dir = _write_pci_device(
        root, spec.pci_slot, spec.bridges, driver="amdgpu", pci_id=pci_id, link=spec.driver_link
    )
    _write(device_dir / "unique_id", spec.unique_id)
    _write(device_dir / "vbios_version", spec.vbios_version)
    _write(device_dir / "product_name", spec.product_name)
    _write(device_dir / "gpu_busy_percent", spec.gpu_busy_percent)
    _write(device_dir / "mem_busy_percent", spec.mem_busy_percent)
    for name in ("vram", "vis_vram", "gtt"):
        _write(device_dir / f"mem_info_{name}_total", getattr(spec, f"{name}_total"))
        _write(device_dir / f"mem_info_{name}_used", getattr(spec, f"{name}_used"))
    if spec.pp_dpm_sclk is not None:
        (device_dir / "pp_dpm_sclk").write_text(spec.pp_dpm_sclk)
    if spec.pp_dpm_mclk is not None:
        (device_dir / "pp_dpm_mclk").write_text(spec.pp_dpm_mclk)
    card_dir = _write_drm_card(root, device_dir, spec.card, spec.connectors)

    hwmon_dir = _write_hwmon_dir(root, device_dir, spec.hwmon, "amdgpu")
    _write_temps(hwmon_dir, spec.temps)
    if spec.power in (PowerFiles.AVERAGE, PowerFiles.BOTH):
        set_value(hwmon_dir / "power1_average", spec.power_average)
    if spec.power in (PowerFiles.INPUT, PowerFiles.BOTH):
        set_value(hwmon_dir / "power1_input", spec.power_input)
    if spec.power_cap is not None:
        set_value(hwmon_dir / "power1_cap", spec.power_cap.current)
        set_value(hwmon_dir / "power1_cap_default", spec.power_cap.default)
        set_value(hwmon_dir / "power1_cap_min", spec.power_cap.min)
        set_value(hwmon_dir / "power1_cap_max", spec.power_cap.max)
    _write(hwmon_dir / "energy1_input", spec.energy)
    _write(hwmon_dir / "fan1_input", spec.fan_rpm)
    if spec.sclk_hz is not None:
        set_value(hwmon_dir / "freq1_input", spec.sclk_hz)
        set_value(hwmon_dir / "freq1_label", "sclk")
    if spec.mclk_hz is not None:
        set_value(hwmon_dir / "freq2_input", spec.mclk_hz)
        set_value(hwmon_dir / "freq2_label", "mclk")
    set_value(hwmon_dir / "in0_input", 862)  # vddgfx, mV: present on real cards, not exported
    set_value(hwmon_dir / "in0_label", "vddgfx")
    return WrittenCard(spec, root, device_dir, card_dir, hwmon_dir)


def fleet_specs(card_numbers: Sequence[int]) -> list[AmdCardSpec]:
    """Discrete cards with the given card numbers, on buses 0x03, 0x13, 0x23… in that order."""
    # Each card its own serial number, as real boards have.
    return [
        replace(
            discrete_spec(card),
            pci_slot=f"0000:{0x03 + 0x10 * position:02x}:00.0",
            unique_id=f"5c0b2a1f6e8d4a{position:02x}",
        )
        for position, card in enumerate(card_numbers)
    ]


def write_amd_fleet(root: Path, card_numbers: Sequence[int]) -> None:
    """Write discrete cards with the given card numbers (slots from `fleet_specs`).

    Only the cards: add host chips with `write_k10temp` and friends.
    """
    for spec in fleet_specs(card_numbers):
        write_amd_card(root, spec)


def write_other_drm_card(root: Path, card: int, pci_slot: str, driver: str) -> Path:
    """A DRM card bound to another driver (`nvidia`, `i915`); returns its PCI device dir."""
    root = root.resolve()  # symlinks are computed from absolute paths
    pci_id = "10de:2684" if driver == "nvidia" else "8086:a780"
    device_dir = _write_pci_device(root, pci_slot, (), driver=driver, pci_id=pci_id, link=True)
    _write_drm_card(root, device_dir, card, ("DP-1",))
    return device_dir


def write_nvidia_gpu(root: Path, pci_slot: str) -> Path:
    """An NVIDIA datacenter GPU as PCI sysfs shows it (3D controller, class 0x030200, bound to
    `nvidia`, no DRM card without nvidia-drm); returns its PCI device dir. Its readings come
    from the fake NVML."""
    root = root.resolve()  # symlinks are computed from absolute paths
    device_dir = _write_pci_device(
        root, pci_slot, (), driver="nvidia", pci_id="10de:2335", link=True
    )
    set_value(device_dir / "class", "0x030200")
    return device_dir


def write_hwmon_chip(root: Path, spec: HwmonChipSpec) -> Path:
    """Write a host hwmon chip; returns its hwmon directory."""
    root = root.resolve()  # symlinks are computed from absolute paths
    parent = root / "devices" / spec.device
    parent.mkdir(parents=True, exist_ok=True)
    hwmon_dir = _write_hwmon_dir(root, parent, spec.hwmon, spec.name, glue=not spec.class_parent)
    _write_temps(hwmon_dir, spec.temps)
    return hwmon_dir


def write_k10temp(root: Path, hwmon: int | None = None) -> Path:
    """The AMD CPU's k10temp chip (`Tctl`, `Tccd1`, no crit files); returns its hwmon dir."""
    return write_hwmon_chip(root, replace(K10TEMP, hwmon=hwmon))


def _driver_links(written: WrittenCard) -> list[Path]:
    """The class and driver links amdgpu made for a card: its DRM nodes, hwmon, the driver's."""
    card = f"card{written.spec.card}"
    drm_class = written.root / "class" / "drm"
    return [
        drm_class / card,
        drm_class / f"renderD{128 + written.spec.card}",
        *(drm_class / f"{card}-{connector}" for connector in written.spec.connectors),
        written.root / "class" / "hwmon" / written.hwmon_dir.name,
        written.root / "bus" / "pci" / "drivers" / "amdgpu" / written.spec.pci_slot,
    ]


def remove_device(written: WrittenCard) -> None:
    """Simulate the card falling off the bus: its device tree and class links disappear."""
    for link in (
        *_driver_links(written),
        written.root / "bus" / "pci" / "devices" / written.spec.pci_slot,
    ):
        link.unlink(missing_ok=True)
    shutil.rmtree(written.device_dir)


# What amdgpu creates on the PCI device (amdgpu_pm.c, amdgpu_device.c, amdgpu_kms.c); the PCI
# core's own files (vendor, device, class, config, uevent...) stay after an unbind.
_AMDGPU_ATTRIBUTE = re.compile(
    r"^(gpu_busy_percent|mem_busy_percent|mem_info_\w+|pp_\w+|power_dpm_\w+|unique_id|"
    r"vbios_version|product_name|product_number|serial_number|gpu_metrics|pcie_bw|"
    r"current_link_\w+)$"
)


def unbind_driver(written: WrittenCard) -> None:
    """Simulate `echo SLOT > /sys/bus/pci/drivers/amdgpu/unbind`: the PCI directory stays.

    As drivers/base/dd.c and amdgpu's teardown leave it: the `driver` link and the driver's
    link to the device go, the uevent loses DRIVER=, the DRM card (and its class links), the
    hwmon directory and amdgpu's attributes go.
    """
    for link in (*_driver_links(written), written.device_dir / "driver"):
        link.unlink(missing_ok=True)
    for directory in ("drm", "hwmon"):
        shutil.rmtree(written.device_dir / directory, ignore_errors=True)
    for entry in written.device_dir.iterdir():
        if _AMDGPU_ATTRIBUTE.match(entry.name) and not entry.is_dir():
            entry.unlink()
    uevent = written.device_dir / "uevent"
    lines = uevent.read_text().splitlines(keepends=True)
    uevent.write_text("".join(line for line in lines if not line.startswith("DRIVER=")))
