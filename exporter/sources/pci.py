"""Which GPUs this host has, from PCI sysfs, and their numbering (`fleet.gpu_index`).

`number_host_gpus` is the one place `gpu` indices are decided, for the exporter and
`gpu-fleet-node` alike. PCI sysfs is read, not NVML, because NVML can take seconds to start
(or hang) and cannot see a card it has no driver for: neither must move the other cards'
indices, or a `power-cap 0` meant for an NVIDIA card lands on the AMD iGPU.

Check by hand: `grep -H . /sys/bus/pci/devices/*/class | grep ':0x03'` and the `vendor` file
beside each: `0x10de` NVIDIA, `0x1002` AMD.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable

from exporter.sources.sysfs import read_text
from fleet.gpu_index import GpuIndex, normalize_pci_bus_id

log = logging.getLogger(__name__)

# PCI vendor ids (pci.ids) of the GPUs we number; others (an Intel iGPU, a BMC's VGA) are not
# ours: no collector reads them and no action can name them.
GPU_VENDORS = {0x10DE: "nvidia", 0x1002: "amd"}
# PCI base class 0x03 "display controller": VGA 0x0300, 3D controller 0x0302 (datacenter
# NVIDIA cards), display controller 0x0380 (AMD Instinct).
DISPLAY_CLASS = 0x03


def pci_gpus(sysfs: str = "/sys") -> dict[str, str]:
    """PCI bus id to vendor (`nvidia`, `amd`) of every NVIDIA and AMD GPU in PCI sysfs.

    Reads `<sysfs>/bus/pci/devices/<bus id>/class` and `vendor`; a device whose files cannot
    be read (one going away while listed) is left out, and an unreadable directory gives {}.
    """
    root = os.path.join(sysfs, "bus", "pci", "devices")
    try:
        names = os.listdir(root)
    except OSError:
        return {}
    found: dict[str, str] = {}
    for name in names:
        klass = read_text(os.path.join(root, name, "class"))
        vendor_text = read_text(os.path.join(root, name, "vendor"))
        try:
            bus_id = normalize_pci_bus_id(name)
            klass_value = int(klass or "", 16)
            vendor_value = int(vendor_text or "", 16)
        except ValueError:
            continue
        vendor = GPU_VENDORS.get(vendor_value)
        if vendor is not None and klass_value >> 16 == DISPLAY_CLASS:
            found[bus_id] = vendor
    return found


def number_host_gpus(
    index: GpuIndex,
    *,
    sysfs: str = "/sys",
    expected: Iterable[str] = (),
    found: Iterable[str] = (),
) -> dict[str, int]:
    """Number the host's GPUs in `index`; the assignment, PCI bus id to `gpu` index.

    The one place `gpu` indices are decided, for the exporter and the node alike: the sorted
    union of the GPUs in PCI sysfs (`pci_gpus`), the roster's expected bus ids and the bus ids
    the vendor libraries `found` (those matter only where sysfs lacks a device, as with the
    fake NVML of tests and demos). Call it once, before the first `index_of`.
    """
    present = pci_gpus(sysfs)
    listed = {normalize_pci_bus_id(bus_id) for bus_id in expected}
    if listed - set(present):
        # Numbered all the same (a card missing at boot must keep its place), but a typo in the
        # roster would also give a phantom index: say which, once per start or request.
        log.warning(
            "the roster lists GPU(s) %s that %s/bus/pci/devices does not show: missing from "
            "the bus, or a typo in gpus.<vendor>.pci_bus_ids; each keeps its `gpu` index",
            ", ".join(sorted(listed - set(present))),
            sysfs,
        )
    index.register([*present, *listed, *found])
    return index.known()
