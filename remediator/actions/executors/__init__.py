"""Executors: how a request reaches `gpu-fleet-node` on a host — over SSH, or locally.

`executor_for(name, host, settings)` picks one per roster host: `local: true` runs the node
as a child process here (`local.py`), every other host is reached with the OpenSSH client
(`ssh.py`). Both share `base.py`: the request check (verb and plain-token words only), the
bounded child process, and the mapping of exit codes to a `NodeAnswer`:

| what happened | answer |
|---|---|
| exit 0, JSON `ok: true` | ok |
| exit 1 | failed: the node's `error` |
| exit 2 | failed: `refused by the host: …` |
| exit 255 (ssh) | failed: `ssh: <ssh's last stderr line>` (connection, auth, host key) |
| over the time limit | failed: `timeout: …`, the process group killed |
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from fleet.roster import Host
from remediator.actions.executors.base import (
    NodeAnswer,
    NodeExecutor,
    NodeRequestError,
    check_request,
)
from remediator.actions.executors.local import DEFAULT_NODE_COMMAND, LocalExecutor
from remediator.actions.executors.ssh import SshExecutor, SshOptions

__all__ = [
    "ExecutorSettings",
    "LocalExecutor",
    "NodeAnswer",
    "NodeExecutor",
    "NodeRequestError",
    "SshExecutor",
    "SshOptions",
    "check_request",
    "executor_for",
]


@dataclass(frozen=True)
class ExecutorSettings:
    """What executors need from the remediator's config."""

    roster_path: Path
    ssh: SshOptions = field(default_factory=SshOptions)
    node_command: tuple[str, ...] = DEFAULT_NODE_COMMAND


def executor_for(name: str, host: Host, settings: ExecutorSettings) -> NodeExecutor:
    """The executor for roster host `name`: local when the roster says `local: true`."""
    if host.local:
        return LocalExecutor(name, settings.roster_path, settings.node_command)
    return SshExecutor(name, host, settings.ssh)
