"""The host collector against this machine (psutil values vary, so no golden file)."""

from __future__ import annotations

import time

import psutil
import pytest
from prometheus_client import CollectorRegistry, generate_latest

from exporter.collectors.base import SourceCollector
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
