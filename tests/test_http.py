"""The exporter's HTTP endpoint, served on port 0 over a fixture tree."""

from __future__ import annotations

import gzip
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from exporter.http import MetricsServer, parse_listen_address
from exporter.registry import ExporterSettings, build_registry
from exporter.roster import Host
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
