"""The built-in playbooks: each loads, matches its alert, and the down playbook heals for real.

The end-to-end run is all real parts but systemd: a llama-server managed by the systemctl
stand-in (systemd is not PID 1 here; the stand-in really starts and stops the process), the
real exporter (in-process, `build_registry`) scraped by a real Prometheus, the remediator's
Flask app and engine with its real journal, and `gpu-fleet-node` run by the local executor.
The server is killed; `LlamaServerDown` arrives; the built-in `llama-server-unhealthy` takes
evidence, drains, restarts the unit through the node, waits for health, and verifies.
"""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path
from typing import Any

import pytest

from exporter.http import MetricsServer
from exporter.registry import ExporterSettings, build_registry
from fleet.roster import load_roster
from remediator.actions.registry import get_action
from remediator.alerts import Alert
from remediator.config import load_config
from remediator.playbooks.budget import disruption_set
from remediator.playbooks.loader import Rejection, Target, load_playbooks
from remediator.playbooks.model import match_playbook, resolve_target
from remediator.service import build_services
from remediator.web import create_app
from tests.llama_lab import free_port, http_get, wait_until
from tests.prometheus_lab import PrometheusServer
from tests.remediator_lab import drop_test_playbooks, write_setup
from tests.ssh_lab import REPO
from tests.systemctl_stand_in import SystemctlStandIn
from tests.test_remediator import firing

UNIT = "llama-server@alpha.service"
ROSTER = load_roster(Path(__file__).resolve().parent.parent / "examples" / "fleet.yaml")

# Every alert the rules raise that a built-in handles: (alert, labels) → (playbook, target).
EXPECTED = [
    ("LlamaServerDown", "server", "llama-server-unhealthy"),
    ("LlamaServerStuck", "server", "llama-server-stuck"),
    ("PortGhost", "server", "port-ghost"),
    ("LlamaServerCrashLooping", "server", "llama-server-crash-looping"),
    ("LlamaServerRunawayGeneration", "server", "llama-server-runaway"),
    ("TokensPerSecondDegraded", "server", "tokens-per-second-degraded"),
    ("LlamaServerSaturated", "server", "llama-server-saturated"),
    ("GpuTemperatureCritical", "gpu", "gpu-temperature-critical"),
    ("GpuComputeModeDrift", "gpu", "gpu-compute-mode-drift"),
    ("GpuLost", "gpu", "gpu-lost"),
    ("GpuLost", "host", "gpu-lost-host"),
    ("ApuTemperatureCritical", "host", "apu-temperature-critical"),
    ("GpuFleetExporterDown", "host", "exporter-down"),
]


def alert(name: str, **labels: str) -> Alert:
    return Alert.model_validate(
        {"status": "firing", "labels": {"alertname": name, **labels}, "annotations": {},
         "startsAt": "2026-11-30T04:00:00Z", "fingerprint": "f00d"}
    )  # fmt: skip


def labels_for(kind: str) -> dict[str, str]:
    host, entry = next((n, h) for n, h in ROSTER.hosts.items() if h.servers)
    if kind == "server":
        return {"host": host, "server": next(iter(entry.servers))}
    if kind == "gpu":
        return {"host": host, "gpu": "0"}
    return {"host": host}


@pytest.mark.parametrize(("alertname", "kind", "playbook"), EXPECTED)
def test_each_alert_has_its_playbook_and_target(alertname: str, kind: str, playbook: str) -> None:
    playbooks = load_playbooks(None)
    found = match_playbook(playbooks, alert(alertname, **labels_for(kind)))
    assert found is not None and found.name == playbook
    assert found.target == kind
    target = resolve_target(found, alert(alertname, **labels_for(kind)), ROSTER)
    assert isinstance(target, Target), target
    # Cooldowns and breakers are set on purpose for each, never left to chance.
    assert found.policy.cooldown_seconds >= 300
    assert 1 <= found.policy.breaker.max_failures <= 4


def test_what_the_playbooks_do() -> None:
    by_name = {p.name: p for p in load_playbooks(None)}

    def actions(name: str) -> list[str]:
        return [s.action for s in by_name[name].steps]

    restart = ["capture_evidence", "drain", "restart_server", "wait_healthy"]
    assert actions("llama-server-unhealthy") == restart
    assert actions("llama-server-stuck") == restart
    assert actions("llama-server-runaway") == restart
    assert actions("port-ghost") == [
        "capture_evidence", "kill_port_ghost", "restart_server", "wait_healthy",
    ]  # fmt: skip
    # A crash loop, saturation, compute-mode drift, a lost GPU: evidence and people, no restart.
    for name in ("llama-server-crash-looping", "llama-server-saturated",
                 "gpu-compute-mode-drift", "gpu-lost", "gpu-lost-host"):  # fmt: skip
        assert actions(name) == ["capture_evidence", "escalate"], name
    assert actions("gpu-temperature-critical")[-1] == "set_power_cap"
    assert actions("apu-temperature-critical")[-1] == "set_power_cap"
    assert actions("tokens-per-second-degraded")[0] == "canary_benchmark"
    # Evidence comes before anything is killed or restarted (DESIGN.md, safety rails).
    for playbook in by_name.values():
        names = [s.action for s in playbook.steps]
        for acting in ("restart_server", "kill_port_ghost"):
            if acting in names:
                assert names.index("capture_evidence") < names.index(acting), playbook.name


def test_evidence_and_people_spend_no_budget_that_a_fix_needs() -> None:
    # A crash loop's playbook gathers evidence and calls people; the loop's fix (a port ghost
    # killed, the unit restarted) is another playbook on the same server. Were the first one
    # disruptive, its hour-long cooldown would hold the fix off for that hour.
    by_name = {p.name: p for p in load_playbooks(None)}
    labels = labels_for("server")
    for name in ("llama-server-crash-looping", "llama-server-saturated", "gpu-compute-mode-drift",
                 "gpu-lost", "gpu-lost-host"):  # fmt: skip
        playbook = by_name[name]
        target = resolve_target(playbook, alert("X", **labels, gpu="0"), ROSTER)
        assert isinstance(target, Target)
        assert disruption_set(playbook, target, ROSTER) == (), name
    ghost = by_name["port-ghost"]
    target = resolve_target(ghost, alert("PortGhost", **labels), ROSTER)
    assert isinstance(target, Target)
    assert disruption_set(ghost, target, ROSTER) == (target.key,)
    assert get_action("escalate").disruptive is False
    assert get_action("escalate").read_only is False  # it calls people: not under dry-run
    assert get_action("restart_server").disruptive is True
    # The ghost's playbook restarts after the kill although PortGhost resolves at once.
    assert get_action("kill_port_ghost").clears_alert is True
    assert get_action("restart_server").clears_alert is False


def test_the_port_ghost_playbook_verifies_with_the_servers_own_engine() -> None:
    """A vLLM server's run verified on `gpufleet_llama_up`, which a vLLM server never has."""
    ghost = {p.name: p for p in load_playbooks(None)}["port-ghost"]
    assert ghost.verify is not None and ghost.verify.promql is not None
    queries = {}
    for server in ("delta", "zeta"):  # llama and vLLM on one host of the example roster
        host = next(h for h, entry in ROSTER.hosts.items() if server in entry.servers)
        target = resolve_target(ghost, alert("PortGhost", host=host, server=server), ROSTER)
        assert isinstance(target, Target)
        queries[server] = target.fill(ghost.verify.promql)
    assert "gpufleet_llama_up{" in queries["delta"] and "vllm" not in queries["delta"]
    assert "gpufleet_vllm_up{" in queries["zeta"] and "llama" not in queries["zeta"]


def test_hostile_labels_never_reach_a_node_command() -> None:
    playbooks = load_playbooks(None)
    host = labels_for("server")["host"]
    for bad in ("alpha; rm -rf /", "$(reboot)", "{server.url}"):
        event = alert("LlamaServerDown", host=host, server=bad)
        found = match_playbook(playbooks, event)
        assert found is not None
        assert isinstance(resolve_target(found, event, ROSTER), Rejection)


def test_check_config_loads_every_builtin(tmp_path: Path) -> None:
    setup = write_setup(tmp_path, servers={"alpha": "http://127.0.0.1:31001"})
    done = subprocess.run(
        [str(REPO / ".venv" / "bin" / "gpu-fleet-remediator"), "check-config",
         "--config", str(setup.config)],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr


# --- down → restart → healed, for real -----------------------------------------------------


def _healthy(url: str) -> bool:
    try:
        return http_get(url, "/health", timeout=1).status == 200
    except OSError:
        return False


def test_down_is_restarted_and_healed_through_the_node(
    tmp_path: Path, llama_binary: Path, tiny_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    stand_in = SystemctlStandIn(tmp_path)
    stand_in.activate(monkeypatch)  # the node, a child of the engine, finds the stand-in
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    stand_in.declare_service(
        UNIT,
        [str(llama_binary), "-m", str(tiny_model), "--host", "127.0.0.1", "--port", str(port),
         "-c", "256", "-np", "1", "-t", "1", "--metrics"],
        stop_timeout_seconds=5,
    )  # fmt: skip
    setup = write_setup(
        tmp_path,
        servers={"alpha": url},
        extra=f"node_command: [{REPO / '.venv' / 'bin' / 'gpu-fleet-node'}]\n",
    )
    drop_test_playbooks(setup)  # the built-in must handle LlamaServerDown
    setup.roster.write_text(
        "hosts:\n  dioscuri:\n    address: 127.0.0.1\n    local: true\n    servers:\n"
        f"      alpha:\n        engine: llama\n        url: {url}\n        unit: {UNIT}\n"
        "        role: gpu-dense\n        model: tiny\n"
    )
    roster = load_roster(setup.roster)
    registry, fleet = build_registry(
        ExporterSettings(host=roster.hosts["dioscuri"], sysfs=str(tmp_path / "nosys"))
    )
    exporter = MetricsServer(registry, "127.0.0.1", 0)
    exporter.start()
    try:
        subprocess.run(["systemctl", "start", UNIT], check=True, timeout=30)
        wait_until(lambda: _healthy(url), 60, interval=0.2, what="llama-server healthy")
        with PrometheusServer(
            tmp_path / "prom", [f"127.0.0.1:{exporter.port}"], labels={"host": "dioscuri"}
        ) as prom:
            prom.wait_for('gpufleet_llama_up{server="alpha"} == 1', timeout=30)
            config_text = setup.config.read_text().replace(
                "prometheus_url: http://127.0.0.1:9", f"prometheus_url: {prom.url}"
            )
            setup.config.write_text(config_text)
            # The server dies (SIGKILL: no clean shutdown), as LlamaServerDown says.
            dead = stand_in.main_pid(UNIT)
            assert dead is not None
            os.kill(dead, signal.SIGKILL)
            wait_until(lambda: not _healthy(url), 10, what="the server is down")

            config = load_config(setup.config)
            services = build_services(config)
            client = create_app(config, services).test_client()
            try:
                answer = client.post(
                    "/webhook/alertmanager", json=firing(),
                    headers={"Authorization": f"Bearer {setup.webhook_token}"},
                )  # fmt: skip
                assert answer.status_code == 200
                assert services.engine is not None
                services.engine.process_all()
                runs: list[dict[str, Any]] = client.get(
                    "/api/runs", headers={"Authorization": f"Bearer {setup.admin_token}"}
                ).get_json()["runs"]
            finally:
                services.close()
        [run] = runs
        steps = [(s["action"], s["result"]) for s in run["steps"]]
        assert run["playbook"] == "llama-server-unhealthy", run
        assert steps == [("capture_evidence", "ok"), ("drain", "ok"),
                         ("restart_server", "ok"), ("wait_healthy", "ok")], run  # fmt: skip
        assert run["outcome"] == "healed", run["verification"]
        assert "evidence of alpha captured" in run["steps"][0]["output"]
        assert "1-token completion was answered" in run["steps"][3]["output"]
        new = stand_in.main_pid(UNIT)
        assert new is not None and new != dead
        assert _healthy(url)
    finally:
        exporter.stop()
        fleet.close()
        stand_in.stop_all()
