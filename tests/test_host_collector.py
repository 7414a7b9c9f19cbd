"""The host collector against this machine (psutil values vary, so no golden file)."""

from __future__ import annotations

import time

import psutil
from prometheus_client import CollectorRegistry

from exporter.collectors.base import SourceCollector
from exporter.collectors.host import HostCollector

NAMES = [
    "gpufleet_host_cpu_utilization_ratio",
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
    assert 0 <= values["gpufleet_host_cpu_utilization_ratio"] <= 1
    assert values["gpufleet_host_cpus"] == psutil.cpu_count(logical=True)
    total = values["gpufleet_host_memory_total_bytes"]
    assert total == psutil.virtual_memory().total
    assert 0 < values["gpufleet_host_memory_available_bytes"] <= total
    assert 0 < values["gpufleet_host_memory_used_bytes"] <= total
    assert 0 <= values["gpufleet_host_swap_used_bytes"] <= values["gpufleet_host_swap_total_bytes"]
    assert all(values[f"gpufleet_host_load{m}"] >= 0 for m in (1, 5, 15))
    collector.close()


def test_cpu_utilization_is_measured_from_the_constructor() -> None:
    collector = HostCollector()
    start = time.process_time()
    while time.process_time() - start < 0.2:  # CPU time between the priming call and the scrape
        pass
    families = {f.name: f for f in collector.collect()}
    ratio = families["gpufleet_host_cpu_utilization_ratio"].samples[0].value
    # Unprimed, psutil would answer exactly 0.0 for the first interval.
    assert 0 < ratio <= 1
