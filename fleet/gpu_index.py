"""The `gpu` label: each GPU's index in PCI bus order among all of the host's GPUs.

NVIDIA cards and AMD cards (an iGPU beside discrete cards included) share one numbering, so
they never share an index. `GpuIndex` holds it, keyed by PCI bus id in the form
`normalize_pci_bus_id` gives (the roster, the exporter, `gpu-fleet-node` and the remediator's
power actions all compare bus ids through it). The host side fills it with one function,
`exporter.sources.pci.number_host_gpus`, which the exporter and `gpu-fleet-node` both call: the
sorted PCI bus ids of every GPU that PCI sysfs shows, of every GPU the roster lists
(`gpus.<vendor>.pci_bus_ids`) and of those the vendor libraries found.

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

import threading
from collections.abc import Iterable


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
