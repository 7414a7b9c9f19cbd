"""llama-server's answers, parsed: recorded answers of the pinned build (tests/fixtures/llama)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from exporter.sources.http_client import Answer, Outcome
from exporter.sources.llama_api import (
    EndpointState,
    Health,
    ParseError,
    endpoint_state,
    health_state,
    parse_metrics,
    parse_props,
    parse_slots,
)

FIXTURES = Path(__file__).parent / "fixtures" / "llama"


def fixture(name: str) -> bytes:
    return (FIXTURES / name).read_bytes()


def test_busy_metrics_show_progress_only_in_decode_calls() -> None:
    values, missing = parse_metrics(fixture("metrics-busy.txt"))
    assert missing == []
    assert values["requests_processing"] == 2
    assert values["requests_deferred"] == 1
    assert values["decode_calls"] == 1630
    assert values["predicted_tokens"] == 0  # moves only when a request finishes
    assert values["prompt_tokens"] == 26


def test_a_renamed_series_is_reported_missing() -> None:
    text = fixture("metrics-idle.txt").replace(b"llamacpp:n_decode_total", b"llamacpp:n_decode2")
    values, missing = parse_metrics(text)
    assert missing == ["llamacpp:n_decode_total"]
    assert "decode_calls" not in values and "requests_processing" in values


def test_unparsable_metrics() -> None:
    with pytest.raises(ParseError):
        parse_metrics(b"llamacpp:x{ 1\n")


def test_props_context_is_per_slot() -> None:
    props = parse_props(fixture("props.json"))
    assert props.n_ctx_per_slot == 32768  # -c 65536 -np 2
    assert props.total_slots == 2
    assert props.alias == "tiny"
    # The pinned build from its source package: no git metadata, "b0-unknown" names no version.
    assert props.build == ""
    assert props.is_sleeping is False  # awake when captured
    assert props.router is False
    with pytest.raises(ParseError):
        parse_props(b"[1]")


def test_slots_busy_and_idle() -> None:
    busy = parse_slots(fixture("slots-busy.json"))
    assert [(s.id, s.busy, s.task_id, s.decoded) for s in busy] == [
        (0, True, 3, 1634),
        (1, True, 2, 1634),
    ]
    assert busy[0].predict_limit == 30000
    idle = parse_slots(fixture("slots-idle.json"))
    assert [(s.busy, s.task_id, s.decoded, s.predict_limit) for s in idle] == [
        (False, None, None, None)
    ] * 2


def test_uncapped_generation_has_an_infinite_limit() -> None:
    text = fixture("slots-busy.json").replace(b'"n_predict":30000', b'"n_predict":-1')
    assert all(s.predict_limit == math.inf for s in parse_slots(text))


@pytest.mark.parametrize(
    ("answer", "health", "endpoint"),
    [
        (Answer(Outcome.ANSWERED, 200, b"{}"), Health.OK, EndpointState.OK),
        (Answer(Outcome.ANSWERED, 503, b""), Health.LOADING, EndpointState.ERROR),
        (Answer(Outcome.ANSWERED, 501, b""), Health.ERROR, EndpointState.DISABLED),
        (Answer(Outcome.ANSWERED, 401, b""), Health.ERROR, EndpointState.ERROR),
        (Answer(Outcome.TIMEOUT), Health.TIMEOUT, EndpointState.BUSY),
        (Answer(Outcome.REFUSED), Health.UNREACHABLE, EndpointState.ERROR),
        (Answer(Outcome.ERROR), Health.ERROR, EndpointState.ERROR),
    ],
)
def test_what_answers_mean(answer: Answer, health: Health, endpoint: EndpointState) -> None:
    assert health_state(answer) is health
    assert endpoint_state(answer) is endpoint
