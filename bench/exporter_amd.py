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

`--baseline REV` adds a third exporter, ours as of a git revision (its `exporter/` package
from `git archive`), scraped in the same alternation: a change's before and after are then
measured on the same machine noise, which across separate runs moves the ratio by more than
most changes do.

    python bench/exporter_amd.py [--scrapes 300] [--baseline HEAD~1]

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


def baseline_tree(revision: str, into: Path) -> Path:
    """The `exporter` package as of `revision`, extracted under `into` (a PYTHONPATH root)."""
    into.mkdir()
    archive = subprocess.run(
        ["git", "-C", str(ROOT), "archive", revision, "exporter"], capture_output=True, check=False
    )
    if archive.returncode != 0:
        sys.exit(f"bench: git archive {revision}: {archive.stderr.decode().strip()}")
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive.stdout, check=True)
    return into


def exporter_command(tree: Path | None) -> list[str]:
    """How to start our exporter: the installed one, or the package under `tree`."""
    if tree is None:
        return [str(Path(sys.executable).parent / "gpu-fleet-exporter")]
    return [sys.executable, "-c", "import sys; from exporter.cli import main; sys.exit(main())"]


def measure(
    cards: list[int], scrapes: int, node_exporter: str, baseline: Path | None = None
) -> tuple[Result, Result | None]:
    """Serve one tree with both exporters (and the baseline) and scrape them alternately."""
    with tempfile.TemporaryDirectory(prefix="gpufleet-bench-") as tmp:
        sysfs = Path(tmp) / "sys"
        write_amd_fleet(sysfs, cards)
        write_k10temp(sysfs)  # the host chip of an AMD box, read by both exporters
        roster = Path(tmp) / "fleet.yaml"
        write_roster(roster, len(cards))
        ours_port, node_port, base_port = free_port(), free_port(), free_port()
        env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}

        def start_ours(tree: Path | None, port: int) -> subprocess.Popen[bytes]:
            # PYTHONPATH comes before the editable install's finder, and `-c` puts the working
            # directory first on sys.path: run in the baseline's tree, not the checkout's.
            where = {"PYTHONPATH": str(tree)} if tree is not None else {}
            return subprocess.Popen(
                [*exporter_command(tree), "--config", str(roster), "--host", "bench",
                 "--sysfs", str(sysfs), "--web.listen-address", f"127.0.0.1:{port}",
                 "--log.level", "warning"],
                env={**env, **where},
                cwd=tree,
            )  # fmt: skip

        ours = start_ours(None, ours_port)
        base = start_ours(baseline, base_port) if baseline is not None else None
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
        procs = [ours, node, *([base] if base is not None else [])]
        try:
            wait_ready(ours_port, ours, "gpu-fleet-exporter")
            wait_ready(node_port, node, "node_exporter")
            if base is not None:
                wait_ready(base_port, base, "gpu-fleet-exporter (baseline)")
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
            base_body = scrape(base_port)[1] if base is not None else b""
            if base is not None and base_body.count(b"\ngpufleet_gpu_info{") != len(cards):
                sys.exit("bench: the baseline exporter did not export every card")
            for _ in range(10):  # warm them up: imports, caches, first-scrape work
                scrape(ours_port)
                scrape(node_port)
                if base is not None:
                    scrape(base_port)
            ours_times, node_times, base_times = [], [], []
            for _ in range(scrapes):  # alternate, so all see the same machine noise
                ours_times.append(scrape(ours_port)[0])
                node_times.append(scrape(node_port)[0])
                if base is not None:
                    base_times.append(scrape(base_port)[0])
            ours_rss, node_rss = rss_bytes(ours.pid), rss_bytes(node.pid)
            base_rss = rss_bytes(base.pid) if base is not None else 0
        finally:
            for proc in procs:
                proc.terminate()
            for proc in procs:
                proc.wait(timeout=10)
    node_median = statistics.median(node_times)
    result = Result(
        statistics.median(ours_times),
        node_median,
        ours_cards,
        node_cards,
        len(ours_body),
        len(node_body),
        ours_rss,
        node_rss,
    )
    if base is None:
        return result, None
    return result, Result(
        statistics.median(base_times),
        node_median,
        len(cards),
        node_cards,
        len(base_body),
        len(node_body),
        base_rss,
        node_rss,
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scrapes", type=int, default=300, help="scrapes of each exporter")
    parser.add_argument(
        "--baseline", metavar="REV", help="also scrape our exporter as of this git revision"
    )
    args = parser.parse_args()
    node_exporter = find_node_exporter()
    print(f"scrapes: {args.scrapes} of each exporter per tree, alternating")
    with tempfile.TemporaryDirectory(prefix="gpufleet-baseline-") as tmp:
        baseline = baseline_tree(args.baseline, Path(tmp) / "tree") if args.baseline else None
        for name, cards in TREES.items():
            result, before = measure(cards, args.scrapes, node_exporter, baseline)
            report(name, cards, result, before, args.baseline)
    return 0


def report(
    name: str, cards: list[int], result: Result, before: Result | None, revision: str | None
) -> None:
    """Print one tree's figures (and the baseline's, measured in the same alternation)."""
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
    if before is not None:
        print(
            f"  baseline {revision}: median {before.ours_median * 1000:.2f} ms, ratio "
            f"{before.ratio:.2f}, RSS {before.ours_rss / 2**20:.1f} MiB (same run; now "
            f"{result.ratio:.2f})"
        )


if __name__ == "__main__":
    sys.exit(main())
