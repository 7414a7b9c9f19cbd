"""Benchmark: one host whose sources are hostile, scraped every second — nothing blanks it.

The host (issue 27): a fake NVML H200 pair (`examples/nvml-fake/two-h200.yaml`: the GPU is the
only stand-in), four amdgpu cards and k10temp in a sysfs tree written in the kernel's layout,
one of the cards stuck (its `gpu_busy_percent` a FIFO: a read blocks as on a hung SMU), an nvme
chip whose `temp1_input` blocks the same way, and six llama servers:

- `healthy`: the pinned real llama-server on the tiny test model;
- `recorded`: the real server's recorded answers (tests/recorded_llama.py), busy;
- `big`: those answers with an 8 MB `/metrics` (junk series around ours);
- `surrogate`: a lone surrogate in `/props`' `model_alias`;
- `slots`: `/slots` listing 10,000 busy slots (compact entries, under the 8 MiB cap);
- `stopped`: a second real llama-server, SIGSTOPped (accepts connections, never answers).

`gpu-fleet-exporter` serves it and is scraped every second, with Prometheus' timeout header.
Printed: each scrape's time and whether every healthy device and server was read in it; then
scrape duration p50/p99/max, scrapes answered 200, scrapes in which every healthy device and
server was read, the series dropped by budget, RSS and threads first/last, against the
targets: every scrape 200 within the servers' timeout + 0.5 s, every healthy device and
server read in every scrape, RSS <= 80 MiB and flat after the warm-up, threads flat.

Healthy means: both NVIDIA GPUs and the three free AMD cards `gpufleet_gpu_up 1`, k10temp's
`Tctl` read, `healthy` and `recorded` up with `/metrics` ok.

    python bench/exporter_hostile.py [--scrapes 100] [--timeout 2]

Exits non-zero when a scrape was not answered 200 or a healthy device or server was not read
in one; durations, RSS and threads are printed, not enforced (these machines are noisy).
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack, suppress
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

# The repository root is on the path only now: the lab comes from the tests.
from tests.llama_lab import LlamaServer, free_port, write_tiny_model  # noqa: E402
from tests.recorded_llama import FIXTURES, JSON, TEXT, RecordedLlama  # noqa: E402
from tests.reliability.soak import llama_binary, sample, six_servers_roster  # noqa: E402
from tests.sysfs_tree import (  # noqa: E402
    fleet_specs,
    nvme_spec,
    write_amd_card,
    write_hwmon_chip,
    write_k10temp,
)

SCENARIO = ROOT / "examples" / "nvml-fake" / "two-h200.yaml"
MARGIN_SECONDS = 0.5  # the target: every scrape within the servers' timeout + this
RSS_TARGET_MIB = 80
WARMUP_SCRAPES = 10
HEALTHY_SERVERS = ("healthy", "recorded")
SMALL = ("-c", "512", "-np", "1", "-t", "1", "--metrics")
GPUS = "{nvidia: {count: 2}, amd: {count: 4}}"


def hostile_bodies() -> dict[str, dict[str, tuple[bytes, str]]]:
    """The recorded answers, changed as each hostile server sends them."""
    busy_metrics = (FIXTURES / "metrics-busy.txt").read_bytes()
    line = b'junk_series{a="%d",b="some label value of a plugin"} 12345\n'
    junk = b"".join(line % i for i in range(8_000_000 // len(line % 0)))
    props = json.loads((FIXTURES / "props.json").read_text())
    props["model_alias"] = "\ud800"  # json.dumps escapes it; the reader's decoder makes it
    slot = {
        "id": 0, "n_ctx": 512, "is_processing": True, "id_task": 1,
        "params": {"n_predict": -1}, "next_token": [{"n_decoded": 5}],
    }  # fmt: skip
    slots = [{**slot, "id": i, "id_task": 1000 + i} for i in range(10_000)]
    return {
        "recorded": {},
        "big": {"/metrics": (junk + busy_metrics, TEXT)},
        "surrogate": {"/props": (json.dumps(props).encode(), JSON)},
        "slots": {"/slots": (json.dumps(slots).encode(), JSON)},
    }


def write_tree(root: Path) -> tuple[Path, Path]:
    """Four AMD cards (card 0 stuck), k10temp, and an nvme chip that blocks; the two FIFOs."""
    cards = [write_amd_card(root, spec) for spec in fleet_specs([0, 1, 2, 3])]
    write_k10temp(root)
    nvme = write_hwmon_chip(root, nvme_spec(0, "0000:01:00.0"))
    fifos = (cards[0].file("gpu_busy_percent"), nvme / "temp1_input")
    for fifo in fifos:
        fifo.unlink()
        os.mkfifo(fifo)
    return fifos


def scrape(port: int, timeout: float) -> tuple[float, int, str]:
    start = time.perf_counter()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        headers = {"X-Prometheus-Scrape-Timeout-Seconds": str(timeout)}
        conn.request("GET", "/metrics", headers=headers)
        response = conn.getresponse()
        body = response.read().decode("utf-8", "replace")
        return time.perf_counter() - start, response.status, body
    finally:
        conn.close()


STUCK_CARD = "0000:03:00.0"  # card0's slot (fleet_specs)
_INFO = re.compile(r"^gpufleet_gpu_info\{([^}]*)\} ", re.M)


def healthy_read(body: str) -> list[str]:
    """What a healthy device or server lacks in this scrape (empty: all read)."""
    gpus = {}
    for labels in _INFO.findall(body):
        fields = dict(re.findall(r'(\w+)="([^"]*)"', labels))
        gpus[fields["pci_bus_id"]] = fields["gpu"]
    # The stuck card's identity was never read (its first read blocked): the other five are.
    healthy = len(set(gpus) - {STUCK_CARD})
    missing = [] if healthy == 5 else [f"gpu_info of {5 - healthy} healthy GPUs"]
    for bus_id, gpu in sorted(gpus.items()):
        if bus_id != STUCK_CARD and f'gpufleet_gpu_up{{gpu="{gpu}"}} 1.0' not in body:
            missing.append(f"gpu {gpu}")
    if 'gpufleet_host_temperature_celsius{chip="k10temp",sensor="Tctl"}' not in body:
        missing.append("k10temp")
    for name in HEALTHY_SERVERS:
        if f'gpufleet_llama_up{{server="{name}"}} 1.0' not in body:
            missing.append(f"server {name} up")
        ok = f'gpufleet_llama_endpoint{{endpoint="metrics",server="{name}",state="ok"}} 1.0'
        if ok not in body:
            missing.append(f"server {name} /metrics")
    return missing


def dropped(body: str) -> float:
    total = 0.0
    for line in body.splitlines():
        if line.startswith("gpufleet_exporter_series_dropped_total{") and "over_budget" in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


def percentile(values: list[float], share: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(share * (len(ordered) - 1)))]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scrapes", type=int, default=100, help="one a second")
    parser.add_argument("--timeout", type=float, default=2.0, help="per-server timeout")
    args = parser.parse_args()
    exporter = Path(sys.executable).parent / "gpu-fleet-exporter"
    scrape_timeout = 10.0  # Prometheus' shipped scrape_timeout
    with tempfile.TemporaryDirectory(prefix="gpufleet-hostile-") as tmp, ExitStack() as stack:
        work = Path(tmp)
        sysfs = work / "sys"
        fifos = write_tree(sysfs)

        def unblock() -> None:
            for fifo in fifos:  # a writer that opens and closes: a blocked read returns EOF
                with suppress(OSError):
                    os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))

        stack.callback(unblock)
        binary, model = llama_binary(), write_tiny_model(work / "tiny.gguf")
        real = {}
        for name in ("healthy", "stopped"):
            server = LlamaServer(binary, ["-m", str(model), *SMALL], work)
            stack.callback(server.stop)
            real[name] = server.start()
        for server in real.values():
            server.wait_healthy(60)
        real["stopped"].freeze()
        urls = {"healthy": real["healthy"].url}
        for name, bodies in hostile_bodies().items():
            urls[name] = stack.enter_context(RecordedLlama(bodies, busy=True)).url
        urls["stopped"] = real["stopped"].url
        port = free_port()
        roster = six_servers_roster(work / "fleet.yaml", urls, args.timeout, gpus=GPUS)
        proc = subprocess.Popen(
            [str(exporter), "--config", str(roster),
             "--host", "bench", "--sysfs", str(sysfs), "--nvml.fake-scenario", str(SCENARIO),
             "--web.listen-address", f"127.0.0.1:{port}", "--log.level", "error"],
        )  # fmt: skip
        stack.callback(proc.wait, 10)
        stack.callback(proc.terminate)
        deadline = time.monotonic() + 30
        while True:
            try:
                scrape(port, scrape_timeout)
                break
            except OSError:
                if time.monotonic() > deadline or proc.poll() is not None:
                    sys.exit("bench: the exporter did not start")
                time.sleep(0.1)
        times: list[float] = []
        statuses: list[int] = []
        complete: list[bool] = []
        status: list[tuple[int, int]] = []
        drops = 0.0
        print("scrape  seconds  status  healthy-read  threads  rss-KiB")
        for number in range(args.scrapes):
            started = time.monotonic()
            elapsed, code, body = scrape(port, scrape_timeout)
            missing = healthy_read(body) if code == 200 else ["(no 200)"]
            times.append(elapsed)
            statuses.append(code)
            complete.append(not missing)
            seen = sample(proc.pid)
            status.append((seen.threads, seen.rss_kib))
            drops = dropped(body) if code == 200 else drops
            print(f"{number:6d}  {elapsed:7.3f}  {code:6d}  "
                  f"{'all' if not missing else 'MISSING ' + ', '.join(missing):12s}  "
                  f"{status[-1][0]:7d}  {status[-1][1]:7d}")  # fmt: skip
            time.sleep(max(0.0, 1.0 - (time.monotonic() - started)))

    target = args.timeout + MARGIN_SECONDS
    ok = sum(code == 200 for code in statuses)
    print("host: fake NVML H200 pair, 4 amdgpu cards (card0 stuck), k10temp, nvme (blocking);"
          f" servers: {', '.join(urls)}; server timeout {args.timeout} s")  # fmt: skip
    print(f"scrape seconds: p50 {statistics.median(times):.3f}, p99 {percentile(times, 0.99):.3f},"
          f" max {max(times):.3f}; target every scrape <= {target:.1f} s: "
          f"{'MET' if max(times) <= target else 'MISSED'}")  # fmt: skip
    print(f"scrapes answered 200: {ok}/{len(statuses)}")
    print(f"scrapes with every healthy device and server read: {sum(complete)}/{len(complete)}")
    print(f"series dropped by budget (cumulative, at the end): {drops:.0f}, "
          f"{drops / (len(statuses) + 1):.0f} a scrape")  # fmt: skip
    window = status[WARMUP_SCRAPES:] or status
    rss_mib = [s[1] / 1024 for s in window]
    print(f"RSS MiB first/last/max: {status[0][1] / 1024:.1f}/{status[-1][1] / 1024:.1f}/"
          f"{max(s[1] for s in status) / 1024:.1f}; target <= {RSS_TARGET_MIB} MiB: "
          f"{'MET' if max(rss_mib) <= RSS_TARGET_MIB else 'MISSED'}; after {WARMUP_SCRAPES} "
          f"scrapes of warm-up {rss_mib[0]:.1f} -> {rss_mib[-1]:.1f}")  # fmt: skip
    threads = [s[0] for s in window]
    print(f"threads first/last/max: {status[0][0]}/{status[-1][0]}/{max(s[0] for s in status)};"
          f" after warm-up {threads[0]} -> {threads[-1]}: "
          f"{'flat' if max(threads) <= threads[0] else 'GREW'}")  # fmt: skip
    if ok != len(statuses) or not all(complete):
        sys.exit("bench: a scrape was not answered 200, or a healthy device or server not read")
    return 0


if __name__ == "__main__":
    sys.exit(main())
