"""The Stuck and Runaway playbooks verify with evidence that fails while the fault persists.

`gpufleet_llama_up == 1` holds while a server is stuck (its /health answers) or a runaway
generation goes on, so a "healed" built on it would be a lie. A real Prometheus scrapes series
shaped as the exporter writes them (a stand-in endpoint: the fault is the data), and the
playbooks' own verification queries, filled for the target, must not hold while the fault
persists and must hold once it is gone.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from fleet.roster import load_roster
from remediator.playbooks.loader import load_playbooks
from remediator.playbooks.model import Playbook
from remediator.prometheus_api import promql_holds
from remediator.targets import Target
from tests.prometheus_lab import MetricsEndpoint, PrometheusServer
from tests.remediator_lab import write_setup

HEALTHY = 'gpufleet_llama_up{server="alpha"} 1\n'
STUCK = HEALTHY + (
    'gpufleet_llama_requests_processing{server="alpha"} 2\n'
    'gpufleet_llama_decode_calls_total{server="alpha"} 123456\n'  # flat: nothing moves
)
STUCK_GONE = HEALTHY + (
    'gpufleet_llama_requests_processing{server="alpha"} 0\n'
    'gpufleet_llama_decode_calls_total{server="alpha"} 123456\n'
)
RUNAWAY = HEALTHY + 'gpufleet_llama_slot_decoded_tokens{server="alpha",slot="0"} 9000\n'
RUNAWAY_GONE = HEALTHY + 'gpufleet_llama_slot_decoded_tokens{server="alpha",slot="0"} 120\n'
# Capped at -n 4096 (the unit's own): 3900 tokens is past 2048 and 80 % of the cap.
CAPPED_RUNAWAY = HEALTHY + (
    'gpufleet_llama_slot_decoded_tokens{server="alpha",slot="0"} 3900\n'
    'gpufleet_llama_slot_predict_limit{server="alpha",slot="0"} 4096\n'
)
CAPPED_GONE = HEALTHY + (
    'gpufleet_llama_slot_decoded_tokens{server="alpha",slot="0"} 300\n'
    'gpufleet_llama_slot_predict_limit{server="alpha",slot="0"} 4096\n'
)


@pytest.fixture
def target(tmp_path: Path) -> Target:
    setup = write_setup(tmp_path, servers={"alpha": "http://127.0.0.1:9"})
    host = load_roster(setup.roster).hosts["dioscuri"]
    return Target("server", "dioscuri", host, server="alpha", server_entry=host.servers["alpha"])


@pytest.fixture
def lab(tmp_path: Path) -> Iterator[tuple[MetricsEndpoint, PrometheusServer]]:
    with (
        MetricsEndpoint(HEALTHY) as endpoint,
        PrometheusServer(tmp_path, [endpoint.target], labels={"host": "dioscuri"}) as prometheus,
    ):
        yield endpoint, prometheus


def _playbook(name: str) -> Playbook:
    return next(p for p in load_playbooks(None) if p.name == name)


def _holds(prometheus: PrometheusServer, query: str, within: float) -> bool:
    return promql_holds(prometheus.url, query, within_seconds=within, interval_seconds=0.5).ok


@pytest.mark.parametrize(
    ("playbook", "fault", "gone"),
    [
        ("llama-server-stuck", STUCK, STUCK_GONE),
        ("llama-server-runaway", RUNAWAY, RUNAWAY_GONE),
        ("llama-server-runaway", CAPPED_RUNAWAY, CAPPED_GONE),
    ],
)
def test_the_verification_fails_while_the_fault_persists(
    lab: tuple[MetricsEndpoint, PrometheusServer],
    target: Target,
    playbook: str,
    fault: str,
    gone: str,
) -> None:
    endpoint, prometheus = lab
    verify = _playbook(playbook).verify
    assert verify is not None and verify.promql is not None
    query = target.fill(verify.promql)
    endpoint.set(fault)
    prometheus.wait_for('gpufleet_llama_up{server="alpha"}')
    # Long enough for `changes(…[1m])` to see several flat samples.
    prometheus.wait_for('count_over_time(gpufleet_llama_up{server="alpha"}[1m]) > 3')
    assert _holds(prometheus, 'gpufleet_llama_up{server="alpha"} == 1', 2)  # the old check lied
    assert not _holds(prometheus, query, 3), f"{query} held while the fault persists"
    endpoint.set(gone)
    assert _holds(prometheus, query, 10), f"{query} did not hold once the fault was gone"
    # Its probe asks for a completion, which a stuck server does not answer.
    assert verify.probe is not None and verify.probe.action == "wait_healthy"
