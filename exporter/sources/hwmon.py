"""hwmon chips: their names, temperature sensors and the sensors' limits.

Shared by the amd collector (the amdgpu chip under each card's `device/hwmon/`) and the hwmon
collector (every chip under `<sysfs>/class/hwmon/`). Units and names follow the kernel's
Documentation/hwmon/sysfs-interface.rst: `name` is the chip's name; `temp<N>_input`,
`temp<N>_crit` and `temp<N>_emergency` are in millidegrees Celsius; `temp<N>_label` is an
optional free-form label ("edge", "Tctl", "Composite"), and without one lm-sensors calls the
sensor `temp<N>`, as we do.

Series are unique by construction. A driver may give two channels one label (node_exporter's
captured `hwmon4` has `temp1_label` and `temp2_label` both `foosensor`), and two samples with
one label set are a broken exposition (Prometheus keeps one of them, silently). So within a
chip the lowest-numbered channel keeps the label and each later namesake is called
`<label>_temp<N>` (`foosensor`, `foosensor_temp2`): a label that is unique, as nearly all are,
keeps its meaning for the rules, dashboards and the roster's `thermal: {chip/sensor: ...}`
keys, and which channel is which can be read off the name. Chips that share a name are
numbered the same way by `chip_labels`.

Discovery lists each chip's directory once; what a scrape reads is precomputed paths.
"""

from __future__ import annotations

import os
from collections.abc import Collection, Iterable
from dataclasses import dataclass

from exporter.sources.sysfs import StaticValue, read_int, read_text
from exporter.sources.text import clean_label

_TEMP_VALUES = ("_input", "_crit", "_emergency")


def read_millicelsius(path: str) -> float | None:
    """A hwmon temperature file (millidegrees Celsius) in degrees Celsius; None if unreadable."""
    value = read_int(path)
    return None if value is None else value / 1000


@dataclass(frozen=True, slots=True)
class TempSensor:
    """One `temp<N>` channel of a chip: where its reading is and its (static) limits."""

    number: int
    sensor: str
    input_path: str | None
    crit: StaticValue[float]
    emergency: StaticValue[float]


@dataclass(frozen=True, slots=True)
class HwmonChip:
    """A hwmon chip as found at discovery: its directory listing and temperature channels."""

    path: str
    name: str
    device_path: str
    files: frozenset[str]
    temps: tuple[TempSensor, ...]

    def file(self, attribute: str) -> str | None:
        """The path of `attribute` in this chip's directory, or None if it did not exist."""
        return os.path.join(self.path, attribute) if attribute in self.files else None

    def label(self, channel: str) -> str | None:
        """The content of `<channel>_label` (e.g. `freq1` → "sclk"), or None."""
        path = self.file(f"{channel}_label")
        return None if path is None else read_text(path)


def _channel_numbers(files: Iterable[str], prefix: str, suffix: str) -> list[int]:
    """The N of every `<prefix><N><suffix>` file, ascending."""
    numbers = []
    for entry in files:
        if entry.startswith(prefix) and entry.endswith(suffix):
            digits = entry[len(prefix) : len(entry) - len(suffix)]
            if digits.isascii() and digits.isdigit():
                numbers.append(int(digits))
    return sorted(numbers)


def channel_numbers(chip: HwmonChip, prefix: str, suffix: str = "_input") -> list[int]:
    """The channel numbers of `<prefix><N><suffix>` files of the chip (`freq`, `fan`…)."""
    return _channel_numbers(chip.files, prefix, suffix)


def read_chip(path: str) -> HwmonChip | None:
    """Read a chip's directory once; None if it cannot be listed or has no name.

    The name is the chip's `name` file; drivers still on the deprecated
    `hwmon_device_register()` keep it in `device/name` (libsensors looks there too).
    """
    try:
        files = frozenset(os.listdir(path))
    except OSError:
        return None
    name = read_text(os.path.join(path, "name")) or read_text(os.path.join(path, "device", "name"))
    if name is None:
        # sysfs-interface.rst makes `name` mandatory, yet captures exist without it
        # (node_exporter's `hwmon4`). Its directory name is the only handle there is: not
        # stable across boots, but its temperatures are better seen than dropped.
        name = os.path.basename(os.path.normpath(path))
    name = clean_label(name)
    device_link = os.path.join(path, "device")
    # hwmon numbers follow probe order and change across boots; the parent device's path
    # (PCI address, platform device) does not, so it orders chips that share a name.
    device_path = os.path.realpath(device_link if "device" in files else path)

    def path_or_none(attribute: str) -> str | None:
        return os.path.join(path, attribute) if attribute in files else None

    # A channel is known by any of its value files, so that a missing `temp2_input` loses
    # only the reading, not junction's crit and emergency limits beside it.
    numbers = sorted(
        {n for suffix in _TEMP_VALUES for n in _channel_numbers(files, "temp", suffix)}
    )
    temps = []
    taken: set[str] = set()
    for number in numbers:
        channel = f"temp{number}"
        label_path = path_or_none(f"{channel}_label")
        label = read_text(label_path) if label_path is not None else None
        label = clean_label(label) if label is not None else None
        sensor = unique_name(label or channel, channel, taken)
        taken.add(sensor)
        temps.append(
            TempSensor(
                number=number,
                sensor=sensor,
                input_path=path_or_none(f"{channel}_input"),
                crit=StaticValue(path_or_none(f"{channel}_crit"), read_millicelsius),
                emergency=StaticValue(path_or_none(f"{channel}_emergency"), read_millicelsius),
            )
        )
    return HwmonChip(path=path, name=name, device_path=device_path, files=files, temps=tuple(temps))


def unique_name(name: str, qualifier: str, taken: Collection[str]) -> str:
    """`name`, or `name_<qualifier>` (then `name_<qualifier>_2`...) when `name` is taken."""
    if name not in taken:
        return name
    candidate, count = f"{name}_{qualifier}", 1
    while candidate in taken:
        count += 1
        candidate = f"{name}_{qualifier}_{count}"
    return candidate


def list_chips(sysfs: str, *, exclude_names: Collection[str] = ()) -> list[HwmonChip]:
    """Every readable chip under `<sysfs>/class/hwmon`, in order of their device paths."""
    root = os.path.join(sysfs, "class", "hwmon")
    try:
        entries = os.listdir(root)
    except OSError:
        return []
    chips = []
    for entry in entries:
        if not entry.startswith("hwmon"):
            continue
        chip = read_chip(os.path.join(root, entry))
        if chip is not None and chip.name not in exclude_names:
            chips.append(chip)
    chips.sort(key=lambda c: (c.device_path, os.path.realpath(c.path)))
    return chips


def chip_labels(chips: Iterable[HwmonChip]) -> list[tuple[str, HwmonChip]]:
    """The `chip` label of each chip: its name, and `name_1`, `name_2`… for later namesakes.

    `chips` must already be in a stable order (`list_chips` orders by device path).
    """
    seen: dict[str, int] = {}
    taken: set[str] = set()
    labelled = []
    for chip in chips:
        count = seen.get(chip.name, 0)
        seen[chip.name] = count + 1
        label = chip.name if count == 0 else f"{chip.name}_{count}"
        # A chip really named `nvme_1` beside two `nvme`: still one label per chip.
        label = unique_name(label, "chip", taken)
        taken.add(label)
        labelled.append((label, chip))
    return labelled
