"""systemd units of the roster's model servers, and each unit's main process.

Sample output (as in `tests/golden/units.prom`: one server running, one in a restart loop,
one failed, one whose unit does not exist on the host; the golden file leaves out the state
change time, which depends on the clock)::

    gpufleet_unit_active{server="alpha",unit="llama-server@alpha.service"} 1.0
    gpufleet_unit_state{server="beta",state="activating",unit="llama-server@beta.service"} 1.0
    gpufleet_unit_state{server="beta",state="active",unit="llama-server@beta.service"} 0.0
    gpufleet_unit_sub_state_info{server="beta",sub_state="auto-restart",
                                 unit="llama-server@beta.service"} 1.0
    gpufleet_unit_restarts_total{server="beta",unit="llama-server@beta.service"} 27.0
    gpufleet_unit_main_pid{server="alpha",unit="llama-server@alpha.service"} 4242.0
    gpufleet_unit_state_change_timestamp_seconds{server="alpha",
                                                 unit="llama-server@alpha.service"} 1.700005e+09
    gpufleet_unit_loaded{server="delta",unit="llama-server@delta.service"} 0.0
    gpufleet_server_process_resident_memory_bytes{server="alpha"} 1.2288e+09
    gpufleet_server_process_cpu_seconds_total{server="alpha"} 15.0
    gpufleet_server_process_threads{server="alpha"} 9.0
    gpufleet_server_process_start_time_seconds{server="alpha"} 1.700005e+09

Check by hand::

    systemctl show -p LoadState,ActiveState,SubState,MainPID,NRestarts,StateChangeTimestamp UNIT
    ps -o rss=,time=,nlwp=,lstart= -p MAINPID     # RSS in KiB, CPU time, threads, start

How it reads:

- The unit statuses come from the shared `UnitsReader`: one `systemctl show` for every unit
  of the roster, shared with the other collectors of the same scrape. When systemctl fails
  (no bus, no systemd, a timeout) nothing of the units is known, so nothing is exported and
  the collector raises `CollectorError` with systemctl's message.
- `gpufleet_unit_state` is one-hot over systemd's active states. A start loop shows as
  `activating` with sub-state `auto-restart`; a state systemd added after the six we list
  (`maintenance`, `refreshing`) is exported as an extra `state` value rather than dropped,
  so exactly one `state` is 1 whatever the systemd version.
- What systemd does not say is absent, never 0: `NRestarts` (systemd < 235 has none), the
  main PID (`MainPID=0`: no main process), the state change time (`0`: never changed).
- The state change time is systemd's CLOCK_MONOTONIC stamp turned into Unix time, so a
  clock step after boot (NTP) cannot skew it; it is rounded to whole seconds so that it stays
  put between changes.
- The process series read the unit's main process from `<procfs>/PID/stat` and `status`
  (proc(5)) with `sources/procfs`. psutil would read the same files but only from the global
  `psutil.PROCFS_PATH`, which a collector must not change under its neighbours.
  A process that exited between systemctl's answer and the read is simply absent; any other
  unreadable `/proc` file is reported with `CollectorError` after the rest is yielded.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

from prometheus_client.metrics_core import Metric

from exporter.collectors import catalogue
from exporter.collectors.base import CollectorError
from exporter.sources.procfs import boot_time, listed, read_stat, read_status
from exporter.sources.systemd import SystemdError, UnitsReader, UnitStatus, monotonic_to_unix
from fleet.roster import Server

# systemd's unit active states (systemd.unit(5), "ActiveState"; `systemctl --state=help`).
ACTIVE_STATES = ("active", "reloading", "inactive", "failed", "activating", "deactivating")


@dataclass(frozen=True)
class ProcessStats:
    """One process as `/proc/PID/stat` and `/proc/PID/status` describe it."""

    resident_memory_bytes: int | None  # None for a zombie (its status has no VmRSS line)
    cpu_seconds: float  # user + system time of all its threads
    threads: int
    start_ticks: int  # clock ticks after boot (proc(5): stat field 22, `starttime`)


class ProcessUnreadable(Exception):
    """The process exists but its `stat` or `status` cannot be read or lacks a field."""


def read_process(pid: int, *, procfs: str = "/proc", clock_ticks: int) -> ProcessStats | None:
    """The process's stats, or None when it no longer exists.

    Raises `ProcessUnreadable` when it is still listed but its files cannot be read or
    parsed. Both files are read before anything is returned, so a process that exits between
    the two reads gives None, never half of its series.
    """
    stat = read_stat(pid, procfs=procfs)
    status = read_status(pid, procfs=procfs) if stat is not None else None
    if stat is None or status is None:
        if listed(pid, procfs=procfs):
            what = "stat" if stat is None else "status"
            raise ProcessUnreadable(f"{procfs}/{pid}/{what} is unreadable or not in its format")
        return None  # exited since systemctl named it (or between the two reads)
    utime, stime = stat.utime_ticks, stat.stime_ticks
    if utime is None or stime is None or stat.threads is None or stat.start_ticks is None:
        raise ProcessUnreadable(f"{procfs}/{pid}/stat lacks the fields proc(5) promises")
    return ProcessStats(
        status.resident_bytes, (utime + stime) / clock_ticks, stat.threads, stat.start_ticks
    )


class _Families:
    """The families of one scrape, filled server by server."""

    def __init__(self) -> None:
        self.active = catalogue.gauge("gpufleet_unit_active")
        self.state = catalogue.gauge("gpufleet_unit_state")
        self.sub_state = catalogue.gauge("gpufleet_unit_sub_state_info")
        self.restarts = catalogue.counter("gpufleet_unit_restarts_total")
        self.main_pid = catalogue.gauge("gpufleet_unit_main_pid")
        self.state_change = catalogue.gauge("gpufleet_unit_state_change_timestamp_seconds")
        self.loaded = catalogue.gauge("gpufleet_unit_loaded")
        self.rss = catalogue.gauge("gpufleet_server_process_resident_memory_bytes")
        self.cpu = catalogue.counter("gpufleet_server_process_cpu_seconds_total")
        self.threads = catalogue.gauge("gpufleet_server_process_threads")
        self.start_time = catalogue.gauge("gpufleet_server_process_start_time_seconds")

    def all(self) -> list[Metric]:
        return [
            self.active, self.state, self.sub_state, self.restarts, self.main_pid,
            self.state_change, self.loaded, self.rss, self.cpu, self.threads, self.start_time,
        ]  # fmt: skip


class UnitsCollector:
    """The roster servers' systemd units and main processes; see the module docstring."""

    name = "units"

    def __init__(
        self, servers: Mapping[str, Server], units: UnitsReader, *, procfs: str = "/proc"
    ) -> None:
        missing = sorted({s.unit for s in servers.values()} - set(units.units))
        if missing:
            # A wiring bug in the registry, not a host problem: refuse to start rather than
            # export nothing for these servers on every scrape.
            raise ValueError(f"the UnitsReader does not read unit(s) {', '.join(missing)}")
        self._servers = dict(servers)
        self._units = units
        self._procfs = procfs
        # USER_HZ: the unit of utime, stime and starttime (proc(5)); fixed for the kernel.
        self._clock_ticks = os.sysconf("SC_CLK_TCK")

    def collect(self) -> Iterator[Metric]:
        """One scrape of every server's unit and main process.

        Raises `CollectorError` without yielding when systemctl failed, and after yielding
        the rest when a process's `/proc` files could not be read.
        """
        if not self._servers:
            return
        try:
            statuses = self._units.statuses()
        except SystemdError as exc:
            raise CollectorError(str(exc)) from None
        families = _Families()
        problems: list[str] = []
        booted: float | None = None
        boot_time_read = False
        for server_name, server in self._servers.items():
            status = statuses.get(server.unit)
            if status is None:  # parse_show answers every unit asked; kept as a guard
                problems.append(f"{server_name}: systemctl said nothing of {server.unit}")
                continue
            _export_unit(families, server_name, status)
            if status.main_pid is None:
                continue
            try:
                stats = read_process(
                    status.main_pid, procfs=self._procfs, clock_ticks=self._clock_ticks
                )
            except ProcessUnreadable as exc:
                problems.append(f"{server_name}: cannot read process {status.main_pid}: {exc}")
                continue
            if stats is None:
                continue
            if not boot_time_read:
                # Read once per scrape, and only when a process needs it.
                boot_time_read = True
                booted = boot_time(self._procfs)
                if booted is None:
                    problems.append(f"cannot read the boot time (btime of {self._procfs}/stat)")
            _export_process(families, server_name, stats, booted, self._clock_ticks)
        yield from (family for family in families.all() if family.samples)
        if problems:
            raise CollectorError("; ".join(problems))

    def close(self) -> None:
        """Nothing to release: the `UnitsReader` belongs to whoever built it."""


def _export_unit(f: _Families, server: str, status: UnitStatus) -> None:
    labels = [server, status.unit]
    if status.active_state:
        f.active.add_metric(labels, 1.0 if status.active else 0.0)
        states = list(ACTIVE_STATES)
        if status.active_state not in states:
            states.append(status.active_state)
        for state in states:
            f.state.add_metric([*labels, state], 1.0 if state == status.active_state else 0.0)
    if status.sub_state:
        f.sub_state.add_metric([*labels, status.sub_state], 1.0)
    if status.n_restarts is not None:
        f.restarts.add_metric(labels, status.n_restarts)
    if status.main_pid is not None:
        f.main_pid.add_metric(labels, status.main_pid)
    if status.state_change_monotonic_seconds is not None:
        # Whole seconds: the monotonic-to-Unix offset is read anew each scrape and drifts by
        # microseconds (and NTP slew), which would make `changes()` see a change every scrape.
        entered = monotonic_to_unix(status.state_change_monotonic_seconds)
        f.state_change.add_metric(labels, round(entered))
    if status.load_state:
        f.loaded.add_metric(labels, 1.0 if status.load_state == "loaded" else 0.0)


def _export_process(
    f: _Families, server: str, stats: ProcessStats, boot_time: float | None, clock_ticks: int
) -> None:
    labels = [server]
    if stats.resident_memory_bytes is not None:
        f.rss.add_metric(labels, stats.resident_memory_bytes)
    f.cpu.add_metric(labels, stats.cpu_seconds)
    f.threads.add_metric(labels, stats.threads)
    if boot_time is not None:
        f.start_time.add_metric(labels, boot_time + stats.start_ticks / clock_ticks)
