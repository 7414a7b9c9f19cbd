"""Playbooks in memory: what they match, the target they resolve, their steps and policy.

`loader.py` turns YAML into these objects (and documents the format); this module holds the
objects themselves and the two questions the engine asks of them:

- `match_playbook(playbooks, alert)`: which playbook handles an alert (the first that matches,
  in the loader's order);
- `resolve_target(playbook, alert, roster)`: what the playbook acts on, looked up in the roster.

Alert labels are only *keys* into the roster: `resolve_target` uses the `host`, `server` and
`gpu` labels to look entries up and nothing else. Every value a step or a PromQL query can
receive comes from `Target.fill` (`remediator.targets`, below both playbooks and actions), which
knows only the roster's names and fields, so a label holding `; rm -rf /` or `{server.url}`
cannot reach an action's params.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from fleet.roster import Host, Roster
from remediator.alerts import Alert
from remediator.targets import Target, TargetKind

# Rejection reasons quote the label value that failed the lookup (an operator needs to see it),
# shortened so a hostile or broken label cannot flood the journal and the report.
_QUOTE_LIMIT = 64


def _quote(value: str) -> str:
    if len(value) > _QUOTE_LIMIT:
        value = value[:_QUOTE_LIMIT] + "…"
    return repr(value)


@dataclass(frozen=True)
class Rejection:
    """Why an alert's target could not be resolved (missing label, not in the roster)."""

    reason: str


# --- matching -------------------------------------------------------------------------------

MatchOp = Literal["=", "!=", "=~", "!~"]


@dataclass(frozen=True)
class LabelMatcher:
    """One label condition, Prometheus style; an absent label reads as "" (as in PromQL)."""

    label: str
    op: MatchOp
    value: str
    regex: re.Pattern[str] | None = None

    @classmethod
    def parse(cls, label: str, spec: str) -> LabelMatcher:
        """`critical`, `=critical`, `!=x`, `=~regex` or `!~regex`; raises `re.error`.

        A leading `=` means plain equality, so a literal value that starts with `!=`, `=~` or
        `!~` can still be matched exactly: `"==~x"` matches the value `=~x`.
        """
        # Anchored like Prometheus (`^(?:re)$`): `matches` uses `fullmatch`.
        if spec.startswith("=~"):
            return cls(label, "=~", spec[2:], re.compile(spec[2:]))
        if spec.startswith("!~"):
            return cls(label, "!~", spec[2:], re.compile(spec[2:]))
        if spec.startswith("!="):
            return cls(label, "!=", spec[2:])
        if spec.startswith("="):
            return cls(label, "=", spec[1:])
        return cls(label, "=", spec)

    def matches(self, labels: Mapping[str, str]) -> bool:
        """Whether the alert's labels satisfy this condition."""
        actual = labels.get(self.label, "")
        if self.op == "=":
            return actual == self.value
        if self.op == "!=":
            return actual != self.value
        assert self.regex is not None
        found = self.regex.fullmatch(actual) is not None
        return found if self.op == "=~" else not found

    def __str__(self) -> str:
        return f"{self.label}{self.op}{self.value!r}"


@dataclass(frozen=True)
class Match:
    """Which alerts a playbook handles: an exact `alertname` and optional label matchers."""

    alertname: str
    labels: tuple[LabelMatcher, ...] = ()

    def matches(self, alert: Alert) -> bool:
        """Whether `alert` is one this playbook handles (its status is the engine's concern)."""
        if alert.alertname != self.alertname:
            return False
        return all(matcher.matches(alert.labels) for matcher in self.labels)


# --- steps, verification, policy ------------------------------------------------------------


@dataclass(frozen=True)
class Step:
    """One step: a registered action, its params as written (templates), and its time limit.

    `params` still holds the placeholders; the engine fills them from the target (never from
    the alert) with `remediator.actions.registry.render_step`, which also validates the result
    against the action's params model.
    `path` is the step's key path in its file (`steps[1]`, `verify.probe`) for messages.
    """

    action: str
    params: Mapping[str, Any]
    timeout_seconds: float
    path: str


@dataclass(frozen=True)
class Verify:
    """How to tell that the run healed the problem: a PromQL query and/or a direct probe.

    The query holds when it returns a non-empty result; it is evaluated every
    `interval_seconds` until it holds or `within_seconds` have passed. The probe (one step of
    a read-only action) runs after that and must succeed too.
    """

    promql: str | None
    within_seconds: float
    interval_seconds: float
    probe: Step | None


class _Frozen(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Breaker(_Frozen):
    """`max_failures` failures of the target within `window_seconds` open its breaker.

    Failures are every disruptive run on the target that did not heal, or healed and the
    problem came back, whatever playbook ran it (`remediator.journal.rails`).
    """

    max_failures: int = Field(default=3, ge=1, le=100)
    window_seconds: float = Field(default=3600.0, gt=0, le=7 * 86400)


BudgetScope = Literal["nested", "target"]


class Policy(_Frozen):
    """A playbook's safety rails (the fleet-wide caps are in the remediator's config).

    `cooldown_seconds` and `breaker` judge the disruption budget of the targets the run
    touches (`remediator.playbooks.budget`): shared by every disruptive playbook.
    `budget_scope: target` narrows what the run touches to its own target (see there).
    """

    cooldown_seconds: float = Field(default=600.0, ge=0, le=7 * 86400)
    timeout_seconds: float = Field(default=300.0, gt=0, le=6 * 3600)
    breaker: Breaker = Breaker()
    dry_run: bool = False
    budget_scope: BudgetScope = "nested"


@dataclass(frozen=True)
class Playbook:
    """A validated playbook; `source` is its file, `builtin` whether it ships with us."""

    name: str
    description: str
    match: Match
    target: TargetKind
    steps: tuple[Step, ...]
    verify: Verify | None
    policy: Policy
    source: str
    builtin: bool


# --- the engine's questions -----------------------------------------------------------------


def match_playbook(playbooks: Iterable[Playbook], alert: Alert) -> Playbook | None:
    """The first playbook that matches `alert`, in the given order, or None.

    `load_playbooks` returns the extra directory's playbooks (by file name) before the
    built-ins (by file name), so an operator's playbook shadows a built-in for the same alert.
    Only labels are compared: whether a `resolved` alert starts anything is the engine's call.
    """
    for playbook in playbooks:
        if playbook.match.matches(alert):
            return playbook
    return None


_GPU_INDEX = re.compile(r"^[0-9]{1,4}$")
# A router model id as llama-server lists it in /models (a GGUF file's stem or a preset's
# name): a conservative alphabet, since it goes into a request body and a PromQL matcher.
_SERVED_MODEL = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:@+-]{0,199}$")


def resolve_target(playbook: Playbook, alert: Alert, roster: Roster) -> Target | Rejection:
    """The roster entry `playbook` acts on for `alert`, or why there is none.

    The `host` label (and `server` or `gpu`, by the playbook's target) is looked up in the
    roster; the names in the `Target` are the roster's own keys. A GPU index must be a plain
    decimal number below the host's expected GPU count when the roster gives one.
    """
    labels = alert.labels
    host_label = labels.get("host")
    if not host_label:
        return Rejection("the alert has no `host` label, so its target cannot be looked up")
    host_entry = roster.hosts.get(host_label)
    if host_entry is None:
        return Rejection(f"host {_quote(host_label)} is not in the roster")
    # Found in the roster: from here on the name is one the roster validated (a conservative
    # alphabet), whatever else the alert carries.
    host = host_label
    if playbook.target == "host":
        return Target("host", host, host_entry)
    if playbook.target == "server":
        server_label = labels.get("server")
        if not server_label:
            return Rejection(
                f"the alert has no `server` label (playbook {playbook.name} acts on a server)"
            )
        server_entry = host_entry.servers.get(server_label)
        if server_entry is None:
            return Rejection(f"server {_quote(server_label)} is not in the roster on host {host}")
        # Outside router mode the exporter leaves `served_model` empty (no label).
        served_model = labels.get("served_model") or None
        if served_model is not None and not _SERVED_MODEL.fullmatch(served_model):
            return Rejection(f"served_model {_quote(served_model)} is not a model id")
        return Target("server", host, host_entry, server=server_label, server_entry=server_entry,
                      served_model=served_model)  # fmt: skip
    gpu_label = labels.get("gpu")
    if not gpu_label:
        return Rejection(f"the alert has no `gpu` label (playbook {playbook.name} acts on a GPU)")
    if not _GPU_INDEX.fullmatch(gpu_label):
        return Rejection(f"gpu {_quote(gpu_label)} is not a GPU index")
    gpu = int(gpu_label)
    expected = expected_gpu_count(host_entry)
    if expected is not None and gpu >= expected:
        return Rejection(
            f"gpu {gpu} is not on host {host}: the roster expects {expected} GPU(s), "
            "numbered from 0"
        )
    return Target("gpu", host, host_entry, gpu=gpu)


def expected_gpu_count(host: Host) -> int | None:
    """All GPUs the roster expects on `host` (every vendor), or None when it says nothing."""
    vendors = [v for v in (host.gpus.nvidia, host.gpus.amd) if v is not None]
    if not vendors:
        return None
    return sum(v.count for v in vendors)
