"""One scrape of a single collector, as the exporter's supervisor does it.

Keeps what the collector yielded before a `CollectorError`, and puts it in a registry so tests
can ask `get_sample_value` without collecting again.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.metrics_core import Metric

from exporter.collectors.base import CollectorError, SourceCollector


class Families:
    """Already-collected families, so a registry can answer `get_sample_value`."""

    def __init__(self, families: list[Metric]) -> None:
        self.families = families

    def collect(self) -> Iterator[Metric]:
        return iter(self.families)


def scrape(collector: SourceCollector) -> tuple[CollectorRegistry, CollectorError | None]:
    """One scrape: the registry of what was yielded, and the error it ended with (if any)."""
    families: list[Metric] = []
    error = None
    try:
        for family in collector.collect():
            families.append(family)
    except CollectorError as err:
        error = err
    registry = CollectorRegistry(auto_describe=False)
    registry.register(Families(families))
    return registry, error
