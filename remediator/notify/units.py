"""A series' unit from its name: the one place that maps a unit suffix to what a chart shows.

Prometheus names carry their base unit as a suffix (Prometheus docs, "Metric and label
naming": `_seconds`, `_bytes`, `_celsius`, `_ratio` ...); a chart shows the unit a person reads
instead: GiB rather than bytes, % rather than a 0-1 ratio. `Unit.scale` turns a base value
into the shown one (`value * scale`), the same for the series and the alert's threshold.

Recording rules are named `level:metric:operations` (Prometheus docs, "Recording rules"):
the unit is the metric part's, unless the operations end in `ratio` (the result of a division,
e.g. `server_model:gpufleet_tokens_per_second:ratio`, current against baseline).

`unit_of_query` looks at every metric name in a PromQL expression (strings, label matchers and
ranges taken out first): one unit among them is the query's, two or a division make it plain
numbers (`a_bytes / b_bytes` is not bytes). `_total` counters are named by what they count,
not by what a query does to them (`rate(x_seconds_total[5m])` is not seconds), so they give
no unit.

Check by hand:
`python -c "from remediator.notify.units import unit_of; print(unit_of('x_bytes'))"`.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class Unit:
    """How a base-unit value is shown: `value * scale`, then `symbol` (e.g. GiB, °C)."""

    symbol: str
    scale: float = 1.0
    name: str = ""

    def shown(self, value: float) -> float:
        """The value in the unit shown."""
        return value * self.scale

    def format(self, value: float, *, digits: int = 3) -> str:
        """`84.5 °C`, `71.2 GiB`, `98 %` — a base value, scaled, with its symbol."""
        number = f"{self.shown(value):.{digits}g}"
        return f"{number} {self.symbol}" if self.symbol else number


PLAIN = Unit("", 1.0, "value")
"""What a series without a known unit is shown in: its value as it is."""

# Suffix (longest first wins) → the unit a reader wants. Bytes are shown in GiB: VRAM and host
# memory are sized in GiB (an 80 GB card is 79.6 GiB); nothing we chart is small enough for MiB.
SUFFIXES: dict[str, Unit] = {
    "_tokens_per_second": Unit("tok/s", 1.0, "tokens per second"),
    "_celsius": Unit("°C", 1.0, "temperature"),
    "_watts": Unit("W", 1.0, "power"),
    "_bytes": Unit("GiB", 1.0 / 2**30, "memory"),
    "_ratio": Unit("%", 100.0, "ratio"),
    "_seconds": Unit("s", 1.0, "time"),
    "_hertz": Unit("MHz", 1e-6, "clock"),
    "_joules": Unit("kJ", 1e-3, "energy"),
    "_tokens": Unit("tokens", 1.0, "tokens"),
}
_BY_LENGTH = sorted(SUFFIXES, key=len, reverse=True)

_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`')
_MATCHERS = re.compile(r"\{[^{}]*\}")
_RANGE = re.compile(r"\[[^\[\]]*\]")
_GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^()]*\)")
_NAME = re.compile(r"[A-Za-z_:][A-Za-z0-9_:]*")


def unit_of(name: str) -> Unit | None:
    """The unit of a series name (`gpufleet_gpu_power_watts` → W), or None when it has none."""
    metric = name
    if name.count(":") >= 2:  # level:metric:operations
        _, metric, operations = name.split(":", 2)
        if operations.split(":")[-1].endswith("ratio"):
            return SUFFIXES["_ratio"]
    if metric.endswith("_total"):
        return None
    for suffix in _BY_LENGTH:
        if metric.endswith(suffix):
            return SUFFIXES[suffix]
    return None


def metric_names(query: str) -> list[str]:
    """The series names a PromQL expression reads, in order (functions and keywords left out)."""
    text = _STRING.sub(" ", query)
    text = _MATCHERS.sub(" ", text)
    text = _RANGE.sub(" ", text)
    text = _GROUPING.sub(" ", text)
    names = []
    for found in _NAME.finditer(text):
        after = text[found.end() :].lstrip()
        if after.startswith("("):  # a function call or an aggregation
            continue
        word = found.group(0)
        # Series names are snake_case with an underscore or a colon; PromQL's own words
        # (and, or, unless, bool, offset, sum ...) and durations have neither.
        if ("_" in word or ":" in word) and not re.fullmatch(r"[0-9]+[a-z]+", word):
            names.append(word)
    return names


def unit_of_query(query: str, series_names: Iterable[str] = ()) -> Unit:
    """The unit of what `query` returns: of its series' names, else of the names it reads.

    `series_names` are the `__name__` labels in the result (kept when the query selects series
    as they are); without them the expression's own names decide. Anything unclear is `PLAIN`.
    """
    names = [name for name in series_names if name]
    if not names:
        if re.search(r"(?<![/*])/(?![/*])", _STRING.sub(" ", query)):
            return PLAIN  # a division: the quotient's unit is not its operands'
        names = metric_names(query)
    units = {unit_of(name) for name in names}
    if len(units) == 1:
        (unit,) = units
        return unit or PLAIN
    return PLAIN
