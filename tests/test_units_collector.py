"""The units collector against the systemctl STAND-IN and real processes.

systemctl here is a stand-in (`tests/stand_in_bin/systemctl`, driven by
`tests.systemctl_stand_in`): systemd is not PID 1 on the test machines (containers, CI), so the
real systemctl could only answer "System has not been booted with systemd". The stand-in
answers `systemctl show` in systemctl's own format and is found on PATH exactly as the real
one is, so the collector and `UnitsReader` run unchanged; it also logs its calls, which is how
the tests count them.

The process series read REAL processes (children started here, compared with psutil's view of
the same pid), except in the golden file, which reads a small `/proc` tree written by the test
so that its values never change.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric

from exporter.collectors.base import CollectorError, SourceCollector
from exporter.collectors.units import ACTIVE_STATES, UnitsCollector
from exporter.registry import FleetCollector
from exporter.sources.systemd import UnitsReader
from fleet.roster import Server
from tests.golden import assert_golden, exposition
from tests.systemctl_stand_in import SystemctlStandIn

PROMTOOL = shutil.which("promtool")
TICKS = os.sysconf("SC_CLK_TCK")
# PID_MAX_LIMIT is 2**22 and PIDs stay below pid_max: no process can ever have this one.
NO_SUCH_PID = 4194304
BOOT_TIME = 1_700_000_000
FIXTURE_PID = 4242

PROCESS_SERIES = (
    "gpufleet_server_process_resident_memory_bytes",
    "gpufleet_server_process_cpu_seconds_total",
    "gpufleet_server_process_threads",
    "gpufleet_server_process_start_time_seconds",
)


def server(name: str, port: int, engine: str = "llama") -> Server:
    unit = f"llama-server@{name}.service" if engine == "llama" else f"vllm@{name}.service"
    return Server.model_validate(
        {
            "engine": engine,
            "url": f"http://127.0.0.1:{port}",
            "unit": unit,
            "role": "gpu-dense",
            "model": "Gemma4-31B-QAT-Q4_K_M",
        }
    )


SERVERS = {
    "alpha": server("alpha", 31001),
    "beta": server("beta", 31002),
    "gamma": server("gamma", 31003, engine="vllm"),
    "delta": server("delta", 31004),
}


class ManualClock:
    """The `UnitsReader`'s clock, moved by the test: a scrape is when the test says."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def next_scrape(self) -> None:
        self.now += 15.0  # Prometheus' usual interval, far past the reader's max age


@pytest.fixture
def stand_in(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> SystemctlStandIn:
    systemctl = SystemctlStandIn(tmp_path)
    systemctl.activate(monkeypatch)
    return systemctl


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock()


def reader(clock: ManualClock, servers: dict[str, Server] = SERVERS) -> UnitsReader:
    return UnitsReader([s.unit for s in servers.values()], clock=clock)


def registry_of(collector: UnitsCollector) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    return registry


def scrape(collector: UnitsCollector) -> tuple[list[Metric], CollectorError | None]:
    """Every family one scrape yields, and the `CollectorError` it raised after them, if any."""
    families: list[Metric] = []
    try:
        for family in collector.collect():
            families.append(family)
    except CollectorError as exc:
        return families, exc
    return families, None


def write_procfs(root: Path, pid: int, comm: str = "llama-server") -> Path:
    """A `/proc` holding one process and the boot time, in the kernel's formats (proc(5))."""
    (root / str(pid)).mkdir(parents=True)
    (root / "stat").write_text(
        "cpu  10132153 290696 3084719 46828483 16683 0 25195 0 0 0\n"
        "intr 1462898 0 9 0\nctxt 115315133\n"
        f"btime {BOOT_TIME}\nprocesses 86031\nprocs_running 6\nprocs_blocked 0\n"
    )
    # utime 12 s, stime 3 s, 9 threads, started 5000 s after boot: whole seconds in ticks
    # whatever USER_HZ is, so the golden file holds on any kernel.
    fields = ["S", "1", str(pid), str(pid), "0", "-1", "4194560", "2040", "0", "12", "0"]
    fields += [str(12 * TICKS), str(3 * TICKS), "0", "0", "20", "0", "9", "0"]
    fields += [str(5000 * TICKS), "1300000000", "300000", "18446744073709551615"]
    fields += ["0"] * 29
    (root / str(pid) / "stat").write_text(f"{pid} ({comm}) {' '.join(fields)}\n")
    (root / str(pid) / "status").write_text(
        f"Name:\t{comm}\nUmask:\t0022\nState:\tS (sleeping)\nTgid:\t{pid}\nPid:\t{pid}\n"
        "VmPeak:\t 1400000 kB\nVmSize:\t 1300000 kB\nVmHWM:\t 1250000 kB\n"
        "VmRSS:\t 1200000 kB\nRssAnon:\t  900000 kB\nThreads:\t9\n"
    )
    return root


def set_golden_units(systemctl: SystemctlStandIn) -> None:
    """A server running, one in a restart loop, one failed; delta's unit does not exist."""
    systemctl.set_unit(
        "llama-server@alpha.service",
        ActiveState="active",
        SubState="running",
        MainPID=FIXTURE_PID,
        NRestarts=0,
    )
    systemctl.set_unit(
        "llama-server@beta.service", ActiveState="activating", SubState="auto-restart", NRestarts=27
    )
    systemctl.set_unit("vllm@gamma.service", ActiveState="failed", SubState="failed", NRestarts=3)


def test_golden(stand_in: SystemctlStandIn, clock: ManualClock, tmp_path: Path) -> None:
    set_golden_units(stand_in)
    # A command name with spaces and ')' in it: the stat fields must be found after the last ')'.
    procfs = write_procfs(tmp_path / "proc", FIXTURE_PID, comm="llama) (x y")
    collector = UnitsCollector(SERVERS, reader(clock), procfs=str(procfs))
    assert isinstance(collector, SourceCollector)
    assert collector.name == "units"
    assert_golden(exposition(collector), "units")
    collector.close()


def test_states_are_one_hot(stand_in: SystemctlStandIn, clock: ManualClock, tmp_path: Path) -> None:
    set_golden_units(stand_in)
    procfs = write_procfs(tmp_path / "proc", FIXTURE_PID)
    registry = registry_of(UnitsCollector(SERVERS, reader(clock), procfs=str(procfs)))
    expected = {
        "alpha": ("active", "running", 1.0),
        "beta": ("activating", "auto-restart", 0.0),
        "gamma": ("failed", "failed", 0.0),
        "delta": ("inactive", "dead", 0.0),
    }
    for name, (state, sub_state, active) in expected.items():
        labels = {"server": name, "unit": SERVERS[name].unit}
        assert registry.get_sample_value("gpufleet_unit_active", labels) == active, name
        values = {
            s: registry.get_sample_value("gpufleet_unit_state", {**labels, "state": s})
            for s in ACTIVE_STATES
        }
        assert values == {s: 1.0 if s == state else 0.0 for s in ACTIVE_STATES}, name
        info = {**labels, "sub_state": sub_state}
        assert registry.get_sample_value("gpufleet_unit_sub_state_info", info) == 1.0, name


def test_a_state_newer_than_the_list_is_kept(
    stand_in: SystemctlStandIn, clock: ManualClock
) -> None:
    # systemd 254 added "refreshing" (and 24x "maintenance"): still exactly one state is 1.
    servers = {"alpha": SERVERS["alpha"]}
    stand_in.set_unit(SERVERS["alpha"].unit, ActiveState="refreshing", SubState="running")
    registry = registry_of(UnitsCollector(servers, reader(clock, servers)))
    labels = {"server": "alpha", "unit": SERVERS["alpha"].unit}
    assert registry.get_sample_value("gpufleet_unit_state", {**labels, "state": "refreshing"}) == 1
    assert all(
        registry.get_sample_value("gpufleet_unit_state", {**labels, "state": s}) == 0
        for s in ACTIVE_STATES
    )
    assert registry.get_sample_value("gpufleet_unit_active", labels) == 0


def test_restarts_rising_show_on_the_next_scrape(
    stand_in: SystemctlStandIn, clock: ManualClock
) -> None:
    servers = {"beta": SERVERS["beta"]}
    labels = {"server": "beta", "unit": SERVERS["beta"].unit}
    registry = registry_of(UnitsCollector(servers, reader(clock, servers)))
    stand_in.set_unit(SERVERS["beta"].unit, ActiveState="activating", SubState="auto-restart")
    for restarts in (25, 26, 27):
        stand_in.set_unit(SERVERS["beta"].unit, NRestarts=restarts)
        clock.next_scrape()
        assert registry.get_sample_value("gpufleet_unit_restarts_total", labels) == restarts


def test_restarts_absent_when_systemd_does_not_say(
    stand_in: SystemctlStandIn, clock: ManualClock
) -> None:
    # systemd before 235 has no NRestarts property: `systemctl show` prints it empty.
    servers = {"alpha": SERVERS["alpha"]}
    stand_in.set_unit(SERVERS["alpha"].unit, ActiveState="active", NRestarts="")
    registry = registry_of(UnitsCollector(servers, reader(clock, servers)))
    labels = {"server": "alpha", "unit": SERVERS["alpha"].unit}
    assert registry.get_sample_value("gpufleet_unit_active", labels) == 1
    assert registry.get_sample_value("gpufleet_unit_restarts_total", labels) is None


def test_unit_not_found(stand_in: SystemctlStandIn, clock: ManualClock) -> None:
    servers = {"delta": SERVERS["delta"]}  # the stand-in knows no such unit, as systemd would
    families, error = scrape(UnitsCollector(servers, reader(clock, servers)))
    assert error is None
    samples = {(s.name, s.labels.get("state", "")): s.value for f in families for s in f.samples}
    assert samples[("gpufleet_unit_loaded", "")] == 0
    assert samples[("gpufleet_unit_active", "")] == 0
    assert samples[("gpufleet_unit_state", "inactive")] == 1
    assert ("gpufleet_unit_main_pid", "") not in samples
    assert ("gpufleet_unit_state_change_timestamp_seconds", "") not in samples
    assert not {name for name, _ in samples} & set(PROCESS_SERIES)


def test_state_change_timestamp(stand_in: SystemctlStandIn, clock: ManualClock) -> None:
    servers = {"alpha": SERVERS["alpha"]}
    # systemd records CLOCK_MONOTONIC in microseconds: this unit changed state 90 s ago.
    entered = int((time.monotonic() - 90) * 1e6)
    stand_in.set_unit(SERVERS["alpha"].unit, StateChangeTimestampMonotonic=entered)
    registry = registry_of(UnitsCollector(servers, reader(clock, servers)))
    labels = {"server": "alpha", "unit": SERVERS["alpha"].unit}
    value = registry.get_sample_value("gpufleet_unit_state_change_timestamp_seconds", labels)
    assert value is not None
    assert value == pytest.approx(time.time() - 90, abs=1.0)
    # Whole seconds, so the next scrape (same systemd answer) gives exactly the same value.
    assert value == int(value)
    clock.next_scrape()
    time.sleep(0.01)
    again = registry.get_sample_value("gpufleet_unit_state_change_timestamp_seconds", labels)
    assert again == value


@pytest.fixture
def child() -> Iterator[subprocess.Popen[str]]:
    """A real process with 4 threads and 64 MiB touched, waiting to be stopped."""
    code = (
        "import threading, time\n"
        "ballast = bytearray(64 << 20)\n"
        "for _ in range(3):\n"
        "    threading.Thread(target=time.sleep, args=(60,), daemon=True).start()\n"
        "print('ready', flush=True)\n"
        "time.sleep(60)\n"
    )
    process = subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        assert process.stdout is not None
        assert process.stdout.readline() == "ready\n"
        yield process
    finally:
        process.kill()
        process.wait()


def test_process_of_a_real_main_pid(
    stand_in: SystemctlStandIn, clock: ManualClock, child: subprocess.Popen[str]
) -> None:
    servers = {"alpha": SERVERS["alpha"]}
    stand_in.set_unit(SERVERS["alpha"].unit, ActiveState="active", MainPID=child.pid)
    registry = registry_of(UnitsCollector(servers, reader(clock, servers)))
    value = registry.get_sample_value
    unit_labels = {"server": "alpha", "unit": SERVERS["alpha"].unit}
    assert value("gpufleet_unit_main_pid", unit_labels) == child.pid
    labels = {"server": "alpha"}
    psutil_view = psutil.Process(child.pid)
    with psutil_view.oneshot():
        rss = psutil_view.memory_info().rss
        cpu = psutil_view.cpu_times()
        threads = psutil_view.num_threads()
        started = psutil_view.create_time()
    exported_rss = value("gpufleet_server_process_resident_memory_bytes", labels)
    assert exported_rss is not None
    assert exported_rss >= 64 << 20  # the ballast is in it
    assert exported_rss == pytest.approx(rss, rel=0.05)
    assert value("gpufleet_server_process_threads", labels) == threads == 4
    assert value("gpufleet_server_process_start_time_seconds", labels) == pytest.approx(
        started, abs=1.0
    )
    exported_cpu = value("gpufleet_server_process_cpu_seconds_total", labels)
    assert exported_cpu == pytest.approx(cpu.user + cpu.system, abs=0.1)


def test_main_process_that_exited_is_absent(stand_in: SystemctlStandIn, clock: ManualClock) -> None:
    # The unit's main process exits (and is reaped) between systemctl's answer and the read.
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    servers = {"alpha": SERVERS["alpha"], "beta": SERVERS["beta"]}
    stand_in.set_unit(SERVERS["alpha"].unit, ActiveState="active", MainPID=gone.pid)
    stand_in.set_unit(SERVERS["beta"].unit, ActiveState="active", MainPID=NO_SUCH_PID)
    families, error = scrape(UnitsCollector(servers, reader(clock, servers)))
    assert error is None  # a process that is gone is not a failure of the collector
    names = {s.name for f in families for s in f.samples}
    assert "gpufleet_unit_main_pid" in names
    assert not names & set(PROCESS_SERIES)


def test_unreadable_boot_time_drops_only_the_start_time(
    stand_in: SystemctlStandIn, clock: ManualClock, tmp_path: Path
) -> None:
    servers = {"alpha": SERVERS["alpha"]}
    stand_in.set_unit(SERVERS["alpha"].unit, ActiveState="active", MainPID=FIXTURE_PID)
    procfs = write_procfs(tmp_path / "proc", FIXTURE_PID)
    (procfs / "stat").write_text("cpu  1 2 3 4\n")  # no btime line
    families, error = scrape(UnitsCollector(servers, reader(clock, servers), procfs=str(procfs)))
    assert error is not None
    assert "btime" in str(error)
    values = {s.name: s.value for f in families for s in f.samples if "process" in s.name}
    assert values == {
        "gpufleet_server_process_resident_memory_bytes": 1200000 * 1024,
        "gpufleet_server_process_cpu_seconds_total": 15.0,
        "gpufleet_server_process_threads": 9.0,
    }


@pytest.mark.parametrize(
    ("stat", "why"),
    [
        ("4242 (llama-server) S 1 4242 4242 0 -1\n", "lacks the fields"),  # cut short
        ("llama-server is running\n", "/4242/stat is unreadable"),  # not stat's format
    ],
)
def test_a_listed_process_whose_stat_does_not_parse_is_reported(
    stand_in: SystemctlStandIn, clock: ManualClock, tmp_path: Path, stat: str, why: str
) -> None:
    servers = {"alpha": SERVERS["alpha"]}
    stand_in.set_unit(SERVERS["alpha"].unit, ActiveState="active", MainPID=FIXTURE_PID)
    procfs = write_procfs(tmp_path / "proc", FIXTURE_PID)
    (procfs / str(FIXTURE_PID) / "stat").write_text(stat)
    families, error = scrape(UnitsCollector(servers, reader(clock, servers), procfs=str(procfs)))
    assert error is not None and why in str(error) and "alpha" in str(error)
    names = {s.name for f in families for s in f.samples}
    assert "gpufleet_unit_main_pid" in names  # the unit's series stay
    assert not names & set(PROCESS_SERIES)  # never half of the process's


def test_systemctl_failing(stand_in: SystemctlStandIn, clock: ManualClock) -> None:
    set_golden_units(stand_in)
    stand_in.fail = {"exit": 1, "stderr": "Failed to connect to bus: No such file or directory"}
    stand_in.save()
    families, error = scrape(UnitsCollector(SERVERS, reader(clock)))
    assert families == []
    assert error is not None
    assert "Failed to connect to bus" in str(error)
    # Under the exporter's supervisor: no unit series at all, and the collector marked failed.
    fleet = FleetCollector([UnitsCollector(SERVERS, reader(clock))])
    registry = CollectorRegistry(auto_describe=False)
    registry.register(fleet)
    text = generate_latest(registry).decode()
    assert "gpufleet_unit_" not in text
    assert 'gpufleet_exporter_collector_success{collector="units"} 0.0' in text


def test_one_systemctl_call_per_scrape(stand_in: SystemctlStandIn, clock: ManualClock) -> None:
    set_golden_units(stand_in)
    shared = reader(clock)
    # Two collectors reading the same reader in one scrape, as units, processes and ports do.
    first = UnitsCollector({"alpha": SERVERS["alpha"], "beta": SERVERS["beta"]}, shared)
    second = UnitsCollector({"gamma": SERVERS["gamma"], "delta": SERVERS["delta"]}, shared)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(FleetCollector([first, second]))
    for scrape_number in (1, 2, 3):
        text = generate_latest(registry).decode()
        assert 'gpufleet_unit_active{server="alpha"' in text
        assert 'gpufleet_unit_active{server="delta"' in text
        calls = stand_in.calls()
        assert len(calls) == scrape_number, calls
        assert calls[-1].startswith("show ")
        assert all(s.unit in calls[-1].split() for s in SERVERS.values())
        clock.next_scrape()


def test_reader_must_read_every_server_unit(clock: ManualClock) -> None:
    partial = UnitsReader([SERVERS["alpha"].unit], clock=clock)
    with pytest.raises(ValueError, match=r"llama-server@beta\.service"):
        UnitsCollector({"alpha": SERVERS["alpha"], "beta": SERVERS["beta"]}, partial)


def test_promtool_accepts_the_exposition(
    stand_in: SystemctlStandIn, clock: ManualClock, child: subprocess.Popen[str]
) -> None:
    if PROMTOOL is None:
        pytest.fail("promtool is missing: `make test` installs Debian's prometheus package")
    set_golden_units(stand_in)
    entered = int((time.monotonic() - 30) * 1e6)
    stand_in.set_unit(
        SERVERS["alpha"].unit, MainPID=child.pid, StateChangeTimestampMonotonic=entered
    )
    text = exposition(UnitsCollector(SERVERS, reader(clock)))
    for name in ("gpufleet_unit_state_change_timestamp_seconds", *PROCESS_SERIES):
        assert f'{name}{{server="alpha"' in text, name
    result = subprocess.run(
        [PROMTOOL, "check", "metrics"], input=text, capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stdout + result.stderr
