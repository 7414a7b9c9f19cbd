"""Port ghosts: whether each roster server's port is held by its own unit or by a ghost.

A ghost is a process listening on a server's port that is not one of the server's unit's
processes, or any listener while the unit is not running. It is what makes a unit crash-loop
with "couldn't bind": after an OOM kill, a stale llama-server kept port 8080 and the unit
restarted 27 times. `gpu-fleet-node guard-port` clears such a ghost before the unit starts;
this collector lets an alert see one.

Sample output (alpha clean; beta's port held by a stale llama-server while the unit restarts)::

    gpufleet_port_ghost{port="31001",server="alpha"} 0.0
    gpufleet_port_ghost{port="31002",server="beta"} 1.0
    gpufleet_port_listener_info{comm="llama-server",port="31001"} 1.0
    gpufleet_port_listener_info{comm="llama-server",port="31002"} 1.0
    gpufleet_port_listener_pid{comm="llama-server",port="31001"} 4242.0
    gpufleet_port_listener_pid{comm="llama-server",port="31002"} 25836.0

The pid is a value, not a label: a crash-looping unit restarts with a new pid every few
seconds, and a `pid` label would make a new series each time (each kept by Prometheus for its
retention). Several processes of one name on one port (a forked listener, SO_REUSEPORT) are
one series; its pid is the lowest of them.

A server's port is its URL's (80/443 when the URL has none), and every listener on that port
counts, whatever its address: a socket on 127.0.0.1:P blocks a later bind of 0.0.0.0:P too.
Sockets held by the unit of another roster server on the same port (two servers on two
addresses of one port) belong to that server, not to a ghost.

Cost: the listening sockets come from the kernel's sock_diag (or `/proc/net/tcp{,6}`); the
unit's main process is checked first (one `/proc/PID/fd` read), then the unit's other
processes. That settles the verdict: a socket that none of the unit's processes holds is a
ghost's (when all of them could be read). Only to *name* a ghost is the rest of /proc read, and
that read works under a time budget per scrape (`naming_budget_seconds`, 3 ms by default),
continued where it stopped on the next scrape: on a host with thousands of processes the
ghost's `gpufleet_port_listener_info` appears a few scrapes after its `gpufleet_port_ghost` 1,
and no scrape pays for the whole of /proc. Where a holder was found is remembered and
re-checked first on the next scrape (one readlink), so a ghost is searched for once, not on
every scrape.

Privilege: who holds a socket is read from `/proc/PID/fd`, which needs root or
CAP_SYS_PTRACE + CAP_DAC_READ_SEARCH for other users' processes. Without it the ghost series of
a server whose holder cannot be seen is left out (never 0: that would claim "clean") and the
collector fails with a message that says so. A listener on the port of a unit that is not
running is a ghost whoever holds it, so that much is known even without privilege.

Check by hand (as root; without privilege `ss` shows no process)::

    ss -ltnp 'sport = :31001'
    systemctl show --property=ActiveState,MainPID llama-server@alpha.service
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

from prometheus_client.metrics_core import Metric

from exporter.collectors import catalogue
from exporter.collectors.base import CollectorError
from exporter.sources.procfs import read_comm
from exporter.sources.procnet import (
    FD_PRIVILEGE,
    HolderScan,
    Listener,
    ProcNetError,
    find_holders,
    read_listeners,
    url_port,
)
from exporter.sources.systemd import SystemdError, UnitsReader, UnitStatus, unit_pids
from fleet.roster import Server

# States in which the unit's processes run and may hold its port. systemd's `reloading` (and
# `refreshing`, systemd 257+) keep the main process; every other state (`activating` while
# ExecStartPre= runs, `deactivating`, `inactive`, `failed`) has no server that should listen.
RUNNING_STATES = frozenset({"active", "reloading", "refreshing"})


# Time a scrape may spend reading other processes to name a ghost (the target for the whole
# port check is 5 ms on a host with 1,000 extra processes: bench/port_ghosts.py).
NAMING_BUDGET_SECONDS = 0.003


@dataclass
class _NamingPass:
    """A read of /proc for the holders of `inodes`, spread over scrapes."""

    inodes: frozenset[int]
    read: set[int] = field(default_factory=set)  # pids read so far that hold none of them


@dataclass
class _Check:
    """One scrape's findings."""

    ghosts: dict[str, bool]  # server -> ghost; servers left out are unknown
    listeners: set[tuple[int, int]]  # (port, pid) of every holder found on a roster port
    problems: list[str]


class PortsCollector:
    """`gpufleet_port_ghost{server,port}`, `gpufleet_port_listener_info{port,comm}` and `_pid`."""

    name = "ports"

    def __init__(
        self,
        servers: Mapping[str, Server],
        units: UnitsReader,
        *,
        procfs: str = "/proc",
        sysfs: str = "/sys",
        naming_budget_seconds: float | None = NAMING_BUDGET_SECONDS,
    ) -> None:
        self._servers = dict(sorted(servers.items()))
        self._ports = {name: url_port(server.url) for name, server in self._servers.items()}
        self._units = units
        self._procfs = procfs
        self._sysfs = sysfs
        # Where the last scrape found each listening socket's holder: re-checked first next
        # time, so a ghost that stays for hours costs its full /proc scan once, not every scrape.
        # A hint is only a place to look: a holder counts only once its fd is read again.
        self._hints: dict[int, tuple[int, str]] = {}
        # None: no limit (name a ghost in the scrape that sees it, however long /proc takes).
        self._naming_budget = naming_budget_seconds
        self._naming: _NamingPass | None = None
        # The last scrape's scan, for tests and the benchmark: how many processes it read and
        # whether it needed the whole of /proc.
        self.last_scan: HolderScan | None = None

    def close(self) -> None:
        """Nothing to release."""

    def collect(self) -> Iterator[Metric]:
        """Yield the ghost and listener families; raise `CollectorError` after them on trouble."""
        ghost = catalogue.gauge("gpufleet_port_ghost")
        info = catalogue.gauge("gpufleet_port_listener_info")
        pid_of = catalogue.gauge("gpufleet_port_listener_pid")
        try:
            check = self._check()
        except ProcNetError as exc:
            yield from (ghost, info, pid_of)
            raise CollectorError(f"cannot read the listening sockets: {exc}") from None
        for server, is_ghost in check.ghosts.items():
            ghost.add_metric([server, str(self._ports[server])], 1.0 if is_ghost else 0.0)
        lowest: dict[tuple[str, str], int] = {}
        for port, pid in sorted(check.listeners):
            comm = read_comm(pid, procfs=self._procfs)
            if comm is not None:  # None: it exited since the scan
                lowest.setdefault((str(port), comm), pid)  # sorted: the first is the lowest
        for (port_text, comm), pid in sorted(lowest.items()):
            info.add_metric([port_text, comm], 1.0)
            pid_of.add_metric([port_text, comm], float(pid))
        yield from (ghost, info, pid_of)
        if check.problems:
            raise CollectorError("; ".join(check.problems))

    def _check(self) -> _Check:
        problems: list[str] = []
        statuses: dict[str, UnitStatus] | None
        try:
            statuses = self._units.statuses()
        except SystemdError as exc:
            statuses = None
            problems.append(f"cannot read the units ({exc}): port ghosts unknown")
        by_port = read_listeners(procfs=self._procfs, ports=set(self._ports.values()))
        inodes = {sock.inode for socks in by_port.values() for sock in socks}

        # Units that may legitimately hold their port now, and their processes as known so far.
        running: dict[str, UnitStatus] = {}
        own: dict[str, set[int]] = {}
        for name, server in self._servers.items():
            status = statuses.get(server.unit) if statuses is not None else None
            listened = bool(by_port.get(self._ports[name]))
            if status is not None and status.active_state in RUNNING_STATES and listened:
                running[name] = status
                own[name] = {status.main_pid} if status.main_pid else set()

        # The cheap path: a healthy server's socket is held by its unit's main process; a
        # holder found in the previous scrape is re-checked with a single readlink.
        main_pids = sorted({pid for pids in own.values() for pid in pids})
        scan = find_holders(inodes, main_pids, procfs=self._procfs, rest=False, hints=self._hints)
        for name, status in running.items():
            # A socket not held by the main process may still be the unit's: one of its other
            # processes (a server that forks its listener). Read them (cgroup.procs).
            main = own[name]
            if any(not scan.holders.get(s.inode, set()) & main for s in by_port[self._ports[name]]):
                own[name] = main | unit_pids(status, sysfs=self._sysfs, procfs=self._procfs)
        unresolved = scan.unresolved(inodes)
        if unresolved:
            candidates = sorted({pid for pids in own.values() for pid in pids})
            scan = find_holders(
                unresolved, candidates, procfs=self._procfs, rest=False, previous=scan
            )
            unresolved = scan.unresolved(inodes)
        if unresolved:
            scan = self._name_holders(unresolved, scan)
            unresolved = scan.unresolved(inodes)
        if unresolved:
            # A socket closed between reading net/tcp and reading the fds is simply gone.
            still = read_listeners(procfs=self._procfs, ports=set(self._ports.values()))
            listening = {sock.inode for socks in still.values() for sock in socks}
            closed = unresolved - listening
            by_port = {
                port: [sock for sock in socks if sock.inode not in closed]
                for port, socks in by_port.items()
            }
            unresolved -= closed
        self.last_scan = scan
        self._hints = {inode: place for inode, place in scan.places.items() if inode in inodes}

        ghosts: dict[str, bool] = {}
        reported: set[int] = set()  # ports whose unseen holder is already explained
        # A holder not found yet is worth a message once the search is over (a server whose
        # own processes cannot be read gets its message from the verdict, at once).
        explain = scan.complete
        for name, server in self._servers.items():
            port = self._ports[name]
            socks = by_port.get(port, [])
            status = statuses.get(server.unit) if statuses is not None else None
            if statuses is not None and status is None:
                problems.append(f"server {name}: systemctl did not describe {server.unit}")
            if status is None:
                continue
            if not socks:
                ghosts[name] = False
            elif status.active_state not in RUNNING_STATES:
                ghosts[name] = True
            else:
                verdict = self._verdict(port, socks, scan, own)
                if verdict is None:
                    problems.append(self._unknown(name, port, socks, scan))
                    reported.add(port)
                else:
                    ghosts[name] = verdict

        listeners: set[tuple[int, int]] = set()
        for name, port in self._ports.items():
            socks = by_port.get(port, [])
            for sock in socks:
                listeners.update((port, pid) for pid in scan.holders.get(sock.inode, ()))
            if explain and port not in reported and any(sock.inode in unresolved for sock in socks):
                # The ghost value may be known (a unit that is not running), the holder is not.
                problems.append(self._unknown(name, port, socks, scan))
                reported.add(port)
        return _Check(ghosts, listeners, problems)

    def _name_holders(self, unresolved: set[int], scan: HolderScan) -> HolderScan:
        """Read the rest of /proc for `unresolved`, within this scrape's budget."""
        inodes = frozenset(unresolved)
        if self._naming is None or self._naming.inodes != inodes:
            self._naming = _NamingPass(inodes)  # a new search: what was read before is moot
        deadline = None
        if self._naming_budget is not None:
            deadline = time.monotonic() + self._naming_budget
        scan = find_holders(
            unresolved,
            procfs=self._procfs,
            previous=scan,
            skip=self._naming.read,
            deadline=deadline,
        )
        if scan.complete:
            self._naming = None  # found, or /proc read to its end: the next search starts over
        else:
            holding = {pid for inode in unresolved for pid in scan.holders.get(inode, ())}
            self._naming.read |= scan.scanned - holding
        return scan

    def _verdict(
        self,
        port: int,
        socks: list[Listener],
        scan: HolderScan,
        own: dict[str, set[int]],
    ) -> bool | None:
        """True ghost, False clean, None unknown, for a running unit with listeners."""
        # Another roster server on the same port (on another address) owns its own sockets.
        legit = set().union(*(own.get(n, set()) for n, p in self._ports.items() if p == port))
        # Every process of the units was seen whole (its fd directory read; not hidden by
        # hidepid=, not refused): a socket none of them holds is not theirs, whoever holds it
        # (naming that holder may take a few more scrapes).
        seen_all = legit <= scan.listed
        unknown = False
        for sock in socks:
            holders = scan.holders.get(sock.inode)
            if not holders:
                if seen_all and legit:
                    return True
                unknown = True
            elif not holders & legit:
                return True  # a known ghost is a ghost, whatever else is unknown
        return None if unknown else False

    def _unknown(self, name: str, port: int, socks: list[Listener], scan: HolderScan) -> str:
        """Why the holder of a listener on `port` cannot be told."""
        hidden = [sock for sock in socks if not scan.holders.get(sock.inode)]
        owners = ", ".join(sorted({f"uid {sock.uid}" for sock in hidden})) or "?"
        if scan.denied:
            return (
                f"server {name}: cannot tell who listens on port {port} (socket of {owners}): "
                f"not allowed to read the open files (/proc/PID/fd) of {len(scan.denied)} "
                f"process(es); the exporter needs {FD_PRIVILEGE} to see other users' processes"
            )
        return (
            f"server {name}: no process visible in {self._procfs} holds the listening socket "
            f"on port {port} (socket of {owners}): is {self._procfs} mounted with hidepid=, or "
            "is the holder in another PID namespace?"
        )
