"""The action registry: named functions with typed params, and the one way to run them.

An action is `def name(ctx: ActionContext, params: SomeParams) -> StepResult`, registered by
name with `@action("name", SomeParams)` (STYLE.md, habit 6). Playbook steps name actions and
give their params as YAML; the loader validates those params against the action's model at
start-up, so an unknown action or a bad param stops the start instead of failing at 3 a.m.

Params models forbid unknown keys (a typo must not be dropped silently). String params may be
templates (`"{server.url}/health"`): `render_params` fills every string from the roster-resolved
`Target`, never from the alert, and the engine validates the filled mapping again
(`RegisteredAction.parse_params`) before running the step.

`run_action` runs an action in the calling thread under a deadline: the action must honour
`ctx.deadline` (`ctx.remaining()`) and `ctx.cancel`; whatever it raises becomes a failed
`StepResult`, so one broken action never takes the engine down (STYLE.md, habit 7). Under
dry-run the engine calls no action at all (it journals each step as "would run"): an action
author who forgets to look at `ctx.dry_run` cannot make a dry run act.

Two things a step can hand back to the engine besides its verdict (`StepResult`):
- `undo`: a compensating step (`Undo`) the engine runs at the end of the run whatever happened
  after — a later step failing, the run timing out — e.g. `drain` puts a deployment back into
  the proxy's routing. Undos run in reverse order, before verification, each journaled as a
  step of its own;
- `escalate`: a reason to call people now (a crash loop, a power cap at its floor); the engine
  journals an escalation event, counts it and queues the escalation report;
- `finish`: the run is over, successfully, without the remaining steps and the verification
  (a canary that finds a false alarm); the engine journals the reason as the verification.

`ActionContext.settings` carries what host actions need from the config (executors, allowed
URLs, Redis), `journal` lets an action keep a durable promise (a scheduled power-cap restore).
"""

from __future__ import annotations

import dataclasses
import logging
import re
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from pydantic import BaseModel, ConfigDict

from remediator.actions.settings import ActionSettings
from remediator.targets import Target, fill_templates

if TYPE_CHECKING:
    from remediator.journal import Journal

log = logging.getLogger(__name__)

# The step mapping's own key beside the action name: no action may take that name.
RESERVED_STEP_KEYS = frozenset({"timeout_seconds"})
_ACTION_NAME = re.compile(r"^[a-z][a-z0-9_]{0,62}$")

# Socket timeouts and sleeps wake a little after the instant they were set for; an action
# that honoured its deadline must not be reported as a timeout for those milliseconds.
_DEADLINE_SLACK_SECONDS = 0.25


class ActionParams(BaseModel):
    """Base for params models: unknown keys refused, values frozen.

    `needs_seconds()` tells the loader how long the action needs with these params at least
    (a `wait` of 600 s needs 600 s), so a step's time limit can never be shorter by mistake.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    def needs_seconds(self) -> float:
        """The least time the action needs with these params (0: no particular need)."""
        return 0.0


@dataclass(frozen=True)
class ActionContext:
    """What an action may know while it runs.

    `deadline` is a `time.monotonic()` instant the action must finish by; `cancel` is set when
    the remediator stops: long waits must use `cancel.wait(...)`, not sleep. A pause or a
    maintenance window does not cut a step short: it takes effect between steps (the engine
    runs no further step that is not read-only).
    """

    target: Target
    prometheus_url: str
    deadline: float
    cancel: threading.Event
    dry_run: bool
    settings: ActionSettings = field(default_factory=ActionSettings)
    journal: Journal | None = None
    run_id: int | None = None

    def remaining(self) -> float:
        """Seconds left until the deadline (0 when it has passed)."""
        return max(0.0, self.deadline - time.monotonic())


@dataclass(frozen=True)
class Undo:
    """A compensating step: action `action` with validated `params`, within `timeout_seconds`.

    `why` says what it undoes (journaled with it). It runs with its own time limit, not the
    run's: putting a deployment back into routing must happen even after the run ran out.
    """

    action: str
    params: BaseModel
    timeout_seconds: float
    why: str


@dataclass(frozen=True)
class StepResult:
    """The outcome of one step: success, a one-line human summary, and structured details.

    `undo` (a compensating step), `escalate` (a reason to call people) and `finish` (the run
    ends here, successfully) are for the engine; see the module docstring.
    """

    ok: bool
    output: str
    details: dict[str, Any] = field(default_factory=dict)
    undo: Undo | None = None
    escalate: str | None = None
    finish: str | None = None


ActionFn = Callable[[ActionContext, Any], StepResult]
P = TypeVar("P", bound=BaseModel)


@dataclass(frozen=True)
class RegisteredAction:
    """A registered action: its name, params model, function and default time limit.

    `read_only` actions observe and change nothing (probes, checks, waits): they may serve as
    a playbook's verification probe, and the engine runs them without first asking whether
    the alert still fires. `disruptive`
    actions touch their target (restart, drain, cap, kill): only they spend the target's
    disruption budget (`playbooks/budget.py`). Every action that is not read-only is
    disruptive unless it says otherwise: `escalate` changes something (it calls people, so
    it does not run under dry-run) but touches no target.

    `clears_alert` actions remove, when they succeed, what their alert measures but not the
    whole fault (a port ghost killed: `PortGhost` reads 0, yet the unit still has to start).
    After one has acted, the alert's resolving is the run's own doing, not the fault going away
    by itself: the engine stops asking whether the alert still fires, finishes the playbook's
    steps and lets verification judge.
    """

    name: str
    params_model: type[BaseModel]
    fn: ActionFn
    default_timeout_seconds: float
    read_only: bool = False
    undo_first: Callable[[ActionContext, Any], Undo | None] | None = None
    disruptive: bool = True
    clears_alert: bool = False
    # What undoes it, for people (docs/actions.md): the undo step, or a restore of its own.
    undo: str = ""

    def parse_params(self, raw: Mapping[str, Any]) -> BaseModel:
        """Validate filled params; raises `pydantic.ValidationError`."""
        return self.params_model.model_validate(dict(raw))


class UnknownActionError(KeyError):
    """No action is registered under that name."""


# The registry is filled by import side effects (`@action` on module level, as robusta does):
# which actions exist is fixed once `remediator.actions` is imported, never changed at runtime.
_REGISTRY: dict[str, RegisteredAction] = {}
_REGISTRY_LOCK = threading.Lock()


def action(
    name: str,
    params: type[P],
    *,
    default_timeout_seconds: float = 60.0,
    read_only: bool = False,
    undo_first: Callable[[ActionContext, P], Undo | None] | None = None,
    disruptive: bool | None = None,
    undo: str = "",
    clears_alert: bool = False,
) -> Callable[[Callable[[ActionContext, P], StepResult]], Callable[[ActionContext, P], StepResult]]:
    """Register `fn(ctx, params) -> StepResult` as the action `name` taking `params`.

    `undo_first(ctx, params)` names, before the action runs, the undo it may need (an undo is
    recorded before the step that needs it): the engine journals it with the step's start,
    so a crash in the middle of the step still leaves the undo to run. An action whose
    result then carries no undo had nothing to undo; the engine marks it not needed.

    `disruptive` defaults to `not read_only`; a read-only action is never disruptive.
    `undo` says in words what undoes the action (docs/actions.md is generated from it): an
    action with `undo_first` must say it. `clears_alert`: see `RegisteredAction`.

    Raises `ValueError` for a bad or taken name, a non-positive default time limit, a
    params model that accepts unknown keys, a read-only action said to be disruptive, or an
    `undo_first` without its `undo`, or a read-only action said to clear its alert.
    """
    if not _ACTION_NAME.match(name) or name in RESERVED_STEP_KEYS:
        raise ValueError(f"action name {name!r}: use lower_snake_case, not a reserved step key")
    if default_timeout_seconds <= 0:
        raise ValueError(f"action {name}: default_timeout_seconds must be > 0")
    if read_only and disruptive:
        raise ValueError(f"action {name}: a read-only action cannot be disruptive")
    if read_only and clears_alert:
        raise ValueError(f"action {name}: a read-only action changes nothing, clears nothing")
    if undo_first is not None and not undo:
        raise ValueError(f"action {name}: say what undoes it (`undo`) beside `undo_first`")
    if params.model_config.get("extra") != "forbid":
        raise ValueError(
            f"action {name}: params model {params.__name__} must forbid extra keys "
            "(subclass ActionParams)"
        )

    def register(
        fn: Callable[[ActionContext, P], StepResult],
    ) -> Callable[[ActionContext, P], StepResult]:
        with _REGISTRY_LOCK:
            if name in _REGISTRY:
                raise ValueError(f"action {name!r} is already registered")
            _REGISTRY[name] = RegisteredAction(
                name=name,
                params_model=params,
                fn=fn,
                default_timeout_seconds=default_timeout_seconds,
                read_only=read_only,
                undo_first=undo_first,
                disruptive=not read_only if disruptive is None else disruptive,
                undo=undo,
                clears_alert=clears_alert,
            )
        return fn

    return register


def get_action(name: str) -> RegisteredAction:
    """The action registered as `name`; raises `UnknownActionError`."""
    try:
        return _REGISTRY[name]
    except KeyError:
        raise UnknownActionError(name) from None


def registered() -> dict[str, RegisteredAction]:
    """A copy of the registry, name to action."""
    with _REGISTRY_LOCK:
        return dict(_REGISTRY)


def render_params(raw: Mapping[str, Any], target: Target) -> dict[str, Any]:
    """`raw` with every string, at any depth, filled by `target.fill` (keys are left alone)."""
    return fill_templates(raw, target)


class StepSpec(Protocol):
    """What `render_step` reads of a step: the action's name and its params as written.

    A protocol, not the playbook's `Step`: playbooks name actions, so actions sit below them
    and know nothing of playbooks (tests/test_import_graph.py).
    """

    @property
    def action(self) -> str:
        """The registered action's name."""

    @property
    def params(self) -> Mapping[str, Any]:
        """The params as written, placeholders and all."""


def render_step(step: StepSpec, target: Target) -> BaseModel:
    """A step's params for `target`: filled from the roster, then validated by the action.

    Raises `UnknownActionError` or `pydantic.ValidationError`; both were ruled out at load
    for the sample target, but a real roster value can still fail (an engine must report it).
    """
    return get_action(step.action).parse_params(render_params(step.params, target))


def run_action(
    ctx: ActionContext, name: str, params: BaseModel, timeout_seconds: float
) -> StepResult:
    """Run action `name` with validated `params` in this thread, bounded in time.

    The action's deadline is the earlier of `ctx.deadline` and now + `timeout_seconds`.
    Never raises for the action's sake: an unknown action, wrong params, an exception inside
    the action (`error: …`) or an overrun (`timeout …`) all come back as a failed
    `StepResult`. Under `ctx.dry_run` only read-only actions are called.
    """
    try:
        registered_action = get_action(name)
    except UnknownActionError:
        return StepResult(False, f"error: no action is registered as {name!r}")
    if not isinstance(params, registered_action.params_model):
        return StepResult(
            False,
            f"error: {name} takes {registered_action.params_model.__name__}, "
            f"not {type(params).__name__}",
        )
    if ctx.cancel.is_set():
        return StepResult(False, "cancelled before it started", {"cancelled": True})
    start = time.monotonic()
    deadline = min(ctx.deadline, start + max(0.0, timeout_seconds))
    if deadline <= start:
        return StepResult(False, "timeout: no time left to start it", {"timeout": True})
    if ctx.dry_run and not registered_action.read_only:
        return StepResult(
            True,
            f"dry run: would run {name} {params.model_dump_json()}",
            {"dry_run": True},
        )
    bounded = dataclasses.replace(ctx, deadline=deadline)
    try:
        result = registered_action.fn(bounded, params)
    except Exception as exc:
        # The one broad catch of the remediator, on purpose: whatever an action raises (a bug,
        # an OSError nobody foresaw) is that step's failure, journaled and reported, and the
        # run goes on to its verdict; it must never kill the engine's worker thread.
        log.exception("action %s raised", name)
        return StepResult(False, f"error: {type(exc).__name__}: {exc}", {"exception": repr(exc)})
    elapsed = time.monotonic() - start
    if not isinstance(result, StepResult):
        return StepResult(False, f"error: {name} returned {type(result).__name__}, not StepResult")
    if time.monotonic() > deadline + _DEADLINE_SLACK_SECONDS:
        limit = deadline - start
        return StepResult(
            False,
            f"timeout after {elapsed:.1f} s (limit {limit:.1f} s): {result.output}",
            {**result.details, "timeout": True, "elapsed_seconds": round(elapsed, 3)},
            # What the action did before it overran must still be undone (and escalated).
            undo=result.undo,
            escalate=result.escalate,
        )
    return result
