"""The fleet at a glance: what Prometheus knows of each host and what the journal says of it.

`gather(...)` builds one `FleetStatus` — read by `gpu-fleet-remediator status` (a table that
fits 100 columns, or `--json`) and by the remediator's page (`remediator/ui.py`) — from:

- Prometheus' HTTP API: one instant query (`remediator.prometheus_api.query_instant`) for the
  exporter's series the view needs (the catalogue, docs/metrics.md: `gpufleet_gpu_*`,
  `gpufleet_llama_*`, `gpufleet_vllm_*`, `gpufleet_port_ghost`, `gpufleet_unit_active`), the
  recording rules' `server_model:gpufleet_tokens_per_second:{current,baseline_7d}` and `up{job=
  "gpu-fleet-exporter"}`, narrowed to one `host` with `--host`;
- the journal: pause (and who set it, why), maintenance windows, open breakers, cooldowns, the
  newest run of each target, runs that wait, the outbox's depth and its failed reports;
- the roster: the hosts and servers there are, so a server Prometheus knows nothing about is
  shown as unknown, never left out — and unknown is `None` (`?` in the table, `null` in JSON),
  never 0.

Prometheus unreachable (or refusing the query) leaves `prometheus_error` set and every value
that only Prometheus knows unknown; the journal's part is still filled in, and the other way
round (`journal_error`).

Check by hand: `gpu-fleet-remediator status --config /etc/gpu-fleet/remediator.yaml`, and
compare with `curl -G $PROM/api/v1/query --data-urlencode 'query={__name__=~"gpufleet_gpu_up"}'`.
"""

from __future__ import annotations

import math
import re
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from typing import Any

from fleet.roster import Roster
from remediator import prometheus_api
from remediator.journal import Journal, JournalError, RunRecord

EXPORTER_JOB = "gpu-fleet-exporter"
"""The scrape job of the exporters (DESIGN.md, "Metric names")."""

TPS_CURRENT = "server_model:gpufleet_tokens_per_second:current"
TPS_BASELINE = "server_model:gpufleet_tokens_per_second:baseline_7d"

# Every series the view reads, in one instant query: one round trip however large the fleet.
SERIES = (
    "up",
    "gpufleet_gpu_info",
    "gpufleet_gpu_up",
    "gpufleet_gpu_read_timeout",
    "gpufleet_gpu_temperature_celsius",
    "gpufleet_gpu_temperature_critical_celsius",
    "gpufleet_gpu_memory_used_bytes",
    "gpufleet_gpu_memory_total_bytes",
    "gpufleet_gpu_power_watts",
    "gpufleet_gpu_power_limit_watts",
    "gpufleet_llama_info",
    "gpufleet_llama_up",
    "gpufleet_llama_health",
    "gpufleet_llama_sleeping",
    "gpufleet_llama_model_state",
    "gpufleet_llama_context_tokens",
    "gpufleet_llama_slots",
    "gpufleet_llama_requests_deferred",
    "gpufleet_vllm_info",
    "gpufleet_vllm_up",
    "gpufleet_vllm_requests_running",
    "gpufleet_vllm_requests_waiting",
    "gpufleet_port_ghost",
    "gpufleet_unit_active",
    TPS_CURRENT,
    TPS_BASELINE,
)
GIB = 1024**3
RUNS_LOOKED_AT = 200
"""The newest runs read for "the last run of each target"."""
_HOST_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")


# --- the records ----------------------------------------------------------------------------


@dataclass(frozen=True)
class GpuStatus:
    """One GPU as Prometheus sees it; None is unknown."""

    gpu: str
    vendor: str | None = None
    model: str | None = None
    up: bool | None = None
    read_timeout: bool | None = None
    temperature_celsius: float | None = None
    temperature_sensor: str | None = None
    critical_celsius: float | None = None
    vram_used_bytes: float | None = None
    vram_total_bytes: float | None = None
    power_watts: float | None = None
    power_cap_watts: float | None = None


@dataclass(frozen=True)
class ModelSpeed:
    """One served model's generation speed on a router: now and its 7-day baseline (tok/s)."""

    now: float | None = None
    baseline: float | None = None


@dataclass(frozen=True)
class ServerStatus:
    """One model server: the roster's facts and what Prometheus sees; None is unknown.

    `state` is `ok`, `loading`, `error`, `unreachable`, `timeout` (llama-server's `/health`),
    `sleeping`, `router` (its models in `router_models`: name → `loaded`, `sleeping`, …),
    `up`/`down` (vLLM), or None when nothing is known. A router's speeds are per served model
    (`model_speeds`); its own `tokens_per_second` is then None — one number across models
    would say nothing of any of them.
    """

    server: str
    engine: str | None
    role: str | None
    model: str | None
    in_roster: bool
    state: str | None = None
    up: bool | None = None
    sleeping: bool | None = None
    router_models: dict[str, str] = field(default_factory=dict)
    context_tokens: int | None = None
    slots_busy: int | None = None
    slots_total: int | None = None
    deferred: int | None = None
    tokens_per_second: float | None = None
    baseline_tokens_per_second: float | None = None
    model_speeds: dict[str, ModelSpeed] = field(default_factory=dict)
    ghost: bool | None = None
    unit_active: bool | None = None


@dataclass(frozen=True)
class Maintenance:
    """A host's maintenance window: since when, until when (None: until turned off), who, why."""

    since: datetime
    until: datetime | None
    by: str
    reason: str


@dataclass(frozen=True)
class OpenBreaker:
    """An open circuit breaker: acting on `target` stopped until a person resets it."""

    target: str
    opened_at: datetime | None
    playbook: str | None
    reason: str | None


@dataclass(frozen=True)
class Cooldown:
    """A target cooling down after a disruptive run."""

    target: str
    until: datetime
    playbook: str | None


@dataclass(frozen=True)
class LastRun:
    """The newest run of a target (or one that waits)."""

    id: int
    target: str
    alertname: str
    playbook: str | None
    created_at: datetime
    finished_at: datetime | None
    state: str
    decision: str | None
    outcome: str | None
    wait_reason: str | None
    not_before: datetime | None

    @property
    def result(self) -> str:
        """One word or phrase: the outcome, else the decision, else the state."""
        if self.state == "pending" and self.wait_reason is not None:
            return f"waiting ({self.wait_reason})"
        return self.outcome or self.decision or self.state


@dataclass(frozen=True)
class HostStatus:
    """One host: its exporter, GPUs and servers, and the remediator's side of it."""

    host: str
    in_roster: bool
    exporter_up: bool | None = None
    gpus: list[GpuStatus] = field(default_factory=list)
    servers: list[ServerStatus] = field(default_factory=list)
    maintenance: Maintenance | None = None
    breakers: list[OpenBreaker] = field(default_factory=list)
    cooldowns: list[Cooldown] = field(default_factory=list)
    last_runs: list[LastRun] = field(default_factory=list)


@dataclass(frozen=True)
class Pause:
    """The fleet-wide pause: on or off, and the act that set it (who, when, why)."""

    paused: bool | None
    by: str | None = None
    at: datetime | None = None
    reason: str | None = None


@dataclass(frozen=True)
class OutboxFailure:
    """A report Zulip refused for good."""

    id: int
    created_at: datetime
    topic: str
    run_id: int | None
    attempts: int
    error: str | None


@dataclass(frozen=True)
class FleetStatus:
    """The whole view. `prometheus_error`/`journal_error` say which half could not be read."""

    at: datetime
    prometheus_url: str
    prometheus_error: str | None
    journal_error: str | None
    pause: Pause
    outbox_depth: int | None
    outbox_oldest: datetime | None
    outbox_failures: list[OutboxFailure]
    hosts: list[HostStatus]
    waiting_runs: list[LastRun] = field(default_factory=list)


# --- Prometheus -----------------------------------------------------------------------------


@dataclass(frozen=True)
class _Sample:
    name: str
    labels: dict[str, str]
    value: float


def _query(host: str | None) -> str:
    names = "|".join(re.escape(name) for name in SERIES)
    matchers = [f'__name__=~"{names}"']
    if host is not None:
        # Host names are checked against the roster before they get here; quoted anyway.
        matchers.append(f'host="{host}"')
    return "{" + ",".join(matchers) + "}"


def read_prometheus(
    prometheus_url: str, *, host: str | None = None, timeout_seconds: float = 5.0
) -> list[_Sample]:
    """The series the view needs, as samples; raises `prometheus_api.QueryError`."""
    result = prometheus_api.query_instant(
        prometheus_url, _query(host), timeout_seconds=timeout_seconds
    )
    samples = []
    for series in result:
        metric = dict(series.get("metric") or {})
        value = series.get("value")
        try:
            number = float(value[1])
        except (TypeError, ValueError, IndexError):
            continue
        name = metric.pop("__name__", "")
        samples.append(_Sample(name, {str(k): str(v) for k, v in metric.items()}, number))
    return samples


def _finite(value: float | None) -> float | None:
    return value if value is not None and math.isfinite(value) else None


class _Index:
    """The samples of one host, by series name, for the per-field look-ups below."""

    def __init__(self, samples: Iterable[_Sample]) -> None:
        self.by_name: dict[str, list[_Sample]] = defaultdict(list)
        for sample in samples:
            self.by_name[sample.name].append(sample)

    def all(self, name: str, **labels: str) -> list[_Sample]:
        return [
            s
            for s in self.by_name.get(name, [])
            if all(s.labels.get(k, "") == v for k, v in labels.items())
        ]

    def one(self, name: str, **labels: str) -> float | None:
        found = self.all(name, **labels)
        return _finite(found[0].value) if found else None

    def total(self, name: str, **labels: str) -> float | None:
        values = [s.value for s in self.all(name, **labels) if math.isfinite(s.value)]
        return sum(values) if values else None


def _flag(value: float | None) -> bool | None:
    return None if value is None else value >= 0.5


def _as_int(value: float | None) -> int | None:
    return None if value is None else round(value)


def _gpus(index: _Index) -> list[GpuStatus]:
    names = {
        s.labels.get("gpu", "")
        for name in SERIES
        if name.startswith("gpufleet_gpu_")
        for s in index.all(name)
    } - {""}
    gpus = []
    for gpu in sorted(names, key=lambda g: (len(g), g)):
        info = index.all("gpufleet_gpu_info", gpu=gpu)
        # The sensor closest to its critical value (or the hottest when none has one).
        best: tuple[float, float, str, float | None] | None = None
        for sample in index.all("gpufleet_gpu_temperature_celsius", gpu=gpu):
            if not math.isfinite(sample.value):
                continue
            sensor = sample.labels.get("sensor", "")
            critical = index.one(
                "gpufleet_gpu_temperature_critical_celsius", gpu=gpu, sensor=sensor
            )
            rank = sample.value / critical if critical else sample.value / 1000
            candidate = (rank, sample.value, sensor, critical)
            if best is None or candidate[:2] > best[:2]:
                best = candidate
        gpus.append(
            GpuStatus(
                gpu=gpu,
                vendor=info[0].labels.get("vendor") if info else None,
                model=info[0].labels.get("model") if info else None,
                up=_flag(index.one("gpufleet_gpu_up", gpu=gpu)),
                read_timeout=_flag(index.one("gpufleet_gpu_read_timeout", gpu=gpu)),
                temperature_celsius=best[1] if best else None,
                temperature_sensor=best[2] if best else None,
                critical_celsius=best[3] if best else None,
                vram_used_bytes=index.one("gpufleet_gpu_memory_used_bytes", gpu=gpu, pool="vram"),
                vram_total_bytes=index.one("gpufleet_gpu_memory_total_bytes", gpu=gpu, pool="vram"),
                power_watts=index.one("gpufleet_gpu_power_watts", gpu=gpu),
                power_cap_watts=index.one(
                    "gpufleet_gpu_power_limit_watts", gpu=gpu, kind="current"
                ),
            )
        )
    return gpus


def _llama_state(index: _Index, server: str, router: bool) -> tuple[str | None, dict[str, str]]:
    models: dict[str, str] = {}
    for sample in index.all("gpufleet_llama_model_state", server=server):
        if sample.value >= 0.5:
            models[sample.labels.get("served_model", "")] = sample.labels.get("state", "?")
    health = [
        s.labels.get("state", "")
        for s in index.all("gpufleet_llama_health", server=server)
        if s.value >= 0.5
    ]
    state = health[0] if health else None
    if state is None:
        up = index.one("gpufleet_llama_up", server=server)
        state = None if up is None else ("ok" if up >= 0.5 else "down")
    if state == "ok" and (router or models):
        return "router", dict(sorted(models.items()))
    if state == "ok" and _flag(index.one("gpufleet_llama_sleeping", server=server)):
        return "sleeping", models
    return state, dict(sorted(models.items()))


def _tps(index: _Index, name: str, server: str, model: str | None) -> float | None:
    found = index.all(name, server=server)
    # After a model swap both models' series may be there: the roster's model is the one now.
    mine = [s for s in found if model is not None and s.labels.get("model") == model] or found
    values = [s.value for s in mine if math.isfinite(s.value)]
    return max(values) if values else None


def _model_speeds(index: _Index, server: str) -> dict[str, ModelSpeed]:
    """A router's speeds by served model (the series' `served_model`); empty for the others."""
    speeds: dict[str, dict[str, float]] = {}
    for field_name, name in (("now", TPS_CURRENT), ("baseline", TPS_BASELINE)):
        for sample in index.all(name, server=server):
            served = sample.labels.get("served_model", "")
            if served and math.isfinite(sample.value):
                mine = speeds.setdefault(served, {})
                mine[field_name] = max(sample.value, mine.get(field_name, sample.value))
    return {served: ModelSpeed(**found) for served, found in sorted(speeds.items())}


def _server(
    index: _Index,
    name: str,
    engine: str | None,
    role: str | None,
    model: str | None,
    *,
    in_roster: bool,
    router: bool,
) -> ServerStatus:
    info = index.all("gpufleet_llama_info", server=name) or index.all(
        "gpufleet_vllm_info", server=name
    )
    if engine is None:
        engine = "vllm" if index.all("gpufleet_vllm_info", server=name) else "llama"
    role = role or (info[0].labels.get("role") if info else None)
    model = model or (info[0].labels.get("model") if info else None)
    ghosts = [s.value for s in index.all("gpufleet_port_ghost", server=name)]
    speeds = _model_speeds(index, name)
    unit = index.one("gpufleet_unit_active", server=name)
    common: dict[str, Any] = {
        "server": name,
        "engine": engine,
        "role": role,
        "model": model,
        "in_roster": in_roster,
        "tokens_per_second": None if speeds else _tps(index, TPS_CURRENT, name, model),
        "baseline_tokens_per_second": None if speeds else _tps(index, TPS_BASELINE, name, model),
        "model_speeds": speeds,
        "ghost": (max(ghosts) >= 0.5) if ghosts else None,
        "unit_active": _flag(unit),
    }
    if engine == "vllm":
        up = _flag(index.one("gpufleet_vllm_up", server=name))
        return ServerStatus(
            **common,
            state=None if up is None else ("up" if up else "down"),
            up=up,
            slots_busy=_as_int(index.total("gpufleet_vllm_requests_running", server=name)),
            deferred=_as_int(index.total("gpufleet_vllm_requests_waiting", server=name)),
        )
    state, models = _llama_state(index, name, router)
    busy = index.total("gpufleet_llama_slots", server=name, state="busy")
    idle = index.total("gpufleet_llama_slots", server=name, state="idle")
    contexts = [
        s.value
        for s in index.all("gpufleet_llama_context_tokens", server=name)
        if math.isfinite(s.value)
    ]
    return ServerStatus(
        **common,
        state=state,
        up=_flag(index.one("gpufleet_llama_up", server=name)),
        sleeping=_flag(index.one("gpufleet_llama_sleeping", server=name)),
        router_models=models,
        context_tokens=_as_int(max(contexts)) if contexts else None,
        slots_busy=_as_int(busy),
        slots_total=_as_int(busy + idle) if busy is not None and idle is not None else None,
        deferred=_as_int(index.total("gpufleet_llama_requests_deferred", server=name)),
    )


def _servers(index: _Index, roster_host: Any | None) -> list[ServerStatus]:
    servers = []
    listed = dict(roster_host.servers) if roster_host is not None else {}
    for name, entry in sorted(listed.items()):
        servers.append(
            _server(
                index,
                name,
                entry.engine,
                entry.role,
                entry.model,
                in_roster=True,
                router=entry.router is True,
            )
        )
    seen = (
        {
            s.labels.get("server", "")
            for name in SERIES
            if "llama" in name or "vllm" in name
            for s in index.all(name)
        }
        - {""}
        - set(listed)
    )
    for name in sorted(seen):  # served and scraped, but not in the roster: shown, and said so
        servers.append(_server(index, name, None, None, None, in_roster=False, router=False))
    return servers


# --- the journal ----------------------------------------------------------------------------


def _host_of(target: str) -> str | None:
    """`server/dioscuri/alpha`, `gpu/dioscuri/0`, `host/dioscuri` → `dioscuri`."""
    parts = target.split("/")
    return parts[1] if len(parts) >= 2 else None


def _last_run(run: RunRecord) -> LastRun:
    return LastRun(
        id=run.id,
        target=run.target or "",
        alertname=run.alert.alertname,
        playbook=run.playbook,
        created_at=run.created_at,
        finished_at=run.finished_at,
        state=run.state,
        decision=run.decision,
        outcome=run.outcome,
        wait_reason=run.wait_reason,
        not_before=run.not_before,
    )


def _pause(journal: Journal) -> Pause:
    paused = journal.paused()
    if not paused:
        return Pause(False)
    found = journal.events(kind="paused", limit=1)
    if not found:
        return Pause(True)
    event = found[0]
    actor = event.actor or ""
    # The event's detail is "remediation paused by WHO[: WHY]" (journal/rails.py).
    _, _, why = str(event.detail).partition(f"paused by {actor}")
    return Pause(True, by=actor or None, at=event.at, reason=why.removeprefix(": ") or None)


@dataclass
class _JournalPart:
    pause: Pause = field(default_factory=lambda: Pause(None))
    maintenance: dict[str, Maintenance] = field(default_factory=dict)
    breakers: list[OpenBreaker] = field(default_factory=list)
    cooldowns: list[Cooldown] = field(default_factory=list)
    last_runs: list[LastRun] = field(default_factory=list)
    waiting: list[LastRun] = field(default_factory=list)
    outbox_depth: int | None = None
    outbox_oldest: datetime | None = None
    outbox_failures: list[OutboxFailure] = field(default_factory=list)


def _read_journal(journal: Journal) -> _JournalPart:
    part = _JournalPart()
    part.pause = _pause(journal)
    part.maintenance = {
        host: Maintenance(since=since, until=until, reason=why, by=by)
        for host, (since, until, why, by) in journal.maintenance_windows().items()
    }
    part.breakers = [
        OpenBreaker(b.target, b.opened_at, b.playbook, b.reason) for b in journal.breakers()
    ]
    part.cooldowns = [Cooldown(t, u, p) for t, u, p in journal.cooldowns()]
    newest: dict[str, LastRun] = {}
    for run in journal.recent_runs(RUNS_LOOKED_AT):  # newest first
        if run.target and run.target not in newest:
            newest[run.target] = _last_run(run)
    part.last_runs = sorted(newest.values(), key=lambda r: r.target)
    part.waiting = [_last_run(run) for run in journal.waiting_runs(200)]
    part.outbox_depth, part.outbox_oldest = journal.outbox_stats()
    part.outbox_failures = [
        OutboxFailure(e.id, e.created_at, e.topic, e.run_id, e.attempts, e.last_error)
        for e in journal.outbox_failures(20)
    ]
    return part


# --- together -------------------------------------------------------------------------------


def gather(
    journal: Journal | None,
    roster: Roster,
    prometheus_url: str,
    *,
    host: str | None = None,
    timeout_seconds: float = 5.0,
    now: datetime | None = None,
    journal_error: str | None = None,
) -> FleetStatus:
    """The fleet's status now; `host` narrows it to one host (a roster name: check it first).

    `journal` None: it could not be opened (`journal_error` says why). Never raises for
    Prometheus or the journal being down: their half is then unknown and the
    reason is in `prometheus_error` / `journal_error`.
    """
    prometheus_error = None
    samples: list[_Sample] = []
    try:
        samples = read_prometheus(prometheus_url, host=host, timeout_seconds=timeout_seconds)
    except prometheus_api.QueryError as exc:
        prometheus_error = str(exc)
    part = _JournalPart()
    if journal is not None:
        try:
            part = _read_journal(journal)
        except JournalError as exc:
            journal_error = str(exc)
    by_host: dict[str, list[_Sample]] = defaultdict(list)
    for sample in samples:
        by_host[sample.labels.get("host", "")].append(sample)
    names = set(roster.hosts) | {h for h in by_host if h and _HOST_NAME.match(h)}
    if host is not None:
        names &= {host}
    hosts = []
    for name in sorted(names):
        index = _Index(by_host.get(name, []))
        ups = [s for s in index.all("up") if s.labels.get("job") == EXPORTER_JOB]
        entry = roster.hosts.get(name)

        def mine(target: str, name: str = name) -> bool:
            return _host_of(target) == name

        hosts.append(
            HostStatus(
                host=name,
                in_roster=entry is not None,
                exporter_up=_flag(max(s.value for s in ups)) if ups else None,
                gpus=_gpus(index),
                servers=_servers(index, entry),
                maintenance=part.maintenance.get(name),
                breakers=[b for b in part.breakers if mine(b.target)],
                cooldowns=[c for c in part.cooldowns if mine(c.target)],
                last_runs=[r for r in part.last_runs if mine(r.target)],
            )
        )
    waiting = (
        part.waiting if host is None else [r for r in part.waiting if _host_of(r.target) == host]
    )
    return FleetStatus(
        at=now or datetime.now(UTC),
        prometheus_url=prometheus_url,
        prometheus_error=prometheus_error,
        journal_error=journal_error,
        pause=part.pause,
        outbox_depth=part.outbox_depth,
        outbox_oldest=part.outbox_oldest,
        outbox_failures=part.outbox_failures,
        hosts=hosts,
        waiting_runs=waiting,
    )


def _plain(value: Any) -> Any:
    if isinstance(value, datetime):
        return value.isoformat()
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def as_json(status: FleetStatus) -> dict[str, Any]:
    """The status as plain JSON data (times in RFC 3339, unknown as null)."""
    data: dict[str, Any] = _plain(asdict(status))
    return data


def ratio(value: float | None, reference: float | None) -> float | None:
    """`value / reference`, or None when either is unknown or the reference is not > 0."""
    if value is None or reference is None or reference <= 0:
        return None
    return value / reference


def sanitize(text: object) -> str:
    """`text` without control characters: a label must not drive the terminal it is shown on."""
    return _CONTROL.sub("\N{REPLACEMENT CHARACTER}", str(text))


_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069]")


# --- the table ------------------------------------------------------------------------------

WIDTH = 100
"""The table's width: every line fits it."""

_RESET = "\x1b[0m"
_COLORS = {"good": "\x1b[32m", "warn": "\x1b[33m", "bad": "\x1b[31;1m", "dim": "\x1b[2m"}
_GOOD_STATES = {"ok", "up", "router", "sleeping", "loaded"}
_BAD_STATES = {"error", "unreachable", "timeout", "down", "failed"}


def _fit(text: object, width: int, *, right: bool = False) -> str:
    """`text` (control characters replaced) cut with `…` or padded to exactly `width`."""
    shown = sanitize(text)
    if len(shown) > width:
        shown = shown[: max(0, width - 1)] + "…"
    return shown.rjust(width) if right else shown.ljust(width)


def _num(value: float | None, digits: int = 0) -> str:
    return "?" if value is None else f"{value:.{digits}f}"


def _pair(value: float | None, reference: float | None, digits: int = 0) -> str:
    if value is None and reference is None:
        return "?"
    return f"{_num(value, digits)}/{_num(reference, digits)}"


def _when(value: datetime | None) -> str:
    return "?" if value is None else f"{value.astimezone(UTC):%Y-%m-%d %H:%M}Z"


def _yes(value: bool | None) -> str:
    return "?" if value is None else ("yes" if value else "no")


class _Painter:
    """ANSI colour for a cell, or nothing (`enabled` False: a pipe, a file, NO_COLOR)."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled

    def __call__(self, text: str, tone: str | None) -> str:
        if not self.enabled or tone is None:
            return text
        return f"{_COLORS[tone]}{text}{_RESET}"


def _temperature_tone(gpu: GpuStatus) -> str | None:
    if gpu.temperature_celsius is None or gpu.critical_celsius is None:
        return None
    margin = gpu.critical_celsius - gpu.temperature_celsius
    return "bad" if margin <= 5 else "warn" if margin <= 15 else "good"


def _share_tone(share: float | None, warn: float, bad: float) -> str | None:
    if share is None:
        return None
    return "bad" if share >= bad else "warn" if share >= warn else None


def _state_tone(state: str | None) -> str | None:
    if state is None:
        return "dim"
    return "good" if state in _GOOD_STATES else "bad" if state in _BAD_STATES else "warn"


def _server_state(server: ServerStatus) -> str:
    if server.state is None:
        return "?" if server.unit_active is not False else "inactive"
    if server.state == "router" and server.router_models:
        # Loaded of listed (the JSON has each model's state).
        loaded = sum(1 for state in server.router_models.values() if state == "loaded")
        return f"router {loaded}/{len(server.router_models)}"
    return server.state


def _line(text: str, width: int = WIDTH) -> str:
    shown = sanitize(text)
    return shown if len(shown) <= width else shown[: width - 1] + "…"


def _gpu_lines(host: HostStatus, paint: _Painter) -> list[str]:
    lines = [
        "  "
        + "  ".join(
            [
                _fit("GPU", 3),
                _fit("model", 26),
                _fit("up", 3),
                _fit("temp/crit °C", 18),
                _fit("VRAM used/total GiB", 19),
                _fit("power/cap W", 11),
            ]
        )
    ]
    for gpu in host.gpus:
        temp = _pair(gpu.temperature_celsius, gpu.critical_celsius)
        if gpu.temperature_sensor:
            temp += f" {gpu.temperature_sensor}"
        used = None if gpu.vram_used_bytes is None else gpu.vram_used_bytes / GIB
        total = None if gpu.vram_total_bytes is None else gpu.vram_total_bytes / GIB
        up = "lost" if gpu.up is False else "hung" if gpu.read_timeout else _yes(gpu.up)
        cells = [
            _fit(gpu.gpu, 3),
            _fit(gpu.model or "?", 26),
            paint(_fit(up, 3), "good" if gpu.up else "bad" if up in ("lost", "hung") else "dim"),
            paint(_fit(temp, 18), _temperature_tone(gpu)),
            paint(
                _fit(_pair(used, total, 1), 19),
                _share_tone(ratio(gpu.vram_used_bytes, gpu.vram_total_bytes), 0.90, 0.97),
            ),
            paint(
                _fit(_pair(gpu.power_watts, gpu.power_cap_watts), 11),
                _share_tone(ratio(gpu.power_watts, gpu.power_cap_watts), 0.95, 1.0),
            ),
        ]
        lines.append("  " + "  ".join(cells))
    return lines


def _server_lines(host: HostStatus, paint: _Painter) -> list[str]:
    lines = [
        "  "
        + " ".join(
            [
                _fit("server", 10),
                _fit("role", 10),
                _fit("model", 22),
                _fit("state", 12),
                _fit("ctx", 6, right=True),
                _fit("slots", 5, right=True),
                _fit("defer", 5, right=True),
                _fit("tok/s now/base", 14, right=True),
                _fit("ghost", 5),
            ]
        )
    ]
    for server in host.servers:
        name = server.server if server.in_roster else f"{server.server}!"
        tps = ratio(server.tokens_per_second, server.baseline_tokens_per_second)
        tps_tone = None if tps is None else "bad" if tps < 0.5 else "warn" if tps < 0.7 else None
        cells = [
            _fit(name, 10),
            _fit(server.role or "?", 10),
            _fit(server.model or "?", 22),
            paint(_fit(_server_state(server), 12), _state_tone(server.state)),
            _fit(_num(server.context_tokens), 6, right=True),
            _fit(_pair(server.slots_busy, server.slots_total), 5, right=True),
            paint(_fit(_num(server.deferred), 5, right=True), "warn" if server.deferred else None),
            paint(
                _fit(
                    _pair(server.tokens_per_second, server.baseline_tokens_per_second, 1),
                    14,
                    right=True,
                ),
                tps_tone,
            ),
            paint(_fit(_yes(server.ghost), 5), "bad" if server.ghost else None),
        ]
        lines.append("  " + " ".join(cells))
        lines += _model_lines(server, paint)
    if any(not server.in_roster for server in host.servers):
        lines.append("  (!: served and scraped, but not in the roster)")
    return lines


def _model_lines(server: ServerStatus, paint: _Painter) -> list[str]:
    """A router's models under its row: each one's state and speed against its baseline."""
    lines = []
    for served in sorted(set(server.router_models) | set(server.model_speeds)):
        speed = server.model_speeds.get(served, ModelSpeed())
        share = ratio(speed.now, speed.baseline)
        tone = None if share is None else "bad" if share < 0.5 else "warn" if share < 0.7 else None
        cells = [
            _fit("", 10),
            _fit("· " + served, 33),
            _fit(server.router_models.get(served, "?"), 12),
            _fit("", 18),
            paint(_fit(_pair(speed.now, speed.baseline, 1), 14, right=True), tone),
        ]
        lines.append("  " + " ".join(cells).rstrip())
    return lines


def _remediator_lines(host: HostStatus, paint: _Painter) -> list[str]:
    lines = []
    for breaker in host.breakers:
        text = _line(
            f"  breaker OPEN {breaker.target} since {_when(breaker.opened_at)} "
            f"({breaker.playbook or '?'}): {breaker.reason or ''}".rstrip(": ")
        )
        lines.append(paint(text, "bad"))
    for cooldown in host.cooldowns:
        lines.append(
            _line(
                f"  cooldown {cooldown.target} until {_when(cooldown.until)} "
                f"({cooldown.playbook or '?'})"
            )
        )
    for run in host.last_runs:
        tone = (
            "good"
            if run.outcome in ("healed", "done_unverified", "resolved")
            else "bad"
            if run.outcome in ("not_healed", "failed", "interrupted")
            else None
        )
        lines.append(
            paint(
                _line(
                    f"  last run #{run.id} {_when(run.created_at)} {run.target} {run.alertname} → "
                    f"{run.playbook or '-'}: {run.result}"
                ),
                tone,
            )
        )
    return lines


def render_text(status: FleetStatus, *, color: bool = False) -> str:
    """The status as a table: every line at most `WIDTH` columns (colour codes aside)."""
    paint = _Painter(color)
    out = [_line(f"gpu-fleet status · {_when(status.at)} · {len(status.hosts)} host(s)")]
    if status.prometheus_error is not None:
        out.append(
            paint(_line(f"Prometheus {status.prometheus_url}: {status.prometheus_error}"), "bad")
        )
        out.append(_line("  the fleet's side is unknown (?); the journal's part follows"))
    else:
        out.append(_line(f"Prometheus {status.prometheus_url}: ok"))
    if status.journal_error is not None:
        out.append(paint(_line(f"journal: {status.journal_error}"), "bad"))
    else:
        pause = status.pause
        if pause.paused:
            why = f": {pause.reason}" if pause.reason else ""
            text = f"remediation PAUSED by {pause.by or '?'} at {_when(pause.at)}{why}"
            out.append(paint(_line(text), "warn"))
        else:
            out.append(_line("remediation: active"))
        oldest = f" (oldest {_when(status.outbox_oldest)})" if status.outbox_oldest else ""
        failed = len(status.outbox_failures)
        out.append(
            paint(
                _line(
                    f"outbox: {_num(status.outbox_depth)} unsent{oldest}, "
                    f"{failed}{'+' if failed >= 20 else ''} failed"
                ),
                "bad" if failed else None,
            )
        )
    for host in status.hosts:
        out.append("")
        exporter = {True: "exporter up", False: "exporter DOWN", None: "exporter not scraped"}
        head = (
            f"{host.host}{'' if host.in_roster else ' (not in the roster)'} · "
            + exporter[host.exporter_up]
        )
        if status.prometheus_error is not None:
            head = f"{host.host} · exporter ?"
        out.append(paint(_line(head), "bad" if host.exporter_up is False else None))
        if host.maintenance is not None:
            m = host.maintenance
            until = f" until {_when(m.until)}" if m.until else ""
            why = f": {m.reason}" if m.reason else ""
            out.append(
                paint(_line(f"  MAINTENANCE since {_when(m.since)}{until} by {m.by}{why}"), "warn")
            )
        if host.gpus:
            out += _gpu_lines(host, paint)
        if host.servers:
            out += _server_lines(host, paint)
        out += _remediator_lines(host, paint)
    if status.waiting_runs:
        out.append("")
        for run in status.waiting_runs:
            out.append(
                _line(
                    f"waiting run #{run.id} {run.target} {run.alertname} → "
                    f"{run.playbook or '-'}: {run.wait_reason}, next look "
                    f"{_when(run.not_before)}"
                )
            )
    return "\n".join(line.rstrip() for line in out) + "\n"
