"""`gpu-fleet-remediator` subcommands as a user runs them (real processes)."""

from __future__ import annotations

import base64
import json
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

from tests.llama_lab import free_port, stop_process, wait_until
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


def test_replay_is_a_sandbox_unless_live_and_never_claims_other_runs(tmp_path: Path) -> None:
    from remediator.alerts import parse_notification
    from remediator.journal import Journal

    alpha = CountingServer()
    try:
        setup = write_setup(tmp_path, servers={"alpha": alpha.url})
        # The serving replica's journal holds a queued run already (say a worker is busy).
        journal_url = f"sqlite:///{tmp_path / 'journal.db'}"
        live = Journal(journal_url, replica_id="central-1")
        queued = (ALERTMANAGER_FIXTURES / "repeat-interval.json").read_bytes()
        queued_body = queued.replace(b"5f2a9c0e1b3d4a67", b"0123456789abcdef")
        [queued_run] = live.admit(parse_notification(queued_body), queued_body).new_run_ids
        live.close()
        payload = str(ALERTMANAGER_FIXTURES / "firing.json")
        sandbox = run("replay", payload, "--config", str(setup.config))
        assert sandbox.returncode == 0, sandbox.stderr
        assert "sandbox" in sandbox.stdout and "dry_run" in sandbox.stdout
        assert alpha.count("/health") == 0
        table = run("runs", "--config", str(setup.config), "--json")
        assert len(json.loads(table.stdout)) == 1  # the live journal saw nothing of it
        grouped = str(ALERTMANAGER_FIXTURES / "grouped.json")
        real = run("replay", grouped, "--config", str(setup.config), "--live")
        assert real.returncode == 0, real.stderr
        assert "live journal" in real.stdout
        assert "healed" in real.stdout and "rejected" in real.stdout
        assert alpha.count("/health") == 1
        table = run("runs", "--config", str(setup.config))
        assert table.returncode == 0
        assert "LlamaServerDown" in table.stdout and "server/dioscuri/alpha" in table.stdout
        as_json = {r["id"]: r for r in json.loads(
            run("runs", "--config", str(setup.config), "--json").stdout)}  # fmt: skip
        assert len(as_json) == 4
        # The queued run is the serving replica's to handle: still pending, nobody claimed it.
        assert as_json[queued_run]["state"] == "pending"
        assert {r["owner"] for i, r in as_json.items() if i != queued_run} == {
            f"{_replica(setup.config)}-replay"
        }
    finally:
        alpha.close()


def _replica(config: Path) -> str:
    from remediator.config import load_config

    return load_config(config).replica_id


def test_people_act_from_the_cli_and_are_journaled_with_who_and_why(tmp_path: Path) -> None:
    setup = write_setup(tmp_path, servers={"alpha": "http://127.0.0.1:9"})
    config = ["--config", str(setup.config)]
    assert run("pause", *config, "--reason", "deploy").returncode == 0
    assert run("resume", *config).returncode == 0
    on = run("maintenance", "dioscuri", "on", *config, "--until", "2030-01-01T00:00:00Z",
             "--reason", "swap")  # fmt: skip
    assert on.returncode == 0, on.stderr
    assert run("maintenance", "nowhere", "on", *config).returncode == 2
    assert run("maintenance", "dioscuri", "on", *config, "--until", "soon").returncode == 2
    reset = run("breaker", "reset", "server/dioscuri/alpha", *config)
    assert reset.returncode == 1 and "not open" in reset.stderr
    assert run("escalation", "ack", "12345", *config).returncode == 1
    assert run("cancel", "999", *config).returncode == 1
    from remediator.journal import Journal

    journal = Journal(f"sqlite:///{tmp_path / 'journal.db'}", replica_id="x")
    try:
        kinds = {e.kind: e for e in journal.events()}
        assert {"paused", "resumed", "maintenance_on"} <= set(kinds)
        assert kinds["paused"].actor is not None and kinds["paused"].actor.startswith("cli:")
        assert "deploy" in kinds["paused"].detail
        assert "until 2030-01-01" in kinds["maintenance_on"].detail
        [(host, window)] = journal.maintenance_windows().items()
        assert host == "dioscuri" and window[1] is not None and window[2] == "swap"
    finally:
        journal.close()


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


def test_init_config_opens_the_page_with_its_own_password(tmp_path: Path) -> None:
    roster = tmp_path / "fleet.yaml"
    roster.write_text("hosts:\n  local:\n    address: 127.0.0.1\n    local: true\n")
    directory = tmp_path / "run"
    result = run("init-config", str(directory), "--roster", str(roster))
    assert result.returncode == 0, result.stderr
    password_file = directory / "ui.password"
    assert password_file.stat().st_mode & 0o777 == 0o600
    assert str(password_file) in result.stdout and "/ui/" in result.stdout
    password = password_file.read_text().strip()
    assert len(password) >= 32
    tokens = {(directory / n).read_text().strip() for n in ("webhook.token", "admin.token")}
    assert password not in tokens
    # Serve the written config as it is, on a free port instead of 9095.
    config = directory / "remediator.yaml"
    port = free_port()
    config.write_text(config.read_text().replace("127.0.0.1:9095", f"127.0.0.1:{port}"))
    log = (tmp_path / "serve.log").open("wb")
    proc = subprocess.Popen([REMEDIATOR, "serve", "--config", str(config)],
                            stdout=log, stderr=subprocess.STDOUT)  # fmt: skip

    def get(path: str, user: str | None = None, secret: str = "") -> int:
        headers: dict[str, str] = {}
        if user is not None:
            token = base64.b64encode(f"{user}:{secret}".encode()).decode()
            headers["Authorization"] = f"Basic {token}"
        request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", headers=headers)
        try:
            with urllib.request.urlopen(request, timeout=10) as answer:
                return int(answer.status)
        except urllib.error.HTTPError as refused:
            return refused.code

    def up() -> bool:
        assert proc.poll() is None, (tmp_path / "serve.log").read_text()
        try:
            return get("/healthz") == 200
        except OSError:
            return False

    try:
        wait_until(up, timeout=30, what="the init-config remediator")
        assert get("/ui/", "ui", password) == 200
        assert get("/ui/") == 401
        assert get("/ui/", "ui", "not-the-password") == 401
        assert get("/ui/", "ui", next(iter(tokens))) == 401
    finally:
        stop_process(proc, 15)
        log.close()


def test_runs_never_prints_a_control_character_from_an_alert(tmp_path: Path) -> None:
    """An alert name is the network's: `\\x1b[2J` would clear the operator's terminal,
    `\\x1b]0;…\\x07` retitle it."""
    from remediator.alerts import parse_notification
    from remediator.journal import Journal

    setup = write_setup(tmp_path, servers={"alpha": "http://127.0.0.1:9"})
    payload = json.loads((ALERTMANAGER_FIXTURES / "firing.json").read_text())
    payload["alerts"][0]["labels"]["alertname"] = "Evil\x1b[2J\x1b]0;owned\x07"
    raw = json.dumps(payload).encode()
    journal = Journal(f"sqlite:///{tmp_path / 'journal.db'}", replica_id="x")
    try:
        journal.admit(parse_notification(raw), raw)
    finally:
        journal.close()
    shown = run("runs", "--config", str(setup.config))
    assert shown.returncode == 0, shown.stderr
    assert "Evil\ufffd[2J\ufffd]0;owned\ufffd" in shown.stdout
    assert not any(c in shown.stdout for c in "\x1b\x07")
