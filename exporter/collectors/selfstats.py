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

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.metrics_core import Metric

from exporter import __version__


@dataclass(frozen=True)
class CollectorOutcome:
    """How one collector did in one scrape."""

    name: str
    success: bool
    duration_seconds: float


def self_metrics(outcomes: Sequence[CollectorOutcome]) -> Iterator[Metric]:
    """The exporter's own families for one scrape."""
    success = GaugeMetricFamily(
        "gpufleet_exporter_collector_success",
        "1 when the collector read its whole source in this scrape, 0 when part of it failed.",
        labels=["collector"],
    )
    duration = GaugeMetricFamily(
        "gpufleet_exporter_collector_duration_seconds",
        "Time the collector took in this scrape.",
        labels=["collector"],
    )
    for outcome in outcomes:
        success.add_metric([outcome.name], 1.0 if outcome.success else 0.0)
        duration.add_metric([outcome.name], outcome.duration_seconds)
    yield success
    yield duration
    build = GaugeMetricFamily(
        "gpufleet_exporter_build_info",
        "The exporter's version and the Python running it.",
        labels=["version", "python_version"],
    )
    build.add_metric([__version__, platform.python_version()], 1.0)
    yield build
