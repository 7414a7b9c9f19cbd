"""The exporter's own series: per-collector success and duration, and build info.

Sample output:

    gpufleet_exporter_collector_success{collector="amd"} 1.0
    gpufleet_exporter_collector_duration_seconds{collector="amd"} 0.00061
    gpufleet_exporter_series_dropped_total{collector="llama",server="",reason="unrenderable"} 0.0
    gpufleet_exporter_build_info{version="0.1.0",python_version="3.11.7",nvml="nvidia-ml-py"} 1.0

Check by hand: `gpu-fleet-exporter --once | grep gpufleet_exporter_`.
"""

from __future__ import annotations

import platform
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

from prometheus_client.metrics_core import Metric

from exporter import __version__
from exporter.collectors import catalogue

REAL_NVML = "nvidia-ml-py"
FAKE_NVML = "fake"


@dataclass(frozen=True)
class CollectorOutcome:
    """How one collector did in one scrape."""

    name: str
    success: bool
    duration_seconds: float


def self_metrics(
    outcomes: Sequence[CollectorOutcome],
    dropped: Mapping[tuple[str, str, str], int],
    nvml: str = REAL_NVML,
) -> Iterator[Metric]:
    """The exporter's own families for one scrape; `dropped` by (collector, server, reason)."""
    success = catalogue.gauge("gpufleet_exporter_collector_success")
    duration = catalogue.gauge("gpufleet_exporter_collector_duration_seconds")
    for outcome in outcomes:
        success.add_metric([outcome.name], 1.0 if outcome.success else 0.0)
        duration.add_metric([outcome.name], outcome.duration_seconds)
    yield success
    yield duration
    series_dropped = catalogue.counter("gpufleet_exporter_series_dropped_total")
    for (collector, server, reason), count in sorted(dropped.items()):
        series_dropped.add_metric([collector, server, reason], float(count))
    yield series_dropped
    build = catalogue.gauge("gpufleet_exporter_build_info")
    build.add_metric([__version__, platform.python_version(), nvml], 1.0)
    yield build
