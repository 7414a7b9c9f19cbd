"""A real OpenSSH server on 127.0.0.1 for the SSH executor's tests (Debian's openssh-server).

`SshLab(directory)` makes a host key and client keys with `ssh-keygen`, writes its own
`sshd_config` (`-f`: the machine's own sshd and its config are never touched) and an
`authorized_keys` whose entries carry forced commands, starts `/usr/sbin/sshd -D -e` on a free
port and writes a `known_hosts` that names that port (`[127.0.0.1]:PORT`), so the client runs
with strict host-key checking ON, as in production.

The config differs from a production sshd only where a temporary directory needs it:
`StrictModes no` (the keys and `authorized_keys` sit in a world-readable tmp dir),
`UsePAM no` (no PAM stack for a throw-away daemon), `AuthorizedKeysFile` in the tmp dir, and
`AllowUsers` the current user only.

In production the forced command is `sudo /opt/gpu-fleet/bin/gpu-fleet-node --config … --host
… --ssh`; the tests run as root (the containers' user), so they need no `sudo` and run the
node directly, through a small wrapper that puts the systemctl stand-in first on PATH (sshd
gives a session its own minimal environment).
"""

from __future__ import annotations

import os
import shlex
import shutil
import socket
import subprocess
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

from tests.llama_lab import LabError, free_port, stop_process

SSHD = Path("/usr/sbin/sshd")
REPO = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class ClientKey:
    """A client key pair and the forced command its `authorized_keys` entry carries."""

    name: str
    private: Path
    public: Path
    command: str


def keygen(path: Path, comment: str) -> Path:
    """An ed25519 key pair without a passphrase at `path` (and `path.pub`)."""
    subprocess.run(
        ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", comment, "-f", str(path)],
        check=True,
        capture_output=True,
    )
    return path


def write_wrapper(path: Path, argv: Sequence[str], env: Mapping[str, str]) -> Path:
    """An executable shell script that runs `argv` with `env` added (a forced command)."""
    exports = "".join(f"export {key}={shlex.quote(value)}\n" for key, value in env.items())
    path.write_text("#!/bin/sh\n" + exports + "exec " + shlex.join(argv) + "\n")
    path.chmod(0o755)
    return path


class SshLab:
    """One sshd with its keys; `add_key(name, command)` before `start()`.

    `address`: the loopback address it listens on (the lab gives each host its own, 127.0.0.2…).
    """

    def __init__(self, directory: Path, address: str = "127.0.0.1") -> None:
        if not SSHD.exists() or shutil.which("ssh") is None:
            raise LabError("openssh-server and openssh-client are needed (make test installs them)")
        self.directory = directory
        self.address = address
        self.directory.mkdir(parents=True, exist_ok=True)
        self.host_key = keygen(directory / "ssh_host_ed25519_key", "lab host key")
        self.port = free_port()
        self.user = (
            os.environ.get("USER")
            or subprocess.run(
                ["id", "-un"], check=True, capture_output=True, text=True
            ).stdout.strip()
        )
        self.keys: dict[str, ClientKey] = {}
        self.known_hosts = directory / "known_hosts"
        self.log = directory / "sshd.log"
        self._process: subprocess.Popen[bytes] | None = None

    def add_key(self, name: str, command: str, private: Path | None = None) -> ClientKey:
        """A client key whose `authorized_keys` entry forces `command` (`restrict`ed).

        `private`: an existing key pair to authorize (one remediator key for several hosts,
        as in production); else a new one is made.
        """
        if private is None:
            private = keygen(self.directory / f"client_{name}", f"lab client {name}")
        key = ClientKey(name, private, Path(f"{private}.pub"), command)
        self.keys[name] = key
        return key

    def _write_config(self) -> Path:
        lines = []
        for key in self.keys.values():
            quoted = key.command.replace("\\", "\\\\").replace('"', '\\"')
            lines.append(f'command="{quoted}",restrict {key.public.read_text().strip()}')
        authorized = self.directory / "authorized_keys"
        authorized.write_text("\n".join(lines) + "\n")
        config = self.directory / "sshd_config"
        config.write_text(
            f"Port {self.port}\n"
            f"ListenAddress {self.address}\n"
            f"HostKey {self.host_key}\n"
            f"PidFile {self.directory / 'sshd.pid'}\n"
            f"AuthorizedKeysFile {authorized}\n"
            "UsePAM no\n"
            "StrictModes no\n"
            "PasswordAuthentication no\n"
            "KbdInteractiveAuthentication no\n"
            "PubkeyAuthentication yes\n"
            "PermitRootLogin prohibit-password\n"
            f"AllowUsers {self.user}\n"
            "LogLevel VERBOSE\n"
        )
        host_public = Path(f"{self.host_key}.pub").read_text().split()
        self.known_hosts.write_text(
            f"[{self.address}]:{self.port} {host_public[0]} {host_public[1]}\n"
        )
        return config

    def start(self, timeout: float = 15.0) -> SshLab:
        """Start sshd and wait until it accepts connections."""
        config = self._write_config()
        # sshd needs its privilege-separation directory (made by the package's unit otherwise).
        Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)
        with self.log.open("wb") as log:
            self._process = subprocess.Popen(
                [str(SSHD), "-D", "-e", "-f", str(config)],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
            )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._process.poll() is not None:
                raise LabError(f"sshd exited {self._process.returncode}: {self.log.read_text()}")
            with socket.socket() as probe:
                probe.settimeout(0.2)
                if probe.connect_ex((self.address, self.port)) == 0:
                    return self
            time.sleep(0.05)
        raise LabError(f"sshd did not listen on {self.port}: {self.log.read_text()}")

    def stop(self) -> None:
        """Stop sshd (its sessions' children are not ours to keep)."""
        if self._process is not None:
            stop_process(self._process, 5)

    def __enter__(self) -> SshLab:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.stop()


def node_forced_command(
    directory: Path, roster: Path, host: str, env: Mapping[str, str], extra: Sequence[str] = ()
) -> str:
    """The forced command of a node key: a wrapper running `gpu-fleet-node … --ssh`.

    `env` should carry the systemctl stand-in's PATH and state file (`SystemctlStandIn.env`).
    """
    node = REPO / ".venv" / "bin" / "gpu-fleet-node"
    argv = [str(node), "--config", str(roster), "--host", host, *extra, "--ssh"]
    wanted = {key: env[key] for key in ("PATH", "GPUFLEET_SYSTEMCTL_STATE") if key in env}
    wanted["PYTHONPATH"] = str(REPO)
    return str(write_wrapper(directory / f"node-{host}.sh", argv, wanted))
