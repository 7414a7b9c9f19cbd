"""Benchmark: webhook acknowledgement latency, ours against a bare waitress app.

Posts 1,000 Alertmanager notifications (50 distinct alerts x 20 duplicates, interleaved as
repeat intervals and HA pairs deliver them) one after another over a keep-alive connection to
`gpu-fleet-remediator serve` (SQLite journal, durability as configured for production: WAL,
synchronous=NORMAL) and to a waitress app that only reads the body and answers 200, in the same
run. Prints p50/p99 of each, their ratio (target <= 2) and the number of runs the remediator
journaled (must be 50: one per distinct alert).

    python bench/webhook.py [--notifications 1000] [--distinct 50]
"""

from __future__ import annotations

import argparse
import http.client
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.llama_lab import free_port  # noqa: E402 - needs the repo root on sys.path
from tests.remediator_lab import ALERTMANAGER_FIXTURES, CountingServer, write_setup  # noqa: E402

TARGET_RATIO = 2.0
BARE_APP = """
import sys, waitress
def app(environ, start_response):
    environ["wsgi.input"].read(int(environ.get("CONTENT_LENGTH") or 0))
    start_response("200 OK", [("Content-Type", "application/json"), ("Content-Length", "2")])
    return [b"{}"]
waitress.serve(app, host="127.0.0.1", port=int(sys.argv[1]), threads=8, _quiet=True)
"""


def payloads(total: int, distinct: int) -> list[bytes]:
    base = json.loads((ALERTMANAGER_FIXTURES / "firing.json").read_text())
    bodies = []
    for index in range(total):
        alert_no = index % distinct
        body = json.loads(json.dumps(base))
        alert = body["alerts"][0]
        alert["labels"]["alertname"] = "BenchAlert"  # no playbook: journaled as notify-only
        alert["labels"]["instance_no"] = str(alert_no)
        alert["fingerprint"] = f"{alert_no:016x}"
        alert["startsAt"] = "2026-11-30T03:00:00Z"
        if (index // distinct) % 2:  # every other round as the HA pair's twin would send it
            body["externalURL"] = "http://127.0.0.2:9093"
        bodies.append(json.dumps(body).encode())
    return bodies


def wait_port(port: int, proc: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            sys.exit(f"bench: server exited with {proc.returncode}")
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
            conn.request("GET", "/healthz")
            conn.getresponse().read()
            conn.close()
            return
        except OSError:
            time.sleep(0.1)
    sys.exit(f"bench: nothing answers on port {port}")


def post_all(port: int, bodies: list[bytes], token: str) -> list[float]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)  # one keep-alive connection
    headers = {"Content-Type": "application/json", "Authorization": f"Bearer {token}"}
    latencies = []
    for body in bodies:
        start = time.perf_counter()
        conn.request("POST", "/webhook/alertmanager", body=body, headers=headers)
        response = conn.getresponse()
        response.read()
        latencies.append(time.perf_counter() - start)
        if response.status != 200:
            sys.exit(f"bench: port {port} answered {response.status}")
    conn.close()
    return latencies


def percentile(values: list[float], share: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(share * len(ordered)))]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--notifications", type=int, default=1000)
    parser.add_argument("--distinct", type=int, default=50)
    args = parser.parse_args()
    bodies = payloads(args.notifications, args.distinct)
    remediator = Path(sys.executable).parent / "gpu-fleet-remediator"
    model_server = CountingServer()
    with tempfile.TemporaryDirectory(prefix="gpufleet-bench-") as tmp:
        ours_port, bare_port = free_port(), free_port()
        setup = write_setup(
            Path(tmp), servers={"alpha": model_server.url}, listen=f"127.0.0.1:{ours_port}"
        )
        ours = subprocess.Popen(
            [str(remediator), "--log.level", "warning", "serve", "--config", str(setup.config)]
        )
        bare = subprocess.Popen([sys.executable, "-c", BARE_APP, str(bare_port)])
        try:
            wait_port(ours_port, ours)
            wait_port(bare_port, bare)
            # The same warm-up for both (first requests pay for imports, caches and the
            # journal's first pages); ours sees these alerts again below as the duplicates
            # they are, so the runs counted are unchanged.
            warm = bodies[: min(20, len(bodies))]
            post_all(ours_port, warm, setup.webhook_token)
            post_all(bare_port, warm, setup.webhook_token)
            ours_times = post_all(ours_port, bodies, setup.webhook_token)
            # The webhook answers once the body is journaled; the runs are made right after,
            # in batches: wait (bounded) until the distinct alerts have theirs and every run
            # is decided, so that the remediator's work after the burst does not share the
            # CPU with the bare app's measurement.
            deadline = time.monotonic() + 20
            runs = []
            while time.monotonic() < deadline:
                conn = http.client.HTTPConnection("127.0.0.1", ours_port, timeout=30)
                conn.request("GET", "/api/runs?limit=1000",
                             headers={"Authorization": f"Bearer {setup.admin_token}"})  # fmt: skip
                runs = json.loads(conn.getresponse().read())["runs"]
                conn.close()
                if len(runs) >= args.distinct and all(r["state"] == "done" for r in runs):
                    break
                time.sleep(0.1)
            bare_times = post_all(bare_port, bodies, setup.webhook_token)
        finally:
            for proc in (ours, bare):
                proc.terminate()
            for proc in (ours, bare):
                proc.wait(timeout=15)
            model_server.close()
    ours_p50, ours_p99 = statistics.median(ours_times), percentile(ours_times, 0.99)
    bare_p50, bare_p99 = statistics.median(bare_times), percentile(bare_times, 0.99)
    print(f"notifications: {len(bodies)} ({args.distinct} distinct alerts x "
          f"{len(bodies) // args.distinct}), one keep-alive connection each")  # fmt: skip
    print(f"gpu-fleet-remediator: p50 {ours_p50 * 1000:.2f} ms, p99 {ours_p99 * 1000:.2f} ms "
          "(SQLite journal, WAL, synchronous=NORMAL)")  # fmt: skip
    print(f"bare waitress app:    p50 {bare_p50 * 1000:.2f} ms, p99 {bare_p99 * 1000:.2f} ms")
    ratio = ours_p50 / bare_p50
    verdict = "met" if ratio <= TARGET_RATIO else "MISSED"
    print(f"ratio p50 ours/bare: {ratio:.2f} (target <= {TARGET_RATIO}: {verdict}); "
          f"p99 ratio {ours_p99 / bare_p99:.2f}")  # fmt: skip
    print(f"runs journaled: {len(runs)} (must be {args.distinct})")
    if len(runs) != args.distinct:
        sys.exit(f"bench: {len(runs)} runs journaled, expected {args.distinct}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
