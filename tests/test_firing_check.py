"""Whether an alert still fires, asked of a real Prometheus (remediator/firing.py).

Prometheus evaluates a real rule over a metric the test switches; the check must follow
`ALERTS` (with the alert's extra labels, as external labels add them, still matching), fall
back to the journal for an alert this Prometheus does not evaluate or when it is down, and the
engine must end a run whose alert Prometheus no longer fires as `resolved`, touching nothing —
but act on one this Prometheus holds `pending` while the journal holds it firing (the other
Prometheus of an HA pair fired first).
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from remediator.firing import FiringCheck
from tests.prometheus_lab import MetricsEndpoint, PrometheusServer
from tests.test_remediator import firing, make_lab

RULES = """\
groups:
  - name: lab
    rules:
      - alert: LlamaServerDown
        expr: lab_fault == 1
        labels: {severity: critical, category: inference}
      # The same condition behind a `for:` that never ends in a test: pending throughout, as
      # in the Prometheus of an HA pair that evaluates after the one that fired.
      - alert: LlamaServerStuck
        expr: lab_fault == 1
        for: 1h
        labels: {severity: critical, category: inference}
"""
LABELS = {"alertname": "LlamaServerDown", "host": "dioscuri", "server": "alpha",
          "severity": "critical", "category": "inference"}  # fmt: skip
FAULT = 'lab_fault{host="dioscuri",server="alpha"} %d\n'


@pytest.fixture
def lab_prometheus(tmp_path: Path) -> Iterator[tuple[MetricsEndpoint, PrometheusServer]]:
    rules = tmp_path / "rules.yml"
    rules.write_text(RULES)
    with (
        MetricsEndpoint(FAULT % 1) as endpoint,
        PrometheusServer(tmp_path, [endpoint.target], rule_files=[rules]) as prometheus,
    ):
        prometheus.wait_for('ALERTS{alertname="LlamaServerDown",alertstate="firing"}')
        prometheus.wait_for('ALERTS{alertname="LlamaServerStuck",alertstate="pending"}')
        yield endpoint, prometheus


def test_the_check_follows_prometheus_and_falls_back_to_the_journal(
    lab_prometheus: tuple[MetricsEndpoint, PrometheusServer],
) -> None:
    endpoint, prometheus = lab_prometheus
    check = FiringCheck(prometheus.url)
    # The notification carries labels ALERTS lacks (an external label): still a match.
    sent = {**LABELS, "cluster": "lab", "job": "lab", "instance": endpoint.target}
    answer = check.check(sent, journal_firing=False)
    assert (answer.firing, answer.source) == (True, "prometheus")
    other = check.check({**sent, "server": "beta"}, journal_firing=True)
    assert (other.firing, other.source) == (False, "prometheus")  # not that server's alert
    endpoint.set(FAULT % 0)
    prometheus.wait_for('absent(ALERTS{alertname="LlamaServerDown"})')
    answer = check.check(sent, journal_firing=True)
    assert (answer.firing, answer.source) == (False, "prometheus")
    unknown = check.check({**sent, "alertname": "NotARuleHere"}, journal_firing=True)
    assert (unknown.firing, unknown.source) == (True, "journal")
    assert "evaluates no rule" in unknown.detail
    prometheus.stop()
    down = FiringCheck(prometheus.url).check(sent, journal_firing=True)
    assert (down.firing, down.source) == (True, "journal")
    assert "unreachable" in down.detail


def test_a_run_whose_alert_prometheus_no_longer_fires_touches_nothing(
    tmp_path: Path, lab_prometheus: tuple[MetricsEndpoint, PrometheusServer]
) -> None:
    endpoint, prometheus = lab_prometheus
    endpoint.set(FAULT % 0)
    prometheus.wait_for('absent(ALERTS{alertname="LlamaServerDown"})')
    # Alertmanager has not sent the resolution yet: the journal still says firing.
    (tmp_path / "remediator").mkdir()
    for lab in make_lab(tmp_path / "remediator", prometheus_url=prometheus.url):
        assert lab.post(firing(fingerprint="a" * 16)).status_code == 200
        lab.process()
        [run] = lab.runs()
        assert run["decision"] == "resolved" and "no longer firing in Prometheus" in run["reason"]
        assert lab.alpha.count("/health") == 0 and lab.alpha.count("/restart") == 0


def test_pending_here_counts_while_the_journal_holds_the_alert_firing(
    tmp_path: Path, lab_prometheus: tuple[MetricsEndpoint, PrometheusServer]
) -> None:
    """The HA pair's other Prometheus fired first; this one still counts the `for:` down.

    Read as resolved, the run ended touching nothing, and Alertmanager's repeats of the
    occurrence were duplicates: the fault was never healed (scenario 7 in the lab).
    """
    endpoint, prometheus = lab_prometheus
    check = FiringCheck(prometheus.url)
    sent = {**LABELS, "alertname": "LlamaServerStuck", "cluster": "lab", "job": "lab",
            "instance": endpoint.target}  # fmt: skip
    ahead = check.check(sent, journal_firing=True)
    assert (ahead.firing, ahead.source) == (True, "prometheus")
    assert "pending in Prometheus" in ahead.detail
    # Alertmanager resolved the occurrence: what is pending now is a new one, not this.
    after = check.check(sent, journal_firing=False)
    assert (after.firing, after.source) == (False, "prometheus")
    assert "only pending" in after.detail
    other = check.check({**sent, "server": "beta"}, journal_firing=True)
    assert (other.firing, other.source) == (False, "prometheus")  # not that server's alert

    (tmp_path / "remediator").mkdir()
    payload = firing(alertname="LlamaServerStuck", fingerprint="b" * 16)
    payload["alerts"][0]["labels"].update(sent)
    for lab in make_lab(tmp_path / "remediator", prometheus_url=prometheus.url):
        assert lab.post(payload).status_code == 200
        lab.process()
        [run] = lab.runs()
        assert run["decision"] != "resolved", run["reason"]
        assert run["outcome"] == "healed", run
        assert lab.alpha.count("/restart") == 1


class OnceWrongPrometheus:
    """STAND-IN for Prometheus' HTTP API (`/api/v1/rules?type=alert`, `/api/v1/query`, as
    the real one answers them: `{"status": "success", "data": …}`) whose first `ALERTS`
    query misses the alert — a scrape lost, a rule group evaluated late — and whose later
    ones find it firing. The real Prometheus cannot be made to give one wrong answer on cue."""

    def __init__(self, labels: dict[str, str]) -> None:
        self.queries = 0
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                if self.path.startswith("/api/v1/rules"):
                    rules = [{"type": "alerting", "name": labels["alertname"]}]
                    data: dict[str, Any] = {"groups": [{"name": "lab", "rules": rules}]}
                else:
                    outer.queries += 1
                    series = {"metric": {"__name__": "ALERTS", "alertstate": "firing", **labels},
                              "value": [0, "1"]}  # fmt: skip
                    found = [] if outer.queries == 1 else [series]
                    data = {"resultType": "vector", "result": found}
                body = json.dumps({"status": "success", "data": data}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: object) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        threading.Thread(target=self._server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


def test_one_not_firing_read_is_asked_again_before_it_ends_a_run(tmp_path: Path) -> None:
    """Before, a single negative answer ended the occurrence's only run as `resolved`, and
    every later repeat from Alertmanager was a duplicate: the fault was never remediated."""
    prometheus = OnceWrongPrometheus(LABELS)
    try:
        for lab in make_lab(tmp_path, prometheus_url=prometheus.url):
            assert lab.post(firing(fingerprint="c" * 16)).status_code == 200
            lab.process()
            [run] = lab.runs()
            assert run["outcome"] == "healed", run
            assert lab.alpha.count("/restart") == 1
            assert prometheus.queries >= 2  # the first "no" was asked again
    finally:
        prometheus.close()
