"""The one bounded way to read servers (exporter/sources/bounded.py): real and stand-in servers.

A trickling, hung or SIGSTOPped server must cost its own series only: every call is bounded as a
whole, a lane (server, endpoint) has one call in flight at most, `/health` has a lane of its
own, and the workers are a fixed number. The real pinned llama-server is the healthy neighbour
and the SIGSTOPped one; `tests/llama_stand_in.py` does what it cannot do on demand (trickle one
byte at a time, answer 500).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest

from exporter.collectors.llama import MAX_WORKERS, LlamaCollector
from exporter.sources.bounded import BUSY_DETAIL, Lanes, Request
from exporter.sources.http_client import Outcome, Watchdog, call
from tests.llama_lab import StartLlamaServer
from tests.llama_stand_in import LlamaStandIn
from tests.test_llama_collector import SMALL_ARGS, Scrape, entry

# What a loaded 2-core CI machine may add on top of a deadline.
SLACK_SECONDS = 0.35


@pytest.fixture
def lanes() -> Iterator[Lanes]:
    made = Lanes(2, name="test-read")
    yield made
    made.close()


@pytest.fixture
def trickler() -> Iterator[LlamaStandIn]:
    # 20 bytes a second: a few hundred bytes of answer take far longer than any timeout here.
    with LlamaStandIn("trickle", interval=0.05) as stand_in:
        yield stand_in


def test_a_trickling_answer_is_cut_at_the_deadline_of_the_whole_call(
    trickler: LlamaStandIn,
) -> None:
    watchdog = Watchdog()
    try:
        start = time.monotonic()
        answer = call(f"{trickler.url}/health", timeout=0.5, watchdog=watchdog)
        elapsed = time.monotonic() - start
    finally:
        watchdog.close()
    # Each byte came 20x sooner than the socket timeout: only the whole-call deadline ends it.
    assert answer.outcome is Outcome.TIMEOUT, answer
    assert 0.45 < elapsed < 0.5 + SLACK_SECONDS, elapsed


def test_a_lane_has_one_call_in_flight_and_a_second_is_busy_at_once(
    lanes: Lanes, trickler: LlamaStandIn
) -> None:
    first = lanes.start(("t", "metrics"), Request(f"{trickler.url}/metrics", 1.0))
    start = time.monotonic()
    second = lanes.start(("t", "metrics"), Request(f"{trickler.url}/metrics", 1.0))
    assert second.done and time.monotonic() - start < 0.05
    assert second.answer().outcome is Outcome.TIMEOUT
    assert second.answer().detail == BUSY_DETAIL
    # Another lane of the same server is not held up by it.
    health = lanes.start(("t", "health"), Request(f"{trickler.url}/health", 1.0))
    assert not health.done
    lanes.wait([first, health])
    assert first.answer().outcome is Outcome.TIMEOUT
    assert trickler.connections == 2  # the refused call never connected
    # Once the first call has ended (cut at its deadline) the lane takes a new one.
    third = lanes.start(("t", "metrics"), Request(f"{trickler.url}/metrics", 0.2))
    lanes.wait([third])
    assert third.answer().detail != BUSY_DETAIL


def test_the_wait_ends_at_the_request_timeout_not_past_it(
    lanes: Lanes, trickler: LlamaStandIn
) -> None:
    # The timeout bounds the wait as well as the call: the call is cut a margin before it,
    # so a scrape waits no longer than its servers' timeouts.
    before = time.monotonic()
    pending = lanes.start(("t", "metrics"), Request(f"{trickler.url}/metrics", 0.5))
    after = time.monotonic()
    assert before + 0.5 <= pending.deadline <= after + 0.5
    lanes.wait([pending])
    assert pending.answer().outcome is Outcome.TIMEOUT  # trickling: cut, or still running


def test_workers_are_bounded_a_call_beyond_them_is_busy_not_queued(
    lanes: Lanes, trickler: LlamaStandIn
) -> None:
    held = [lanes.start((n, "metrics"), Request(f"{trickler.url}/metrics", 1.0)) for n in "ab"]
    refused = lanes.start(("c", "metrics"), Request(f"{trickler.url}/metrics", 1.0))
    assert refused.done and refused.answer().detail == BUSY_DETAIL
    workers = [t for t in threading.enumerate() if t.name.startswith("test-read")]
    assert len(workers) == 2
    lanes.wait(held)


def test_neighbours_of_a_trickling_a_hung_and_a_failing_server_are_read_on_time(
    llama_server: StartLlamaServer,
) -> None:
    healthy = llama_server(*SMALL_ARGS)
    frozen = llama_server(*SMALL_ARGS)
    timeout = 1.0
    with (
        LlamaStandIn("trickle", interval=1.0) as trickling,
        LlamaStandIn("trickle", interval=1.0, paths=frozenset({"/metrics"})) as slow_metrics,
        LlamaStandIn("error") as failing,
    ):
        servers = {
            "healthy": entry(healthy.url, timeout_seconds=timeout),
            "frozen": entry(frozen.url, timeout_seconds=timeout),
            "trickling": entry(trickling.url, timeout_seconds=timeout),
            "slowmetrics": entry(slow_metrics.url, timeout_seconds=timeout),
            "failing": entry(failing.url, timeout_seconds=timeout),
        }
        collector = LlamaCollector(servers)
        try:
            frozen.freeze()
            threads = []
            for _ in range(6):
                start = time.monotonic()
                s = Scrape(iter(collector.collect()))
                elapsed = time.monotonic() - start
                # The exporter's own threads (drivers, lane workers, the watchdog), not the
                # stand-ins' connection threads.
                threads.append(sum(t.name.startswith(("llama", "http-watchdog"))
                                   for t in threading.enumerate()))  # fmt: skip
                assert elapsed < timeout + SLACK_SECONDS, elapsed
                assert s.get("gpufleet_llama_up", server="healthy") == 1
                assert s.endpoint("healthy", "metrics") == "ok"
                assert s.endpoint("healthy", "props") == "ok"
                assert s.health("frozen") == "timeout"
                assert s.health("trickling") == "timeout"
                assert s.health("failing") == "error"
                # /health has a lane of its own: never behind the trickling /metrics.
                assert s.health("slowmetrics") == "ok"
                assert s.endpoint("slowmetrics", "metrics") == "busy"
            # Never more than the fixed set: one driver per server, the watchdog, and the lane
            # workers' ceiling; hung calls do not add threads scrape after scrape beyond it.
            # (The pool starts a worker only when no idle one is free, so in practice far
            # fewer: the benchmark shows 31 over 600 scrapes of six servers.)
            assert max(threads) <= len(servers) + MAX_WORKERS + 1, threads
        finally:
            frozen.thaw()
            collector.close()
