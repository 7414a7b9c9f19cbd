"""Property-based fuzzing of the webhook and admission: hostile bodies never break remediation.

Bodies come from `hypothesis` (fixed `max_examples`, derandomised: the same cases every run)
and go through the real app — `create_app`'s WSGI stack, `WebhookEndpoint`, `Journal.admit` on
a real SQLite journal — with the engine's workers and heartbeat running, as `serve` runs them.
Every answer must be 200 (admitted) or a 4xx; afterwards no loop is dead, `/healthz` is 200,
nothing acted outside the roster, and a good alert posted last is handled to its end.
"""

from __future__ import annotations

import copy
import json
import time
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.test_remediator import Lab, firing, fixture, make_lab

ALLOWED = {200, 400, 413}

_TIMES = st.one_of(
    st.sampled_from(
        [
            "0001-01-01T00:00:00Z",  # Alertmanager's zero time
            "0001-01-01T00:00:00+01:00",  # before the year 1 in UTC
            "9999-12-31T23:59:59-01:00",  # after the year 9999 in UTC
            "0000-00-00T00:00:00Z",
            "2026-13-01T00:00:00Z",
            "2026-11-30T25:00:00Z",
            "2026-11-30T03:12:45.123456789Z",
            "2026-11-30 03:12:45",
            "-2026-11-30T03:12:45Z",
            "",
        ]
    ),
    st.datetimes().map(lambda d: d.isoformat() + "Z"),
    st.text(max_size=40),
    st.integers(),
    st.none(),
)
# Label names and values as an attacker writes them: shell metacharacters, paths, NULs,
# placeholders, unicode, very long.
_HOSTILE = st.one_of(
    st.sampled_from(
        [
            "dioscuri",
            "alpha",
            "beta",
            "theia",
            "nowhere",
            "; rm -rf /",
            "$(id)",
            "`id`",
            "../../etc/passwd",
            "{server.url}",
            "{host}",
            "a\x00b",
            "\ud7ff",
            "🔥" * 50,
            "x" * 5000,
            "server/dioscuri/alpha",
            "0",
            "-1",
            "99999999999999999999",
        ]
    ),
    st.text(max_size=64),
)
_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4)
    ),
    max_leaves=20,
)


def _sometimes(draw: st.DrawFn, one_in: int = 4) -> bool:
    return draw(st.integers(0, one_in - 1)) == 0


@st.composite
def _alert(draw: st.DrawFn) -> dict[str, Any]:
    alert: dict[str, Any] = copy.deepcopy(fixture("firing")["alerts"][0])
    alert["fingerprint"] = draw(st.text("0123456789abcdef", min_size=16, max_size=16))
    if _sometimes(draw):
        alert["labels"] = draw(st.dictionaries(_HOSTILE, _HOSTILE, max_size=8))
        alert["labels"].setdefault(
            "alertname", draw(st.sampled_from(["LlamaServerDown", "LlamaServerStuck", "Other"]))
        )
    if _sometimes(draw, 2):
        alert["labels"].update(host=draw(_HOSTILE), server=draw(_HOSTILE), gpu=draw(_HOSTILE))
    if draw(st.integers(0, 20)) == 0:  # a huge label set
        alert["labels"].update({f"l{index}": "v" * 100 for index in range(500)})
    for key in ("startsAt", "endsAt"):
        if _sometimes(draw):
            alert[key] = draw(_TIMES)
    if _sometimes(draw, 8):
        alert["fingerprint"] = draw(st.one_of(st.text(max_size=80), _JSON))
    if _sometimes(draw, 8):
        alert["status"] = draw(st.sampled_from(["firing", "resolved", "FIRING", "", None]))
    if draw(st.integers(0, 10)) == 0:
        alert[draw(st.sampled_from(["labels", "annotations", "generatorURL"]))] = draw(_JSON)
    return alert


@st.composite
def _body(draw: st.DrawFn) -> bytes:
    kind = draw(st.integers(0, 15))
    if kind == 0:
        return draw(st.binary(max_size=200))
    if kind == 1:
        return json.dumps(draw(_JSON)).encode()
    if kind == 2:
        depth = draw(st.integers(50, 200_000))
        return (b"[" * depth) + (b"]" * depth if draw(st.booleans()) else b"")
    payload = copy.deepcopy(fixture("firing"))
    payload["alerts"] = draw(st.lists(_alert(), min_size=0 if _sometimes(draw, 10) else 1,
                                      max_size=5))  # fmt: skip
    if _sometimes(draw, 8):
        payload[draw(st.sampled_from(list(payload)))] = draw(_JSON)
    if _sometimes(draw, 8):
        payload["truncatedAlerts"] = draw(st.one_of(st.integers(), _JSON))
    text = json.dumps(payload, ensure_ascii=draw(st.booleans()))
    return text.encode("utf-8", errors="surrogatepass")


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
    @given(body=_body())
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
