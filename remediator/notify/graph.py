"""The picture of an incident: the metric that fired, around the time it fired, as a small PNG.

`draw(prometheus_url, spec)` asks Prometheus for `query_range` (`GET /api/v1/query_range`,
Prometheus docs "HTTP API": `{"status": "success", "data": {"resultType": "matrix",
"result": [{"metric": {...}, "values": [[ts, "1"], ...]}]}}`) over the spec's window and
draws up to `MAX_SERIES` lines on a light grid, the incident's span shaded. The PNG is written
here with `zlib` (filter 0 rows, one IDAT chunk, RGB): a 480 x 160 picture needs no imaging
library. Anything that goes wrong (Prometheus down, an error answer, no data) returns None
with the reason logged: the report then goes out without a picture.
"""

from __future__ import annotations

import logging
import math
import struct
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from remediator import prometheus_api

log = logging.getLogger(__name__)

WIDTH, HEIGHT = 480, 160
MAX_SERIES = 6
POINTS = 240  # samples across the window: about two pixels each
_MARGIN = 6

_BACKGROUND = (255, 255, 255)
_GRID = (226, 229, 234)
_BAND = (253, 226, 226)
_AXIS = (160, 166, 176)
PALETTE = (
    (31, 119, 180),
    (214, 39, 40),
    (44, 160, 44),
    (255, 127, 14),
    (148, 103, 189),
    (140, 86, 75),
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


def query_range(
    prometheus_url: str,
    query: str,
    start: datetime,
    end: datetime,
    *,
    timeout_seconds: float = 5.0,
) -> list[Series]:
    """The series of a range query; raises `GraphError` with the reason."""
    step = max(1.0, (end - start).total_seconds() / POINTS)
    try:
        result = prometheus_api.query_range(
            prometheus_url,
            query,
            start=start.timestamp(),
            end=end.timestamp(),
            step=step,
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


class Canvas:
    """An RGB picture in memory, with just what a line chart needs."""

    def __init__(self, width: int, height: int, background: Color = _BACKGROUND) -> None:
        self.width = width
        self.height = height
        self.pixels = bytearray(bytes(background) * (width * height))

    def set(self, x: int, y: int, color: Color) -> None:
        """Paint one pixel (outside the picture: ignored)."""
        if 0 <= x < self.width and 0 <= y < self.height:
            offset = (y * self.width + x) * 3
            self.pixels[offset : offset + 3] = bytes(color)

    def get(self, x: int, y: int) -> Color:
        """One pixel's color."""
        offset = (y * self.width + x) * 3
        r, g, b = self.pixels[offset : offset + 3]
        return (r, g, b)

    def rect(self, x0: int, y0: int, x1: int, y1: int, color: Color) -> None:
        """Fill the rectangle between two corners, both included."""
        for y in range(max(0, min(y0, y1)), min(self.height, max(y0, y1) + 1)):
            for x in range(max(0, min(x0, x1)), min(self.width, max(x0, x1) + 1)):
                self.set(x, y, color)

    def line(self, x0: int, y0: int, x1: int, y1: int, color: Color) -> None:
        """A two-pixel-thick line (Bresenham), readable on a phone."""
        dx, dy = abs(x1 - x0), -abs(y1 - y0)
        sx, sy = (1 if x0 < x1 else -1), (1 if y0 < y1 else -1)
        error = dx + dy
        while True:
            self.set(x0, y0, color)
            self.set(x0, y0 + 1, color)
            if x0 == x1 and y0 == y1:
                return
            doubled = 2 * error
            if doubled >= dy:
                error += dy
                x0 += sx
            if doubled <= dx:
                error += dx
                y0 += sy

    def png(self) -> bytes:
        """The picture as PNG (8-bit RGB, no interlace)."""
        stride = self.width * 3
        raw = b"".join(
            b"\x00" + bytes(self.pixels[row * stride : (row + 1) * stride])
            for row in range(self.height)
        )

        def chunk(kind: bytes, data: bytes) -> bytes:
            crc = zlib.crc32(kind + data) & 0xFFFFFFFF
            return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", crc)

        header = struct.pack(">IIBBBBB", self.width, self.height, 8, 2, 0, 0, 0)
        return (
            b"\x89PNG\r\n\x1a\n"
            + chunk(b"IHDR", header)
            + chunk(b"IDAT", zlib.compress(raw, 9))
            + chunk(b"IEND", b"")
        )


def _value_range(series: Sequence[Series]) -> tuple[float, float]:
    values = [value for one in series for _, value in one.points]
    low, high = min(values), max(values)
    if high - low < 1e-12:  # a flat line sits in the middle, not on an edge
        pad = abs(high) * 0.1 or 1.0
        return low - pad, high + pad
    pad = (high - low) * 0.08
    return low - pad, high + pad


def render(
    series: Sequence[Series],
    start: float,
    end: float,
    *,
    marked: tuple[float, float] | None = None,
    width: int = WIDTH,
    height: int = HEIGHT,
) -> bytes:
    """A line chart of `series` between unix times `start` and `end`, as PNG bytes.

    `marked` (unix times) is shaded: the incident, from the alert to the run's end.
    """
    canvas = Canvas(width, height)
    left, right = _MARGIN, width - _MARGIN - 1
    top, bottom = _MARGIN, height - _MARGIN - 1
    span = max(end - start, 1e-9)

    def x_of(when: float) -> int:
        return left + round((when - start) / span * (right - left))

    if marked is not None:
        canvas.rect(x_of(max(start, marked[0])), top, x_of(min(end, marked[1])), bottom, _BAND)
    for index in range(5):
        y = top + round(index * (bottom - top) / 4)
        canvas.line(left, y, right, y, _GRID)
    drawn = [one for one in series if one.points]
    if drawn:
        low, high = _value_range(drawn)

        def y_of(value: float) -> int:
            return bottom - round((value - low) / (high - low) * (bottom - top))

        gap = span / POINTS * 2.5  # a missing scrape or two breaks the line
        for index, one in enumerate(drawn[:MAX_SERIES]):
            color = PALETTE[index % len(PALETTE)]
            previous: tuple[float, float] | None = None
            for when, value in one.points:
                if previous is not None and when - previous[0] <= gap:
                    canvas.line(
                        x_of(previous[0]), y_of(previous[1]), x_of(when), y_of(value), color
                    )
                else:
                    canvas.set(x_of(when), y_of(value), color)
                previous = (when, value)
    canvas.line(left, bottom, right, bottom, _AXIS)
    return canvas.png()


def _label_text(labels: Mapping[str, str]) -> str:
    shown = ", ".join(f"{k}={v}" for k, v in sorted(labels.items()) if k != "__name__")
    return shown or labels.get("__name__", "series")


def draw(
    prometheus_url: str, spec: Mapping[str, Any], *, timeout_seconds: float = 5.0
) -> Picture | None:
    """The picture a report's `graph` spec asks for, or None (the reason is logged)."""
    try:
        query = str(spec["query"])
        start = datetime.fromisoformat(str(spec["start"]))
        end = datetime.fromisoformat(str(spec["end"]))
        marked_raw = spec.get("marked")
        marked = (
            (
                datetime.fromisoformat(str(marked_raw[0])).timestamp(),
                datetime.fromisoformat(str(marked_raw[1])).timestamp(),
            )
            if isinstance(marked_raw, list | tuple) and len(marked_raw) == 2
            else None
        )
    except (KeyError, ValueError, TypeError):
        log.warning("report picture: unusable spec %r", dict(spec))
        return None
    try:
        series = query_range(prometheus_url, query, start, end, timeout_seconds=timeout_seconds)
    except GraphError as exc:
        log.warning("report picture left out: %s", exc)
        return None
    series = [one for one in series if one.points]
    if not series:
        log.info("report picture left out: %s has no data in the window", query)
        return None
    png = render(series, start.timestamp(), end.timestamp(), marked=marked)
    low = min(value for one in series for _, value in one.points)
    high = max(value for one in series for _, value in one.points)
    names = "; ".join(_label_text(one.labels) for one in series[:MAX_SERIES])
    more = f" (+{len(series) - MAX_SERIES} more not drawn)" if len(series) > MAX_SERIES else ""
    caption = f"{low:g} … {high:g} — {names}{more}"
    return Picture(png=png, caption=caption)
