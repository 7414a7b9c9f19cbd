"""The local executor: `gpu-fleet-node` on the remediator's own machine (roster `local: true`).

    <node_command…> --config ROSTER --host NAME VERB ARG...

`node_command` comes from the remediator's config (default `["gpu-fleet-node"]`; e.g.
`["sudo", "-n", "/opt/gpu-fleet/bin/gpu-fleet-node"]` when the remediator's user may run it
through a sudoers line). The same checks as over SSH apply: the words are plain tokens, and
the node checks them against the roster.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from pathlib import Path

from remediator.actions.executors.base import NodeAnswer, check_request, run_request

DEFAULT_NODE_COMMAND = ("gpu-fleet-node",)


class LocalExecutor:
    """Runs node requests for the local host as a child process."""

    def __init__(
        self, host: str, roster_path: Path, node_command: Sequence[str] = DEFAULT_NODE_COMMAND
    ) -> None:
        if not node_command:
            raise ValueError("node_command must name a program")
        self.host = host
        self.roster_path = roster_path
        self.node_command = tuple(node_command)

    def command(self, verb: str, args: Sequence[str]) -> list[str]:
        """The argv for the request; raises `NodeRequestError` for a bad word."""
        words = check_request(verb, args)
        return [
            *self.node_command, "--config", str(self.roster_path), "--host", self.host, *words,
        ]  # fmt: skip

    def run(
        self,
        verb: str,
        args: Sequence[str],
        *,
        timeout: float,
        cancel: threading.Event | None = None,
    ) -> NodeAnswer:
        """Run the request locally (exit 255 means nothing special here)."""
        return run_request(
            self, verb, args, timeout=timeout, cancel=cancel, env=None, via_ssh=False
        )
