"""The Grafana dashboard and its provisioning files: loadable, portable, naming only real series.

Grafana cannot run here (it is not packaged for Debian), so the dashboard is judged by what
Grafana needs of it: a dashboard model with unique panel ids and a layout, every datasource the
`datasource` variable (a hard-coded uid breaks the import into any other Grafana), and every
template variable defined. Its PromQL is judged by the real tools:

- promtool parses every query: Debian's promtool 2.42 has no `promql parse` command, so each
  query, its Grafana variables replaced by values Grafana could send, becomes a recording rule
  of a temporary rule file and `promtool check rules` must accept the file;
- promql-parser's AST names the series each query reads, and each must be produced by a live
  scrape of the exporter (over the fixtures of tests/test_full_scrape.py, with a real
  llama-server), by a recording rule of rules/, by the remediator's `/metrics`, or by
  Prometheus itself (`ALERTS`, `up`…). A series that nothing produces is a panel that shows
  "No data" forever, and nobody notices until the night it was needed.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from exporter.canary import CanaryCollector
from exporter.exposition import TextWriter
from exporter.registry import ExporterSettings, build_registry
from tests.llama_lab import StartLlamaServer
from tests.sysfs_tree import discrete_spec, write_amd_card, write_k10temp
from tests.systemctl_stand_in import SystemctlStandIn
from tests.test_full_scrape import REPO, TWO_GPUS, live_host
from tests.test_remediator import fixture as alertmanager_payload
from tests.test_remediator import make_lab
from tests.vllm_stand_in import VllmStandIn

try:
    import promql_parser
except ImportError as error:  # a missing parser fails the module, never skips it
    raise ImportError(
        "promql-parser is not installed: `make test` installs the test extras into .venv"
    ) from error

DASHBOARD = REPO / "grafana" / "dashboards" / "gpu-fleet.json"
PROVISIONING = REPO / "grafana" / "provisioning"
DATASOURCE_REF = {"type": "prometheus", "uid": "${datasource}"}

# Grafana's own variables and a value it could send for each (promtool needs a real duration).
BUILTINS = {"__rate_interval": "5m", "__interval": "1m", "__range": "6h"}
# What Grafana sends for a multi-value variable: a regex alternation of the chosen values.
MULTI_VALUE = "(alpha|beta)"
# Series Prometheus writes itself: alert state (rules/) and the scrape's own series.
PROMETHEUS_SERIES = {
    "ALERTS",
    "ALERTS_FOR_STATE",
    "up",
    "scrape_duration_seconds",
    "scrape_samples_scraped",
    "scrape_samples_post_metric_relabeling",
    "scrape_series_added",
}
# The Prometheus configuration operators start from: its scrape jobs and scrape interval.
EXAMPLE_PROMETHEUS = REPO / "examples" / "prometheus.yml"
# Labels Prometheus attaches at scrape time (`host` from the roster's file_sd), never in a scrape.
TARGET_LABELS = {"host", "instance", "job"}
# What the issue asks the dashboard to show: losing one of these is losing a panel.
REQUIRED_SERIES = {
    "gpufleet_gpu_utilization_ratio",
    "gpufleet_gpu_memory_used_bytes",
    "gpufleet_gpu_memory_total_bytes",
    "gpufleet_gpu_power_watts",
    "gpufleet_gpu_power_limit_watts",
    "gpufleet_gpu_temperature_celsius",
    "gpufleet_gpu_temperature_critical_celsius",
    "gpufleet_host_temperature_celsius",
    "gpufleet_host_temperature_critical_celsius",
    "gpufleet_llama_info",
    "gpufleet_llama_health",
    "gpufleet_llama_slots",
    "gpufleet_llama_requests_deferred",
    "gpufleet_llama_decode_calls_total",
    "server_model:gpufleet_tokens_per_second:current",
    "server_model:gpufleet_tokens_per_second:baseline_7d",
    "server_model:gpufleet_tokens_per_second:ratio",
    "gpufleet_port_ghost",
    "gpufleet_unit_restarts_total",
    "gpufleet_remediator_runs_total",
    "gpufleet_remediator_breaker_open",
    "gpufleet_remediator_escalations_total",
    "gpufleet_remediator_queue_depth",
    "ALERTS",
    # Issue 19: hardware health, APU memory, the exporter's own health and the canary.
    "gpufleet_gpu_xid_errors_total",
    "gpufleet_gpu_ecc_errors_total",
    "gpufleet_gpu_remapped_rows_failed",
    "gpufleet_gpu_pcie_link_width",
    "gpufleet_gpu_pcie_replay_errors_total",
    "gpufleet_gpu_throttle_active",
    "gpufleet_gpu_fan_speed_ratio",
    "gpufleet_host_memory_available_bytes",
    "gpufleet_exporter_collector_success",
    "gpufleet_canary_tokens_per_second",
    "server:gpufleet_llama_spec_acceptance_ratio:rate5m",
}

VARIABLE = re.compile(r"\$\{(\w+)(?::\w+)?\}|\$(\w+)|\[\[(\w+)\]\]")
LABEL_VALUES = re.compile(r"^\s*label_values\((?:(.*),)?\s*(\w+)\s*\)\s*$", re.DOTALL)


# -- reading the dashboard ------------------------------------------------------------------------


def load_dashboard() -> dict[str, Any]:
    dashboard: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return dashboard


def all_panels(panels: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    """Every panel, including those a collapsed row keeps in its own `panels`."""
    for panel in panels:
        yield panel
        yield from all_panels(panel.get("panels", []))


def panel_id_problems(dashboard: dict[str, Any]) -> list[str]:
    """Missing and duplicate panel ids: Grafana keys panel state, links and edits by id."""
    problems: list[str] = []
    seen: dict[int, str] = {}
    for panel in all_panels(dashboard["panels"]):
        title = panel.get("title", "?")
        panel_id = panel.get("id")
        if not isinstance(panel_id, int):
            problems.append(f"{title!r}: no integer id")
        elif panel_id in seen:
            problems.append(f"{title!r}: id {panel_id} is also {seen[panel_id]!r}'s")
        else:
            seen[panel_id] = title
    return problems


def variables(dashboard: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {v["name"]: v for v in dashboard["templating"]["list"]}


@dataclass(frozen=True)
class Query:
    """One query of the dashboard, in Grafana's syntax, and where it lives (for messages)."""

    where: str
    text: str
    is_label_values: bool = False


def dashboard_queries(dashboard: dict[str, Any]) -> list[Query]:
    queries: list[Query] = []
    for panel in all_panels(dashboard["panels"]):
        for target in panel.get("targets", []):
            where = f"panel {panel['id']} {panel['title']!r} target {target['refId']}"
            queries.append(Query(where, target["expr"]))
    for annotation in dashboard["annotations"]["list"]:
        queries.append(Query(f"annotation {annotation['name']!r}", annotation["expr"]))
    for variable in variables(dashboard).values():
        if variable["type"] == "query":
            query = variable["query"]
            # Grafana 10+ stores {"query": ..., "qryType": ...}; older ones a plain string.
            text = query["query"] if isinstance(query, dict) else query
            queries.append(Query(f"variable {variable['name']!r}", text, is_label_values=True))
    return queries


def to_promql(query: Query, dashboard: dict[str, Any]) -> str | None:
    """The PromQL Prometheus would receive: variables replaced, `label_values()` unwrapped.

    None for `label_values(label)`, which reads no series. Any other variable query
    (`metrics()`, `query_result()`) is rejected: it names series this test could not check.
    """
    text = query.text
    if query.is_label_values:
        match = LABEL_VALUES.match(text)
        assert match, f"{query.where}: only label_values(...) variable queries are checked"
        if match.group(1) is None:
            return None
        text = match.group(1)
    defined = variables(dashboard)

    def value(match: re.Match[str]) -> str:
        name = next(g for g in match.groups() if g is not None)
        if name in BUILTINS:
            return BUILTINS[name]
        assert name in defined, f"{query.where}: ${name} is not a dashboard variable"
        return MULTI_VALUE if defined[name].get("multi") else "alpha"

    return VARIABLE.sub(value, text)


def all_promql(dashboard: dict[str, Any]) -> list[tuple[str, str]]:
    """(where, PromQL) of every query that reads series."""
    out = []
    for query in dashboard_queries(dashboard):
        promql = to_promql(query, dashboard)
        if promql is not None:
            out.append((query.where, promql))
    return out


# -- what the queries read ------------------------------------------------------------------------


@dataclass(frozen=True)
class Selector:
    """A series selector of a query: the metric name and its equality matchers."""

    name: str
    equal: tuple[tuple[str, str], ...]


def selectors(promql: str) -> list[Selector]:
    """The series selectors of a query, from promql-parser's AST (not a regex over the text)."""
    found: list[Selector] = []
    problems: list[str] = []

    def visit(node: promql_parser.Expr) -> bool | None:
        if isinstance(node, promql_parser.VectorSelector):
            matchers = node.matchers.matchers
            equal = tuple(
                (m.name, m.value) for m in matchers if m.op == promql_parser.MatchOp.Equal
            )
            name = node.name or dict(equal).get("__name__")
            if name is None:
                # `{__name__=~"gpufleet_.*"}`: no single series to check, so not allowed.
                problems.append(f"a selector without a literal metric name: {node}")
            else:
                labels = tuple((k, v) for k, v in equal if k != "__name__")
                found.append(Selector(name, labels))
        return None

    promql_parser.walk(promql_parser.parse(promql), pre_visit=visit)
    assert not problems, problems
    return found


def metric_names(promql: str) -> set[str]:
    return {s.name for s in selectors(promql)}


# -- who produces what ----------------------------------------------------------------------------


@dataclass
class Exposition:
    """What one scrape produces: sample names (suffixes as scraped) and the samples' labels."""

    names: set[str]
    samples: dict[str, list[dict[str, str]]]

    def matches(self, selector: Selector) -> bool:
        wanted = {k: v for k, v in selector.equal if k not in TARGET_LABELS}
        if not wanted:
            # The name alone: a family declared without samples yet still produces it.
            return selector.name in self.names
        return any(
            all(labels.get(k) == v for k, v in wanted.items())
            for labels in self.samples.get(selector.name, [])
        )


# A family declared without samples (a labelled counter before its first increment) still
# names its series: these are the suffixes each type's samples carry in the text format.
SUFFIXES = {
    "counter": ("_total", "_created"),
    "histogram": ("_bucket", "_sum", "_count", "_created"),
    "summary": ("", "_sum", "_count", "_created"),
}


def parse_exposition(text: str) -> Exposition:
    names: set[str] = set()
    samples: dict[str, list[dict[str, str]]] = {}
    for family in text_string_to_metric_families(text):
        names.update(family.name + suffix for suffix in SUFFIXES.get(family.type, ("",)))
        for sample in family.samples:
            names.add(sample.name)
            samples.setdefault(sample.name, []).append(dict(sample.labels))
    return Exposition(names, samples)


def recording_rule_names() -> set[str]:
    files = sorted((REPO / "rules").glob("*.yml")) + sorted((REPO / "rules").glob("*.yaml"))
    assert files, "rules/ holds no rule files"
    names: set[str] = set()
    for path in files:
        for group in yaml.safe_load(path.read_text())["groups"]:
            names.update(rule["record"] for rule in group["rules"] if "record" in rule)
    return names


def exporter_scrape(
    tmp_path: Path, llama_server: StartLlamaServer, monkeypatch: pytest.MonkeyPatch
) -> Exposition:
    """A live scrape of the exporter: both GPU vendors, k10temp, a llama-server and a vLLM.

    The parts of test_full_scrape.py (roster, NVML scenario, sysfs writers, stand-ins) with a
    lighter load: the dashboard reads no per-slot series, so only the canary generates, once.
    """
    sysfs = tmp_path / "sys"
    write_amd_card(sysfs, discrete_spec(0, "0000:03:00.0"))
    write_k10temp(sysfs)
    llama = llama_server("-c", "512", "-np", "2", "-t", "1", "-a", "tiny", "--metrics")
    systemctl = SystemctlStandIn(tmp_path)
    systemctl.activate(monkeypatch)
    systemctl.set_unit(
        "llama-server@alpha.service",
        ActiveState="active",
        SubState="running",
        MainPID=llama.pid,
        NRestarts=1,
    )
    systemctl.set_unit("vllm@zeta.service", ActiveState="active", MainPID=os.getpid())
    with VllmStandIn(REPO / "tests" / "fixtures" / "vllm" / "metrics-v1.txt") as vllm:
        host = live_host(llama.url, vllm.url, canary=True)
        settings = ExporterSettings(host=host, sysfs=str(sysfs), nvml_fake_scenario=TWO_GPUS)
        registry, fleet = build_registry(settings)
        try:
            # The canary panels read its series, which exist after its first run: run it now
            # rather than wait for its schedule (one 8-token completion of the tiny model).
            canaries = [c for c in fleet.collectors if isinstance(c, CanaryCollector)]
            assert [p.run_once() for c in canaries for p in c.probes] == ["ok"]
            text = TextWriter().render_registry(registry).decode()
        finally:
            fleet.close()
    return parse_exposition(text)


def remediator_scrape(tmp_path: Path) -> Exposition:
    """The remediator's `/metrics` after it handled one alert (so runs_total has a sample)."""
    with contextlib.contextmanager(make_lab)(tmp_path) as lab:
        assert lab.post(alertmanager_payload("firing")).status_code == 200
        lab.process()
        answer = lab.client.get("/metrics")
        assert answer.status_code == 200
        return parse_exposition(answer.get_data(as_text=True))


# -- promtool -------------------------------------------------------------------------------------


def promtool_check(
    queries: list[tuple[str, str]], directory: Path
) -> subprocess.CompletedProcess[str]:
    """`promtool check rules` over the queries, one group per query named after its place.

    promtool reports every unparsable rule with its group, so one run names every bad panel.
    """
    promtool = shutil.which("promtool")
    assert promtool is not None, "promtool is missing: `make test` installs Debian's prometheus"
    groups = [
        {"name": where, "rules": [{"record": f"dashboard_query_{i}", "expr": promql}]}
        for i, (where, promql) in enumerate(queries)
    ]
    rules = directory / "dashboard-queries.yml"
    rules.write_text(yaml.safe_dump({"groups": groups}, sort_keys=False))
    return subprocess.run(
        [promtool, "check", "rules", str(rules)], capture_output=True, text=True, check=False
    )


# -- tests ----------------------------------------------------------------------------------------


def test_the_dashboard_is_a_grafana_dashboard() -> None:
    dashboard = load_dashboard()
    assert dashboard["title"] == "GPU fleet"
    assert dashboard["uid"] == "gpu-fleet"
    # Schema 39 is Grafana 10.4/11.0's; older Grafanas migrate it poorly or not at all.
    assert dashboard["schemaVersion"] >= 39
    assert isinstance(dashboard["templating"]["list"], list)
    panels = list(all_panels(dashboard["panels"]))
    assert len(panels) > 10
    problems = panel_id_problems(dashboard)
    assert not problems, "\n".join(problems)
    for panel in panels:
        where = f"panel {panel.get('id')} {panel.get('title')!r}"
        assert isinstance(panel.get("type"), str) and panel["type"], where
        grid = panel.get("gridPos")
        assert isinstance(grid, dict), f"{where}: no gridPos"
        assert all(isinstance(grid.get(k), int) for k in ("h", "w", "x", "y")), where
        # Grafana's grid is 24 columns wide: anything past it is squeezed or pushed down.
        assert grid["w"] > 0 and grid["h"] > 0 and grid["x"] + grid["w"] <= 24, where
        if panel["type"] != "row":
            assert panel.get("targets"), f"{where}: no queries"
            assert len({t["refId"] for t in panel["targets"]}) == len(panel["targets"]), where


def test_the_panel_checks_see_into_collapsed_rows() -> None:
    # A collapsed row keeps its panels inside it: the checks above must still see them.
    nested: dict[str, Any] = {
        "panels": [
            {"id": 1, "type": "row", "title": "r", "panels": [{"id": 2, "title": "inner"}]},
            {"id": 2, "type": "stat", "title": "outer"},
            {"type": "stat", "title": "no id"},
        ]
    }
    assert [p["title"] for p in all_panels(nested["panels"])] == ["r", "inner", "outer", "no id"]
    assert panel_id_problems(nested) == [
        "'outer': id 2 is also 'inner''s",
        "'no id': no integer id",
    ]


def test_every_datasource_is_the_datasource_variable() -> None:
    dashboard = load_dashboard()
    variable = variables(dashboard)["datasource"]
    assert variable["type"] == "datasource" and variable["query"] == "prometheus"
    for panel in all_panels(dashboard["panels"]):
        if panel["type"] == "row":
            continue
        where = f"panel {panel['id']} {panel['title']!r}"
        assert panel.get("datasource") == DATASOURCE_REF, where
        for target in panel["targets"]:
            assert target.get("datasource") == DATASOURCE_REF, f"{where} {target['refId']}"
    for annotation in dashboard["annotations"]["list"]:
        assert annotation.get("datasource") == DATASOURCE_REF, annotation["name"]
    for name, var in variables(dashboard).items():
        if var["type"] == "query":
            assert var.get("datasource") == DATASOURCE_REF, name

    # Anywhere at all (overrides, links, legacy string forms): a datasource is the variable,
    # and the only uid is the dashboard's own.
    def walk(node: Any, path: str) -> Iterator[str]:
        if isinstance(node, dict):
            for key, value in node.items():
                here = f"{path}.{key}"
                stray_datasource = key == "datasource" and value != DATASOURCE_REF
                stray_uid = key == "uid" and path != "" and value != "${datasource}"
                if stray_datasource or stray_uid:
                    yield f"{here} = {value!r}"
                yield from walk(value, here)
        elif isinstance(node, list):
            for index, item in enumerate(node):
                yield from walk(item, f"{path}[{index}]")

    hard_coded = list(walk(dashboard, ""))
    assert not hard_coded, "\n".join(hard_coded)


def test_the_variables_are_those_the_panels_need() -> None:
    dashboard = load_dashboard()
    defined = variables(dashboard)
    assert list(defined) == ["datasource", "host", "role", "server", "gpu"]
    for name in ("host", "role", "server", "gpu"):
        var = defined[name]
        assert var["type"] == "query" and var["multi"] and var["includeAll"], name
        # `.*` for All: the default, an alternation of every value, grows with the fleet and
        # misses a host or role that appeared after the dashboard loaded.
        assert var["allValue"] == ".*", name
    for query in dashboard_queries(dashboard):
        for match in VARIABLE.finditer(query.text):
            name = next(g for g in match.groups() if g is not None)
            assert name in BUILTINS or name in defined, f"{query.where}: ${name} undefined"
            if name in defined and defined[name].get("multi"):
                # A multi-value variable expands to `(a|b)`: only a regex matcher can take it.
                before = query.text[: match.start()]
                assert re.search(r'[=!]~\s*"[^"]*$', before), (
                    f"{query.where}: ${name} outside a regex matcher"
                )


def test_the_report_links_fill_variables_the_panels_use() -> None:
    # The remediator's Zulip reports link here with var-host, var-server and var-gpu (from the
    # alert's labels): each must be a variable, and some panel must filter by it, or the link
    # opens the whole fleet.
    from datetime import UTC, datetime
    from urllib.parse import parse_qs, urlsplit

    from remediator.notify.report import grafana_link_url

    now = datetime.now(UTC)
    url = grafana_link_url(
        "https://grafana.example/d/gpu-fleet/gpu-fleet",
        {"host": "h", "server": "s", "gpu": "0"},
        now,
        now,
    )
    linked = {
        key.removeprefix("var-") for key in parse_qs(urlsplit(url).query) if key.startswith("var-")
    }
    assert linked == {"host", "server", "gpu"}
    dashboard = load_dashboard()
    assert linked <= set(variables(dashboard))
    texts = [query.text for query in dashboard_queries(dashboard)]
    for name in linked:
        assert any(f'=~"${name}"' in text for text in texts), f"no query filters by ${name}"


def test_the_dashboard_scales_to_a_fleet() -> None:
    dashboard = load_dashboard()
    top = dashboard["panels"]
    # The per-GPU time series are one collapsed row per host, not every host in one panel.
    [per_host] = [p for p in top if p["type"] == "row" and p.get("repeat") == "host"]
    assert per_host["collapsed"] and per_host["panels"]
    # No table legends: with 100 hosts they bury the graph.
    for panel in all_panels(top):
        legend = panel.get("options", {}).get("legend", {})
        assert legend.get("displayMode") != "table", f"panel {panel['id']} {panel['title']!r}"
    # The way out: the runbooks and Alertmanager.
    assert {link["title"] for link in dashboard["links"]} >= {"Runbooks", "Alertmanager"}
    assert any("docs/runbooks" in link["url"] for link in dashboard["links"])
    # The overview's host column drills down to that host.
    [hosts] = [p for p in top if p["title"].startswith("Hosts")]
    host_links = [
        link
        for override in hosts["fieldConfig"]["overrides"]
        if override["matcher"] == {"id": "byName", "options": "host"}
        for prop in override["properties"]
        if prop["id"] == "links"
        for link in prop["value"]
    ]
    assert host_links and "var-host=${__value.raw}" in host_links[0]["url"]


def test_the_queries_cover_what_the_dashboard_is_for() -> None:
    dashboard = load_dashboard()
    named = set().union(*(metric_names(promql) for _, promql in all_promql(dashboard)))
    assert REQUIRED_SERIES - named == set()
    # Firing alerts as annotations: the one annotation reads ALERTS and nothing else.
    [annotation] = dashboard["annotations"]["list"]
    promql = to_promql(Query("annotation", annotation["expr"]), dashboard)
    assert promql is not None
    [selector] = selectors(promql)
    assert selector == Selector("ALERTS", (("alertstate", "firing"),))


def test_the_name_extractor_reads_the_ast(tmp_path: Path) -> None:
    # Label names, label values, functions, keywords and durations are not series.
    assert metric_names(
        'sum by (host, gpufleet_fake) (rate(a_total{job="not_a_metric"}[5m] offset 1h))'
        ' * on (host) group_left (model) b_info{model=~"c_total|d"} > bool 0'
        ' unless ignoring (x) {__name__="c_bucket", le="1"}'
    ) == {"a_total", "b_info", "c_bucket"}
    assert metric_names("max_over_time(x[5m:1m])") == {"x"}
    assert metric_names("vector(0) or vector(time() - 1)") == set()
    [selector] = selectors('up{job="gpu-fleet-exporter", host=~"(alpha|beta)"}')
    assert selector == Selector("up", (("job", "gpu-fleet-exporter"),))
    with pytest.raises(AssertionError, match="without a literal metric name"):
        selectors('{__name__=~"gpufleet_.*"}')
    # And the Grafana side: variables replaced, label_values() unwrapped.
    dashboard = load_dashboard()
    query = Query("v", 'label_values(gpufleet_llama_info{host=~"$host"}, role)', True)
    assert to_promql(query, dashboard) == 'gpufleet_llama_info{host=~"(alpha|beta)"}'
    assert to_promql(Query("v", "label_values(host)", True), dashboard) is None
    with pytest.raises(AssertionError, match=r"\$nope is not a dashboard variable"):
        to_promql(Query("p", 'x{host=~"$nope"}'), dashboard)


def test_the_suffixes_are_those_of_the_scrape_text() -> None:
    text = (
        "# TYPE c counter\nc_total 1.0\n"
        "# TYPE e counter\n"  # declared, no sample yet
        '# TYPE h histogram\nh_bucket{le="+Inf"} 1.0\nh_sum 1.0\nh_count 1.0\n'
        "# TYPE g gauge\ng 1.0\n"
    )
    names = parse_exposition(text).names
    assert {"c_total", "e_total", "h_bucket", "h_sum", "h_count", "g"} <= names
    # The family names are not series: a query for `c` or `h` finds nothing.
    assert {"c", "e", "h"} & names == set()


def test_promtool_parses_every_query(tmp_path: Path) -> None:
    queries = all_promql(load_dashboard())
    assert len(queries) > 30
    result = promtool_check(queries, tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    # The parser that names the series must read every query too.
    unparsable = []
    for where, promql in queries:
        try:
            promql_parser.parse(promql)
        except ValueError as error:
            unparsable.append(f"{where}: {error}")
    assert not unparsable, "\n".join(unparsable)


def test_promtool_check_names_the_broken_panel(tmp_path: Path) -> None:
    # The check above can fail, and when it does it says where.
    result = promtool_check(
        [("panel 7 'good'", "up"), ("panel 8 'broken' target B", "sum(rate(x[5m])")], tmp_path
    )
    assert result.returncode != 0
    assert "panel 8 'broken' target B" in result.stdout + result.stderr
    assert "panel 7" not in result.stdout + result.stderr


def test_every_series_is_produced_by_someone(
    tmp_path: Path, llama_server: StartLlamaServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "exporter").mkdir()
    (tmp_path / "remediator").mkdir()
    exporter = exporter_scrape(tmp_path / "exporter", llama_server, monkeypatch)
    remediator = remediator_scrape(tmp_path / "remediator")
    recorded = recording_rule_names()
    prometheus = yaml.safe_load(EXAMPLE_PROMETHEUS.read_text())
    # `up{job="gpu-fleet-exporter"}` must name a job of the example configuration.
    scrape_jobs = {job["job_name"] for job in prometheus["scrape_configs"]}
    unknown: list[str] = []
    for where, promql in all_promql(load_dashboard()):
        for selector in selectors(promql):
            name = selector.name
            if name in exporter.names:
                source = exporter
            elif name in remediator.names:
                source = remediator
            elif name in recorded:
                continue
            elif name in PROMETHEUS_SERIES:
                jobs = {v for k, v in selector.equal if k == "job"}
                if not jobs <= scrape_jobs:
                    unknown.append(f"{where}: {name} of no scrape job of ours: {jobs}")
                continue
            else:
                unknown.append(f"{where}: {name}")
                continue
            # A misspelt label value (`pool="vrma"`) is a panel with no data too.
            if not source.matches(selector):
                unknown.append(f"{where}: no sample of {name} has {dict(selector.equal)}")
    assert not unknown, "series nothing produces:\n" + "\n".join(unknown)


def test_the_provisioning_files_load_this_dashboard() -> None:
    providers = yaml.safe_load((PROVISIONING / "dashboards" / "gpu-fleet.yml").read_text())
    assert providers["apiVersion"] == 1
    [provider] = providers["providers"]
    assert provider["type"] == "file"
    path = provider["options"]["path"]
    assert Path(path).is_absolute(), path
    # The README's install steps must put the JSON where the provider looks.
    readme = (REPO / "grafana" / "README.md").read_text()
    assert f"install -d {path}\n" in readme
    assert f"install -m 0644 grafana/dashboards/{DASHBOARD.name} {path}/\n" in readme

    datasources = yaml.safe_load((PROVISIONING / "datasources" / "prometheus.yml").read_text())
    assert datasources["apiVersion"] == 1
    [datasource] = datasources["datasources"]
    # The type the dashboard's datasource variable lists.
    assert datasource["type"] == variables(load_dashboard())["datasource"]["query"]
    assert datasource["access"] == "proxy"
    assert re.match(r"^https?://", datasource["url"]), datasource["url"]
    # Grafana sizes $__rate_interval from the scrape interval it is told: a smaller one than
    # Prometheus' gives rate() windows with too few samples, and panels with gaps.
    prometheus = yaml.safe_load(EXAMPLE_PROMETHEUS.read_text())
    assert datasource["jsonData"]["timeInterval"] == prometheus["global"]["scrape_interval"]
