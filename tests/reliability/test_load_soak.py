"""Reliability 6: load and soak — a storm against one remediator beside one exporter scraped
every second, both watched from `/proc` for the whole time.

Side by side for 2 minutes (`make test`) or 10 (`make reliability`):

- **Storm.** A real `gpu-fleet-remediator serve` on SQLite with its workers running gets a
  burst every 5 s: 600 notifications from 16 senders as fast as it answers (hundreds a second),
  a quarter LlamaServerDown of 40 servers firing all along (repeats and HA twins: one run each,
  probe, restart, verify), a quarter their twins, a quarter the newest group of five BenchAlerts
  (no playbook: each a notify-only run) and a quarter the group of three bursts back resolved.
  Every post has a group key of its own, so the journal says which were admitted. A 503 is
  retried as Alertmanager retries it. Per 5-s window: answered notifications/s, p99 latency.
- **Soak.** A real `gpu-fleet-exporter` with the servers benchmark's six (healthy, SIGSTOPped,
  trickling, sleeping, router, erroring: `tests/reliability/soak.py`), each with a 0.8 s
  timeout, scraped every second by a process of its own.

Both processes are sampled every 1.3 s: threads (/proc/PID/task), open fds (/proc/PID/fd), RSS
(VmRSS). Warm-up: the first 30 s of the run, at both sizes. By then every waitress thread,
engine worker and lane thread has started (their counts do not move after the first burst or
scrape), six bursts have touched each thread's glibc arena and SQLite's page caches, and the
RSS jump of the start is over (in the runs here within the first 10 s; after it both creep by
a few KiB a second). After it:

- memory growth < 10 %: the median RSS of the last 15 s against the median of the 15 s right
  after the warm-up;
- threads flat: at most THREADS_SLACK threads above the most seen in those first 15 s (a pool
  may start one more the first time its calls overlap a way they had not before);
- fds flat: the fewest open in the last 15 s at most FDS_SLACK above the fewest in the first
  15 s. The floor, not the peak: a scrape holds a socket per server endpoint in flight and a
  burst its connections, so a sample's count depends on when in a scrape it lands, while a
  leak raises the floor (the most seen is in the table);
- storm: every notification answered 200 is in the journal, once; nothing but 200 or an
  honest 503 (the journal could not write: then nothing was journaled, and the retry's 200
  is the one row); each server restarted once (its one run);
- soak: every scrape answered 200, none over the timeout + 0.1 s (the exporter's promise:
  README, "Model servers"), the three healthy servers read up in every scrape, the sleeper
  not woken and the router's unloaded model not loaded.

On this shared two-core machine the two stand for two machines that never share a CPU in a
fleet (the exporter on a GPU host, the remediator on the central one): the storm's side — the
remediator and the test's sender threads — runs at nice 10, so the exporter's scrapes get the
CPU they would have on their own host and the storm takes the rest. The thresholds are the same
at both sizes.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import queue
import statistics
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tests.llama_lab import free_port, stop_process, wait_until
from tests.reliability.figures import Figures, sized
from tests.reliability.harness import CountingServers, journal_query, notification
from tests.reliability.soak import (
    HEALTHY,
    Drift,
    ProcessSample,
    Sampler,
    Scrape,
    drift,
    parse_scrapes,
    six_servers_roster,
    start_six_servers,
)
from tests.remediator_lab import write_setup
from tests.test_remediator_process import Replica

pytestmark = pytest.mark.reliability

ROOT = Path(__file__).resolve().parents[2]
EXPORTER = str(Path(sys.executable).parent / "gpu-fleet-exporter")
STORM, SOAK = "6 storm", "6 soak"

SECONDS = sized(120, 600)
WARMUP = 30.0
SPAN = 15.0  # the windows compared: right after the warm-up, and the last
# Not a multiple of the 1-s scrape interval: the samples walk through a scrape's phases, so
# every 15-s span holds samples between scrapes (the fds' floor) and in them.
SAMPLE_EVERY = 1.3
RSS_GROWTH_MAX = 0.10
THREADS_SLACK = 2
FDS_SLACK = 4

BURST_EVERY = 5.0
BURST = 600
SENDERS = 16
SERVERS = 40
GROUP = 5  # BenchAlerts per group
RESOLVE_AFTER = 3  # bursts

TIMEOUT = 0.8  # each server's, below the 1 s interval (the servers benchmark's)
MARGIN = 0.1
STORM_NICE = 10


def _nice_thread() -> None:
    # Linux: a thread's niceness is its own (setpriority on its task id).
    os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), STORM_NICE)


def _renice(pid: int) -> None:
    """Renice every thread of `pid` (threads it starts later inherit from their creator)."""
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError):  # a thread that ended meanwhile
            os.setpriority(os.PRIO_PROCESS, int(task.name), STORM_NICE)


# -- the storm ----------------------------------------------------------------------------------


def _bench_group(burst: int, *, resolved: bool) -> dict[str, Any]:
    """The group of five BenchAlerts first fired by `burst` (no playbook: notify-only runs)."""
    payload = notification("s0", "0")
    template = payload["alerts"][0]
    alerts = []
    for index in range(GROUP):
        alert = json.loads(json.dumps(template))
        alert["labels"].update(alertname="BenchAlert", server=f"s{index}", burst=str(burst))
        alert["fingerprint"] = f"be{burst:08x}{index:06x}"
        alert["startsAt"] = f"2026-11-30T08:{burst // 60 % 60:02d}:{burst % 60:02d}Z"
        if resolved:
            alert.update(status="resolved", endsAt="2026-11-30T09:00:00Z")
        alerts.append(alert)
    payload.update(alerts=alerts, status="resolved" if resolved else "firing")
    payload["commonLabels"] = {"alertname": "BenchAlert", "host": "dioscuri", "burst": str(burst)}
    payload["groupLabels"] = {"alertname": "BenchAlert"}
    return payload


def _burst(number: int) -> Iterator[dict[str, Any]]:
    """Burst `number`'s notifications, interleaved as a storm's arrive."""
    for index in range(BURST):
        kind = index % 4
        if kind < 2:
            server = (index // 4) % SERVERS
            body = notification(f"s{server}", f"d0{server:014x}")
            if kind:  # the HA pair's twin
                body["externalURL"] = "http://127.0.0.2:9093"
            yield body
        elif kind == 3 and number >= RESOLVE_AFTER:
            yield _bench_group(number - RESOLVE_AFTER, resolved=True)
        else:
            yield _bench_group(number, resolved=False)


@dataclass
class _Attempt:
    key: str
    ended: float  # monotonic
    seconds: float
    status: int  # 0: no answer


@dataclass
class _Storm:
    port: int
    token: str
    attempts: list[_Attempt] = field(default_factory=list)
    unsent: int = 0  # left in the queue when the time was up (never posted: not lost)
    reconnects: int = 0  # a kept-alive connection found closed, the post sent again
    alerts: dict[str, int] = field(default_factory=dict)  # alerts in each notification
    _queue: queue.Queue[tuple[str, bytes] | None] = field(default_factory=queue.Queue)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _stop: threading.Event = field(default_factory=threading.Event)

    def _connection(self) -> http.client.HTTPConnection:
        return http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)

    def _post(self, conn: http.client.HTTPConnection, key: str, body: bytes) -> int:
        headers = {"Content-Type": "application/json", "Authorization": f"Bearer {self.token}"}
        conn.request("POST", "/webhook/alertmanager", body=body, headers=headers)
        response = conn.getresponse()
        response.read()
        return int(response.status)

    def _send(self) -> None:
        _nice_thread()
        conn = self._connection()
        mine: list[_Attempt] = []
        while (item := self._queue.get()) is not None:
            if self._stop.is_set():
                with self._lock:
                    self.unsent += 1
                continue
            key, body = item
            for _ in range(100):  # a 503 is retried, as Alertmanager retries a 5xx
                started = time.monotonic()
                try:
                    status = self._post(conn, key, body)
                except (http.client.RemoteDisconnected, BrokenPipeError, ConnectionResetError):
                    # A kept-alive connection the server had closed; a post it did admit
                    # before closing would be journaled twice, which the test counts.
                    conn.close()
                    conn = self._connection()
                    with self._lock:
                        self.reconnects += 1
                    continue
                except OSError:
                    status = 0
                    conn.close()
                    conn = self._connection()
                ended = time.monotonic()
                mine.append(_Attempt(key, ended, ended - started, status))
                if status != 503:
                    break
                time.sleep(0.1)
        conn.close()
        with self._lock:
            self.attempts += mine

    def run(self, seconds: float) -> float:
        """Burst every BURST_EVERY s for `seconds`, then stop; returns the start (monotonic)."""
        _nice_thread()
        senders = [threading.Thread(target=self._send, daemon=True) for _ in range(SENDERS)]
        for sender in senders:
            sender.start()
        start = time.monotonic()
        number = 0
        posted = 0
        while time.monotonic() < start + seconds:
            for body in _burst(number):
                body["groupKey"] = f"storm-{posted}"
                self.alerts[body["groupKey"]] = len(body["alerts"])
                self._queue.put((body["groupKey"], json.dumps(body).encode()))
                posted += 1
            number += 1
            time.sleep(max(0.0, start + number * BURST_EVERY - time.monotonic()))
        self._stop.set()
        for _ in senders:
            self._queue.put(None)
        for sender in senders:
            sender.join(120)
        return start


@dataclass(frozen=True)
class _Window:
    start: float
    answered: int
    p99: float | None
    burst_rate: float | None  # answered/s from the burst's first post to its last answer


def _percentile(values: list[float], share: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(share * len(ordered)))]


def _windows(attempts: list[_Attempt], start: float, seconds: float) -> list[_Window]:
    by_window: dict[int, list[_Attempt]] = {}
    for attempt in attempts:
        by_window.setdefault(int((attempt.ended - start) // BURST_EVERY), []).append(attempt)
    windows = []
    for index in range(int(seconds // BURST_EVERY)):
        these = by_window.get(index, [])
        latencies = [a.seconds for a in these]
        answered = sum(1 for a in these if a.status == 200)
        rate = None
        if these:
            busy = max(a.ended for a in these) - min(a.ended - a.seconds for a in these)
            rate = answered / busy if busy > 0 else None
        windows.append(
            _Window(
                index * BURST_EVERY,
                answered,
                _percentile(latencies, 0.99) if latencies else None,
                rate,
            )
        )
    return windows


# -- the soak -----------------------------------------------------------------------------------


def _start_exporter(
    stack: ExitStack, roster: Path, work: Path
) -> tuple[subprocess.Popen[bytes], int]:
    port = free_port()
    log = (work / "exporter.log").open("ab")
    stack.callback(log.close)
    proc = subprocess.Popen(
        [EXPORTER, "--config", str(roster), "--host", "bench", "--sysfs", str(work),
         "--web.listen-address", f"127.0.0.1:{port}", "--log.level", "warning"],
        stdout=log, stderr=subprocess.STDOUT,
    )  # fmt: skip
    stack.callback(stop_process, proc, 10)

    def answers() -> bool:
        if proc.poll() is not None:
            raise AssertionError(f"the exporter exited {proc.returncode}")
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
            conn.request("GET", "/metrics")
            ok = conn.getresponse().status == 200
            conn.close()
            return ok
        except OSError:
            return False

    wait_until(answers, timeout=30, what="the exporter")
    return proc, port


def _trend(name: str, samples: list[ProcessSample], start: float) -> None:
    """The samples as printed lines (seen with -s, and in a failure's report)."""
    print(f"{name}: t-s threads fds rss-KiB")
    for s in samples:
        print(f"  {s.at - start:6.1f} {s.threads:4d} {s.fds:4d} {s.rss_kib:8d}")


def _count_drift(suite: str, figures: Figures, d: Drift) -> list[str]:
    """Count `d` into the figures; the targets it missed."""
    figures.add(suite, "RSS at the start (KiB)", d.rss_first_kib)
    figures.add(suite, "RSS after the warm-up, median (KiB)", int(d.rss_base_kib))
    figures.add(suite, "RSS at the end, median (KiB)", int(d.rss_end_kib))
    figures.add(suite, "RSS growth after the warm-up (per mille)", round(d.rss_growth * 1000))
    figures.add(suite, "threads right after the warm-up (most)", d.threads_base)
    figures.add(suite, "threads at most, after the warm-up", d.threads_max)
    figures.add(suite, "open fds right after the warm-up (fewest)", d.fds_floor_base)
    figures.add(suite, "open fds at the end (fewest)", d.fds_floor_end)
    figures.add(suite, "open fds at most, after the warm-up", d.fds_max)
    missed = []
    if d.rss_growth >= RSS_GROWTH_MAX:
        missed.append(f"{suite}: RSS grew {d.rss_growth:.1%} (target < {RSS_GROWTH_MAX:.0%})")
    if d.threads_max > d.threads_base + THREADS_SLACK:
        missed.append(f"{suite}: threads {d.threads_base} -> {d.threads_max}")
    if d.fds_floor_end > d.fds_floor_base + FDS_SLACK:
        missed.append(f"{suite}: fds (fewest) {d.fds_floor_base} -> {d.fds_floor_end}")
    return missed


def test_a_storm_and_a_soak_side_by_side(tmp_path: Path, figures: Figures) -> None:
    with ExitStack() as stack:
        six_dir = tmp_path / "six"
        six_dir.mkdir()
        six = start_six_servers(stack, six_dir)
        roster = six_servers_roster(six_dir / "fleet.yaml", six.urls, TIMEOUT)
        exporter, exporter_port = _start_exporter(stack, roster, six_dir)

        model = CountingServers([f"s{i}" for i in range(SERVERS)])
        stack.callback(model.close)
        port = free_port()
        setup = write_setup(
            tmp_path,
            servers=model.urls(),
            listen=f"127.0.0.1:{port}",
            extra="limits: {max_runs_per_hour: 100000}\n",
        )
        replica = Replica(setup, port, tmp_path / "remediator.log").start()
        stack.callback(replica.stop)
        assert replica.proc is not None
        _renice(replica.proc.pid)

        pids = {"remediator": replica.proc.pid, "exporter": exporter.pid}
        with Sampler(pids, SAMPLE_EVERY) as sampler:
            scraped = (tmp_path / "scrapes.jsonl").open("wb")
            stack.callback(scraped.close)
            scraper = subprocess.Popen(
                [sys.executable, "-m", "tests.reliability.soak", "scrape", str(exporter_port),
                 str(exporter.pid), str(SECONDS), *HEALTHY],
                cwd=ROOT, stdout=scraped,
            )  # fmt: skip
            stack.callback(stop_process, scraper, 5)
            soak_start = time.monotonic()
            storm = _Storm(port, setup.webhook_token)
            storm_start = storm.run(SECONDS)
            scraper.wait(timeout=120)
        scrapes: list[Scrape] = parse_scrapes((tmp_path / "scrapes.jsonl").read_text())
        asleep = six.sleeper_asleep()
        beta = six.router_models()["beta"]

        # Every run decided and done: the workers kept pace (then the journal is read once).
        def settled() -> bool:
            rows = journal_query(tmp_path / "journal.db", "SELECT state FROM runs")
            return all(r[0] == "done" for r in rows)

        wait_until(settled, timeout=120, what="every run done")
        healthy_at_end = replica._healthy()
        rows = journal_query(
            tmp_path / "journal.db",
            "SELECT group_key, count(*) FROM notifications WHERE rejected IS NULL "
            "GROUP BY group_key",
        )
        outcomes = Counter(
            str(r[0]) for r in journal_query(tmp_path / "journal.db", "SELECT outcome FROM runs")
        )
        restarts = {i: model.count(f"s{i}", "/restart") for i in range(SERVERS)}

    # -- the storm's figures and targets
    journaled = {str(key): int(n) for key, n in rows}
    answered = {a.key for a in storm.attempts if a.status == 200}
    statuses = Counter(a.status for a in storm.attempts)
    lost = sorted(k for k in answered if k not in journaled)
    twice = sorted(k for k, n in journaled.items() if n > 1)
    # A 503 says "not journaled, retry": one never followed by a 200 must have no row.
    refused_only = {a.key for a in storm.attempts if a.status == 503} - answered
    dishonest = sorted(k for k in refused_only if k in journaled)
    wrong = sum(n for s, n in statuses.items() if s not in (200, 503))
    restarted_twice = [f"s{i}: {n}" for i, n in restarts.items() if n > 1]
    not_restarted = [f"s{i}" for i, n in restarts.items() if n == 0]
    windows = _windows(storm.attempts, storm_start, SECONDS)
    _trend("remediator", sampler.samples["remediator"], storm_start)
    for w in windows:
        p99 = "-" if w.p99 is None else f"{w.p99 * 1000:.0f} ms"
        rate = "-" if w.burst_rate is None else f"{w.burst_rate:.0f}/s"
        print(f"  window {w.start:5.0f} s: {w.answered / BURST_EVERY:6.1f} answered/s "
              f"(in its burst {rate}), p99 {p99}")  # fmt: skip
    latencies = [a.seconds for a in storm.attempts]
    p99s = [w.p99 for w in windows if w.p99 is not None]
    figures.add(STORM, "notifications answered 200", len(answered))
    figures.add(STORM, "answered 503 (journal busy, retried)", statuses.get(503, 0))
    figures.add(STORM, "kept-alive connections found closed", storm.reconnects)
    figures.add(STORM, "not sent when the time was up", storm.unsent)
    figures.add(STORM, "notifications/s, mean", round(len(answered) / SECONDS))
    rates = sorted(w.burst_rate for w in windows if w.burst_rate is not None)
    figures.add(STORM, "alerts/s, mean", round(sum(storm.alerts[k] for k in answered) / SECONDS))
    figures.add(STORM, "notifications/s within a burst, median", round(statistics.median(rates)))
    figures.add(STORM, "notifications/s within a burst, slowest", round(rates[0]))
    figures.add(STORM, "p99 latency, whole storm (ms)", round(_percentile(latencies, 0.99) * 1000))
    figures.add(STORM, "p99 latency, worst window (ms)", round(max(p99s) * 1000))
    figures.add(STORM, "runs done", sum(outcomes.values()))
    figures.zero(STORM, "lost: 200 but not journaled", len(lost))
    figures.zero(STORM, "journaled twice", len(twice))
    figures.zero(STORM, "503 but journaled", len(dishonest))
    figures.zero(STORM, "answers neither 200 nor 503", wrong)
    figures.zero(STORM, "servers restarted twice", len(restarted_twice))
    missed = _count_drift(
        STORM, figures, drift(sampler.samples["remediator"], storm_start, WARMUP, SPAN)
    )

    # -- the soak's figures and targets
    _trend("exporter", sampler.samples["exporter"], soak_start)
    failed = [s for s in scrapes if s.status != 200]
    slow = [s for s in scrapes if s.seconds > TIMEOUT + MARGIN]
    down = [s for s in scrapes if s.status == 200 and s.healthy_up < len(HEALTHY)]
    for s in slow + failed + down:
        # When the run-queue wait is about the overshoot, other processes held the CPUs.
        print(f"  scrape at {s.at - soak_start:.1f} s: {s.seconds:.3f} s, {s.status}, "
              f"{s.healthy_up} up, exporter CPU {s.cpu:.3f} s, waited for a CPU "
              f"{s.waited:.3f} s, load {s.load:.1f}, llama collector {s.llama} s "
              f"{s.error}")  # fmt: skip
    print(f"scrapes: exporter CPU median {statistics.median(s.cpu for s in scrapes):.3f} s, "
          f"waited for a CPU median {statistics.median(s.waited for s in scrapes):.3f} s, "
          f"max {max(s.waited for s in scrapes):.3f} s; load median "
          f"{statistics.median(s.load for s in scrapes):.1f}, max "
          f"{max(s.load for s in scrapes):.1f}")  # fmt: skip
    figures.add(SOAK, "scrapes", len(scrapes))
    figures.add(
        SOAK,
        "scrape seconds, median (ms)",
        round(statistics.median(s.seconds for s in scrapes) * 1000),
    )
    figures.add(SOAK, "scrape seconds, worst (ms)", round(max(s.seconds for s in scrapes) * 1000))
    figures.zero(SOAK, "failed scrapes", len(failed))
    figures.zero(SOAK, "slow scrapes (over timeout + 0.1 s)", len(slow))
    figures.zero(SOAK, "scrapes with a healthy server down", len(down))
    figures.zero(SOAK, "servers woken or loaded by scrapes", (not asleep) + (beta != "unloaded"))
    missed += _count_drift(
        SOAK, figures, drift(sampler.samples["exporter"], soak_start, WARMUP, SPAN)
    )

    assert lost == [] and twice == [] and dishonest == [], (lost[:5], twice[:5], dishonest[:5])
    assert wrong == 0, statuses
    assert restarted_twice == [] and not_restarted == [], (restarted_twice, not_restarted)
    assert healthy_at_end, "the remediator's /healthz failed after the storm"
    assert len(answered) >= SECONDS * 20, f"too few notifications to judge: {len(answered)}"
    # One a second, a few lost to the scraper's own start-up at most.
    assert len(scrapes) >= SECONDS - 5, len(scrapes)
    assert failed == [] and slow == [] and down == [], (len(failed), len(slow), len(down))
    assert asleep and beta == "unloaded", (asleep, beta)
    assert missed == [], missed
