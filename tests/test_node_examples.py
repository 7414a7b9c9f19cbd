"""The example `authorized_keys` and sudoers files of gpu-fleet-node, checked by the real tools.

- `visudo -cf` parses the sudoers example (Debian's `sudo` package);
- `ssh-keygen -l` reads the authorized_keys line with a real key put in (`openssh-client`);
- the real `sudo` runs the rule: in a private mount namespace (the machine's own /etc/sudoers
  is never touched) the example is bind-mounted over /etc/sudoers, with `nobody` as the node
  user and this checkout's paths, and `nobody` may run exactly the forced command, with
  SSH_ORIGINAL_COMMAND passed through, and no other command line.

A missing tool fails the test: `make test` installs sudo and openssh.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.llama_lab import free_port
from tests.test_node_verbs import NODE, write_roster
from tests.test_ports import NOBODY

EXAMPLES = Path(__file__).resolve().parent.parent / "examples" / "node"
SUDOERS = EXAMPLES / "sudoers.example"
AUTHORIZED_KEYS = EXAMPLES / "authorized_keys.example"
FORCED = (
    "/opt/gpu-fleet/bin/gpu-fleet-node --config /etc/gpu-fleet/fleet.yaml --host dioscuri --ssh"
)


def tool(path: str) -> str:
    found = shutil.which(path) or (path if os.access(path, os.X_OK) else None)
    if found is None:
        pytest.fail(f"{path} is missing: `make test` installs Debian's sudo and openssh packages")
    return found


def rule_lines(path: Path) -> list[str]:
    return [
        line
        for line in path.read_text().splitlines()
        if line.strip() and not line.lstrip().startswith("#")
    ]


def test_the_sudoers_example_parses_with_visudo() -> None:
    done = subprocess.run(
        [tool("/usr/sbin/visudo"), "-cf", str(SUDOERS)],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "parsed OK" in done.stdout


def test_the_sudoers_example_allows_exactly_the_forced_command() -> None:
    rules = rule_lines(SUDOERS)
    assert rules == [
        f"Cmnd_Alias GPUFLEET_NODE = {FORCED}",
        'Defaults!GPUFLEET_NODE env_keep += "SSH_ORIGINAL_COMMAND"',
        "gpufleet ALL=(root) NOPASSWD: GPUFLEET_NODE",
    ]
    # In sudoers `*` matches spaces too: a wildcard would let another --config through.
    assert not any(char in "".join(rules) for char in "*?[")


def test_the_authorized_keys_line_forces_sudo_of_that_command(tmp_path: Path) -> None:
    (line,) = rule_lines(AUTHORIZED_KEYS)
    match = re.fullmatch(
        r'command="([^"]+)",restrict (ssh-ed25519) AAAA… gpu-fleet-remediator', line
    )
    assert match is not None, line
    assert match.group(1) == f"sudo {FORCED}"
    # With a real key in place of the placeholder, OpenSSH reads the line (options and all).
    key = tmp_path / "gpu-fleet-remediator"
    subprocess.run(
        [tool("ssh-keygen"), "-q", "-t", "ed25519", "-N", "", "-C", "gpu-fleet-remediator",
         "-f", str(key)],
        check=True, timeout=30,
    )  # fmt: skip
    public = key.with_suffix(".pub").read_text().split()
    authorized = tmp_path / "authorized_keys"
    authorized.write_text(line.replace("AAAA…", public[1]) + "\n")
    done = subprocess.run(
        [tool("ssh-keygen"), "-l", "-f", str(authorized)],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert "gpu-fleet-remediator (ED25519)" in done.stdout


@pytest.fixture
def shared_dir() -> Iterator[Path]:
    """A directory `nobody` can look into (pytest's tmp_path is under root's 0700 one)."""
    with tempfile.TemporaryDirectory(prefix="gpufleet-sudo-") as name:
        os.chmod(name, 0o755)
        yield Path(name)


def sudo_as_nobody(
    sudoers: Path, argv: list[str], ssh_command: str
) -> subprocess.CompletedProcess[str]:
    """Run `sudo -n ARGV` as nobody with `sudoers` as /etc/sudoers, in a private mount namespace."""
    setpriv = [tool("setpriv"), f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups"]
    # The bind mount exists only in the new namespace: the machine's sudoers stays as it is.
    inner = 'mount --bind "$0" /etc/sudoers && exec "$@"'
    command = [
        tool("unshare"), "--mount", "--propagation", "private", "--", "sh", "-c", inner,
        str(sudoers), *setpriv, tool("sudo"), "-n", *argv,
    ]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != "SSH_ORIGINAL_COMMAND"}
    env["SSH_ORIGINAL_COMMAND"] = ssh_command
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=60, check=False)


def test_sudo_runs_exactly_the_forced_command_and_keeps_ssh_original_command(
    shared_dir: Path,
) -> None:
    assert os.geteuid() == 0, "this test mounts over /etc/sudoers in a namespace; run it as root"
    roster = write_roster(shared_dir, free_port())
    os.chmod(roster, 0o644)
    sudoers = shared_dir / "sudoers"
    text = "Defaults env_reset\n" + SUDOERS.read_text()  # Debian's default is env_reset
    text = text.replace("/opt/gpu-fleet/bin/gpu-fleet-node", NODE)
    text = text.replace("/etc/gpu-fleet/fleet.yaml", str(roster))
    text = text.replace("--host dioscuri", "--host lab").replace("gpufleet ALL", "nobody ALL")
    sudoers.write_text(text)
    os.chmod(sudoers, 0o440)  # sudo refuses a sudoers file others may write
    forced = shlex.split(FORCED.replace("/opt/gpu-fleet/bin/gpu-fleet-node", NODE))
    forced = [str(roster) if a == "/etc/gpu-fleet/fleet.yaml" else a for a in forced]
    forced = ["lab" if a == "dioscuri" else a for a in forced]

    # The forced command runs as root, and sees the client's command (env_keep).
    done = sudo_as_nobody(sudoers, forced, "restart gamma")
    assert done.returncode == 2, done.stderr
    answer = json.loads(done.stdout)
    assert "server 'gamma' belongs to host 'elsewhere'" in answer["error"]

    # Any other command line is sudo's to refuse: gpu-fleet-node never runs.
    for other in (
        [NODE, "--config", str(shared_dir / "mine.yaml"), "--host", "lab", "--ssh"],
        [*forced, "--config", str(shared_dir / "mine.yaml")],
        [NODE, "--config", str(roster), "--host", "lab", "restart", "alpha"],
    ):
        refused = sudo_as_nobody(sudoers, other, "restart alpha")
        assert refused.returncode == 1 and refused.stdout == ""
        assert "a password is required" in refused.stderr

    # Without the env_keep line sudo would drop the client's command.
    sudoers.chmod(0o640)
    sudoers.write_text(
        "\n".join(line for line in text.splitlines() if "env_keep" not in line) + "\n"
    )
    sudoers.chmod(0o440)
    dropped = sudo_as_nobody(sudoers, forced, "restart gamma")
    assert dropped.returncode == 2
    assert "SSH_ORIGINAL_COMMAND is not set" in json.loads(dropped.stdout)["error"]
