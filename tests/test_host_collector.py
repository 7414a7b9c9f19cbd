"""The host collector against a procfs fixture tree, and against this machine (with psutil)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import psutil
import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric

from exporter.collectors.base import CollectorError, SourceCollector
from exporter.collectors.host import CPU_MODES, HostCollector

NAMES = [
    "gpufleet_host_load1",
    "gpufleet_host_load5",
    "gpufleet_host_load15",
    "gpufleet_host_memory_total_bytes",
    "gpufleet_host_memory_available_bytes",
    "gpufleet_host_memory_used_bytes",
    "gpufleet_host_swap_total_bytes",
    "gpufleet_host_swap_used_bytes",
    "gpufleet_host_cpus",
]


def test_every_series_present_and_sane() -> None:
    collector = HostCollector()
    assert isinstance(collector, SourceCollector)
    assert collector.name == "host"
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    values: dict[str, float] = {}
    for name in NAMES:
        value = registry.get_sample_value(name)
        assert value is not None, name
        values[name] = value
    assert values["gpufleet_host_cpus"] == psutil.cpu_count(logical=True)
    total = values["gpufleet_host_memory_total_bytes"]
    assert total == psutil.virtual_memory().total
    assert 0 < values["gpufleet_host_memory_available_bytes"] <= total
    assert 0 < values["gpufleet_host_memory_used_bytes"] <= total
    assert 0 <= values["gpufleet_host_swap_used_bytes"] <= values["gpufleet_host_swap_total_bytes"]
    assert all(values[f"gpufleet_host_load{m}"] >= 0 for m in (1, 5, 15))
    collector.close()


def cpu_seconds(collector: HostCollector) -> dict[str, float]:
    families = {f.name: f for f in collector.collect()}
    return {s.labels["mode"]: s.value for s in families["gpufleet_host_cpu_seconds"].samples}


def test_cpu_time_is_counters_not_a_ratio_since_the_last_scrape() -> None:
    """Counters: what one scraper sees does not depend on when another scraped."""
    collector = HostCollector()
    first = cpu_seconds(collector)
    assert set(first) <= set(CPU_MODES) and {"user", "system", "idle"} <= set(first)
    start = time.process_time()
    while time.process_time() - start < 0.2:  # burn CPU time between the scrapes
        pass
    second = cpu_seconds(collector)
    assert all(second[mode] >= first[mode] for mode in first)
    # This process alone spent 0.2 s of CPU time in user or system mode.
    busy = sum(second[m] - first[m] for m in ("user", "nice", "system"))
    assert busy >= 0.15
    # The modes add up to elapsed CPU time: no mode is counted twice (guest is inside user).
    total = sum(second.values())
    assert total == pytest.approx(sum(psutil.cpu_times()[:8]), rel=0.01)
    text = generate_latest(registry_with(collector)).decode()
    assert "# TYPE gpufleet_host_cpu_seconds_total counter" in text
    assert "gpufleet_host_cpu_utilization_ratio" not in text


def registry_with(collector: HostCollector) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    return registry


def test_read_under_the_procfs_root(tmp_path: Path) -> None:
    """The host's /proc mounted elsewhere (an exporter in a container): the files there count,
    not the process's own /proc. The files are in the kernel's formats (proc(5))."""
    ticks = os.sysconf("SC_CLK_TCK")
    (tmp_path / "stat").write_text(
        f"cpu  {100 * ticks} {2 * ticks} {30 * ticks} {4000 * ticks} {5 * ticks} 0 {ticks} 0 "
        f"{7 * ticks} 0\n"
        "cpu0 1 0 0 0 0 0 0 0 0 0\ncpu1 1 0 0 0 0 0 0 0 0 0\ncpu2 1 0 0 0 0 0 0 0 0 0\n"
        "intr 12345 0 0\nctxt 999\nbtime 1700000000\nprocesses 42\n"
    )
    (tmp_path / "loadavg").write_text("1.50 0.75 0.25 2/345 6789\n")
    (tmp_path / "meminfo").write_text(
        "MemTotal:       16000000 kB\nMemFree:         2000000 kB\n"
        "MemAvailable:    9000000 kB\nBuffers:          500000 kB\nCached:          5000000 kB\n"
        "SwapCached:            0 kB\nSwapTotal:       4000000 kB\nSwapFree:        3000000 kB\n"
        "SReclaimable:    1000000 kB\nHugePages_Total:       0\n"
    )
    registry = registry_with(HostCollector(procfs=str(tmp_path)))
    value = registry.get_sample_value
    assert value("gpufleet_host_cpu_seconds_total", {"mode": "user"}) == 100
    assert value("gpufleet_host_cpu_seconds_total", {"mode": "idle"}) == 4000
    assert value("gpufleet_host_cpu_seconds_total", {"mode": "softirq"}) == 1
    assert value("gpufleet_host_cpus") == 3
    assert (value("gpufleet_host_load1"), value("gpufleet_host_load15")) == (1.5, 0.25)
    assert value("gpufleet_host_memory_total_bytes") == 16_000_000 * 1024
    assert value("gpufleet_host_memory_available_bytes") == 9_000_000 * 1024
    # used = total - free - buffers - (cached + SReclaimable), as free(1) and psutil say
    assert value("gpufleet_host_memory_used_bytes") == 7_500_000 * 1024
    assert value("gpufleet_host_swap_used_bytes") == 1_000_000 * 1024
    # A file that cannot be read drops its own series only.
    (tmp_path / "loadavg").unlink()
    families: list[Metric] = []
    error = None
    collector = HostCollector(procfs=str(tmp_path))
    try:
        families.extend(collector.collect())
    except CollectorError as exc:
        error = exc
    names = {f.name for f in families}
    assert error is not None and "loadavg" in str(error)
    assert "gpufleet_host_load1" not in names and "gpufleet_host_memory_total_bytes" in names


def test_this_machine_matches_psutil() -> None:
    """On the real /proc, the same numbers psutil reads (the collector used it before)."""
    registry = registry_with(HostCollector())
    assert registry.get_sample_value("gpufleet_host_swap_total_bytes") == psutil.swap_memory().total
    assert registry.get_sample_value("gpufleet_host_memory_total_bytes") == (
        psutil.virtual_memory().total
    )
