"""systemd units, read with one `systemctl show` call for all of them.

`systemctl` is run as found on `PATH` (not D-Bus, not an absolute path), so that operators and
tests can interpose their own. Its `show` output is `Key=Value` lines, one block per unit in
the order asked, blocks separated by an empty line (systemctl(1), "show").

Manual check: `systemctl show --property=Id,ActiveState,SubState,MainPID,NRestarts \
llama-server@alpha.service`.
"""

from __future__ import annotations

import logging
import os
import subprocess
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from exporter.sources.procfs import descendants

log = logging.getLogger(__name__)

SYSTEMCTL = "systemctl"
PROPERTIES = (
    "Id",
    "LoadState",
    "ActiveState",
    "SubState",
    "MainPID",
    "NRestarts",
    "StateChangeTimestampMonotonic",
    "ControlGroup",
    "ExecStart",
)


class SystemdError(Exception):
    """`systemctl` could not be run or its answer could not be read."""


def run_tool(
    command: Sequence[str],
    *,
    timeout: float,
    what: str,
    error: type[Exception] = SystemdError,
) -> subprocess.CompletedProcess[bytes]:
    """Run a systemd tool (`command[0]`, as found on PATH) with an argv list, never a shell.

    Its output is left as bytes for the caller to decode. Raises `error` naming `what` when
    the tool is missing, cannot be run or does not return within `timeout`; the exit status
    is the caller's to judge.
    """
    tool = command[0]
    try:
        return subprocess.run(
            list(command),
            capture_output=True,
            timeout=timeout,
            check=False,
            stdin=subprocess.DEVNULL,
        )
    except FileNotFoundError:
        raise error(f"{tool} not found on PATH") from None
    except subprocess.TimeoutExpired:
        raise error(f"{what} did not answer within {timeout:g} s") from None
    except OSError as exc:
        raise error(f"cannot run {tool}: {exc}") from None


def _text(data: bytes) -> str:
    return data.decode("utf-8", "replace")


@dataclass(frozen=True)
class UnitStatus:
    """One unit as `systemctl show` describes it; None where systemd says nothing."""

    unit: str
    load_state: str
    active_state: str
    sub_state: str
    main_pid: int | None  # None when the unit has no main process (MainPID=0)
    n_restarts: int | None
    state_change_monotonic_seconds: float | None  # CLOCK_MONOTONIC, as systemd records it
    control_group: str | None  # e.g. /system.slice/llama-server@alpha.service
    exec_start_path: str | None  # the executable of the first ExecStart= line
    # Its argv as `systemctl show` prints it: words joined by spaces, environment variables
    # (`${X}`, `$X`) unexpanded, specifiers (`%i`) already resolved. () when unknown.
    exec_start_argv: tuple[str, ...] = ()

    @property
    def active(self) -> bool:
        """True while the unit is active (running, or exited for oneshot units)."""
        return self.active_state == "active"


def _int(value: str) -> int | None:
    try:
        return int(value)
    except ValueError:
        return None


def _exec_path(value: str) -> str | None:
    # ExecStart={ path=/usr/bin/llama-server ; argv[]=/usr/bin/llama-server -m … ; … }
    marker = "path="
    start = value.find(marker)
    if start < 0:
        return None
    end = value.find(" ;", start)
    path = value[start + len(marker) : end if end >= 0 else None].strip()
    return path or None


def _exec_argv(value: str) -> tuple[str, ...]:
    # `argv[]=` up to the next ` ; `: systemd joins the words with single spaces.
    marker = " argv[]="
    start = value.find(marker)
    if start < 0:
        return ()
    end = value.find(" ; ", start + len(marker))
    text = value[start + len(marker) : end if end >= 0 else None]
    return tuple(text.split(" ")) if text else ()


def parse_show(text: str, units: Sequence[str]) -> dict[str, UnitStatus]:
    """Parse `systemctl show` output for `units` (asked in that order)."""
    blocks: list[dict[str, str]] = []
    current: dict[str, str] = {}
    for line in text.splitlines():
        if not line.strip():
            if current:
                blocks.append(current)
                current = {}
            continue
        key, sep, value = line.partition("=")
        if sep:
            current.setdefault(key, value)  # the first ExecStart= line, if there are several
    if current:
        blocks.append(current)
    if len(blocks) != len(units):
        raise SystemdError(f"systemctl show gave {len(blocks)} blocks for {len(units)} units")
    result = {}
    for unit, block in zip(units, blocks, strict=True):
        pid = _int(block.get("MainPID", ""))
        mono = _int(block.get("StateChangeTimestampMonotonic", ""))
        result[unit] = UnitStatus(
            unit=unit,
            load_state=block.get("LoadState", ""),
            active_state=block.get("ActiveState", ""),
            sub_state=block.get("SubState", ""),
            main_pid=pid if pid else None,
            n_restarts=_int(block.get("NRestarts", "")),
            state_change_monotonic_seconds=mono / 1e6 if mono else None,
            control_group=block.get("ControlGroup") or None,
            exec_start_path=_exec_path(block.get("ExecStart", "")),
            exec_start_argv=_exec_argv(block.get("ExecStart", "")),
        )
    return result


def show_units(
    units: Sequence[str], *, systemctl: str = SYSTEMCTL, timeout: float = 5.0
) -> dict[str, UnitStatus]:
    """Every unit's status from one `systemctl show` call; raises `SystemdError`."""
    if not units:
        return {}
    command = [systemctl, "show", "--no-pager", f"--property={','.join(PROPERTIES)}", *units]
    done = run_tool(command, timeout=timeout, what=f"{systemctl} show")
    if done.returncode != 0:
        stderr = _text(done.stderr).strip()
        raise SystemdError(f"{systemctl} show exited {done.returncode}: {stderr}")
    return parse_show(_text(done.stdout), units)


class UnitsReader:
    """The roster units' statuses, shared by the collectors of one scrape.

    The units, processes and ports collectors all need the same statuses in the same scrape;
    keeping an answer for `max_age_seconds` makes that one `systemctl show` call, not three.
    """

    def __init__(
        self,
        units: Sequence[str],
        *,
        systemctl: str = SYSTEMCTL,
        max_age_seconds: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.units = list(dict.fromkeys(units))
        self._systemctl = systemctl
        self._max_age = max_age_seconds
        self._clock = clock
        self._lock = threading.Lock()
        self._at: float | None = None
        self._result: dict[str, UnitStatus] | SystemdError = {}

    def statuses(self) -> dict[str, UnitStatus]:
        """The statuses (fresh, or at most `max_age_seconds` old); raises `SystemdError`."""
        with self._lock:
            now = self._clock()
            if self._at is None or now - self._at > self._max_age:
                try:
                    self._result = show_units(self.units, systemctl=self._systemctl)
                except SystemdError as exc:
                    self._result = exc
                self._at = now
            result = self._result
        if isinstance(result, SystemdError):
            # A new exception each time: raising the stored one again would add this raise's
            # frames to its traceback, scrape after scrape (three collectors share a reader),
            # and keep every one of those frames and their locals alive.
            raise SystemdError(*result.args)
        return result


def monotonic_to_unix(monotonic_seconds: float) -> float:
    """A CLOCK_MONOTONIC time (as systemd records state changes) as Unix time."""
    return time.time() - (time.monotonic() - monotonic_seconds)


def unit_pids(status: UnitStatus, *, sysfs: str = "/sys", procfs: str = "/proc") -> set[int]:
    """The unit's processes: its main process and every process of its control group.

    From the unit's cgroup (`cgroup.procs`, v2 then v1's systemd hierarchy) when readable;
    else the main process and its descendants (`procfs.descendants`).
    """
    if status.control_group:
        relative = status.control_group.lstrip("/")
        for hierarchy in ("fs/cgroup", "fs/cgroup/systemd"):
            path = os.path.join(sysfs, hierarchy, relative, "cgroup.procs")
            try:
                with open(path, encoding="ascii") as procs:
                    pids = {int(line) for line in procs if line.strip()}
            except (OSError, ValueError):
                continue
            if pids:
                return pids
    if status.main_pid is None:
        return set()
    return descendants(status.main_pid, procfs=procfs)


def run_unit_job(
    action: str, unit: str, *, systemctl: str = SYSTEMCTL, timeout: float = 120.0
) -> tuple[int, str]:
    """Run `systemctl ACTION UNIT` (start, stop, restart, reset-failed): exit status, stderr.

    An argv list, never a shell; `unit` must already have been checked against the roster.
    Raises `SystemdError` when systemctl cannot be run or does not return within `timeout`.
    """
    if action not in ("start", "stop", "restart", "reset-failed"):
        raise ValueError(f"not a unit job: {action!r}")
    done = run_tool([systemctl, action, unit], timeout=timeout, what=f"{systemctl} {action}")
    return done.returncode, _text(done.stderr).strip()
