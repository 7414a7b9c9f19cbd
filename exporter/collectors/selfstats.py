"""The exporter's own series: per-collector success and duration, and build info.

Sample output:

    gpufleet_exporter_collector_success{collector="amd"} 1.0
    gpufleet_exporter_collector_duration_seconds{collector="amd"} 0.00061
    gpufleet_exporter_build_info{version="0.1.0",python_version="3.11.7"} 1.0

Check by hand: `gpu-fleet-exporter --once | grep gpufleet_exporter_`.
"""

from __future__ import annotations

import platform
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from prometheus_client.metrics_core import Metric

from exporter import __version__
from exporter.collectors import catalogue


@dataclass(frozen=True)
class CollectorOutcome:
    """How one collector did in one scrape."""

    name: str
    success: bool
    duration_seconds: float


def self_metrics(outcomes: Sequence[CollectorOutcome]) -> Iterator[Metric]:
    """The exporter's own families for one scrape."""
    success = catalogue.gauge("gpufleet_exporter_collector_success")
    duration = catalogue.gauge("gpufleet_exporter_collector_duration_seconds")
    for outcome in outcomes:
        success.add_metric([outcome.name], 1.0 if outcome.success else 0.0)
        duration.add_metric([outcome.name], outcome.duration_seconds)
    yield success
    yield duration
    build = catalogue.gauge("gpufleet_exporter_build_info")
    build.add_metric([__version__, platform.python_version()], 1.0)
    yield build
