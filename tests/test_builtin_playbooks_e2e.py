"""Built-in playbooks end to end, checked against real processes, ports and a sysfs tree.

All real parts but systemd and the GPU (as in tests/test_builtin_playbooks.py, whose
`test_down_is_restarted_and_healed_through_the_node` is the model): llama-servers managed by
the systemctl stand-in (systemd is not PID 1 here; the stand-in really starts and stops the
process), the real exporter (in-process, `build_registry`) scraped by a real Prometheus, the
remediator's Flask app and engine with its real journal, and `gpu-fleet-node` run by the local
executor (roster `local: true`).

- Port ghost: a stale llama-server of the unit's own program holds the port while the unit is
  failed; the built-in `port-ghost` takes evidence, kills the ghost, restarts the unit, heals.
  An unrelated program (a Python listener) on the port is refused and left alone.
- Runaway generation: a request with a huge `n_predict` keeps the only slot busy (context
  shift on, so it never ends); a copy of the built-in `llama-server-runaway` with a 3 s drain
  instead of 30 s (the only change) drains, restarts (which cuts the request) and heals.
- Thermal on AMD: a writable amdgpu fixture tree (tests/sysfs_tree.py) read by the exporter and
  written by the node (`--sysfs`); a copy of the built-in `gpu-temperature-critical` with a
  10 s restore window and a 1 s verification interval (instead of 900 s and 15 s) lowers
  `power1_cap` one step, the engine's heartbeat puts it back once the temperature stayed
  normal; a second card already at the roster's minimum escalates without a write.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shlex
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import yaml
from flask.testing import FlaskClient

import remediator.playbooks
from exporter.http import MetricsServer
from exporter.registry import ExporterSettings, build_registry
from fleet.roster import Host, load_roster
from remediator.actions.power import RESTORED, SCHEDULED, pending_restores
from remediator.config import load_config
from remediator.service import Services, build_services
from remediator.web import create_app
from tests.llama_lab import die_with_parent, free_port, start_generation, wait_until
from tests.prometheus_lab import PrometheusServer
from tests.remediator_lab import Setup, drop_test_playbooks, write_setup
from tests.sysfs_tree import (
    PowerCapSpec,
    TempSpec,
    WrittenCard,
    fleet_specs,
    set_value,
    write_amd_card,
)
from tests.systemctl_stand_in import SystemctlStandIn
from tests.systemctl_stand_in import _running as alive  # a zombie has exited
from tests.test_builtin_playbooks import UNIT, _healthy
from tests.test_host_actions import NODE, _busy, server_roster
from tests.test_remediator import fixture

HOST = "dioscuri"
BUILTIN = Path(remediator.playbooks.__file__).resolve().parent / "builtin"


# --- helpers ---------------------------------------------------------------------------------


def llama_argv(binary: Path, model: Path, port: int, *extra: str) -> list[str]:
    """The unit's ExecStart=: a small llama-server on 127.0.0.1:`port`."""
    return [str(binary), "-m", str(model), "--host", "127.0.0.1", "--port", str(port),
            "-c", "256", "-np", "1", "-t", "1", "--metrics", *extra]  # fmt: skip


def alert_payload(labels: dict[str, str]) -> dict[str, Any]:
    """Alertmanager's webhook body (the recorded fixture) for one firing alert with `labels`."""
    payload = fixture("firing")
    alert = payload["alerts"][0]
    alert["labels"] = dict(labels)
    alert["annotations"] = {"summary": f"{labels['alertname']} on {labels['host']}"}
    alert["fingerprint"] = hashlib.sha256(repr(sorted(labels.items())).encode()).hexdigest()[:16]
    payload["groupLabels"] = {"alertname": labels["alertname"]}
    payload["commonLabels"] = dict(labels)
    return payload


def post_alert(client: FlaskClient, setup: Setup, labels: dict[str, str]) -> None:
    answer = client.post(
        "/webhook/alertmanager", json=alert_payload(labels),
        headers={"Authorization": f"Bearer {setup.webhook_token}"},
    )  # fmt: skip
    assert answer.status_code == 200, answer.get_data(as_text=True)


def all_runs(client: FlaskClient, setup: Setup) -> list[dict[str, Any]]:
    answer = client.get("/api/runs", headers={"Authorization": f"Bearer {setup.admin_token}"})
    runs: list[dict[str, Any]] = answer.get_json()["runs"]
    return runs


def handle_alert(setup: Setup, labels: dict[str, str]) -> dict[str, Any]:
    """Post the alert to the webhook, let the engine handle it; the one run it made."""
    config = load_config(setup.config)
    services = build_services(config)
    client = create_app(config, services).test_client()
    try:
        post_alert(client, setup, labels)
        assert services.engine is not None
        services.engine.process_all()
        runs = all_runs(client, setup)
    finally:
        services.close()
    [run] = runs
    return run


def steps_of(run: dict[str, Any]) -> list[tuple[str, str]]:
    return [(step["action"], step["result"]) for step in run["steps"]]


def builtin_copy(builtin: str, name: str, change: Callable[[dict[str, Any]], None]) -> str:
    """A built-in playbook's YAML under another name, changed by `change` (shorter times)."""
    data: dict[str, Any] = yaml.safe_load((BUILTIN / f"{builtin}.yaml").read_text())
    data["name"] = name
    change(data)
    return yaml.safe_dump(data, sort_keys=False)


def server_setup(tmp_path: Path, url: str, prometheus_url: str = "http://127.0.0.1:9") -> Setup:
    """The remediator's set-up for server alpha on the local host dioscuri, built-ins only."""
    setup = write_setup(
        tmp_path, servers={"alpha": url}, prometheus_url=prometheus_url,
        extra=f"node_command: [{NODE}]\n",
    )  # fmt: skip
    drop_test_playbooks(setup)  # the built-ins must handle the alerts
    server_roster(tmp_path, url)  # the same fleet.yaml, with dioscuri `local: true`
    return setup


@contextlib.contextmanager
def scraped(tmp_path: Path, host: Host, sysfs: Path) -> Iterator[PrometheusServer]:
    """The real exporter for `host` (in-process) and a real Prometheus scraping it."""
    registry, fleet = build_registry(ExporterSettings(host=host, sysfs=str(sysfs)))
    exporter = MetricsServer(registry, "127.0.0.1", 0)
    exporter.start()
    try:
        with PrometheusServer(
            tmp_path / "prom", [f"127.0.0.1:{exporter.port}"], labels={"host": HOST}
        ) as prom:
            yield prom
    finally:
        exporter.stop()
        fleet.close()


@pytest.fixture
def stand_in(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[SystemctlStandIn]:
    """The systemctl stand-in on PATH (for the exporter and the node); its services stopped."""
    stand_in = SystemctlStandIn(tmp_path)
    stand_in.activate(monkeypatch)
    try:
        yield stand_in
    finally:
        stand_in.stop_all()


@contextlib.contextmanager
def process(argv: list[str], log: Path) -> Iterator[subprocess.Popen[bytes]]:
    """A process started by the test (a port ghost, a listener); killed and reaped at the end."""
    with log.open("wb") as output:
        child = subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, stdout=output, stderr=subprocess.STDOUT,
            preexec_fn=die_with_parent,  # noqa: PLW1509 - one system call, libc loaded before
        )  # fmt: skip
        try:
            yield child
        finally:
            if child.poll() is None:
                child.kill()
            child.wait(timeout=10)


# --- port ghost ------------------------------------------------------------------------------

PORT_GHOST = {"alertname": "PortGhost", "host": HOST, "server": "alpha",
              "severity": "critical", "category": "inference"}  # fmt: skip


def test_port_ghost_is_killed_and_the_unit_restarted_and_healed(
    tmp_path: Path, llama_binary: Path, tiny_model: Path, stand_in: SystemctlStandIn
) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    argv = llama_argv(llama_binary, tiny_model, port)
    stand_in.declare_service(UNIT, argv, stop_timeout_seconds=5)
    # The unit lost its server: systemd reports it failed, while a llama-server of the unit's
    # own program and command line (a leftover of an earlier run) still holds the port.
    stand_in.set_unit(UNIT, ActiveState="failed", SubState="failed", Result="exit-code")
    roster = server_roster(tmp_path, url)
    with process(argv, tmp_path / "ghost.log") as ghost:
        wait_until(lambda: _healthy(url), 60, interval=0.2, what="the ghost answers")
        with scraped(tmp_path, roster.hosts[HOST], tmp_path / "nosys") as prom:
            # What PortGhost fires on, as the exporter sees it.
            prom.wait_for(f'gpufleet_port_ghost{{server="alpha",port="{port}"}} == 1')
            setup = server_setup(tmp_path, url, prom.url)
            run = handle_alert(setup, {**PORT_GHOST, "port": str(port)})
        # The guard waited until the ghost had exited: it is reaped here, not waited for.
        assert ghost.poll() is not None, "the ghost still runs"
        assert not alive(ghost.pid)
    assert run["playbook"] == "port-ghost", run
    assert steps_of(run) == [("capture_evidence", "ok"), ("kill_port_ghost", "ok"),
                             ("restart_server", "ok"), ("wait_healthy", "ok")], run  # fmt: skip
    evidence, kill, restart = (step["output"] for step in run["steps"][:3])
    # The evidence names the ghost: its pid and its command line, as the port's owner.
    assert evidence.startswith("evidence of alpha captured"), evidence
    assert f'"pid": {ghost.pid}' in evidence
    assert f'"cmdline": "{shlex.join(argv)}"' in evidence
    assert f"stale process of {UNIT}'s program" in kill and f"pid {ghost.pid} " in kill
    assert "letting the unit start" in kill
    new = stand_in.main_pid(UNIT)
    assert new is not None and new != ghost.pid and alive(new)
    assert f"active/running pid {new}" in restart, restart
    assert run["outcome"] == "healed", run["verification"]
    assert "gpufleet_port_ghost" in run["verification"] and "held" in run["verification"]
    assert _healthy(url)
    assert Path(f"/proc/{new}/exe").resolve() == llama_binary.resolve()


LISTENER = """\
import socket, sys, time
server = socket.socket()
server.bind(("127.0.0.1", int(sys.argv[1])))
server.listen()
print("listening", flush=True)
time.sleep(600)
"""


def test_port_held_by_another_program_is_refused_and_left_alone(
    tmp_path: Path, llama_binary: Path, tiny_model: Path, stand_in: SystemctlStandIn
) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    stand_in.declare_service(UNIT, llama_argv(llama_binary, tiny_model, port))
    log = tmp_path / "listener.log"
    with process([sys.executable, "-c", LISTENER, str(port)], log) as listener:
        wait_until(lambda: "listening" in log.read_text(), 20, what="the listener")
        setup = server_setup(tmp_path, url)
        run = handle_alert(setup, {**PORT_GHOST, "port": str(port)})
        # Not a stale process of the unit's program: nothing was killed, nothing restarted.
        assert listener.poll() is None and alive(listener.pid)
    assert run["playbook"] == "port-ghost", run
    assert steps_of(run) == [
        ("capture_evidence", "ok"), ("kill_port_ghost", "failed"),
        ("restart_server", "skipped"), ("wait_healthy", "skipped"),
    ], run  # fmt: skip
    assert run["outcome"] == "failed"
    assert run["verification"] == "step 1 failed; verification skipped"
    evidence, kill = run["steps"][0]["output"], run["steps"][1]["output"]
    assert f'"pid": {listener.pid}' in evidence
    # Why, in the run's own words: who holds the port, and that the guard refused.
    assert kill.startswith("guard-port alpha on dioscuri failed: refusing to kill anything"), kill
    assert '"outcome":"refused"' in kill and '"stopped":[]' in kill
    assert f"port {port} is held by pid {listener.pid} " in kill
    assert f"it runs {os.path.realpath(sys.executable)}, not {llama_binary.resolve()}" in kill
    assert stand_in.main_pid(UNIT) is None
    assert not any(call.startswith(("restart", "start")) for call in stand_in.calls())


# --- runaway generation: drain, restart, the request is cut ----------------------------------


def test_runaway_generation_is_drained_cut_by_a_restart_and_healed(
    tmp_path: Path, llama_binary: Path, tiny_model: Path, stand_in: SystemctlStandIn
) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    # Context shift on: a request without a sane n_predict never ends by itself. This build
    # waits for a non-streamed request before it exits on SIGTERM: the stop ends in SIGKILL.
    argv = llama_argv(llama_binary, tiny_model, port, "--context-shift")
    stand_in.declare_service(UNIT, argv, stop_timeout_seconds=2)
    subprocess.run(["systemctl", "start", UNIT], check=True, timeout=30)
    wait_until(lambda: _healthy(url), 60, interval=0.2, what="llama-server healthy")
    old = stand_in.main_pid(UNIT)
    assert old is not None
    roster = server_roster(tmp_path, url)
    with scraped(tmp_path, roster.hosts[HOST], tmp_path / "nosys") as prom:
        prom.wait_for('gpufleet_llama_up{server="alpha"} == 1')
        setup = server_setup(tmp_path, url, prom.url)

        def short_drain(playbook: dict[str, Any]) -> None:
            [drain] = [step for step in playbook["steps"] if "drain" in step]
            assert drain["drain"] == {"max_wait_seconds": 30}
            drain["drain"]["max_wait_seconds"] = 3

        (setup.playbooks / "runaway.yaml").write_text(
            builtin_copy("llama-server-runaway", "llama-server-runaway-3s", short_drain)
        )
        runaway = start_generation(url, n_predict=2_000_000)
        wait_until(lambda: _busy(url), 20, interval=0.1, what="the runaway in the slot")
        run = handle_alert(
            setup,
            {"alertname": "LlamaServerRunawayGeneration", "host": HOST, "server": "alpha",
             "slot": "0", "severity": "warning", "category": "inference",
             "cause": "decoded_tokens"},
        )  # fmt: skip
    assert run["playbook"] == "llama-server-runaway-3s", run
    assert steps_of(run) == [("capture_evidence", "ok"), ("drain", "ok"),
                             ("restart_server", "ok"), ("wait_healthy", "ok")], run  # fmt: skip
    drain = run["steps"][1]["output"]
    assert "still 1 request(s) processing after" in drain and "going on: they are cut" in drain
    assert "LiteLLM" not in drain  # no proxy in the roster: nothing to take out of routing
    # The restart is what cut the request: its connection ended without an answer.
    assert runaway.wait(10), "the runaway request still runs"
    assert runaway.error is not None and runaway.result is None, (runaway.status, runaway.error)
    new = stand_in.main_pid(UNIT)
    assert new is not None and new != old and not alive(old)
    assert f"pid {old} → active/running pid {new}" in run["steps"][2]["output"]
    assert run["outcome"] == "healed", run["verification"]
    assert _healthy(url) and not _busy(url)


# --- thermal on AMD: one power-cap step, the restore, the floor ------------------------------

HOT = (
    TempSpec("edge", 80_000, crit=100_000, crit_hyst=-273_150, emergency=105_000),
    TempSpec("junction", 107_000, crit=110_000, crit_hyst=-273_150, emergency=115_000),
    TempSpec("mem", 70_000, crit=100_000, crit_hyst=-273_150, emergency=105_000),
)
CAP = PowerCapSpec(current=303_000_000, default=303_000_000, min=180_000_000, max=345_000_000)
THERMAL_ROSTER = f"""\
hosts:
  {HOST}:
    address: 127.0.0.1
    local: true
    gpus: {{amd: {{count: 2}}}}
    power_cap_watts: {{0: {{min: 250, max: 345}}, 1: {{min: 303, max: 345}}}}
"""


def power_cap(card: WrittenCard) -> int:
    return int(card.hwmon_file("power1_cap").read_text())


def test_gpu_temperature_lowers_the_amd_power_cap_and_the_heartbeat_restores_it(
    tmp_path: Path,
) -> None:
    sysfs = tmp_path / "sys"
    state_dir = tmp_path / "node-state"
    # GPU 0 may go down to 250 W; GPU 1 is at its roster minimum already (303 W).
    cards = [write_amd_card(sysfs, replace(spec, temps=HOT, power_cap=CAP))
             for spec in fleet_specs([0, 1])]  # fmt: skip
    setup = write_setup(
        tmp_path, servers={},
        extra=f"node_command: [{NODE}, --sysfs, {sysfs}, --state-dir, {state_dir}]\n"
              "power_cap: {check_interval_seconds: 1}\n",
    )  # fmt: skip
    drop_test_playbooks(setup)
    setup.roster.write_text(THERMAL_ROSTER)

    def fast(playbook: dict[str, Any]) -> None:
        [step] = [step for step in playbook["steps"] if "set_power_cap" in step]
        assert step["set_power_cap"]["restore_after_seconds"] == 900
        step["set_power_cap"]["restore_after_seconds"] = 10
        playbook["verify"]["interval_seconds"] = 1

    (setup.playbooks / "thermal.yaml").write_text(
        builtin_copy("gpu-temperature-critical", "gpu-temperature-critical-10s", fast)
    )
    roster = load_roster(setup.roster)
    with scraped(tmp_path, roster.hosts[HOST], sysfs) as prom:
        # What GpuTemperatureCritical fires on, for both cards.
        prom.wait_for(
            "gpufleet_gpu_temperature_celsius >= on (host, instance, gpu, sensor) "
            "(gpufleet_gpu_temperature_critical_celsius - 5)",
            count=2,
        )
        setup.config.write_text(
            setup.config.read_text().replace(
                "prometheus_url: http://127.0.0.1:9", f"prometheus_url: {prom.url}"
            )
        )
        config = load_config(setup.config)
        services = build_services(config)
        client = create_app(config, services).test_client()
        services.start()  # workers, and the heartbeat that restores power caps
        try:
            thermal(setup, services, client, cards, state_dir)
        finally:
            services.close()


def thermal(
    setup: Setup,
    services: Services,
    client: FlaskClient,
    cards: list[WrittenCard],
    state_dir: Path,
) -> None:
    hot = {"alertname": "GpuTemperatureCritical", "host": HOST, "severity": "critical",
           "category": "gpu", "sensor": "junction"}  # fmt: skip
    post_alert(client, setup, {**hot, "gpu": "0"})
    # The lower cap works: once it is written, the card cools (the exporter reads the tree).
    wait_until(lambda: power_cap(cards[0]) < CAP.current, 30, interval=0.1,
               what="GPU 0's power1_cap lowered")  # fmt: skip
    set_value(cards[0].hwmon_file("temp1_input"), 60_000)
    set_value(cards[0].hwmon_file("temp2_input"), 75_000)
    set_value(cards[0].hwmon_file("temp3_input"), 60_000)
    # One step of 10 %: 303 W → 272 W (272.7 rounded down), above the roster's 250 W; the
    # node recorded the 303 W it replaced (checked before the restore can be due, 10 s on).
    assert power_cap(cards[0]) == 272_000_000
    assert (state_dir / "power-cap-gpu0.json").exists()
    post_alert(client, setup, {**hot, "gpu": "1"})

    def done() -> bool:
        runs = all_runs(client, setup)
        return len(runs) == 2 and all(run["state"] == "done" for run in runs)

    wait_until(done, 60, interval=0.2, what="both runs done")
    by_target = {run["target"]: run for run in all_runs(client, setup)}
    first, floor = by_target[f"gpu/{HOST}/0"], by_target[f"gpu/{HOST}/1"]

    assert first["playbook"] == "gpu-temperature-critical-10s", first
    assert steps_of(first) == [("capture_evidence", "ok"), ("set_power_cap", "ok")], first
    capped = first["steps"][1]["output"]
    # The card's bus id, read from the exporter's gpufleet_gpu_info, went to the node with it.
    bus = cards[0].spec.pci_slot
    assert capped.startswith(f"power cap of gpu 0 ({bus}): 303 W → 272 W (floor 250 W); restore")
    assert f"gpu-fleet-node: power-cap 0 272 {bus}: done" in capped
    assert first["outcome"] == "healed", first["verification"]
    [schedule] = services.journal.events(kind=SCHEDULED)
    assert schedule.run_id == first["id"] and schedule.target == f"gpu/{HOST}/0"

    # At the floor: nothing written, and people are called (an event and a metric).
    assert steps_of(floor) == [("capture_evidence", "ok"), ("set_power_cap", "failed")], floor
    assert floor["steps"][1]["output"].startswith("at the floor: gpu 1 of dioscuri is at its")
    assert floor["outcome"] == "failed"
    assert power_cap(cards[1]) == CAP.current
    assert not (state_dir / "power-cap-gpu1.json").exists()
    [escalation] = services.journal.events(kind="escalation")
    assert escalation.run_id == floor["id"]
    assert "power-cap floor (303 W, floor 303 W) and still too hot" in escalation.detail
    metrics = client.get("/metrics").get_data(as_text=True)
    assert (
        'gpufleet_remediator_escalations_total{playbook="gpu-temperature-critical-10s"} 1.0'
        in metrics
    )

    # Normal for the whole 10 s window: the engine's heartbeat puts the old cap back.
    wait_until(lambda: power_cap(cards[0]) == CAP.current, 60, interval=0.2,
               what="GPU 0's power1_cap restored")  # fmt: skip
    wait_until(lambda: bool(services.journal.events(kind=RESTORED)), 10, what="journaled")
    assert pending_restores(services.journal) == []
    assert not (state_dir / "power-cap-gpu0.json").exists()
    assert power_cap(cards[1]) == CAP.current
