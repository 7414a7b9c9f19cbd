"""The SSH executor: `gpu-fleet-node` on a roster host through the OpenSSH client.

    ssh -T -o BatchMode=yes -o StrictHostKeyChecking=yes -o ConnectTimeout=10
        [-o UserKnownHostsFile=FILE] [-i IDENTITY -o IdentitiesOnly=yes] [-p PORT]
        -- [USER@]ADDRESS VERB ARG...

On the host, the key's `authorized_keys` entry forces
`command="sudo /opt/gpu-fleet/bin/gpu-fleet-node --config … --host NAME --ssh",restrict`;
the node reads the words sent here from `SSH_ORIGINAL_COMMAND` and checks them against its
own roster. The remote side joins the words with spaces, so every word is checked to be a
plain token first (`base.check_request`): no word can carry a space, a quote or a `;`.

The operator's own `~/.ssh/config` keeps working (no `-F`): this only *adds* options. Batch
mode (never a password or passphrase prompt: a prompt would hang a run) and strict host-key
checking (an unknown or changed host key fails, exit 255, instead of being trusted) are
forced; `User` and `Port` are set only when the roster's `ssh:` gives them.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from fleet.roster import Host
from remediator.actions.executors.base import NodeAnswer, check_request, run_request


@dataclass(frozen=True)
class SshOptions:
    """The client's settings (the remediator config's `ssh:` section)."""

    binary: str = "ssh"
    identity_file: Path | None = None
    known_hosts_file: Path | None = None
    connect_timeout_seconds: int = 10


class SshExecutor:
    """Runs node requests on `host` over SSH."""

    def __init__(self, host: str, entry: Host, options: SshOptions) -> None:
        self.host = host
        self.entry = entry
        self.options = options

    def destination(self) -> str:
        """`[user@]address`: the roster's address (validated: an IP or an RFC 1123 name)."""
        user = self.entry.ssh.user if self.entry.ssh is not None else None
        return f"{user}@{self.entry.address}" if user else self.entry.address

    def command(self, verb: str, args: Sequence[str]) -> list[str]:
        """The ssh argv for the request; raises `NodeRequestError` for a bad word."""
        words = check_request(verb, args)
        options = self.options
        argv = [
            options.binary,
            "-T",  # no terminal: the node answers JSON, nothing interactive
            "-o", "BatchMode=yes",
            "-o", "StrictHostKeyChecking=yes",
            "-o", f"ConnectTimeout={options.connect_timeout_seconds}",
        ]  # fmt: skip
        if options.known_hosts_file is not None:
            argv += ["-o", f"UserKnownHostsFile={options.known_hosts_file}"]
        if options.identity_file is not None:
            # Only this key: an agent's other keys must not be tried (and counted as failures).
            argv += ["-i", str(options.identity_file), "-o", "IdentitiesOnly=yes"]
        port = self.entry.ssh.port if self.entry.ssh is not None else None
        if port is not None:
            argv += ["-p", str(port)]
        # `--` ends the options: nothing after it is read as one, whatever it looks like.
        return [*argv, "--", self.destination(), *words]

    def run(
        self,
        verb: str,
        args: Sequence[str],
        *,
        timeout: float,
        cancel: threading.Event | None = None,
    ) -> NodeAnswer:
        """Run the request over SSH; exit 255 is reported as `ssh: <its message>`."""
        return run_request(self, verb, args, timeout=timeout, cancel=cancel, env=None, via_ssh=True)
