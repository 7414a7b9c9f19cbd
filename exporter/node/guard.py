"""`guard-port`: free a server's port from a stale process of its own program.

Used two ways. As the server unit's `ExecStartPre=` (with systemd's `+` prefix, so it runs with
full privileges even when the unit has `User=`)::

    ExecStartPre=+/opt/gpu-fleet/bin/gpu-fleet-node guard-port %i --config /etc/gpu-fleet/...

and as a verb of the remediator (`guard-port SERVER` over `--ssh`). It finds who listens on the
server's port (from the roster URL) and:

- nobody: outcome `free`;
- a stale process of the unit's own server: the same executable, by resolved path, as the
  unit's `ExecStart=` (the kernel's " (deleted)" mark of a replaced binary is ignored), *and*
  either in the unit's own cgroup or with a command line that fits `ExecStart=`
  (`exporter.node.exec_start`: an interpreter shared with a bystander is no proof): log the
  evidence (pid, cmdline, owner, start time), SIGTERM it, SIGKILL it after `term_timeout`
  seconds if it is still there, wait for the port to be free (`free_timeout`): `cleared`;
- the unit's current main process: nothing to do (it is never killed): `own-main`;
- anything else (another program, pid 1, the main process of another roster unit, a process of
  another running service): kill nothing, say what holds the port: `refused`;
- a port still held after the stale process was stopped: `still-held`.

When the guard itself cannot work (no roster, a bad roster, an unknown host or server,
`systemctl` failing, no privilege to see the holder) the outcome is `cannot-check`: as
`ExecStartPre=` it says so loudly on stderr (journald keeps it) and exits 0, because it must
never be the reason a healthy server cannot start. The exit code of each outcome is the
caller's business (`exporter.node.cli`); `GuardResult` carries what was found and done.
"""

from __future__ import annotations

import datetime
import errno
import os
import re
import select
import shlex
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from exporter.node.exec_start import fits_exec_start
from exporter.sources.procfs import ProcessInfo, process_info, read_stat, systemd_unit_of
from exporter.sources.procnet import ProcNetError, find_holders, read_listeners, url_port
from exporter.sources.systemd import SystemdError, UnitStatus, show_units, unit_pids
from fleet.roster import DEFAULT_ROSTER_PATH, RosterError, load_roster, resolve_host_name

PRIVILEGE = "root, or CAP_SYS_PTRACE and CAP_DAC_READ_SEARCH (and CAP_KILL to act)"
DEFAULT_TERM_TIMEOUT = 10.0
DEFAULT_FREE_TIMEOUT = 10.0
# After SIGKILL a process normally vanishes at once; one stuck in uninterruptible sleep (a GPU
# driver call) only when that call returns, which may be never: bounded like the rest.
KILL_WAIT_SECONDS = 5.0
POLL_SECONDS = 0.05
MAX_CMDLINE = 4096  # characters of a command line in the evidence (they can be megabytes)

# States in which a service's processes are its own (not leftovers of a dead run).
ALIVE_STATES = frozenset({"active", "reloading", "refreshing", "activating", "deactivating"})
# A unit name as the kernel shows it in /proc/PID/cgroup; checked before it goes to systemctl.
_SERVICE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9:_.\\@-]{0,250}\.service$")

# Outcomes; the first three leave the port usable by the unit.
FREE = "free"
CLEARED = "cleared"
OWN_MAIN = "own-main"
REFUSED = "refused"
STILL_HELD = "still-held"
CANNOT_CHECK = "cannot-check"
GOOD_OUTCOMES = frozenset({FREE, CLEARED, OWN_MAIN})


@dataclass
class GuardResult:
    """What the guard found and did."""

    outcome: str = CANNOT_CHECK
    port: int | None = None
    holders: list[dict[str, Any]] = field(default_factory=list)
    stopped: list[int] = field(default_factory=list)
    log: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        """The JSON `result` of the verb."""
        return {
            "outcome": self.outcome,
            "port": self.port,
            "holders": self.holders,
            "stopped": self.stopped,
            "log": self.log,
        }


class Log:
    """The guard's messages, one line each on stderr (journald keeps a unit's stderr).

    Every line is kept in `lines` too, for the verb's JSON answer.
    """

    def __init__(self, server: str, stream: TextIO | None = None) -> None:
        self.prefix = f"gpu-fleet-node guard-port {server}: "
        self.stream = stream
        self.lines: list[str] = []

    def say(self, message: str) -> None:
        """One line of the guard's log."""
        self.lines.append(message)
        print(self.prefix + message, file=self.stream or sys.stderr, flush=True)

    def cannot_check(self, why: str) -> None:
        """The guard cannot work: say why, loudly, and that the unit is let start."""
        self.say(f"cannot check the port: {why}; letting the unit start")


@dataclass
class _Holder:
    """A process holding a listening socket of the port, and what the guard makes of it."""

    info: ProcessInfo
    inodes: set[int] = field(default_factory=set)
    verdict: str = ""  # "stale", "main", or why it must not be killed


def describe(info: ProcessInfo, *, now: float | None = None) -> str:
    """A process as evidence: pid, comm, owner, start time, executable and command line.

    One line: comm, paths and arguments are the process's own choice and may hold newlines or
    escape sequences, which would forge or garble journal lines; they are escaped.
    """
    owner = "unknown owner"
    if info.uid is not None:
        owner = f"user {info.user or '?'} (uid {info.uid})"
    started = "start time unknown"
    if info.start_time is not None:
        when = datetime.datetime.fromtimestamp(info.start_time).astimezone()
        age = max(0.0, (time.time() if now is None else now) - info.start_time)
        started = f"started {when.isoformat(timespec='seconds')} ({_duration(age)} ago)"
    exe = _one_line(info.exe) if info.exe else "unreadable"
    if info.exe_deleted:
        exe += " (deleted: replaced since it started)"
    cmdline = _one_line(shlex.join(info.cmdline)) if info.cmdline else "(empty)"
    if len(cmdline) > MAX_CMDLINE:
        cmdline = cmdline[:MAX_CMDLINE] + f"... ({len(cmdline)} characters)"
    comm = _one_line(info.comm or "?")
    return f"pid {info.pid} ({comm}), {owner}, {started}, exe {exe}, cmdline: {cmdline}"


def _one_line(text: str) -> str:
    """`text` with control characters escaped as Python does (a newline becomes backslash-n)."""
    return "".join(
        char if char.isprintable() or char == " " else char.encode("unicode_escape").decode()
        for char in text
    )


def _duration(seconds: float) -> str:
    minutes, secs = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    days, hours = divmod(hours, 24)
    if days:
        return f"{days} d {hours} h"
    if hours:
        return f"{hours} h {minutes} min"
    if minutes:
        return f"{minutes} min {secs} s"
    return f"{secs} s"


def guard_port(
    server_name: str,
    *,
    config: Path = DEFAULT_ROSTER_PATH,
    host: str | None = None,
    term_timeout: float = DEFAULT_TERM_TIMEOUT,
    free_timeout: float = DEFAULT_FREE_TIMEOUT,
    procfs: str = "/proc",
    sysfs: str = "/sys",
    log: Log | None = None,
) -> GuardResult:
    """Free `server_name`'s port from a stale process of its own program."""
    log = log or Log(server_name)
    result = GuardResult(log=log.lines)
    try:
        roster = load_roster(config)
        host_name = resolve_host_name(roster, host)
    except RosterError as exc:
        log.cannot_check(str(exc))
        return result
    servers = roster.hosts[host_name].servers
    server = servers.get(server_name)
    if server is None:
        known = ", ".join(sorted(servers)) or "none"
        log.cannot_check(f"{config}: host {host_name!r} has no server {server_name!r} ({known})")
        return result
    port = url_port(server.url)
    result.port = port
    try:
        # All the host's units in one call: their main processes must never be taken for
        # stale ones, even when a misconfigured sibling listens on this port.
        units = list(dict.fromkeys([server.unit, *(s.unit for s in servers.values())]))
        statuses = show_units(units)
    except SystemdError as exc:
        log.cannot_check(str(exc))
        return result
    status = statuses[server.unit]
    if status.exec_start_path is None:
        log.cannot_check(f"systemd reports no ExecStart= executable for {server.unit}")
        return result
    program = os.path.realpath(status.exec_start_path)
    guard = _Guard(
        log=log,
        unit=server.unit,
        port=port,
        status=status,
        statuses=statuses,
        program=program,
        procfs=procfs,
        sysfs=sysfs,
        result=result,
    )
    try:
        result.outcome = guard.run(term_timeout=term_timeout, free_timeout=free_timeout)
    except ProcNetError as exc:
        log.cannot_check(str(exc))
        result.outcome = CANNOT_CHECK
    return result


def _holder_evidence(holder: _Holder) -> dict[str, Any]:
    info = holder.info
    cmdline = shlex.join(info.cmdline)
    return {
        "pid": info.pid,
        "comm": info.comm,
        "exe": info.exe,
        "cmdline": cmdline[:MAX_CMDLINE],
        "user": info.user,
        "start_time": info.start_time,
        "verdict": holder.verdict,
    }


@dataclass
class _Guard:
    log: Log
    unit: str
    port: int
    status: UnitStatus
    statuses: dict[str, UnitStatus]
    program: str
    procfs: str
    sysfs: str
    result: GuardResult

    def listening(self) -> set[int]:
        """Inodes of the sockets listening on the port now."""
        by_port = read_listeners(procfs=self.procfs, ports={self.port})
        return {sock.inode for sock in by_port.get(self.port, [])}

    def run(self, *, term_timeout: float, free_timeout: float) -> str:
        """Check the port and act; the outcome."""
        inodes = self.listening()
        if not inodes:
            self.log.say(f"port {self.port} is free")
            return FREE
        own = unit_pids(self.status, sysfs=self.sysfs, procfs=self.procfs)
        # Every holder, not just one: a socket shared by a parent and its child is freed only
        # when both are gone, and each of them must pass the checks below.
        scan = find_holders(inodes, sorted(own), procfs=self.procfs, all_holders=True)
        unseen = scan.unresolved(inodes)
        if unseen:
            unseen &= self.listening()  # closed meanwhile: nothing to free
        if unseen:
            if scan.denied:
                self.log.cannot_check(
                    f"not allowed to see which process holds port {self.port} (the open files "
                    f"of {len(scan.denied)} process(es) are unreadable); the guard needs "
                    f"{PRIVILEGE}: use ExecStartPre=+... so it runs with full privileges"
                )
            else:
                self.log.cannot_check(
                    f"no process visible in {self.procfs} holds port {self.port} (hidepid=, or "
                    "another PID namespace?)"
                )
            return CANNOT_CHECK

        holders: dict[int, _Holder] = {}
        for inode, pids in scan.holders.items():
            for pid in pids:
                if pid not in holders:
                    info = process_info(pid, procfs=self.procfs)
                    if info is None:
                        continue  # exited since the scan: it holds nothing any more
                    holders[pid] = _Holder(info)
                holders[pid].inodes.add(inode)
        if not holders:
            return self.wait_free(inodes, free_timeout)
        for holder in holders.values():
            holder.verdict = self.judge(holder.info)
            self.result.holders.append(_holder_evidence(holder))
        refused = [h for h in holders.values() if h.verdict not in ("stale", "main", "unknown")]
        if refused:
            # A holder known to be off limits is reason enough, whatever else is unknown.
            for holder in refused:
                self.log.say(
                    f"port {self.port} is held by {describe(holder.info)}: {holder.verdict}"
                )
            self.log.say(
                f"refusing to kill anything: the guard only stops stale processes of "
                f"{self.unit}'s own program {self.program}. Port {self.port} stays taken and "
                f"the unit cannot bind it: stop that program or move one of them to another "
                f"port (check: ss -ltnp 'sport = :{self.port}')"
            )
            return REFUSED
        if any(h.verdict == "unknown" for h in holders.values()):
            self.log.cannot_check(
                f"cannot read which program holds port {self.port}; the guard needs {PRIVILEGE}"
            )
            return CANNOT_CHECK
        stale = [h for h in holders.values() if h.verdict == "stale"]
        if not stale:
            pid = next(iter(holders))
            self.log.say(
                f"port {self.port} is held by {self.unit}'s own main process (pid {pid}); "
                "nothing to do"
            )
            return OWN_MAIN
        for holder in stale:
            self.log.say(
                f"port {self.port} is held by a stale process of {self.unit}'s program "
                f"{self.program}: {describe(holder.info)}"
            )
        try:
            _terminate([h.info for h in stale], term_timeout, self.procfs, self.log)
        except PermissionError as exc:
            self.log.cannot_check(f"not allowed to signal the stale process ({exc.strerror})")
            return CANNOT_CHECK
        self.result.stopped = [h.info.pid for h in stale]
        # Only the sockets the stale processes held must go (the main process keeps its own).
        mine = set().union(*(h.inodes for h in holders.values() if h.verdict == "main"))
        return self.wait_free(inodes - mine, free_timeout)

    def judge(self, info: ProcessInfo) -> str:
        """The verdict on a holder: `stale`, `main`, `unknown`, or why it must not be killed."""
        if info.pid == 1:
            return "pid 1 (systemd or init, a .socket unit?) is never killed"
        if info.pid == os.getpid():
            return "this is the guard itself"
        if info.pid == self.status.main_pid:
            return "main"
        for unit, status in self.statuses.items():
            alive = status.active_state in ALIVE_STATES
            if unit != self.unit and status.main_pid == info.pid and alive:
                return f"it is the main process of {unit} ({status.active_state})"
        other = systemd_unit_of(info.pid, procfs=self.procfs)
        if other is not None and other != self.unit and _SERVICE_NAME.match(other):
            state = self.service_state(other)
            if state is None:
                return f"it belongs to {other}, whose state systemctl cannot tell"
            if state in ALIVE_STATES:
                return f"it belongs to the service {other}, which is {state}"
        if info.exe is None:
            return "unknown"
        if info.exe != self.program:
            return f"it runs {info.exe}, not {self.program}"
        if other == self.unit:
            return "stale"  # in the unit's own cgroup, not its main process: proof enough
        # The same executable is not proof (an interpreter runs anything): its command line
        # must fit the unit's ExecStart= too.
        argv = self.status.exec_start_argv
        if not argv:
            return (
                f"it runs {self.program}, but systemd gave no ExecStart= command line for "
                f"{self.unit} to compare it with: not proven a copy of the unit's server"
            )
        if not fits_exec_start(info.cmdline, argv):
            shown = _one_line(" ".join(argv))
            if len(shown) > MAX_CMDLINE:
                shown = shown[:MAX_CMDLINE] + "..."
            return (
                f"it runs {self.program}, but its command line does not fit {self.unit}'s "
                f"ExecStart= ({shown}): not proven a copy of the unit's server"
            )
        return "stale"

    def service_state(self, unit: str) -> str | None:
        known = self.statuses.get(unit)
        if known is None:
            try:
                known = show_units([unit])[unit]
            except SystemdError:
                return None
            self.statuses[unit] = known
        return known.active_state

    def wait_free(self, inodes: set[int], timeout: float) -> str:
        """Wait until none of `inodes` listens on the port any more; the outcome."""
        deadline = time.monotonic() + timeout
        while inodes & self.listening():
            if time.monotonic() >= deadline:
                self.log.say(
                    f"port {self.port} is still held {timeout:g} s later; the unit cannot "
                    f"bind it (check: ss -ltnp 'sport = :{self.port}')"
                )
                return STILL_HELD
            time.sleep(POLL_SECONDS)
        self.log.say(f"port {self.port} is free; letting the unit start")
        return CLEARED


# ---------------------------------------------------------------------------------------------
# Signalling exactly the process that was judged
# ---------------------------------------------------------------------------------------------


class _Target:
    """One process to stop, pinned by a pidfd where the kernel has them (Linux 5.3+).

    A pid alone can be reused between the judgement and the signal; a pidfd cannot: it keeps
    naming the process it was opened for. It is opened, then the start time is checked against
    the judged one, so the pidfd is known to name the judged process. Without pidfds the start
    time is checked right before each kill(2) instead (a much smaller window, not none).
    """

    def __init__(self, info: ProcessInfo, procfs: str) -> None:
        self.info = info
        self.procfs = procfs
        self.fd: int | None = None
        self.gone = False
        try:
            self.fd = os.pidfd_open(info.pid)
        except ProcessLookupError:
            self.gone = True
            return
        except OSError as exc:
            if exc.errno not in (errno.ENOSYS, errno.EINVAL):
                raise
        if not self.same():
            self.gone = True

    def same(self) -> bool:
        """True while the pid still names the judged process (and it has not exited)."""
        stat = read_stat(self.info.pid, procfs=self.procfs)
        if stat is None or stat.start_ticks is None or stat.start_ticks != self.info.start_ticks:
            return False
        # A zombie has closed its files already: for the port it is gone.
        return stat.state not in ("Z", "X")

    def signal(self, signum: signal.Signals) -> None:
        """Send `signum`; a process that has exited meanwhile is simply gone."""
        if self.gone:
            return
        try:
            if self.fd is not None:
                signal.pidfd_send_signal(self.fd, signum)
            elif self.same():
                os.kill(self.info.pid, signum)
            else:
                self.gone = True
        except ProcessLookupError:
            self.gone = True

    def exited(self) -> bool:
        """True once the process has ended."""
        if not self.gone:
            if self.fd is not None:
                # A pidfd polls readable once the process has exited (a zombie counts).
                poller = select.poll()
                poller.register(self.fd, select.POLLIN)
                self.gone = bool(poller.poll(0))
            else:
                self.gone = not self.same()
        return self.gone

    def close(self) -> None:
        """Close the pidfd."""
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def _wait(targets: list[_Target], timeout: float) -> list[_Target]:
    """Wait until every target has exited or `timeout` passes; those still running."""
    deadline = time.monotonic() + timeout
    while True:
        alive = [t for t in targets if not t.exited()]
        if not alive or time.monotonic() >= deadline:
            return alive
        time.sleep(POLL_SECONDS)


def _terminate(infos: list[ProcessInfo], term_timeout: float, procfs: str, log: Log) -> None:
    """SIGTERM every process, SIGKILL those still running after `term_timeout` seconds."""
    targets = [_Target(info, procfs) for info in infos]
    try:
        _signal_all(targets, signal.SIGTERM, log)
        alive = _wait(targets, term_timeout)
        if alive:
            for target in alive:
                log.say(
                    f"pid {target.info.pid} still runs {term_timeout:g} s after SIGTERM; "
                    "sending SIGKILL"
                )
            _signal_all(alive, signal.SIGKILL, log)
            for target in _wait(alive, KILL_WAIT_SECONDS):
                log.say(
                    f"pid {target.info.pid} still runs {KILL_WAIT_SECONDS:g} s after SIGKILL "
                    "(uninterruptible sleep in a driver call?)"
                )
    finally:
        for target in targets:
            target.close()


def _signal_all(targets: list[_Target], signum: signal.Signals, log: Log) -> None:
    for target in targets:
        target.signal(signum)
        if not target.gone:
            log.say(f"sent {signum.name} to pid {target.info.pid}")
