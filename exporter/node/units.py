"""The unit verbs of `gpu-fleet-node`: status, evidence, and start/stop/restart of a server.

Every function here takes a server already checked against the roster (`exporter.node.cli`
does that): the unit name that reaches `systemctl` and `journalctl` is the roster's, never
text from the request. Both are run from PATH as argv lists.

- `unit_status`: what systemd says of the unit, and who listens on the server's port;
- `evidence`: the status, the port's owners and the main process in detail, the unit's last
  journal lines and the GPU processes, each part best-effort (a part that fails is
  `{"error": ...}`, never a failed verb);
- `unit_job`: `systemctl start|stop|restart UNIT`, then a bounded wait for the state it should
  reach (restart: active with a *new* MainPID).
"""

from __future__ import annotations

import shlex
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from exporter.sources.journal import JournalError, unit_journal
from exporter.sources.procfs import process_info, read_cgroup, read_status, systemd_unit_of
from exporter.sources.procnet import ProcNetError, find_holders, read_listeners, url_port
from exporter.sources.systemd import (
    SystemdError,
    UnitStatus,
    monotonic_to_unix,
    run_unit_job,
    show_units,
    unit_pids,
)
from fleet.roster import Server

JOURNAL_LINES = 50
MAX_CMDLINE = 4096
POLL_SECONDS = 0.2
# States in which a unit's processes are its own (a listener of a unit in any other state is a
# ghost, whoever holds it), as the ports collector judges.
RUNNING_STATES = frozenset({"active", "reloading"})


@dataclass(frozen=True)
class Roots:
    """Where the host is read from: procfs and sysfs roots (tests point them elsewhere)."""

    procfs: str = "/proc"
    sysfs: str = "/sys"


def _statuses(server: Server, siblings: Mapping[str, Server]) -> dict[str, UnitStatus]:
    # One systemctl call for the unit and its siblings: a sibling's processes on the same
    # port (two servers on two addresses of one port) are not this server's ghost.
    units = list(dict.fromkeys([server.unit, *(s.unit for s in siblings.values())]))
    return show_units(units)


def describe_status(status: UnitStatus) -> dict[str, Any]:
    """A unit's status as the verbs report it."""
    changed = status.state_change_monotonic_seconds
    return {
        "unit": status.unit,
        "load_state": status.load_state,
        "active_state": status.active_state,
        "sub_state": status.sub_state,
        "main_pid": status.main_pid,
        "n_restarts": status.n_restarts,
        # Unix seconds (systemd records the change on CLOCK_MONOTONIC).
        "state_change_timestamp": monotonic_to_unix(changed) if changed else None,
    }


def unit_status(
    server: Server, siblings: Mapping[str, Server], roots: Roots = Roots()
) -> dict[str, Any]:
    """The `status` result; raises `SystemdError` or `ProcNetError` when it cannot be read."""
    statuses = _statuses(server, siblings)
    status = statuses[server.unit]
    port = url_port(server.url)
    listeners, ghost, _ = _port_holders(server, statuses, siblings, roots)
    return {
        **describe_status(status),
        "port": port,
        "listeners": [
            {"pid": pid, "comm": info.comm if info else None, "user": info.user if info else None}
            for pid, info in ((pid, process_info(pid, procfs=roots.procfs)) for pid in listeners)
        ],
        "ghost": ghost,
    }


def _port_holders(
    server: Server,
    statuses: Mapping[str, UnitStatus],
    siblings: Mapping[str, Server],
    roots: Roots,
) -> tuple[list[int], bool | None, bool]:
    """Who listens on the server's port.

    The pids, whether the port has a ghost (None: cannot tell), and whether some holder's open
    files could not be read (privilege).
    """
    status = statuses[server.unit]
    port = url_port(server.url)
    by_port = read_listeners(procfs=roots.procfs, ports={port})
    inodes = {sock.inode for sock in by_port.get(port, [])}
    if not inodes:
        return [], False, False
    own = unit_pids(status, sysfs=roots.sysfs, procfs=roots.procfs)
    scan = find_holders(inodes, sorted(own), procfs=roots.procfs, all_holders=True)
    pids = sorted(set().union(*scan.holders.values())) if scan.holders else []
    if status.active_state not in RUNNING_STATES:
        return pids, True, bool(scan.denied)  # any listener while the unit is down
    ours = set(own)
    for sibling in siblings.values():
        sibling_status = statuses.get(sibling.unit)
        if sibling_status is not None and sibling.unit != server.unit:
            ours |= unit_pids(sibling_status, sysfs=roots.sysfs, procfs=roots.procfs)
    if any(holders - ours for holders in scan.holders.values()):
        return pids, True, bool(scan.denied)
    if scan.unresolved(inodes):
        return pids, None, bool(scan.denied)  # a holder we may not (or cannot) see
    return pids, False, False


def _part(build: Callable[[], Any]) -> Any:
    """One best-effort part of the evidence: its value, or `{"error": why}`."""
    try:
        return build()
    except (OSError, SystemdError, ProcNetError, JournalError, ValueError) as exc:
        return {"error": str(exc) or type(exc).__name__}


def evidence(
    server: Server,
    siblings: Mapping[str, Server],
    roots: Roots,
    gpu_processes: Callable[[], list[dict[str, Any]]],
) -> dict[str, Any]:
    """The `evidence` result: every part best-effort."""
    status_part = _part(lambda: unit_status(server, siblings, roots))

    def port_owner() -> list[dict[str, Any]]:
        statuses = _statuses(server, siblings)
        pids, _, _ = _port_holders(server, statuses, siblings, roots)
        owners = []
        for pid in pids:
            info = process_info(pid, procfs=roots.procfs)
            if info is None:
                continue  # exited since the scan
            owners.append(
                {
                    "pid": pid,
                    "comm": info.comm,
                    "exe": info.exe,
                    "cmdline": shlex.join(info.cmdline)[:MAX_CMDLINE],
                    "user": info.user,
                    "start_time": info.start_time,
                    "cgroup_unit": systemd_unit_of(pid, procfs=roots.procfs),
                }
            )
        return owners

    def main_process() -> dict[str, Any] | None:
        pid = status_part.get("main_pid") if isinstance(status_part, dict) else None
        if pid is None:
            return None
        return _main_process(pid, roots.procfs)

    return {
        "unit": status_part,
        "port_owner": _part(port_owner),
        "main_process": _part(main_process),
        "journal": _part(lambda: unit_journal(server.unit, lines=JOURNAL_LINES)),
        "gpu_processes": _part(gpu_processes),
    }


def _main_process(pid: int, procfs: str) -> dict[str, Any]:
    info = process_info(pid, procfs=procfs)
    if info is None:
        raise ValueError(f"the main process {pid} is gone")
    status = read_status(pid, procfs=procfs)
    cgroup = read_cgroup(pid, procfs=procfs)
    if status is None or cgroup is None:
        raise ValueError(f"cannot read {procfs}/{pid}/status and cgroup (exited meanwhile?)")
    return {
        "pid": pid,
        "comm": info.comm,
        "exe": info.exe,
        "cmdline": shlex.join(info.cmdline)[:MAX_CMDLINE],
        "user": info.user,
        "rss_bytes": status.resident_bytes,
        "threads": status.threads,
        "start_time": info.start_time,
        "cgroup": cgroup.strip()[:MAX_CMDLINE],
    }


class JobFailed(Exception):
    """A unit job did not reach its state; `result` holds the statuses before and after."""

    def __init__(self, message: str, result: dict[str, Any]) -> None:
        super().__init__(message)
        self.result = result


def _crash_looped(status: Mapping[str, Any]) -> bool:
    """Failed, or restarted by systemd since its last start (its start limit may be spent).

    Even when the loop has just ended and the unit is active again.
    """
    return (
        status.get("active_state") == "failed"
        or status.get("sub_state") == "auto-restart"
        or int(status.get("n_restarts") or 0) > 0
    )


def unit_job(
    action: str,
    server: Server,
    siblings: Mapping[str, Server],
    *,
    wait_seconds: float,
    roots: Roots = Roots(),
) -> dict[str, Any]:
    """`systemctl ACTION UNIT` and a bounded wait for its state; the result, or `JobFailed`.

    start: `active`; restart: `active` with a MainPID other than before; stop: `inactive` or
    `failed`. Raises `SystemdError` when the status cannot be read before anything is done.

    A start or restart of a `failed` or crash-looped unit (a restart scheduled, `auto-restart`,
    or `NRestarts` above 0: systemd restarted it since its last start) first runs `systemctl
    reset-failed UNIT` (in the result as `reset_failed`): a unit that crash-looped into its
    start limit (`Result=start-limit-hit`) refuses every start until then (systemd.unit(5),
    StartLimitIntervalSec=), and one that looped without reaching it (still looping, or up
    again once the ghost is gone) has spent most of it: a manual start counts too, and a
    restart refused there has already stopped the server. reset-failed clears the counter
    whatever the state. A crash loop is exactly what the remediator restarts after removing
    its cause (a port ghost killed). The remediator's own cooldown and breaker keep its
    restarts from becoming a loop of their own.
    """
    before = unit_status(server, siblings, roots)
    deadline = time.monotonic() + wait_seconds
    result: dict[str, Any] = {"before": before}
    try:
        if action in ("start", "restart") and _crash_looped(before):
            code, stderr = run_unit_job("reset-failed", server.unit, timeout=wait_seconds)
            result["reset_failed"] = {"exit": code, "stderr": stderr[:MAX_CMDLINE]}
        code, stderr = run_unit_job(action, server.unit, timeout=wait_seconds)
    except SystemdError as exc:
        result["after"] = _part(lambda: unit_status(server, siblings, roots))
        raise JobFailed(str(exc), result) from None
    result["systemctl"] = {"exit": code, "stderr": stderr[:MAX_CMDLINE]}
    while True:
        after = _part(lambda: unit_status(server, siblings, roots))
        reached = (
            isinstance(after, dict) and "error" not in after and _reached(action, before, after)
        )
        if reached or code != 0 or time.monotonic() >= deadline:
            break
        time.sleep(POLL_SECONDS)
    result["after"] = after
    if not reached:
        if code != 0:
            why = f"systemctl {action} exited {code}: {stderr or '(no message)'}"
        else:
            why = f"it did not get there within {wait_seconds:g} s"
        state = after.get("active_state") if isinstance(after, dict) else None
        raise JobFailed(
            f"{action} {server.unit}: {_goal(action)} not reached (now {state}): {why}", result
        )
    return result


def _goal(action: str) -> str:
    return {
        "start": "active",
        "restart": "active with a new main process",
        "stop": "inactive or failed",
    }[action]


def _reached(action: str, before: Mapping[str, Any], after: Mapping[str, Any]) -> bool:
    if action == "stop":
        return after.get("active_state") in ("inactive", "failed")
    if after.get("active_state") != "active":
        return False
    if action == "restart":
        return after.get("main_pid") is not None and after.get("main_pid") != before.get("main_pid")
    return True
