"""The picture of an incident: the metric that fired, its threshold, and what was done, as a PNG.

`draw(prometheus_url, spec)` asks Prometheus for `query_range` (`GET /api/v1/query_range`,
Prometheus docs "HTTP API": `{"status": "success", "data": {"resultType": "matrix",
"result": [{"metric": {...}, "values": [[ts, "1"], ...]}]}}`) over the spec's window and
draws it with matplotlib (the Agg canvas, no pyplot: no global figure state):

- the time axis in UTC (the date under it), the value axis in the series' unit
  (`remediator.notify.units`: °C, W, GiB, %, tok/s) with the unit on each tick;
- up to `MAX_SERIES` lines, the legend naming each by the labels that tell them apart (on one
  GPU's host: `gpu=0`, `gpu=1`), the labels they share in the title;
- the alert's threshold as a dashed red line named at its right end: a number (`threshold`),
  or a PromQL expression (`threshold_query`) drawn over the same window, since a threshold may
  move (a critical value per sensor, a baseline);
- the incident (`marked`: from the alert to the run's end) shaded, and each step that changed
  something (`steps`: drain, restart, power cap) as a dotted line at its start, numbered as in
  the report's table.

The report (`remediator.notify.report`) writes the spec; its keys:

    {"query": "...", "start": iso, "end": iso, "marked": [iso, iso],
     "threshold": 85.0 | "threshold_query": "...", "threshold_label": "...",
     "steps": [{"at": iso, "label": "2 drain"}]}

The window: the spec's, cut to what there is to see. It ends at the drawing's time when the
spec's end (the run's end plus five minutes) is still to come — a report is drawn as the run
ends, and the future has no samples, so the picture would end in a blank strip. It starts at
the first sample when the data begins later than the spec's start (a Prometheus, a host or a
series younger than the window), though never after the incident's start, which keeps a
margin before it. The query's step is a `POINTS`-th of the window, but never finer than
Prometheus' own `scrape_interval` (`GET /api/v1/status/config`, its `global` section; 15 s,
the usual one, when it cannot be read): a finer step repeats each sample into stairs. So an
incident of a minute in a Prometheus scraping every second — the lab — is drawn over the
minutes there are data for at one point a second, not as four points in a blank 20-minute
frame; a production incident, with data across its window, is drawn over the whole of it.

Size: `WIDTH` x `HEIGHT` = 800 x 400 px. Zulip shows an uploaded image inline as a preview
scaled into a box about 150 CSS px high on the web (30 % of the screen's height in the mobile
app), and full size on a click. At 2:1 the preview is about 300 x 150 CSS px; the text is
14-15 pt at 100 dpi (19-21 px, a twentieth of the height), so it is still 7-8 CSS px there, and
twice that on the high-density screens most phones have; the lines are 2.5 px for the same
reason. A wider picture would shrink further into the same box.

matplotlib is imported in `render` only, when a picture is drawn: it is in the `report` extra,
and nothing on a GPU host (the exporter, `gpu-fleet-node`) ever loads it. Without it, or when
anything else goes wrong (Prometheus down, an error answer, no data), `draw` returns None with
the reason logged: the report then goes out without a picture.

Check by hand: `python -c "from remediator.notify.graph import draw; ..."` with a spec, or
`pytest tests/test_notify_graph.py` and look at `tests/golden/*.png`.
"""

from __future__ import annotations

import io
import logging
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

import yaml

from remediator import prometheus_api
from remediator.notify.units import PLAIN, Unit, metric_names, unit_of_query

log = logging.getLogger(__name__)

WIDTH, HEIGHT = 800, 400
DPI = 100
MAX_SERIES = 6
POINTS = 240  # samples across the window: one every 3 px at most
MIN_STEP_SECONDS = 15.0  # the step's floor when Prometheus' scrape interval is unknown
# Prometheus' own default when its config's `global` section sets no scrape_interval.
DEFAULT_SCRAPE_INTERVAL_SECONDS = 60.0
# Before an incident whose start the data does not reach back past: this share of the window.
_LEAD_SHARE = 0.05
_TITLE_MAX_CHARS = 78  # across the whole picture at FONT_SIZE (DejaVu Sans: ~10 px each)
# The labels a reader looks for first, in this order; the rest (role, model ...) after them.
_TITLE_LABELS = ("host", "server", "gpu", "sensor", "chip", "pool", "served_model")
_LEGEND_LABEL_MAX_CHARS = 28
# Labels that name where a series was scraped from, not what it is: never in the title.
_SCRAPE_LABELS = ("instance", "job")

FONT_SIZE = 14  # points at DPI: see "Size" above
LINE_WIDTH = 2.5
_BAND = "#fbd5d5"
_THRESHOLD = "#c62828"
_STEP = "#37474f"
_GRID = "#e2e5ea"
# matplotlib's tab10 without its red (the threshold's colour): six lines told apart at a glance.
PALETTE = (
    (31, 119, 180),
    (44, 160, 44),
    (255, 127, 14),
    (148, 103, 189),
    (140, 86, 75),
    (23, 190, 207),
)

Color = tuple[int, int, int]


class GraphError(Exception):
    """No picture: the message says why (Prometheus down, an error answer, no data)."""


@dataclass(frozen=True)
class Picture:
    """A drawn PNG and its caption (Markdown: what it shows, its range)."""

    png: bytes
    caption: str


@dataclass(frozen=True)
class Series:
    """One line: its labels and its (unix time, value) points, NaN and infinities left out."""

    labels: dict[str, str]
    points: list[tuple[float, float]]


@dataclass(frozen=True)
class Mark:
    """A step that changed something, at `at` (unix time), named `label` (`2 drain`)."""

    at: float
    label: str


@dataclass(frozen=True)
class Threshold:
    """The alert's threshold: a fixed `value`, or `series` over the window (base units)."""

    label: str
    value: float | None = None
    series: tuple[Series, ...] = ()


@dataclass(frozen=True)
class ChartSpec:
    """A report's `graph` spec, parsed: what to draw and what to mark."""

    query: str
    start: datetime
    end: datetime
    marked: tuple[float, float] | None = None
    threshold: float | None = None
    threshold_query: str | None = None
    threshold_label: str | None = None
    steps: tuple[Mark, ...] = field(default_factory=tuple)

    @classmethod
    def parse(cls, spec: Mapping[str, Any]) -> ChartSpec:
        """Read a spec as the report wrote it; raises `ValueError` (or `KeyError`, `TypeError`)."""

        def when(text: Any) -> datetime:
            parsed = datetime.fromisoformat(str(text))
            return parsed if parsed.tzinfo is not None else parsed.replace(tzinfo=UTC)

        marked_raw = spec.get("marked")
        marked = (
            (when(marked_raw[0]).timestamp(), when(marked_raw[1]).timestamp())
            if isinstance(marked_raw, list | tuple) and len(marked_raw) == 2
            else None
        )
        threshold_raw = spec.get("threshold")
        threshold = float(threshold_raw) if threshold_raw is not None else None
        if threshold is not None and not math.isfinite(threshold):
            threshold = None
        steps = tuple(
            Mark(when(step["at"]).timestamp(), str(step.get("label", "")))
            for step in spec.get("steps") or ()
        )
        query_raw = spec.get("threshold_query")
        label_raw = spec.get("threshold_label")
        return cls(
            query=str(spec["query"]),
            start=when(spec["start"]),
            end=when(spec["end"]),
            marked=marked,
            threshold=threshold,
            threshold_query=str(query_raw) if query_raw else None,
            threshold_label=str(label_raw) if label_raw else None,
            steps=steps,
        )


def query_step(start: float, end: float, floor: float = MIN_STEP_SECONDS) -> float:
    """The range query's step in seconds over unix times `start`..`end`.

    A `POINTS`-th of the window, never finer than `floor` (the scrape interval: a finer step
    repeats each sample into stairs).
    """
    return max(floor, (end - start) / POINTS)


_DURATION = re.compile(r"(\d+)(ms|s|m|h|d|w|y)")
_DURATION_SECONDS = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800,
                     "y": 31536000}  # fmt: skip


def duration_seconds(text: str) -> float | None:
    """A Prometheus duration (`15s`, `1m30s`, `500ms`) in seconds; None when it is not one."""
    text = text.strip()
    parts = _DURATION.findall(text)
    if not parts or "".join(number + unit for number, unit in parts) != text:
        return None
    return sum(int(number) * _DURATION_SECONDS[unit] for number, unit in parts)


def scrape_interval_seconds(prometheus_url: str, *, timeout_seconds: float = 5.0) -> float | None:
    """Prometheus' global `scrape_interval` in seconds; None when it cannot be read.

    From its loaded config, `GET /api/v1/status/config`: `{"data": {"yaml": "global: ..."}}`
    (Prometheus docs "HTTP API", "Config"); 1 m, Prometheus' default, when `global` sets none.
    A job may scrape at its own interval; the global one is what most series have.
    """
    try:
        text = prometheus_api.loaded_config_yaml(prometheus_url, timeout_seconds=timeout_seconds)
    except prometheus_api.QueryError as exc:
        log.info("report picture: Prometheus' scrape interval unknown: %s", exc)
        return None
    try:
        config = yaml.safe_load(text)
    except yaml.YAMLError:
        return None
    section = config.get("global") if isinstance(config, dict) else None
    if not isinstance(section, dict) or "scrape_interval" not in section:
        return DEFAULT_SCRAPE_INTERVAL_SECONDS if isinstance(config, dict) else None
    seconds = duration_seconds(str(section["scrape_interval"]))
    return seconds if seconds is not None and seconds > 0 else None


def query_range(
    prometheus_url: str,
    query: str,
    start: datetime,
    end: datetime,
    *,
    timeout_seconds: float = 5.0,
    step: float | None = None,
) -> list[Series]:
    """The series of a range query; raises `GraphError` with the reason.

    `step` (seconds): `query_step` of the window unless given.
    """
    if step is None:
        step = query_step(start.timestamp(), end.timestamp())
    # Prometheus evaluates at start, start + step, ... up to end, in whole milliseconds:
    # counted back from the end, so the last point is the window's end (a window that ends now
    # gets the newest sample, not one up to a step older); the first may fall a step before
    # the start, outside the axes. In milliseconds here too, as the API's parameters are
    # written: a step rounded there but not here would drop the last point.
    step_ms = max(1, math.ceil(step * 1000))
    end_ms = math.floor(end.timestamp() * 1000)
    first_ms = end_ms - math.ceil((end_ms - start.timestamp() * 1000) / step_ms) * step_ms
    try:
        result = prometheus_api.query_range(
            prometheus_url,
            query,
            start=first_ms / 1000,
            end=end_ms / 1000,
            step=step_ms / 1000,
            timeout_seconds=timeout_seconds,
        )
    except prometheus_api.QueryError as exc:
        raise GraphError(str(exc)) from None
    out = []
    for item in result:
        values = item.get("values") if isinstance(item, dict) else None
        if not isinstance(values, list):
            continue
        points = []
        for pair in values:
            try:
                when, value = float(pair[0]), float(pair[1])
            except (TypeError, ValueError, IndexError):
                continue
            if math.isfinite(value):
                points.append((when, value))
        labels = item.get("metric") or {}
        out.append(Series({str(k): str(v) for k, v in labels.items()}, points))
    return out


def distinguishing_labels(series: Sequence[Series]) -> list[str]:
    """The label names whose values differ between `series` (`__name__` aside), sorted."""
    names = sorted({name for one in series for name in one.labels if name != "__name__"})
    return [
        name for name in names if len({one.labels.get(name) for one in series}) > 1
    ]  # a label one series lacks differs too: None is a value here


def legend_label(labels: Mapping[str, str], names: Sequence[str]) -> str:
    """`gpu=0, sensor=edge`: the distinguishing labels of one series, cut to fit the legend."""
    text = ", ".join(f"{name}={labels.get(name, '—')}" for name in names)
    if len(text) > _LEGEND_LABEL_MAX_CHARS:
        text = text[: _LEGEND_LABEL_MAX_CHARS - 1] + "…"
    return text


def chart_title(query: str, series: Sequence[Series]) -> str:
    """The series' name (or the query's first) and the labels every series shares."""
    names = {one.labels.get("__name__", "") for one in series}
    name = names.pop() if len(names) == 1 and "" not in names else ""
    if not name:
        found = metric_names(query)
        name = found[0] if found else query
    differing = set(distinguishing_labels(series))
    shared = sorted(
        {
            (key, value)
            for key, value in series[0].labels.items()
            if key not in differing and key != "__name__" and key not in _SCRAPE_LABELS
        },
        key=lambda item: (
            _TITLE_LABELS.index(item[0]) if item[0] in _TITLE_LABELS else len(_TITLE_LABELS),
            item,
        ),
    )
    title = name + (" · " + " ".join(f"{k}={v}" for k, v in shared) if shared else "")
    return title if len(title) <= _TITLE_MAX_CHARS else title[: _TITLE_MAX_CHARS - 1] + "…"


def plain_text(text: str) -> str:
    """`text` as matplotlib shows it literally: a `$` would start mathtext (and can fail)."""
    return text.replace("$", r"\$")


# Tick spacings, in seconds: each divides an hour or a day, so ticks fall on round UTC times;
# the shortest for a window of seconds (a young Prometheus, the lab).
_TICK_STEPS = (1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200, 10800, 21600,
               43200, 86400)  # fmt: skip


def time_ticks(start: float, end: float, most: int = 4) -> list[float]:
    """Round UTC times between `start` and `end` (unix seconds), `most` of them at most."""
    span = max(end - start, 1.0)
    step = next((one for one in _TICK_STEPS if span / one <= most), _TICK_STEPS[-1])
    first = math.ceil(start / step) * step
    return [float(t) for t in range(int(first), int(end) + 1, step)]


def _step_label_places(
    marks: Sequence[Mark], start: float, end: float, width: int
) -> list[tuple[Mark, int, bool]]:
    """Each step with its label's row (0 at the top) and side (True: left of its line).

    In the last third of the window a label goes left of its line (the edge would cut it);
    each takes the highest row where it overlaps no label before it (widths estimated from
    the font size: a row too many costs less than two labels on top of each other).
    """
    char = (FONT_SIZE - 2) * DPI / 72 * 0.62
    plot = width * 0.85  # the axes' share of the picture, about
    taken: list[list[tuple[float, float]]] = []
    places = []
    for mark in marks:
        x = (mark.at - start) / max(end - start, 1e-9) * plot
        right = x > plot * 0.67
        extent = (len(mark.label) + 1) * char
        span = (x - extent - 6, x) if right else (x, x + extent + 6)
        level = 0
        while level < len(taken) and any(
            span[0] < other[1] and other[0] < span[1] for other in taken[level]
        ):
            level += 1
        if level == len(taken):
            taken.append([])
        taken[level].append(span)
        places.append((mark, min(level, 3), right))
    return places


def _legend_columns(labels: Sequence[str], width: int) -> int:
    """As many columns (up to 4) as the widest label lets fit across the picture."""
    char = FONT_SIZE * DPI / 72 * 0.62  # DejaVu Sans' average advance, in px
    entry = (max(len(label) for label in labels) + 4) * char  # + the line sample
    # Two at least: labels are cut to fit two (`_LEGEND_LABEL_MAX_CHARS`), and one column of
    # nine entries would leave no room for the plot.
    return max(min(2, len(labels)), min(4, len(labels), int((width - 20) // entry)))


def _hex(color: Color) -> str:
    return "#{:02x}{:02x}{:02x}".format(*color)


def render(
    series: Sequence[Series],
    start: float,
    end: float,
    *,
    marked: tuple[float, float] | None = None,
    unit: Unit = PLAIN,
    threshold: Threshold | None = None,
    steps: Sequence[Mark] = (),
    title: str = "",
    width: int = WIDTH,
    height: int = HEIGHT,
    step: float | None = None,
) -> bytes:
    """A line chart of `series` between unix times `start` and `end`, as PNG bytes (RGBA).

    `marked` (unix times) is shaded: the incident, from the alert to the run's end. `step`:
    the query's (`query_step` of the window unless given). Raises `ImportError` without
    matplotlib (the `report` extra).
    """
    # Here, not at the top: only a remediator that draws reports needs matplotlib (see above).
    from matplotlib.backends.backend_agg import FigureCanvasAgg  # noqa: PLC0415
    from matplotlib.figure import Figure  # noqa: PLC0415
    from matplotlib.ticker import FixedLocator, FuncFormatter, MaxNLocator  # noqa: PLC0415

    def x_of(when: float) -> float:
        return when  # unix seconds; the ticks below are whole UTC minutes and hours

    figure = Figure(
        figsize=(width / DPI, height / DPI), dpi=DPI, facecolor="white", layout="constrained"
    )
    FigureCanvasAgg(figure)
    axes = figure.add_subplot()
    axes.set_facecolor("white")
    for side in ("top", "right"):
        axes.spines[side].set_visible(False)
    axes.grid(True, color=_GRID, linewidth=1.0)
    axes.set_axisbelow(True)

    shown_values: list[float] = []
    if marked is not None:
        axes.axvspan(
            x_of(max(start, marked[0])),
            x_of(min(end, marked[1])),
            color=_BAND,
            label="incident",
            zorder=0,
        )
    drawn = [one for one in series if one.points][:MAX_SERIES]
    differing = distinguishing_labels(drawn)
    # A missing scrape or two breaks the line (the query step: see `query_range`).
    gap = (step if step is not None else query_step(start, end)) * 2.5
    for index, one in enumerate(drawn):
        color = _hex(PALETTE[index % len(PALETTE)])
        xs: list[float] = []
        ys: list[float] = []
        lone: list[tuple[float, float]] = []  # a sample with no neighbour: a dot, not a line
        run: list[tuple[float, float]] = []
        for when, value in [*one.points, (math.inf, math.nan)]:
            if run and (when - run[-1][0] > gap or not math.isfinite(when)):
                if len(run) == 1:
                    lone.append(run[0])
                xs += [x_of(t) for t, _ in run] + [math.nan]  # matplotlib breaks at NaN
                ys += [unit.shown(v) for _, v in run] + [math.nan]
                run = []
            if math.isfinite(when):
                run.append((when, value))
                shown_values.append(unit.shown(value))
        label = plain_text(legend_label(one.labels, differing)) if differing else None
        axes.plot(xs, ys, color=color, linewidth=LINE_WIDTH, label=label, zorder=3)
        if lone:
            axes.plot(
                [x_of(t) for t, _ in lone],
                [unit.shown(v) for _, v in lone],
                color=color,
                linestyle="none",
                marker="o",
                markersize=LINE_WIDTH * 2,
                zorder=3,
            )
    if threshold is not None:
        # Named on the line itself, at its right end, where the eye meets it: not in the legend.
        first: float | None = None
        if threshold.value is not None:
            axes.axhline(
                unit.shown(threshold.value), color=_THRESHOLD, linestyle="--", linewidth=2.0
            )
            first = unit.shown(threshold.value)
            shown_values.append(first)
        for line in threshold.series:
            axes.plot(
                [x_of(when) for when, _ in line.points],
                [unit.shown(value) for _, value in line.points],
                color=_THRESHOLD,
                linestyle="--",
                linewidth=2.0,
                drawstyle="steps-post",
                zorder=2,
            )
            shown_values.extend(unit.shown(value) for _, value in line.points)
            if first is None:
                first = unit.shown(line.points[0][1])
        if first is not None:
            # At the left end: the window opens before the alert (15 minutes, or a margin
            # where the data begins later), so the steps' labels are to the right; under the
            # series (zorder), so it never hides them.
            axes.annotate(
                plain_text(threshold.label),
                xy=(0.0, first),
                xycoords=("axes fraction", "data"),
                xytext=(4, 3),
                textcoords="offset points",
                ha="left",
                va="bottom",
                fontsize=FONT_SIZE - 2,
                color=_THRESHOLD,
                bbox={
                    "boxstyle": "round,pad=0.15",
                    "facecolor": "white",
                    "alpha": 0.75,
                    "edgecolor": "none",
                },
                zorder=2.5,
            )
    marks = [mark for mark in sorted(steps, key=lambda mark: mark.at) if start <= mark.at <= end]
    for number, (mark, level, right) in enumerate(_step_label_places(marks, start, end, width)):
        axes.axvline(
            x_of(mark.at),
            color=_STEP,
            linestyle=":",
            linewidth=2.0,
            label="steps" if number == 0 else None,
            zorder=4,
        )
        axes.annotate(
            plain_text(mark.label),
            xy=(x_of(mark.at), 1.0),
            xycoords=("data", "axes fraction"),
            xytext=(-4 if right else 4, -4 - level * (FONT_SIZE + 4)),
            textcoords="offset points",
            ha="right" if right else "left",
            va="top",
            fontsize=FONT_SIZE - 2,
            color=_STEP,
            bbox={"boxstyle": "round,pad=0.15", "facecolor": "white", "edgecolor": "none"},
            zorder=5,
        )

    axes.set_xlim(x_of(start), x_of(end))
    if shown_values:
        low, high = min(shown_values), max(shown_values)
        pad = (high - low) * 0.12 if high - low > 1e-12 else (abs(high) * 0.1 or 1.0)
        # Room above for the step labels and the legend.
        rows = 1 + max((level for _, level, _ in _step_label_places(marks, start, end, width)),
                       default=-1)  # fmt: skip
        axes.set_ylim(low - pad, high + pad * (1.0 + 1.5 * rows))  # room for the step labels
    axes.xaxis.set_major_locator(FixedLocator(time_ticks(start, end)))
    clock = "%H:%M" if end - start >= 600 else "%H:%M:%S"
    axes.xaxis.set_major_formatter(
        FuncFormatter(lambda value, _: f"{datetime.fromtimestamp(value, UTC):{clock}}")
    )
    axes.yaxis.set_major_locator(MaxNLocator(nbins=4))
    symbol = f" {unit.symbol}" if unit.symbol else ""
    axes.yaxis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:g}{symbol}"))
    axes.tick_params(labelsize=FONT_SIZE, length=4)
    day = datetime.fromtimestamp(start, UTC)
    axes.set_xlabel(f"{day:%Y-%m-%d} UTC", fontsize=FONT_SIZE - 1, color="#444444", loc="right")
    if title:
        # Over the whole width, not only the plot's: the name and labels need the room.
        figure.suptitle(plain_text(title), fontsize=FONT_SIZE, x=0.01, ha="left")
    handles, labels = axes.get_legend_handles_labels()
    # The series first, then what explains them: incident, steps.
    extras = ("incident", "steps")
    order = sorted(range(len(labels)), key=lambda i: labels[i] in extras)
    handles, labels = [handles[i] for i in order], [labels[i] for i in order]
    if handles:
        # Under the plot, not in it: it hides no data and no step label.
        figure.legend(
            handles,
            labels,
            loc="outside lower left",
            ncol=_legend_columns(labels, width),
            fontsize=FONT_SIZE - 1,
            frameon=False,
            handlelength=1.6,
            columnspacing=1.2,
        )
    out = io.BytesIO()
    # No "Software" text chunk: the same data gives the same bytes across matplotlib releases.
    figure.savefig(out, format="png", dpi=DPI, metadata={"Software": None})
    return out.getvalue()


def _label_text(labels: Mapping[str, str]) -> str:
    shown = ", ".join(f"{k}={v}" for k, v in sorted(labels.items()) if k != "__name__")
    return shown or labels.get("__name__", "series")


@dataclass(frozen=True)
class Window:
    """What a picture shows: unix times `start`..`end`, queried at `step` seconds."""

    start: float
    end: float
    step: float

    def datetimes(self) -> tuple[datetime, datetime]:
        """`start` and `end` as UTC datetimes."""
        return datetime.fromtimestamp(self.start, UTC), datetime.fromtimestamp(self.end, UTC)


def fit_window(
    chart: ChartSpec,
    now: float,
    floor: float,
    first_sample: float | None = None,
) -> Window:
    """The spec's window cut to what there is to see (the module docstring, "The window").

    It ends at `now` when the spec's end is still to come; it starts at `first_sample` (the
    earliest of the series) when that is later than the spec's start, but before the incident
    (`marked`) by `_LEAD_SHARE` of the window at least. `floor`: the step's (scrape interval).
    """
    start, end = chart.start.timestamp(), chart.end.timestamp()
    if start < now < end:
        end = now
    if first_sample is not None and first_sample > start:
        begin = first_sample
        if chart.marked is not None:
            begin = min(begin, chart.marked[0] - (end - chart.marked[0]) * _LEAD_SHARE)
        start = max(start, begin)
    return Window(start, end, query_step(start, end, floor))


def _threshold(
    prometheus_url: str, chart: ChartSpec, window: Window, unit: Unit, timeout_seconds: float
) -> Threshold | None:
    """The threshold line the spec asks for, or None; a failed query costs only the line."""
    if chart.threshold is not None:
        label = chart.threshold_label or f"threshold {unit.format(chart.threshold)}"
        return Threshold(label, value=chart.threshold)
    if not chart.threshold_query:
        return None
    try:
        found = query_range(
            prometheus_url,
            chart.threshold_query,
            *window.datetimes(),
            timeout_seconds=timeout_seconds,
            step=window.step,
        )
    except GraphError as exc:
        log.warning("report picture: threshold left out: %s", exc)
        return None
    lines = tuple(one for one in found if one.points)[:MAX_SERIES]
    if not lines:
        log.info("report picture: threshold %s has no data in the window", chart.threshold_query)
        return None
    values = {value for one in lines for _, value in one.points}
    if chart.threshold_label:
        label = chart.threshold_label
    elif len(values) == 1:
        label = f"threshold {unit.format(values.pop())}"
    else:
        label = "threshold"
    return Threshold(label, series=lines)


def draw(
    prometheus_url: str,
    spec: Mapping[str, Any],
    *,
    timeout_seconds: float = 5.0,
    now: datetime | None = None,
) -> Picture | None:
    """The picture a report's `graph` spec asks for, or None (the reason is logged).

    `now`: the drawing's time (the clock's unless given), where a window still to come ends.
    """
    try:
        chart = ChartSpec.parse(spec)
        if chart.end - chart.start <= timedelta(0):
            raise ValueError("an empty window")
    except (KeyError, ValueError, TypeError, OverflowError, OSError):
        log.warning("report picture: unusable spec %r", dict(spec))
        return None
    drawn_at = (now or datetime.now(UTC)).timestamp()
    floor = scrape_interval_seconds(prometheus_url, timeout_seconds=timeout_seconds)
    window = fit_window(chart, drawn_at, floor or MIN_STEP_SECONDS)

    def fetch(window: Window) -> list[Series]:
        found = query_range(prometheus_url, chart.query, *window.datetimes(),
                            timeout_seconds=timeout_seconds, step=window.step)  # fmt: skip
        return [one for one in found if one.points]

    def first_sample(series: Sequence[Series]) -> float:
        return min(one.points[0][0] for one in series)

    try:
        series = fetch(window)
        if series:
            # A coarse step's first point comes up to a step after the first sample.
            begins = first_sample(series) - window.step
            fitted = fit_window(chart, drawn_at, floor or MIN_STEP_SECONDS, first_sample=begins)
            # The data begins inside the window: asked again over the fitted window at its
            # finer step; the axis then begins at the first sample found (less than the coarse
            # step later: no further query, the points are there).
            if fitted.start > window.start + window.step and (finer := fetch(fitted)):
                series = finer
                start = fit_window(chart, drawn_at, fitted.step, first_sample(finer)).start
                window = Window(max(fitted.start, start), fitted.end, fitted.step)
    except GraphError as exc:
        log.warning("report picture left out: %s", exc)
        return None
    if not series:
        log.info("report picture left out: %s has no data in the window", chart.query)
        return None
    unit = unit_of_query(chart.query, [one.labels.get("__name__", "") for one in series])
    threshold = _threshold(prometheus_url, chart, window, unit, timeout_seconds)
    try:
        png = render(
            series,
            window.start,
            window.end,
            marked=chart.marked,
            unit=unit,
            threshold=threshold,
            steps=chart.steps,
            title=chart_title(chart.query, series),
            step=window.step,
        )
    except ImportError as exc:
        log.warning(
            "report picture left out: matplotlib is not installed (%s); install the "
            "`report` extra: pip install 'gpu-fleet[report]'",
            exc,
        )
        return None
    except (ValueError, RuntimeError, OverflowError, MemoryError) as exc:
        # matplotlib refuses data it cannot place (dates out of range, a degenerate axis):
        # the report goes without a picture, never without the report.
        log.warning("report picture left out: drawing failed: %s", exc)
        return None
    low = min(value for one in series for _, value in one.points)
    high = max(value for one in series for _, value in one.points)
    names = "; ".join(_label_text(one.labels) for one in series[:MAX_SERIES])
    more = f" (+{len(series) - MAX_SERIES} more not drawn)" if len(series) > MAX_SERIES else ""
    span = unit.format(low) if low == high else f"{unit.format(low)} … {unit.format(high)}"
    line = f" · {threshold.label}" if threshold is not None else ""
    caption = f"{span} — {names}{more}{line}"
    return Picture(png=png, caption=caption)
