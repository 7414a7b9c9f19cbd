r"""Playbook files: the YAML format, and loading with every problem named by its key path.

One playbook per file. A full example (every key; `description`, `match`, `target` and `steps`
are required, the rest optional with the defaults shown):

    name: llama-server-unhealthy          # unique over all playbooks; [a-z0-9][a-z0-9_.-]*
    description: >-                       # what it does and why, for the operator and reports
      A llama-server stopped answering /health. Give systemd's restart and the model load
      30 s, then check it is back, in Prometheus and directly.
    match:
      alertname: LlamaServerDown          # exact
      labels:                             # optional; all must hold
        severity: critical                # equality (a leading `=` also means equality)
        category: "=~inference|gpu"       # regex (Python's `re`), anchored: the whole value
        env: "!=staging"                  # not equal; `!~regex`: does not match
    target: server                        # host | server | gpu (see "Targets")
    steps:                                # in order; the first failure stops the run
      - http_probe: {url: "{server.url}/health", expect_status: 200}
      - wait: {seconds: 30}
        timeout_seconds: 40               # optional, beside the action: the step's time limit
    verify:                               # optional: promql and/or probe
      promql: 'gpufleet_llama_up{host="{host}",server="{server}"} == 1'
      within_seconds: 120                 # re-evaluated until it holds or this passes (60)
      interval_seconds: 5                 # (5)
      probe:                              # one step of a read-only action, run after promql
        http_probe: {url: "{server.url}/health"}
    policy:
      cooldown_seconds: 600               # nothing disrupts the targets again before this (600)
      timeout_seconds: 300                # the whole run, steps and verification (300)
      breaker: {max_failures: 3, window_seconds: 3600}   # failures of the target → stop, escalate
      dry_run: false                      # this playbook only records what it would do
      budget_scope: nested                # or `target`: touch only its own target's budget

Budgets (cooldown, breaker, lock) belong to targets and are shared by every disruptive playbook
(`remediator.playbooks.budget` says what a run touches, `remediator.journal.rails` how they
are judged).

Steps: each is a mapping of one action name (`remediator.actions.registry.registered()`) to its
params, plus an optional `timeout_seconds`. Params are validated against the action's params
model here, at load (unknown keys are errors); a step's time limit defaults to the action's
default, stretched to what the params need (a `wait` of 90 s gets at least 91 s), and may not
be shorter than that need nor longer than `policy.timeout_seconds`. The steps' needs plus
`verify.within_seconds` must fit in `policy.timeout_seconds`.

Targets: `host` is the roster host named by the alert's `host` label; `server` also needs the
`server` label (a server of that host); `gpu` the `gpu` label (an index below the host's GPU
count when the roster gives one). An alert whose labels do not resolve is rejected, not run.

Placeholders, in params and in `verify.promql`: `{host}`, `{host.address}`,
`{host.exporter_port}` (every target); `{server}`, `{server.url}`, `{server.unit}`,
`{server.role}`, `{server.model}` (target `server`); `{gpu}` (target `gpu`). They are filled
from the roster entry the target resolved to, never from alert labels or annotations, so no
alert can put text into a command, a URL or a query. Only `{name}` / `{name.field}` is a
placeholder: PromQL matchers (`{host="{host}"}`) and JSON braces are plain text. An unknown
placeholder, or one the target kind cannot fill, is a load error.

Order: `load_playbooks` returns the extra directory's playbooks first, by file name, then the
built-ins (`remediator/playbooks/builtin/*.yaml`), by file name; `match_playbook` takes the
first that matches. So an operator's playbook for an alert shadows the built-in one. Names are
unique over both: reusing a built-in's name is an error, not an override.

Errors: one line each, all at once, `FILE: key.path: message`, e.g.
`/etc/gpu-fleet/playbooks/gpu.yaml: steps[0].wait.seconds: Input should be greater than 0`.
"""

from __future__ import annotations

import importlib.resources
import re
from collections.abc import Iterable, Iterator, Mapping
from importlib.resources.abc import Traversable
from pathlib import Path
from typing import Annotated, Any

import yaml
from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

import remediator.actions  # noqa: F401  (registers the built-in actions steps may name)
from fleet.yamlfile import load_strict
from remediator.actions.registry import (
    RESERVED_STEP_KEYS,
    ActionParams,
    UnknownActionError,
    get_action,
    registered,
)
from remediator.config import validation_problems, yaml_problem
from remediator.playbooks.model import (
    LabelMatcher,
    Match,
    Playbook,
    Policy,
    Rejection,
    Step,
    Verify,
    match_playbook,
    resolve_target,
)
from remediator.targets import (
    ALL_PLACEHOLDERS,
    PLACEHOLDER,
    PLACEHOLDERS,
    TARGET_KINDS,
    Target,
    TargetKind,
)

__all__ = [
    "Playbook",
    "PlaybookError",
    "Rejection",
    "Target",
    "load_playbooks",
    "match_playbook",
    "parse_playbook",
    "resolve_target",
]

_NAME = r"^[a-z0-9][a-z0-9_.-]{0,62}$"
_LABEL_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
# Stands in for each placeholder when params are validated at load: the shapes of real roster
# values (documentation addresses, RFC 5737), so a URL template validates like a real URL.
_SAMPLE_VALUES = {
    "host": "sample-host",
    "host.address": "192.0.2.1",
    "host.exporter_port": "9445",
    "server": "sample",
    "server.url": "http://192.0.2.1:31001",
    "server.unit": "llama-server@sample.service",
    "server.role": "sample-role",
    "server.model": "sample-model",
    "gpu": "0",
}
# A default step limit is the params' need plus this (the action's own bookkeeping).
_STEP_MARGIN_SECONDS = 1.0
_MAX_STEP_SECONDS = 6 * 3600.0

Problem = tuple[str, str]


class PlaybookError(Exception):
    """Playbooks cannot be used; one line per problem: `FILE: key.path: message`."""


# --- the shape (checked by pydantic) --------------------------------------------------------


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


def _matcher(value: str) -> str:
    try:
        LabelMatcher.parse("label", value)
    except re.error as exc:
        raise ValueError(f"bad regex: {exc}") from None
    return value


class _MatchSpec(_Strict):
    alertname: str = Field(min_length=1, max_length=200)
    labels: dict[str, Annotated[str, AfterValidator(_matcher)]] = {}

    @field_validator("labels")
    @classmethod
    def _names(cls, value: dict[str, str]) -> dict[str, str]:
        for name in value:
            if not _LABEL_NAME.match(name):
                raise ValueError(f"{name!r} is not a Prometheus label name")
            if name == "alertname":
                raise ValueError("give the alert's name as match.alertname, not as a label")
        return value


class _VerifySpec(_Strict):
    promql: str | None = Field(default=None, min_length=1, max_length=4000)
    within_seconds: float = Field(default=60.0, ge=0, le=3600)
    interval_seconds: float = Field(default=5.0, gt=0, le=600)
    probe: Any = None  # a step: checked by _parse_step, with its own key paths

    @model_validator(mode="after")
    def _something_to_check(self) -> _VerifySpec:
        if self.promql is None and self.probe is None:
            raise ValueError("give promql, probe or both (or leave verify out)")
        return self


class _PlaybookSpec(_Strict):
    name: str = Field(pattern=_NAME)
    description: str = Field(min_length=1, max_length=4000)
    match: _MatchSpec
    target: TargetKind
    steps: list[Any] = Field(min_length=1, max_length=50)  # each checked by _parse_step
    verify: _VerifySpec | None = None
    policy: Policy = Policy()


# --- steps and placeholders -----------------------------------------------------------------


def _strings(value: Any, path: str) -> Iterator[tuple[str, str]]:
    """Every string inside `value` (nested mappings and lists), with its key path."""
    if isinstance(value, str):
        yield path, value
    elif isinstance(value, Mapping):
        for key, item in value.items():
            yield from _strings(item, f"{path}.{key}")
    elif isinstance(value, list):
        for index, item in enumerate(value):
            yield from _strings(item, f"{path}[{index}]")


def _placeholder_problems(value: Any, path: str, kind: TargetKind | None) -> list[Problem]:
    problems = []
    for where, text in _strings(value, path):
        for match in PLACEHOLDER.finditer(text):
            name = match.group(1)
            if name not in ALL_PLACEHOLDERS:
                known = ", ".join(f"{{{n}}}" for n in PLACEHOLDERS[kind or "server"])
                problems.append((where, f"unknown placeholder {{{name}}} (known: {known})"))
            elif kind is not None and name not in PLACEHOLDERS[kind]:
                problems.append(
                    (where, f"placeholder {{{name}}} cannot be filled for target {kind}")
                )
    return problems


def _sample_fill(value: Any) -> Any:
    if isinstance(value, str):
        return PLACEHOLDER.sub(lambda m: _SAMPLE_VALUES.get(m.group(1), m.group(0)), value)
    if isinstance(value, Mapping):
        return {key: _sample_fill(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_sample_fill(item) for item in value]
    return value


def _parse_step(
    raw: Any,
    path: str,
    kind: TargetKind | None,
    policy_timeout: float | None,
    *,
    probe: bool = False,
) -> tuple[Step | None, float, list[Problem]]:
    """A step, the least time it needs, and its problems (a step only if there are none)."""
    shape = "a step is a mapping of one action name to its params (and optional timeout_seconds)"
    if not isinstance(raw, Mapping):
        return None, 0.0, [(path, shape)]
    names = [key for key in raw if key not in RESERVED_STEP_KEYS]
    if len(names) != 1 or not isinstance(names[0], str):
        found = ", ".join(repr(n) for n in names) or "none"
        return None, 0.0, [(path, f"{shape}; found action keys: {found}")]
    name = names[0]
    where = f"{path}.{name}"
    problems: list[Problem] = []
    try:
        action = get_action(name)
    except UnknownActionError:
        known = ", ".join(sorted(registered()))
        return None, 0.0, [(where, f"unknown action (known: {known})")]
    if probe and not action.read_only:
        problems.append((where, "a verification probe must be a read-only action (a check)"))
    params = raw[name]
    if params is None:
        params = {}
    if not isinstance(params, Mapping):
        return None, 0.0, [(where, "params must be a mapping (`{}` for none)")]
    if any(not isinstance(key, str) for key in params):
        return None, 0.0, [(where, "param names must be strings")]
    explicit = raw.get("timeout_seconds")
    if explicit is not None and (
        isinstance(explicit, bool)
        or not isinstance(explicit, int | float)
        or not 0 < explicit <= _MAX_STEP_SECONDS
    ):
        problems.append(
            (
                f"{path}.timeout_seconds",
                f"must be a number of seconds, > 0 and <= {_MAX_STEP_SECONDS:g}",
            )
        )
        explicit = None
    placeholder_problems = _placeholder_problems(params, where, kind)
    problems.extend(placeholder_problems)
    needs = 0.0
    if not placeholder_problems:
        try:
            validated = action.parse_params(_sample_fill(params))
        except ValidationError as exc:
            problems.extend(
                (f"{where}.{loc}" if loc != "(top level)" else where, message)
                for loc, message in validation_problems(exc)
            )
        else:
            if isinstance(validated, ActionParams):
                needs = validated.needs_seconds()
    if explicit is not None:
        timeout = float(explicit)
        if timeout < needs:
            problems.append(
                (
                    f"{path}.timeout_seconds",
                    f"{timeout:g} s is less than the step needs ({needs:g} s)",
                )
            )
    else:
        timeout = max(action.default_timeout_seconds, needs + _STEP_MARGIN_SECONDS)
        if policy_timeout is not None:
            timeout = min(timeout, policy_timeout)
    # A need beyond the run's limit is reported once, for the whole playbook, by the caller.
    if policy_timeout is not None and needs <= policy_timeout < timeout:
        problems.append(
            (
                f"{path}.timeout_seconds",
                f"{timeout:g} s is more than policy.timeout_seconds ({policy_timeout:g} s)",
            )
        )
    if problems:
        return None, needs, problems
    return Step(action=name, params=dict(params), timeout_seconds=timeout, path=path), needs, []


# --- one playbook ---------------------------------------------------------------------------


def _raw_kind(data: Mapping[str, Any]) -> TargetKind | None:
    value = data.get("target")
    for kind in TARGET_KINDS:
        if value == kind:
            return kind
    return None


def _raw_policy_timeout(data: Mapping[str, Any]) -> float | None:
    raw = data.get("policy")
    try:
        policy = Policy() if raw is None else Policy.model_validate(raw)
    except ValidationError:
        return None  # reported by the full validation
    return policy.timeout_seconds


def parse_playbook(data: Any, *, source: str, builtin: bool) -> tuple[Playbook | None, list[str]]:
    """Validate one playbook's YAML data: the playbook, or its problems as `key.path: message`.

    Every part is checked even when another part is wrong, so all problems come out at once.
    """
    if not isinstance(data, Mapping):
        return None, ["(top level): a playbook is a mapping (name, description, match, …)"]
    problems: list[Problem] = []
    spec: _PlaybookSpec | None = None
    try:
        spec = _PlaybookSpec.model_validate(data)
    except ValidationError as exc:
        problems.extend(validation_problems(exc))
    kind = _raw_kind(data)
    policy_timeout = _raw_policy_timeout(data)

    steps: list[Step] = []
    total_needs = 0.0
    raw_steps = data.get("steps")
    if isinstance(raw_steps, list):
        for index, raw_step in enumerate(raw_steps):
            step, needs, step_problems = _parse_step(
                raw_step, f"steps[{index}]", kind, policy_timeout
            )
            problems.extend(step_problems)
            total_needs += needs
            if step is not None:
                steps.append(step)

    verify: Verify | None = None
    raw_verify = data.get("verify")
    if isinstance(raw_verify, Mapping):
        promql = raw_verify.get("promql")
        if isinstance(promql, str):
            problems.extend(_placeholder_problems(promql, "verify.promql", kind))
        probe: Step | None = None
        if raw_verify.get("probe") is not None:
            probe, needs, probe_problems = _parse_step(
                raw_verify["probe"], "verify.probe", kind, policy_timeout, probe=True
            )
            problems.extend(probe_problems)
            total_needs += needs
        if spec is not None and spec.verify is not None:
            total_needs += spec.verify.within_seconds if spec.verify.promql else 0.0
            verify = Verify(
                promql=spec.verify.promql,
                within_seconds=spec.verify.within_seconds,
                interval_seconds=spec.verify.interval_seconds,
                probe=probe,
            )

    if policy_timeout is not None and total_needs > policy_timeout:
        problems.append(
            (
                "policy.timeout_seconds",
                f"{policy_timeout:g} s cannot fit the steps and the verification, which need "
                f"{total_needs:g} s",
            )
        )
    if problems or spec is None:
        return None, [f"{where}: {message}" for where, message in problems]
    match = Match(
        alertname=spec.match.alertname,
        labels=tuple(LabelMatcher.parse(k, v) for k, v in spec.match.labels.items()),
    )
    playbook = Playbook(
        name=spec.name,
        description=spec.description.strip(),
        match=match,
        target=spec.target,
        steps=tuple(steps),
        verify=verify,
        policy=spec.policy,
        source=source,
        builtin=builtin,
    )
    return playbook, []


# --- files ----------------------------------------------------------------------------------


def _builtin_files() -> list[Traversable]:
    folder = importlib.resources.files("remediator.playbooks").joinpath("builtin")
    return sorted(
        (item for item in folder.iterdir() if item.is_file() and item.name.endswith(".yaml")),
        key=lambda item: item.name,
    )


def _extra_files(directory: Path) -> tuple[list[Path], list[str]]:
    if not directory.is_dir():
        return [], [f"{directory}: not a directory (playbooks_dir)"]
    try:
        files = [
            path
            for path in directory.iterdir()
            # Dot files are editor locks and backups (`.#x.yaml`), never playbooks.
            if path.suffix in (".yaml", ".yml") and not path.name.startswith(".")
        ]
    except OSError as exc:
        return [], [f"{directory}: cannot list: {exc.strerror or exc}"]
    return sorted(files, key=lambda path: path.name), []


def _read(item: Traversable | Path) -> tuple[Any, str | None]:
    try:
        text = item.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        return None, f"cannot read: {reason}"
    try:
        data = load_strict(text)
    except yaml.YAMLError as exc:
        return None, yaml_problem(exc)
    if data is None:
        return None, "(top level): the file is empty"
    return data, None


def _load_files(
    files: Iterable[tuple[Traversable | Path, bool]],
) -> tuple[list[Playbook], list[str]]:
    playbooks: list[Playbook] = []
    errors: list[str] = []
    names: dict[str, str] = {}
    builtin_sources: set[str] = set()
    for item, builtin in files:
        source = str(item)
        data, error = _read(item)
        if error is not None:
            errors.append(f"{source}: {error}")
            continue
        playbook, problems = parse_playbook(data, source=source, builtin=builtin)
        errors.extend(f"{source}: {problem}" for problem in problems)
        name = data.get("name") if isinstance(data, Mapping) else None
        if isinstance(name, str):
            if name in names:
                first = names[name]
                if builtin and first not in builtin_sources:
                    # The operator's file is the one to change: say so there.
                    errors.append(
                        f"{first}: name: {name!r} is the name of a built-in playbook "
                        f"({source}); give this one its own name (it is matched first anyway)"
                    )
                else:
                    errors.append(f"{source}: name: {name!r} is taken by {first}")
                continue
            names[name] = source
            if builtin:
                builtin_sources.add(source)
        if playbook is not None:
            playbooks.append(playbook)
    return playbooks, errors


def load_playbooks(extra_dir: Path | None) -> list[Playbook]:
    """The playbooks of `extra_dir` (`*.yaml`, `*.yml`), then the built-ins, validated.

    Raises `PlaybookError` listing every problem of every file, one `FILE: key.path: message`
    line each.
    """
    files: list[tuple[Traversable | Path, bool]] = []
    errors: list[str] = []
    if extra_dir is not None:
        extra, errors = _extra_files(extra_dir)
        files.extend((path, False) for path in extra)
    files.extend((item, True) for item in _builtin_files())
    playbooks, problems = _load_files(files)
    errors.extend(problems)
    if errors:
        raise PlaybookError("\n".join(errors))
    return playbooks
