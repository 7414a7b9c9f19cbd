"""Processes as procfs shows them: the pid list, `stat`, `status`, identity, trees, boot time.

Every reader of `/proc` outside the network tables (`sources/procnet.py`) and the DRM files
(`sources/drm_fdinfo.py`) is here, each once. The root is injected (`procfs=`, `/proc` by
default), so tests read a fixture tree in the kernel's formats (proc(5)).

Readers never raise. A process can exit between any two reads: its directory disappears
(ENOENT), or a file opened just before it was reaped answers ESRCH; a file we may not read
(hidepid=, another user's `exe`) answers EACCES. Each of these, and content that does not
parse, gives None: unknown, for the caller to leave out. Callers that must tell "gone" from
"there but unreadable" ask `listed()` afterwards.

`/proc/PID/stat` is parsed once, in `parse_stat`: the command name (field 2) is in parentheses
and may itself hold spaces and ')' (`prctl(PR_SET_NAME)` takes any bytes), so the fields that
follow start after the *last* ')' (proc(5), "/proc/pid/stat"). A field a line lacks is None
rather than a failed line.

Check by hand: `cat /proc/PID/stat`, `grep -E '^(Uid|VmRSS|Threads):' /proc/PID/status`,
`grep btime /proc/stat`, `cat /proc/PID/task/*/children`.
"""

from __future__ import annotations

import os
import pwd
from dataclasses import dataclass

# What the kernel's d_path appends to the path of an unlinked file (a replaced executable).
_DELETED = " (deleted)"


def _read(path: str) -> bytes | None:
    """The whole file, or None when it cannot be read (gone, not ours to see, not a file)."""
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError:
        return None


def _pid_file(procfs: str, pid: int, name: str) -> bytes | None:
    return _read(os.path.join(procfs, str(pid), name))


def _number(field: bytes) -> int:
    """A decimal field as the kernel prints it; ValueError for anything else.

    int() alone also takes Python's digit separators (b"4_242"), which the kernel never prints,
    and numbers of any length.
    """
    value = int(field) if b"_" not in field else None
    # The kernel prints at most 64-bit numbers (rsslim is often 2**64 - 1).
    if value is None or not -(2**63) <= value < 2**64:
        raise ValueError(f"not a kernel number: {field!r}")
    return value


def _text(data: bytes | None) -> str | None:
    # Command names, paths and cgroup names are bytes to the kernel, not always UTF-8.
    return data.decode("utf-8", "replace") if data is not None else None


# ---------------------------------------------------------------------------------------------
# The process list and the boot time
# ---------------------------------------------------------------------------------------------


def all_pids(procfs: str = "/proc") -> list[int] | None:
    """Every process id in `procfs` (thread-group leaders: threads live under PID/task).

    None when `procfs` cannot be listed: which processes exist is then unknown, not "none".
    """
    try:
        names = os.listdir(procfs)
    except OSError:
        return None
    return [int(name) for name in names if name.isdigit()]


def listed(pid: int, *, procfs: str = "/proc") -> bool:
    """Whether `<procfs>/PID` exists: after a read gave None, "there but unreadable"."""
    return os.path.isdir(os.path.join(procfs, str(pid)))


def boot_time(procfs: str = "/proc") -> float | None:
    """The boot time (Unix seconds), the `btime` line of `<procfs>/stat`; None if unreadable."""
    data = _read(os.path.join(procfs, "stat"))
    for line in (data or b"").splitlines():
        if line.startswith(b"btime "):
            try:
                return float(line.split()[1])
            except (IndexError, ValueError):
                return None
    return None


# ---------------------------------------------------------------------------------------------
# stat and status
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Stat:
    """The fields of `/proc/PID/stat` the exporter uses; None where the line lacks one.

    Field numbers are proc(5)'s, from 1. Times are in clock ticks (USER_HZ,
    `os.sysconf("SC_CLK_TCK")`).
    """

    pid: int  # field 1
    comm: str  # field 2, without its parentheses (at most 15 bytes: TASK_COMM_LEN - 1)
    state: str  # field 3: R S D T t Z X I ...
    ppid: int | None  # field 4
    utime_ticks: int | None  # field 14
    stime_ticks: int | None  # field 15
    threads: int | None  # field 20, num_threads
    start_ticks: int | None  # field 22, starttime: ticks after boot (with the pid, an identity)


def parse_stat(data: bytes) -> Stat | None:
    """One `/proc/PID/stat` line; None when it is not one (no parenthesised name, no state)."""
    opening, closing = data.find(b"("), data.rfind(b")")
    if opening < 0 or closing < opening:
        return None
    fields = data[closing + 1 :].split()  # fields[0] is field 3
    try:
        pid = _number(data[:opening])
    except ValueError:
        return None
    if not fields:
        return None

    def number(field_number: int) -> int | None:
        try:
            return _number(fields[field_number - 3])
        except (IndexError, ValueError):
            return None

    return Stat(
        pid=pid,
        comm=data[opening + 1 : closing].decode("utf-8", "replace"),
        state=fields[0].decode("ascii", "replace"),
        ppid=number(4),
        utime_ticks=number(14),
        stime_ticks=number(15),
        threads=number(20),
        start_ticks=number(22),
    )


def read_stat(pid: int, *, procfs: str = "/proc") -> Stat | None:
    """`<procfs>/PID/stat`; None when the process is gone or the file unreadable."""
    data = _pid_file(procfs, pid, "stat")
    return parse_stat(data) if data is not None else None


@dataclass(frozen=True)
class Status:
    """The lines of `/proc/PID/status` the exporter uses; None where a line is missing."""

    uid: int | None  # the effective uid (`Uid:` real, effective, saved, filesystem)
    resident_bytes: int | None  # `VmRSS`; none for a zombie or a kernel thread
    threads: int | None  # `Threads`


def parse_status(data: bytes) -> Status:
    """The `Uid`, `VmRSS` and `Threads` lines of a `/proc/PID/status` text."""
    values: dict[bytes, list[bytes]] = {}
    for line in data.splitlines():
        key, sep, rest = line.partition(b":")
        if sep and key in (b"Uid", b"VmRSS", b"Threads"):
            values[key] = rest.split()

    def number(key: bytes, position: int, scale: int = 1) -> int | None:
        try:
            return _number(values[key][position]) * scale
        except (KeyError, IndexError, ValueError):
            return None

    return Status(
        uid=number(b"Uid", 1),
        # "VmRSS:\t   1780 kB": the kernel's "kB" is KiB (proc(5)).
        resident_bytes=number(b"VmRSS", 0, 1024),
        threads=number(b"Threads", 0),
    )


def read_status(pid: int, *, procfs: str = "/proc") -> Status | None:
    """`<procfs>/PID/status`; None when the process is gone or the file unreadable."""
    data = _pid_file(procfs, pid, "status")
    return parse_status(data) if data is not None else None


# ---------------------------------------------------------------------------------------------
# Identity: comm, exe, cmdline, owner, cgroup
# ---------------------------------------------------------------------------------------------


def read_comm(pid: int, *, procfs: str = "/proc") -> str | None:
    """The process's command name (`comm`, at most 15 bytes); None when it is gone."""
    text = _text(_pid_file(procfs, pid, "comm"))
    return text.rstrip("\n") if text is not None else None


def read_cgroup(pid: int, *, procfs: str = "/proc") -> str | None:
    """`<procfs>/PID/cgroup` as text, one `ID:CONTROLLERS:PATH` line a hierarchy."""
    return _text(_pid_file(procfs, pid, "cgroup"))


def systemd_unit_of(pid: int, *, procfs: str = "/proc") -> str | None:
    """The systemd service or scope whose cgroup holds `pid` (from `/proc/PID/cgroup`).

    The cgroup v2 line is `0::/system.slice/NAME.service`; on v1 the `name=systemd` hierarchy
    carries the same path. The innermost `.service`/`.scope` component names the unit (a
    service may create sub-cgroups below itself). None outside any unit, or when unreadable.
    """
    text = read_cgroup(pid, procfs=procfs)
    if text is None:
        return None
    paths = []
    for line in text.splitlines():
        _, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if controllers in ("", "name=systemd"):
            paths.append(path)
    for path in paths:
        for part in reversed(path.split("/")):
            if part.endswith((".service", ".scope")):
                return part
    return None


@dataclass(frozen=True)
class ProcessInfo:
    """What a process is, for evidence and decisions; None where it could not be read."""

    pid: int
    comm: str | None
    exe: str | None  # `/proc/PID/exe` resolved, without the kernel's " (deleted)" suffix
    exe_deleted: bool  # the executable was replaced or removed since the process started
    cmdline: tuple[str, ...]
    uid: int | None  # effective uid (as `ps -o user` shows)
    user: str | None
    start_ticks: int | None  # `stat` starttime: clock ticks after boot (identity with the pid)
    start_time: float | None  # Unix time
    state: str | None  # `stat` state letter: R S D T Z ...


def _user_name(uid: int | None) -> str | None:
    if uid is None:
        return None
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return None


def process_info(pid: int, *, procfs: str = "/proc") -> ProcessInfo | None:
    """What process `pid` is; None when it does not exist (any more)."""
    stat = read_stat(pid, procfs=procfs)
    if stat is None:
        return None
    try:
        exe: str | None = os.readlink(os.path.join(procfs, str(pid), "exe"))
    except OSError:
        exe = None  # kernel threads have none; another user's needs privilege
    deleted = exe is not None and exe.endswith(_DELETED)
    if exe is not None and deleted:
        exe = exe[: -len(_DELETED)]
    raw_cmdline = _text(_pid_file(procfs, pid, "cmdline")) or ""
    status = read_status(pid, procfs=procfs)
    uid = status.uid if status is not None else None
    btime = boot_time(procfs)
    start = None
    if stat.start_ticks is not None and btime is not None:
        start = btime + stat.start_ticks / os.sysconf("SC_CLK_TCK")
    return ProcessInfo(
        pid=pid,
        comm=read_comm(pid, procfs=procfs),
        exe=exe,
        exe_deleted=deleted,
        cmdline=tuple(part for part in raw_cmdline.split("\0") if part),
        uid=uid,
        user=_user_name(uid),
        start_ticks=stat.start_ticks,
        start_time=start,
        state=stat.state,
    )


# ---------------------------------------------------------------------------------------------
# Process trees
# ---------------------------------------------------------------------------------------------


def children(pid: int, *, procfs: str = "/proc") -> list[int] | None:
    """The children of `pid`, from `<procfs>/PID/task/TID/children` of each of its threads.

    None when the kernel has no such files (CONFIG_PROC_CHILDREN unset) or the process is gone
    (proc(5), "/proc/pid/task/tid/children": each thread lists the children it created).
    """
    task_dir = os.path.join(procfs, str(pid), "task")
    try:
        tids = os.listdir(task_dir)
    except OSError:
        return None
    found: list[int] = []
    answered = False
    for tid in tids:
        data = _read(os.path.join(task_dir, tid, "children"))
        if data is None:
            continue  # the thread exited since the listing (or no CONFIG_PROC_CHILDREN)
        try:
            named = [int(child) for child in data.split()]
        except ValueError:
            continue
        found.extend(named)
        answered = True
    return found if answered else None


def descendants(pid: int, *, procfs: str = "/proc") -> set[int]:
    """`pid` and all its descendants, as far as they can be seen.

    Through `/proc/PID/task/TID/children` where the kernel has it (CONFIG_PROC_CHILDREN, as
    Debian's and Ubuntu's kernels have); otherwise from every process's parent in
    `/proc/PID/stat` (one pass over /proc). A process that exits during the walk is left out
    with its subtree; when `procfs` cannot be listed, only `pid` itself is known.
    """
    children_file = os.path.join(procfs, str(pid), "task", str(pid), "children")
    if not os.path.exists(children_file):
        return _descendants_by_parent(pid, procfs)
    found = {pid}
    todo = [pid]
    while todo:
        for child in children(todo.pop(), procfs=procfs) or ():
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def _descendants_by_parent(pid: int, procfs: str) -> set[int]:
    by_parent: dict[int, list[int]] = {}
    for other in all_pids(procfs) or ():
        stat = read_stat(other, procfs=procfs)
        if stat is not None and stat.ppid is not None:
            by_parent.setdefault(stat.ppid, []).append(other)
    found = {pid}
    todo = [pid]
    while todo:
        for child in by_parent.get(todo.pop(), ()):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


# ---------------------------------------------------------------------------------------------
# The host as a whole: CPU time, load, memory (proc(5): /proc/stat, /proc/loadavg, meminfo)
# ---------------------------------------------------------------------------------------------

# /proc/stat's `cpu` line, in order (proc(5)); guest and guest_nice are already inside user
# and nice, so they are read but not among the modes.
CPU_FIELDS = ("user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal")


@dataclass(frozen=True)
class CpuTimes:
    """The `cpu` line of /proc/stat in seconds, by mode (a mode the kernel lacks: absent)."""

    seconds: dict[str, float]
    cpus: int | None  # the `cpuN` lines: CPUs online


def read_cpu_times(procfs: str = "/proc") -> CpuTimes | None:
    """CPU time summed over all CPUs and the CPU count, from `<procfs>/stat`; None if unreadable."""
    data = _read(os.path.join(procfs, "stat"))
    if data is None:
        return None
    ticks = os.sysconf("SC_CLK_TCK")  # USER_HZ: what /proc/stat counts in
    seconds: dict[str, float] = {}
    cpus = 0
    for line in data.splitlines():
        fields = line.split()
        if not fields:
            continue
        if fields[0] == b"cpu":
            try:
                values = [_number(f) for f in fields[1 : 1 + len(CPU_FIELDS)]]
            except ValueError:
                return None
            seconds = {mode: v / ticks for mode, v in zip(CPU_FIELDS, values, strict=False)}
        elif fields[0].startswith(b"cpu") and fields[0][3:].isdigit():
            cpus += 1
    if not seconds:
        return None
    return CpuTimes(seconds, cpus or None)


def read_loadavg(procfs: str = "/proc") -> tuple[float, float, float] | None:
    """The 1, 5 and 15 minute load averages from `<procfs>/loadavg`; None if unreadable."""
    data = _read(os.path.join(procfs, "loadavg"))
    try:
        one, five, fifteen = (float(f) for f in (data or b"").split()[:3])
    except ValueError:
        return None
    return one, five, fifteen


def read_meminfo(procfs: str = "/proc") -> dict[str, int] | None:
    """`<procfs>/meminfo` in bytes by key (`MemTotal`, `MemAvailable`...); None if unreadable."""
    data = _read(os.path.join(procfs, "meminfo"))
    if data is None:
        return None
    values: dict[str, int] = {}
    for line in data.splitlines():
        key, sep, rest = line.partition(b":")
        fields = rest.split()
        if not sep or not fields:
            continue
        try:
            value = _number(fields[0])
        except ValueError:
            continue  # that field only
        unit = fields[1] if len(fields) > 1 else b""
        values[key.decode("ascii", "replace")] = value * 1024 if unit == b"kB" else value
    return values or None
