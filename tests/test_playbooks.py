"""Playbooks: the built-ins load, every error names its file and key path, matching, targets.

The injection tests hold the design's promise (DESIGN.md, "Labels"): alert labels are only keys
into the roster, so a label holding `; rm -rf /` or `{server.url}` never reaches a param.
"""

from __future__ import annotations

import tempfile
import textwrap
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from fleet.roster import load_roster, parse_roster
from remediator.actions.builtin import HttpProbeParams
from remediator.actions.host import CaptureEvidenceParams
from remediator.actions.registry import (
    ActionContext,
    ActionParams,
    StepResult,
    action,
    render_params,
    render_step,
)
from remediator.alerts import Alert
from remediator.playbooks.loader import (
    Playbook,
    PlaybookError,
    Rejection,
    Target,
    load_playbooks,
    match_playbook,
    resolve_target,
)

EXAMPLE_ROSTER = Path(__file__).resolve().parent.parent / "examples" / "fleet.yaml"
BUILTIN_DIR = Path(__file__).resolve().parent.parent / "remediator" / "playbooks" / "builtin"

ROSTER = parse_roster(
    {
        "hosts": {
            "dioscuri": {
                "address": "192.0.2.10",
                "exporter_port": 9446,
                "gpus": {"nvidia": {"count": 2}, "amd": {"count": 1}},
                "servers": {
                    "alpha": {
                        "engine": "llama",
                        "url": "http://192.0.2.10:31001",
                        "unit": "llama-server@alpha.service",
                        "role": "gpu-dense",
                        "model": "Gemma4-31B-QAT-Q4_K_M",
                    }
                },
            },
            "bare": {"address": "192.0.2.11"},
        }
    },
    "test",
)


class _ActsParams(ActionParams):
    pass


@action("test_playbooks_acts", _ActsParams)
def _acts(ctx: ActionContext, params: _ActsParams) -> StepResult:
    """Stands for an action that changes something (not read-only): never run here."""
    return StepResult(False, "never run")


GOOD = """
name: gpu-hot
description: A GPU runs hot; check it cooled down.
match:
  alertname: GpuTemperatureHigh
  labels:
    severity: "=~crit.*"
    env: "!=staging"
target: gpu
steps:
  - prometheus_check:
      query: 'gpufleet_gpu_temperature_celsius{host="{host}",gpu="{gpu}"} < 80'
      within_seconds: 60
    timeout_seconds: 70
  - wait: {seconds: 5}
verify:
  promql: 'gpufleet_gpu_throttle_active{host="{host}",gpu="{gpu}"} == 0'
  within_seconds: 30
policy: {cooldown_seconds: 60, timeout_seconds: 200}
"""


def alert(alertname: str, **labels: str) -> Alert:
    return Alert(
        status="firing",
        labels={"alertname": alertname, **labels},
        annotations={},
        startsAt=datetime(2026, 1, 1, tzinfo=UTC),
        fingerprint="abc123",
    )


def write(directory: Path, name: str, text: str) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / name
    path.write_text(textwrap.dedent(text))
    return path


def errors_of(directory: Path) -> list[str]:
    with pytest.raises(PlaybookError) as info:
        load_playbooks(directory)
    return str(info.value).splitlines()


def one_error(tmp_path: Path, text: str) -> str:
    path = write(tmp_path / "extra", "bad.yaml", text)
    lines = errors_of(tmp_path / "extra")
    assert len(lines) == 1, lines
    assert lines[0].startswith(f"{path}: ")
    return lines[0].removeprefix(f"{path}: ")


def good_with(**changes: Any) -> str:
    """GOOD with top-level keys replaced (YAML flow text per key)."""
    text = textwrap.dedent(GOOD)
    for key, value in changes.items():
        lines = text.splitlines()
        start = next(i for i, line in enumerate(lines) if line.startswith(f"{key}:"))
        end = next(
            (i for i in range(start + 1, len(lines)) if lines[i] and not lines[i][0].isspace()),
            len(lines),
        )
        lines[start:end] = [f"{key}: {value}"] if value is not None else []
        text = "\n".join(lines) + "\n"
    return text


# --- loading --------------------------------------------------------------------------------


def test_builtins_load_and_render_for_the_example_fleet() -> None:
    playbooks = load_playbooks(None)
    names = [p.name for p in playbooks]
    # By file name; every built-in loads (the full list and what each does:
    # tests/test_builtin_playbooks.py).
    files = sorted(BUILTIN_DIR.glob("*.yaml"), key=lambda path: path.name)
    assert names == [path.stem for path in files]
    assert {"exporter-down", "llama-server-unhealthy"} <= set(names)
    assert all(p.builtin and p.description for p in playbooks)

    roster = load_roster(EXAMPLE_ROSTER)
    host, entry = next((n, h) for n, h in roster.hosts.items() if h.servers)
    server = next(iter(entry.servers))

    llama = match_playbook(playbooks, alert("LlamaServerDown", host=host, server=server))
    assert llama is not None and llama.name == "llama-server-unhealthy"
    target = resolve_target(llama, alert("LlamaServerDown", host=host, server=server), roster)
    assert isinstance(target, Target)
    assert [s.action for s in llama.steps] == [
        "capture_evidence", "drain", "restart_server", "wait_healthy",
    ]  # fmt: skip
    assert isinstance(render_step(llama.steps[0], target), CaptureEvidenceParams)
    assert llama.verify is not None and llama.verify.probe is not None
    probe = render_step(llama.verify.probe, target)
    assert isinstance(probe, HttpProbeParams)
    assert probe.url == f"{entry.servers[server].url}/health"
    assert llama.verify.promql is not None
    assert target.fill(llama.verify.promql) == (
        f'gpufleet_llama_up{{host="{host}",server="{server}"}} == 1'
    )

    exporter = match_playbook(playbooks, alert("GpuFleetExporterDown", host=host))
    assert exporter is not None and exporter.target == "host"
    host_target = resolve_target(exporter, alert("GpuFleetExporterDown", host=host), roster)
    assert isinstance(host_target, Target)
    params = render_step(exporter.steps[0], host_target)
    assert isinstance(params, HttpProbeParams)
    assert params.url == f"http://{entry.address}:{entry.exporter_port}/metrics"

    assert match_playbook(playbooks, alert("SomethingElse", host=host)) is None


def test_extra_dir_comes_first_and_is_ordered_by_file_name(tmp_path: Path) -> None:
    extra = tmp_path / "playbooks"
    write(extra, "b-gpu.yaml", GOOD)
    # Shadows the built-in for LlamaServerDown on critical alerts, and only those.
    write(
        extra,
        "a-llama.yml",
        """
        name: llama-critical
        description: Critical LlamaServerDown alerts get a direct probe first.
        match: {alertname: LlamaServerDown, labels: {severity: critical}}
        target: server
        steps:
          - http_probe: {url: "{server.url}/health", timeout_seconds: 3}
        """,
    )
    write(extra, ".#a-llama.yml", "this is an editor's lock file, not YAML: [")
    write(extra, "notes.txt", "not a playbook")
    playbooks = load_playbooks(extra)
    builtins = [p.name for p in load_playbooks(None)]
    assert [p.name for p in playbooks] == ["llama-critical", "gpu-hot", *builtins]
    assert [p.builtin for p in playbooks] == [False, False] + [True] * len(builtins)
    assert playbooks[0].source == str(extra / "a-llama.yml")
    critical = alert("LlamaServerDown", host="dioscuri", server="alpha", severity="critical")
    warning = alert("LlamaServerDown", host="dioscuri", server="alpha", severity="warning")
    assert match_playbook(playbooks, critical) is playbooks[0]
    unhealthy = next(p for p in playbooks if p.name == "llama-server-unhealthy")
    assert match_playbook(playbooks, warning) is unhealthy

    gpu_hot = playbooks[1]
    assert [s.timeout_seconds for s in gpu_hot.steps] == [70, 60]  # explicit; wait's default
    assert gpu_hot.policy.cooldown_seconds == 60
    assert gpu_hot.policy.breaker.max_failures == 3  # default


def test_matchers_are_anchored_regexes_and_prometheus_like() -> None:
    playbook = load_one(GOOD)
    base = {"host": "dioscuri", "gpu": "0"}
    assert playbook.match.matches(alert("GpuTemperatureHigh", severity="critical", **base))
    # Anchored: `crit.*` must match the whole value, not a part of it.
    assert not playbook.match.matches(alert("GpuTemperatureHigh", severity="supercritical"))
    assert not playbook.match.matches(alert("GpuTemperatureHigh", severity="warning"))
    # `!=staging`: an absent label reads as "" and passes; `staging` does not.
    assert not playbook.match.matches(
        alert("GpuTemperatureHigh", severity="critical", env="staging")
    )
    assert not playbook.match.matches(alert("GpuTemperatureLow", severity="critical"))

    other = load_one(
        good_with(match="{alertname: X, labels: {a: '!~x.*', b: '==~literal', c: ''}}")
    )
    assert other.match.matches(alert("X", a="yes", b="=~literal"))
    assert not other.match.matches(alert("X", a="xyz", b="=~literal"))
    assert not other.match.matches(alert("X", a="yes", b="literal"))
    # `c: ''`: the label must be absent or empty, as `c=""` in PromQL.
    assert not other.match.matches(alert("X", a="yes", b="=~literal", c="set"))


def load_one(text: str) -> Playbook:
    with tempfile.TemporaryDirectory() as directory:
        write(Path(directory), "one.yaml", text)
        playbooks = load_playbooks(Path(directory))
    return playbooks[0]


# --- errors ---------------------------------------------------------------------------------


def test_unknown_action(tmp_path: Path) -> None:
    error = one_error(tmp_path, good_with(steps="[{restart_evrything: {}}]"))
    assert error.startswith("steps[0].restart_evrything: unknown action (known: ")
    assert "http_probe" in error and "wait" in error


def test_bad_params_are_caught_at_load(tmp_path: Path) -> None:
    extra = tmp_path / "extra"
    path = write(
        extra,
        "bad.yaml",
        good_with(
            steps="[{wait: {seconds: -1}}, {wait: {seconds: 1, jitter: 2}}, "
            "{http_probe: {url: 'ftp://{host.address}/x'}}, {wait: 5}]"
        ),
    )
    assert errors_of(extra) == [
        f"{path}: steps[0].wait.seconds: Input should be greater than 0",
        f"{path}: steps[1].wait.jitter: unknown key",
        f"{path}: steps[2].http_probe.url: must be an http:// or https:// URL with a host",
        f"{path}: steps[3].wait: params must be a mapping (`{{}}` for none)",
    ]


def test_unknown_placeholders_and_ones_the_target_cannot_fill(tmp_path: Path) -> None:
    extra = tmp_path / "extra"
    path = write(
        extra,
        "bad.yaml",
        good_with(
            steps="[{http_probe: {url: '{server.url}/health'}}, "
            "{prometheus_check: {query: 'up{host=\"{hots}\"}'}}]",
            verify="{promql: 'up{instance=\"{alert.instance}\"} == 1'}",
        ),
    )
    lines = errors_of(extra)
    assert lines[0] == (
        f"{path}: steps[0].http_probe.url: placeholder {{server.url}} cannot be filled for "
        "target gpu"
    )
    assert lines[1].startswith(
        f"{path}: steps[1].prometheus_check.query: unknown placeholder {{hots}} (known: {{host}}"
    )
    assert lines[2].startswith(f"{path}: verify.promql: unknown placeholder {{alert.instance}}")
    assert len(lines) == 3


def test_duplicate_names_bad_regex_bad_target_and_missing_keys_all_at_once(
    tmp_path: Path,
) -> None:
    extra = tmp_path / "extra"
    first = write(extra, "a.yaml", GOOD)
    second = write(extra, "b.yaml", GOOD)  # same name again
    builtin_name = write(extra, "c.yaml", good_with(name="exporter-down"))
    regex = write(extra, "d.yaml", good_with(name="d", match="{alertname: X, labels: {a: '=~(x'}}"))
    target = write(extra, "e.yaml", good_with(name="e", target="instance"))
    missing = write(extra, "f.yaml", good_with(name="f", description=None, steps=None))
    shape = write(
        extra, "g.yaml", good_with(name="g", steps="[{wait: {seconds: 1}, http_probe: {}}]")
    )
    lines = errors_of(extra)
    builtin_file = BUILTIN_DIR / "exporter-down.yaml"
    assert f"{second}: name: 'gpu-hot' is taken by {first}" in lines
    assert (
        f"{builtin_name}: name: 'exporter-down' is the name of a built-in playbook "
        f"({builtin_file}); give this one its own name (it is matched first anyway)"
    ) in lines
    assert any(line.startswith(f"{regex}: match.labels.a: bad regex: ") for line in lines)
    assert f"{target}: target: Input should be 'host', 'server' or 'gpu'" in lines
    assert f"{missing}: description: required key is missing" in lines
    assert f"{missing}: steps: required key is missing" in lines
    assert any(
        line.startswith(f"{shape}: steps[0]: a step is a mapping of one action") for line in lines
    )
    assert len(lines) == 7, lines


def test_time_limits_must_fit(tmp_path: Path) -> None:
    assert (
        one_error(tmp_path, good_with(steps="[{wait: {seconds: 30}, timeout_seconds: 10}]"))
        == "steps[0].timeout_seconds: 10 s is less than the step needs (30 s)"
    )
    assert one_error(
        tmp_path,
        good_with(
            steps="[{wait: {seconds: 100}}, {wait: {seconds: 100}}]",
            verify="{promql: 'up == 1', within_seconds: 60}",
            policy="{timeout_seconds: 240}",
        ),
    ) == (
        "policy.timeout_seconds: 240 s cannot fit the steps and the verification, which need 260 s"
    )
    assert one_error(tmp_path, good_with(steps="[{wait: {seconds: 1}, timeout_seconds: -3}]")) == (
        "steps[0].timeout_seconds: must be a number of seconds, > 0 and <= 21600"
    )


def test_a_probe_must_be_read_only_and_verify_needs_something(tmp_path: Path) -> None:
    assert one_error(tmp_path, good_with(verify="{probe: {test_playbooks_acts: {}}}")) == (
        "verify.probe.test_playbooks_acts: a verification probe must be a read-only action "
        "(a check)"
    )
    assert one_error(tmp_path, good_with(verify="{within_seconds: 10}")) == (
        "verify: give promql, probe or both (or leave verify out)"
    )
    assert one_error(tmp_path, good_with(verify="{probe: {nope: {}}}")).startswith(
        "verify.probe.nope: unknown action"
    )


def test_files_that_are_not_playbooks(tmp_path: Path) -> None:
    extra = tmp_path / "extra"
    empty = write(extra, "a.yaml", "")
    duplicate_key = write(extra, "b.yaml", "name: x\nname: y\n")
    listing = write(extra, "c.yaml", "- name: x\n")
    lines = errors_of(extra)
    assert lines[0] == f"{empty}: (top level): the file is empty"
    assert (
        lines[1]
        == f"{duplicate_key}: not valid YAML (line 2, column 1): duplicate key 'name' (line 2)"
    )
    assert lines[2].startswith(f"{listing}: (top level): a playbook is a mapping")
    assert errors_of(tmp_path / "missing") == [
        f"{tmp_path / 'missing'}: not a directory (playbooks_dir)"
    ]


# --- targets --------------------------------------------------------------------------------


def builtin(name: str) -> Playbook:
    return next(p for p in load_playbooks(None) if p.name == name)


def test_targets_resolve_through_the_roster() -> None:
    llama = builtin("llama-server-unhealthy")
    target = resolve_target(
        llama, alert("LlamaServerDown", host="dioscuri", server="alpha"), ROSTER
    )
    assert isinstance(target, Target)
    assert (target.kind, target.key, target.host, target.server) == (
        "server", "server/dioscuri/alpha", "dioscuri", "alpha",
    )  # fmt: skip
    assert target.server_entry is ROSTER.hosts["dioscuri"].servers["alpha"]
    assert target.host_entry is ROSTER.hosts["dioscuri"]

    host = resolve_target(
        builtin("exporter-down"), alert("GpuFleetExporterDown", host="bare"), ROSTER
    )
    assert isinstance(host, Target) and host.key == "host/bare" and host.server is None
    assert host.fill("{host.address}:{host.exporter_port}") == "192.0.2.11:9445"

    gpu_hot = load_one(GOOD)
    gpu = resolve_target(gpu_hot, alert("GpuTemperatureHigh", host="dioscuri", gpu="2"), ROSTER)
    assert isinstance(gpu, Target) and gpu.key == "gpu/dioscuri/2" and gpu.gpu == 2
    # The roster says nothing about `bare`'s GPUs, so any index is taken at its word.
    assert isinstance(
        resolve_target(gpu_hot, alert("GpuTemperatureHigh", host="bare", gpu="5"), ROSTER), Target
    )


LLAMA, EXPORTER, GPU = "llama-server-unhealthy", "exporter-down", "gpu-hot"
D = "dioscuri"


@pytest.mark.parametrize(
    ("name", "labels", "reason"),
    [
        (LLAMA, {"server": "alpha"}, "the alert has no `host` label"),
        (LLAMA, {"host": "castor", "server": "alpha"}, "host 'castor' is not in the roster"),
        (LLAMA, {"host": D}, "the alert has no `server` label"),
        (LLAMA, {"host": D, "server": "omega"}, "server 'omega' is not in the roster on host"),
        (EXPORTER, {"host": "dioscuri; rm -rf /"}, "host 'dioscuri; rm -rf /' is not in the"),
        (GPU, {"host": D}, "the alert has no `gpu` label"),
        (GPU, {"host": D, "gpu": "3"}, "gpu 3 is not on host dioscuri: the roster expects 3"),
        (GPU, {"host": D, "gpu": "0; reboot"}, "gpu '0; reboot' is not a GPU index"),
        (GPU, {"host": D, "gpu": "-1"}, "gpu '-1' is not a GPU index"),
    ],
)
def test_unresolvable_targets_are_rejected_with_a_reason(
    name: str, labels: dict[str, str], reason: str
) -> None:
    playbook = load_one(GOOD) if name == GPU else builtin(name)
    result = resolve_target(playbook, alert(playbook.match.alertname, **labels), ROSTER)
    assert isinstance(result, Rejection)
    assert result.reason.startswith(reason), result.reason


def test_alert_labels_never_reach_a_param() -> None:
    llama = builtin("llama-server-unhealthy")
    hostile = {
        "host": "dioscuri",
        "server": "alpha",
        # Labels that are not keys, holding shell syntax and placeholders.
        "instance": "$(rm -rf /)",
        "url": "{server.url}",
        "job": "; rm -rf /",
    }
    event = alert("LlamaServerDown", **hostile)
    event = event.model_copy(update={"annotations": {"summary": "{host.address}; rm -rf /"}})
    target = resolve_target(llama, event, ROSTER)
    assert isinstance(target, Target)
    assert llama.verify is not None and llama.verify.probe is not None
    rendered = render_params(llama.verify.probe.params, target)
    assert rendered == {"url": "http://192.0.2.10:31001/health", "expect_status": 200,
                        "timeout_seconds": 5}  # fmt: skip
    everything = repr(rendered) + target.fill(llama.verify.promql or "")
    assert "rm -rf" not in everything and "$(" not in everything

    # A label that is a key but holds a placeholder or shell syntax finds nothing in the
    # roster: rejected, not filled.
    for bad in ("{server.url}", "alpha; rm -rf /", "alpha\n"):
        result = resolve_target(
            llama, alert("LlamaServerDown", host="dioscuri", server=bad), ROSTER
        )
        assert isinstance(result, Rejection)
