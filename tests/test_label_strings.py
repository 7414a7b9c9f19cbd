"""Strings from sources become clean label values, and one bad string never fails a scrape.

The end-to-end case serves the real llama-server's recorded answers (tests/recorded_llama.py)
with one change: `/props` carries a lone surrogate in its
`model_alias`, escaped as JSON allows (`"\\ud800"`), which Python's decoder turns into a `str`
that cannot be encoded. Before, the whole exporter answered HTTP 500 on every scrape.
"""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.metrics_core import Metric

from exporter.exposition import TextWriter
from exporter.http import MetricsServer
from exporter.registry import ExporterSettings, FleetCollector, build_registry
from exporter.sources.llama_api import parse_models, parse_props
from exporter.sources.text import LABEL_LIMIT, clean_label
from fleet.roster import Host
from tests.recorded_llama import JSON, RecordedLlama

FIXTURES = Path(__file__).parent / "fixtures" / "llama"


def test_clean_label_keeps_plain_values_and_cleans_the_rest() -> None:
    for plain in ("0", "gemma-4-12b", "NVIDIA H200", "0000:41:00.0", "Strix Halo — Radeon 8060S"):
        assert clean_label(plain) == plain
    assert clean_label("a\ud800b") == "a\ufffdb"
    assert clean_label("line\nbreak\x00\x7f\x9b") == "line\ufffdbreak\ufffd\ufffd\ufffd"
    long = clean_label("x" * 2_000_000)
    assert len(long) == LABEL_LIMIT and long.endswith("…")
    for value in ("a\ud800b", "x" * 2_000_000, "\udfff" * 300):
        clean_label(value).encode()  # always encodable


def test_props_and_models_strings_are_cleaned_where_read() -> None:
    props = json.loads((FIXTURES / "props.json").read_text())
    props["model_alias"] = "\ud800" + "a" * 5000
    props["build_info"] = "b1-\x1b[31m"
    parsed = parse_props(json.dumps(props).encode())  # ensure_ascii: the surrogate escaped
    assert parsed.alias.startswith("\ufffd") and len(parsed.alias) == LABEL_LIMIT
    assert parsed.build == "b1-\ufffd[31m"
    models = {
        "data": [
            {"id": "m\ud800", "status": {"value": "loaded"}},
            {"id": "m\udfff", "status": {"value": "loaded"}},  # the same label once cleaned
        ]
    }
    [model] = parse_models(json.dumps(models).encode())
    assert model.id == "m\ufffd"


class _Surrogates:
    """A collector whose second family holds a label value no encoder can write."""

    name = "bad"

    def collect(self) -> Iterator[Metric]:
        good = GaugeMetricFamily("gpufleet_test_good", "fine", labels=["x"])
        good.add_metric(["ok"], 1.0)
        yield good
        bad = GaugeMetricFamily("gpufleet_test_bad", "not encodable", labels=["x"])
        bad.add_metric(["\ud800"], 1.0)
        bad.add_metric(["fine"], 2.0)
        yield bad

    def close(self) -> None:
        pass


class _Fine:
    name = "fine"

    def collect(self) -> Iterator[Metric]:
        family = GaugeMetricFamily("gpufleet_test_fine", "fine")
        family.add_metric([], 3.0)
        yield family

    def close(self) -> None:
        pass


def test_an_unencodable_family_costs_its_collector_not_the_scrape(
    caplog: pytest.LogCaptureFixture,
) -> None:
    fleet = FleetCollector([_Surrogates(), _Fine()])
    for scrape in (1, 2):
        text = TextWriter().render(fleet.collect()).decode()
        assert 'gpufleet_test_good{x="ok"} 1.0' in text
        assert "gpufleet_test_fine 3.0" in text
        assert "gpufleet_test_bad" not in text  # the whole family: its good sample too
        assert 'gpufleet_exporter_collector_success{collector="bad"} 0.0' in text
        assert 'gpufleet_exporter_collector_success{collector="fine"} 1.0' in text
        dropped = "gpufleet_exporter_series_dropped_total"
        bad = f'{dropped}{{collector="bad",reason="unrenderable",server=""}}'
        assert f"{bad} {2.0 * scrape}" in text
        assert f'{dropped}{{collector="fine",reason="unrenderable",server=""}} 0.0' in text
    # Logged once, when it appeared, naming the family.
    assert [r.getMessage() for r in caplog.records].count(
        "collector bad failed: left out, not writable as UTF-8 text: gpufleet_test_bad"
    ) == 1


def llama_host(url: str) -> Host:
    return Host.model_validate(
        {
            "address": "127.0.0.1",
            "servers": {
                "alpha": {
                    "engine": "llama",
                    "url": url,
                    "unit": "llama-server@alpha.service",
                    "role": "gpu-dense",
                    "model": "tiny",
                }
            },
        }
    )


def test_a_surrogate_alias_leaves_the_exporter_answering(tmp_path: Path) -> None:
    props = json.loads((FIXTURES / "props.json").read_text())
    props["model_alias"] = "\ud800"
    with RecordedLlama({"/props": (json.dumps(props).encode(), JSON)}) as llama:
        settings = ExporterSettings(host=llama_host(llama.url), sysfs=str(tmp_path / "sys"))
        registry, fleet = build_registry(settings)
        server = MetricsServer(registry, "127.0.0.1", 0)
        server.start()
        try:
            for _ in range(2):
                with urllib.request.urlopen(f"http://127.0.0.1:{server.port}/metrics") as answer:
                    assert answer.status == 200
                    text = answer.read().decode()
                assert 'alias="\ufffd"' in text
                assert 'gpufleet_llama_up{server="alpha"} 1.0' in text
        finally:
            server.stop()
            fleet.close()
