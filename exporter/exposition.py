"""The text exposition format (0.0.4), written fast for the families our collectors make.

`prometheus_client.generate_latest` handles every metric type and spends about 4 µs per sample
doing it; an 8-card host has a few hundred samples per scrape, and the benchmark holds us to
0.8 times node_exporter's scrape time. Our collectors make only gauges and counters, so this writer
handles those two directly (same bytes as `generate_latest`, a test checks that) and hands any
other family type to prometheus_client unchanged.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import cast

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.utils import floatToGoString

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_FAST_TYPES = frozenset({"gauge", "counter"})

# prometheus_client's own float formatting (Go's style: +Inf, NaN, exponents), untyped upstream.
_go_float = cast(Callable[[float], str], floatToGoString)


def _escape_label(value: str) -> str:
    # Most label values (indices, uuids, names) need no escaping; checking is cheaper than
    # three unconditional replaces.
    if "\\" in value or '"' in value or "\n" in value:
        return value.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")
    return value


class TextWriter:
    """Writes scrapes in the text format, remembering each series' formatted `name{labels} `.

    A host's series are nearly the same every scrape, and formatting their labels is most of
    the writer's work; the values are formatted fresh each time. Bounded: a label set that
    churns (it should not) empties the memory instead of growing it. Safe to share between
    threads: a race costs at most a head formatted twice.
    """

    HEAD_LIMIT = 20_000

    def __init__(self) -> None:
        self._heads: dict[tuple[str, tuple[tuple[str, str], ...]], str] = {}

    def _head(self, name: str, labels: dict[str, str]) -> str:
        # Labels sorted, as prometheus_client writes them.
        key = (name, tuple(sorted(labels.items())))
        head = self._heads.get(key)
        if head is None:
            if len(self._heads) >= self.HEAD_LIMIT:
                self._heads.clear()
            if labels:
                text = ",".join(f'{k}="{_escape_label(v)}"' for k, v in key[1])
                head = f"{name}{{{text}}} "
            else:
                head = name + " "
            self._heads[key] = head
        return head

    def _family(self, family: Metric, out: list[str]) -> None:
        name = family.name + "_total" if family.type == "counter" else family.name
        doc = family.documentation.replace("\\", r"\\").replace("\n", r"\n")
        out.append(f"# HELP {name} {doc}\n# TYPE {name} {family.type}\n")
        head_of = self._head
        for sample in family.samples:
            head = head_of(sample.name, sample.labels)
            value = _go_float(sample.value)
            if sample.timestamp is not None:
                out.append(f"{head}{value} {int(float(sample.timestamp) * 1000)}\n")
            else:
                out.append(f"{head}{value}\n")

    def render(self, families: Iterable[Metric]) -> bytes:
        """One scrape's families, byte for byte as `generate_latest` writes them."""
        collected = list(families)
        if any(f.type not in _FAST_TYPES for f in collected):
            registry = CollectorRegistry(auto_describe=False)
            registry.register(_Families(collected))
            return generate_latest(registry)
        out: list[str] = []
        for family in collected:
            self._family(family, out)
        return "".join(out).encode()

    def render_registry(self, registry: CollectorRegistry) -> bytes:
        """A whole registry in the text format."""
        return self.render(registry.collect())


class _Families:
    """Adapts already-collected families to prometheus_client's collector protocol."""

    def __init__(self, families: list[Metric]) -> None:
        self._families = families

    def collect(self) -> Iterable[Metric]:
        return self._families
