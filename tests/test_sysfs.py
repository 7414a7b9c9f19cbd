"""The sysfs readers, and the fixture builder's fidelity to the kernel's layout."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from exporter.sources.sysfs import StaticValue, read_bytes, read_float, read_int, read_text
from tests.sysfs_tree import (
    ACPITZ,
    apu_spec,
    discrete_spec,
    nvme_spec,
    remove_device,
    set_value,
    write_amd_card,
    write_hwmon_chip,
    write_k10temp,
)


def put(tmp_path: Path, content: bytes) -> str:
    path = tmp_path / "attr"
    path.write_bytes(content)
    return str(path)


@pytest.mark.parametrize(
    ("content", "text", "integer", "number"),
    [
        (b"42\n", "42", 42, 42.0),
        (b"  -273150 \n", "-273150", -273150, -273150.0),
        (b"1.5\n", "1.5", None, 1.5),
        (b"", None, None, None),
        (b"\n", None, None, None),
        (b"garbage\n", "garbage", None, None),
        (b"12abc\n", "12abc", None, None),
        (b"\xff\xfe\x00", None, None, None),
        (b"nan\n", "nan", None, None),
        (b"inf\n", "inf", None, None),
    ],
)
def test_readers_parse_or_give_none(
    tmp_path: Path, content: bytes, text: str | None, integer: int | None, number: float | None
) -> None:
    path = put(tmp_path, content)
    assert read_text(path) == text
    assert read_int(path) == integer
    assert read_float(path) == number


def test_missing_file_and_directory_give_none(tmp_path: Path) -> None:
    missing = str(tmp_path / "absent")
    for reader in (read_bytes, read_text, read_int, read_float):
        assert reader(missing) is None
        assert reader(str(tmp_path)) is None  # open() works on a directory, read() fails


def test_hex_ids_and_long_files(tmp_path: Path) -> None:
    assert read_int(put(tmp_path, b"0x1002\n"), 16) == 0x1002
    long = b"0: 500Mhz\n" * 1000  # more than one page: read to the end
    assert read_bytes(put(tmp_path, long)) == long


def test_readers_leak_no_descriptors(tmp_path: Path) -> None:
    path = put(tmp_path, b"7\n")
    before = len(os.listdir("/proc/self/fd"))
    for _ in range(100):
        read_int(path)
        read_int(str(tmp_path))  # the failing read closes its descriptor too
    assert len(os.listdir("/proc/self/fd")) == before


def test_static_value_is_cached_once_known_and_retried_while_unknown(tmp_path: Path) -> None:
    path = tmp_path / "mem_info_vram_total"
    path.write_text("garbage\n")
    static = StaticValue(str(path), read_int)
    assert static.exists
    assert static.get() is None
    set_value(path, 1024)
    assert static.get() == 1024  # retried while unknown
    set_value(path, 2048)
    assert static.get() == 1024  # cached once known
    absent = StaticValue(None, read_int)
    assert not absent.exists
    assert absent.get() is None


def test_builder_writes_the_kernels_symlinks(tmp_path: Path) -> None:
    card = write_amd_card(tmp_path, discrete_spec(card=0))
    root = tmp_path.resolve()
    device = root / "devices/pci0000:00/0000:03:00.0"
    assert card.device_dir == device
    assert (
        os.readlink(root / "class/drm/card0") == "../../devices/pci0000:00/0000:03:00.0/drm/card0"
    )
    assert os.readlink(device / "drm/card0/device") == "../../../0000:03:00.0"
    assert os.readlink(device / "driver") == "../../../bus/pci/drivers/amdgpu"
    assert os.readlink(root / "class/hwmon/hwmon0") == (
        "../../devices/pci0000:00/0000:03:00.0/hwmon/hwmon0"
    )
    assert os.readlink(device / "hwmon/hwmon0/device") == "../../../0000:03:00.0"
    assert (root / "class/drm/card0/device").resolve() == device
    assert (root / "class/drm/card0/device/driver").resolve() == root / "bus/pci/drivers/amdgpu"
    assert (root / "class/drm/card0-DP-1").resolve() == device / "drm/card0/card0-DP-1"
    assert (root / "class/hwmon/hwmon0/device").resolve() == device
    uevent = (device / "uevent").read_text().splitlines()
    assert "DRIVER=amdgpu" in uevent
    assert "PCI_SLOT_NAME=0000:03:00.0" in uevent
    assert "PCI_ID=1002:744C" in uevent
    assert read_text(str(device / "vendor")) == "0x1002"
    assert read_text(str(device / "pp_dpm_sclk")) == "0: 500Mhz\n1: 1800Mhz *\n2: 2500Mhz"
    hwmon = card.hwmon_dir
    assert read_text(str(hwmon / "name")) == "amdgpu"
    assert [read_text(str(hwmon / f"temp{n}_label")) for n in (1, 2, 3)] == [
        "edge",
        "junction",
        "mem",
    ]
    assert read_text(str(hwmon / "freq1_label")) == "sclk"
    assert read_text(str(hwmon / "freq2_label")) == "mclk"


def test_builder_apu_and_host_chips(tmp_path: Path) -> None:
    apu = write_amd_card(tmp_path, apu_spec())
    assert apu.device_dir == tmp_path.resolve() / "devices/pci0000:00/0000:00:08.1/0000:c5:00.0"
    files = set(os.listdir(apu.hwmon_dir))
    assert {"temp1_input", "temp1_label", "power1_input", "freq1_input"} <= files
    assert not files & {"temp2_input", "temp1_crit", "power1_average", "fan1_input", "freq2_input"}

    k10temp = write_k10temp(tmp_path)
    assert k10temp.name == "hwmon1"  # the next free number after the APU's hwmon0
    assert not [f for f in os.listdir(k10temp) if f.endswith("_crit")]  # Zen has none
    nvme = write_hwmon_chip(tmp_path, nvme_spec(0, "0000:02:00.0"))
    # nvme0 is a class device, so its hwmon sits directly in it (no hwmon/ glue directory).
    assert nvme.parent.name == "nvme0"
    assert os.readlink(nvme / "device") == "../../nvme0"
    assert read_int(str(nvme / "temp1_crit")) == 84_850
    acpitz = write_hwmon_chip(tmp_path, ACPITZ)
    assert not (acpitz / "temp1_label").exists()


def test_remove_device_takes_the_class_links_too(tmp_path: Path) -> None:
    card = write_amd_card(tmp_path, discrete_spec(card=10))
    remove_device(card)
    root = tmp_path.resolve()
    assert not card.device_dir.exists()
    assert sorted(os.listdir(root / "class/drm")) == []
    assert sorted(os.listdir(root / "class/hwmon")) == []
    assert sorted(os.listdir(root / "bus/pci/drivers/amdgpu")) == []
