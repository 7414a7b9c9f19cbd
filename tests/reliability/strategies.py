"""Hostile Alertmanager notifications as `hypothesis` strategies, shared by every webhook fuzz.

`tests/test_admission_fuzz.py` (the 300-case fuzz in every `pytest` run) and
`tests/reliability/test_hostile_webhooks.py` (the reliability suite's few thousand) draw from
here, so the two cannot drift apart. Bodies start from the recorded Alertmanager v4 fixture and
break it the ways an attacker or a broken sender would: malformed JSON, wrong types, extreme
and impossible times, huge label sets, deep nesting, unicode (lone surrogates included), labels
carrying shell metacharacters, paths, NULs and placeholders, hosts and servers the roster lacks.
"""

from __future__ import annotations

import copy
import json
from typing import Any

from hypothesis import strategies as st

from tests.remediator_lab import ALERTMANAGER_FIXTURES


def firing_fixture() -> dict[str, Any]:
    """A fresh copy of the recorded firing notification (one LlamaServerDown on dioscuri/alpha)."""
    data: dict[str, Any] = json.loads((ALERTMANAGER_FIXTURES / "firing.json").read_text())
    return data


TIMES = st.one_of(
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
"""`startsAt`/`endsAt` values: Alertmanager's zero time, out of UTC's range, impossible, junk."""

HOSTILE = st.one_of(
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
            "| nc 127.0.0.1 9 ;",
            "../../etc/passwd",
            "/etc/shadow",
            "{server.url}",
            "{host}",
            "a\x00b",
            "\x00",
            "\ud7ff",
            "\ud800",  # a lone surrogate: not encodable as UTF-8
            "🔥" * 50,
            "x" * 5000,
            "server/dioscuri/alpha",
            "dioscuri\n",
            " alpha",
            "0",
            "-1",
            "99999999999999999999",
        ]
    ),
    st.text(max_size=64),
)
"""Label names and values as an attacker writes them."""

JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4)
    ),
    max_leaves=20,
)
"""Any JSON value, nested: what lands where a field of another type was expected."""


def _sometimes(draw: st.DrawFn, one_in: int = 4) -> bool:
    return draw(st.integers(0, one_in - 1)) == 0


@st.composite
def alerts(draw: st.DrawFn) -> dict[str, Any]:
    """One alert of a notification, broken in zero or more places."""
    alert: dict[str, Any] = copy.deepcopy(firing_fixture()["alerts"][0])
    alert["fingerprint"] = draw(st.text("0123456789abcdef", min_size=16, max_size=16))
    if _sometimes(draw):
        alert["labels"] = draw(st.dictionaries(HOSTILE, HOSTILE, max_size=8))
        alert["labels"].setdefault(
            "alertname", draw(st.sampled_from(["LlamaServerDown", "LlamaServerStuck", "Other"]))
        )
    if _sometimes(draw, 2):
        alert["labels"].update(host=draw(HOSTILE), server=draw(HOSTILE), gpu=draw(HOSTILE))
    if draw(st.integers(0, 20)) == 0:  # a huge label set
        alert["labels"].update({f"l{index}": "v" * 100 for index in range(500)})
    for key in ("startsAt", "endsAt"):
        if _sometimes(draw):
            alert[key] = draw(TIMES)
    if _sometimes(draw, 8):
        alert["fingerprint"] = draw(st.one_of(st.text(max_size=80), JSON_VALUES))
    if _sometimes(draw, 8):
        alert["status"] = draw(st.sampled_from(["firing", "resolved", "FIRING", "", None]))
    if draw(st.integers(0, 10)) == 0:
        alert[draw(st.sampled_from(["labels", "annotations", "generatorURL"]))] = draw(JSON_VALUES)
    return alert


@st.composite
def bodies(draw: st.DrawFn) -> bytes:
    """A whole webhook body: bytes, any JSON, deep nesting, many copies of a few alerts in one
    body, or a notification broken inside."""
    kind = draw(st.integers(0, 15))
    if kind == 0:
        return draw(st.binary(max_size=200))
    if kind == 1:
        return json.dumps(draw(JSON_VALUES)).encode()
    if kind == 2:
        depth = draw(st.integers(50, 200_000))
        return (b"[" * depth) + (b"]" * depth if draw(st.booleans()) else b"")
    if kind == 3:  # deep nesting inside an otherwise good notification
        depth = draw(st.integers(50, 50_000))
        text = json.dumps(firing_fixture())
        return text.replace(
            '"annotations": {', '"annotations": {"x": ' + "[" * depth + "]" * depth + ", ", 1
        ).encode()
    if kind == 4:  # many alerts in one body, copies of each other, firing and resolved mixed
        payload = firing_fixture()
        template = payload["alerts"][0]
        payload["alerts"] = []
        for _ in range(draw(st.integers(2, 300))):
            alert = copy.deepcopy(template)
            alert["fingerprint"] = draw(st.sampled_from(["a" * 16, "b" * 16, "c" * 16]))
            alert["labels"]["server"] = draw(st.sampled_from(["alpha", "beta", "nowhere"]))
            alert["status"] = draw(st.sampled_from(["firing", "resolved"]))
            alert["startsAt"] = draw(
                st.sampled_from(
                    ["2026-11-30T03:12:45Z", "2026-11-30T03:12:50Z", "2026-11-30T04:12:45Z"]
                )
            )
            if alert["status"] == "resolved":
                alert["endsAt"] = draw(
                    st.sampled_from(["2026-11-30T03:20:00Z", "2026-11-30T03:00:00Z"])
                )
            payload["alerts"].append(alert)
        return json.dumps(payload).encode()
    payload = firing_fixture()
    payload["alerts"] = draw(
        st.lists(alerts(), min_size=0 if _sometimes(draw, 10) else 1, max_size=5)
    )
    if _sometimes(draw, 8):
        payload[draw(st.sampled_from(list(payload)))] = draw(JSON_VALUES)
    if _sometimes(draw, 8):
        payload["truncatedAlerts"] = draw(st.one_of(st.integers(), JSON_VALUES))
    text = json.dumps(payload, ensure_ascii=draw(st.booleans()))
    return text.encode("utf-8", errors="surrogatepass")
