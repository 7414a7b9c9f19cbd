"""The remediator end to end in one process: webhook → journal → engine → steps → verify.

The app is the real Flask app over a real SQLite journal; its steps' side effects land on local
HTTP servers (tests/remediator_lab.py) that stand in for model servers' health endpoints.
"""

from __future__ import annotations

import base64
import copy
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from flask.testing import FlaskClient

from remediator.config import load_config
from remediator.service import Services, build_services
from remediator.web import create_app
from tests.remediator_lab import ALERTMANAGER_FIXTURES, CountingServer, Setup, write_setup


def fixture(name: str) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((ALERTMANAGER_FIXTURES / f"{name}.json").read_text())
    return data


def firing(
    server: str = "alpha",
    *,
    host: str = "dioscuri",
    starts: str = "2026-11-30T04:00:00Z",
    alertname: str = "LlamaServerDown",
    fingerprint: str | None = None,
) -> dict[str, Any]:
    payload = copy.deepcopy(fixture("firing"))
    alert = payload["alerts"][0]
    alert["labels"].update({"alertname": alertname, "host": host, "server": server})
    alert["startsAt"] = starts
    alert["fingerprint"] = fingerprint or f"{host}{server}{alertname}"[:16].ljust(16, "0")
    return payload


@dataclass
class Lab:
    client: FlaskClient
    services: Services
    setup: Setup
    alpha: CountingServer
    beta: CountingServer

    def post(self, payload: dict[str, Any] | bytes, token: str | None = None) -> Any:
        body = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
        headers = {"Authorization": f"Bearer {token or self.setup.webhook_token}"}
        return self.client.post("/webhook/alertmanager", data=body, headers=headers,
                                content_type="application/json")  # fmt: skip

    def admin(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        headers = {"Authorization": f"Bearer {self.setup.admin_token}"}
        return self.client.open(path, method=method, json=body, headers=headers)

    def process(self) -> None:
        assert self.services.engine is not None
        self.services.engine.process_all()

    def runs(self) -> list[dict[str, Any]]:
        answer = self.admin("GET", "/api/runs?limit=100")
        assert answer.status_code == 200
        runs: list[dict[str, Any]] = answer.get_json()["runs"]
        return runs


def make_lab(tmp_path: Path, **options: Any) -> Iterator[Lab]:
    alpha, beta = CountingServer(), CountingServer()
    setup = write_setup(tmp_path, servers={"alpha": alpha.url, "beta": beta.url}, **options)
    config = load_config(setup.config)
    services = build_services(config)
    app = create_app(config, services)
    try:
        yield Lab(app.test_client(), services, setup, alpha, beta)
    finally:
        services.close()
        alpha.close()
        beta.close()


@pytest.fixture
def lab(tmp_path: Path) -> Iterator[Lab]:
    yield from make_lab(tmp_path)


def test_a_firing_alert_runs_its_playbook_and_heals(lab: Lab) -> None:
    answer = lab.post(fixture("firing"))
    assert answer.status_code == 200
    assert answer.get_json()["status"] == "ok"
    lab.process()
    assert lab.alpha.count("/health") == 1 and lab.alpha.count("/verify") == 1
    [run] = lab.runs()
    assert run["playbook"] == "probe-llama"
    assert run["target"] == "server/dioscuri/alpha"
    assert run["outcome"] == "healed"
    assert run["alert"]["fingerprint"] == "5f2a9c0e1b3d4a67"
    assert run["alert"]["labels"]["server"] == "alpha"
    assert [s["action"] for s in run["steps"]] == ["http_probe", "wait"]
    assert all(s["result"] == "ok" for s in run["steps"])
    assert "probe http_probe: ok" in run["verification"]


def test_repeats_and_ha_duplicates_run_nothing_again(lab: Lab) -> None:
    assert lab.post(fixture("firing")).status_code == 200
    lab.process()
    for name in ("repeat-interval", "ha-duplicate"):
        assert lab.post(fixture(name)).status_code == 200
    lab.process()
    assert lab.alpha.count("/health") == 1
    assert len(lab.runs()) == 1


def test_resolved_closes_without_running(lab: Lab) -> None:
    lab.post(fixture("firing"))
    lab.process()
    assert lab.post(fixture("resolved")).status_code == 200
    lab.process()
    assert lab.alpha.count("/health") == 1
    [run] = lab.runs()
    assert run["alert"]["status"] == "resolved"


def test_grouped_alerts_and_an_unknown_server(lab: Lab) -> None:
    assert lab.post(fixture("grouped")).status_code == 200
    lab.process()
    assert len(lab.runs()) == 3
    by_target = {r["alert"]["labels"]["server"]: r for r in lab.runs()}
    assert by_target["alpha"]["outcome"] == "healed"
    assert by_target["beta"]["outcome"] == "healed"
    # theia has no server `delta` in the roster: nothing runs, the run says why.
    assert by_target["delta"]["decision"] == "rejected"
    assert "delta" in by_target["delta"]["reason"]
    assert lab.beta.count("/health") == 1


def test_unknown_host_and_notify_only(lab: Lab) -> None:
    lab.post(firing(host="nowhere", fingerprint="f" * 16))
    lab.post(firing(alertname="SomethingElse", fingerprint="e" * 16))
    lab.process()
    decisions = {r["alert"]["labels"]["alertname"] + "/" + r["alert"]["labels"]["host"]:
                 r["decision"] for r in lab.runs()}  # fmt: skip
    assert decisions == {
        "LlamaServerDown/nowhere": "rejected",
        "SomethingElse/dioscuri": "notify_only",
    }
    assert lab.alpha.count("/health") == 0


def test_cooldown(lab: Lab) -> None:
    lab.post(firing(starts="2026-11-30T04:00:00Z", fingerprint="a" * 16))
    lab.process()
    lab.post(firing(starts="2026-11-30T04:05:00Z", fingerprint="a" * 16))
    lab.process()
    runs = lab.runs()
    assert [r["decision"] for r in runs] == ["cooldown", "run"]
    assert lab.alpha.count("/health") == 1


def test_breaker_opens_after_runs_that_do_not_heal_and_escalates(tmp_path: Path) -> None:
    for lab in make_lab(tmp_path, cooldown=0, max_failures=2):
        lab.alpha.verify_status = 500
        for minute in range(3):
            lab.post(firing(starts=f"2026-11-30T05:0{minute}:00Z", fingerprint="b" * 16))
            lab.process()
        runs = lab.runs()
        assert [r["outcome"] or r["decision"] for r in runs] == [
            "breaker_open",
            "not_healed",
            "not_healed",
        ]
        events = lab.admin("GET", "/api/events?kind=escalation").get_json()["events"]
        assert len(events) == 1 and "probe-llama" in events[0]["detail"]
        metrics = lab.client.get("/metrics").get_data(as_text=True)
        assert 'gpufleet_remediator_escalations_total{playbook="probe-llama"} 1.0' in metrics
        assert ('gpufleet_remediator_breaker_open{host="dioscuri",playbook="probe-llama",'
                'server="alpha"} 1.0') in metrics  # fmt: skip
        assert lab.alpha.count("/health") == 2


def test_dry_run_journals_what_would_run(tmp_path: Path) -> None:
    for lab in make_lab(tmp_path, dry_run=True):
        lab.post(fixture("firing"))
        lab.process()
        [run] = lab.runs()
        assert run["decision"] == "dry_run"
        assert [s["result"] for s in run["steps"]] == ["skipped", "skipped"]
        assert run["steps"][0]["params"]["url"] == f"{lab.alpha.url}/health"
        assert lab.alpha.count("/health") == 0


def test_pause_resume_and_maintenance(lab: Lab) -> None:
    assert lab.admin("POST", "/api/pause", {"reason": "deploy"}).status_code == 200
    lab.post(firing(fingerprint="c" * 16))
    lab.process()
    assert lab.runs()[0]["decision"] == "paused"
    lab.admin("POST", "/api/resume")
    assert (
        lab.admin("POST", "/api/maintenance/dioscuri", {"on": True, "reason": "swap"}).status_code
        == 200
    )
    lab.post(firing(server="beta", fingerprint="d" * 16))
    lab.process()
    assert lab.runs()[0]["decision"] == "maintenance"
    assert lab.admin("POST", "/api/maintenance/nowhere", {"on": True}).status_code == 404
    assert lab.admin("POST", "/api/maintenance/dioscuri", {"on": "yes"}).status_code == 400
    lab.admin("POST", "/api/maintenance/dioscuri", {"on": False})
    lab.post(firing(server="beta", starts="2026-11-30T06:00:00Z", fingerprint="d" * 16))
    lab.process()
    assert lab.runs()[0]["outcome"] == "healed"
    assert lab.alpha.count("/health") == 0 and lab.beta.count("/health") == 1


def test_webhook_and_admin_secrets_are_kept_apart(lab: Lab) -> None:
    body = fixture("firing")
    assert lab.post(body, token="admin-secret-456").status_code == 401
    assert lab.post(body, token="wrong").status_code == 401
    answer = lab.client.post("/webhook/alertmanager", json=body)
    assert answer.status_code == 401 and "WWW-Authenticate" in answer.headers
    webhook_on_api = lab.client.get(
        "/api/runs", headers={"Authorization": "Bearer webhook-secret-123"}
    )
    assert webhook_on_api.status_code == 401
    assert lab.client.post("/api/pause").status_code == 401
    assert lab.admin("GET", "/api/runs").status_code == 200
    basic = base64.b64encode(b"x:webhook-secret-123").decode()
    as_basic = {"Authorization": f"Basic {basic}"}
    assert lab.client.post("/webhook/alertmanager", json=body, headers=as_basic).status_code == 401
    assert lab.runs() == []  # nothing of a refused request was journaled


@pytest.mark.parametrize(
    ("body", "status", "message"),
    [
        (b"{not json", 400, "not JSON"),
        (b"[]", 400, "must be a JSON object"),
        (json.dumps({**fixture("firing"), "version": "3"}).encode(), 400, "version"),
        (json.dumps({**fixture("firing"), "alerts": []}).encode(), 400, "alerts"),
        (
            json.dumps(fixture("firing")).replace("2026-11-30T03:12:45.123Z", "yesterday").encode(),
            400,
            "alerts[0].startsAt",
        ),
        (b"x" * (1024 * 1024 + 1), 413, "body over"),
        (b"", 400, "not JSON"),
    ],
)
def test_bad_bodies_get_4xx_and_run_nothing(
    lab: Lab, body: bytes, status: int, message: str
) -> None:
    answer = lab.post(body)
    assert answer.status_code == status
    assert message in answer.get_json()["error"]
    lab.process()
    assert lab.runs() == []
    metrics = lab.client.get("/metrics").get_data(as_text=True)
    assert f'gpufleet_remediator_webhook_requests_total{{code="{status}"}} 1.0' in metrics


def test_health_and_metrics(lab: Lab) -> None:
    assert lab.client.get("/healthz").status_code == 200
    lab.post(fixture("firing"))
    lab.process()
    text = lab.client.get("/metrics").get_data(as_text=True)
    assert 'gpufleet_remediator_runs_total{outcome="healed",playbook="probe-llama"} 1.0' in text
    assert "gpufleet_remediator_queue_depth 0.0" in text
    assert 'gpufleet_remediator_webhook_requests_total{code="200"} 1.0' in text
    assert "gpufleet_remediator_run_duration_seconds_count" in text
