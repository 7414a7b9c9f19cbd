"""GPU memory per model server: NVML's processes and AMD's DRM fdinfo, mapped to units by pid.

A pid belongs to a server when it is one of the processes of the server's systemd unit (its
control group, else its main process and descendants). Memory held by processes of no server
(another program, a ghost, the MPS server itself) is exported per GPU as unowned: it is the
memory a restarted server may find missing.

Runs after the NVIDIA collector in the same scrape and uses the process list that collector
read on its NVML worker (NVML is only ever called from that one thread).

Unknown is absent, never 0 (a 0 would claim "holds nothing"):

- NVIDIA: a GPU whose process list NVML cannot give (NO_PERMISSION, NOT_SUPPORTED, a GPU not
  read this scrape) exports neither series for that GPU. A process listed without an amount
  (`usedGpuMemory` None: MIG, vGPU) leaves its server's series out on that GPU, or the
  unowned series when it belongs to no server.
- AMD: a server one of whose processes' `/proc/PID/fd` may not be read has no series on any
  AMD GPU (which GPU it uses cannot be told); one hidden process of nobody leaves out the
  unowned series of every AMD GPU. The collector fails with a message that says why.

Cost on AMD: the units' own processes are read every scrape (their fdinfo, a handful of
files). "Unowned" needs every other process's fds; that walk of /proc runs under a time budget
per scrape (`unowned_budget_seconds`, 3 ms by default, as the ports collector names ghosts),
continued where it stopped on the next scrape; the unowned series shows the last finished walk
(absent until the first one finishes, a few scrapes after start on a busy host).

Sample output::

    gpufleet_server_gpu_memory_bytes{gpu="0",server="alpha"} 2.1474836e+10
    gpufleet_server_gpu_memory_bytes{gpu="1",server="beta"} 2.0401094e+10
    gpufleet_gpu_unowned_memory_bytes{gpu="0"} 5.36870912e+08

Check by hand: `nvidia-smi --query-compute-apps=pid,used_memory --format=csv`, and on AMD
`grep -H drm-memory-vram /proc/PID/fdinfo/*`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Protocol

from prometheus_client.metrics_core import Metric

from exporter.collectors import catalogue
from exporter.collectors.base import CollectorError
from exporter.sources import drm_fdinfo
from exporter.sources.procfs import all_pids
from exporter.sources.procnet import FD_PRIVILEGE
from exporter.sources.systemd import SystemdError, UnitsReader, unit_pids
from fleet.gpu_index import GpuIndex
from fleet.roster import Server

# Time a scrape may spend reading other processes' fds for the AMD unowned memory.
UNOWNED_BUDGET_SECONDS = 0.003


@dataclass
class GpuProcesses:
    """What NVML listed on one GPU in one scrape."""

    used: dict[int, int] = field(default_factory=dict)  # pid -> bytes
    unknown: set[int] = field(default_factory=set)  # listed, amount not available
    incomplete: str | None = None  # why the list itself is not whole (a failed call)


class ProcessMemorySource(Protocol):
    """What the NVIDIA collector offers: per PCI bus id, the processes of its last scrape."""

    def process_memory(self) -> dict[str, GpuProcesses]:
        """The processes of each GPU read this scrape (a GPU not read is left out)."""
        ...


_ClientOwner = tuple[int, int]  # (pid, vram bytes) of a DRM client, as a walk found it


@dataclass
class _UnownedWalk:
    """A read of every process's amdgpu DRM clients, spread over scrapes."""

    pending: list[int]  # pids still to read, descending (pop() gives the lowest)
    clients: dict[tuple[str, str], _ClientOwner] = field(default_factory=dict)
    hidden: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class _UnownedResult:
    """A finished walk."""

    clients: dict[tuple[str, str], _ClientOwner]
    hidden: tuple[int, ...]


@dataclass
class _Tally:
    """One scrape's figures, and what is unknown among them."""

    by_server: dict[tuple[str, str], int] = field(default_factory=dict)
    unowned: dict[str, int] = field(default_factory=dict)  # gpu -> bytes; only known GPUs
    known: set[str] = field(default_factory=set)  # GPUs whose per-server figures are known
    unknown_servers: dict[str, set[str]] = field(default_factory=dict)  # gpu -> servers
    unknown_unowned: set[str] = field(default_factory=set)
    problems: list[str] = field(default_factory=list)

    def add(self, owner: str | None, gpu: str, used: int) -> None:
        if owner is None:
            self.unowned[gpu] = self.unowned.get(gpu, 0) + used
        else:
            self.by_server[owner, gpu] = self.by_server.get((owner, gpu), 0) + used


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
        unowned_budget_seconds: float | None = UNOWNED_BUDGET_SECONDS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._servers = dict(servers)
        self._units = units
        self._nvidia = nvidia
        self._amd_bus_ids = amd_bus_ids
        self._gpu_index = gpu_index
        self._procfs = procfs
        self._sysfs = sysfs
        # None: no limit (the whole walk in the scrape that starts it).
        self._budget = unowned_budget_seconds
        self._clock = clock
        self._walk: _UnownedWalk | None = None
        self._unowned: _UnownedResult | None = None

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
        tally = _Tally()
        self._nvidia_memory(owners, tally)
        amd = {bus_id: str(self._gpu_index.index_of(bus_id)) for bus_id in self._amd_bus_ids()}
        if amd:
            self._amd_memory(owners, amd, tally)
        # A running server on its roster GPU that holds nothing there is worth a 0, not silence.
        for name in active:
            roster_gpu = self._servers[name].gpu
            if roster_gpu is not None and str(roster_gpu) in tally.known:
                tally.by_server.setdefault((name, str(roster_gpu)), 0)

        served = catalogue.gauge("gpufleet_server_gpu_memory_bytes")
        for (server, gpu), used in sorted(tally.by_server.items()):
            if gpu in tally.known and server not in tally.unknown_servers.get(gpu, ()):
                served.add_metric([server, gpu], used)
        other = catalogue.gauge("gpufleet_gpu_unowned_memory_bytes")
        for gpu, used in sorted(tally.unowned.items()):
            if gpu not in tally.unknown_unowned:
                other.add_metric([gpu], used)
        yield from (f for f in (served, other) if f.samples)
        if tally.problems:
            raise CollectorError("; ".join(tally.problems))

    def _nvidia_memory(self, owners: dict[int, str], tally: _Tally) -> None:
        for bus_id, processes in self._nvidia.process_memory().items():
            gpu = str(self._gpu_index.index_of(bus_id))
            if processes.incomplete is not None:
                tally.problems.append(
                    f"GPU {gpu} ({bus_id}): NVML cannot list its processes "
                    f"({processes.incomplete}): its per-server and unowned memory are unknown"
                )
                continue
            tally.known.add(gpu)
            tally.unowned.setdefault(gpu, 0)
            for pid, used in processes.used.items():
                tally.add(owners.get(pid), gpu, used)
            for pid in processes.unknown:
                owner = owners.get(pid)
                if owner is None:
                    tally.unknown_unowned.add(gpu)
                else:
                    tally.unknown_servers.setdefault(gpu, set()).add(owner)
            if processes.unknown:
                tally.problems.append(
                    f"GPU {gpu} ({bus_id}): NVML gives no memory figure for "
                    f"{len(processes.unknown)} process(es) (e.g. pid {min(processes.unknown)}; "
                    "MIG or vGPU): the memory of their server (or unowned) is unknown"
                )

    def _amd_memory(self, owners: dict[int, str], amd: dict[str, str], tally: _Tally) -> None:
        own_clients: set[tuple[str, str]] = set()
        hidden: list[int] = []
        for gpu in amd.values():
            tally.known.add(gpu)
        for pid in sorted(owners):  # sorted: a client shared after fork() goes to the parent
            clients = drm_fdinfo.process_clients(pid, procfs=self._procfs)
            if clients is None:
                hidden.append(pid)
                for gpu in amd.values():
                    tally.unknown_servers.setdefault(gpu, set()).add(owners[pid])
                continue
            for key, vram in clients.items():
                if key in own_clients:
                    continue
                own_clients.add(key)
                pdev = key[0]
                if pdev in amd:
                    tally.add(owners[pid], amd[pdev], vram)
        if hidden:
            tally.problems.append(
                f"cannot read the open files of {len(hidden)} process(es) of roster units "
                f"(e.g. pid {hidden[0]}): their servers' AMD GPU memory is unknown; "
                f"the exporter needs {FD_PRIVILEGE}"
            )
        result = self._continue_walk(owners, tally)
        if result is None:
            # The first walk has not finished yet, or /proc cannot be listed.
            tally.unknown_unowned.update(amd.values())
            return
        foreign_hidden = [pid for pid in result.hidden if pid not in owners]
        if foreign_hidden:
            tally.unknown_unowned.update(amd.values())
            tally.problems.append(
                f"cannot read the open files of {len(foreign_hidden)} other process(es) "
                f"(e.g. pid {foreign_hidden[0]}): AMD GPU memory of no server is unknown; "
                f"the exporter needs {FD_PRIVILEGE}"
            )
            return
        for gpu in amd.values():
            tally.unowned.setdefault(gpu, 0)
        for key, (pid, vram) in result.clients.items():
            # Counted for its server this scrape (a unit's process, or a client it shares).
            if pid in owners or key in own_clients:
                continue
            if key[0] in amd:
                tally.add(None, amd[key[0]], vram)

    def _continue_walk(self, owners: Mapping[int, str], tally: _Tally) -> _UnownedResult | None:
        """Read more of /proc for the unowned memory; the last finished walk, if any."""
        if self._walk is None:
            pids = all_pids(self._procfs)
            if pids is None:
                # Which processes exist is unknown: no walk, rather than one that finds none.
                tally.problems.append(
                    f"cannot list the processes of {self._procfs}: AMD GPU memory of no server "
                    "is unknown"
                )
                return None
            self._walk = _UnownedWalk(sorted(pids, reverse=True))
        walk = self._walk
        deadline = None if self._budget is None else self._clock() + self._budget
        read_one = False
        while walk.pending:
            # At least one process per scrape, so that a walk always ends.
            if read_one and deadline is not None and self._clock() > deadline:
                break
            pid = walk.pending.pop()
            if pid in owners:
                continue  # read above, every scrape
            read_one = True
            clients = drm_fdinfo.process_clients(pid, procfs=self._procfs)
            if clients is None:
                walk.hidden.append(pid)
                continue
            for key, vram in clients.items():
                walk.clients.setdefault(key, (pid, vram))
        if not walk.pending:
            self._unowned = _UnownedResult(walk.clients, tuple(walk.hidden))
            self._walk = None
        return self._unowned

    def close(self) -> None:
        """Nothing to release."""
