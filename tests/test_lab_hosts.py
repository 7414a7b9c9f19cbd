"""The lab's scenarios on its GPU hosts (tests/lab_hosts.py): NVIDIA, AMD dGPU, Strix-Halo APU.

The remediator reaches each host over SSH (a real sshd per host, the forced command
`gpu-fleet-node`, strict host keys). Each scenario asserts on outcomes — the runs in the
journal, the fixtures' state (the fake NVML's enforced limit, amdgpu's `power1_cap`),
Prometheus' `ALERTS`, the report's text — never on wall-clock times. Marker `lab`.
"""

from __future__ import annotations

import json
import urllib.parse
from pathlib import Path
from typing import Any

import psycopg
import pytest

from tests.lab import Lab, lab_playbooks
from tests.lab_hosts import NVIDIA_BUSES, LabHosts, NvidiaHost
from tests.pg import throwaway_database

pytestmark = pytest.mark.lab


def _runs_of(lab: Lab, playbook: str) -> list[dict[str, Any]]:
    return [r for r in lab.runs() if r["playbook"] == playbook]


def _run_for(lab: Lab, playbook: str) -> dict[str, Any] | None:
    """The run of `playbook` that acted (took steps), if any yet."""
    return next((r for r in _runs_of(lab, playbook) if r["steps"]), None)


def _done(lab: Lab, playbook: str) -> bool:
    runs = _runs_of(lab, playbook)
    return bool(runs) and all(r["state"] == "done" for r in runs)


def _events(lab: Lab, kind: str) -> list[dict[str, Any]]:
    answer = lab.admin("GET", "/api/events?" + urllib.parse.urlencode({"kind": kind}))
    events: list[dict[str, Any]] = answer["events"]
    return events


def test_hot_gpu_and_apu_are_capped_one_step_on_the_right_card_then_restored(
    tmp_path: Path, llama_binary: Path, tiny_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    hosts = LabHosts(tmp_path / "hosts")
    nvidia, amd, apu = hosts.nvidia, hosts.amd, hosts.apu
    playbooks = lab_playbooks("gpu-temperature-critical", "apu-temperature-critical")
    lab = Lab(tmp_path, llama_binary, tiny_model, monkeypatch, hosts=hosts, playbooks=playbooks)
    hot, calm = NVIDIA_BUSES[1], NVIDIA_BUSES[0]  # gpu 1 (NVML's device 0) and gpu 0
    with lab:
        assert lab.prometheus is not None
        # Every host's readings are in, each under its own `host` label.
        lab.prometheus.wait_for('gpufleet_gpu_power_limit_watts{kind="current"}', count=4)
        before = {
            "nvidia hot": nvidia.power_limit_watts(hot),
            "nvidia calm": nvidia.power_limit_watts(calm),
            "amd": amd.power_cap_watts(),
            "apu": apu.power_cap_watts(),
        }
        assert before == {"nvidia hot": 700, "nvidia calm": 700, "amd": 303, "apu": 120}
        lab.phase("heating nvhost's gpu 1 to 90 °C (critical 92) and apuhost's Tctl to 93 °C")
        nvidia.set_temperature(hot, 90)
        apu.set_tctl(93)
        lab.wait_firing("GpuTemperatureCritical")
        lab.wait_firing("ApuTemperatureCritical")
        fired = {(a["metric"]["host"], a["metric"].get("gpu")) for a in
                 lab.alerts("GpuTemperatureCritical")}  # fmt: skip
        assert fired == {("nvhost", "1")}, fired  # the hot card only

        # The cap comes down one step (10 %) on the hot card; the host then cools, as a
        # capped card does.
        # Both of its sensors are hot (core 90 °C, memory 94 °C: two alerts, one card).
        lab.wait(lambda: nvidia.power_limit_watts(hot) < 700, "nvhost gpu 1's cap lowered")
        lab.phase(f"nvhost gpu 1 capped at {nvidia.power_limit_watts(hot):g} W; cooling it")
        nvidia.set_temperature(hot, 50)
        lab.wait(lambda: apu.power_cap_watts() < 120, "apuhost's APU cap lowered")
        lab.phase(f"apuhost's APU capped at {apu.power_cap_watts():g} W; cooling it")
        apu.set_tctl(60)
        assert nvidia.power_limit_watts(hot) == 630
        assert apu.power_cap_watts() == 108
        # The other cards are untouched: the calm NVIDIA card, the AMD dGPU host's card.
        assert nvidia.power_limit_watts(calm) == 700
        assert amd.power_cap_watts() == 303

        for playbook in ("gpu-temperature-critical-lab", "apu-temperature-critical-lab"):
            lab.wait(lambda p=playbook: _done(lab, p), f"the {playbook} run to end")
        gpu_run = _run_for(lab, "gpu-temperature-critical-lab")
        apu_run = _run_for(lab, "apu-temperature-critical-lab")
        assert gpu_run is not None and apu_run is not None
        lab.phase(f"runs ended: gpu {gpu_run['outcome']}, apu {apu_run['outcome']}")
        assert gpu_run["target"] == "gpu/nvhost/1", gpu_run
        assert apu_run["target"] == "host/apuhost", apu_run
        for run in (gpu_run, apu_run):
            steps = [(s["action"], s["result"]) for s in run["steps"]]
            assert ("set_power_cap", "ok") in steps, steps
            assert run["outcome"] == "healed", run["verification"]
        cap_step = next(s for s in gpu_run["steps"] if s["action"] == "set_power_cap")
        assert f"power cap of gpu 1 ({hot}): 700 W → 630 W" in cap_step["output"]
        # One card, two sensors' alerts: one step down, not one per alert. The other sensor's
        # run waited for the card's lock and found its alert resolved: nothing done.
        others = [r for r in _runs_of(lab, "gpu-temperature-critical-lab")
                  if r["id"] != gpu_run["id"]]  # fmt: skip
        assert [(r["decision"], r["steps"]) for r in others] in ([], [("resolved", [])]), others

        lab.wait(lambda: not lab.alerts("GpuTemperatureCritical")
                 and not lab.alerts("ApuTemperatureCritical"), "the alerts to resolve")  # fmt: skip
        # After the (lab-length) window of normal temperature, the old caps come back.
        # (The journal's event follows the node's answer: wait for it, then look.)
        lab.wait(lambda: len(_events(lab, "power_cap_restored")) == 2, "the restores", timeout=90)
        lab.phase("both caps restored")
        restored = {e["target"] for e in _events(lab, "power_cap_restored")}
        assert restored == {"gpu/nvhost/1", "gpu/apuhost/0"}, restored
        assert nvidia.power_limit_watts(hot) == 700 and apu.power_cap_watts() == 120
        assert nvidia.power_limit_watts(calm) == 700 and amd.power_cap_watts() == 303
        scheduled = [json.loads(e["detail"]) for e in _events(lab, "power_cap_restore_scheduled")]
        assert sorted((d["host"], d["gpu"], d["pci_bus_id"]) for d in scheduled) == [
            ("apuhost", 0, "0000:c5:00.0"), ("nvhost", 1, hot),
        ]  # fmt: skip

        def healed_report(target: str) -> str | None:
            return next((r for r in lab.reports() if "✅ **Healed**" in r and target in r), None)

        for playbook, target in (
            ("gpu-temperature-critical-lab", "gpu/nvhost/1"),
            ("apu-temperature-critical-lab", "host/apuhost"),
        ):
            lab.wait(lambda t=target: healed_report(t) is not None,
                     f"the healed report of {target}")  # fmt: skip
            report = healed_report(target)
            assert report is not None and f"`{playbook}` on `{target}`" in report, report
        # The report shows which card was capped, and by how much.
        assert f"power cap of gpu 1 ({hot}): 700 W → 630 W" in (healed_report("gpu/nvhost/1") or "")
        assert "power cap of gpu 0 (0000:c5:00.0): 120 W → 108 W" in (
            healed_report("host/apuhost") or ""
        )
        # The restores are reported too: the run's report had promised them.
        for target in ("gpu/nvhost/1", "gpu/apuhost/0"):
            line = f"🔋 **Power cap restored** — `{target}`"
            lab.wait(lambda line=line: any(line in r for r in lab.reports()),
                     f"the restore's report of {target}")  # fmt: skip
        # One problem, one run, however often Alertmanager resent it.
        summary = [(r["id"], r["alert"]["labels"], r["decision"], r["outcome"], r["reason"])
                   for r in lab.runs()]  # fmt: skip
        assert len([r for r in lab.runs() if r["steps"]]) == 2, summary  # the two that acted
        assert {r["alert"]["labels"]["host"] for r in lab.runs()} == {"nvhost", "apuhost"}


def _deliveries(journal_url: str, alertname: str, host: str) -> list[tuple[str, str]]:
    """`(sending Alertmanager's externalURL, admitting replica)` of every notification the
    journal received with `alertname` on `host` firing, oldest first."""
    with psycopg.connect(journal_url) as db:
        rows = db.execute("SELECT raw, replica FROM notifications ORDER BY id").fetchall()
    found = []
    for raw, replica in rows:
        body = json.loads(raw)
        if any(a["status"] == "firing" and a["labels"].get("alertname") == alertname
               and a["labels"].get("host") == host for a in body.get("alerts", [])):  # fmt: skip
            found.append((str(body.get("externalURL", "")), str(replica)))
    return found


def test_ha_prometheus_alertmanager_and_remediator_pairs_deliver_twice_and_run_once(
    tmp_path: Path, llama_binary: Path, tiny_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    hosts = LabHosts(tmp_path / "hosts")
    nvidia = hosts.nvidia
    with throwaway_database() as journal:
        lab = Lab(tmp_path, llama_binary, tiny_model, monkeypatch, hosts=hosts, ha=True,
                  replicas=2, journal_url=journal,
                  playbooks=lab_playbooks("gpu-temperature-critical"))  # fmt: skip
        with lab:
            _ha_scenario(lab, nvidia, journal)


def _ha_scenario(lab: Lab, nvidia: NvidiaHost, journal: str) -> None:
    """Scenario 7 in a started HA lab: fault, copies, one run."""
    hot, calm = NVIDIA_BUSES[1], NVIDIA_BUSES[0]
    assert lab.prometheus is not None and lab.prometheus_b is not None
    servers = (lab.prometheus, lab.prometheus_b)
    lab.phase("the HA lab is up; heating nvhost's gpu 1 to 90 °C (its memory stays cool)")
    nvidia.set_temperature(hot, 90, memory=60)  # one sensor: one alert, one problem
    firing = 'ALERTS{alertname="GpuTemperatureCritical",alertstate="firing",host="nvhost"}'
    for prometheus in servers:  # both evaluate the problem, both send it to both managers
        prometheus.wait_for(firing, timeout=60)
    lab.phase("GpuTemperatureCritical fires in both Prometheus replicas")

    def managers_hold_one_alert() -> bool:
        held = [
            [a["labels"] for a in manager.alerts()
             if a["labels"].get("alertname") == "GpuTemperatureCritical"]
            for manager in lab.alertmanagers
        ]  # fmt: skip
        return all(len(labels) == 1 and "replica" not in labels[0] for labels in held)

    # Two copies (replica a and b) are one alert in each manager: the relabelling works.
    lab.wait(managers_hold_one_alert, "one alert, without `replica`, in both managers")
    lab.wait(lambda: nvidia.power_limit_watts(hot) < 700, "nvhost gpu 1's cap lowered")
    # Let the pair resend while the card is still hot: every copy must find the run made.
    lab.wait(lambda: len(_deliveries(journal, "GpuTemperatureCritical", "nvhost")) >= 3,
             "the alert delivered three times")  # fmt: skip
    nvidia.set_temperature(hot, 50)
    lab.phase("capped and cooling")
    lab.wait(lambda: _done(lab, "gpu-temperature-critical-lab"), "the run to end")
    lab.wait(lambda: not any(p.query(firing) for p in servers), "the alert to resolve")
    runs = [r for r in lab.runs() if r["alert"]["labels"]["alertname"] == "GpuTemperatureCritical"]
    deliveries = _deliveries(journal, "GpuTemperatureCritical", "nvhost")
    senders = {sender for sender, _ in deliveries}
    admitted = {replica for _, replica in deliveries}
    lab.phase(f"{len(deliveries)} deliveries from {len(senders)} Alertmanager(s) to "
              f"{len(admitted)} replica(s), {len(runs)} run(s)")  # fmt: skip
    assert len(deliveries) >= 3, deliveries
    assert admitted == {"lab-1", "lab-2"}, deliveries  # every manager sends to both
    assert len(runs) == 1, [(r["id"], r["decision"], r["alert"]["starts_at"]) for r in runs]
    run = runs[0]
    assert run["target"] == "gpu/nvhost/1" and run["outcome"] == "healed", run
    assert [s["action"] for s in run["steps"]].count("set_power_cap") == 1, run["steps"]
    assert nvidia.power_limit_watts(hot) == 630  # one step, not one per copy
    assert nvidia.power_limit_watts(calm) == 700
    lab.wait(lambda: any("✅ **Healed**" in r and "gpu/nvhost/1" in r for r in lab.reports()),
             "the healed report")  # fmt: skip
