"""GPU memory per model server: NVML's processes and AMD's DRM fdinfo, mapped to units by pid.

A pid belongs to a server when it is one of the processes of the server's systemd unit (its
control group, else its main process and descendants). Memory held by processes of no server
(another program, a ghost, the MPS server itself) is exported per GPU as unowned: it is the
memory a restarted server may find missing.

Runs after the NVIDIA collector in the same scrape and uses the process list that collector
read on its NVML worker (NVML is only ever called from that one thread).

Sample output::

    gpufleet_server_gpu_memory_bytes{gpu="0",server="alpha"} 2.1474836e+10
    gpufleet_server_gpu_memory_bytes{gpu="1",server="beta"} 2.0401094e+10
    gpufleet_gpu_unowned_memory_bytes{gpu="0"} 5.36870912e+08

Check by hand: `nvidia-smi --query-compute-apps=pid,used_memory --format=csv`, and on AMD
`grep -H drm-memory-vram /proc/PID/fdinfo/*`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Protocol

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.metrics_core import Metric

from exporter.collectors.base import CollectorError
from exporter.gpu_index import GpuIndex
from exporter.roster import Server
from exporter.sources import drm_fdinfo
from exporter.sources.systemd import SystemdError, UnitsReader, unit_pids


class ProcessMemorySource(Protocol):
    """What the NVIDIA collector offers: GPU memory by pid, per PCI bus id, of its last scrape."""

    def process_memory(self) -> dict[str, dict[int, int]]:
        """GPU memory by pid, per GPU (PCI bus id)."""
        ...


class ServerMemoryCollector:
    """Exports `gpufleet_server_gpu_memory_bytes` and `gpufleet_gpu_unowned_memory_bytes`."""

    name = "server_memory"

    def __init__(
        self,
        servers: Mapping[str, Server],
        units: UnitsReader,
        *,
        nvidia: ProcessMemorySource,
        amd_bus_ids: Callable[[], list[str]],
        gpu_index: GpuIndex,
        procfs: str = "/proc",
        sysfs: str = "/sys",
    ) -> None:
        self._servers = dict(servers)
        self._units = units
        self._nvidia = nvidia
        self._amd_bus_ids = amd_bus_ids
        self._gpu_index = gpu_index
        self._procfs = procfs
        self._sysfs = sysfs

    def _owners(self) -> tuple[dict[int, str], set[str]]:
        """Map each pid to its server; also the servers whose unit is active."""
        statuses = self._units.statuses() if self._servers else {}
        owners: dict[int, str] = {}
        active = set()
        for name, server in self._servers.items():
            status = statuses.get(server.unit)
            if status is None:
                continue
            if status.active:
                active.add(name)
            for pid in unit_pids(status, sysfs=self._sysfs, procfs=self._procfs):
                owners[pid] = name
        return owners, active

    def collect(self) -> Iterator[Metric]:
        """One scrape; raises `CollectorError` when processes cannot be attributed or seen."""
        try:
            owners, active = self._owners()
        except SystemdError as exc:
            # Without the units, every byte would read as unowned: say nothing rather than that.
            raise CollectorError(f"cannot map GPU memory to servers: {exc}") from None
        by_server: dict[tuple[str, str], int] = {}
        unowned: dict[str, int] = {}

        def add(pid: int, gpu: str, used: int) -> None:
            owner = owners.get(pid)
            if owner is None:
                unowned[gpu] += used
            else:
                by_server[owner, gpu] = by_server.get((owner, gpu), 0) + used

        for bus_id, processes in self._nvidia.process_memory().items():
            gpu = str(self._gpu_index.index_of(bus_id))
            unowned.setdefault(gpu, 0)
            for pid, used in processes.items():
                add(pid, gpu, used)
        hidden: list[int] = []
        amd = {bus_id: str(self._gpu_index.index_of(bus_id)) for bus_id in self._amd_bus_ids()}
        if amd:
            found = drm_fdinfo.scan(drm_fdinfo.all_pids(self._procfs), procfs=self._procfs)
            hidden = found.hidden_pids
            for gpu in amd.values():
                unowned.setdefault(gpu, 0)
            for (pid, pdev), used in found.vram.items():
                if pdev in amd:
                    add(pid, amd[pdev], used)
        # A running server on its roster GPU that holds nothing there is worth a 0, not silence.
        for name in active:
            roster_gpu = self._servers[name].gpu
            if roster_gpu is not None and str(roster_gpu) in unowned:
                by_server.setdefault((name, str(roster_gpu)), 0)

        served = GaugeMetricFamily(
            "gpufleet_server_gpu_memory_bytes",
            "GPU memory held by the processes of a model server's unit.",
            labels=["server", "gpu"],
        )
        for (server, gpu), used in sorted(by_server.items()):
            served.add_metric([server, gpu], used)
        other = GaugeMetricFamily(
            "gpufleet_gpu_unowned_memory_bytes",
            "GPU memory held by processes that belong to no roster server.",
            labels=["gpu"],
        )
        for gpu, used in sorted(unowned.items()):
            other.add_metric([gpu], used)
        yield from (f for f in (served, other) if f.samples)
        if hidden:
            raise CollectorError(
                f"cannot read the open files of {len(hidden)} processes (e.g. pid {hidden[0]}): "
                "their AMD GPU memory is not counted; the exporter needs root, or "
                "CAP_SYS_PTRACE and CAP_DAC_READ_SEARCH"
            )

    def close(self) -> None:
        """Nothing to release."""
