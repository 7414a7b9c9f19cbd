"""`gpu-fleet-node check-config`: the roster and this host in it, checked without acting.

Run as the operator would before installing the forced command: it reads the roster, finds the
host, and answers with the usual JSON line; it starts no unit job, reads no GPU and connects to
nothing. It is a local command only: under `--ssh` it is an unknown verb.
"""

from __future__ import annotations

import socket
from pathlib import Path

from tests.systemctl_stand_in import SystemctlStandIn
from tests.test_node_verbs import run_node, write_roster


def test_check_config_answers_from_the_roster_alone(tmp_path: Path) -> None:
    with socket.create_server(("127.0.0.1", 0)) as listener:
        listener.settimeout(0.2)
        roster = write_roster(tmp_path, listener.getsockname()[1])  # server alpha lives there
        stand_in = SystemctlStandIn(tmp_path)
        before = stand_in.state_path.read_text()
        good = run_node(stand_in, roster, "check-config")
        assert good.code == 0, good.stderr
        assert good.json["ok"] is True and good.json["host"] == "lab"
        assert good.result == {
            "roster": str(roster),
            "servers": ["alpha"],
            "power_cap_gpus": ["0", "1"],
            "pci_bus_ids": [],
        }
        try:
            listener.accept()[0].close()
            connected = True
        except TimeoutError:
            connected = False
        assert not connected, "check-config connected to a roster server"
        assert stand_in.state_path.read_text() == before  # no systemctl job either


def test_check_config_names_the_file_and_key_and_exits_2(tmp_path: Path) -> None:
    roster = write_roster(tmp_path, 31001)
    roster.write_text(roster.read_text().replace("engine: llama", "engine: llamas", 1))
    stand_in = SystemctlStandIn(tmp_path)
    bad = run_node(stand_in, roster, "check-config")
    assert bad.code == 2 and bad.json["ok"] is False
    assert f"{roster}: hosts.lab.servers.alpha.engine: Input should be" in bad.json["error"]
    # Not a remote verb: the forced command refuses it like any unknown word.
    remote = run_node(stand_in, write_roster(tmp_path, 31001), ssh="check-config")
    assert remote.code == 2 and "unknown verb 'check-config'" in remote.json["error"]
