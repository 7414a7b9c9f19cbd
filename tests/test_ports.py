"""Port ghosts with real processes on real ports: the ports collector and its procfs source.

The holders are real: llama-servers started by the lab (the pinned llama.cpp build) and plain
Python listeners; systemd's side comes from the systemctl stand-in (systemd is not PID 1 here).
The unprivileged view is a forked child that drops to `nobody` before it collects.
"""

from __future__ import annotations

import codecs
import json
import os
import shutil
import socket
import subprocess
import sys
import traceback
from collections.abc import Iterator
from pathlib import Path
from types import TracebackType
from typing import Any

import pytest

from exporter.collectors.ports import PortsCollector
from exporter.sources.procfs import process_info, systemd_unit_of
from exporter.sources.procnet import (
    find_holders,
    parse_listeners,
    read_listeners,
    read_procfs_listeners,
    read_sock_diag_listeners,
    url_port,
)
from exporter.sources.systemd import UnitsReader
from fleet.roster import Server
from tests.llama_lab import StartLlamaServer, free_port
from tests.scraping import scrape
from tests.systemctl_stand_in import SystemctlStandIn

NOBODY = 65534
UNIT = "llama-server@alpha.service"
LLAMA_ARGS = ("-c", "256", "-np", "1", "-t", "1")

# A plain TCP listener: binds, says "ready" once it listens, then waits to be killed.
# argv: host port [ignore-sigterm]
LISTENER_CODE = """\
import signal, socket, sys, time
host, port = sys.argv[1], int(sys.argv[2])
if len(sys.argv) > 3:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
family = socket.AF_INET6 if ":" in host else socket.AF_INET
listener = socket.socket(family, socket.SOCK_STREAM)
listener.bind((host, port))
listener.listen()
print("ready", flush=True)
time.sleep(600)
"""


class PythonListener:
    """A real Python process listening on `host:port` (a context manager that kills it)."""

    def __init__(self, port: int, host: str = "127.0.0.1", *, ignore_sigterm: bool = False):
        self.port = port
        extra = ["ignore-sigterm"] if ignore_sigterm else []
        self.process = subprocess.Popen(
            [sys.executable, "-c", LISTENER_CODE, host, str(port), *extra],
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.process.stdout is not None
        line = self.process.stdout.readline()
        if line.strip() != "ready":
            self.process.kill()
            raise AssertionError(f"listener on {host}:{port} did not start: {line!r}")

    @property
    def pid(self) -> int:
        return self.process.pid

    def alive(self) -> bool:
        return self.process.poll() is None

    def __enter__(self) -> PythonListener:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait(timeout=10)
        if self.process.stdout is not None:
            self.process.stdout.close()


def server(port: int, unit: str = UNIT) -> Server:
    return Server(
        engine="llama",
        url=f"http://127.0.0.1:{port}",
        unit=unit,
        role="gpu-dense",
        model="tiny",
    )


def exec_start(path: Path | str, *args: str) -> str:
    """An `ExecStart=` value as `systemctl show` prints it."""
    argv = " ".join([str(path), *args])
    return (
        f"{{ path={path} ; argv[]={argv} ; ignore_errors=no ; start_time=[n/a] ; "
        "stop_time=[n/a] ; pid=0 ; code=(null) ; status=0/0 }"
    )


@pytest.fixture
def stand_in(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> SystemctlStandIn:
    systemctl = SystemctlStandIn(tmp_path)
    systemctl.activate(monkeypatch)
    return systemctl


def collector(servers: dict[str, Server], **kwargs: Any) -> PortsCollector:
    """A ports collector that names a ghost in the scrape that sees it (no time budget).

    The budgeted search that names a ghost over several scrapes has its own tests.
    """
    units = UnitsReader([s.unit for s in servers.values()], max_age_seconds=0)
    kwargs.setdefault("naming_budget_seconds", None)
    return PortsCollector(servers, units, **kwargs)


def ghost(registry: Any, name: str, port: int) -> float | None:
    value: float | None = registry.get_sample_value(
        "gpufleet_port_ghost", {"server": name, "port": str(port)}
    )
    return value


def listeners(registry: Any) -> set[tuple[str, str, str]]:
    """(port, pid, comm) of each listener: the info series and the pid series, which carry no
    pid label (a restart must not make a new series) and match one for one."""
    infos, pids = set(), {}
    for family in registry.collect():
        for sample in family.samples:
            if family.name == "gpufleet_port_listener_info":
                assert sample.value == 1.0 and "pid" not in sample.labels
                infos.add((sample.labels["port"], sample.labels["comm"]))
            elif family.name == "gpufleet_port_listener_pid":
                pids[sample.labels["port"], sample.labels["comm"]] = str(int(sample.value))
    assert infos == set(pids)
    return {(port, pids[port, comm], comm) for port, comm in infos}


def listener_series(registry: Any) -> set[tuple[str, tuple[tuple[str, str], ...]]]:
    """The label sets of the listener series: what Prometheus would store as series."""
    return {
        (sample.name, tuple(sorted(sample.labels.items())))
        for family in registry.collect()
        if family.name.startswith("gpufleet_port_listener_")
        for sample in family.samples
    }


# ---------------------------------------------------------------------------------------------
# The collector with real processes
# ---------------------------------------------------------------------------------------------


def test_the_units_own_llama_server_is_clean_and_cheap(
    llama_server: StartLlamaServer, llama_binary: Path, stand_in: SystemctlStandIn
) -> None:
    llama = llama_server(*LLAMA_ARGS)
    stand_in.set_unit(
        UNIT, ActiveState="active", MainPID=llama.pid, ExecStart=exec_start(llama_binary)
    )
    ports = collector({"alpha": server(llama.port)})
    registry, error = scrape(ports)
    assert error is None
    assert ghost(registry, "alpha", llama.port) == 0.0
    assert listeners(registry) == {(str(llama.port), str(llama.pid), "llama-server")}
    # The main process's fds answered it: no other process was read.
    assert ports.last_scan is not None
    assert ports.last_scan.scanned == {llama.pid} and not ports.last_scan.full_scan


def test_a_listener_while_the_unit_is_inactive_is_a_ghost(
    llama_server: StartLlamaServer, stand_in: SystemctlStandIn
) -> None:
    llama = llama_server(*LLAMA_ARGS)
    stand_in.set_unit(UNIT, ActiveState="inactive", SubState="dead", MainPID=0)
    registry, error = scrape(collector({"alpha": server(llama.port)}))
    assert error is None
    assert ghost(registry, "alpha", llama.port) == 1.0
    assert listeners(registry) == {(str(llama.port), str(llama.pid), "llama-server")}


def test_another_llama_server_on_the_port_is_a_ghost(
    llama_server: StartLlamaServer, llama_binary: Path, stand_in: SystemctlStandIn
) -> None:
    main = llama_server(*LLAMA_ARGS)  # the unit's main process, on a port of its own
    squatter = llama_server(*LLAMA_ARGS)  # holds the roster port
    stand_in.set_unit(
        UNIT, ActiveState="active", MainPID=main.pid, ExecStart=exec_start(llama_binary)
    )
    ports = collector({"alpha": server(squatter.port)})
    registry, error = scrape(ports)
    assert error is None
    assert ghost(registry, "alpha", squatter.port) == 1.0
    assert listeners(registry) == {(str(squatter.port), str(squatter.pid), "llama-server")}
    assert ports.last_scan is not None and ports.last_scan.full_scan


def test_a_python_listener_on_the_port_is_a_ghost(
    llama_server: StartLlamaServer, stand_in: SystemctlStandIn
) -> None:
    main = llama_server(*LLAMA_ARGS)
    port = free_port()
    stand_in.set_unit(UNIT, ActiveState="active", MainPID=main.pid)
    with PythonListener(port) as holder:
        registry, error = scrape(collector({"alpha": server(port)}))
    assert error is None
    assert ghost(registry, "alpha", port) == 1.0
    [(got_port, got_pid, comm)] = listeners(registry)
    assert (got_port, got_pid) == (str(port), str(holder.pid))
    assert comm.startswith("python")


def test_no_listener_is_clean_whatever_the_unit_state(
    llama_server: StartLlamaServer, stand_in: SystemctlStandIn
) -> None:
    main = llama_server(*LLAMA_ARGS)
    alpha_port, beta_port = free_port(), free_port()
    beta_unit = "llama-server@beta.service"
    stand_in.set_unit(UNIT, ActiveState="active", MainPID=main.pid)
    stand_in.set_unit(beta_unit, ActiveState="failed", SubState="failed", MainPID=0)
    registry, error = scrape(
        collector({"alpha": server(alpha_port), "beta": server(beta_port, beta_unit)})
    )
    assert error is None
    assert ghost(registry, "alpha", alpha_port) == 0.0
    assert ghost(registry, "beta", beta_port) == 0.0
    assert listeners(registry) == set()


def test_a_ghost_costs_one_full_scan_then_its_holder_is_rechecked(
    llama_server: StartLlamaServer, stand_in: SystemctlStandIn
) -> None:
    main = llama_server(*LLAMA_ARGS)
    port = free_port()
    stand_in.set_unit(UNIT, ActiveState="active", MainPID=main.pid)
    ports = collector({"alpha": server(port)})
    with PythonListener(port) as first:
        registry, error = scrape(ports)
        assert error is None and ghost(registry, "alpha", port) == 1.0
        assert ports.last_scan is not None and ports.last_scan.full_scan
        registry, error = scrape(ports)  # the same ghost: one readlink confirms it
        assert error is None and ghost(registry, "alpha", port) == 1.0
        assert ports.last_scan is not None and not ports.last_scan.full_scan
        assert len(ports.last_scan.hinted) == 1
        before = listener_series(registry)
    with PythonListener(port) as second:  # another ghost on the port: the old hint fails
        registry, error = scrape(ports)
    assert second.pid != first.pid
    assert error is None and ghost(registry, "alpha", port) == 1.0
    assert {pid for _, pid, _ in listeners(registry)} == {str(second.pid)}
    # A new process on the port (a restart of a crash-looping unit) is not a new series.
    assert listener_series(registry) == before
    assert ports.last_scan is not None and ports.last_scan.full_scan and not ports.last_scan.hinted


def test_a_ghost_is_known_at_once_and_named_over_scrapes_within_the_budget(
    llama_server: StartLlamaServer, stand_in: SystemctlStandIn
) -> None:
    """The default: no scrape reads all of /proc; the verdict does not wait for the name."""
    main = llama_server(*LLAMA_ARGS)
    port = free_port()
    stand_in.set_unit(UNIT, ActiveState="active", MainPID=main.pid)
    # One systemctl answer for the whole test: the scrapes below are about /proc only.
    units = UnitsReader([UNIT], max_age_seconds=600)
    ports = PortsCollector({"alpha": server(port)}, units, naming_budget_seconds=0.0)
    with PythonListener(port) as holder:  # the newest pid: the end of /proc's order
        scrapes, named = 0, False
        while not named:
            scrapes += 1
            assert scrapes < 5000, "the budgeted search never ended"
            registry, error = scrape(ports)
            # Known at once, without an error while the search for its name goes on.
            assert error is None and ghost(registry, "alpha", port) == 1.0
            scan = ports.last_scan
            assert scan is not None
            named = bool(listeners(registry))
            if not named:
                # A budget of 0 still reads one process per scrape, so the search ends.
                assert not scan.complete and len(scan.scanned - {main.pid}) == 1
        assert listeners(registry) == {(str(port), str(holder.pid), listeners(registry).pop()[2])}
        assert scrapes > 1
        registry, error = scrape(ports)  # then one readlink confirms it
        assert ports.last_scan is not None and ports.last_scan.hinted
        assert error is None and {pid for _, pid, _ in listeners(registry)} == {str(holder.pid)}


def test_sock_diag_and_proc_net_tcp_agree(llama_server: StartLlamaServer) -> None:
    """The fast path (netlink sock_diag) reads the same sockets as the files it replaces."""
    llama = llama_server(*LLAMA_ARGS)
    v4, v6 = free_port(), free_port()
    with PythonListener(v4), PythonListener(v6, "::1"):
        wanted = {llama.port, v4, v6}
        fast = set(read_sock_diag_listeners(wanted))
        files = set(read_procfs_listeners("/proc", wanted))
    assert fast == files
    assert {(s.port, s.family) for s in fast} == {
        (llama.port, socket.AF_INET),
        (v4, socket.AF_INET),
        (v6, socket.AF_INET6),
    }


def test_a_process_of_the_units_control_group_is_its_own(
    tmp_path: Path, stand_in: SystemctlStandIn
) -> None:
    """The listener is a child of the main process: found through the unit's cgroup.procs."""
    port = free_port()
    cgroup = "/system.slice/llama-server@alpha.service"
    with (
        subprocess.Popen(["sleep", "60"]) as main,
        PythonListener(port) as child,
    ):
        try:
            procs = tmp_path / "sys" / "fs" / "cgroup" / cgroup.lstrip("/") / "cgroup.procs"
            procs.parent.mkdir(parents=True)
            procs.write_text(f"{main.pid}\n{child.pid}\n")
            stand_in.set_unit(UNIT, ActiveState="active", MainPID=main.pid, ControlGroup=cgroup)
            ports = collector({"alpha": server(port)}, sysfs=str(tmp_path / "sys"))
            registry, error = scrape(ports)
            assert error is None
            assert ghost(registry, "alpha", port) == 0.0
            assert ports.last_scan is not None and not ports.last_scan.full_scan
            assert ports.last_scan.scanned == {main.pid, child.pid}
            # Next scrape: the child is found again by its remembered fd, and is still the
            # unit's own (a remembered holder is judged like any other).
            registry, error = scrape(ports)
            assert error is None and ghost(registry, "alpha", port) == 0.0
            assert ports.last_scan is not None and ports.last_scan.hinted
            assert child.pid not in ports.last_scan.scanned
        finally:
            main.kill()


def test_an_ipv6_listener_is_seen(stand_in: SystemctlStandIn) -> None:
    port = free_port()
    stand_in.set_unit(UNIT, ActiveState="inactive", MainPID=0)
    with PythonListener(port, "::1") as holder:
        [sock] = read_listeners(ports={port})[port]
        registry, error = scrape(collector({"alpha": server(port)}))
    assert (sock.address, sock.family, sock.uid) == ("::1", socket.AF_INET6, os.getuid())
    assert error is None
    assert ghost(registry, "alpha", port) == 1.0
    assert {(p, pid) for p, pid, _ in listeners(registry)} == {(str(port), str(holder.pid))}


def test_systemctl_failing_leaves_every_ghost_unknown(stand_in: SystemctlStandIn) -> None:
    port = free_port()
    stand_in.fail = {"exit": 1, "stderr": "Failed to connect to bus: No such file or directory"}
    stand_in.save()
    with PythonListener(port) as holder:
        registry, error = scrape(collector({"alpha": server(port)}))
    assert ghost(registry, "alpha", port) is None  # absent: never a 0 that claims "clean"
    assert error is not None and "Failed to connect to bus" in str(error)
    assert "port ghosts unknown" in str(error)
    # Who listens is still known, and still exported.
    assert {(p, pid) for p, pid, _ in listeners(registry)} == {(str(port), str(holder.pid))}


def _collect_as_nobody(ports: PortsCollector) -> dict[str, Any]:
    """Collect in a forked child that has dropped to `nobody` (no capabilities left)."""
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        status = 1
        outcome: dict[str, Any] = {"crash": "the child ended early"}
        try:
            os.close(read_fd)
            # Codecs load lazily, from the interpreter's own tree, which nobody may not read.
            codecs.lookup("ascii")
            os.setgroups([])
            os.setgid(NOBODY)
            os.setuid(NOBODY)  # from uid 0 to non-zero: the kernel clears every capability
            registry, error = scrape(ports)
            samples = [
                (family.name, sample.labels, sample.value)
                for family in registry.collect()
                for sample in family.samples
            ]
            outcome = {"uid": os.geteuid(), "samples": samples, "error": error and str(error)}
            status = 0
        except BaseException:  # noqa: BLE001 - reported by the parent; the child must not return
            outcome = {"crash": traceback.format_exc()}
        finally:
            try:
                with os.fdopen(write_fd, "w") as out:
                    json.dump(outcome, out, default=str)
            finally:
                os._exit(status)
    os.close(write_fd)
    with os.fdopen(read_fd) as answer:
        text = answer.read()
    _, wait_status = os.waitpid(pid, 0)
    result: dict[str, Any] = json.loads(text)
    assert os.waitstatus_to_exitcode(wait_status) == 0, result.get("crash")
    return result


def test_unprivileged_view_leaves_the_ghost_absent_and_says_why(
    llama_server: StartLlamaServer, stand_in: SystemctlStandIn
) -> None:
    assert os.geteuid() == 0, "this test drops from root to nobody; run it as root"
    llama = llama_server(*LLAMA_ARGS)  # root's, held by the unit's main process
    beta_unit, beta_port = "llama-server@beta.service", free_port()
    stand_in.set_unit(UNIT, ActiveState="active", MainPID=llama.pid)
    stand_in.set_unit(beta_unit, ActiveState="inactive", MainPID=0)
    servers = {"alpha": server(llama.port), "beta": server(beta_port, beta_unit)}
    units = UnitsReader([UNIT, beta_unit], max_age_seconds=3600)
    units.statuses()  # read as root: the child collects from this answer, not from systemctl
    with PythonListener(beta_port):  # a root-owned ghost on the port of a unit that is down
        # No naming budget: the walk of /proc ends in this one scrape however many processes
        # this machine runs (the budget has tests of its own; this one is about privilege).
        result = _collect_as_nobody(PortsCollector(servers, units, naming_budget_seconds=None))
    assert result["uid"] == NOBODY
    ghosts = {
        labels["server"]: value
        for name, labels, value in result["samples"]
        if name == "gpufleet_port_ghost"
    }
    # alpha: its holder cannot be seen, so no value at all; beta: the unit is down and something
    # listens, so it is a ghost whoever holds it.
    assert ghosts == {"beta": 1.0}
    assert not [s for s in result["samples"] if s[0] == "gpufleet_port_listener_info"]
    error = result["error"]
    assert error is not None
    assert f"port {llama.port}" in error and f"port {beta_port}" in error
    assert "CAP_SYS_PTRACE" in error and "CAP_DAC_READ_SEARCH" in error and "root" in error


# ---------------------------------------------------------------------------------------------
# procnet on recorded text and a fixture tree
# ---------------------------------------------------------------------------------------------

# Recorded from /proc/net/tcp and tcp6 (kernel 6.x, x86-64): a listener on 0.0.0.0:2024 (uid 0),
# one on 127.0.0.1:25672 (uid 106), an established connection, and `[::1]:4369` / `[::]:8080`.
TCP = """\
  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode
   0: 00000000:07E8 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 623 1 00000000d3199693 100 0 0 10 0
   1: 0100007F:6448 00000000:0000 0A 00000000:00000000 00:00000000 00000000   106        0 6909 1 00000000c4af9105 100 0 0 10 0
   2: 0100007F:07E8 0100007F:A1B2 01 00000000:00000000 00:00000000 00000000     0        0 7001 1 00000000c4af9106 20 4 30 10 -1
"""  # noqa: E501 - the kernel's own line length
TCP6 = """\
  sl  local_address                         remote_address                        st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode
   0: 00000000000000000000000001000000:1111 00000000000000000000000000000000:0000 0A 00000000:00000000 00:00000000 00000000   106        0 6808 1 0000000096322f51 100 0 0 10 0
   1: 00000000000000000000000000000000:1F90 00000000000000000000000000000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 4925 1 0000000086c9570a 100 0 0 10 0
"""  # noqa: E501


def test_parse_listeners_reads_the_kernels_format() -> None:
    assert sys.byteorder == "little", "the recorded text is from a little-endian machine"
    found = parse_listeners(TCP, socket.AF_INET)
    assert [(s.port, s.address, s.inode, s.uid) for s in found] == [
        (2024, "0.0.0.0", 623, 0),
        (25672, "127.0.0.1", 6909, 106),
    ]  # the established connection (state 01) is not a listener
    found6 = parse_listeners(TCP6, socket.AF_INET6, ports={8080})
    assert [(s.port, s.address, s.inode, s.family) for s in found6] == [
        (8080, "::", 4925, socket.AF_INET6)
    ]
    assert parse_listeners(TCP6, socket.AF_INET6, ports={4369})[0].address == "::1"


@pytest.fixture
def procfs(tmp_path: Path) -> Iterator[Path]:
    """A procfs tree: net/tcp, net/tcp6 and two processes whose fds link to sockets."""
    root = tmp_path / "proc"
    (root / "net").mkdir(parents=True)
    (root / "net" / "tcp").write_text(TCP)
    (root / "net" / "tcp6").write_text(TCP6)
    (root / "stat").write_text("cpu  1 2 3\nbtime 1700000000\nprocesses 42\n")
    for pid, links in {
        100: ["socket:[623]", "/dev/null"],
        200: ["pipe:[9]", "socket:[4925]"],
    }.items():
        fd = root / str(pid) / "fd"
        fd.mkdir(parents=True)
        for number, target in enumerate(links):
            os.symlink(target, fd / str(number))
        # starttime (field 22) 250362 ticks; comm with a space and a parenthesis.
        stat = f"{pid} (my (srv) x) S 1 {pid} {pid} 0 -1 4194304 96 0 0 0 0 0 0 0 20 0 1 0 "
        (root / str(pid) / "stat").write_text(stat + "250362 3133440 361\n")
        (root / str(pid) / "comm").write_text("my (srv) x\n")
        (root / str(pid) / "cmdline").write_text("/usr/bin/srv\0--port\x008080\0")
        (root / str(pid) / "status").write_text("Name:\tsrv\nUid:\t1000\t998\t998\t998\n")
        (root / str(pid) / "cgroup").write_text(
            "0::/system.slice/llama-server@beta.service/payload\n"
        )
        os.symlink("/usr/bin/srv (deleted)", root / str(pid) / "exe")
    yield root


def test_find_holders_reads_candidates_first_and_the_rest_only_when_needed(procfs: Path) -> None:
    only_candidates = find_holders({623}, [100], procfs=str(procfs))
    assert only_candidates.holders == {623: {100}} and not only_candidates.full_scan
    assert only_candidates.scanned == {100}
    scan = find_holders({623, 4925}, [100], procfs=str(procfs))
    assert scan.holders == {623: {100}, 4925: {200}} and scan.full_scan
    nobody_holds = find_holders({999}, procfs=str(procfs))
    assert nobody_holds.unresolved({999}) == {999} and not nobody_holds.denied


def test_process_info_from_the_tree(procfs: Path) -> None:
    info = process_info(200, procfs=str(procfs))
    assert info is not None
    assert info.comm == "my (srv) x"
    assert (info.exe, info.exe_deleted) == ("/usr/bin/srv", True)
    assert info.cmdline == ("/usr/bin/srv", "--port", "8080")
    assert info.uid == 998 and info.start_ticks == 250362
    assert info.start_time == pytest.approx(1700000000 + 250362 / os.sysconf("SC_CLK_TCK"))
    assert process_info(12345, procfs=str(procfs)) is None
    assert systemd_unit_of(200, procfs=str(procfs)) == "llama-server@beta.service"


def test_a_socket_no_visible_process_holds_is_unknown(
    procfs: Path, stand_in: SystemctlStandIn
) -> None:
    """hidepid= or another PID namespace: nobody is seen holding a listening socket."""
    (procfs / "100" / "fd" / "0").unlink()  # now no process of the tree holds inode 623
    stand_in.set_unit(UNIT, ActiveState="active", MainPID=100)
    registry, error = scrape(collector({"alpha": server(2024)}, procfs=str(procfs)))
    # The unit's process was read whole and does not hold it: not the unit's, so a ghost,
    # whose holder cannot be named.
    assert ghost(registry, "alpha", 2024) == 1.0
    assert listeners(registry) == set()
    assert error is not None and "no process visible" in str(error) and "hidepid" in str(error)


def test_a_hidden_unit_process_leaves_the_ghost_unknown(
    procfs: Path, stand_in: SystemctlStandIn
) -> None:
    """hidepid=2 hides the unit's own process: whether it holds the socket cannot be told."""
    shutil.rmtree(procfs / "100" / "fd")  # what hidepid=2 shows: the pid's fds are not there
    stand_in.set_unit(UNIT, ActiveState="active", MainPID=100)
    registry, error = scrape(collector({"alpha": server(2024)}, procfs=str(procfs)))
    assert ghost(registry, "alpha", 2024) is None
    assert error is not None and "no process visible" in str(error)


def test_unreadable_net_tcp_fails_the_collector(tmp_path: Path, stand_in: SystemctlStandIn) -> None:
    stand_in.set_unit(UNIT, ActiveState="active", MainPID=1)
    registry, error = scrape(collector({"alpha": server(2024)}, procfs=str(tmp_path)))
    assert ghost(registry, "alpha", 2024) is None
    assert error is not None and "net/tcp" in str(error)


def test_url_port_defaults() -> None:
    assert url_port("http://127.0.0.1:31001") == 31001
    assert url_port("http://gpu.example") == 80
    assert url_port("https://gpu.example/v1") == 443
