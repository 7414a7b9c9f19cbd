"""The Prometheus rules of `rules/`: promtool accepts and tests them, and their contract holds.

promtool (Debian's prometheus package, which `make test` installs; missing, the test fails)
checks both rule files and runs the unit tests in `rules/tests/`. The rest reads the YAML with
PyYAML and checks what promtool cannot: every alert has `for:`, a `severity`, the `category`
the issue assigns it, `summary`/`description`/`runbook_url` annotations that name its target
and value, and a runbook that exists; every alert rule fires in some test case and every alert
stays quiet in another; every runbook belongs to an alert; aggregations keep the labels the
remediator resolves targets by; the series the rules and runbooks name exist; the recording
rules the dashboard reads keep their names and labels; the built-in playbooks match alerts of
these rules, and the alerts carry the labels their playbooks' targets need.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from exporter.collectors.catalogue import CATALOGUE
from remediator.playbooks.loader import load_playbooks
from remediator.playbooks.model import Playbook

REPO = Path(__file__).resolve().parent.parent
RULES = REPO / "rules"
ALERT_FILE = RULES / "gpu-fleet-alerts.rules.yml"
RECORDING_FILE = RULES / "gpu-fleet-recording.rules.yml"
RULE_FILES = (RECORDING_FILE, ALERT_FILE)
TEST_FILES = sorted((RULES / "tests").glob("*.test.yml"))
RUNBOOKS = REPO / "docs" / "runbooks"
RUNBOOK_BASE = "https://github.com/gpu-fleet/gpu-fleet/blob/main/docs/runbooks/"

# The issue's list of alerts and the category of each (the remediator maps a category to a
# Zulip topic): llama-server, ports and tok/s are `inference`; temperatures, throttling, lost
# GPUs, VRAM and compute mode `gpu`; the exporter and the remediator `infra`.
CATEGORIES = {
    "LlamaServerDown": "inference",
    "LlamaServerStuck": "inference",
    "LlamaServerSaturated": "inference",
    "LlamaServerRunawayGeneration": "inference",
    "LlamaServerCrashLooping": "inference",
    "LlamaServerLoadingTooLong": "inference",
    "LlamaServerMetricsMissing": "inference",
    "LlamaServerModelLoadFailed": "inference",
    "PortGhost": "inference",
    "TokensPerSecondDegraded": "inference",
    "GpuLost": "gpu",
    "GpuTemperatureCritical": "gpu",
    "ApuTemperatureCritical": "gpu",
    "GpuThermalThrottling": "gpu",
    "GpuMemoryNearlyFull": "gpu",
    "GpuComputeModeDrift": "gpu",
    "GpuFleetExporterDown": "infra",
    "GpuFleetRemediatorDown": "infra",
    "GpuFleetRemediatorDegraded": "infra",
    # Issue 19: the pipeline's own health, and the exporter's scrapes and collectors.
    "GpuFleetExporterScrapeSlow": "infra",
    "GpuFleetCollectorFailing": "infra",
    "GpuFleetExporterTargetsMissing": "infra",
    "Watchdog": "infra",
    "PrometheusRuleEvaluationFailures": "infra",
    "PrometheusConfigReloadFailed": "infra",
    "PrometheusNotificationsFailing": "infra",
    "AlertmanagerNotificationsFailing": "infra",
    "AlertmanagerConfigReloadFailed": "infra",
    "AlertmanagerDown": "infra",
    # Issue 19: hardware faults, warning tiers, capacity; vLLM and the canary.
    "GpuXidErrors": "gpu",
    "GpuEccErrors": "gpu",
    "GpuRowRemapping": "gpu",
    "GpuRetiredPagesPending": "gpu",
    "GpuPcieLinkDegraded": "gpu",
    "GpuPcieReplays": "gpu",
    "GpuHardwareSlowdown": "gpu",
    "GpuFanStopped": "gpu",
    "GpuTemperatureHigh": "gpu",
    "ApuTemperatureHigh": "gpu",
    "GpuGttNearlyFull": "gpu",
    "HostMemoryNearlyFull": "gpu",
    "ServerGpuMemoryGrowing": "gpu",
    "VllmServerDown": "inference",
    "VllmServerSaturated": "inference",
    "TokensPerSecondCanaryStale": "inference",
}
SEVERITIES = {"warning", "critical"}
# The dead man's switch is no problem to rate: `none` (the usual convention), and only it.
SEVERITY_OF = {"Watchdog": "none"}
# The remediator, Prometheus and Alertmanager run centrally: their targets have no `host` label
# (file_sd gives it to GPU hosts); the Watchdog is `vector(1)`, with no labels at all.
PIPELINE = {
    "Watchdog",
    "PrometheusRuleEvaluationFailures",
    "PrometheusConfigReloadFailed",
    "PrometheusNotificationsFailing",
    "AlertmanagerNotificationsFailing",
    "AlertmanagerConfigReloadFailed",
    "AlertmanagerDown",
}
WITHOUT_HOST = {
    "GpuFleetRemediatorDown",
    "GpuFleetRemediatorDegraded",
    "GpuFleetExporterTargetsMissing",  # about the fleet's targets, not one host
} | PIPELINE
# The labels that name a target in the roster, and must survive every aggregation.
TARGET_LABELS = ("host", "server", "gpu")
# The recording rules the dashboard reads, and their labels exactly.
DASHBOARD_SERIES = (
    "server_model:gpufleet_tokens_per_second:current",
    "server_model:gpufleet_tokens_per_second:baseline_7d",
    "server_model:gpufleet_tokens_per_second:ratio",
)
DASHBOARD_LABELS = {"host", "server", "role", "model"}
# ...and a router's models (llama-server --models-dir), one series per served model (issue 15).
ROUTER_LABELS = DASHBOARD_LABELS | {"served_model"}
# The card of each model server, which the server alerts join: one series per server, `gpu`
# only where the roster gives it (issue 19).
SERVER_GPU_SERIES = "server:gpufleet_server_gpu:info"
SERVER_GPU_LABELS = {"host", "instance", "server"}
# A playbook's target kind and the alert labels it resolves the target by
# (remediator/playbooks/loader.py, "Targets").
PLAYBOOK_TARGET_LABELS = {"host": {"host"}, "server": {"host", "server"}, "gpu": {"host", "gpu"}}
# A series name on its own, not the middle of a recording rule's `level:metric:operation`.
SERIES_NAME = re.compile(r"(?<![\w:])gpufleet_\w+(?![\w:])")
RUNBOOK_SECTIONS = ("## What it means", "## Confirm by hand", "## What to do", "## Escalate when")
DURATION = re.compile(r"(?:[0-9]+(?:ms|[smhdwy]))+")


def load(path: Path) -> Any:
    with path.open(encoding="utf-8") as f:
        return yaml.safe_load(f)


def rules_of(path: Path) -> list[dict[str, Any]]:
    return [rule for group in load(path)["groups"] for rule in group["rules"]]


ALERT_RULES = [rule for path in RULE_FILES for rule in rules_of(path) if "alert" in rule]
ALERT_NAMES = sorted({rule["alert"] for rule in ALERT_RULES})


def alert_cases() -> list[dict[str, Any]]:
    """Every `alert_rule_test` entry of every test file."""
    return [
        case
        for path in TEST_FILES
        for group in load(path)["tests"]
        for case in group.get("alert_rule_test", [])
    ]


def expected_alerts() -> list[tuple[str, dict[str, str]]]:
    """(alertname, labels) of every alert a test case expects to fire."""
    return [
        (case["alertname"], {k: str(v) for k, v in alert.get("exp_labels", {}).items()})
        for case in alert_cases()
        for alert in case.get("exp_alerts") or []
    ]


def firing_cases_of(rule: dict[str, Any]) -> list[dict[str, str]]:
    """The expected alerts that this very rule produces: its name and all its static labels."""
    static = {k: str(v) for k, v in rule.get("labels", {}).items()}
    return [
        labels
        for name, labels in expected_alerts()
        if name == rule["alert"] and static.items() <= labels.items()
    ]


def kebab(name: str) -> str:
    return re.sub(r"(?<!^)(?=[A-Z])", "-", name).lower()


def rule_id(rule: dict[str, Any]) -> str:
    labels = rule.get("labels", {})
    return f"{rule['alert']}[{labels.get('cause') or labels.get('severity')}]"


def promtool() -> str:
    binary = shutil.which("promtool")
    if binary is None:
        pytest.fail("promtool is missing: `make test` installs Debian's prometheus package")
    return binary


def test_promtool_check_rules_accepts_both_files() -> None:
    result = subprocess.run(
        [promtool(), "check", "rules", *map(str, RULE_FILES)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    # promtool counts what PyYAML sees: the checks below read every rule promtool loads.
    for path in RULE_FILES:
        assert f"SUCCESS: {len(rules_of(path))} rules found" in result.stdout, result.stdout


def test_promtool_unit_tests_pass() -> None:
    assert TEST_FILES, "no rules/tests/*.test.yml"
    result = subprocess.run(
        [promtool(), "test", "rules", *map(str, TEST_FILES)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count("SUCCESS") == len(TEST_FILES), result.stdout


def test_the_unit_tests_load_the_rule_files_of_this_directory() -> None:
    loaded = {
        (path.parent / rule_file).resolve()
        for path in TEST_FILES
        for rule_file in load(path)["rule_files"]
    }
    assert loaded == {path.resolve() for path in RULE_FILES}


def test_the_alerts_are_those_of_the_issue() -> None:
    # The remediator's playbooks and Alertmanager's inhibitions match these names.
    assert sorted(CATEGORIES) == ALERT_NAMES
    assert not [rule for rule in rules_of(RECORDING_FILE) if "alert" in rule]


@pytest.mark.parametrize("rule", ALERT_RULES, ids=rule_id)
def test_alert_rule_is_complete(rule: dict[str, Any]) -> None:
    name = rule["alert"]
    assert DURATION.fullmatch(str(rule.get("for", ""))), f"{name}: `for:` missing or not a duration"
    assert not re.fullmatch(r"(0+[a-z]+)+", rule["for"]), f"{name}: `for: {rule['for']}` is zero"
    labels = rule.get("labels", {})
    if name in SEVERITY_OF:
        assert labels.get("severity") == SEVERITY_OF[name]
    else:
        assert labels.get("severity") in SEVERITIES
    assert labels.get("category") == CATEGORIES[name]
    annotations = rule.get("annotations", {})
    for key in ("summary", "description", "runbook_url"):
        assert str(annotations.get(key, "")).strip(), f"{name}: annotation {key} is empty"
    assert annotations["runbook_url"] == f"{RUNBOOK_BASE}{kebab(name)}.md"
    assert (RUNBOOKS / f"{kebab(name)}.md").is_file(), f"{name}: no runbook"
    text = annotations["summary"] + annotations["description"]
    assert "$value" in annotations["description"], f"{name}: the description omits the value"
    firing = firing_cases_of(rule)
    assert firing, f"{rule_id(rule)}: no test case where this rule fires"
    for labels_of_case in firing:
        if name not in WITHOUT_HOST:
            assert "host" in labels_of_case, f"{name}: fires without `host`: {labels_of_case}"
        # The annotations name the target by the labels the alert carries.
        for label in TARGET_LABELS:
            if label in labels_of_case:
                assert f"$labels.{label}" in text, f"{name}: annotations omit {label}"


@pytest.mark.parametrize("rule", rules_of(RECORDING_FILE) + ALERT_RULES, ids=str)
def test_aggregations_keep_the_target_labels(rule: dict[str, Any]) -> None:
    expr = rule["expr"]
    # `by (...)` and `on (...)` list what is kept: the host always. `without (...)` lists what
    # is dropped: never a target label.
    for clause, kept in re.findall(r"\b(by|on)\s*\(([^)]*)\)", expr):
        assert "host" in re.split(r"\s*,\s*", kept.strip()), f"{clause} ({kept}) drops host"
    for dropped in re.findall(r"\bwithout\s*\(([^)]*)\)", expr):
        lost = set(re.split(r"\s*,\s*", dropped.strip())) & set(TARGET_LABELS)
        assert not lost, f"without ({dropped}) drops {lost}"


def known_series() -> set[str]:
    """What the exporter emits (its catalogue, which test_full_scrape proves against a live
    scrape) and what the remediator exports (its metrics module; counters get `_total`)."""
    exporter = set(CATALOGUE)
    assert len(exporter) > 30, "the metric catalogue went missing"
    source = (REPO / "remediator" / "metrics.py").read_text(encoding="utf-8")
    remediator = set(re.findall(r'"(gpufleet_remediator_\w+)"', source))
    assert "gpufleet_remediator_journal_up" in remediator
    return exporter | remediator | {f"{name}_total" for name in remediator}


def test_rules_and_runbooks_name_only_series_that_exist() -> None:
    # A misspelt series is no error to Prometheus: the alert just never fires.
    known = known_series()
    texts = {path.name: path.read_text(encoding="utf-8") for path in RULE_FILES}
    texts |= {path.name: path.read_text(encoding="utf-8") for path in RUNBOOKS.glob("*.md")}
    unknown = {
        (name, series)
        for name, text in texts.items()
        for series in SERIES_NAME.findall(text)
        if series not in known
    }
    assert not unknown, sorted(unknown)


def test_the_readme_lists_every_alert_rule_with_its_threshold() -> None:
    # rules/README.md's table: one row per rule, named by the alert, its `cause` (or `source`)
    # where it has several rules, and its severity, with what fires it and its `for:`.
    readme = (RULES / "README.md").read_text(encoding="utf-8")
    row = re.compile(
        r"^\| `(\w+)`(?: `((?:cause|source)=\w+)`)? \| (.+?) \| (\w+) \| (\w+) \| \w+ \|$",
        flags=re.MULTILINE,
    )
    rows = {
        (name, tag, severity): duration
        for name, tag, _condition, duration, severity in row.findall(readme)
    }
    missing, wrong_for = [], []
    for rule in ALERT_RULES:
        labels = rule.get("labels", {})
        tag = next((f"{k}={labels[k]}" for k in ("cause", "source") if k in labels), "")
        key = (rule["alert"], tag, labels.get("severity"))
        if key not in rows:
            missing.append(" ".join(filter(None, key)))
        elif rows[key] != rule["for"]:
            wrong_for.append(
                f"{' '.join(filter(None, key))}: README {rows[key]}, rule {rule['for']}"
            )
    assert not missing, f"rules/README.md lacks: {missing}"
    assert not wrong_for, wrong_for


@pytest.mark.parametrize("name", ALERT_NAMES)
def test_every_alert_has_a_firing_and_a_quiet_case(name: str) -> None:
    cases = [case for case in alert_cases() if case["alertname"] == name]
    assert [c for c in cases if c.get("exp_alerts")], f"{name}: no case where it fires"
    # An explicit empty list: "at this time, this alert does not fire".
    assert [c for c in cases if c.get("exp_alerts", None) == []], f"{name}: no quiet case"


def test_every_runbook_belongs_to_an_alert() -> None:
    referenced = {
        rule["annotations"]["runbook_url"].removeprefix(RUNBOOK_BASE) for rule in ALERT_RULES
    }
    assert {path.name for path in RUNBOOKS.glob("*.md")} == referenced


@pytest.mark.parametrize("name", ALERT_NAMES)
def test_runbook_has_its_sections(name: str) -> None:
    text = (RUNBOOKS / f"{kebab(name)}.md").read_text(encoding="utf-8")
    assert text.startswith(f"# {name}\n")
    for section in RUNBOOK_SECTIONS:
        assert f"\n{section}\n" in text, f"{name}: runbook lacks {section!r}"


def evaluated_label_sets(series: str) -> list[set[str]]:
    """The label names of every sample a promql_expr_test expects of `series`."""
    return [
        set(re.findall(r'([a-zA-Z_][a-zA-Z0-9_]*)="', sample["labels"]))
        for path in TEST_FILES
        for group in load(path)["tests"]
        for test in group.get("promql_expr_test", [])
        if series in test["expr"]
        for sample in test.get("exp_samples") or []
    ]


@pytest.mark.parametrize("series", DASHBOARD_SERIES)
def test_dashboard_series_keep_their_name_and_labels(series: str) -> None:
    assert series in {rule.get("record") for rule in rules_of(RECORDING_FILE)}
    # A unit test evaluates the series and names every label of the result: exactly these, a
    # plain server's and a router model's (with served_model) both evaluated.
    label_sets = evaluated_label_sets(series)
    assert label_sets, f"no promql_expr_test evaluates {series}"
    assert all(labels in (DASHBOARD_LABELS, ROUTER_LABELS) for labels in label_sets), label_sets
    assert DASHBOARD_LABELS in label_sets and ROUTER_LABELS in label_sets, label_sets


def test_the_server_gpu_series_keeps_its_labels() -> None:
    assert SERVER_GPU_SERIES in {rule.get("record") for rule in rules_of(RECORDING_FILE)}
    # The series itself, not an aggregation of it (`count by (host, server) (...)`).
    label_sets = [
        labels for labels in evaluated_label_sets(SERVER_GPU_SERIES) if labels >= {"instance"}
    ]
    assert SERVER_GPU_LABELS in label_sets and SERVER_GPU_LABELS | {"gpu"} in label_sets
    assert all(labels in (SERVER_GPU_LABELS, SERVER_GPU_LABELS | {"gpu"}) for labels in label_sets)


def handled_by(playbook: Playbook, alertname: str, labels: dict[str, str]) -> bool:
    """The remediator's own matching (`Match.matches`), on an alert's name and labels."""
    return playbook.match.alertname == alertname and all(
        matcher.matches(labels) for matcher in playbook.match.labels
    )


def test_the_playbook_an_alert_goes_to_finds_its_target() -> None:
    # For every alert a test expects to fire, the playbook the remediator would take (the first
    # that matches, as `match_playbook` picks it) resolves its target from labels the alert has.
    playbooks = load_playbooks(None)
    problems = []
    for alertname, labels in expected_alerts():
        taken = next((p for p in playbooks if handled_by(p, alertname, labels)), None)
        if taken is None:
            continue  # no playbook: the remediator reports it and runs nothing
        missing = PLAYBOOK_TARGET_LABELS[taken.target] - labels.keys()
        if missing:
            problems.append(f"{alertname} {labels} -> {taken.name}: lacks {sorted(missing)}")
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("playbook", load_playbooks(None), ids=lambda p: p.name)
def test_builtin_playbook_matches_an_alert_the_rules_raise(playbook: Playbook) -> None:
    assert playbook.match.alertname in ALERT_NAMES, f"{playbook.name}: no rule raises it"
    assert any(handled_by(playbook, name, labels) for name, labels in expected_alerts()), (
        f"{playbook.name}: matches no alert of the rules' test cases"
    )
