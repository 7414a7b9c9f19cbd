"""Reliability 2: hostile data at the exporter — what model servers, sysfs and /proc may say.

Every case goes through a collector's real read path: llama-server's `/props`, `/metrics`,
`/slots` and a router's `/models` and vLLM's `/metrics` served over HTTP from local servers,
hwmon files in a fixture sysfs tree (`tests/sysfs_tree.py`), `/proc` files in a fixture procfs.
The inputs are the recorded answers of the real servers, broken field by field (`hypothesis`,
fixed `max_examples`, derandomised). For each:

- no crash: `collect()` returns (a `CollectorError` would be a config fault: none here);
- no scrape lost: the exposition renders and parses (prometheus_client's parser, and
  `promtool check metrics` on every tenth case);
- never a duplicate series;
- never a value invented, only the bad field dropped: a series is there only when its input
  field was a value of the right type, and then with that value; the good fields beside a bad
  one are still exported.
"""

from __future__ import annotations

import contextlib
import copy
import json
import math
import re
import subprocess
import threading
from collections import Counter
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

from exporter.collectors.hwmon import HwmonCollector
from exporter.collectors.llama import LlamaCollector
from exporter.collectors.vllm import VllmCollector
from exporter.exposition import TextWriter
from exporter.sources.procfs import parse_stat, parse_status
from fleet.roster import Server
from tests.reliability.figures import Figures, sized
from tests.reliability.strategies import JSON_VALUES
from tests.sysfs_tree import ACPITZ, K10TEMP, nvme_spec, write_hwmon_chip
from tests.vllm_stand_in import VllmStandIn

pytestmark = pytest.mark.reliability

SUITE = "2 exporter data"
FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"
_HYPOTHESIS: dict[str, Any] = {
    "derandomize": True,
    "deadline": None,
    "database": None,
    "suppress_health_check": [
        HealthCheck.too_slow,
        HealthCheck.data_too_large,
        HealthCheck.function_scoped_fixture,
    ],
}
Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]

# Values a broken or hostile server puts where a number belongs.
GARBAGE = st.one_of(
    JSON_VALUES,
    st.sampled_from([10**400, 2**63, -(2**63) - 1, 1e308, -0.0, True, False, "12", "", None]),
)
# Tokens where the exposition's value belongs.
BAD_NUMBERS = st.one_of(
    st.sampled_from(
        [
            "NaN",
            "+Inf",
            "-Inf",
            "-1",
            "1e400",
            "0x10",
            "abc",
            "",
            "1,5",
            "1_000",
            "१२",
            "1e",
            "--1",
            "9" * 400,
        ]
    ),
    st.floats().map(repr),
    st.text(max_size=12),
)


# -- the exposition's checks -------------------------------------------------------------------


class Exposition:
    """What one scrape of a collector rendered: its samples, and everything wrong with it."""

    def __init__(self, collector: Any, promtool: bool) -> None:
        families = list(collector.collect())  # raises on a crash: the test fails with it
        # The exporter's own writer, as `/metrics` serves it: raises when the scrape is lost.
        self.text = TextWriter().render(families).decode()
        self.samples: Samples = {}
        seen: Counter[tuple[str, frozenset[tuple[str, str]]]] = Counter()
        for family in text_string_to_metric_families(self.text):
            for sample in family.samples:
                key = (sample.name, frozenset(sample.labels.items()))
                seen[key] += 1
                self.samples[key] = sample.value
        self.duplicates = [k for k, n in seen.items() if n > 1]
        if promtool:
            checked = subprocess.run(
                ["promtool", "check", "metrics"],
                input=self.text,
                capture_output=True,
                text=True,
                check=False,
            )
            # promtool lints names and help too (exit 3): only a parse error (1) is a lost scrape.
            assert checked.returncode in (0, 3), checked.stderr

    def get(self, name: str, **labels: str) -> float | None:
        return self.samples.get((name, frozenset(labels.items())))

    def names(self) -> set[str]:
        return {name for name, _ in self.samples}


def _same(exported: float, given: Any) -> bool:
    if isinstance(given, float) and math.isnan(given):
        return math.isnan(exported)
    return exported == float(given)


def _record(figures: Figures, suite: str, counts: dict[str, int]) -> None:
    figures.add(suite, "cases", counts.get("cases", 0))
    figures.zero(suite, "crashes or lost scrapes", counts.get("lost", 0))
    figures.zero(suite, "duplicate series", counts.get("duplicates", 0))
    figures.zero(suite, "values invented or wrong", counts.get("invented", 0))
    figures.zero(suite, "good fields dropped", counts.get("dropped", 0))


# -- llama-server ------------------------------------------------------------------------------


class _Answers:
    """A local HTTP server answering each path (query ignored) with the body it is given."""

    def __init__(self) -> None:
        self.bodies: dict[str, bytes] = {"/health": b'{"status":"ok"}'}
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                body = outer.bodies.get(self.path.split("?", 1)[0])
                self.send_response(200 if body is not None else 404)
                self.send_header("Content-Length", str(len(body or b"")))
                self.end_headers()
                self.wfile.write(body or b"")

            def log_message(self, format: str, *args: object) -> None:
                del format, args

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        threading.Thread(target=self._server.serve_forever, args=(0.05,), daemon=True).start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


@pytest.fixture
def answers() -> Iterator[_Answers]:
    server = _Answers()
    yield server
    server.close()


def _server(url: str, engine: str = "llama", **extra: Any) -> Server:
    return Server.model_validate(
        {
            "engine": engine,
            "url": url,
            "unit": "x.service",
            "role": "gpu-dense",
            "model": "tiny",
            **extra,
        }
    )


PROPS: dict[str, Any] = json.loads((FIXTURES / "llama" / "props.json").read_text())
SLOTS: list[dict[str, Any]] = json.loads((FIXTURES / "llama" / "slots-busy.json").read_text())
METRICS = (FIXTURES / "llama" / "metrics-busy.txt").read_text()
_PROPS_FIELDS = ("n_ctx", "total_slots", "model_alias", "build_info", "is_sleeping")
_SLOT_FIELDS = ("id_task", "n_decoded", "n_predict", "n_ctx")
_OURS = {
    "llamacpp:prompt_tokens_total": "gpufleet_llama_prompt_tokens_total",
    "llamacpp:tokens_predicted_total": "gpufleet_llama_predicted_tokens_total",
    "llamacpp:n_decode_total": "gpufleet_llama_decode_calls_total",
    "llamacpp:requests_processing": "gpufleet_llama_requests_processing",
    "llamacpp:requests_deferred": "gpufleet_llama_requests_deferred",
    "llamacpp:n_tokens_max": "gpufleet_llama_tokens_max",
}


@st.composite
def _llama_case(draw: st.DrawFn) -> dict[str, Any]:
    """Recorded answers of a busy llama-server, broken field by field (which ones: `broken`)."""
    props = copy.deepcopy(PROPS)
    props["is_sleeping"] = False
    broken: dict[str, Any] = {}
    for field in draw(st.sets(st.sampled_from(_PROPS_FIELDS), max_size=3)):
        value = draw(GARBAGE)
        broken[field] = value
        if field == "n_ctx":
            props["default_generation_settings"]["n_ctx"] = value
        else:
            props[field] = value
    slots = copy.deepcopy(SLOTS)
    slot_broken: dict[tuple[int, str], Any] = {}
    for index, field in draw(
        st.sets(
            st.tuples(st.integers(0, len(slots) - 1), st.sampled_from(_SLOT_FIELDS)), max_size=3
        )
    ):
        value = draw(GARBAGE)
        slot_broken[(index, field)] = value
        if field == "n_decoded":
            slots[index]["next_token"][0]["n_decoded"] = value
        elif field == "n_predict":
            slots[index]["params"]["n_predict"] = value
        else:
            slots[index][field] = value
    lines = METRICS.splitlines()
    metric_broken: dict[str, str | None] = {}
    for name in draw(st.sets(st.sampled_from(sorted(_OURS)), max_size=2)):
        token = draw(st.one_of(st.none(), BAD_NUMBERS))  # None: the line is gone
        metric_broken[name] = token
        lines = [
            (f"{name} {token}" if token is not None else "#")
            if line.startswith(f"{name} ")
            else line
            for line in lines
        ]
    whole = draw(st.integers(0, 12))
    bodies = {
        "/props": json.dumps(props).encode(),
        "/slots": json.dumps(slots).encode(),
        "/metrics": ("\n".join(lines) + "\n").encode(),
    }
    replaced = None
    if whole < 3:  # a whole answer replaced by junk
        replaced = ("/props", "/slots", "/metrics")[whole]
        bodies[replaced] = draw(
            st.one_of(st.binary(max_size=300), JSON_VALUES.map(lambda v: json.dumps(v).encode()))
        )
    return {
        "bodies": bodies,
        "props": broken,
        "slots": slot_broken,
        "metrics": metric_broken,
        "replaced": replaced,
    }


def _int_value(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _metric_input(body: bytes, name: str) -> list[float]:
    """The values the input exposition gives `name` (unlabelled lines), as floats."""
    found = []
    for line in body.decode("utf-8", "replace").splitlines():
        if line.startswith(f"{name} "):
            with contextlib.suppress(ValueError):
                found.append(float(line.split(" ", 1)[1]))
    return found


def _check_llama(case: dict[str, Any], scrape: Exposition) -> tuple[list[str], list[str]]:
    """(invented or wrong values, good fields dropped) of one llama-server case."""
    invented: list[str] = []
    dropped: list[str] = []
    bodies = case["bodies"]
    if scrape.get("gpufleet_llama_up", server="alpha") != 1.0:
        dropped.append("up")
    try:
        props = json.loads(bodies["/props"])
    except ValueError:
        props = None
    props_ok = isinstance(props, dict)
    n_ctx = props.get("default_generation_settings", {}) if props_ok else None
    n_ctx = n_ctx.get("n_ctx") if isinstance(n_ctx, dict) else None
    context = scrape.get("gpufleet_llama_context_tokens", server="alpha", served_model="")
    if context is not None and not (_int_value(n_ctx) and _same(context, n_ctx)):
        invented.append(f"context_tokens {context} from n_ctx {n_ctx!r}")
    if (
        context is None
        and props_ok
        and _int_value(n_ctx)
        and n_ctx
        and not case["props"].keys() & {"n_ctx"}
    ):
        dropped.append("context_tokens")
    sleeping = scrape.get("gpufleet_llama_sleeping", server="alpha")
    given_sleeping = props.get("is_sleeping") if props_ok else None
    if sleeping is not None and not (
        isinstance(given_sleeping, bool) and sleeping == given_sleeping
    ):
        invented.append(f"sleeping {sleeping} from {given_sleeping!r}")
    info = [labels for name, labels in scrape.samples if name == "gpufleet_llama_info"]
    if len(info) != 1:
        dropped.append(f"info ({len(info)} series)")
    else:
        alias = dict(info[0]).get("alias", "")
        given_alias = props.get("model_alias") if props_ok else None
        if alias and alias != given_alias:
            invented.append(f"alias {alias!r} from {given_alias!r}")
    for source, ours in _OURS.items():
        exported = scrape.get(ours, server="alpha", served_model="")
        values = _metric_input(bodies["/metrics"], source)
        if exported is not None and not any(_same(exported, v) for v in values):
            invented.append(f"{ours} {exported} from {values}")
    # The fields left alone still arrive when their answer as a whole was good.
    if case["replaced"] is None and not case["metrics"]:
        for ours in _OURS.values():
            if scrape.get(ours, server="alpha", served_model="") is None:
                dropped.append(ours)
    try:
        slots = json.loads(bodies["/slots"])
    except ValueError:
        slots = None
    for (name, labels), value in scrape.samples.items():
        if name not in ("gpufleet_llama_slot_decoded_tokens", "gpufleet_llama_slot_predict_limit"):
            continue
        slot = int(dict(labels)["slot"])
        entry = (
            next((s for s in slots if isinstance(s, dict) and s.get("id") == slot), None)
            if isinstance(slots, list)
            else None
        )
        if entry is None:
            invented.append(f"{name} of slot {slot}, which /slots does not list")
            continue
        if name.endswith("decoded_tokens"):
            token = entry.get("next_token")
            given = (
                token[0].get("n_decoded")
                if isinstance(token, list) and token and isinstance(token[0], dict)
                else None
            )
            if not (_int_value(given) and _same(value, given)):
                invented.append(f"{name}{{slot={slot}}} {value} from {given!r}")
        else:
            params = entry.get("params")
            given = params.get("n_predict") if isinstance(params, dict) else None
            number = given if isinstance(given, int) and not isinstance(given, bool) else None
            # -1 is "no cap": an infinite limit.
            if number is None or value != (math.inf if number < 0 else float(number)):
                invented.append(f"{name}{{slot={slot}}} {value} from {given!r}")
    return invented, dropped


def test_hostile_llama_server_answers(answers: _Answers, figures: Figures) -> None:
    counts: Counter[str] = Counter()
    failures: list[str] = []

    @settings(max_examples=sized(150, 1500), **_HYPOTHESIS)
    @given(case=_llama_case())
    def scrape(case: dict[str, Any]) -> None:
        answers.bodies.update(case["bodies"])
        collector = LlamaCollector({"alpha": _server(answers.url, timeout_seconds=5)})
        counts["cases"] += 1
        try:
            try:
                exposition = Exposition(collector, promtool=counts["cases"] % 10 == 0)
            except Exception as exc:  # a crash or a lost scrape: counted, then failed below
                counts["lost"] += 1
                failures.append(
                    f"lost: {type(exc).__name__}: {exc}; case {case['props']} "
                    f"{case['slots']} {case['metrics']} {case['replaced']}"
                )
                raise
        finally:
            collector.close()
        invented, dropped = _check_llama(case, exposition)
        counts["duplicates"] += len(exposition.duplicates)
        counts["invented"] += len(invented)
        counts["dropped"] += len(dropped)
        assert not exposition.duplicates and not invented and not dropped, (
            exposition.duplicates,
            invented,
            dropped,
            case["props"],
            case["slots"],
            case["metrics"],
            case["replaced"],
        )

    try:
        scrape()
    finally:
        _record(figures, f"{SUITE}: llama-server", counts)
    assert failures == []


@st.composite
def _router_models(draw: st.DrawFn) -> tuple[bytes, list[Any]]:
    entries: list[Any] = []
    for index in range(draw(st.integers(0, 4))):
        status: dict[str, Any] = {
            "value": draw(st.sampled_from(["loaded", "unloaded", "sleeping", "loading"]))
        }
        if draw(st.integers(0, 3)) == 0:
            status = {"value": "unloaded", "failed": True, "exit_code": draw(GARBAGE)}
        entry: Any = {"id": f"m{index}", "object": "model", "status": status}
        if draw(st.integers(0, 5)) == 0:
            entry = draw(GARBAGE)
        elif draw(st.integers(0, 5)) == 0:
            entry[draw(st.sampled_from(["id", "status"]))] = draw(GARBAGE)
        entries.append(entry)
    data: Any = {"object": "list", "data": entries}
    if draw(st.integers(0, 8)) == 0:
        data = draw(GARBAGE)
    return json.dumps(data).encode(), entries


def test_hostile_router_models(answers: _Answers, figures: Figures) -> None:
    counts: Counter[str] = Counter()
    router_props = json.dumps({"role": "router", "build_info": "b6100-1a2b3c4"}).encode()

    @settings(max_examples=sized(60, 500), **_HYPOTHESIS)
    @given(models=_router_models())
    def scrape(models: tuple[bytes, list[Any]]) -> None:
        body, entries = models
        # The children answer the same recorded /props and /metrics (router mode, ?model=).
        answers.bodies.update(
            {"/models": body, "/metrics": METRICS.encode(), "/props": router_props, "/slots": b"[]"}
        )
        collector = LlamaCollector({"alpha": _server(answers.url, timeout_seconds=5, router=True)})
        counts["cases"] += 1
        try:
            exposition = Exposition(collector, promtool=counts["cases"] % 10 == 0)
        except Exception:
            counts["lost"] += 1
            raise
        finally:
            collector.close()
        counts["duplicates"] += len(exposition.duplicates)
        invented = []
        for (name, labels), value in exposition.samples.items():
            if name == "gpufleet_llama_model_exit_code":
                model = dict(labels)["served_model"]
                given = next(
                    (
                        e["status"].get("exit_code")
                        for e in entries
                        if isinstance(e, dict)
                        and e.get("id") == model
                        and isinstance(e.get("status"), dict)
                    ),
                    None,
                )
                if not (_int_value(given) and _same(value, given)):
                    invented.append(f"exit code {value} of {model} from {given!r}")
        counts["invented"] += len(invented)
        assert not exposition.duplicates and not invented, (exposition.duplicates, invented)
        assert exposition.get("gpufleet_llama_up", server="alpha") == 1.0

    try:
        scrape()
    finally:
        _record(figures, f"{SUITE}: router /models", counts)


# -- vLLM --------------------------------------------------------------------------------------

VLLM_METRICS = (FIXTURES / "vllm" / "metrics-v1.txt").read_text()
_VLLM_OURS = {
    "vllm:num_requests_running": "gpufleet_vllm_requests_running",
    "vllm:num_requests_waiting": "gpufleet_vllm_requests_waiting",
}


@st.composite
def _vllm_text(draw: st.DrawFn) -> str:
    lines = VLLM_METRICS.splitlines()
    samples = [i for i, line in enumerate(lines) if line.startswith("vllm:")]
    for index in draw(st.sets(st.sampled_from(samples), max_size=4)):
        line = lines[index]
        how = draw(st.integers(0, 3))
        if how == 0:
            lines[index] = "#"
        elif how == 1:
            lines[index] = line.rsplit(" ", 1)[0] + " " + draw(BAD_NUMBERS)
        elif how == 2:
            lines.append(line)  # the same series twice
        else:
            lines[index] = line.replace(
                "{",
                "{"
                + draw(
                    st.sampled_from(['engine="9",', 'x="\\n",', 'model_name="other",', '"bad",'])
                ),
                1,
            )
    if draw(st.integers(0, 10)) == 0:
        return draw(st.text(max_size=300))
    return "\n".join(lines) + "\n"


def test_hostile_vllm_metrics(figures: Figures) -> None:
    counts: Counter[str] = Counter()
    with VllmStandIn(FIXTURES / "vllm" / "metrics-v1.txt") as vllm:

        @settings(max_examples=sized(150, 1500), **_HYPOTHESIS)
        @given(text=_vllm_text())
        def scrape(text: str) -> None:
            vllm.serve_metrics_text(text)
            collector = VllmCollector(
                {"gamma": _server(vllm.url, engine="vllm", timeout_seconds=5)}
            )
            counts["cases"] += 1
            try:
                exposition = Exposition(collector, promtool=counts["cases"] % 10 == 0)
            except Exception:
                counts["lost"] += 1
                raise
            finally:
                collector.close()
            counts["duplicates"] += len(exposition.duplicates)
            try:
                given = Counter[str]()
                present: set[str] = set()
                for family in text_string_to_metric_families(text):
                    for sample in family.samples:
                        if sample.name in _VLLM_OURS:
                            given[sample.name] += sample.value  # type: ignore[assignment]
                            present.add(sample.name)
            except (ValueError, IndexError, TypeError):
                given, present = Counter(), set()
            invented = []
            for source, ours in _VLLM_OURS.items():
                value = exposition.get(ours, server="gamma")
                if value is not None and (source not in present or not _same(value, given[source])):
                    invented.append(f"{ours} {value} from {given.get(source)!r}")
            counts["invented"] += len(invented)
            assert not exposition.duplicates and not invented, (exposition.duplicates, invented)
            assert exposition.get("gpufleet_vllm_up", server="gamma") == 1.0

        try:
            scrape()
        finally:
            _record(figures, f"{SUITE}: vLLM /metrics", counts)


# -- sysfs / hwmon -----------------------------------------------------------------------------

_SYSFS_GARBAGE = st.one_of(
    st.binary(max_size=24),
    st.sampled_from(
        [
            b"",
            b"\n",
            b"abc\n",
            b"-",
            b"1_000\n",
            b"+42000\n",
            b" 42000 \n",
            b"42000\x00",
            b"0x10\n",
            b"9" * 400,
            b"-273150\n",
            b"\xff\xfe",
        ]
    ),
    st.integers().map(lambda n: f"{n}\n".encode()),
)
_ASCII_INT = re.compile(rb"\s*[-+]?[0-9]+\s*")


def test_hostile_hwmon_files(tmp_path: Path, figures: Figures) -> None:
    sysfs = tmp_path / "sys"
    chips = {
        "k10temp": write_hwmon_chip(sysfs, K10TEMP),
        "acpitz": write_hwmon_chip(sysfs, ACPITZ),
        "nvme": write_hwmon_chip(sysfs, nvme_spec(0, "0000:01:00.0")),
    }
    files = sorted(
        (chip, path.name)
        for chip, d in chips.items()
        for path in d.iterdir()
        if re.fullmatch(r"temp\d+_(input|crit)", path.name)
    )
    originals = {(c, f): (chips[c] / f).read_bytes() for c, f in files}
    collector = HwmonCollector(str(sysfs))
    baseline = Exposition(collector, promtool=True)
    counts: Counter[str] = Counter()

    @settings(max_examples=sized(150, 1500), **_HYPOTHESIS)
    @given(broken=st.dictionaries(st.sampled_from(files), _SYSFS_GARBAGE, min_size=1, max_size=3))
    def scrape(broken: dict[tuple[str, str], bytes]) -> None:
        for (chip, name), content in originals.items():
            (chips[chip] / name).write_bytes(broken.get((chip, name), content))
        counts["cases"] += 1
        try:
            exposition = Exposition(collector, promtool=counts["cases"] % 10 == 0)
        except Exception:
            counts["lost"] += 1
            raise
        counts["duplicates"] += len(exposition.duplicates)
        invented, dropped = [], []
        for key, value in baseline.samples.items():
            name, labels = key
            if not name.startswith("gpufleet_host_temperature"):
                continue
            now = exposition.samples.get(key)
            # Which file feeds this series: temp<N>_input or _crit of the chip (by label).
            source = [
                (c, f)
                for (c, f) in broken
                if c == dict(labels).get("chip")
                and f.endswith("_crit" if "critical" in name else "_input")
            ]
            if not source:
                if now != value:
                    dropped.append(f"{name}{dict(labels)}: {value} -> {now}")
                continue
            if now is None or now == value:
                continue  # dropped, or the broken file was another sensor's
            garbage = [broken[s] for s in source]
            if not any(_ASCII_INT.fullmatch(g) and now == int(g) / 1000 for g in garbage):
                invented.append(f"{name}{dict(labels)} {now} from {garbage!r}")
        counts["invented"] += len(invented)
        counts["dropped"] += len(dropped)
        assert not exposition.duplicates and not invented and not dropped, (invented, dropped)

    try:
        scrape()
    finally:
        collector.close()
        _record(figures, f"{SUITE}: hwmon files", counts)


_AMD_FILES = (
    ("device", "gpu_busy_percent"),
    ("device", "mem_busy_percent"),
    ("device", "mem_info_vram_used"),
    ("device", "mem_info_vram_total"),
    ("device", "mem_info_gtt_used"),
    ("device", "pp_dpm_sclk"),
    ("device", "pp_dpm_mclk"),
    ("hwmon", "temp1_input"),
    ("hwmon", "temp2_input"),
    ("hwmon", "power1_average"),
    ("hwmon", "power1_cap"),
    ("hwmon", "fan1_input"),
    ("hwmon", "freq1_input"),
)


def test_hostile_amdgpu_files(tmp_path: Path, figures: Figures) -> None:
    from exporter.collectors.amd import AmdCollector
    from fleet.gpu_index import GpuIndex
    from tests.sysfs_tree import discrete_spec, write_amd_card

    card = write_amd_card(tmp_path / "sys", discrete_spec(0))

    def path(where: str, name: str) -> Path:
        return card.file(name) if where == "device" else card.hwmon_file(name)

    originals = {f: path(*f).read_bytes() for f in _AMD_FILES}
    collector = AmdCollector(str(tmp_path / "sys"), gpu_index=GpuIndex(), expected_count=1)
    collector.pci_bus_ids()
    baseline = Exposition(collector, promtool=True)
    assert baseline.get("gpufleet_gpu_up", gpu="0") == 1.0
    counts: Counter[str] = Counter()

    @settings(max_examples=sized(150, 1500), **_HYPOTHESIS)
    @given(
        broken=st.dictionaries(st.sampled_from(_AMD_FILES), _SYSFS_GARBAGE, min_size=1, max_size=3)
    )
    def scrape(broken: dict[tuple[str, str], bytes]) -> None:
        for file, content in originals.items():
            path(*file).write_bytes(broken.get(file, content))
        counts["cases"] += 1
        try:
            exposition = Exposition(collector, promtool=counts["cases"] % 10 == 0)
        except Exception:
            counts["lost"] += 1
            raise
        counts["duplicates"] += len(exposition.duplicates)
        invented, dropped = [], []
        # A garbled field is not a lost GPU, and its identity stays.
        if exposition.get("gpufleet_gpu_up", gpu="0") != 1.0:
            dropped.append("gpu_up")
        if "gpufleet_gpu_info" not in exposition.names():
            dropped.append("gpu_info")
        digits = any(re.search(rb"[0-9]", content) for content in broken.values())
        for key, value in exposition.samples.items():
            if key[0].startswith("gpufleet_exporter"):
                continue
            was = baseline.samples.get(key)
            if was is None:
                invented.append(f"new series {key}")
            elif value != was and not (math.isnan(value) and math.isnan(was)) and not digits:
                invented.append(f"{key[0]}{dict(key[1])} {was} -> {value} from {broken!r}")
        vanished = [
            k
            for k in baseline.samples
            if k not in exposition.samples and not k[0].startswith("gpufleet_exporter")
        ]
        # One file feeds a field or two (a pool's used and its ratio): never the whole card.
        if len(vanished) > 3 * len(broken):
            dropped.append(f"{len(vanished)} series gone for {len(broken)} bad files")
        counts["invented"] += len(invented)
        counts["dropped"] += len(dropped)
        assert not exposition.duplicates and not invented and not dropped, (invented, dropped)

    try:
        scrape()
    finally:
        collector.close()
        _record(figures, f"{SUITE}: amdgpu files", counts)


def test_hostile_cpuinfo(tmp_path: Path, figures: Figures) -> None:
    """k10temp's default critical, from `<procfs>/cpuinfo`: one of the documented values."""
    sysfs, procfs = tmp_path / "sys", tmp_path / "proc"
    write_hwmon_chip(sysfs, K10TEMP)
    procfs.mkdir()
    counts: Counter[str] = Counter()
    block = st.lists(
        st.tuples(
            st.sampled_from(["vendor_id", "cpu family", "model", "model name", "flags", ""]),
            st.one_of(
                st.sampled_from(
                    [
                        "AuthenticAMD",
                        "GenuineIntel",
                        "26",
                        "25",
                        "0x1a",
                        "1_0",
                        "96",
                        "112",
                        "-1",
                        "9" * 40,
                        "",
                    ]
                ),
                st.text(max_size=12),
            ),
        ),
        max_size=8,
    )

    @settings(max_examples=sized(150, 1500), **_HYPOTHESIS)
    @given(lines=block, raw=st.one_of(st.none(), st.binary(max_size=200)))
    def scrape(lines: list[tuple[str, str]], raw: bytes | None) -> None:
        text = "".join(f"{key}\t: {value}\n" for key, value in lines).encode(errors="replace")
        (procfs / "cpuinfo").write_bytes(raw if raw is not None else text)
        collector = HwmonCollector(str(sysfs), procfs=str(procfs))
        counts["cases"] += 1
        try:
            exposition = Exposition(collector, promtool=False)
        except Exception:
            counts["lost"] += 1
            raise
        finally:
            collector.close()
        critical = exposition.get(
            "gpufleet_host_temperature_critical_celsius",
            chip="k10temp",
            sensor="Tctl",
            source="default",
        )
        if critical not in (90.0, 95.0, 100.0):
            counts["invented"] += 1
        assert critical in (90.0, 95.0, 100.0), (critical, lines, raw)

    try:
        scrape()
    finally:
        _record(figures, f"{SUITE}: /proc/cpuinfo", counts)


# -- /proc -------------------------------------------------------------------------------------

STAT = (
    b"4242 (llama-server) S 1 4242 4242 0 -1 4194560 51962 0 1 0 1234 567 0 0 20 0 9 0 "
    b"987654 3221225472 12345 18446744073709551615 1 1 0 0 0 0 0 4096 17663 0 0 0 17 3 0 0 "
    b"0 0 0 0 0 0 0 0 0 0 0\n"
)
_STAT_FIELDS = {4: "ppid", 14: "utime_ticks", 15: "stime_ticks", 20: "threads", 22: "start_ticks"}
STATUS = (
    b"Name:\tllama-server\nState:\tS (sleeping)\nUid:\t1000\t1001\t1001\t1001\n"
    b"VmRSS:\t  1780 kB\nThreads:\t9\n"
)


def test_hostile_proc_files(figures: Figures) -> None:
    counts: Counter[str] = Counter()
    good_stat = parse_stat(STAT)
    good_status = parse_status(STATUS)
    assert good_stat is not None

    @settings(max_examples=sized(300, 3000), **_HYPOTHESIS)
    @given(
        field=st.sampled_from(sorted(_STAT_FIELDS)),
        garbage=_SYSFS_GARBAGE,
        comm=st.binary(max_size=20),
        status_line=st.sampled_from(["Uid", "VmRSS", "Threads"]),
    )
    def parse(field: int, garbage: bytes, comm: bytes, status_line: str) -> None:
        counts["cases"] += 1
        # No whitespace (it would split the field) and no parentheses (the kernel's numbers
        # have none; a ')' among them would move the end of the name).
        token = re.sub(rb"[\s()]", b"", garbage) or b"x"
        fields = STAT[STAT.rfind(b")") + 2 :].split(b" ")
        fields[field - 3] = token
        # A command name may hold spaces, ')' and any byte (prctl): the fields follow the last ')'.
        line = b"4242 (" + comm.replace(b"\n", b"") + b") " + b" ".join(fields)
        stat = parse_stat(line)
        invented, dropped = [], []
        if stat is None:
            dropped.append(f"the whole line for field {field} = {token!r}")
        else:
            value = getattr(stat, _STAT_FIELDS[field])
            if value is not None and not (_ASCII_INT.fullmatch(token) and value == int(token)):
                invented.append(f"{_STAT_FIELDS[field]} {value} from {token!r}")
            for other, attribute in _STAT_FIELDS.items():
                if other != field and getattr(stat, attribute) != getattr(good_stat, attribute):
                    dropped.append(f"{attribute} beside a bad {_STAT_FIELDS[field]}")
        text = re.sub(
            rb"(?m)^(" + status_line.encode() + rb":\t)\s*\S+", lambda m: m.group(1) + token, STATUS
        )
        status = parse_status(text)
        attribute = {"Uid": "uid", "VmRSS": "resident_bytes", "Threads": "threads"}[status_line]
        value = getattr(status, attribute)
        scale = 1024 if status_line == "VmRSS" else 1
        if status_line == "Uid":
            if value != good_status.uid:  # the effective uid is the second number: untouched
                dropped.append("uid beside a bad real uid")
        elif value is not None and not (
            _ASCII_INT.fullmatch(token) and value == int(token) * scale
        ):
            invented.append(f"{attribute} {value} from {token!r}")
        counts["invented"] += len(invented)
        counts["dropped"] += len(dropped)
        assert not invented and not dropped, (invented, dropped)

    try:
        parse()
    finally:
        _record(figures, f"{SUITE}: /proc files", counts)


# -- what the fuzzing found, pinned ------------------------------------------------------------


def test_numbers_the_kernel_and_llama_server_never_write_are_unknown(tmp_path: Path) -> None:
    """Digit separators and numbers past 64 bits: garbage, not values (found by the cases
    above: `b"0_0"` read as 0 °C; a 400-digit `n_decoded` in /slots, or `n_decode_total` in
    /metrics, failed the whole exposition; a router listing a model twice exported it twice)."""
    from exporter.sources.llama_api import parse_metrics, parse_models, parse_props, parse_slots
    from exporter.sources.sysfs import read_int

    path = tmp_path / "temp1_input"
    for content, expected in (
        (b"42000\n", 42000),
        (b"4_2000\n", None),
        (b"9" * 400, None),
        (b"18446744073709551615\n", 2**64 - 1),
    ):
        path.write_bytes(content)
        assert read_int(str(path)) == expected, content
    assert parse_stat(b"42 (x) S 1_0 1") == parse_stat(b"42 (x) S x 1")
    assert parse_status(b"Threads:\t" + b"9" * 30 + b"\n").threads is None
    slots = parse_slots(
        json.dumps(
            [{"id": 0, "is_processing": True, "id_task": 1, "next_token": [{"n_decoded": 10**400}]}]
        ).encode()
    )
    assert slots[0].decoded is None
    props = dict(PROPS, total_slots=-(2**70))
    props["default_generation_settings"] = {"n_ctx": 10**30}
    parsed = parse_props(json.dumps(props).encode())
    assert parsed.total_slots is None and parsed.n_ctx_per_slot is None
    listed = {
        "data": [
            {"id": "m", "status": {"value": "loaded"}},
            {"id": "m", "status": {"value": "unloaded"}},
        ]
    }
    assert [(m.id, m.state) for m in parse_models(json.dumps(listed).encode())] == [("m", "loaded")]
    values, _ = parse_metrics(
        METRICS.replace("n_decode_total 1630", "n_decode_total " + "9" * 400).encode()
    )
    assert "decode_calls" not in values and values["requests_processing"] == 2
