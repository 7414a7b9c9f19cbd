"""`sources/procfs.py` over `/proc` trees written in the kernel's formats, and real processes.

The trees follow proc(5): `stat` is one line `pid (comm) state ppid ...` with 52 fields,
`status` is `Key:\\tvalue` lines, `cgroup` is `ID:CONTROLLERS:PATH` lines, `task/TID/children`
is the space-separated pids a thread created. A process that vanishes is what the kernel
shows then: its directory is gone from under a listing that still named it.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from exporter.sources.procfs import (
    Stat,
    all_pids,
    boot_time,
    children,
    descendants,
    listed,
    parse_stat,
    parse_status,
    process_info,
    read_comm,
    read_stat,
    read_status,
    systemd_unit_of,
)

TICKS = os.sysconf("SC_CLK_TCK")
BOOT_TIME = 1_700_000_000
UNIT_CGROUP = "0::/system.slice/system-llama\\x2dserver.slice/llama-server@alpha.service\n"


def stat_line(
    pid: int,
    comm: str,
    *,
    state: str = "S",
    ppid: int = 1,
    utime: int = 12,
    stime: int = 3,
    threads: int = 9,
    start: int = 5000,
) -> str:
    """A full `/proc/PID/stat` line (52 fields); times in seconds, written in clock ticks."""
    fields = [state, str(ppid), str(pid), str(pid), "0", "-1", "4194560", "2040", "0", "12", "0"]
    fields += [str(utime * TICKS), str(stime * TICKS), "0", "0", "20", "0", str(threads), "0"]
    fields += [str(start * TICKS), "1300000000", "300000", "18446744073709551615"]
    fields += ["0"] * 29
    return f"{pid} ({comm}) {' '.join(fields)}\n"


def write_process(
    root: Path,
    pid: int,
    comm: str = "llama-server",
    *,
    ppid: int = 1,
    state: str = "S",
    uid: int = 0,
    rss_kib: int | None = 1_200_000,
    exe: str = "/usr/bin/llama-server",
    cmdline: tuple[str, ...] = ("/usr/bin/llama-server", "-m", "/models/tiny.gguf"),
    cgroup: str = UNIT_CGROUP,
) -> Path:
    """One process directory as the kernel writes it (what the exporter reads of it)."""
    directory = root / str(pid)
    directory.mkdir(parents=True)
    (directory / "stat").write_text(stat_line(pid, comm, state=state, ppid=ppid))
    status = f"Name:\t{comm}\nUmask:\t0022\nState:\t{state}\nTgid:\t{pid}\nPid:\t{pid}\n"
    status += f"PPid:\t{ppid}\nUid:\t1000\t{uid}\t{uid}\t{uid}\nGid:\t0\t0\t0\t0\n"
    if rss_kib is not None:  # a zombie's status has no Vm* lines
        status += f"VmPeak:\t 1400000 kB\nVmRSS:\t {rss_kib} kB\nRssAnon:\t  900000 kB\n"
    status += "Threads:\t9\n"
    (directory / "status").write_text(status)
    (directory / "comm").write_text(f"{comm}\n")
    (directory / "cmdline").write_bytes(b"".join(arg.encode() + b"\0" for arg in cmdline))
    (directory / "cgroup").write_text(cgroup)
    os.symlink(exe, directory / "exe")
    (directory / "task" / str(pid)).mkdir(parents=True)
    return directory


def write_children(root: Path, pid: int, tid: int, kids: list[int]) -> None:
    """`task/TID/children` of one thread of `pid` (CONFIG_PROC_CHILDREN)."""
    task = root / str(pid) / "task" / str(tid)
    task.mkdir(parents=True, exist_ok=True)
    (task / "children").write_text("".join(f"{kid} " for kid in kids))


@pytest.fixture
def proc(tmp_path: Path) -> Path:
    """A `/proc` root with the boot time and the entries that are not processes."""
    root = tmp_path / "proc"
    root.mkdir()
    (root / "stat").write_text(
        "cpu  10132153 290696 3084719 46828483 16683 0 25195 0 0 0\n"
        f"intr 1462898 0 9 0\nctxt 115315133\nbtime {BOOT_TIME}\nprocesses 86031\n"
    )
    for name in ("self", "thread-self"):
        os.symlink("1", root / name)
    for name in ("net", "sys", "irq"):
        (root / name).mkdir()
    (root / "uptime").write_text("350735.47 234388.90\n")
    return root


@pytest.fixture
def reaped() -> int:
    """The pid of a real process that has exited and been reaped."""
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    return gone.pid


@pytest.fixture
def sleeper() -> Iterator[subprocess.Popen[bytes]]:
    """A real process that waits to be killed."""
    process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        yield process
    finally:
        process.kill()
        process.wait()


# -- stat ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "comm",
    [
        "llama-server",
        "llama server",  # a space
        "llama) (x y",  # ')' and '(' inside, then spaces
        ") S 77 3 3",  # a name that looks like the fields that follow it
        "x)",  # ends in ')'
        "",  # prctl(PR_SET_NAME, "") is allowed
    ],
)
def test_comm_with_spaces_and_parentheses(comm: str) -> None:
    stat = parse_stat(stat_line(4242, comm, state="R", ppid=200).encode())
    assert stat == Stat(
        pid=4242,
        comm=comm,
        state="R",
        ppid=200,
        utime_ticks=12 * TICKS,
        stime_ticks=3 * TICKS,
        threads=9,
        start_ticks=5000 * TICKS,
    )


def test_read_stat_from_the_tree(proc: Path) -> None:
    write_process(proc, 4242, comm="llama) (x y", ppid=200)
    stat = read_stat(4242, procfs=str(proc))
    assert stat is not None
    assert (stat.comm, stat.state, stat.ppid, stat.threads) == ("llama) (x y", "S", 200, 9)


def test_a_short_stat_line_leaves_the_missing_fields_unknown() -> None:
    stat = parse_stat(b"200 (llama server) S 1 200 200 0 -1\n")
    assert stat is not None
    assert (stat.pid, stat.comm, stat.state, stat.ppid) == (200, "llama server", "S", 1)
    assert stat.utime_ticks is stat.stime_ticks is stat.threads is stat.start_ticks is None


@pytest.mark.parametrize(
    "data",
    [b"", b"\n", b"4242 llama-server S 1\n", b"4242 (llama-server)\n", b"pid (comm) S 1\n"],
)
def test_what_is_not_a_stat_line_is_unknown(data: bytes) -> None:
    assert parse_stat(data) is None


def test_a_non_utf8_name_is_read(proc: Path) -> None:
    directory = write_process(proc, 4242)
    (directory / "stat").write_bytes(stat_line(4242, "x").encode().replace(b"(x)", b"(\xff)"))
    stat = read_stat(4242, procfs=str(proc))
    assert stat is not None and stat.comm == "\ufffd" and stat.start_ticks == 5000 * TICKS


# -- status, comm, identity ------------------------------------------------------------------------


def test_status_fields(proc: Path) -> None:
    write_process(proc, 4242, uid=998, rss_kib=1780)
    status = read_status(4242, procfs=str(proc))
    assert status is not None
    # The effective uid is the second of `Uid:` (real, effective, saved, filesystem).
    assert (status.uid, status.resident_bytes, status.threads) == (998, 1780 * 1024, 9)


def test_a_zombie_has_no_resident_memory(proc: Path) -> None:
    write_process(proc, 4242, state="Z", rss_kib=None)
    status = read_status(4242, procfs=str(proc))
    assert status is not None and status.resident_bytes is None and status.threads == 9


def test_status_lines_that_do_not_parse_are_unknown() -> None:
    status = parse_status(b"Name:\tx\nUid:\t1000\nVmRSS:\tlots kB\nThreads:\n")
    assert (status.uid, status.resident_bytes, status.threads) == (None, None, None)


def test_process_info_from_the_tree(proc: Path) -> None:
    write_process(proc, 4242, comm="llama-server", uid=0, exe="/usr/bin/llama-server (deleted)")
    info = process_info(4242, procfs=str(proc))
    assert info is not None
    assert info.comm == "llama-server" and info.state == "S"
    assert info.exe == "/usr/bin/llama-server" and info.exe_deleted
    assert info.cmdline == ("/usr/bin/llama-server", "-m", "/models/tiny.gguf")
    assert (info.uid, info.user) == (0, "root")
    assert info.start_ticks == 5000 * TICKS
    assert info.start_time == pytest.approx(BOOT_TIME + 5000)
    assert read_comm(4242, procfs=str(proc)) == "llama-server"


def test_process_info_of_a_real_process(sleeper: subprocess.Popen[bytes]) -> None:
    info = process_info(sleeper.pid)
    assert info is not None
    assert info.exe == os.path.realpath(sys.executable) and not info.exe_deleted
    assert info.cmdline[1:] == ("-c", "import time; time.sleep(60)")
    assert info.uid == os.geteuid() and info.state in ("R", "S")
    own = read_stat(os.getpid())
    assert own is not None and info.start_ticks is not None and own.start_ticks is not None
    assert info.start_ticks >= own.start_ticks  # started after this test process


@pytest.mark.parametrize(
    ("cgroup", "unit"),
    [
        (UNIT_CGROUP, "llama-server@alpha.service"),
        # cgroup v1: the unit is on the name=systemd hierarchy, not on the controllers'.
        (
            "12:memory:/system.slice/other.service\n"
            "1:name=systemd:/system.slice/vllm@beta.service/payload\n",
            "vllm@beta.service",
        ),
        ("0::/user.slice/user-1000.slice/session-3.scope\n", "session-3.scope"),
        ("0::/\n", None),
    ],
)
def test_systemd_unit_of(proc: Path, cgroup: str, unit: str | None) -> None:
    write_process(proc, 4242, cgroup=cgroup)
    assert systemd_unit_of(4242, procfs=str(proc)) == unit


# -- the process list and the boot time ----------------------------------------------------------


def test_all_pids_are_the_numeric_entries(proc: Path) -> None:
    for pid in (1, 200, 4242):
        write_process(proc, pid)
    assert sorted(all_pids(str(proc)) or []) == [1, 200, 4242]


def test_an_unlistable_procfs_is_unknown_not_empty(tmp_path: Path) -> None:
    assert all_pids(str(tmp_path / "absent")) is None


def test_boot_time(proc: Path, tmp_path: Path) -> None:
    assert boot_time(str(proc)) == BOOT_TIME
    (proc / "stat").write_text("cpu  1 2 3 4\nbtime\n")  # a btime line without its value
    assert boot_time(str(proc)) is None
    (proc / "stat").write_text("cpu  1 2 3 4\n")
    assert boot_time(str(proc)) is None
    assert boot_time(str(tmp_path / "absent")) is None


def test_the_real_boot_time_is_in_the_past() -> None:
    booted = boot_time()
    assert booted is not None and 1_000_000_000 < booted < time.time()


# -- a process that vanishes -----------------------------------------------------------------------


def test_a_reaped_process_reads_as_none_everywhere(reaped: int) -> None:
    assert read_stat(reaped) is None
    assert read_status(reaped) is None
    assert read_comm(reaped) is None
    assert process_info(reaped) is None
    assert systemd_unit_of(reaped) is None
    assert children(reaped) is None
    assert descendants(reaped) == {reaped}
    assert not listed(reaped)


def test_a_process_that_exits_between_two_reads(
    proc: Path, sleeper: subprocess.Popen[bytes]
) -> None:
    # The tree's pid is a link to the real process's directory: when it is reaped the link
    # dangles, as /proc/PID itself disappears, and a read after that answers as the kernel does.
    os.symlink(f"/proc/{sleeper.pid}", proc / str(sleeper.pid))
    before = read_stat(sleeper.pid, procfs=str(proc))
    assert before is not None and before.pid == sleeper.pid
    sleeper.kill()
    sleeper.wait()
    assert read_stat(sleeper.pid, procfs=str(proc)) is None
    assert read_status(sleeper.pid, procfs=str(proc)) is None
    assert process_info(sleeper.pid, procfs=str(proc)) is None
    assert not listed(sleeper.pid, procfs=str(proc))


def test_a_process_that_vanishes_during_the_walk_by_parent(proc: Path) -> None:
    # No children files: the tree comes from every process's ppid.
    write_process(proc, 100)
    write_process(proc, 101, ppid=100)
    write_process(proc, 102, ppid=101)
    write_process(proc, 300)
    # 103 was listed, then exited before its stat was read: its files are gone.
    (proc / "103").mkdir()
    write_process(proc, 104, ppid=103)  # its child, reparented a moment later
    assert descendants(100, procfs=str(proc)) == {100, 101, 102}


def test_descendants_from_the_children_files(proc: Path) -> None:
    write_process(proc, 100)
    write_children(proc, 100, 100, [101])
    write_children(proc, 100, 105, [102, 103])  # a second thread forked these
    write_process(proc, 101)
    write_children(proc, 101, 101, [104])
    write_process(proc, 104)
    write_children(proc, 104, 104, [])
    # 102 and 103 exited after 100's children were read: their subtrees are unknown, they
    # themselves are still named (as the kernel named them a moment ago).
    assert sorted(children(100, procfs=str(proc)) or []) == [101, 102, 103]
    assert descendants(100, procfs=str(proc)) == {100, 101, 102, 103, 104}
    assert children(104, procfs=str(proc)) == []


def test_a_thread_that_exits_during_the_children_read(proc: Path) -> None:
    write_process(proc, 100)
    write_children(proc, 100, 100, [101])
    (proc / "100" / "task" / "106").mkdir()  # listed, then gone: no children file any more
    write_process(proc, 101)
    write_children(proc, 101, 101, [])
    assert children(100, procfs=str(proc)) == [101]
    assert descendants(100, procfs=str(proc)) == {100, 101}


def test_descendants_of_real_processes() -> None:
    # A shell that starts a sleeping child and says its pid: parent -> child in the real /proc.
    # The shell is its session's leader, so killing the group ends the child with it.
    parent = subprocess.Popen(
        ["/bin/sh", "-c", "sleep 60 & echo $!; wait"],
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        assert parent.stdout is not None
        child = int(parent.stdout.readline())
        assert descendants(parent.pid) == {parent.pid, child}
        if os.path.exists(f"/proc/{parent.pid}/task/{parent.pid}/children"):
            assert children(parent.pid) == [child]
        else:  # a kernel without CONFIG_PROC_CHILDREN: the walk by parent found it
            assert children(parent.pid) is None
    finally:
        os.killpg(parent.pid, 9)
        parent.wait()
        if parent.stdout is not None:
            parent.stdout.close()
