"""The systemctl stand-in itself (tests/stand_in_bin/systemctl): it must restart as systemd does.

The lab's crash loops, start limits and stops are only as true as the stand-in, so its
systemd behaviour is tested here with small real processes (Python one-liners): Restart= and
NRestarts, the start limit (systemd.unit(5) StartLimitIntervalSec=/StartLimitBurst=), a stop
that is never a failure, ExecStartPre= on every start, and a teardown that leaves nothing.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from tests.llama_lab import wait_until
from tests.systemctl_stand_in import SystemctlStandIn

UNIT = "demo.service"


@pytest.fixture
def stand_in(tmp_path: Path) -> SystemctlStandIn:
    return SystemctlStandIn(tmp_path)


@pytest.fixture
def marker() -> str:
    """A word in every command line a test starts, to find leftovers by."""
    return f"stand-in-test-{uuid.uuid4().hex}"


def python(code: str, marker: str) -> list[str]:
    """A service's argv: this Python running `code` (the marker is its first argument)."""
    return [sys.executable, "-c", code, marker]


SLEEP = "import time; time.sleep(600)"


def systemctl(stand_in: SystemctlStandIn, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["systemctl", *args],
        env=stand_in.env(),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def show(stand_in: SystemctlStandIn, unit: str = UNIT) -> dict[str, str]:
    done = systemctl(stand_in, "show", unit)
    assert done.returncode == 0, done.stderr
    return dict(line.split("=", 1) for line in done.stdout.splitlines() if "=" in line)


def processes_with(marker: str) -> list[int]:
    """Live (not zombie) processes whose command line holds `marker`."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes()
            status = (entry / "stat").read_text()
        except OSError:
            continue
        if marker.encode() in cmdline and status[status.rfind(")") + 2] not in "ZX":
            found.append(int(entry.name))
    return found


@pytest.fixture(autouse=True)
def nothing_left(stand_in: SystemctlStandIn, marker: str):  # type: ignore[no-untyped-def]
    yield
    stand_in.stop_all()
    assert processes_with(marker) == [] and stand_in.leftovers() == []


def test_a_killed_service_is_restarted_and_counted(stand_in: SystemctlStandIn, marker: str) -> None:
    stand_in.declare_service(UNIT, python(SLEEP, marker), restart="on-failure", restart_sec=0.1)
    assert systemctl(stand_in, "start", UNIT).returncode == 0
    first = stand_in.main_pid(UNIT)
    assert first is not None and show(stand_in)["Restart"] == "on-failure"
    os.kill(first, signal.SIGKILL)  # an unclean signal: on-failure restarts it

    wait_until(lambda: show(stand_in)["NRestarts"] == "1" and show(stand_in)["ActiveState"]
               == "active", 20, what="the restart")  # fmt: skip
    second = stand_in.main_pid(UNIT)
    assert second not in (None, first)
    log = stand_in.log_path(UNIT).read_text()
    assert "status=9/KILL" in log and "Scheduled restart job, restart counter is at 1." in log

    # A manual restart is not an automatic one: systemd flushes the counter at that start.
    assert systemctl(stand_in, "restart", UNIT).returncode == 0
    assert show(stand_in)["NRestarts"] == "0"
    assert stand_in.main_pid(UNIT) not in (None, first, second)


def test_a_clean_exit_is_not_restarted_on_failure_but_is_always(
    stand_in: SystemctlStandIn, marker: str
) -> None:
    stand_in.declare_service(UNIT, python("import time; time.sleep(0.5)", marker),
                             restart="on-failure", start_check_seconds=0.1)  # fmt: skip
    assert systemctl(stand_in, "start", UNIT).returncode == 0
    wait_until(lambda: show(stand_in)["ActiveState"] == "inactive", 20, what="the exit")
    assert show(stand_in)["NRestarts"] == "0" and show(stand_in)["Result"] == "success"

    stand_in.declare_service(UNIT, python("import time; time.sleep(0.5)", marker),
                             restart="always", start_check_seconds=0.1,
                             start_limit_interval_seconds=0)  # fmt: skip
    assert systemctl(stand_in, "start", UNIT).returncode == 0
    wait_until(lambda: int(show(stand_in)["NRestarts"]) >= 2, 20, what="two restarts")


def test_a_crash_loop_hits_the_start_limit_and_stays_failed_until_reset(
    stand_in: SystemctlStandIn, marker: str, tmp_path: Path
) -> None:
    crash = tmp_path / "crash"
    crash.touch()
    code = f"import os, sys, time\nif os.path.exists({str(crash)!r}): sys.exit(1)\n{SLEEP}"
    stand_in.declare_service(
        UNIT, python(code, marker), restart="on-failure", restart_sec=0.1,
        start_limit_interval_seconds=60, start_limit_burst=3, start_check_seconds=0.1,
    )  # fmt: skip
    systemctl(stand_in, "start", UNIT)  # exits at once: this start job fails
    wait_until(lambda: show(stand_in)["ActiveState"] == "failed", 30, what="start-limit-hit")
    state = show(stand_in)
    # Three starts passed (one manual, two automatic); the third restart was refused.
    assert state["Result"] == "start-limit-hit" and state["NRestarts"] == "3", state
    assert "Start request repeated too quickly." in stand_in.log_path(UNIT).read_text()

    crash.unlink()  # the cause is gone; the limit still holds the unit down
    refused = systemctl(stand_in, "start", UNIT)
    assert refused.returncode == 1 and "attempted too often" in refused.stderr
    assert show(stand_in)["ActiveState"] == "failed"
    assert systemctl(stand_in, "restart", UNIT).returncode == 1

    assert systemctl(stand_in, "reset-failed", UNIT).returncode == 0
    state = show(stand_in)
    assert (state["ActiveState"], state["NRestarts"]) == ("inactive", "0")
    assert systemctl(stand_in, "start", UNIT).returncode == 0
    assert show(stand_in)["ActiveState"] == "active"


def test_a_stop_is_never_a_failure_and_reaches_a_stopped_process(
    stand_in: SystemctlStandIn, marker: str
) -> None:
    stand_in.declare_service(UNIT, python(SLEEP, marker), restart="always", restart_sec=0.1,
                             stop_timeout_seconds=30)  # fmt: skip
    assert systemctl(stand_in, "start", UNIT).returncode == 0
    pid = stand_in.main_pid(UNIT)
    assert pid is not None
    os.kill(pid, signal.SIGSTOP)  # hung: SIGTERM alone would wait; SIGCONT lets it die
    assert systemctl(stand_in, "stop", UNIT).returncode == 0
    state = show(stand_in)
    assert (state["ActiveState"], state["SubState"], state["MainPID"]) == ("inactive", "dead", "0")
    assert processes_with(marker) == [] and stand_in.leftovers() == []  # nor a supervisor
    log = stand_in.log_path(UNIT).read_text()
    assert "timed out. Killing." not in log  # the SIGTERM did it, well before 30 s
    assert "Scheduled restart job" not in log and state["NRestarts"] == "0"


def test_a_service_ignoring_sigterm_is_killed_after_the_stop_timeout(
    stand_in: SystemctlStandIn, marker: str
) -> None:
    code = f"import signal\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\n{SLEEP}"
    stand_in.declare_service(UNIT, python(code, marker), restart="on-failure",
                             stop_timeout_seconds=0.5)  # fmt: skip
    assert systemctl(stand_in, "start", UNIT).returncode == 0
    assert systemctl(stand_in, "stop", UNIT).returncode == 0
    assert "State 'stop-sigterm' timed out. Killing." in stand_in.log_path(UNIT).read_text()
    assert show(stand_in)["ActiveState"] == "inactive" and processes_with(marker) == []


def test_exec_start_pre_runs_before_every_start_and_its_failure_counts(
    stand_in: SystemctlStandIn, marker: str, tmp_path: Path
) -> None:
    runs = tmp_path / "pre-runs"
    fail = tmp_path / "pre-fails"
    pre = python(
        f"import os, sys\nopen({str(runs)!r}, 'a').write('x')\n"
        f"sys.exit(1 if os.path.exists({str(fail)!r}) else 0)",
        marker,
    )
    crash_after = "import sys, time; time.sleep(0.4); sys.exit(2)"
    stand_in.declare_service(
        UNIT, python(crash_after, marker), exec_start_pre=pre, restart="on-failure",
        restart_sec=0.1, start_limit_interval_seconds=0, start_check_seconds=0.1,
    )  # fmt: skip
    assert systemctl(stand_in, "start", UNIT).returncode == 0
    wait_until(lambda: int(show(stand_in)["NRestarts"]) >= 2, 20, what="two restarts")
    # Before the first start and before each restart. NRestarts counts a restart when it is
    # scheduled, as systemd does, before its pre-start runs: that one may still be starting.
    wait_until(lambda: len(runs.read_text()) >= 3, 20, what="the second restart's pre-start")

    assert systemctl(stand_in, "stop", UNIT).returncode == 0
    fail.touch()
    runs.write_text("")
    stand_in.declare_service(
        UNIT, python(SLEEP, marker), exec_start_pre=pre, restart="on-failure",
        restart_sec=0.1, start_limit_interval_seconds=60, start_limit_burst=2,
    )  # fmt: skip
    failed = systemctl(stand_in, "start", UNIT)
    assert failed.returncode == 1 and "control process exited" in failed.stderr
    wait_until(lambda: show(stand_in)["Result"] == "start-limit-hit", 20, what="the limit")
    # The failing pre-start counted: two starts passed (each ran it), the third was refused.
    assert runs.read_text() == "xx" and show(stand_in)["NRestarts"] == "2"
    assert stand_in.main_pid(UNIT) is None


def test_stop_all_leaves_nothing_whatever_each_unit_is_doing(
    stand_in: SystemctlStandIn, marker: str
) -> None:
    stand_in.declare_service("running.service", python(SLEEP, marker), restart="always")
    stand_in.declare_service("restarting.service", python("import sys; sys.exit(1)", marker),
                             restart="on-failure", restart_sec=300,
                             start_check_seconds=0.1)  # fmt: skip
    stand_in.declare_service("pre-start.service", python(SLEEP, marker),
                             exec_start_pre=python(SLEEP, marker))  # fmt: skip
    assert systemctl(stand_in, "start", "running.service").returncode == 0
    systemctl(stand_in, "start", "restarting.service")  # fails; a restart waits 300 s
    assert show(stand_in, "restarting.service")["SubState"] == "auto-restart"
    starting = subprocess.Popen(["systemctl", "start", "pre-start.service"], env=stand_in.env())
    # The running service and the pre-start (the restarting one has no process now).
    wait_until(lambda: len(processes_with(marker)) == 2, 20, what="the pre-start running")
    assert show(stand_in, "pre-start.service")["SubState"] == "start-pre"

    stand_in.stop_all()
    assert processes_with(marker) == [] and stand_in.leftovers() == []
    starting.wait(timeout=30)  # its job saw the supervisor go
