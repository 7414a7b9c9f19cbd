"""Benchmark: our exporter against node_exporter on 8-card amdgpu sysfs trees.

Two trees, each of 8 discrete amdgpu cards plus a k10temp chip, each served by
`gpu-fleet-exporter --sysfs TREE` and by Debian's `prometheus-node-exporter` restricted to its
`drm` and `hwmon` collectors (`--path.sysfs TREE`), scraped alternately in the same run:

- `same work`: card0-card7, which node_exporter reads whole too. The ratio that counts:
  ours/node_exporter <= 0.6 (TARGET_RATIO).
- `card10+`: card0-3 and card10-13. node_exporter's drm collector globs `card[0-9]` and sees
  only 4 of them, so it does less work than we do; printed for comparison.

For each it prints both medians, the ratio and the RSS of both processes (target <= 50 MiB
for ours).

    python bench/exporter_amd.py [--scrapes 300]

Exits non-zero when node_exporter is missing or exports no `node_drm_` series, or when our
exporter does not export all 8 cards; the ratios themselves are printed, not enforced (these
machines are noisy; compare runs, not single numbers).
"""

from __future__ import annotations

import argparse
import http.client
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.llama_lab import free_port  # noqa: E402 - needs the repo root on sys.path
from tests.sysfs_tree import write_amd_fleet, write_k10temp  # noqa: E402

TREES = {
    "same work": [0, 1, 2, 3, 4, 5, 6, 7],  # node_exporter reads all 8 too
    "card10+": [0, 1, 2, 3, 10, 11, 12, 13],  # node_exporter sees card0-3 only
}
TARGET_RATIO = 0.6  # on "same work"
TARGET_RSS_MIB = 50
NODE_EXPORTER_NAMES = ("prometheus-node-exporter", "node_exporter")


def scrape(port: int) -> tuple[float, bytes]:
    start = time.perf_counter()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request("GET", "/metrics")
        response = conn.getresponse()
        body = response.read()
        if response.status != 200:
            raise RuntimeError(f"port {port}: HTTP {response.status}")
    finally:
        conn.close()
    return time.perf_counter() - start, body


def wait_ready(port: int, proc: subprocess.Popen[bytes], name: str) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{name} exited with {proc.returncode}")
        try:
            scrape(port)
            return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"{name} did not answer on port {port}")


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def find_node_exporter() -> str:
    for name in NODE_EXPORTER_NAMES:
        path = shutil.which(name)
        if path:
            return path
    sys.exit(
        "bench: node_exporter is missing (Debian package prometheus-node-exporter; "
        "`make bench` installs it)"
    )


def write_roster(path: Path, cards: int) -> None:
    path.write_text(
        f"hosts:\n  bench:\n    address: 127.0.0.1\n    gpus:\n      amd: {{count: {cards}}}\n"
    )


@dataclass(frozen=True)
class Result:
    """One tree's figures."""

    ours_median: float
    node_median: float
    ours_cards: int
    node_cards: int
    ours_bytes: int
    node_bytes: int
    ours_rss: int
    node_rss: int

    @property
    def ratio(self) -> float:
        """Ours over node_exporter's median scrape time."""
        return self.ours_median / self.node_median


def measure(cards: list[int], scrapes: int, node_exporter: str) -> Result:
    """Serve one tree with both exporters and scrape them alternately."""
    ours_bin = Path(sys.executable).parent / "gpu-fleet-exporter"
    with tempfile.TemporaryDirectory(prefix="gpufleet-bench-") as tmp:
        sysfs = Path(tmp) / "sys"
        write_amd_fleet(sysfs, cards)
        write_k10temp(sysfs)  # the host chip of an AMD box, read by both exporters
        roster = Path(tmp) / "fleet.yaml"
        write_roster(roster, len(cards))
        ours_port, node_port = free_port(), free_port()
        env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}
        ours = subprocess.Popen(
            [
                str(ours_bin),
                "--config",
                str(roster),
                "--host",
                "bench",
                "--sysfs",
                str(sysfs),
                "--web.listen-address",
                f"127.0.0.1:{ours_port}",
                "--log.level",
                "warning",
            ],
            env=env,
        )
        node = subprocess.Popen(
            [
                node_exporter,
                "--collector.disable-defaults",
                "--collector.drm",
                "--collector.hwmon",
                f"--path.sysfs={sysfs}",
                f"--web.listen-address=127.0.0.1:{node_port}",
                "--log.level=warn",
            ],
            stderr=subprocess.DEVNULL,
        )
        try:
            wait_ready(ours_port, ours, "gpu-fleet-exporter")
            wait_ready(node_port, node, "node_exporter")
            _, ours_body = scrape(ours_port)
            _, node_body = scrape(node_port)
            ours_cards = ours_body.count(b"\ngpufleet_gpu_info{")
            node_cards = len(
                {
                    line.split(b'card="')[1].split(b'"')[0]
                    for line in node_body.splitlines()
                    if line.startswith(b"node_drm_card_info{")
                }
            )
            if b"\nnode_drm_" not in node_body:
                sys.exit("bench: node_exporter's output has no node_drm_ series")
            if ours_cards != len(cards):
                sys.exit(f"bench: our exporter exported {ours_cards} cards, not {len(cards)}")
            for _ in range(10):  # warm both up: imports, caches, first-scrape work
                scrape(ours_port)
                scrape(node_port)
            ours_times, node_times = [], []
            for _ in range(scrapes):  # alternate, so both see the same machine noise
                ours_times.append(scrape(ours_port)[0])
                node_times.append(scrape(node_port)[0])
            ours_rss, node_rss = rss_bytes(ours.pid), rss_bytes(node.pid)
        finally:
            for proc in (ours, node):
                proc.terminate()
            for proc in (ours, node):
                proc.wait(timeout=10)
    return Result(
        statistics.median(ours_times),
        statistics.median(node_times),
        ours_cards,
        node_cards,
        len(ours_body),
        len(node_body),
        ours_rss,
        node_rss,
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scrapes", type=int, default=300, help="scrapes of each exporter")
    args = parser.parse_args()
    node_exporter = find_node_exporter()
    print(f"scrapes: {args.scrapes} of each exporter per tree, alternating")
    for name, cards in TREES.items():
        result = measure(cards, args.scrapes, node_exporter)
        print(f"tree {name!r}: {len(cards)} amdgpu cards (card{', card'.join(map(str, cards))})")
        print(
            f"  gpu-fleet-exporter: median {result.ours_median * 1000:.2f} ms, "
            f"{result.ours_cards} cards, {result.ours_bytes} bytes, "
            f"RSS {result.ours_rss / 2**20:.1f} MiB"
        )
        print(
            f"  node_exporter:      median {result.node_median * 1000:.2f} ms, "
            f"{result.node_cards} cards, {result.node_bytes} bytes, "
            f"RSS {result.node_rss / 2**20:.1f} MiB"
        )
        if name == "same work":
            verdict = "met" if result.ratio <= TARGET_RATIO else "MISSED"
            rss = "met" if result.ours_rss <= TARGET_RSS_MIB * 2**20 else "MISSED"
            print(
                f"  ratio ours/node_exporter: {result.ratio:.2f} "
                f"(target <= {TARGET_RATIO}: {verdict}); our RSS target <= "
                f"{TARGET_RSS_MIB} MiB: {rss}"
            )
        else:
            print(
                f"  ratio ours/node_exporter: {result.ratio:.2f} (node_exporter reads "
                f"{result.node_cards} of the {len(cards)} cards here: not the same work)"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
