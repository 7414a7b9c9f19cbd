"""Sleeping llama-servers (`--sleep-idle-seconds`) against the real pinned build: never woken.

On the pinned build every server task except the metrics task resets the idle timer, and
`/slots` waits for a sleeping server to wake (reloading its model); `/health`, `/props`
(`is_sleeping`) and `/metrics` answer from cache. So the exporter must read a sleeper without
waking it, and scrape an idle awake server without keeping it awake; the canary likewise. The
idle time is 3 s to keep these tests short; the scrapes come every second, as in production
at the shortest.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from exporter.canary import CanaryProbe
from exporter.collectors.llama import LlamaCollector
from fleet.roster import Canary
from tests.llama_lab import LlamaServer, StartLlamaServer, get_json, wait_until
from tests.tcp_proxy import TcpProxy
from tests.test_llama_collector import Scrape, entry

IDLE_SECONDS = 3
SLEEP_ARGS = ("-c", "1024", "-np", "2", "-t", "1", "--metrics", "--sleep-idle-seconds", "3")
# How late "on time" may be: one scrape interval and a loaded 2-core machine's slack.
LATE_SECONDS = 2.5
SCRAPES_ASLEEP = 60  # a minute of 1 s scrapes


def is_sleeping(server: LlamaServer) -> bool:
    """The server's own word (`/props` is answered from cache: it wakes nothing)."""
    return get_json(server.url, "/props")["is_sleeping"] is True


@pytest.fixture
def collector(llama_server: StartLlamaServer) -> Iterator[tuple[LlamaServer, LlamaCollector]]:
    server = llama_server(*SLEEP_ARGS)
    made = LlamaCollector({"alpha": entry(server.url)})
    yield server, made
    made.close()


def assert_asleep_and_unwoken(s: Scrape) -> None:
    assert s.get("gpufleet_llama_sleeping", server="alpha") == 1
    # Sleeping is not down: /health answers 200 from cache.
    assert s.get("gpufleet_llama_up", server="alpha") == 1
    assert s.health("alpha") == "ok"
    # Slots are unknown while asleep (reading them would wake it): absent, not 0.
    assert s.get("gpufleet_llama_slots", server="alpha", state="idle") is None
    assert not any(n.startswith("gpufleet_llama_slot_") for n in s.names("alpha"))
    assert s.endpoint("alpha", "metrics") == "ok"
    assert s.get("gpufleet_llama_decode_calls_total", server="alpha") is not None


def test_an_idle_server_scraped_every_second_still_falls_asleep_on_time(
    collector: tuple[LlamaServer, LlamaCollector],
) -> None:
    server, made = collector
    awake_since = time.monotonic()  # healthy: the idle timer runs from here at the latest
    first = Scrape(iter(made.collect()))
    assert first.get("gpufleet_llama_sleeping", server="alpha") == 0
    assert first.get("gpufleet_llama_slots", server="alpha", state="idle") == 2
    while True:
        s = Scrape(iter(made.collect()))
        if s.get("gpufleet_llama_sleeping", server="alpha") == 1:
            break
        assert time.monotonic() - awake_since < IDLE_SECONDS + LATE_SECONDS, (
            "scraped every second, the server never fell asleep\n" + server.log_tail()
        )
        time.sleep(1.0)
    assert is_sleeping(server)
    assert_asleep_and_unwoken(s)


def test_a_sleeping_server_stays_asleep_under_a_minute_of_scrapes_and_canaries(
    collector: tuple[LlamaServer, LlamaCollector],
) -> None:
    server, made = collector
    wait_until(lambda: is_sleeping(server), IDLE_SECONDS + 10, interval=0.2, what="asleep")
    settings = Canary(interval_seconds=10, max_tokens=8, timeout_seconds=30)
    probe = CanaryProbe("alpha", entry(server.url, canary=settings.model_dump()), settings)
    for scrape in range(SCRAPES_ASLEEP):
        assert_asleep_and_unwoken(Scrape(iter(made.collect())))
        if scrape % 10 == 0:
            assert probe.run_once() == "skipped_sleeping"
        # One wake would read is_sleeping false for IDLE_SECONDS: the next check sees it.
        assert is_sleeping(server), f"woken by scrape {scrape}\n" + server.log_tail()
        time.sleep(1.0)
    assert probe.snapshot() == ({}, {**dict.fromkeys(probe.snapshot()[1], 0),
                                     "skipped_sleeping": 6})  # fmt: skip


def test_the_canary_does_not_keep_an_idle_server_awake(
    collector: tuple[LlamaServer, LlamaCollector],
) -> None:
    server, _ = collector
    settings = Canary(interval_seconds=10, max_tokens=8, timeout_seconds=30)
    probe = CanaryProbe("alpha", entry(server.url, canary=settings.model_dump()), settings)
    assert probe.run_once() == "ok"  # the first run has no last run to compare with
    measured_at = time.monotonic()
    outcomes: list[str] = []
    while not is_sleeping(server):
        assert time.monotonic() - measured_at < IDLE_SECONDS + LATE_SECONDS, (
            f"the canary kept the server awake: {outcomes}\n" + server.log_tail()
        )
        outcomes.append(probe.run_once())
        time.sleep(0.5)
    assert set(outcomes) <= {"skipped_idle"}, outcomes
    assert probe.run_once() == "skipped_sleeping"
    # Real traffic wakes the server by itself; once it is done the canary measures again.
    generation = server.generate(n_predict=16)
    assert generation.wait(60) and generation.status == 200, generation.error
    assert probe.run_once() == "ok"
    assert probe.run_once() == "skipped_idle"


def test_the_canary_measures_a_restarted_server_again(llama_server: StartLlamaServer) -> None:
    # One address, two processes in turn (a TCP proxy stands for the unit's fixed port): the
    # old one served traffic, so its counters are ahead of the new one's. The new process has
    # served nothing, yet the old reading says nothing about it: the canary measures once.
    old = llama_server("-c", "1024", "-np", "1", "-t", "1", "--metrics")
    with TcpProxy(old.port) as proxy:
        settings = Canary(interval_seconds=10, max_tokens=8, timeout_seconds=30)
        url = f"http://127.0.0.1:{proxy.port}"
        probe = CanaryProbe("alpha", entry(url, canary=settings.model_dump()), settings)
        assert probe.run_once() == "ok"
        generation = old.generate(n_predict=32)  # traffic: the old counters move past the run
        assert generation.wait(60) and generation.status == 200, generation.error
        assert probe.run_once() == "ok"
        assert probe.run_once() == "skipped_idle"
        new = llama_server("-c", "1024", "-np", "1", "-t", "1", "--metrics")
        old.stop()
        proxy.upstream = new.port  # "restarted": the same address, a fresh process
        assert probe.run_once() == "ok"
        assert probe.run_once() == "skipped_idle"  # and idle again after that one run
