r"""Power capping: one step down now, and a durable restore once the temperature is normal.

    - set_power_cap:
        step_percent: 10              # the new cap is the current one minus 10 %, …
        restore_after_seconds: 900    # … restored once the temperature stayed normal this long
        normal_margin_celsius: 10     # "normal": this far below the sensor's critical value
        vendor: amd                   # host targets only (ApuTemperatureCritical): the GPU of
                                      # this vendor on the host, looked up in Prometheus

The GPU's PCI bus id comes from Prometheus at action time (`gpufleet_gpu_info{host,gpu}`'s
`pci_bus_id`) and travels with the index: the node (`power-cap GPU WATTS PCI_BUS_ID`) refuses
when it numbers that card otherwise, so the cap lands on the card the alert is about or
nowhere. The current limit and the device's own minimum come from Prometheus
(`gpufleet_gpu_power_limit_watts{kind="current"|"min"}`); the floor is the higher of the
device minimum and the roster's `power_cap_watts` minimum for the card (keyed by bus id, else
by index). At the floor the step fails and escalates: lowering further is not possible, people
must look. The node checks the bounds again and records the value it replaced, which
`power-cap-restore GPU PCI_BUS_ID` puts back.

The restore is a promise kept in the journal, so it survives restarts and is kept by exactly
one replica: the step journals an event `power_cap_restore_scheduled` (detail: JSON with the
host, GPU, its bus id, the time it is due and the PromQL that must hold), and the engine's
heartbeat calls
`restore_due_power_caps` every `power_cap.check_interval_seconds` under a journal lease. Once
due and the query holds (the hottest sensor stayed `normal_margin_celsius` below critical for
the whole window), it runs `power-cap-restore GPU` and journals `power_cap_restored` (or
`power_cap_restore_dropped` when the host left the roster). A failed restore is retried at
the next check. One pending restore per GPU: a second step down does not add another.
"""

from __future__ import annotations

import json
import logging
import math
import threading
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Literal

from pydantic import Field

from fleet.gpu_index import normalize_pci_bus_id
from fleet.roster import Roster
from remediator.actions.executors import executor_for
from remediator.actions.host import node_call
from remediator.actions.registry import ActionContext, ActionParams, StepResult, action
from remediator.actions.settings import ActionSettings
from remediator.journal import Journal, JournalError
from remediator.prometheus_api import QueryError, query_instant

log = logging.getLogger(__name__)

SCHEDULED = "power_cap_restore_scheduled"
RESTORED = "power_cap_restored"
DROPPED = "power_cap_restore_dropped"
LEASE = "power-cap-restore"
_QUERY_TIMEOUT_SECONDS = 5.0
_RESTORE_TIMEOUT_SECONDS = 60.0


class SetPowerCapParams(ActionParams):
    """`set_power_cap`: how far down, when to restore, and (host targets) which GPU."""

    step_percent: float = Field(default=10.0, gt=0, le=50)
    restore_after_seconds: float = Field(default=900.0, ge=10, le=7 * 86400)
    normal_margin_celsius: float = Field(default=10.0, ge=0, le=50)
    vendor: Literal["amd", "nvidia"] | None = None


def _value(prometheus_url: str, query: str, timeout: float) -> float | None:
    try:
        series = query_instant(prometheus_url, query, timeout_seconds=timeout)
        return float(series[0]["value"][1]) if series else None
    except (QueryError, KeyError, IndexError, TypeError, ValueError):
        return None


def gpu_identity(
    prometheus_url: str, host: str, *, gpu: int | None = None, vendor: str | None = None
) -> tuple[int, str] | str:
    """`(gpu index, PCI bus id)` of one GPU of `host` from `gpufleet_gpu_info`, or why not.

    Selected by index (a GPU target) or by vendor (a host target: the APU). Every series
    found must name the same GPU: two exporters disagreeing is a reason not to act.
    """
    selector = f'host="{host}",' + (f'gpu="{gpu}"' if gpu is not None else f'vendor="{vendor}"')
    query = f"gpufleet_gpu_info{{{selector}}}"
    try:
        series = query_instant(prometheus_url, query, timeout_seconds=_QUERY_TIMEOUT_SECONDS)
    except QueryError as exc:
        return f"cannot read the identity of the GPU ({query}): {exc}"
    found = sorted(
        {
            (
                str(s.get("metric", {}).get("gpu", "")),
                str(s.get("metric", {}).get("pci_bus_id", "")),
            )
            for s in series
        }
    )
    if len(found) != 1:
        return f"{query} gave {len(found)} GPU(s) ({found}); exactly one is needed"
    index, bus_id = found[0]
    if not index.isdigit():
        return f"{query}: gpu {index!r} is not an index"
    try:
        return int(index), normalize_pci_bus_id(bus_id)
    except ValueError:
        return f"{query}: pci_bus_id {bus_id!r} is not a PCI bus id"


def _gpu_of(ctx: ActionContext, params: SetPowerCapParams) -> tuple[int, str] | str:
    """The GPU to cap, with its bus id, or why there is none."""
    target = ctx.target
    if target.gpu is None and params.vendor is None:
        return f"{target.key} is not a GPU: give `vendor` (e.g. amd for an APU)"
    return gpu_identity(ctx.prometheus_url, target.host, gpu=target.gpu, vendor=params.vendor)


def normal_query(ctx: ActionContext, gpu: int, params: SetPowerCapParams) -> str:
    """PromQL that holds once the hottest sensor stayed `margin` below critical for the window."""
    host = ctx.target.host
    window = f"{int(params.restore_after_seconds)}s"
    # Enough points in the window to see a short hot spell (one per 30 s at most).
    step = f"{min(30, max(1, int(params.restore_after_seconds) // 10))}s"
    if ctx.target.gpu is not None:
        selector = f'{{host="{host}",gpu="{gpu}"}}'
        delta = (
            f"max by (host) (gpufleet_gpu_temperature_celsius{selector} - on (host, instance, "
            f"gpu, sensor) gpufleet_gpu_temperature_critical_celsius{selector})"
        )
    else:
        # An APU: its temperature is the CPU package's (k10temp Tctl/Tdie), as in the alert.
        selector = f'{{host="{host}",chip=~"k10temp(_[0-9]+)?",sensor=~"Tctl|Tdie"}}'
        delta = (
            f"max by (host) (gpufleet_host_temperature_celsius{selector} - on (host, instance, "
            f"chip, sensor) gpufleet_host_temperature_critical_celsius{selector})"
        )
    margin = f"{params.normal_margin_celsius:g}"
    return f"max_over_time(({delta})[{window}:{step}]) < -{margin}"


@dataclass(frozen=True)
class ScheduledRestore:
    """A pending restore, as journaled."""

    event_id: int
    host: str
    gpu: int
    due_at: datetime
    query: str
    pci_bus_id: str | None = None  # None: scheduled before actions carried the bus id


def pending_restores(journal: Journal) -> list[ScheduledRestore]:
    """Scheduled restores not yet restored or dropped, oldest first."""
    closed = set()
    for kind in (RESTORED, DROPPED):
        for event in journal.events(kind=kind, limit=5000):
            try:
                closed.add(int(json.loads(event.detail)["schedule"]))
            except (ValueError, KeyError, TypeError):
                continue
    pending = []
    for event in journal.events(kind=SCHEDULED, limit=5000):
        if event.id in closed:
            continue
        try:
            data = json.loads(event.detail)
            pending.append(
                ScheduledRestore(
                    event.id,
                    str(data["host"]),
                    int(data["gpu"]),
                    datetime.fromisoformat(data["due_at"]),
                    str(data["query"]),
                    str(data["pci_bus_id"]) if data.get("pci_bus_id") else None,
                )
            )
        except (ValueError, KeyError, TypeError):
            log.warning("journal event %d is not a readable power-cap restore", event.id)
    return sorted(pending, key=lambda item: item.event_id)


@action(
    "set_power_cap",
    SetPowerCapParams,
    default_timeout_seconds=60.0,
    undo="a restore journaled with the step: `power-cap-restore` once the card's hottest sensor "
    "has stayed `normal_margin_celsius` below critical for `restore_after_seconds`",
)
def set_power_cap(ctx: ActionContext, params: SetPowerCapParams) -> StepResult:
    """Lower the GPU's power cap one step (bounded), and schedule its restore.

    Node `power-cap GPU WATTS PCI_BUS_ID` (the bus id from `gpufleet_gpu_info{host,gpu}` at
    action time) with the current limit (`gpufleet_gpu_power_limit_watts{kind="current"}`)
    minus the step, never below the roster's `power_cap_watts[gpu].min` nor the device minimum;
    at the floor the step fails and calls people. It journals a restore (with the bus id): the
    engine's heartbeat runs `power-cap-restore GPU PCI_BUS_ID` once the hottest sensor has
    stayed `normal_margin_celsius` below critical for `restore_after_seconds` (kept in the
    journal: a restart does not forget it; one replica does it). `vendor: amd` picks a host's
    AMD GPU for an APU alert.
    """
    identity = _gpu_of(ctx, params)
    if isinstance(identity, str):
        return StepResult(False, f"error: {identity}")
    gpu, bus_id = identity
    host = ctx.target.host
    bounds = ctx.target.host_entry.power_bounds(gpu, bus_id)
    if bounds is None:
        return StepResult(
            False,
            f"refused: the roster gives no power_cap_watts bounds for gpu {gpu} ({bus_id}) "
            f"of {host}",
        )
    selector = f'host="{host}",gpu="{gpu}"'
    timeout = max(0.2, min(_QUERY_TIMEOUT_SECONDS, ctx.remaining()))
    current = _value(
        ctx.prometheus_url,
        f'gpufleet_gpu_power_limit_watts{{{selector},kind="current"}}',
        timeout,
    )
    if current is None:
        return StepResult(False, f"cannot read the current power limit of gpu {gpu} of {host}")
    device_min = _value(
        ctx.prometheus_url, f'gpufleet_gpu_power_limit_watts{{{selector},kind="min"}}', timeout
    )
    floor = max(bounds.min, device_min or 0.0)
    wanted = max(floor, current * (1 - params.step_percent / 100))
    watts = max(math.ceil(floor), math.floor(wanted))
    details = {"gpu": gpu, "pci_bus_id": bus_id, "current": current, "floor": floor, "new": watts}
    if current - watts < 1:
        why = (
            f"gpu {gpu} of {host} is at its power-cap floor ({current:g} W, floor {floor:g} W) "
            "and still too hot"
        )
        return StepResult(False, f"at the floor: {why}", details, escalate=why)
    answer = node_call(ctx, "power-cap", [str(gpu), str(watts), bus_id])
    if not answer.ok:
        return StepResult(False, answer.journal_text(), details)
    output = f"power cap of gpu {gpu} ({bus_id}): {current:g} W → {watts} W (floor {floor:g} W)"
    if ctx.journal is not None:
        output += "; " + _schedule(ctx, gpu, bus_id, params)
    return StepResult(True, f"{output}\n{answer.journal_text()}", details)


def _schedule(ctx: ActionContext, gpu: int, bus_id: str, params: SetPowerCapParams) -> str:
    assert ctx.journal is not None
    host = ctx.target.host
    if any(r.host == host and r.gpu == gpu for r in pending_restores(ctx.journal)):
        return "a restore is already scheduled for this GPU"
    due = datetime.now(UTC) + timedelta(seconds=params.restore_after_seconds)
    query = normal_query(ctx, gpu, params)
    detail = {
        "host": host,
        "gpu": gpu,
        "pci_bus_id": bus_id,
        "due_at": due.isoformat(),
        "query": query,
    }
    ctx.journal.add_event(
        SCHEDULED, json.dumps(detail), run_id=ctx.run_id, target=f"gpu/{host}/{gpu}"
    )
    return f"restore scheduled, due from {due:%F %T} UTC once `{query}` holds"


def restore_due_power_caps(
    journal: Journal,
    roster: Roster,
    settings: ActionSettings,
    prometheus_url: str,
    *,
    now: datetime | None = None,
    cancel: threading.Event | None = None,
) -> list[str]:
    """Restore every due power cap whose temperature query holds; what was done, one line each.

    Called by the engine's heartbeat; only the replica holding the journal lease acts.
    """
    if settings.executors is None:
        return []
    ttl = timedelta(seconds=settings.power_cap_check_interval_seconds * 2 + 60)
    try:
        if not journal.take_lease(LEASE, ttl):
            return []
        pending = pending_restores(journal)
    except JournalError as exc:
        log.warning("power-cap restores: journal unavailable: %s", exc)
        return []
    moment = now or datetime.now(UTC)
    done: list[str] = []
    for item in pending:
        if cancel is not None and cancel.is_set():
            break
        if item.due_at > moment:
            continue
        entry = roster.hosts.get(item.host)
        target = f"gpu/{item.host}/{item.gpu}"
        if entry is None:
            detail = {"schedule": item.event_id, "why": "the host is no longer in the roster"}
            journal.add_event(DROPPED, json.dumps(detail), target=target)
            done.append(f"{target}: dropped (host not in the roster)")
            continue
        try:
            series = query_instant(prometheus_url, item.query, timeout_seconds=5.0)
        except QueryError as exc:
            log.warning("power-cap restore of %s: %s", target, exc)
            continue
        if not series:
            continue  # not normal long enough yet: the next check asks again
        bus_id = item.pci_bus_id
        if bus_id is None:  # scheduled by an older remediator: the card as Prometheus sees it
            identity = gpu_identity(prometheus_url, item.host, gpu=item.gpu)
            if isinstance(identity, str):
                log.warning("power-cap restore of %s: %s", target, identity)
                continue
            bus_id = identity[1]
        executor = executor_for(item.host, entry, settings.executors)
        answer = executor.run(
            "power-cap-restore",
            [str(item.gpu), bus_id],
            timeout=_RESTORE_TIMEOUT_SECONDS,
            cancel=cancel,
        )
        if not answer.ok:
            log.warning("power-cap restore of %s failed: %s", target, answer.summary)
            continue
        detail = {"schedule": item.event_id, "result": answer.result}
        journal.add_event(RESTORED, json.dumps(detail, default=str), target=target)
        done.append(f"{target}: restored")
        log.info("power cap of %s restored", target)
    return done
