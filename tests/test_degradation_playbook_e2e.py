"""The built-in `tokens-per-second-degraded` playbook end to end, against a real llama-server.

The parts of tests/test_builtin_playbooks_e2e.py: a llama-server managed by the systemctl
stand-in, the remediator's Flask app and engine with its real journal, `gpu-fleet-node` run by
the local executor, and a real Prometheus. Prometheus scrapes a `MetricsEndpoint` serving the
recording rule's `server_model:gpufleet_tokens_per_second:baseline_7d` (7 days of history cannot
be made in a test), with the rule's labels host, server, role, model; the server's former model
has a baseline of its own, as it does for 7 days after a model swap, with the opposite verdict.

- False alarm: a baseline of 1 tok/s, which the tiny model exceeds many times over. The canary
  really generates (64 tokens counted by llama-server) and the run ends as a false alarm:
  nothing after the canary runs, the unit is not restarted.
- Confirmed: a baseline of 10^9 tok/s. The canary confirms the drop; evidence, drain, restart
  (a new process) and health run; the second canary cannot find the speed back, so the run is
  not healed, and the verification says why.

The built-in's waits are upper bounds (an idle server drains at once, `wait_healthy` returns
when healthy): the built-in itself runs, unchanged.
"""

from __future__ import annotations

import re
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.llama_lab import free_port, http_get, wait_until
from tests.prometheus_lab import MetricsEndpoint, PrometheusServer
from tests.systemctl_stand_in import SystemctlStandIn
from tests.systemctl_stand_in import _running as alive  # a zombie has exited
from tests.test_builtin_playbooks import UNIT, _healthy
from tests.test_builtin_playbooks_e2e import (
    BUILTIN,
    HOST,
    handle_alert,
    llama_argv,
    server_setup,
    stand_in,  # noqa: F401 - the fixture
    steps_of,
)

PLAYBOOK = "tokens-per-second-degraded"
BASELINE = "server_model:gpufleet_tokens_per_second:baseline_7d"
# server_roster (tests/test_host_actions.py) gives alpha role `r` and model `m`.
CURRENT = {"host": HOST, "server": "alpha", "role": "r", "model": "m"}
FORMER = {**CURRENT, "model": "former"}  # before a model swap: its baseline lives on 7 days
DEGRADED = {"alertname": "TokensPerSecondDegraded", "host": HOST, "server": "alpha",
            "role": "r", "model": "m", "severity": "critical", "category": "inference"}  # fmt: skip
MEASURED = r"([0-9]+\.[0-9]) tok/s against a baseline of ([0-9.]+) \(([0-9]+)%\)"


def baselines(current: float, former: float) -> str:
    """The exposition text of the two baselines (the recording rule's series, scraped)."""

    def line(labels: dict[str, str], value: float) -> str:
        inside = ",".join(f'{name}="{value}"' for name, value in labels.items())
        return f"{BASELINE}{{{inside}}} {value!r}\n"

    return f"# TYPE {BASELINE} gauge\n" + line(CURRENT, current) + line(FORMER, former)


@pytest.fixture(scope="module")
def baseline(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[MetricsEndpoint, PrometheusServer]]:
    """A real Prometheus scraping an endpoint the test sets (one per module: 5-6 s to start)."""
    with (
        MetricsEndpoint() as endpoint,
        PrometheusServer(tmp_path_factory.mktemp("prom"), [endpoint.target]) as prom,
    ):
        yield endpoint, prom


def serve_baselines(
    baseline: tuple[MetricsEndpoint, PrometheusServer], current: float, former: float
) -> str:
    """Serve the baselines, wait until Prometheus answers them; its URL."""
    endpoint, prom = baseline
    endpoint.set(baselines(current, former))
    query = f'{BASELINE}{{server="alpha",model="m"}} == {current!r}'

    def served() -> bool:
        return len(prom.query(query)) == 1 and len(prom.query(BASELINE)) == 2

    wait_until(served, 20, interval=0.2, what=f"Prometheus serves {query}")
    return prom.url


def tokens_predicted(url: str) -> float:
    """llama-server's own count of generated tokens (`--metrics`)."""
    text = http_get(url, "/metrics").text
    found = re.search(r"^llamacpp:tokens_predicted_total (\S+)$", text, re.MULTILINE)
    assert found is not None, "no llamacpp:tokens_predicted_total"
    return float(found.group(1))


def started(systemctl: SystemctlStandIn, binary: Path, model: Path) -> tuple[str, int]:
    """Alpha's unit declared and started, healthy; its URL and MainPID."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    systemctl.declare_service(UNIT, llama_argv(binary, model, port), stop_timeout_seconds=5)
    subprocess.run(["systemctl", "start", UNIT], check=True, timeout=30)
    wait_until(lambda: _healthy(url), 60, interval=0.2, what="llama-server healthy")
    pid = systemctl.main_pid(UNIT)
    assert pid is not None and alive(pid)
    return url, pid


def test_the_builtin_is_what_these_runs_exercise() -> None:
    playbook: dict[str, Any] = yaml.safe_load((BUILTIN / f"{PLAYBOOK}.yaml").read_text())
    assert playbook["match"] == {"alertname": "TokensPerSecondDegraded"}
    canary = {"n_predict": 64, "confirm_below_ratio": 0.7}
    evidence = {"promql": [
        'server:gpufleet_llama_spec_acceptance_ratio:rate5m{host="{host}",server="{server}"}',
        'server_model:gpufleet_tokens_per_second:ratio{host="{host}",server="{server}"}',
    ]}  # fmt: skip
    assert playbook["steps"] == [
        {"canary_benchmark": canary}, {"capture_evidence": evidence},
        {"drain": {"max_wait_seconds": 60}}, {"restart_server": {}},
        {"wait_healthy": {"within_seconds": 180}},
    ]  # fmt: skip
    assert playbook["verify"] == {"probe": {"canary_benchmark": {**canary, "mode": "verify"}}}


def test_false_alarm_measures_and_restarts_nothing(
    tmp_path: Path,
    llama_binary: Path,
    tiny_model: Path,
    stand_in: SystemctlStandIn,  # noqa: F811 - the fixture imported above
    baseline: tuple[MetricsEndpoint, PrometheusServer],
) -> None:
    # The former model was far faster: compared with its baseline, the drop would be confirmed.
    prom_url = serve_baselines(baseline, current=1.0, former=1e9)
    url, pid = started(stand_in, llama_binary, tiny_model)
    before = tokens_predicted(url)
    calls = stand_in.calls()

    run = handle_alert(server_setup(tmp_path, url, prom_url), DEGRADED)

    assert run["playbook"] == PLAYBOOK, run
    assert steps_of(run) == [
        ("canary_benchmark", "ok"), ("capture_evidence", "skipped"), ("drain", "skipped"),
        ("restart_server", "skipped"), ("wait_healthy", "skipped"),
    ], run  # fmt: skip
    canary = run["steps"][0]["output"]
    found = re.fullmatch(f"false alarm: {MEASURED}, above 70%; nothing is restarted", canary)
    assert found is not None, canary
    speed, against, percent = float(found.group(1)), found.group(2), int(found.group(3))
    # A real measurement, against the current model's baseline (not the former model's).
    # (The speed is shown rounded to 0.1 tok/s, the ratio from the unrounded speed.)
    assert against == "1.0" and speed > 1.0 and abs(percent - speed * 100) <= 6, canary
    # The canary really generated: llama-server counted its 64 tokens (ignore_eos).
    assert tokens_predicted(url) - before == 64
    assert run["outcome"] == "done_unverified", run
    measured = f"{speed:.1f} tok/s against a baseline of 1.0 ({percent}%)"
    assert run["verification"] == f"false alarm: the canary measured {measured}", run
    # Nothing restarted: the same process serves, and systemctl was asked nothing that acts.
    assert stand_in.main_pid(UNIT) == pid and alive(pid)
    assert stand_in.calls() == calls, stand_in.calls()
    assert _healthy(url)


def test_confirmed_drop_is_drained_and_restarted_but_not_healed(
    tmp_path: Path,
    llama_binary: Path,
    tiny_model: Path,
    stand_in: SystemctlStandIn,  # noqa: F811 - the fixture imported above
    baseline: tuple[MetricsEndpoint, PrometheusServer],
) -> None:
    # The former model was slow: compared with its baseline, this would be a false alarm.
    prom_url = serve_baselines(baseline, current=1e9, former=1.0)
    url, old = started(stand_in, llama_binary, tiny_model)

    run = handle_alert(server_setup(tmp_path, url, prom_url), DEGRADED)

    assert run["playbook"] == PLAYBOOK, run
    assert steps_of(run) == [
        ("canary_benchmark", "ok"), ("capture_evidence", "ok"), ("drain", "ok"),
        ("restart_server", "ok"), ("wait_healthy", "ok"),
    ], run  # fmt: skip
    canary, evidence, drain, restart, healthy = (step["output"] for step in run["steps"])
    found = re.fullmatch(f"degradation confirmed: {MEASURED}", canary)
    assert found is not None, canary
    assert found.group(2) == "1000000000.0" and float(found.group(1)) > 0, canary
    assert evidence.startswith("evidence of alpha captured"), evidence
    assert drain.startswith("drain: idle after"), drain  # an idle server: nothing to wait for
    new = stand_in.main_pid(UNIT)
    assert new is not None and new != old and alive(new) and not alive(old)
    assert f"pid {old} → active/running pid {new}" in restart, restart
    assert healthy.startswith("healthy after"), healthy
    assert any(call.startswith("restart") and UNIT in call for call in stand_in.calls())
    # The second canary ran on the new process (the 1-token health check, then its 64)...
    assert tokens_predicted(url) == 1 + 64
    # ...and could not find the speed back: not healed, and the verification says why.
    assert run["outcome"] == "not_healed", run
    verification = run["verification"]
    found = re.search(f"still degraded: {MEASURED}", verification)
    assert found is not None, verification
    assert found.group(2) == "1000000000.0" and found.group(3) == "0", verification
    assert _healthy(url)
