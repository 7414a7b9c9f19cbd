"""Bounded bodies, parsed once: a huge or junk-filled `/metrics` costs its own endpoint only.

The servers are the real llama-server's recorded answers (tests/recorded_llama.py) with
`/metrics` replaced: 8 MB of junk series (a proxy's or plugin's, past llama.cpp's ~2 KB), or
junk the text parser cannot read around our own lines. Before, the 8 MB answer was parsed
whole, twice a scrape, in pure Python (13 to 18 s with a 2 s server timeout).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

from exporter.collectors import llama as llama_collector
from exporter.collectors.base import CollectorError
from exporter.collectors.llama import BODY_CAPS, LlamaCollector
from exporter.collectors.vllm import _metrics_read
from exporter.sources import llama_api
from exporter.sources.http_client import Answer, Outcome
from exporter.sources.llama_api import METRICS_MAX_LINES, ParseError, parse_metrics
from exporter.sources.scan import our_lines, plausible
from fleet.roster import Server
from tests.recorded_llama import FIXTURES, JSON, TEXT, RecordedLlama

VLLM = Path(__file__).parent / "fixtures" / "vllm" / "metrics-v1.txt"
IDLE = (FIXTURES / "metrics-idle.txt").read_bytes()
BUSY = (FIXTURES / "metrics-busy.txt").read_bytes()
# Junk as a proxy or plugin might add, and a line the text parser refuses.
JUNK_LINE = b'junk_series{a="%d",b="some label value"} 12345\n'
UNPARSABLE = b"this is { not the text format\n"


def junk(size: int) -> bytes:
    lines = [JUNK_LINE % i for i in range(size // len(JUNK_LINE % 0) + 1)]
    return b"".join(lines)


def test_only_our_lines_reach_the_parser(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[str] = []

    def counting(text: str) -> Iterable[Metric]:
        seen.append(text)
        return text_string_to_metric_families(text)

    monkeypatch.setattr(llama_api, "text_string_to_metric_families", counting)
    body = junk(8_000_000) + UNPARSABLE + BUSY + UNPARSABLE
    assert parse_metrics(body) == parse_metrics(BUSY)
    assert (
        len(seen[0].splitlines()) == len(our_lines(BUSY, "llamacpp:", max_lines=99).split("\n")) - 1
    )
    assert len(seen[0]) < 10_000


def test_too_many_lines_of_ours_are_over_budget() -> None:
    lines = b"".join(b"llamacpp:x_%d 1\n" % i for i in range(METRICS_MAX_LINES + 1))
    with pytest.raises(ParseError, match="over budget"):
        parse_metrics(lines + IDLE)


@pytest.mark.parametrize("value", [b"NaN", b"-1", b"+Inf", b"-Inf", b"1" + b"0" * 400])
def test_implausible_values_are_unknown_not_exported(value: bytes) -> None:
    body = IDLE.replace(b"llamacpp:requests_processing 0", b"llamacpp:requests_processing " + value)
    assert body != IDLE
    values, missing = parse_metrics(body)
    assert "requests_processing" not in values
    assert missing == []  # unknown, not a renamed series
    assert not plausible(float("nan")) and plausible(0.0)


def test_vllm_reads_only_its_plausible_lines() -> None:
    text = VLLM.read_bytes()
    good = _metrics_read(Answer(Outcome.ANSWERED, 200, text))
    assert good.state == "ok"
    noisy = _metrics_read(Answer(Outcome.ANSWERED, 200, junk(1_000_000) + UNPARSABLE + text))
    assert noisy.state == "ok" and noisy.samples == good.samples
    name = "vllm:num_requests_running"
    broken = text.replace(
        b'engine="0",model_name="Qwen/Qwen3-32B-AWQ"} 3.0',
        b'engine="0",model_name="Qwen/Qwen3-32B-AWQ"} NaN',
    )
    broken = broken.replace(
        b'engine="1",model_name="Qwen/Qwen3-32B-AWQ"} 2.0',
        b'engine="1",model_name="Qwen/Qwen3-32B-AWQ"} -2',
        1,
    )
    assert broken.count(b"} NaN") == 1 and broken.count(b"} -2\n") == 1
    read = _metrics_read(Answer(Outcome.ANSWERED, 200, broken))
    assert read.state == "ok" and name not in read.samples
    assert read.samples.keys() == good.samples.keys() - {name}


def server(url: str) -> Server:
    return Server.model_validate(
        {
            "engine": "llama",
            "url": url,
            "unit": "llama-server@t.service",
            "role": "gpu-dense",
            "model": "tiny",
            "timeout_seconds": 2,
        }
    )


def scrape(collector: LlamaCollector) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    samples = {}
    with contextlib.suppress(CollectorError):  # raised after what it could read
        for family in collector.collect():
            for s in family.samples:
                samples[s.name, frozenset(s.labels.items())] = s.value
    return samples


def endpoint(samples: dict[Any, float], name: str, which: str) -> str:
    [state] = [
        dict(labels)["state"]
        for (metric, labels), value in samples.items()
        if metric == "gpufleet_llama_endpoint"
        and ("server", name) in labels
        and ("endpoint", which) in labels
        and value == 1
    ]
    return str(state)


def test_an_8_mb_metrics_is_cut_at_its_cap_and_costs_only_itself() -> None:
    assert BODY_CAPS["metrics"] < 8_000_000
    with (
        RecordedLlama({"/metrics": (junk(8_000_000) + BUSY, TEXT)}) as big,
        RecordedLlama(busy=True) as fine,
    ):
        collector = LlamaCollector({"big": server(big.url), "fine": server(fine.url)})
        try:
            samples = scrape(collector)
        finally:
            collector.close()
    assert endpoint(samples, "big", "metrics") == "error"
    assert endpoint(samples, "big", "props") == "ok"
    assert samples[("gpufleet_llama_up", frozenset({("server", "big")}))] == 1.0
    assert endpoint(samples, "fine", "metrics") == "ok"
    processing = (
        "gpufleet_llama_requests_processing",
        frozenset({("server", "fine"), ("served_model", "")}),
    )
    assert samples[processing] == 2
    # The big server's busy lines were past the cap: never read, so never a reason for /slots.
    assert big.hits.get("/slots", 0) == 0 and fine.hits["/slots"] == 1


def test_metrics_are_parsed_once_per_scrape(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []

    def counting(body: bytes) -> tuple[dict[str, float], list[str]]:
        calls.append(len(body))
        return parse_metrics(body)

    monkeypatch.setattr(llama_collector, "parse_metrics", counting)
    with RecordedLlama(busy=True) as busy:
        collector = LlamaCollector({"busy": server(busy.url)})
        try:
            for scrapes in (1, 2):
                samples = scrape(collector)
                assert endpoint(samples, "busy", "slots") == "ok"  # /metrics said: processing
                assert len(calls) == scrapes
        finally:
            collector.close()


def dropped_of(collector: LlamaCollector, name: str, reason: str) -> int:
    return collector.dropped()[name, reason]


def test_slots_past_the_budget_are_left_out_and_counted() -> None:
    """A server listing 5,000 busy slots (a stand-in: the real one is started with -np 2);
    10,000 of the pinned build's slots would be past /slots' 8 MiB cap (the endpoint errs)."""
    one = json.loads((FIXTURES / "slots-busy.json").read_text())[0]
    slots = [{**one, "id": i, "id_task": 1000 + i} for i in range(5_000)]
    body = json.dumps(slots).encode()
    with RecordedLlama({"/slots": (body, JSON)}, busy=True) as many:
        collector = LlamaCollector({"many": server(many.url)})  # max_slots: 256 by default
        try:
            assert dropped_of(collector, "many", "slots_over_budget") == 0  # there from the start
            samples = scrape(collector)
        finally:
            collector.close()
    per_slot = {
        dict(labels)["slot"]
        for (metric, labels) in samples
        if metric == "gpufleet_llama_slot_task_age_seconds"
    }
    assert per_slot == {str(i) for i in range(256)}  # the lowest ids
    labels = frozenset({("server", "many"), ("served_model", ""), ("state", "busy")})
    assert samples["gpufleet_llama_slots", labels] == 5_000  # the counts stay whole
    # Each slot left out had three series: its task age, decoded tokens and predict limit.
    assert dropped_of(collector, "many", "slots_over_budget") == (5_000 - 256) * 3


def test_router_models_past_the_budget_are_neither_read_nor_exported() -> None:
    props = json.loads((FIXTURES / "props.json").read_text())
    props["role"] = "router"
    models = {"data": [{"id": f"m{i:04d}", "status": {"value": "loaded"}} for i in range(5_000)]}
    bodies = {
        "/props": (json.dumps(props).encode(), JSON),
        "/models": (json.dumps(models).encode(), JSON),
    }
    roster = server("http://127.0.0.1:9").model_copy(update={"max_models": 3})
    with RecordedLlama(bodies) as router:
        collector = LlamaCollector({"hub": roster.model_copy(update={"url": router.url})})
        try:
            samples = scrape(collector)  # the first scrape learns it is a router
            samples = scrape(collector)
        finally:
            collector.close()
    listed = {
        dict(labels)["served_model"]
        for (metric, labels) in samples
        if metric == "gpufleet_llama_model_info"
    }
    assert listed == {"m0000", "m0001", "m0002"}
    # Only the models within the budget were read (props and metrics of each child).
    assert router.hits["/metrics"] <= 2 * 3 + 1
    # Each model left out: its info and a state series per state value.
    assert dropped_of(collector, "hub", "models_over_budget") >= (5_000 - 3) * 6
