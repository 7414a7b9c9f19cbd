"""`gpu-fleet-node` refuses what it must not do: exit 2, `ok: false`, and nothing changes.

One real llama-server (run by the systemctl stand-in, as in tests/test_node_verbs.py) serves
every case of this module: each refusal must leave its main process, its port and the unit
untouched, and must not even reach `systemctl start|stop|restart`.
"""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.llama_lab import free_port
from tests.systemctl_stand_in import SystemctlStandIn
from tests.test_node_verbs import (
    NODE,
    UNIT,
    Lab,
    alive,
    healthy,
    llama_argv,
    run_node,
    write_roster,
)

JOBS = ("start ", "stop ", "restart ")


@pytest.fixture(scope="module")
def running(
    llama_binary: Path, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Lab]:
    directory = tmp_path_factory.mktemp("refusals")
    stand_in = SystemctlStandIn(directory)
    port = free_port()
    stand_in.declare_service(UNIT, llama_argv(llama_binary, tiny_model, port))
    lab = Lab(stand_in, write_roster(directory, port), port, llama_binary)
    try:
        subprocess.run(["systemctl", "start", UNIT], env=stand_in.env(), check=True, timeout=60)
        lab.wait_healthy()
        yield lab
    finally:
        stand_in.stop_all()


def assert_untouched(lab: Lab, pid: int | None) -> None:
    """The server runs as before: same main process, port answering, no unit job run."""
    assert pid is not None and lab.main_pid() == pid and alive(pid)
    assert healthy(lab.url)
    # The module's own `systemctl start` is the only unit job ever run.
    assert [call for call in lab.stand_in.calls() if call.startswith(JOBS)] == [f"start {UNIT}"]


@pytest.mark.parametrize(
    ("command", "complaint"),
    [
        ("restart alpha; rm -rf /", "5 words; at most 4"),
        ("restart alpha;", "word 2 'alpha;' is not a plain name"),
        ("restart alpha&&id", "word 2 'alpha&&id' is not a plain name"),
        ("status $(id)", "word 2 '$(id)' is not a plain name"),
        ("status `id`", "word 2 '`id`' is not a plain name"),
        ("status alpha|id", "word 2 'alpha|id' is not a plain name"),
        ("restart alpha\nid", "word 2 'alpha\\nid' is not a plain name"),
        # A trailing newline too: a regular expression's `$` would let it through.
        ("restart alpha\n", "word 2 'alpha\\n' is not a plain name"),
        ("power-cap 0 300 0000:41:00.0\n", "word 4 '0000:41:00.0\\n' is not a plain name"),
        ("restart\talpha", "word 1 'restart\\talpha' is not a plain name"),
        ("status ../alpha", "word 2 '../alpha' is not a plain name"),
        ("status /etc/passwd", "word 2 '/etc/passwd' is not a plain name"),
        ("status 'alpha'", "word 2 \"'alpha'\" is not a plain name"),
        ("restart --config", "word 2 '--config' is not a plain name"),
        ("restart  alpha", "word 2 is empty (two spaces in a row?)"),
        (" restart alpha", "word 1 is empty"),
        ("", "the command is empty"),
        ("a b c d e", "5 words; at most 4"),
        ("x" * 600, "longer than 516 characters"),
        ("restart alpha now", "restart takes 1 argument(s), got 2: usage: restart SERVER"),
        ("restart", "restart takes 1 argument(s), got 0"),
        ("reboot alpha", "unknown verb 'reboot'; the verbs are: status, evidence"),
        ("restart delta", "host 'lab' has no server 'delta' (its servers: alpha)"),
        ("restart gamma", "server 'gamma' belongs to host 'elsewhere', not to this host 'lab'"),
        (
            "power-cap 2 200 0000:c1:00.0",
            "GPU 2 (0000:c1:00.0) has no power_cap_watts bounds in the roster for host 'lab'",
        ),
        (
            "power-cap 0 900 0000:41:00.0",
            "900 W is outside the roster's bounds for GPU 0: 150-300 W",
        ),
        ("power-cap 0 -5 0000:41:00.0", "word 3 '-5' is not a plain name"),
        ("power-cap zero 200 0000:41:00.0", "GPU must be a gpu index (a number), not 'zero'"),
        (
            "power-cap 0 200",
            "power-cap takes 3 argument(s), got 2: usage: power-cap GPU WATTS PCI_BUS_ID",
        ),
        (
            "power-cap 0 200 0000:41:00",
            "PCI_BUS_ID must be a PCI bus id (0000:41:00.0), not '0000:41:00'",
        ),
        ("power-cap-restore 7 0000:41:00.0", "GPU 7 (0000:41:00.0) has no power_cap_watts bounds"),
    ],
)
def test_ssh_refusals_change_nothing(running: Lab, command: str, complaint: str) -> None:
    pid = running.main_pid()
    answer = running.node(ssh=command)
    assert answer.code == 2, answer.stderr
    assert answer.json["ok"] is False and answer.json["result"] == {}
    assert complaint in answer.json["error"]
    assert "refused, nothing was done" in answer.stderr
    assert_untouched(running, pid)


def test_without_ssh_original_command_it_refuses(running: Lab) -> None:
    answer = running.node(ssh=None, options=("--ssh",))
    assert answer.code == 2
    assert "SSH_ORIGINAL_COMMAND is not set" in answer.json["error"]
    assert_untouched(running, running.main_pid())


@pytest.mark.parametrize(
    ("argv", "complaint"),
    [
        # The forced command's own words are not a second way in.
        (["--ssh", "restart", "alpha"], "--ssh takes the command from SSH_ORIGINAL_COMMAND"),
        # A second --config (a sudoers wildcard would let one through) is refused outright.
        (["--ssh", "--config", "/tmp/evil.yaml"], "--config is given twice"),
    ],
)
def test_a_forced_command_with_extra_words_is_refused(
    running: Lab, argv: list[str], complaint: str
) -> None:
    env = running.stand_in.env()
    env["SSH_ORIGINAL_COMMAND"] = "restart alpha"
    done = subprocess.run(
        [NODE, "--config", str(running.roster), "--host", "lab", *argv],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 2
    assert complaint in done.stdout and '"ok":false' in done.stdout
    assert_untouched(running, running.main_pid())


@pytest.mark.parametrize(
    ("args", "complaint"),
    [
        (["restart", "gamma"], "server 'gamma' belongs to host 'elsewhere'"),
        (["status", "../alpha"], "word 2 '../alpha' is not a plain name"),
        (["restart", "alpha", "--wait-seconds", "5"], "bad command line"),
        ([], "no verb given"),
    ],
)
def test_plain_subcommand_refusals(running: Lab, args: list[str], complaint: str) -> None:
    answer = running.node(*args)
    assert answer.code == 2
    assert not answer.json["ok"] and complaint in answer.json["error"]
    assert_untouched(running, running.main_pid())


def test_a_bad_roster_refuses_every_verb(running: Lab, tmp_path: Path) -> None:
    broken = tmp_path / "fleet.yaml"
    broken.write_text(running.roster.read_text().replace("engine: llama", "engine: llamma", 1))
    answer = run_node(running.stand_in, broken, ssh="restart alpha")
    assert answer.code == 2
    assert "cannot use the roster" in answer.json["error"]
    assert "hosts.lab.servers.alpha.engine" in answer.json["error"]
    assert_untouched(running, running.main_pid())
