"""The lab's scenarios (tests/lab.py): from an injected fault to the report in Zulip.

Each asserts on outcomes — the run in the journal, the processes, Prometheus' `ALERTS`, the
report's text — never on wall-clock times. `make test` runs them (marker `lab`).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.lab import Lab

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
