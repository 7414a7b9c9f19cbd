"""Drives the systemctl stand-in (tests/stand_in_bin/systemctl): systemd is not PID 1 here.

`SystemctlStandIn(tmp_path)` writes the state file; `env()` gives an environment whose PATH
finds the stand-in first (for child processes); `activate(monkeypatch)` does the same for this
process, so code that runs `systemctl` from PATH meets the stand-in.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

BIN = Path(__file__).resolve().parent / "stand_in_bin"


class SystemctlStandIn:
    """The state the stand-in answers from, and how to put it first on PATH."""

    def __init__(self, directory: Path) -> None:
        self.state_path = directory / "systemctl-state.json"
        self.units: dict[str, dict[str, Any]] = {}
        self.fail: dict[str, Any] | None = None
        self.delay_seconds = 0.0
        self.save()

    def set_unit(self, unit: str, **properties: Any) -> None:
        """Set (merge) a unit's properties, e.g. `ActiveState="active", MainPID=1234`."""
        self.units.setdefault(unit, {}).update(properties)
        self.save()

    def save(self) -> None:
        """Write the state file the stand-in reads on every call."""
        state = {"units": self.units, "fail": self.fail, "delay_seconds": self.delay_seconds}
        self.state_path.write_text(json.dumps(state))

    def calls(self) -> list[str]:
        """The argument lines of every call so far."""
        path = Path(str(self.state_path) + ".calls")
        return path.read_text().splitlines() if path.exists() else []

    def env(self) -> dict[str, str]:
        """An environment for child processes that finds the stand-in on PATH."""
        return {
            **os.environ,
            "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}",
            "GPUFLEET_SYSTEMCTL_STATE": str(self.state_path),
        }

    def activate(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """Put the stand-in first on this process's PATH for the test."""
        monkeypatch.setenv("PATH", f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}")
        monkeypatch.setenv("GPUFLEET_SYSTEMCTL_STATE", str(self.state_path))
