"""The exporter's HTTP endpoint, served on port 0 over a fixture tree."""

from __future__ import annotations

import contextlib
import gzip
import io
import os
import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, Gauge

from exporter.http import MetricsServer, accepts_gzip
from exporter.registry import ExporterSettings, build_registry
from fleet.http_front import parse_listen_address
from fleet.roster import Host
from tests.sysfs_tree import write_amd_fleet


@pytest.fixture
def server(tmp_path: Path) -> Iterator[MetricsServer]:
    sysfs = tmp_path / "sys"
    write_amd_fleet(sysfs, [0, 10])
    host = Host.model_validate({"address": "127.0.0.1", "gpus": {"amd": {"count": 2}}})
    registry, fleet = build_registry(ExporterSettings(host=host, sysfs=str(sysfs)))
    srv = MetricsServer(registry, "127.0.0.1", 0)
    srv.start()
    yield srv
    srv.stop()
    fleet.close()


def get(url: str, headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], bytes]:
    request = urllib.request.Request(url, headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, dict(response.headers), response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), exc.read()


def test_metrics_landing_and_404(server: MetricsServer) -> None:
    assert server.port > 0
    base = f"http://127.0.0.1:{server.port}"
    status, headers, body = get(f"{base}/metrics")
    assert status == 200
    assert headers["Content-Type"].startswith("text/plain; version=0.0.4")
    assert body.count(b"\ngpufleet_gpu_info{") == 2
    status, headers, body = get(f"{base}/")
    assert status == 200 and b'href="/metrics"' in body
    status, _, body = get(f"{base}/nope")
    assert status == 404 and b"/metrics" in body


def test_gzip_when_asked(server: MetricsServer) -> None:
    status, headers, body = get(
        f"http://127.0.0.1:{server.port}/metrics", {"Accept-Encoding": "gzip"}
    )
    assert status == 200 and headers.get("Content-Encoding") == "gzip"
    assert b"gpufleet_gpu_up" in gzip.decompress(body)


@pytest.mark.parametrize(
    ("header", "gzipped"),
    [
        ("gzip;q=0", False),
        ("gzip; q=0.000", False),
        ("identity, gzip;q=0", False),
        ("*;q=0", False),
        ("*", True),
        ("br, *;q=0.1", True),
        ("gzip;q=0, *", False),  # named beats the wildcard
        ("GZIP;Q=0.5", True),
        ("gzip;q=nope", False),
        ("deflate", False),
        ("", False),
    ],
)
def test_gzip_heeds_q_values(server: MetricsServer, header: str, gzipped: bool) -> None:
    assert accepts_gzip(header) is gzipped
    status, headers, body = get(
        f"http://127.0.0.1:{server.port}/metrics", {"Accept-Encoding": header}
    )
    assert status == 200 and headers["Vary"] == "Accept-Encoding"
    assert (headers.get("Content-Encoding") == "gzip") is gzipped
    assert b"gpufleet_gpu_up" in (gzip.decompress(body) if gzipped else body)


def test_head_gets_the_headers_and_no_body(server: MetricsServer) -> None:
    url = f"http://127.0.0.1:{server.port}/metrics"
    _, got, body = get(url)
    request = urllib.request.Request(url, method="HEAD")
    with urllib.request.urlopen(request, timeout=10) as response:
        assert response.status == 200
        assert response.read() == b""
        assert response.headers["Content-Type"] == got["Content-Type"]
        # The length GET would get (the values move between scrapes, the length barely).
        assert abs(int(response.headers["Content-Length"]) - len(body)) < 64


def test_a_changed_fixture_value_shows_on_the_next_scrape(
    server: MetricsServer, tmp_path: Path
) -> None:
    url = f"http://127.0.0.1:{server.port}/metrics"
    busy = tmp_path / "sys" / "class" / "drm" / "card10" / "device" / "gpu_busy_percent"
    busy.write_text("73\n")
    assert b'gpufleet_gpu_utilization_ratio{gpu="1"} 0.73' in get(url)[2]
    busy.write_text("5\n")
    assert b'gpufleet_gpu_utilization_ratio{gpu="1"} 0.05' in get(url)[2]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (":9445", ("0.0.0.0", 9445)),
        ("127.0.0.1:0", ("127.0.0.1", 0)),
        ("[::1]:9445", ("::1", 9445)),
        ("localhost:80", ("localhost", 80)),
    ],
)
def test_listen_addresses(text: str, expected: tuple[str, int]) -> None:
    assert parse_listen_address(text) == expected


@pytest.mark.parametrize("text", ["9445", "host:port", ":70000"])
def test_bad_listen_addresses(text: str) -> None:
    with pytest.raises(ValueError, match=text.split(":", maxsplit=1)[0] or ":"):
        parse_listen_address(text)


# --- the bounded front: idle and slow clients cost no thread and are cut --------------------


def bounded_server(**bounds: Any) -> MetricsServer:
    """A small registry behind the front with test-sized bounds."""
    registry = CollectorRegistry(auto_describe=False)
    Gauge("gpufleet_test_up", "A series to scrape.", registry=registry).set(1)
    srv = MetricsServer(registry, "127.0.0.1", 0, **bounds)
    srv.start()
    return srv


def closed_by_server(sock: socket.socket, within: float) -> bool:
    """Whether the server closes `sock` (EOF or reset) within `within` seconds."""
    sock.settimeout(within)
    try:
        while True:
            if not sock.recv(65536):
                return True
    except (ConnectionResetError, BrokenPipeError):
        return True
    except TimeoutError:
        return False


def thread_count() -> int:
    """The threads of this process, as the kernel counts them (Python's and any other)."""
    return len(os.listdir("/proc/self/task"))


def test_idle_connections_cost_no_thread_and_are_closed_after_the_timeout() -> None:
    srv = bounded_server(read_timeout_seconds=2.0)
    idle: list[socket.socket] = []
    try:
        url = f"http://127.0.0.1:{srv.port}/metrics"
        assert get(url)[0] == 200  # the front and one worker are running
        before = thread_count()
        for _ in range(300):
            idle.append(socket.create_connection(("127.0.0.1", srv.port), timeout=5))
        time.sleep(0.3)  # the front has accepted them all
        assert thread_count() <= before + 1, "idle connections hold threads"
        # Scrapes are answered while the 300 are open, by the worker already there.
        for _ in range(3):
            status, _, body = get(url)
            assert status == 200 and b"gpufleet_test_up 1.0" in body
        assert thread_count() <= before + 1
        started = time.monotonic()
        assert all(closed_by_server(sock, within=6) for sock in idle)
        assert time.monotonic() - started < 6  # at the 2 s deadline, not one by one
        assert thread_count() <= before + 1
    finally:
        for sock in idle:
            sock.close()
        srv.stop()


def test_a_slow_header_client_is_cut_at_its_deadline() -> None:
    srv = bounded_server(read_timeout_seconds=1.5)
    try:
        sock = socket.create_connection(("127.0.0.1", srv.port), timeout=5)
        started = time.monotonic()
        sock.sendall(b"GET /metrics HTTP/1.1\r\n")
        cut = False
        # One header byte every 0.2 s: each read would succeed well within a per-read
        # timeout; only a deadline for the whole head ends it.
        for byte in b"X-Slow: " + b"a" * 60:
            try:
                sock.sendall(bytes([byte]))
            except (BrokenPipeError, ConnectionResetError):
                cut = True
                break
            time.sleep(0.2)
            if time.monotonic() - started > 2.5 and closed_by_server(sock, within=0.01):
                cut = True
                break
        elapsed = time.monotonic() - started
        assert cut or closed_by_server(sock, within=0.5), "the slow client was never cut"
        assert 1.4 < elapsed < 5, elapsed
        sock.close()
        assert get(f"http://127.0.0.1:{srv.port}/metrics")[0] == 200
    finally:
        srv.stop()


def test_a_full_front_drops_the_longest_waiting_connection_for_a_scrape() -> None:
    srv = bounded_server(read_timeout_seconds=30.0, max_connections=20)
    idle: list[socket.socket] = []
    try:
        for _ in range(20):
            idle.append(socket.create_connection(("127.0.0.1", srv.port), timeout=5))
        time.sleep(0.3)
        # The cap is reached: a scrape makes room by closing the oldest idle connection, and
        # again after another idle one has filled the front up.
        for oldest in range(3):
            assert get(f"http://127.0.0.1:{srv.port}/metrics")[0] == 200
            assert closed_by_server(idle[oldest], within=0.5)
            assert not closed_by_server(idle[oldest + 1], within=0.05)
            idle.append(socket.create_connection(("127.0.0.1", srv.port), timeout=5))
            time.sleep(0.2)
        assert not any(closed_by_server(sock, within=0.01) for sock in idle[3:])
    finally:
        for sock in idle:
            sock.close()
        srv.stop()


def test_an_oversized_or_garbled_head_is_refused() -> None:
    srv = bounded_server(read_timeout_seconds=1.5)
    try:
        # A head over the limit is not kept in memory: the connection is closed.
        sock = socket.create_connection(("127.0.0.1", srv.port), timeout=5)
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            sock.sendall(b"GET /metrics HTTP/1.1\r\nX-Big: " + b"a" * (80 * 1024))
        assert closed_by_server(sock, within=1.0)
        sock.close()
        # A garbled request line gets wsgiref's 400 page (HTTP/0.9 style: no status line).
        sock = socket.create_connection(("127.0.0.1", srv.port), timeout=5)
        sock.sendall(b"NOT HTTP\r\n\r\n")
        answer = sock.recv(65536)
        assert b"Error code: 400" in answer and b"gpufleet_" not in answer, answer
        sock.close()
    finally:
        srv.stop()


def test_a_body_trickling_in_is_cut_at_the_same_deadline() -> None:
    # What a worker reads after the head (a body, for an app that reads one) shares the
    # connection's deadline: a byte every 0.1 s does not keep the read alive past it.
    from fleet.http_front import _DeadlineReader

    ours, peer = socket.socketpair()
    stop = threading.Event()

    def trickle() -> None:
        while not stop.wait(0.1):
            with contextlib.suppress(OSError):
                peer.send(b"x")

    sender = threading.Thread(target=trickle)
    sender.start()
    try:
        reader = io.BufferedReader(_DeadlineReader(ours, b"HEAD", time.monotonic() + 0.6))
        assert reader.read(4) == b"HEAD"
        started = time.monotonic()
        with pytest.raises(TimeoutError):
            while time.monotonic() - started < 3:  # per-read timeouts alone would never end it
                reader.read1(1)
        assert 0.3 < time.monotonic() - started < 1.5
    finally:
        stop.set()
        sender.join()
        ours.close()
        peer.close()


def test_an_answer_leaves_in_one_write(server: MetricsServer) -> None:
    # wsgiref writes the status line, two headers, the rest of the headers and the body one
    # by one; the worker buffers them so the scraper gets one write, not five. A seqpacket
    # pair keeps each sendall a message of its own, so the writes can be counted.
    from fleet.http_front import _Handler, _Pending

    ours, peer = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    request = b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n"
    pending = _Pending(ours, ("127.0.0.1", 40000), time.monotonic() + 5, "head")
    pending.head += request
    try:
        _Handler(pending, server._front._server)
        ours.shutdown(socket.SHUT_WR)
        messages = []
        while message := peer.recv(1 << 20):
            messages.append(message)
    finally:
        ours.close()
        peer.close()
    assert len(messages) == 1, [m[:40] for m in messages]
    head, _, body = messages[0].partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.0 200 OK") or head.startswith(b"HTTP/1.1 200 OK"), head
    assert b"\ngpufleet_gpu_info{" in body
