"""The executors: request checks, argv, and runs through a real sshd to the real node.

A real OpenSSH server (tests/ssh_lab.py) forces `gpu-fleet-node --ssh` for the node key; the
node drives a real llama-server through the systemctl stand-in (tests/stand_in_bin/systemctl,
which really starts and stops the process: systemd is not PID 1 here). Other keys force
commands that misbehave on purpose (sleep, flood) to check the client side's bounds.
"""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from fleet.roster import Roster, load_roster
from remediator.actions.executors import (
    ExecutorSettings,
    LocalExecutor,
    NodeRequestError,
    SshExecutor,
    SshOptions,
    check_request,
    executor_for,
)
from remediator.actions.executors.base import STDOUT_LIMIT
from tests.llama_lab import free_port, http_get, wait_until
from tests.ssh_lab import REPO, SshLab, node_forced_command
from tests.systemctl_stand_in import SystemctlStandIn

UNIT = "llama-server@alpha.service"


# --- the request check and the argv (no process) ---------------------------------------------


@pytest.mark.parametrize(
    ("verb", "args", "reason"),
    [
        ("reboot", [], "unknown verb"),
        ("status", ["alpha; rm -rf /"], "not a plain token"),
        ("status", ["alpha beta"], "not a plain token"),
        ("status", ["$(id)"], "not a plain token"),
        ("status", ["alpha\n"], "not a plain token"),  # `$` alone would let it through
        ("status", ["-oProxyCommand=x"], "not a plain token"),
        ("status", [""], "not a plain token"),
        ("status", ["a" * 129], "not a plain token"),
        ("power-cap", ["0", "300", "x", "y"], "at most 4"),
    ],
)
def test_requests_that_are_never_sent(verb: str, args: list[str], reason: str) -> None:
    with pytest.raises(NodeRequestError, match=reason):
        check_request(verb, args)


def roster_of(text: str, tmp_path: Path) -> Roster:
    path = tmp_path / "fleet.yaml"
    path.write_text(text)
    return load_roster(path)


def test_ssh_argv_adds_options_and_never_a_shell_string(tmp_path: Path) -> None:
    roster = roster_of(
        "hosts:\n  dioscuri:\n    address: 127.0.0.1\n    ssh: {user: gpufleet, port: 2222}\n"
        "  theia:\n    address: theia.example.org\n",
        tmp_path,
    )
    options = SshOptions(
        identity_file=tmp_path / "id", known_hosts_file=tmp_path / "kh", connect_timeout_seconds=3
    )
    argv = SshExecutor("dioscuri", roster.hosts["dioscuri"], options).command("status", ["alpha"])
    assert argv == [
        "ssh", "-T", "-o", "BatchMode=yes", "-o", "StrictHostKeyChecking=yes",
        "-o", "ConnectTimeout=3", "-o", f"UserKnownHostsFile={tmp_path / 'kh'}",
        "-i", str(tmp_path / "id"), "-o", "IdentitiesOnly=yes", "-p", "2222",
        "--", "gpufleet@127.0.0.1", "status", "alpha",
    ]  # fmt: skip
    # No user or port in the roster: the operator's ~/.ssh/config decides (no -F, no -l).
    plain = SshExecutor("theia", roster.hosts["theia"], SshOptions()).command("evidence", ["b"])
    assert plain[-4:] == ["--", "theia.example.org", "evidence", "b"]
    assert "-F" not in plain and "-l" not in plain and "-p" not in plain
    with pytest.raises(NodeRequestError):
        SshExecutor("theia", roster.hosts["theia"], SshOptions()).command("status", ["a;b"])


def test_executor_for_picks_local_for_local_hosts(tmp_path: Path) -> None:
    roster = roster_of(
        "hosts:\n  here:\n    address: 127.0.0.1\n    local: true\n"
        "  there:\n    address: 127.0.0.2\n",
        tmp_path,
    )
    settings = ExecutorSettings(roster_path=tmp_path / "fleet.yaml", node_command=("node", "-x"))
    local = executor_for("here", roster.hosts["here"], settings)
    assert isinstance(local, LocalExecutor)
    assert local.command("status", ["alpha"]) == [
        "node", "-x", "--config", str(tmp_path / "fleet.yaml"), "--host", "here", "status", "alpha",
    ]  # fmt: skip
    assert isinstance(executor_for("there", roster.hosts["there"], settings), SshExecutor)


def test_a_request_refused_here_starts_no_process(tmp_path: Path) -> None:
    marker = tmp_path / "touched"
    executor = LocalExecutor("here", tmp_path / "fleet.yaml", ("touch", str(marker)))
    answer = executor.run("status", [f"alpha;touch {marker}"], timeout=5)
    assert not answer.ok and answer.refused and answer.command == ()
    assert answer.summary.startswith("not sent: ")
    assert not marker.exists()


# --- through a real sshd ----------------------------------------------------------------------


@dataclass
class SshSetup:
    lab: SshLab
    roster_path: Path
    roster: Roster
    stand_in: SystemctlStandIn
    server_url: str

    def executor(self, key: str = "node", known_hosts: Path | None = None) -> SshExecutor:
        options = SshOptions(
            identity_file=self.lab.keys[key].private,
            known_hosts_file=known_hosts or self.lab.known_hosts,
            connect_timeout_seconds=5,
        )
        return SshExecutor("dioscuri", self.roster.hosts["dioscuri"], options)


@pytest.fixture(scope="module")
def ssh_setup(
    tmp_path_factory: pytest.TempPathFactory, llama_binary: Path, tiny_model: Path
) -> Iterator[SshSetup]:
    directory = tmp_path_factory.mktemp("ssh")
    stand_in = SystemctlStandIn(directory)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    lab = SshLab(directory / "sshd")
    roster_path = directory / "fleet.yaml"
    roster_path.write_text(
        "hosts:\n"
        "  dioscuri:\n"
        "    address: 127.0.0.1\n"
        f"    ssh: {{user: {lab.user}, port: {lab.port}}}\n"
        "    servers:\n"
        "      alpha:\n"
        "        engine: llama\n"
        f"        url: {url}\n"
        f"        unit: {UNIT}\n"
        "        role: gpu-dense\n"
        "        model: tiny\n"
        "  theia:\n"
        "    address: 127.0.0.2\n"
        "    servers:\n"
        "      beta: {engine: llama, url: 'http://127.0.0.2:31002', "
        "unit: llama-server@beta.service, role: r, model: m}\n"
    )
    stand_in.declare_service(
        UNIT,
        [str(llama_binary), "-m", str(tiny_model), "--host", "127.0.0.1", "--port", str(port),
         "-c", "256", "-np", "1", "-t", "1"],
        stop_timeout_seconds=5,
    )  # fmt: skip
    lab.add_key("node", node_forced_command(directory, roster_path, "dioscuri", stand_in.env()))
    lab.add_key("sleeper", "sleep 60")
    lab.add_key("flood", f"head -c {STDOUT_LIMIT * 3} /dev/zero")
    subprocess.run(["systemctl", "start", UNIT], env=stand_in.env(), check=True, timeout=30)
    try:
        wait_until(lambda: _healthy(url), 60, interval=0.2, what="llama-server healthy")
        with lab:
            yield SshSetup(lab, roster_path, load_roster(roster_path), stand_in, url)
    finally:
        stand_in.stop_all()


def _healthy(url: str) -> bool:
    try:
        return http_get(url, "/health", timeout=1).status == 200
    except OSError:
        return False


def test_status_and_restart_over_ssh_against_a_real_server(ssh_setup: SshSetup) -> None:
    executor = ssh_setup.executor()
    status = executor.run("status", ["alpha"], timeout=30)
    assert status.ok, status.journal_text()
    assert status.exit_code == 0 and status.command[0] == "ssh"
    before = ssh_setup.stand_in.main_pid(UNIT)
    assert status.result["active_state"] == "active"
    assert status.result["main_pid"] == before

    restart = executor.run("restart", ["alpha"], timeout=60)
    assert restart.ok, restart.journal_text()
    after = ssh_setup.stand_in.main_pid(UNIT)
    assert after is not None and after != before
    assert restart.result["before"]["main_pid"] == before
    assert restart.result["after"]["main_pid"] == after
    # The old process is gone for real, and the new one serves.
    assert before is not None
    assert not Path(f"/proc/{before}").exists() or _zombie(before)
    wait_until(lambda: _healthy(ssh_setup.server_url), 60, interval=0.2, what="healthy again")


def _zombie(pid: int | None) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1].startswith("Z")
    except (OSError, IndexError):
        return True


def test_the_host_refuses_what_is_not_its_own(ssh_setup: SshSetup) -> None:
    executor = ssh_setup.executor()
    other = executor.run("status", ["beta"], timeout=30)  # theia's server, not dioscuri's
    assert not other.ok and other.refused and other.exit_code == 2
    assert other.summary.startswith("refused by the host: ")
    unknown = executor.run("restart", ["omega"], timeout=30)
    assert not unknown.ok and unknown.refused


def test_injection_sent_raw_is_refused_by_the_forced_command(
    ssh_setup: SshSetup, tmp_path: Path
) -> None:
    # Bypass the client's own check on purpose: the node must refuse on its own.
    marker = tmp_path / "pwned"
    argv = ssh_setup.executor().command("status", ["alpha"])
    argv = [*argv[:-2], "status", f"alpha;touch {marker}"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=30, check=False)
    assert done.returncode == 2, done.stderr
    assert '"ok": false' in done.stdout.replace('"ok":false', '"ok": false')
    assert not marker.exists()


def test_a_changed_host_key_fails_as_ssh_with_a_clear_reason(
    ssh_setup: SshSetup, tmp_path: Path
) -> None:
    other_key = tmp_path / "other"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(other_key)],
                   check=True)  # fmt: skip
    kind, blob = Path(f"{other_key}.pub").read_text().split()[:2]
    wrong = tmp_path / "known_hosts"
    wrong.write_text(f"[127.0.0.1]:{ssh_setup.lab.port} {kind} {blob}\n")
    calls = len(ssh_setup.stand_in.calls())
    answer = ssh_setup.executor(known_hosts=wrong).run("restart", ["alpha"], timeout=30)
    assert not answer.ok and answer.exit_code == 255
    assert answer.summary == "ssh: Host key verification failed."
    assert len(ssh_setup.stand_in.calls()) == calls  # nothing ran on the host

    # An unknown host (empty known_hosts) is not trusted either: strict checking is on.
    empty = tmp_path / "empty"
    empty.write_text("")
    unknown = ssh_setup.executor(known_hosts=empty).run("status", ["alpha"], timeout=30)
    assert not unknown.ok and unknown.summary.startswith("ssh: ")


def test_a_command_over_its_time_is_killed_with_its_process_group(ssh_setup: SshSetup) -> None:
    start = time.monotonic()
    answer = ssh_setup.executor("sleeper").run("status", ["alpha"], timeout=2)
    took = time.monotonic() - start
    assert not answer.ok and answer.timed_out
    assert answer.summary.startswith(
        "timeout: status alpha on dioscuri did not finish within 2.0 s"
    )
    assert took < 6
    assert answer.exit_code is None


def test_output_is_bounded(ssh_setup: SshSetup) -> None:
    answer = ssh_setup.executor("flood").run("status", ["alpha"], timeout=30)
    assert not answer.ok
    assert f"more than {STDOUT_LIMIT} bytes to stdout" in answer.summary
    assert len(answer.stdout) <= STDOUT_LIMIT


# --- locally --------------------------------------------------------------------------------


def test_local_executor_runs_the_node_with_the_roster(ssh_setup: SshSetup) -> None:
    node = str(REPO / ".venv" / "bin" / "gpu-fleet-node")
    executor = LocalExecutor("dioscuri", ssh_setup.roster_path, (node,))
    env_before = os.environ.copy()
    # The node runs `systemctl` from PATH: the stand-in's, as for the forced command.
    os.environ.update({k: v for k, v in ssh_setup.stand_in.env().items() if k in
                       ("PATH", "GPUFLEET_SYSTEMCTL_STATE")})  # fmt: skip
    try:
        answer = executor.run("status", ["alpha"], timeout=30)
        refused = executor.run("status", ["beta"], timeout=30)
    finally:
        os.environ.clear()
        os.environ.update(env_before)
    assert answer.ok, answer.journal_text()
    assert answer.result["main_pid"] == ssh_setup.stand_in.main_pid(UNIT)
    assert not refused.ok and refused.refused
