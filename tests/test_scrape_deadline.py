"""The scrape's own deadline: a stuck source never holds a scrape, `/` or shutdown.

In-process, a collector that blocks on an event stands for any source stuck in the kernel.
As a real process, `gpu-fleet-exporter` reads a sysfs tree whose nvme chip's `temp1_input`
is a FIFO (open() blocks until a writer comes, as a read waiting on a wedged admin command
does): before, `/metrics` never answered, `/` stopped answering after four scrapes, and
SIGTERM did not stop the process.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.metrics_core import Metric

from exporter.exposition import TextWriter
from exporter.registry import SCRAPE_TIMEOUT, FleetCollector
from tests.llama_lab import free_port
from tests.sysfs_tree import nvme_spec, write_hwmon_chip, write_k10temp

EXPORTER = str(Path(sys.executable).parent / "gpu-fleet-exporter")


class Blocks:
    """A collector that blocks in collect() until `release` is set."""

    name = "stuck"

    def __init__(self) -> None:
        self.release = threading.Event()
        self.calls = 0

    def collect(self) -> Iterator[Metric]:
        self.calls += 1
        self.release.wait(30)
        family = GaugeMetricFamily("gpufleet_test_stuck", "late")
        family.add_metric([], 1.0)
        yield family

    def close(self) -> None:
        self.release.set()


class Quick:
    name = "quick"

    def collect(self) -> Iterator[Metric]:
        family = GaugeMetricFamily("gpufleet_test_quick", "on time")
        family.add_metric([], 2.0)
        yield family

    def close(self) -> None:
        pass


def scrape(fleet: FleetCollector, timeout: float | None = None) -> tuple[str, float]:
    token = SCRAPE_TIMEOUT.set(timeout)
    start = time.monotonic()
    try:
        text = TextWriter().render(fleet.collect()).decode()
    finally:
        SCRAPE_TIMEOUT.reset(token)
    return text, time.monotonic() - start


def test_a_stuck_collector_is_left_behind_at_the_deadline() -> None:
    stuck = Blocks()
    fleet = FleetCollector([stuck, Quick()])
    try:
        # Prometheus' header says 1.5 s: a budget of 1 s, half of it for one collector; after
        # that the stuck one is left behind and the next one read.
        text, took = scrape(fleet, timeout=1.5)
        assert 0.4 < took < 0.9
        assert "gpufleet_test_quick 2.0" in text and "gpufleet_test_stuck" not in text
        assert 'gpufleet_exporter_collector_success{collector="stuck"} 0.0' in text
        assert 'gpufleet_exporter_collector_success{collector="quick"} 1.0' in text
        for _ in range(5):
            # Still stuck: not started again, not waited on; threads stay flat.
            text, took = scrape(fleet, timeout=1.5)
            assert took < 0.3
            assert "gpufleet_test_quick 2.0" in text
            assert 'gpufleet_exporter_collector_success{collector="stuck"} 0.0' in text
        assert stuck.calls == 1
        # The stuck one's worker, and the fresh one that took the rest: never one per scrape.
        assert sum(reads.threads() for reads, _ in fleet._groups) == 2
        stuck.release.set()  # it returns: the next scrape runs it again
        deadline = time.monotonic() + 5
        while "gpufleet_test_stuck 1.0" not in text and time.monotonic() < deadline:
            text, _ = scrape(fleet, timeout=1.5)
        assert 'gpufleet_exporter_collector_success{collector="stuck"} 1.0' in text
    finally:
        fleet.close()


def test_interrupt_answers_a_scrape_in_progress_now() -> None:
    stuck = Blocks()
    fleet = FleetCollector([stuck, Quick()])
    took: list[float] = []
    thread = threading.Thread(target=lambda: took.append(scrape(fleet, timeout=30)[1]))
    thread.start()
    time.sleep(0.5)
    fleet.interrupt()
    thread.join(5)
    assert took and took[0] < 1.5
    fleet.close()


def test_a_second_scrape_waits_for_the_first_not_for_a_stuck_source() -> None:
    """Two scrapers (an HA pair of Prometheus) at once: both answered, neither past its
    deadline, and the stuck collector runs once."""
    stuck = Blocks()
    fleet = FleetCollector([stuck, Quick()])
    barrier = threading.Barrier(2)
    answers: list[tuple[str, float]] = []

    def one() -> None:
        barrier.wait(5)
        answers.append(scrape(fleet, timeout=2.0))

    threads = [threading.Thread(target=one) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10)
    try:
        assert len(answers) == 2
        assert all("gpufleet_test_quick 2.0" in text for text, _ in answers)
        assert all(took < 2.0 for _, took in answers)
        assert stuck.calls == 1
    finally:
        fleet.close()


def test_a_blocking_hwmon_file_never_stops_the_exporter(tmp_path: Path) -> None:
    sysfs = tmp_path / "sys"
    write_k10temp(sysfs)
    nvme = write_hwmon_chip(sysfs, nvme_spec(0, "0000:01:00.0"))
    fifo = nvme / "temp1_input"
    fifo.unlink()
    os.mkfifo(fifo)
    port = free_port()
    proc = subprocess.Popen(
        [
            EXPORTER,
            "--sysfs",
            str(sysfs),
            "--collector.timeout",
            "1",
            "--web.listen-address",
            f"127.0.0.1:{port}",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                urllib.request.urlopen(f"{base}/", timeout=5).close()
                break
            except OSError:
                assert time.monotonic() < deadline and proc.poll() is None
                time.sleep(0.1)
        headers = {"X-Prometheus-Scrape-Timeout-Seconds": "3"}
        for _ in range(6):  # more than the front's 4 workers
            start = time.monotonic()
            request = urllib.request.Request(f"{base}/metrics", headers=headers)
            with urllib.request.urlopen(request, timeout=5) as answer:
                assert answer.status == 200
                text = answer.read().decode()
            assert time.monotonic() - start < 2.9
            assert 'gpufleet_host_temperature_celsius{chip="k10temp",sensor="Tctl"}' in text
            assert 'gpufleet_host_temperature_read_timeout{chip="nvme"} 1.0' in text
            with urllib.request.urlopen(f"{base}/", timeout=2) as landing:
                assert landing.status == 200
        start = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=5) == 0
        assert time.monotonic() - start < 5
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        with contextlib.suppress(OSError):  # nobody waits on it any more
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
