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

`exec_start_pre=[...]` runs a command before each start, like ExecStartPre= (a non-zero exit
fails the start); `env={...}` adds to the service's environment (systemd's minimal one:
`PATH`, `LANG`). The process's output and systemd's own lines go to `log_path(unit)`, which
the journalctl stand-in prints in `short-iso` form (`journalctl -u UNIT -n 50 -o short-iso`).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import signal
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
        **properties: Any,
    ) -> None:
        """Declare a unit that `systemctl start` really starts (`argv` is its ExecStart=)."""
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

    def stop_all(self, timeout: float = 5.0) -> None:
        """SIGKILL the process group of every service the stand-in started (test teardown)."""
        for state in self.units.values():
            pid = int(state.get("MainPID") or 0)
            if pid and state.get("_managed"):
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(pid, signal.SIGKILL)
                deadline = time.monotonic() + timeout
                while _running(pid) and time.monotonic() < deadline:
                    time.sleep(0.02)

    # -- PATH -------------------------------------------------------------------------------

    def env(self) -> dict[str, str]:
        """An environment for child processes that finds the stand-ins on PATH."""
        return {
            **os.environ,
            "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}",
            "GPUFLEET_SYSTEMCTL_STATE": str(self.state_path),
        }

    def activate(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """Put the stand-ins first on this process's PATH for the test."""
        monkeypatch.setenv("PATH", f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}")
        monkeypatch.setenv("GPUFLEET_SYSTEMCTL_STATE", str(self.state_path))


def _running(pid: int) -> bool:
    """Whether `pid` runs (a zombie has exited: nobody may reap the stand-in's orphans)."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return text[text.rfind(")") + 2 :].split()[0] not in ("Z", "X")
