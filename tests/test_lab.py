"""The lab's scenarios (tests/lab.py): from an injected fault to the report in Zulip.

Each asserts on outcomes — the run in the journal, the processes, Prometheus' `ALERTS`, the
report's text — never on wall-clock times. `make test` runs them (marker `lab`).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from tests.lab import CRASH_LOOPING_UNIT, RUNAWAY_ARGS, UNIT, Lab, Neighbour, lab_playbooks
from tests.llama_lab import get_json
from tests.llama_stand_in import LlamaStandIn

pytestmark = pytest.mark.lab


def test_a_frozen_server_is_restarted_healed_and_reported(
    tmp_path: Path, llama_binary: Path, tiny_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with Lab(tmp_path, llama_binary, tiny_model, monkeypatch) as lab:
        lab.phase("the lab is up; freezing alpha (SIGSTOP)")
        frozen = lab.freeze()
        # Its /health times out: the exporter says so, the rule fires, Alertmanager routes it.
        lab.wait_firing("LlamaServerDown")
        run = lab.wait_run_done()
        lab.phase(f"run {run['id']} ended: {run['outcome'] or run['decision']}")
        assert run["playbook"] == "llama-server-unhealthy", run
        assert run["alert"]["labels"]["server"] == "alpha"
        steps = [(s["action"], s["result"]) for s in run["steps"]]
        assert ("restart_server", "ok") in steps and ("wait_healthy", "ok") in steps, steps
        assert run["outcome"] == "healed", run["verification"]
        assert lab.server_pid() != frozen and lab.healthy()
        lab.wait(lambda: not lab.alerts("LlamaServerDown"), "the alert to resolve")
        lab.wait(lambda: any("✅ **Healed**" in r for r in lab.reports()), "the healed report")
        healed = next(r for r in lab.reports() if "✅ **Healed**" in r)
        assert "`llama-server-unhealthy` on `server/dioscuri/alpha`" in healed
        lab.wait(lambda: any("✅ **Resolved**" in r for r in lab.reports()), "the closing line")
        # One problem, one run, however often Alertmanager resent it meanwhile.
        assert len(lab.runs()) == 1


def test_an_alert_that_resolves_before_its_run_can_start_runs_nothing(
    tmp_path: Path, llama_binary: Path, tiny_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with Lab(tmp_path, llama_binary, tiny_model, monkeypatch) as lab:
        lab.admin("POST", "/api/pause", {"reason": "lab: hold the run back"})
        frozen = lab.freeze()
        lab.wait_firing("LlamaServerDown")
        lab.wait(lambda: bool(lab.runs()) and lab.runs()[0]["wait_reason"] == "paused",
                 "the run to wait for the pause")  # fmt: skip
        lab.thaw(frozen)  # the server answers again: the alert resolves
        lab.wait(lambda: not lab.alerts("LlamaServerDown") and not lab.alerts(
            "LlamaServerDown", "pending"), "the alert to resolve in Prometheus")  # fmt: skip
        lab.admin("POST", "/api/resume")
        run = lab.wait_run_done()
        assert run["decision"] == "resolved", run
        assert run["steps"] == []  # nothing ran, evidence included
        assert lab.server_pid() == frozen and lab.healthy()  # never restarted


def test_a_remediator_killed_after_its_drain_undoes_it_at_restart_and_reports(
    tmp_path: Path, llama_binary: Path, tiny_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tests.test_host_actions import LiteLlmStandIn, litellm_keys

    proxy = LiteLlmStandIn("sk-lab", ["deploy-alpha"])
    keys = litellm_keys(tmp_path, proxy, "sk-lab", "deploy-alpha")
    try:
        with Lab(tmp_path, llama_binary, tiny_model, monkeypatch, litellm=keys) as lab:
            lab.freeze()
            lab.wait_firing("LlamaServerDown")

            def drained() -> bool:
                runs = lab.runs()
                return bool(runs) and any(
                    s["action"] == "drain" and s["result"] == "ok" for s in runs[-1]["steps"]
                )

            lab.wait(drained, "the drain")
            lab.replica.kill()  # SIGKILL: no undo now
            assert proxy.blocked["deploy-alpha"] is True
            lab.replica.start()
            lab.wait(lambda: not proxy.blocked["deploy-alpha"], "the unblock after the restart")
            first = lab.runs()[-1]
            assert first["outcome"] == "interrupted", first
            lab.wait(lambda: any("⚠️ **Interrupted**" in r for r in lab.reports()),
                     "the interruption's report")  # fmt: skip
            unblocks = [call for call in proxy.calls if call[0] == "/model/unblock"]
            assert len(unblocks) == 1, proxy.calls  # done once
            lab.sleep(2)
            # Never re-run blindly: at most the one restart the killed run may have begun
            # (its node child can finish it). If the alert still fires, a new run is judged —
            # and waits for the cooldown the interrupted run left on the server.
            restarts = [s for r in lab.runs() for s in r["steps"]
                        if s["action"] == "restart_server" and s["result"] == "ok"]  # fmt: skip
            assert len(restarts) <= 1
            later = [r for r in lab.runs() if r["id"] != first["id"]]
            if lab.alerts("LlamaServerDown"):
                assert [(r["state"], r["wait_reason"]) for r in later] == [
                    ("pending", "cooldown")
                ], later
            else:
                assert all(r["decision"] in ("resolved", None) for r in later), later
    finally:
        proxy.close()


def test_a_ghost_holding_the_port_of_a_crash_looping_unit_is_killed_and_reported(
    tmp_path: Path, llama_binary: Path, tiny_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with Lab(tmp_path, llama_binary, tiny_model, monkeypatch, unit=CRASH_LOOPING_UNIT) as lab:
        # A stray llama-server (the unit's own binary, in no unit) takes the port while the
        # unit is down; the unit's server then cannot bind it and exits, again and again.
        subprocess.run(["systemctl", "stop", UNIT], check=True, timeout=30)
        ghost = lab.ghost()
        lab.phase(f"ghost pid {ghost.pid} holds alpha's port; starting the unit")
        subprocess.run(["systemctl", "start", UNIT], check=False, timeout=30)
        lab.wait(lambda: int(lab.unit_state().get("NRestarts") or 0) >= 1, "a crash loop")
        lab.wait_firing("PortGhost")

        def ghost_run() -> dict[str, Any] | None:
            done = [r for r in lab.runs() if r["playbook"] == "port-ghost" and r["state"] == "done"]
            return done[0] if done else None

        lab.wait(lambda: ghost_run() is not None, "the port-ghost run", timeout=120)
        run = ghost_run()
        assert run is not None
        lab.phase(f"run {run['id']} ended: {run['outcome'] or run['decision']}")
        assert run["alert"]["labels"]["server"] == "alpha"
        steps = {s["action"]: s for s in run["steps"]}
        assert [s["action"] for s in run["steps"]] == [
            "capture_evidence", "kill_port_ghost", "restart_server", "wait_healthy",
        ], run["steps"]  # fmt: skip
        for step in run["steps"]:
            assert step["result"] == "ok", step["output"]
        # The evidence names the ghost before it was killed: its pid, as a stale process.
        killed = steps["kill_port_ghost"]["output"]
        assert f"held by a stale process of {UNIT}'s program" in killed, killed
        assert f"pid {ghost.pid} (llama-server)" in killed, killed
        assert f"sent SIGTERM to pid {ghost.pid}" in killed, killed
        assert str(ghost.pid) in json.dumps(steps["capture_evidence"])
        assert run["outcome"] == "healed", run["verification"]
        assert ghost.wait(timeout=10) is not None  # gone
        state = lab.unit_state()
        assert state["ActiveState"] == "active" and lab.healthy(), state
        lab.wait(lambda: not lab.alerts("PortGhost"), "PortGhost to resolve")
        lab.wait(lambda: any("`port-ghost` on `server/dioscuri/alpha`" in r and "✅ **Healed**"
                             in r for r in lab.reports()), "the healed report")  # fmt: skip

        # The same ghost at start-up, with the port guard as the unit's ExecStartPre= (as
        # systemd/llama-server@.service has it): cleared before the server starts.
        subprocess.run(["systemctl", "stop", UNIT], check=True, timeout=30)
        lab.stand_in.set_unit(UNIT, _exec_start_pre=lab.guard_argv(), _env=lab.guard_env())
        second = lab.ghost()
        subprocess.run(["systemctl", "start", UNIT], check=True, timeout=60)
        assert second.wait(timeout=10) is not None
        assert lab.unit_state()["ActiveState"] == "active"
        lab.wait(lab.healthy, "alpha healthy behind the guard")
        journal = lab.stand_in.log_path(UNIT).read_text()
        assert f"held by a stale process of {UNIT}'s program" in journal
        assert f"pid {second.pid} " in journal


def test_a_trickling_and_a_sleeping_neighbour_alert_wake_and_restart_nothing(
    tmp_path: Path, llama_binary: Path, tiny_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # On alpha's host: a server whose inference-loop endpoints send a byte a second (/health
    # answers at once: it is not down), and a real llama-server that unloads its model when
    # idle. Each has its own port and unit. The trickle begins with the watch, so it lasts
    # less than LlamaServerStuck's `for:` (15 s in lab time): past that the trickler is stuck
    # by the rules' own definition (a /metrics that never answers is a hung loop) and a run
    # for it is right; what is under test here is what it does to its neighbours.
    trickling = LlamaStandIn("trickle", paths=frozenset())  # nothing trickles yet
    sleeper = Neighbour("sleeper", argv=(
        str(llama_binary), "-m", str(tiny_model), "--host", "127.0.0.1", "--port", "{port}",
        "-c", "256", "-np", "1", "-t", "1", "--metrics", "--sleep-idle-seconds", "1",
    ))  # fmt: skip
    trickler = Neighbour("trickler", url=trickling.url, main_pid=os.getpid())
    with trickling, Lab(tmp_path, llama_binary, tiny_model, monkeypatch,
                        neighbours=[sleeper, trickler]) as lab:  # fmt: skip
        url = lab.neighbour_urls["sleeper"]
        lab.wait(lambda: get_json(url, "/props")["is_sleeping"] is True, "the sleeper asleep")
        trickling.paths = frozenset({"/metrics", "/slots", "/props"})
        lab.phase("the sleeper sleeps, the trickler trickles; watching 8 scrapes")
        pids = {unit: lab.stand_in.main_pid(unit) for unit in (UNIT, sleeper.unit)}
        acted = len([c for c in lab.stand_in.calls() if not c.startswith("show")])
        lab.sleep(8)  # eight scrapes and evaluations, four times the shortest for: in lab time
        assert lab.prometheus is not None
        # The scrapes kept up: alpha and the sleeper were read on the latest one.
        assert lab.prometheus.query('gpufleet_llama_up{server=~"alpha|sleeper"} == 1')
        assert lab.prometheus.query('gpufleet_llama_sleeping{server="sleeper"} == 1')
        # No alert: on the neighbours, the host, or (yet) the trickler. Watchdog always fires;
        # the lab does not scrape the remediator, so its own alert says so.
        # The trickle was seen: the trickler's /metrics timed out (busy) on the latest scrape.
        assert lab.prometheus.query(
            'gpufleet_llama_endpoint{server="trickler",endpoint="metrics",state="busy"} == 1'
        )
        firing = lab.prometheus.query(
            'ALERTS{alertstate="firing",alertname!~"Watchdog|GpuFleetRemediatorDown"}'
        )
        assert firing == [], firing
        pending = lab.prometheus.query('ALERTS{alertstate="pending",server!="trickler"}')
        assert pending == [], pending  # the trickler's own LlamaServerStuck may be pending
        assert get_json(url, "/props")["is_sleeping"] is True  # never woken by a read
        assert {unit: lab.stand_in.main_pid(unit) for unit in pids} == pids
        assert len([c for c in lab.stand_in.calls() if not c.startswith("show")]) == acted
        restarts = [s for r in lab.runs() for s in r["steps"] if s["action"] == "restart_server"]
        assert restarts == [], lab.runs()


def test_a_runaway_generation_is_drained_restarted_and_reported(
    tmp_path: Path, llama_binary: Path, tiny_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A request without a cap that never meets an end-of-sequence (`Lab.runaway`), on a server
    # with room for it to pass the rule's threshold (8192 tokens, 1024 in the lab) and to be
    # still running when the run cuts it.
    playbooks = lab_playbooks("llama-server-runaway")
    with Lab(tmp_path, llama_binary, tiny_model, monkeypatch, llama_args=RUNAWAY_ARGS,
             playbooks=playbooks) as lab:  # fmt: skip
        before = lab.server_pid()
        runaway = lab.runaway()
        lab.phase("a runaway request (n_predict -1, no end-of-sequence) is generating")
        lab.wait_firing("LlamaServerRunawayGeneration", timeout=120)
        run = lab.wait_run_done()
        lab.phase(f"run {run['id']} ended: {run['outcome'] or run['decision']}")
        assert run["playbook"] == "llama-server-runaway-lab", run
        assert run["alert"]["labels"]["server"] == "alpha"
        assert run["alert"]["labels"]["cause"] == "decoded_tokens"
        assert [s["action"] for s in run["steps"]] == [
            "capture_evidence", "drain", "restart_server", "wait_healthy",
        ], run["steps"]  # fmt: skip
        for step in run["steps"]:
            assert step["result"] == "ok", step["output"]
        # The drain saw the runaway still in its slot, and went on: the restart cuts it.
        drain = next(s for s in run["steps"] if s["action"] == "drain")
        assert "still 1 request(s) processing" in drain["output"], drain["output"]
        assert run["outcome"] == "healed", run["verification"]
        runaway.join(timeout=30)
        assert runaway.cut is not None, runaway.answer  # never answered: cut by the restart
        assert lab.server_pid() != before and lab.healthy()
        lab.wait(lambda: not lab.alerts("LlamaServerRunawayGeneration"), "the alert to resolve")
        lab.wait(lambda: any("`llama-server-runaway-lab` on `server/dioscuri/alpha`" in r
                             and "✅ **Healed**" in r for r in lab.reports()),
                 "the healed report")  # fmt: skip
        assert len(lab.runs()) == 1


def test_a_flapping_server_opens_its_breaker_escalates_and_is_not_restarted_in_a_loop(
    tmp_path: Path, llama_binary: Path, tiny_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The fault comes back after every heal: each server alpha gets crashes (SIGKILL; its unit
    # has no Restart=) once it has answered for 6 s (long enough for LlamaServerDown to resolve
    # and the heal to be verified, so each crash is a new alert). Heals that do not stick count
    # as failures; llama-server-unhealthy's breaker opens at 3 (cooldown in lab time: 10 s).
    # A crash rather than a freeze: a frozen server's drain reads time out (20 s a run).
    playbooks = lab_playbooks("llama-server-unhealthy")
    with Lab(tmp_path, llama_binary, tiny_model, monkeypatch, playbooks=playbooks) as lab:
        done = threading.Event()
        killed: list[int] = []

        def flap() -> None:
            healthy_since: dict[int, float] = {}
            while not done.wait(0.2):
                pid = lab.stand_in.main_pid(UNIT)
                if not pid or pid in killed or not lab.healthy():
                    continue
                since = healthy_since.setdefault(pid, time.monotonic())
                if time.monotonic() - since >= 6:
                    os.kill(pid, signal.SIGKILL)
                    killed.append(pid)
                    lab.phase(f"flap: killed pid {pid}")

        thread = threading.Thread(target=flap, name="flapper", daemon=True)
        thread.start()
        try:
            lab.wait(lambda: any(r["decision"] == "breaker_open" for r in lab.runs()),
                     "the breaker to open", timeout=180)  # fmt: skip
            lab.phase("the breaker opened")
            lab.wait(lambda: any("🚨 **Escalation**" in r for r in lab.reports()),
                     "the escalation")  # fmt: skip
            lab.sleep(4)  # the alert fires on: no run may act on it any more
        finally:
            done.set()
            thread.join(timeout=10)
        runs = sorted(lab.runs(), key=lambda r: r["id"])
        acted = [r for r in runs if r["steps"]]
        assert [r["outcome"] for r in acted] == ["healed"] * 3, acted
        restarts = [s for r in runs for s in r["steps"] if s["action"] == "restart_server"]
        assert len(restarts) == 3, runs
        opened = next(r for r in runs if r["decision"] == "breaker_open")
        later = [r for r in runs if r["id"] >= opened["id"]]
        assert all(not r["steps"] and r["decision"] == "breaker_open" for r in later), later
        assert lab.alerts("LlamaServerDown")  # still down: left to the people now
        assert len(killed) == 4 and lab.unit_state()["ActiveState"] == "failed"
        assert not lab.healthy()
        escalation = next(r for r in lab.reports() if "🚨 **Escalation**" in r)
        assert "`llama-server-unhealthy-lab` on `server/dioscuri/alpha`" in escalation
        assert "3 disruptive runs on server/dioscuri/alpha did not heal" in escalation
