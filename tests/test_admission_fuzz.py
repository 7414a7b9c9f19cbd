"""Property-based fuzzing of the webhook and admission: hostile bodies never break remediation.

Bodies come from `hypothesis` (fixed `max_examples`, derandomised: the same cases every run;
the strategies live in `tests/reliability/strategies.py`, shared with the reliability suite)
and go through the real app — `create_app`'s WSGI stack, `WebhookEndpoint`, `Journal.admit` on
a real SQLite journal — with the engine's workers and heartbeat running, as `serve` runs them.
Every answer must be 200 (admitted) or a 4xx; afterwards no loop is dead, `/healthz` is 200,
nothing acted outside the roster, and a good alert posted last is handled to its end.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, given, settings

from tests.reliability.strategies import bodies
from tests.test_remediator import Lab, firing, make_lab

ALLOWED = {200, 400, 413}


def _wait_done(lab: Lab, fingerprint: str, timeout: float = 30.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for run in lab.runs():
            if run["alert"]["fingerprint"] == fingerprint and run["state"] == "done":
                return run
        time.sleep(0.05)
    raise AssertionError(f"the run of {fingerprint} did not finish within {timeout} s")


def test_hostile_bodies_never_break_admission(tmp_path: Path) -> None:
    for lab in make_lab(tmp_path):
        lab.services.start()  # the workers and the heartbeat run, as under `serve`
        _fuzz(lab)


def _fuzz(lab: Lab) -> None:
    """Post the generated bodies, then check what admission left behind."""
    seen: dict[int, int] = {}

    @settings(
        max_examples=300,
        derandomize=True,
        deadline=None,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    @given(body=bodies())
    def post(body: bytes) -> None:
        status = lab.post(body).status_code
        seen[status] = seen.get(status, 0) + 1
        assert status in ALLOWED, (status, body[:300])

    post()
    print(f"answers: {seen}")
    assert seen.get(400, 0) > 50 and seen.get(200, 0) > 10, seen  # both paths were taken
    assert lab.services.dead_loops() == []
    assert lab.client.get("/healthz").status_code == 200
    roster = lab.services.roster
    for run in lab.runs(limit=1000):
        if run["target"] is not None and run["decision"] == "run":
            kind, host, *rest = run["target"].split("/")
            assert host in roster.hosts and (kind != "server" or rest[0] in
                                             roster.hosts[host].servers)  # fmt: skip
    # A good alert afterwards is handled to its end.
    good = firing(server="beta", fingerprint="fuzz0000good0000", starts="2026-11-30T09:00:00Z")
    answer = lab.post(good)
    assert answer.status_code == 200 and len(answer.get_json()["runs"]) == 1
    assert _wait_done(lab, "fuzz0000good0000")["outcome"] == "healed"
