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
        frozen = lab.freeze()
        # Its /health times out: the exporter says so, the rule fires, Alertmanager routes it.
        lab.wait_firing("LlamaServerDown")
        run = lab.wait_run_done()
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
