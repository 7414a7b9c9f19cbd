"""The report's chart: real Prometheus data drawn with matplotlib, checked as a picture.

Real parts: Debian's `prometheus`, its TSDB filled by `promtool tsdb create-blocks-from
openmetrics` (a backfill: an incident of fixed times, so the picture is the same every run),
matplotlib's Agg canvas, Pillow to read the PNG back. The spec is the one production writes:
`Reporter.run_report` on a run whose alert carries the annotations Prometheus renders from
our rules (read from the promtool expectations in rules/tests/, which `promtool test rules`
proves). The pictures are compared with golden PNGs under tests/golden/ within a tolerance
(fonts and anti-aliasing differ a little between FreeType builds); `GPUFLEET_UPDATE_GOLDEN=1`
rewrites them after an intended change: look at them (they are meant to be read at Zulip's
preview size) and review the diff like code.
"""

from __future__ import annotations

import io
import json
import logging
import math
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any
from urllib.parse import quote_plus

import numpy as np
import promql_parser
import pytest
import yaml
from PIL import Image

from fleet.roster import Roster
from remediator.journal import AlertRecord, RunRecord, StepRecord
from remediator.notify import graph
from remediator.notify.graph import (
    HEIGHT,
    PALETTE,
    WIDTH,
    ChartSpec,
    Series,
    chart_title,
    distinguishing_labels,
    draw,
    duration_seconds,
    fit_window,
    legend_label,
    scrape_interval_seconds,
    time_ticks,
)
from remediator.notify.report import CHART_ANNOTATIONS, Reporter, ReportSettings
from remediator.notify.units import PLAIN, SUFFIXES, unit_of, unit_of_query
from tests.golden import GOLDEN_DIR
from tests.prometheus_lab import MetricsEndpoint, PrometheusServer

REPO = Path(__file__).resolve().parent.parent
RULES = REPO / "rules" / "gpu-fleet-alerts.rules.yml"
RULE_TESTS = REPO / "rules" / "tests"

# The incident: GPU 0 of dioscuri heats up from 02:55, the alert fires at 03:02, the run
# drains the server and caps the power at 03:03 and ends at 03:12; GPU 1 stays cool.
T0 = datetime(2026, 11, 30, 2, 30, tzinfo=UTC)
FIRED = datetime(2026, 11, 30, 3, 2, tzinfo=UTC)
STARTED = FIRED + timedelta(seconds=50)
FINISHED = datetime(2026, 11, 30, 3, 12, tzinfo=UTC)
SAMPLE_SECONDS = 15
HOST = {"host": "dioscuri", "instance": "192.0.2.10:9445", "job": "gpu-fleet-exporter"}
GIB = 2**30
MINUS = "\u2212"  # the rules write the threshold labels with the minus sign, U+2212

ROSTER = Roster.model_validate({"hosts": {"dioscuri": {"address": "192.0.2.10"}}})
SETTINGS = ReportSettings(stream="agent-hub", topics={"gpu": "alerts-gpu"})

# Golden tolerance: the mean absolute difference of the RGB channels (0-255) and the share
# of pixels that differ clearly. A moved line or a lost label is far past both; a glyph
# hinted one pixel apart is not.
MEAN_ABS_DIFF_MAX = 1.0
CHANGED_PIXELS_MAX = 0.002


# -- the data ------------------------------------------------------------------------------


def junction_celsius(gpu: int, at: float) -> float:
    """GPU 0 heats from 02:55 to 107 °C, cools after the power cap (03:03) to 96 °C."""
    minutes = (at - T0.timestamp()) / 60
    wobble = math.sin(minutes * 1.7 + gpu) * 0.6
    if gpu == 1:
        return 71.0 + wobble
    if minutes < 25:
        return 78.0 + wobble
    if minutes < 33:
        return 78.0 + (minutes - 25) / 8 * 29.0 + wobble
    return max(96.0, 107.0 - (minutes - 33) * 1.4) + wobble


def vram_used_bytes(at: float) -> float:
    """GPU 0 of 24 GiB fills to within 200 MiB of full from 02:50; the restart frees it."""
    minutes = (at - T0.timestamp()) / 60
    if minutes < 20:
        return 21.5 * GIB
    if minutes < 42:
        return min(24 * GIB - 200 * 2**20, 21.5 * GIB + (minutes - 20) * 0.5 * GIB)
    return 12.0 * GIB


def openmetrics() -> str:
    """The incident's series, one sample every 15 s from 02:30 to 03:30, as OpenMetrics."""
    times = [T0.timestamp() + s for s in range(0, 3600 + 1, SAMPLE_SECONDS)]

    def labels(**extra: str) -> str:
        return ",".join(f'{k}="{v}"' for k, v in {**HOST, **extra}.items())

    lines = ["# TYPE gpufleet_gpu_temperature_celsius gauge"]
    for gpu in (0, 1):
        for at in times:
            value = junction_celsius(gpu, at)
            lines.append(
                f"gpufleet_gpu_temperature_celsius{{{labels(gpu=str(gpu), sensor='junction')}}} "
                f"{value:.2f} {at:.0f}"
            )
    lines.append("# TYPE gpufleet_gpu_temperature_critical_celsius gauge")
    for gpu in (0, 1):
        for at in times:
            lines.append(
                "gpufleet_gpu_temperature_critical_celsius"
                f"{{{labels(gpu=str(gpu), sensor='junction')}}} 110 {at:.0f}"
            )
    lines.append("# TYPE gpufleet_gpu_memory_used_bytes gauge")
    for at in times:
        lines.append(
            f"gpufleet_gpu_memory_used_bytes{{{labels(gpu='0', pool='vram')}}} "
            f"{vram_used_bytes(at):.0f} {at:.0f}"
        )
    lines.append("# TYPE gpufleet_gpu_memory_total_bytes gauge")
    for at in times:
        lines.append(
            f"gpufleet_gpu_memory_total_bytes{{{labels(gpu='0', pool='vram')}}} {24 * GIB} {at:.0f}"
        )
    # The recording rules' tok/s of delta (as Prometheus records them: no instance, no job):
    # 100 tok/s as usual, 45 from 02:50 (the critical's 50 % line is 50).
    speed = 'host="dioscuri",server="delta",role="gpu-light",model="Qwen3-8B-Q8_0"'
    for name in ("current", "baseline_7d"):
        lines.append(f"# TYPE server_model:gpufleet_tokens_per_second:{name} gauge")
        for at in times:
            late = name == "current" and at >= T0.timestamp() + 20 * 60
            value = 45.0 + math.sin(at / 97) * 1.5 if late else 100.0
            lines.append(
                f"server_model:gpufleet_tokens_per_second:{name}{{{speed}}} {value:.2f} {at:.0f}"
            )
    lines.append("# EOF")
    return "\n".join(lines) + "\n"


@pytest.fixture(scope="module")
def prometheus(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PrometheusServer]:
    """A real Prometheus whose TSDB holds the incident (backfilled with promtool)."""
    tmp = tmp_path_factory.mktemp("graph")
    # Its scrape interval is its data's (a sample every 15 s): the picture's step follows it.
    server = PrometheusServer(tmp, [], f"{SAMPLE_SECONDS}s")
    source = tmp / "incident.om"
    source.write_text(openmetrics())
    data = server.directory / "data"
    data.mkdir(parents=True)
    subprocess.run(
        ["promtool", "tsdb", "create-blocks-from", "openmetrics", str(source), str(data)],
        check=True,
        capture_output=True,
        timeout=120,
    )
    with server:
        yield server


# -- the annotations, as Prometheus renders them --------------------------------------------


def rendered_annotations(alertname: str, **labels: str) -> tuple[dict[str, str], dict[str, str]]:
    """The labels and annotations of `alertname` in a promtool expectation (rules/tests/).

    `promtool test rules` checks these strings against what Prometheus renders from our
    templates: a test here that uses them uses what Prometheus would send.
    """
    for path in sorted(RULE_TESTS.glob("*.yml")):
        for case in yaml.safe_load(path.read_text())["tests"]:
            for check in case.get("alert_rule_test", []):
                if check["alertname"] != alertname:
                    continue
                for expected in check.get("exp_alerts") or []:
                    found = {str(k): str(v) for k, v in expected["exp_labels"].items()}
                    if all(found.get(k) == v for k, v in labels.items()):
                        return found, dict(expected["exp_annotations"])
    raise AssertionError(f"no promtool expectation of {alertname} with {labels}")


def incident_run(
    alertname: str, labels: dict[str, str], annotations: dict[str, str], steps: list[StepRecord]
) -> RunRecord:
    alert = AlertRecord(
        id=1,
        fingerprint="0c1d2e3f40516273",
        starts_at=FIRED,
        status="firing",
        alertname=alertname,
        labels={"alertname": alertname, **labels},
        annotations=annotations,
        generator_url="http://prometheus.example.org:9090/graph?g0.expr=up&g0.tab=1",
        first_seen=FIRED,
        last_seen=FIRED,
        resolved_at=None,
    )
    return RunRecord(
        id=7,
        alert=alert,
        state="done",
        decision="run",
        reason="",
        playbook="gpu-overheating",
        target="gpu/dioscuri/0",
        owner="central-1",
        created_at=FIRED,
        claimed_at=STARTED,
        started_at=STARTED,
        finished_at=FINISHED,
        outcome="healed",
        verification="held",
        steps=steps,
    )


def step(index: int, action: str, at: datetime, seconds: float = 2.0) -> StepRecord:
    return StepRecord(
        index=index,
        action=action,
        params={},
        started_at=at,
        finished_at=at + timedelta(seconds=seconds),
        result="ok",
        output="",
    )


def spec_of(run: RunRecord) -> dict[str, Any]:
    [report] = Reporter(SETTINGS, ROSTER).run_report(run)
    assert report.graph is not None
    return dict(report.graph)


def temperature_run() -> RunRecord:
    labels, annotations = rendered_annotations(
        "GpuTemperatureCritical", host="dioscuri", gpu="0", sensor="junction"
    )
    return incident_run(
        "GpuTemperatureCritical",
        labels,
        annotations,
        [
            step(0, "capture_evidence", STARTED),
            step(1, "drain", STARTED + timedelta(seconds=3)),
            step(2, "set_power_cap", STARTED + timedelta(seconds=40)),
            step(3, "wait_healthy", STARTED + timedelta(seconds=45), seconds=300),
            step(4, "restart_server", FIRED + timedelta(minutes=7)),
        ],
    )


# -- the picture ----------------------------------------------------------------------------


def decoded(png: bytes) -> Image.Image:
    image = Image.open(io.BytesIO(png))
    image.load()  # decodes every row: a broken PNG raises here
    return image


def assert_golden_png(png: bytes, name: str, tmp_path: Path) -> None:
    """`png` looks like tests/golden/NAME.png, within the tolerance (or rewrite it)."""
    path = GOLDEN_DIR / f"{name}.png"
    if os.environ.get("GPUFLEET_UPDATE_GOLDEN") == "1":
        path.write_bytes(png)
    assert path.exists(), f"no golden picture {path}: run with GPUFLEET_UPDATE_GOLDEN=1"
    actual = np.asarray(decoded(png).convert("RGB"), dtype=np.int16)
    expected = np.asarray(Image.open(path).convert("RGB"), dtype=np.int16)
    drawn = tmp_path / f"{name}.png"
    drawn.write_bytes(png)
    assert actual.shape == expected.shape, f"{drawn} is {actual.shape}, {path} {expected.shape}"
    difference = np.abs(actual - expected)
    mean = float(difference.mean())
    changed = float((difference.max(axis=2) > 64).mean())
    assert mean <= MEAN_ABS_DIFF_MAX and changed <= CHANGED_PIXELS_MAX, (
        f"{drawn} differs from {path}: mean absolute difference {mean:.2f} "
        f"(at most {MEAN_ABS_DIFF_MAX}), {changed:.2%} of the pixels changed "
        f"(at most {CHANGED_PIXELS_MAX:.1%})"
    )


def colour_share(png: bytes, rgb: tuple[int, int, int], within: int = 30) -> float:
    """The share of the picture's pixels near the colour `rgb`."""
    pixels = np.asarray(decoded(png).convert("RGB"), dtype=np.int16)
    near = np.abs(pixels - np.array(rgb, dtype=np.int16)).max(axis=2) <= within
    return float(near.mean())


THRESHOLD_RGB = (0xC6, 0x28, 0x28)
BAND_RGB = (0xFB, 0xD5, 0xD5)


def test_the_temperature_incident_is_drawn_with_threshold_span_and_steps(
    prometheus: PrometheusServer, tmp_path: Path
) -> None:
    spec = spec_of(temperature_run())
    # What the report asks for: the rule's series and threshold, the changing steps only.
    assert spec["query"] == 'gpufleet_gpu_temperature_celsius{host="dioscuri",sensor="junction"}'
    assert spec["threshold_query"].endswith("- 5")
    assert spec["threshold_label"] == f"GPU 0 junction: critical {MINUS} 5 °C"
    assert [s["label"] for s in spec["steps"]] == ["2 drain", "3 set_power_cap", "5 restart_server"]
    picture = draw(prometheus.url, spec)
    assert picture is not None
    image = decoded(picture.png)
    assert image.format == "PNG" and image.size == (WIDTH, HEIGHT)
    # Both GPUs drawn, the threshold read from Prometheus (110 - 5), in the caption too.
    assert "gpu=0" in picture.caption and "gpu=1" in picture.caption
    assert picture.caption.startswith("70.4 °C … 107 °C")
    assert f"GPU 0 junction: critical {MINUS} 5 °C" in picture.caption
    assert colour_share(picture.png, THRESHOLD_RGB) > 0.002, "no threshold line"
    assert colour_share(picture.png, BAND_RGB, within=8) > 0.05, "no incident span"
    assert_golden_png(picture.png, "chart-gpu-temperature", tmp_path)


def test_the_memory_chart_is_in_gib_with_the_rules_threshold(
    prometheus: PrometheusServer, tmp_path: Path
) -> None:
    labels, annotations = rendered_annotations("GpuMemoryNearlyFull", host="dioscuri", gpu="0")
    run = incident_run(
        "GpuMemoryNearlyFull",
        labels,
        annotations,
        [step(0, "restart_server", datetime(2026, 11, 30, 3, 12, tzinfo=UTC))],
    )
    spec = spec_of(run)
    picture = draw(prometheus.url, spec)
    assert picture is not None
    # 24 GiB less min(2 %, 512 MiB) = 23.52 GiB: the binding one of the rule's two conditions.
    assert picture.caption.startswith("12 GiB … 23.8 GiB")
    assert "GPU 0: 98 % used and under 512 MiB free" in picture.caption
    assert decoded(picture.png).size == (WIDTH, HEIGHT)
    assert_golden_png(picture.png, "chart-gpu-memory", tmp_path)


def test_the_speed_chart_is_in_tok_s_against_its_baseline_share(
    prometheus: PrometheusServer, tmp_path: Path
) -> None:
    labels, annotations = rendered_annotations(
        "TokensPerSecondDegraded", severity="critical", server="delta"
    )
    run = incident_run(
        "TokensPerSecondDegraded",
        labels,
        annotations,
        [step(0, "restart_server", datetime(2026, 11, 30, 3, 5, tzinfo=UTC))],
    )
    picture = draw(prometheus.url, spec_of(run))
    assert picture is not None
    assert picture.caption.startswith("43.5 tok/s … 100 tok/s")
    assert picture.caption.endswith("· 50 % of the 7-day baseline")
    assert colour_share(picture.png, THRESHOLD_RGB) > 0.002, "no threshold line"
    assert_golden_png(picture.png, "chart-tokens-per-second", tmp_path)


def test_a_failing_threshold_query_costs_the_line_not_the_picture(
    prometheus: PrometheusServer, caplog: pytest.LogCaptureFixture
) -> None:
    spec = spec_of(temperature_run())
    spec["threshold_query"] = "gpufleet_gpu_temperature_critical_celsius{"  # a parse error
    with caplog.at_level(logging.WARNING, logger="remediator.notify.graph"):
        picture = draw(prometheus.url, spec)
    assert picture is not None and "critical" not in picture.caption
    assert colour_share(picture.png, THRESHOLD_RGB) < 0.0005
    assert "threshold left out" in caplog.text


def test_without_data_or_prometheus_there_is_no_picture(
    prometheus: PrometheusServer, caplog: pytest.LogCaptureFixture
) -> None:
    spec = spec_of(temperature_run())
    with caplog.at_level(logging.INFO, logger="remediator.notify.graph"):
        assert draw(prometheus.url, {**spec, "query": "gpufleet_no_such_series"}) is None
        assert draw("http://127.0.0.1:9", spec, timeout_seconds=1.0) is None
        assert draw(prometheus.url, {**spec, "start": "yesterday"}) is None
    assert "no data in the window" in caplog.text and "unusable spec" in caplog.text


def test_a_static_threshold_from_the_alert_expression(prometheus: PrometheusServer) -> None:
    labels, annotations = rendered_annotations(
        "GpuTemperatureCritical", host="dioscuri", gpu="0", sensor="junction"
    )
    plain = {k: v for k, v in annotations.items() if k not in CHART_ANNOTATIONS}
    run = incident_run("GpuTemperatureCritical", labels, plain, [])
    # Without the chart annotations: the alert's own `x > 100` gives the series and the line.
    expr = quote_plus("gpufleet_gpu_temperature_celsius > 100")
    alert = replace(run.alert, generator_url=f"http://p:9090/graph?g0.expr={expr}&g0.tab=1")
    spec = spec_of(replace(run, alert=alert))
    assert spec["query"] == "gpufleet_gpu_temperature_celsius" and spec["threshold"] == 100.0
    picture = draw(prometheus.url, spec)
    assert picture is not None and "threshold 100 °C" in picture.caption


def test_labels_that_would_be_mathtext_are_drawn_as_written(
    prometheus: PrometheusServer, tmp_path: Path
) -> None:
    # A `$` in a label value starts matplotlib's mathtext; `$\frac{` would fail to parse.
    series = [
        Series(
            {"server": r"a$\frac{", "gpu": "0"}, [(T0.timestamp() + 60 * i, 1.0) for i in range(9)]
        ),
        Series({"server": "b$", "gpu": "0"}, [(T0.timestamp() + 60 * i, 2.0) for i in range(9)]),
    ]
    png = graph.render(series, T0.timestamp(), T0.timestamp() + 600, title=r"x$\frac{")
    assert decoded(png).size == (WIDTH, HEIGHT)


# -- the window: what there is to see ----------------------------------------------------------


def test_the_step_follows_prometheus_scrape_interval(prometheus: PrometheusServer) -> None:
    assert scrape_interval_seconds(prometheus.url) == SAMPLE_SECONDS
    assert scrape_interval_seconds("http://127.0.0.1:9", timeout_seconds=1.0) is None
    assert duration_seconds("1m30s") == 90 and duration_seconds("500ms") == 0.5
    assert duration_seconds("15") is None and duration_seconds("1x") is None
    assert duration_seconds("s15s") is None


def test_the_window_ends_at_the_drawing_and_starts_where_the_data_does() -> None:
    chart = ChartSpec.parse(spec_of(temperature_run()))
    start, end = chart.start.timestamp(), chart.end.timestamp()
    assert (chart.start, chart.end) == (
        FIRED - timedelta(minutes=15),
        FINISHED + timedelta(minutes=5),
    )
    # Drawn as the run ends: the five minutes after it are still to come, and left out.
    at_end = (FINISHED + timedelta(seconds=20)).timestamp()
    window = fit_window(chart, at_end, SAMPLE_SECONDS)
    assert (window.start, window.end) == (start, at_end)
    # Drawn later (a page opened the next day): the whole window, at no finer than 15 s.
    window = fit_window(chart, end + 86400, SAMPLE_SECONDS)
    assert (window.start, window.end, window.step) == (start, end, SAMPLE_SECONDS)
    # Data from 02:58 only (a young Prometheus): the picture begins there, at a finer step
    # when Prometheus scrapes faster.
    first = datetime(2026, 11, 30, 2, 58, tzinfo=UTC).timestamp()
    window = fit_window(chart, end + 86400, 1.0, first_sample=first)
    assert (window.start, window.end) == (first, end)
    assert window.step == (end - first) / graph.POINTS
    # Data from after the alert fired: the incident's start stays in view, with a margin.
    late = (FIRED + timedelta(minutes=3)).timestamp()
    window = fit_window(chart, end + 86400, 1.0, first_sample=late)
    assert window.start == FIRED.timestamp() - (end - FIRED.timestamp()) * 0.05
    # Data from before the window: it is the spec's.
    assert fit_window(chart, end + 86400, 1.0, first_sample=start - 60).start == start


def _exposition(celsius: float) -> str:
    return (
        "# TYPE gpufleet_gpu_temperature_celsius gauge\n"
        f'gpufleet_gpu_temperature_celsius{{gpu="0",sensor="junction"}} {celsius}\n'
    )


def test_a_young_fast_scraped_incident_fills_the_picture(tmp_path: Path) -> None:
    # The lab's case, and a new host's: Prometheus scrapes every second and has seconds of
    # data, the run is drawn as it ends. In the spec's 20-minute frame the incident would be a
    # sliver at the right end of a blank picture; fitted, it spans most of it.
    with (
        MetricsEndpoint(_exposition(50)) as endpoint,
        PrometheusServer(tmp_path, [endpoint.target], labels={"host": "dioscuri"}) as prometheus,
    ):
        query = 'gpufleet_gpu_temperature_celsius{host="dioscuri",sensor="junction"}'
        prometheus.wait_for(query)
        # A sample or two, drawn at once (a run that ended as Prometheus came up): the query's
        # last point is now, so it holds the newest sample, not only points a step before.
        first = datetime.now(UTC)
        early = draw(prometheus.url, {
            "query": query,
            "start": (first - timedelta(minutes=15)).isoformat(),
            "end": (first + timedelta(minutes=5)).isoformat(),
            "marked": [(first - timedelta(seconds=30)).isoformat(), first.isoformat()],
        })  # fmt: skip
        assert early is not None and early.caption.startswith("50 °C")
        time.sleep(4)
        endpoint.set(_exposition(90))
        prometheus.wait_for(f"{query} == 90")
        hot = datetime.now(UTC)
        time.sleep(5)
        endpoint.set(_exposition(55))
        prometheus.wait_for(f"{query} == 55")
        cooled = datetime.now(UTC)
        time.sleep(3)
        spec = {
            "query": query,
            "start": (hot - timedelta(minutes=15)).isoformat(),
            "end": (cooled + timedelta(minutes=5)).isoformat(),
            "marked": [hot.isoformat(), cooled.isoformat()],
            "threshold": 87.0,
            "steps": [{"at": (hot + timedelta(seconds=1)).isoformat(), "label": "2 set_power_cap"}],
        }
        assert scrape_interval_seconds(prometheus.url) == 1.0
        picture = draw(prometheus.url, spec)
        assert picture is not None
        assert picture.caption.startswith("50 °C … 90 °C") and "threshold 87 °C" in picture.caption
        # The incident, 5 s of about 15: a third of the plot, not 0.4 % of a 20-minute one.
        assert colour_share(picture.png, BAND_RGB, within=8) > 0.1, "the incident is a sliver"
        # The line runs from the left of the plot to its right, not only at its right end.
        pixels = np.asarray(decoded(picture.png).convert("RGB"), dtype=np.int16)
        line = np.abs(pixels - np.array(PALETTE[0], dtype=np.int16)).max(axis=2) <= 30
        columns = np.flatnonzero(line[: HEIGHT * 3 // 4].any(axis=0))
        assert columns.min() < WIDTH * 0.2 and columns.max() > WIDTH * 0.9, columns
    (tmp_path / "young-prometheus.png").write_bytes(picture.png)  # to look at


# -- what the picture is made of -------------------------------------------------------------


def test_units_come_from_the_series_name_suffix() -> None:
    assert unit_of("gpufleet_gpu_temperature_celsius") == SUFFIXES["_celsius"]
    assert unit_of("gpufleet_gpu_power_watts") == SUFFIXES["_watts"]
    assert unit_of("gpufleet_gpu_utilization_ratio") == SUFFIXES["_ratio"]
    assert unit_of("gpufleet_llama_tokens_per_second") == SUFFIXES["_tokens_per_second"]
    assert (
        unit_of("server_model:gpufleet_tokens_per_second:current") == SUFFIXES["_tokens_per_second"]
    )
    assert unit_of("server_model:gpufleet_tokens_per_second:ratio") == SUFFIXES["_ratio"]
    assert unit_of("gpufleet_llama_decode_calls_total") is None
    assert unit_of("up") is None
    memory = unit_of("gpufleet_gpu_memory_used_bytes")
    assert memory is not None and memory.format(24 * GIB) == "24 GiB"
    assert SUFFIXES["_ratio"].format(0.985) == "98.5 %"


def test_a_querys_unit_is_its_series_unit_when_there_is_one() -> None:
    assert (
        unit_of_query('last_over_time(gpufleet_gpu_power_watts{host="a_bytes"}[1m])').symbol == "W"
    )
    assert unit_of_query("max by (host_celsius) (gpufleet_gpu_power_watts)").symbol == "W"
    assert unit_of_query("gpufleet_gpu_temperature_celsius - 5").symbol == "°C"
    # A quotient, a mix, or a counter's rate: plain numbers, never a wrong unit.
    assert (
        unit_of_query("gpufleet_gpu_memory_used_bytes / gpufleet_gpu_memory_total_bytes") == PLAIN
    )
    assert unit_of_query("gpufleet_gpu_power_watts + gpufleet_gpu_temperature_celsius") == PLAIN
    assert unit_of_query("rate(gpufleet_llama_decode_calls_total[5m])") == PLAIN
    # The result's own names win: a division by a number keeps the name off the result.
    assert unit_of_query("x", ["gpufleet_gpu_power_watts"]).symbol == "W"


def test_the_legend_names_series_by_what_tells_them_apart() -> None:
    series = [
        Series(
            {"__name__": "t_celsius", "host": "h", "gpu": str(g), "sensor": "edge"}, [(0.0, 1.0)]
        )
        for g in range(3)
    ]
    assert distinguishing_labels(series) == ["gpu"]
    assert legend_label(series[1].labels, ["gpu"]) == "gpu=1"
    assert chart_title("t_celsius", series) == "t_celsius · host=h sensor=edge"
    assert distinguishing_labels(series[:1]) == []
    long = legend_label({"server": "s" * 60}, ["server"])
    assert len(long) == 28 and long.endswith("…")


def test_at_most_six_series_are_drawn_and_the_caption_says_so(
    prometheus: PrometheusServer,
) -> None:
    spec = spec_of(temperature_run())
    query = " or ".join(
        f'label_replace(gpufleet_gpu_temperature_celsius{{gpu="0"}} + {i}, "copy", "{i}", "", "")'
        for i in range(8)
    )
    picture = draw(prometheus.url, {**spec, "query": query})
    assert picture is not None and "(+2 more not drawn)" in picture.caption


def test_time_ticks_are_round_utc_times() -> None:
    start = datetime(2026, 11, 30, 2, 47, tzinfo=UTC).timestamp()
    ticks = time_ticks(start, start + 30 * 60)
    assert [datetime.fromtimestamp(t, UTC).strftime("%H:%M") for t in ticks] == [
        "02:50",
        "03:00",
        "03:10",
    ]
    # A window of seconds (a young Prometheus) gets ticks too, not one or none.
    ticks = time_ticks(start + 3.4, start + 14.2)
    assert [datetime.fromtimestamp(t, UTC).strftime("%H:%M:%S") for t in ticks] == [
        "02:47:05",
        "02:47:10",
    ]


# -- the rules publish it ----------------------------------------------------------------------


def alert_rules() -> list[dict[str, Any]]:
    groups = yaml.safe_load(RULES.read_text())["groups"]
    return [rule for group in groups for rule in group["rules"] if "alert" in rule]


@pytest.mark.parametrize(
    "alertname",
    [
        "GpuTemperatureCritical",
        "ApuTemperatureCritical",
        "GpuMemoryNearlyFull",
        "TokensPerSecondDegraded",
    ],
)
def test_every_temperature_memory_and_speed_alert_publishes_its_chart(alertname: str) -> None:
    rules = [rule for rule in alert_rules() if rule["alert"] == alertname]
    assert rules
    for rule in rules:
        annotations = rule["annotations"]
        assert {"chart_query", "threshold_query", "threshold_label"} <= set(annotations)


def test_the_rendered_chart_queries_are_valid_promql() -> None:
    # Every rendered chart_query and threshold_query promtool checks parses as PromQL.
    seen = 0
    for path in sorted(RULE_TESTS.glob("*.yml")):
        for case in yaml.safe_load(path.read_text())["tests"]:
            for check in case.get("alert_rule_test", []):
                for expected in check.get("exp_alerts") or []:
                    annotations = expected.get("exp_annotations") or {}
                    for key in ("chart_query", "threshold_query"):
                        if key in annotations:
                            promql_parser.parse(annotations[key])
                            seen += 1
    assert seen >= 20


# -- who loads matplotlib ----------------------------------------------------------------------

PROBE = """
import json, sys
import {module}
print(json.dumps(sorted(name for name in sys.modules if name.split(".")[0] == "matplotlib")))
"""


@pytest.mark.parametrize(
    "module",
    [
        "exporter.cli",
        "exporter.node",
        "exporter.node.cli",
        "exporter.registry",
        "remediator.notify.graph",
        "remediator.notify.sender",
        "remediator.cli",
    ],
)
def test_matplotlib_is_loaded_only_to_draw(module: str) -> None:
    # The exporter and gpu-fleet-node never load it; the remediator only when it draws.
    done = subprocess.run(
        [sys.executable, "-c", PROBE.format(module=module)],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    assert json.loads(done.stdout) == []


def test_without_matplotlib_the_report_goes_without_a_picture(
    prometheus: PrometheusServer,
) -> None:
    # A remediator installed without the `report` extra: `import matplotlib` fails.
    script = (
        "import json, logging, sys\n"
        "sys.modules['matplotlib'] = None\n"
        "logging.basicConfig(level=logging.WARNING)\n"
        "from remediator.notify.graph import draw\n"
        "print(draw(sys.argv[1], json.loads(sys.argv[2])))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script, prometheus.url, json.dumps(spec_of(temperature_run()))],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    assert done.stdout.strip() == "None"
    assert "matplotlib is not installed" in done.stderr and "gpu-fleet[report]" in done.stderr


def test_the_chart_annotations_stay_out_of_the_reports_evidence() -> None:
    [report] = Reporter(SETTINGS, ROSTER).run_report(temperature_run())
    assert "description:" in report.content  # the other annotations are evidence
    for key in CHART_ANNOTATIONS:
        assert f"{key}:" not in report.content


def test_a_dry_run_marks_no_steps() -> None:
    run = replace(temperature_run(), decision="dry_run", outcome=None)
    assert "steps" not in spec_of(run)


def test_the_sender_uploads_the_chart_with_the_report(
    prometheus: PrometheusServer, tmp_path: Path
) -> None:
    # The production path: the report's spec journaled in the outbox, the sender drawing it
    # from Prometheus and uploading it to (a stand-in) Zulip with the message.
    from remediator.journal import Journal
    from tests.test_notify_sender import STREAM, make_sender
    from tests.zulip_stand_in import ZulipStandIn

    [report] = Reporter(SETTINGS, ROSTER).run_report(temperature_run())
    journal = Journal(f"sqlite:///{tmp_path / 'journal.db'}", replica_id="central-1")
    try:
        journal.enqueue_report(report.topic, report.content, run_id=7, graph=report.graph)
        with ZulipStandIn(streams=(STREAM,)) as zulip:
            sender = make_sender(
                journal, zulip.write_zuliprc(tmp_path / "zuliprc"), prometheus_url=prometheus.url
            )
            assert sender.send_due() == 1
            [(path, png)] = zulip.uploads.items()
            [message] = zulip.messages
    finally:
        journal.close()
    assert f"]({path})" in message.content and "GPU 0 junction: critical" in message.content
    assert_golden_png(png, "chart-gpu-temperature", tmp_path)
