"""`gpu-fleet-remediator` subcommands as a user runs them (real processes)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.remediator_lab import ALERTMANAGER_FIXTURES, CountingServer, write_setup

REMEDIATOR = str(Path(sys.executable).parent / "gpu-fleet-remediator")
EXAMPLE_ROSTER = Path(__file__).resolve().parent.parent / "examples" / "fleet.yaml"


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [REMEDIATOR, *args], capture_output=True, text=True, timeout=60, check=False
    )


def test_check_config_ok_and_errors(tmp_path: Path) -> None:
    setup = write_setup(tmp_path, servers={"alpha": "http://127.0.0.1:31001"})
    ok = run("check-config", "--config", str(setup.config))
    assert ok.returncode == 0, ok.stderr
    assert "probe-llama" in ok.stdout and "llama-server-unhealthy" in ok.stdout
    text = setup.config.read_text().replace("dry_run: false", "dry_run: maybe\nlisten2: x")
    setup.config.write_text(text)
    bad = run("check-config", "--config", str(setup.config))
    assert bad.returncode == 2
    assert "dry_run" in bad.stderr and "listen2" in bad.stderr and str(setup.config) in bad.stderr
    (setup.playbooks / "broken.yaml").write_text(
        "name: broken\nmatch: {alertname: X}\ntarget: server\nsteps:\n  - explode: {}\n"
    )
    setup.config.write_text(text.replace("dry_run: maybe\nlisten2: x", "dry_run: false"))
    broken = run("check-config", "--config", str(setup.config))
    assert broken.returncode == 2
    assert "broken.yaml" in broken.stderr and "explode" in broken.stderr


def test_replay_dry_run_then_for_real_and_runs_table(tmp_path: Path) -> None:
    alpha = CountingServer()
    try:
        setup = write_setup(tmp_path, servers={"alpha": alpha.url})
        payload = str(ALERTMANAGER_FIXTURES / "firing.json")
        dry = run("replay", payload, "--config", str(setup.config), "--dry-run")
        assert dry.returncode == 0, dry.stderr
        assert "dry_run" in dry.stdout and alpha.count("/health") == 0
        grouped = str(ALERTMANAGER_FIXTURES / "grouped.json")
        real = run("replay", grouped, "--config", str(setup.config))
        assert real.returncode == 0, real.stderr
        assert "healed" in real.stdout and "rejected" in real.stdout
        assert alpha.count("/health") == 1
        table = run("runs", "--config", str(setup.config))
        assert table.returncode == 0
        assert "LlamaServerDown" in table.stdout and "server/dioscuri/alpha" in table.stdout
        as_json = json.loads(run("runs", "--config", str(setup.config), "--json").stdout)
        assert len(as_json) == 4
    finally:
        alpha.close()


def test_roster_file_sd() -> None:
    result = run("roster", "file-sd", "--roster", str(EXAMPLE_ROSTER))
    assert result.returncode == 0, result.stderr
    groups = json.loads(result.stdout)
    assert {"targets": ["192.0.2.10:9445"], "labels": {"host": "dioscuri"}} in groups
    assert len(groups) == 6
    assert all(set(g["labels"]) == {"host"} for g in groups)


def test_init_config_writes_a_working_local_setup(tmp_path: Path) -> None:
    roster = tmp_path / "fleet.yaml"
    roster.write_text("hosts:\n  local:\n    address: 127.0.0.1\n    local: true\n")
    result = run("init-config", str(tmp_path / "run"), "--roster", str(roster))
    assert result.returncode == 0, result.stderr
    token = tmp_path / "run" / "webhook.token"
    assert token.stat().st_mode & 0o777 == 0o600
    check = run("check-config", "--config", str(tmp_path / "run" / "remediator.yaml"))
    assert check.returncode == 0, check.stderr
    again = run("init-config", str(tmp_path / "run"), "--roster", str(roster))
    assert "left as it is" in again.stdout
