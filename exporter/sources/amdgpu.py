"""AMD GPUs through the amdgpu driver's sysfs files: discovery, identity and readings.

Discovery finds the DRM cards (`card<N>`) whose PCI device is bound to `amdgpu`:
- with libudev (`pyudev`, subsystem `drm`) when reading the real `/sys` — libudev cannot be
  pointed at another root;
- otherwise by a plain walk of `<sysfs>/class/drm/card*` (fixture trees, containers without
  libudev). Names are `card` + digits only, so connectors (`card0-DP-1`) and render nodes
  (`renderD128`) are skipped and `card10` and above are found (node_exporter's drm collector
  globs `card[0-9]` and misses them).

Each card's identity and static values (totals, limits, maximum clocks) are read once and
cached; the paths of the changing files are computed once, so a scrape is only the reads of
the changing values. Units (Documentation/gpu/amdgpu/driver-misc.rst, thermal.rst and
Documentation/hwmon/sysfs-interface.rst): `*_busy_percent` in percent, `mem_info_*` in bytes,
hwmon temperatures in millidegrees Celsius, power and power caps in microwatts, energy in
microjoules, `freq*_input` in hertz, `fan1_input` in RPM, `pp_dpm_*` levels in MHz. Every value
is returned in base units (ratio 0-1, bytes, °C, W, J, Hz).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field

from exporter.sources.hwmon import HwmonChip, TempSensor, channel_numbers, read_chip
from exporter.sources.sysfs import StaticValue, read_bytes, read_int, read_text
from exporter.sources.text import clean_label
from fleet.gpu_index import normalize_pci_bus_id

try:
    import pyudev
except ImportError:  # optional binding: the sysfs walk covers its absence
    pyudev = None

log = logging.getLogger(__name__)

DRIVER = "amdgpu"
MEMORY_POOLS = ("vram", "vis_vram", "gtt")
# hwmon `freq<N>_label` → our `clock` label (thermal.rst: freq1 is "sclk", the gfx/compute
# clock; freq2 is "mclk", the memory clock, dGPUs only).
CLOCK_LABELS = {"sclk": "graphics", "mclk": "memory"}
# pp_dpm_<file> → our `clock` label.
DPM_CLOCKS = (("pp_dpm_sclk", "graphics"), ("pp_dpm_mclk", "memory"))


def is_card_name(name: str) -> bool:
    """Whether a DRM class entry is a card (`card0`, `card12`), not a connector or render node."""
    digits = name[4:]
    return name.startswith("card") and digits.isascii() and digits.isdigit()


def parse_uevent(text: str | None) -> dict[str, str]:
    """`KEY=value` lines of a `uevent` file as a dict (empty when unreadable)."""
    if text is None:
        return {}
    pairs = {}
    for line in text.splitlines():
        key, sep, value = line.partition("=")
        if sep:
            pairs[key.strip()] = value.strip()
    return pairs


def parse_dpm_max_hz(text: str) -> float | None:
    """The highest clock level of a `pp_dpm_sclk`/`pp_dpm_mclk` file, in Hz.

    The format (Documentation/gpu/amdgpu/thermal.rst, pp_dpm_*) is one level a line,
    `<index>: <clock>Mhz`, the current level marked ` *`; RDNA parts add a deep-sleep line
    `S: 19Mhz`. Levels ascend, but the maximum is taken rather than the last line so that
    ordering quirks cannot matter. None when no line parses.
    """
    best: int | None = None
    for line in text.splitlines():
        _, sep, rest = line.partition(":")
        words = rest.split()
        if not sep or not words:
            continue
        word = words[0].lower()
        if not word.endswith("mhz"):
            continue
        try:
            mhz = int(word[:-3])
        except ValueError:
            continue
        if best is None or mhz > best:
            best = mhz
    return None if best is None else best * 1_000_000


def _read_dpm_max_hz(path: str) -> float | None:
    text = read_text(path)
    return None if text is None else parse_dpm_max_hz(text)


def _read_identity_text(path: str) -> str | None:
    """Text of an identity file; "" when empty (known: nothing there), None when unreadable.

    Older kernels create `product_name` empty on boards without a FRU EEPROM: that is an
    answer (no model), not a failure to retry every scrape.
    """
    data = read_bytes(path)
    if data is None or b"\0" in data:
        return None
    try:
        return clean_label(data.decode().strip())
    except UnicodeDecodeError:
        return None


def _read_hex(path: str) -> int | None:
    return read_int(path, 16)


def _read_microunits(path: str) -> float | None:
    value = read_int(path)
    return None if value is None else value / 1_000_000


@dataclass(frozen=True, slots=True)
class CardLocation:
    """Where a card lives: DRM name, its DRM directory, its PCI device directory and slot."""

    card: str
    card_dir: str
    device_dir: str
    pci_slot: str


class UdevUnavailableError(Exception):
    """libudev (or its `pyudev` binding) cannot be used here."""


def _card_number(location: CardLocation) -> int:
    return int(location.card[4:])


def _driven_by_amdgpu(device_link: str, uevent: dict[str, str], *, fresh: bool = False) -> bool:
    """Whether the device's driver is amdgpu: its `driver` link, else its uevent's DRIVER.

    `fresh`: read the uevent here, only where the link is missing (a scrape's check: readlink
    alone is the common case).
    """
    try:
        return os.path.basename(os.readlink(os.path.join(device_link, "driver"))) == DRIVER
    except OSError:
        pass  # no driver link (unbound, or a copied tree: `cp -r` drops it): the uevent says
    if fresh:
        uevent = parse_uevent(read_text(os.path.join(device_link, "uevent")))
    return uevent.get("DRIVER") == DRIVER


def walk_cards(sysfs: str) -> list[CardLocation]:
    """Find amdgpu cards by walking `<sysfs>/class/drm`, in card-number order."""
    drm = os.path.join(sysfs, "class", "drm")
    try:
        entries = os.listdir(drm)
    except OSError:
        return []  # no DRM at all (a container, a headless host): no cards
    found = []
    for entry in entries:
        if not is_card_name(entry):
            continue
        card_dir = os.path.join(drm, entry)
        device_link = os.path.join(card_dir, "device")
        uevent = parse_uevent(read_text(os.path.join(device_link, "uevent")))
        if not _driven_by_amdgpu(device_link, uevent):
            continue
        device_dir = os.path.realpath(device_link)
        raw_slot = uevent.get("PCI_SLOT_NAME") or os.path.basename(device_dir)
        try:
            slot = normalize_pci_bus_id(raw_slot)
        except ValueError:
            log.warning("amdgpu card %s: no PCI slot (%r); skipped", card_dir, raw_slot)
            continue
        found.append(CardLocation(entry, card_dir, device_dir, slot))
    found.sort(key=_card_number)
    return found


def udev_cards() -> list[CardLocation]:
    """List amdgpu cards as libudev enumerates them (real `/sys` only), in card-number order.

    Raises `UdevUnavailableError` when pyudev or libudev cannot be loaded or enumerated.
    """
    if pyudev is None:
        raise UdevUnavailableError("pyudev is not installed")
    try:
        context = pyudev.Context()
        devices = list(context.list_devices(subsystem="drm"))
    except (ImportError, OSError) as err:  # pyudev raises ImportError when libudev is missing
        raise UdevUnavailableError(str(err)) from err
    found = []
    for device in devices:
        name = str(device.sys_name)
        if not is_card_name(name):
            continue
        parent = device.find_parent("pci")
        if parent is None or parent.driver != DRIVER:
            continue
        raw_slot = str(parent.properties.get("PCI_SLOT_NAME") or parent.sys_name)
        try:
            slot = normalize_pci_bus_id(raw_slot)
        except ValueError:
            continue
        found.append(CardLocation(name, str(device.sys_path), str(parent.sys_path), slot))
    found.sort(key=_card_number)
    return found


def discover_cards(sysfs: str, *, use_udev: bool) -> list[CardLocation]:
    """Find amdgpu cards via libudev when asked and usable, else via the sysfs walk."""
    if use_udev:
        try:
            return udev_cards()
        except UdevUnavailableError as err:
            log.warning("libudev unusable (%s); walking %s/class/drm instead", err, sysfs)
    return walk_cards(sysfs)


@dataclass(frozen=True, slots=True)
class AmdIdentity:
    """A card's identity, as on `gpufleet_gpu_info` ("" where unknown)."""

    card: str
    pci_bus_id: str
    uuid: str
    model: str
    pci_id: str
    vbios: str


@dataclass(slots=True)
class AmdReading:
    """The changing values of one card at one scrape, in base units; None/absent = unknown.

    `any()`: whether anything was read at all; a card that answers nothing is not up.
    """

    utilization: float | None = None
    memory_utilization: float | None = None
    memory_used: list[tuple[str, int]] = field(default_factory=list)
    temperatures: list[tuple[str, float]] = field(default_factory=list)
    power_watts: float | None = None
    power_cap_watts: float | None = None
    energy_joules: float | None = None
    fan_rpm: int | None = None
    clocks: list[tuple[str, float]] = field(default_factory=list)

    def any(self) -> bool:
        """Whether at least one changing value was read."""
        return bool(self.memory_used or self.temperatures or self.clocks) or any(
            v is not None
            for v in (
                self.utilization,
                self.memory_utilization,
                self.power_watts,
                self.power_cap_watts,
                self.energy_joules,
                self.fan_rpm,
            )
        )


class AmdCard:
    """One amdgpu card: identity and static values cached, changing files' paths precomputed."""

    def __init__(self, location: CardLocation) -> None:
        self.location = location
        device = location.device_dir
        try:
            files = frozenset(os.listdir(device))
        except OSError:
            files = frozenset()

        def at(name: str) -> str | None:
            return os.path.join(device, name) if name in files else None

        uevent = parse_uevent(read_text(os.path.join(device, "uevent")))
        # PCI_ID is upper case (`1002:744C`); the `vendor`/`device` files (`0x1002`) win.
        self._uevent_pci_id = uevent.get("PCI_ID", "").lower()
        self._uuid = StaticValue(at("unique_id"), _read_identity_text)
        self._vbios = StaticValue(at("vbios_version"), _read_identity_text)
        self._model = StaticValue(at("product_name"), _read_identity_text)
        self._vendor_id = StaticValue(at("vendor"), _read_hex)
        self._device_id = StaticValue(at("device"), _read_hex)

        self._gpu_busy = at("gpu_busy_percent")
        self._mem_busy = at("mem_busy_percent")
        self._pools_used = tuple(
            (pool, path) for pool in MEMORY_POOLS if (path := at(f"mem_info_{pool}_used"))
        )
        self._pools_total = tuple(
            (pool, StaticValue(path, read_int))
            for pool in MEMORY_POOLS
            if (path := at(f"mem_info_{pool}_total"))
        )
        self._dpm_max = tuple(
            (clock, StaticValue(path, _read_dpm_max_hz))
            for name, clock in DPM_CLOCKS
            if (path := at(name))
        )

        chip = _card_hwmon(device) if "hwmon" in files else None
        self.hwmon_dir = chip.path if chip is not None else None
        self._temps: tuple[TempSensor, ...] = chip.temps if chip is not None else ()
        self._temp_inputs = tuple((t.sensor, t.input_path) for t in self._temps if t.input_path)
        self._power: tuple[str, ...] = ()
        self._power_cap: str | None = None
        self._power_limits: tuple[tuple[str, StaticValue[float]], ...] = ()
        self._energy: str | None = None
        self._fan: str | None = None
        self._clocks: tuple[tuple[str, str], ...] = ()
        # The power-cap files by name (`power1_cap`, `power1_cap_min`, ...), for gpu-fleet-node.
        self.power_cap_files: dict[str, str] = {}
        if chip is not None:
            self.power_cap_files = {
                name: path
                for name in ("power1_cap", "power1_cap_min", "power1_cap_max", "power1_cap_default")
                if (path := chip.file(name))
            }
            # thermal.rst: power1_input is instantaneous, power1_average averaged; newer ASICs
            # (and APUs) have only power1_input, older only power1_average. Prefer the former.
            self._power = tuple(
                p for p in (chip.file("power1_input"), chip.file("power1_average")) if p
            )
            self._power_cap = chip.file("power1_cap")
            self._power_limits = tuple(
                (kind, StaticValue(path, _read_microunits))
                for kind, name in (
                    ("default", "power1_cap_default"),
                    ("min", "power1_cap_min"),
                    ("max", "power1_cap_max"),
                )
                if (path := chip.file(name))
            )
            self._energy = chip.file("energy1_input")
            self._fan = chip.file("fan1_input")
            self._clocks = _hwmon_clocks(chip)

    def present(self) -> bool:
        """Whether the card's PCI device directory still exists (gone: fell off the bus)."""
        return os.path.exists(self.location.device_dir)

    def bound(self) -> bool:
        """Whether amdgpu still drives the card (an unbind keeps the PCI directory).

        After `echo SLOT > /sys/bus/pci/drivers/amdgpu/unbind` the `driver` link, the DRM card,
        `hwmon/` and amdgpu's attributes go; the uevent loses its DRIVER line with the link.
        """
        return _driven_by_amdgpu(self.location.device_dir, {}, fresh=True)

    def identity(self) -> AmdIdentity:
        """The card's identity from cached values (unknown parts re-read until known)."""
        vendor, device = self._vendor_id.get(), self._device_id.get()
        pci_id = (
            f"{vendor:04x}:{device:04x}"
            if vendor is not None and device is not None
            else self._uevent_pci_id
        )
        return AmdIdentity(
            card=self.location.card,
            pci_bus_id=self.location.pci_slot,
            uuid=self._uuid.get() or "",
            model=self._model.get() or "",
            pci_id=pci_id,
            vbios=self._vbios.get() or "",
        )

    def memory_totals(self) -> list[tuple[str, int]]:
        """(pool, bytes) of each memory pool whose total is known."""
        return [(pool, v) for pool, static in self._pools_total if (v := static.get()) is not None]

    def temperature_limits(self) -> list[tuple[str, float | None, float | None]]:
        """(sensor, critical °C, emergency °C) of each temperature channel."""
        return [(t.sensor, t.crit.get(), t.emergency.get()) for t in self._temps]

    def power_limits(self) -> list[tuple[str, float]]:
        """(kind, W) of the static power-cap bounds: `default`, `min`, `max`."""
        return [(kind, v) for kind, static in self._power_limits if (v := static.get()) is not None]

    def clock_max(self) -> list[tuple[str, float]]:
        """(clock, Hz) of the highest DPM level of each clock."""
        return [(clock, v) for clock, static in self._dpm_max if (v := static.get()) is not None]

    def read(self) -> AmdReading:
        """Read the changing values; each unreadable file leaves only its own field unknown."""
        reading = AmdReading()
        if self._gpu_busy is not None and (v := read_int(self._gpu_busy)) is not None:
            reading.utilization = v / 100
        if self._mem_busy is not None and (v := read_int(self._mem_busy)) is not None:
            reading.memory_utilization = v / 100
        for pool, path in self._pools_used:
            if (v := read_int(path)) is not None:
                reading.memory_used.append((pool, v))
        for sensor, path in self._temp_inputs:
            if (v := read_int(path)) is not None:
                reading.temperatures.append((sensor, v / 1000))
        for path in self._power:
            # Falls through to power1_average when power1_input exists but fails (EOPNOTSUPP
            # on some SMU firmware) as well as when it is absent.
            if (v := read_int(path)) is not None:
                reading.power_watts = v / 1_000_000
                break
        if self._power_cap is not None and (v := read_int(self._power_cap)) is not None:
            reading.power_cap_watts = v / 1_000_000
        if self._energy is not None and (v := read_int(self._energy)) is not None:
            reading.energy_joules = v / 1_000_000
        if self._fan is not None:
            reading.fan_rpm = read_int(self._fan)
        for clock, path in self._clocks:
            if (v := read_int(path)) is not None:
                reading.clocks.append((clock, v))
        return reading


def _card_hwmon(device_dir: str) -> HwmonChip | None:
    """The card's hwmon chip (`<device>/hwmon/hwmon<N>`; amdgpu registers exactly one)."""
    parent = os.path.join(device_dir, "hwmon")
    try:
        entries = sorted(e for e in os.listdir(parent) if e.startswith("hwmon"))
    except OSError:
        return None
    for entry in entries:
        chip = read_chip(os.path.join(parent, entry))
        if chip is not None:
            return chip
    return None


def _hwmon_clocks(chip: HwmonChip) -> tuple[tuple[str, str], ...]:
    clocks = []
    for number in channel_numbers(chip, "freq"):
        clock = CLOCK_LABELS.get(chip.label(f"freq{number}") or "")
        path = chip.file(f"freq{number}_input")
        if clock is not None and path is not None:
            clocks.append((clock, path))
    return tuple(clocks)
