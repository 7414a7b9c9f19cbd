"""Drives the systemctl and journalctl STAND-INS (tests/stand_in_bin/): systemd is not PID 1 here.

They are stand-ins, not systemd: the test machines (containers, CI) run without systemd, and
the code under test runs `systemctl`/`journalctl` from PATH, so these two scripts put first on
PATH answer instead. `show` speaks systemctl's own format; `start`/`stop`/`restart` really
start and stop processes (see the module docstring of tests/stand_in_bin/systemctl).

`SystemctlStandIn(tmp_path)` writes the state file; `env()` gives an environment whose PATH
finds the stand-ins first (for child processes: the exporter, `gpu-fleet-node`, an sshd's
forced command); `activate(monkeypatch)` does the same for this process.

Units whose state a test sets by hand (`set_unit(UNIT, ActiveState="active", MainPID=pid)`)
are only shown. A unit declared with an ExecStart= argv is managed: `systemctl start` starts
that process for real, detached like a service. A real llama-server from the lab
(tests/llama_lab.py; the `llama_binary` and `tiny_model` fixtures of tests/conftest.py)::

    stand_in = SystemctlStandIn(tmp_path)
    port = free_port()
    stand_in.declare_service(
        "llama-server@alpha.service",
        [str(llama_binary), "-m", str(tiny_model), "--host", "127.0.0.1",
         "--port", str(port), "-c", "256", "-np", "1", "-t", "1"],
        stop_timeout_seconds=5,           # SIGTERM, then SIGKILL (systemd's TimeoutStopSec=)
    )
    try:
        subprocess.run(["systemctl", "start", "llama-server@alpha.service"], env=stand_in.env())
        stand_in.main_pid("llama-server@alpha.service")   # the llama-server's pid
        ...                                               # wait for http://127.0.0.1:PORT/health
    finally:
        stand_in.stop_all()   # services are detached: a test must stop them, pass or fail

`exec_start_pre=[...]` runs a command before each start, automatic restarts included, like
ExecStartPre= (a non-zero exit fails that start); `env={...}` adds to the service's
environment (systemd's minimal one: `PATH`, `LANG`). `restart="on-failure"` (or `"always"`)
with `restart_sec=` is systemd's Restart=/RestartSec=: the unit's supervisor (a detached
process of the stand-in, the main process's parent, as PID 1 is) starts it again after an
unclean exit and counts `NRestarts`; `start_limit_interval_seconds=`/`start_limit_burst=`
(systemd's defaults 10 s and 5) is the start limit, after which the unit is `failed` with
`Result=start-limit-hit` until `systemctl reset-failed`. A `stop` is never restarted. The
process's output and systemd's own lines go to `log_path(unit)`, which the journalctl
stand-in prints in `short-iso` form (`journalctl -u UNIT -n 50 -o short-iso`).

`stop_all()` kills every supervisor first (so nothing is restarted), then every process a unit
started: nothing the stand-in started outlives a test that calls it, pass or fail.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import signal
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

BIN = Path(__file__).resolve().parent / "stand_in_bin"


def exec_start_value(argv: Sequence[str]) -> str:
    """An `ExecStart=` value as `systemctl show` prints it for `argv`."""
    return (
        f"{{ path={argv[0]} ; argv[]={' '.join(argv)} ; ignore_errors=no ; "
        "start_time=[n/a] ; stop_time=[n/a] ; pid=0 ; code=(null) ; status=0/0 }"
    )


class SystemctlStandIn:
    """The state the stand-ins answer from, and how to put them first on PATH."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.state_path = directory / "systemctl-state.json"
        self.fail: dict[str, Any] | None = None
        self.delay_seconds = 0.0
        self._write({"units": {}, "fail": None, "delay_seconds": 0.0})

    # -- the state file (shared with the stand-in processes, which change it too) -----------

    @contextlib.contextmanager
    def _locked(self) -> Iterator[dict[str, Any]]:
        with open(str(self.state_path) + ".lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            state: dict[str, Any] = json.loads(self.state_path.read_text())
            yield state
            self._write(state)

    def _write(self, state: dict[str, Any]) -> None:
        temporary = self.state_path.with_name(self.state_path.name + ".tmp")
        temporary.write_text(json.dumps(state))
        os.replace(temporary, self.state_path)

    @property
    def units(self) -> dict[str, dict[str, Any]]:
        """Every unit's state as the stand-ins see it now (private `_` keys included)."""
        units: dict[str, dict[str, Any]] = json.loads(self.state_path.read_text())["units"]
        return units

    def set_unit(self, unit: str, **properties: Any) -> None:
        """Set (merge) a unit's properties, e.g. `ActiveState="active", MainPID=1234`."""
        with self._locked() as state:
            state["units"].setdefault(unit, {}).update(properties)

    def declare_service(
        self,
        unit: str,
        argv: Sequence[str],
        *,
        exec_start_pre: Sequence[str] | None = None,
        env: dict[str, str] | None = None,
        stop_timeout_seconds: float = 10.0,
        start_check_seconds: float = 0.3,
        restart: str = "no",
        restart_sec: float = 0.1,
        start_limit_interval_seconds: float = 10.0,
        start_limit_burst: int = 5,
        **properties: Any,
    ) -> None:
        """Declare a unit that `systemctl start` really starts (`argv` is its ExecStart=).

        `restart`: Restart= (`no`, `on-failure`, `always`); `restart_sec`: RestartSec=;
        `start_limit_*`: StartLimitIntervalSec= and StartLimitBurst= (an interval of 0: none).
        """
        if restart not in ("no", "on-failure", "always"):
            raise ValueError(f"restart: {restart!r} is not one of no, on-failure, always")
        self.set_unit(
            unit,
            LoadState="loaded",
            ActiveState="inactive",
            SubState="dead",
            MainPID=0,
            ExecStart=exec_start_value([str(a) for a in argv]),
            _argv=[str(a) for a in argv],
            _exec_start_pre=[str(a) for a in exec_start_pre] if exec_start_pre else None,
            _env=dict(env or {}),
            _stop_timeout_seconds=stop_timeout_seconds,
            _start_check_seconds=start_check_seconds,
            _restart=restart,
            _restart_sec=restart_sec,
            _start_limit_interval_seconds=start_limit_interval_seconds,
            _start_limit_burst=start_limit_burst,
            **properties,
        )

    def save(self) -> None:
        """Write `fail` and `delay_seconds` into the state file the stand-in reads on every call."""
        with self._locked() as state:
            state["fail"] = self.fail
            state["delay_seconds"] = self.delay_seconds

    def main_pid(self, unit: str) -> int | None:
        """The unit's MainPID as recorded (None for 0 or an unknown unit)."""
        pid = int(self.units.get(unit, {}).get("MainPID") or 0)
        return pid or None

    def log_path(self, unit: str) -> Path:
        """The unit's log file: the service's output and systemd's own lines."""
        return self.directory / f"{unit}.log"

    def calls(self) -> list[str]:
        """The argument lines of every call so far."""
        path = Path(str(self.state_path) + ".calls")
        return path.read_text().splitlines() if path.exists() else []

    def restarts(self, unit: str) -> int:
        """The unit's NRestarts as recorded."""
        return int(self.units.get(unit, {}).get("NRestarts") or 0)

    def stop_all(self, timeout: float = 5.0) -> None:
        """SIGKILL every supervisor, then every process group a unit started (test teardown).

        Under the state's lock: a supervisor starts a process and records it under that lock,
        so none is started unrecorded; killed first, none is restarted afterwards.
        """
        targets: list[tuple[int, int | None]] = []
        with self._locked() as state:
            for unit_state in state["units"].values():
                unit_state["_stopping"] = True
                for role in ("supervisor", "control", "main"):
                    pid = int(unit_state.get(f"_{role}_pid") or 0)
                    ticks = unit_state.get(f"_{role}_ticks")
                    if pid and _start_ticks(pid) == ticks:
                        targets.append((pid, ticks))
                        with contextlib.suppress(ProcessLookupError, PermissionError):
                            if role == "supervisor":
                                os.kill(pid, signal.SIGKILL)
                            else:
                                os.killpg(pid, signal.SIGKILL)
        deadline = time.monotonic() + timeout
        for pid, ticks in targets:
            while _start_ticks(pid) == ticks and time.monotonic() < deadline:
                time.sleep(0.02)

    def leftovers(self) -> list[int]:
        """Pids of the stand-in's processes (supervisors, pre-starts, mains) still running."""
        found = []
        for unit_state in self.units.values():
            for role in ("supervisor", "control", "main"):
                pid = int(unit_state.get(f"_{role}_pid") or 0)
                if pid and _start_ticks(pid) == unit_state.get(f"_{role}_ticks"):
                    found.append(pid)
        return found

    # -- PATH -------------------------------------------------------------------------------

    def env(self) -> dict[str, str]:
        """An environment for child processes that finds the stand-ins on PATH."""
        return {
            **os.environ,
            "PATH": _path(),
            "GPUFLEET_SYSTEMCTL_STATE": str(self.state_path),
        }

    def activate(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """Put the stand-ins first on this process's PATH for the test."""
        monkeypatch.setenv("PATH", _path())
        monkeypatch.setenv("GPUFLEET_SYSTEMCTL_STATE", str(self.state_path))


def _path() -> str:
    """The stand-ins first, then this interpreter's directory, then the PATH as it was.

    The stand-ins run as `python3 -S` (stdlib only): the exporter runs `systemctl show` on
    every scrape, and a version manager's `python3` shim (pyenv's: a shell script that runs
    `pyenv exec`) or site-packages' start-up took 0.1-0.2 s of each call here, over a second
    on a loaded machine, where the real systemctl answers in milliseconds; the lab's 1 s
    scrapes then timed out.
    """
    return os.pathsep.join([str(BIN), str(Path(sys.executable).parent), os.environ.get("PATH", "")])


def _start_ticks(pid: int) -> int | None:
    """`/proc/PID/stat` starttime; None when gone or a zombie (nobody reaps the orphans here)."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rfind(")") + 2 :].split()
    if not fields or fields[0] in ("Z", "X"):
        return None
    return int(fields[19])


def _running(pid: int) -> bool:
    """Whether `pid` runs (a zombie has exited: nobody may reap the stand-in's orphans)."""
    return _start_ticks(pid) is not None
