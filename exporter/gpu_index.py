"""The `gpu` label: each GPU's index in PCI bus order among all of the host's GPUs.

NVIDIA cards and AMD cards (an iGPU beside discrete cards included) share one numbering, so
they never share an index. The numbering comes from one function, `number_host_gpus`, which
the exporter and `gpu-fleet-node` both call: the sorted PCI bus ids of every GPU that PCI sysfs
shows (`<sysfs>/bus/pci/devices/*`: display class `0x03xxxx`, vendor NVIDIA `0x10de` or AMD
`0x1002`), of every GPU the roster lists (`gpus.<vendor>.pci_bus_ids`) and of those the vendor
libraries found. PCI sysfs is read, not NVML, because NVML can take seconds to start (or hang)
and cannot see a card it has no driver for: neither must move the other cards' indices, or a
`power-cap 0` meant for an NVIDIA card lands on the AMD iGPU.

Indices are fixed for the exporter's lifetime: a GPU that falls off the bus keeps its index
(and shows `gpufleet_gpu_up 0`), and NVML renumbering its devices after a re-initialisation
changes nothing, because GPUs are keyed by PCI bus id, not by NVML index. Across restarts they
are stable while the same cards are on the bus, and also when one is missing at boot if the
roster lists the bus ids. Actions carry the bus id with the index, so a numbering that
differs anyway is refused by the node instead of acting on another card.

Check by hand: `lspci -D -d ::0300; lspci -D -d ::0302; lspci -D -d ::0380` (or
`grep -H . /sys/bus/pci/devices/*/class | grep ':0x03'`), sorted: the position is `gpu`.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Iterable

from exporter.sources.sysfs import read_text

log = logging.getLogger(__name__)

# PCI vendor ids (pci.ids) of the GPUs we number; others (an Intel iGPU, a BMC's VGA) are not
# ours: no collector reads them and no action can name them.
GPU_VENDORS = {0x10DE: "nvidia", 0x1002: "amd"}
# PCI base class 0x03 "display controller": VGA 0x0300, 3D controller 0x0302 (datacenter
# NVIDIA cards), display controller 0x0380 (AMD Instinct).
DISPLAY_CLASS = 0x03


def normalize_pci_bus_id(raw: str) -> str:
    """Return the sysfs form of a PCI bus id: lower case, 4-digit domain (`0000:41:00.0`).

    NVML reports `00000000:41:00.0` (an 8-digit domain, upper case); sysfs and the roster use
    the Linux form. Raises `ValueError` for a string that is not a PCI address.
    """
    text = raw.strip().lower()
    parts = text.split(":")
    if len(parts) == 2:  # bus:dev.fn without a domain
        parts = ["0000", *parts]
    if len(parts) != 3 or "." not in parts[2]:
        raise ValueError(f"not a PCI bus id: {raw!r}")
    domain, bus, devfn = parts
    dev, _, fn = devfn.partition(".")
    try:
        dom_i, bus_i, dev_i, fn_i = int(domain, 16), int(bus, 16), int(dev, 16), int(fn, 16)
    except ValueError:
        raise ValueError(f"not a PCI bus id: {raw!r}") from None
    return f"{dom_i:04x}:{bus_i:02x}:{dev_i:02x}.{fn_i:x}"


class GpuIndex:
    """Assigns and remembers `gpu` indices by PCI bus id. Thread-safe."""

    def __init__(self) -> None:
        self._by_bus_id: dict[str, int] = {}
        self._lock = threading.Lock()

    def register(self, pci_bus_ids: Iterable[str]) -> None:
        """Give the unknown ids the next free indices, in PCI bus order among themselves."""
        with self._lock:
            fresh = sorted({normalize_pci_bus_id(b) for b in pci_bus_ids} - set(self._by_bus_id))
            for bus_id in fresh:
                self._by_bus_id[bus_id] = len(self._by_bus_id)

    def index_of(self, pci_bus_id: str) -> int:
        """The GPU's index; a GPU never seen before gets the next free one."""
        bus_id = normalize_pci_bus_id(pci_bus_id)
        with self._lock:
            if bus_id not in self._by_bus_id:
                self._by_bus_id[bus_id] = len(self._by_bus_id)
            return self._by_bus_id[bus_id]

    def known(self) -> dict[str, int]:
        """A copy of the assignment, PCI bus id to index."""
        with self._lock:
            return dict(self._by_bus_id)


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
