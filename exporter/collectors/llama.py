"""llama-server: health, identity, sleep, router models, slots, requests and token counters.

Every roster server is read by a driver of its own, all at once, under one deadline per server
(its `timeout_seconds` from the scrape's start), through `exporter.sources.bounded`: each
(server, endpoint) is a lane with at most one call in flight, `/health` a lane of its own, and
every call is bounded as a whole. A trickling, hung or stopped server costs its own series; its
neighbours are read on time.

What is read, and why in this order (DESIGN.md, the llama-server facts; all on the pinned
build):

1. `/health`, `/props` and `/metrics` at once. `/health` alone says up or down. `/props` says
   `is_sleeping` and, in router mode, `role: "router"`. Both `/props` and `/metrics` are safe
   while the server sleeps (they answer from cache and do not reset its idle timer).
2. `/slots` only when the server is awake and `/metrics` says requests are processing: every
   server task but the metrics task resets the idle timer, and `/slots` wakes a sleeper
   (reloading its model). With nothing processing every slot is idle, which `/props`
   `total_slots` already says. While a server sleeps its slot series are absent, not 0.
3. Router mode (`--models-dir`, `--models-preset`): `/models` lists the children with their
   state; only a `loaded` one is read, with `?model=NAME&autoload=false` (without
   `autoload=false` a read loads the model; a `sleeping` or `loading` child is not asked at
   all, since `autoload=false` alone still forwards to it). Its series carry `served_model`.

Sample output (server `alpha`, generating on one of two slots)::

    gpufleet_llama_up{server="alpha"} 1.0
    gpufleet_llama_sleeping{server="alpha"} 0.0
    gpufleet_llama_info{alias="gemma",build="b6100-1a2b3c4",gpu="0",
                        model="Gemma4-31B-QAT-Q4_K_M",role="gpu-dense",server="alpha"} 1.0
    gpufleet_llama_slots{served_model="",server="alpha",state="busy"} 1.0
    gpufleet_llama_decode_calls_total{served_model="",server="alpha"} 1630.0
    gpufleet_llama_slot_decoded_tokens{served_model="",server="alpha",slot="0"} 1634.0
    gpufleet_llama_model_state{served_model="beta",server="router",state="unloaded"} 1.0

`served_model` is empty outside router mode (Prometheus stores an empty label as no label).

Check by hand: `curl -s http://127.0.0.1:31001/health`, `curl -s .../props | jq .is_sleeping`,
`curl -s .../metrics | grep ^llamacpp:`, `curl -s .../models | jq '.data[].status'`, and
`curl -s '.../metrics?model=NAME&autoload=false'` (with `-H "Authorization: Bearer $(cat
KEYFILE)"` when the server has an API key). Do not `curl .../slots` on a sleeping server.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import TypeVar
from urllib.parse import quote

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.metrics_core import Metric

from exporter.collectors import catalogue
from exporter.collectors.base import CollectorError
from exporter.sources.bounded import Lanes, Pending, Request
from exporter.sources.http_client import MAX_BODY_BYTES, Answer, Outcome, read_secret
from exporter.sources.llama_api import (
    MODEL_STATES,
    EndpointState,
    Health,
    ParseError,
    Props,
    RouterModel,
    Slot,
    endpoint_state,
    health_state,
    parse_metrics,
    parse_models,
    parse_props,
    parse_slots,
)
from fleet.roster import Server

log = logging.getLogger(__name__)

T = TypeVar("T")
_Fams = dict[str, GaugeMetricFamily | CounterMetricFamily]

# The lane workers: a fixed ceiling, not a per-server count, because a router's lanes grow with
# its loaded models (three each) and a call refused for want of a worker reads `busy`. The pool
# starts a thread only when no idle one is free, so the threads are as many as the calls that
# were ever in flight at once (each bounded by its deadline), never more than this.
MAX_WORKERS = 64

# /metrics keys to families, for a server and for each loaded router model.
_COUNTERS = {
    "decode_calls": "gpufleet_llama_decode_calls_total",
    "prompt_tokens": "gpufleet_llama_prompt_tokens_total",
    "predicted_tokens": "gpufleet_llama_predicted_tokens_total",
    "prompt_seconds": "gpufleet_llama_prompt_seconds_total",
    "predicted_seconds": "gpufleet_llama_predicted_seconds_total",
    "prompt_tokens_cached": "gpufleet_llama_prompt_tokens_cached_total",
    "spec_drafts": "gpufleet_llama_spec_drafts_total",
    "spec_draft_tokens": "gpufleet_llama_spec_draft_tokens_total",
    "spec_accepted_tokens": "gpufleet_llama_spec_accepted_tokens_total",
}
_GAUGES = {
    "requests_processing": "gpufleet_llama_requests_processing",
    "requests_deferred": "gpufleet_llama_requests_deferred",
    # llama.cpp types n_tokens_max a counter, but it is a maximum: it never adds up.
    "tokens_max": "gpufleet_llama_tokens_max",
}
_OTHER = (
    "gpufleet_llama_up",
    "gpufleet_llama_health",
    "gpufleet_llama_sleeping",
    "gpufleet_llama_info",
    "gpufleet_llama_endpoint",
    "gpufleet_llama_model_info",
    "gpufleet_llama_model_state",
    "gpufleet_llama_model_exit_code",
    "gpufleet_llama_slots",
    "gpufleet_llama_context_tokens",
    "gpufleet_llama_slot_decoded_tokens",
    "gpufleet_llama_slot_predict_limit",
    "gpufleet_llama_slot_task_age_seconds",
)


SLOTS_OVER_BUDGET = "slots_over_budget"
MODELS_OVER_BUDGET = "models_over_budget"

BODY_CAPS: Mapping[str, int] = {
    # What llama-server sends, with room (tests/fixtures/llama/ holds the pinned build's):
    # /health is a line; /props carries the chat template (tens of KB); /metrics is ~2 KB;
    # /models lists a router's children; /slots grows with the slots (~2 KB each).
    "health": 64 * 1024,
    "props": 2 * 1024 * 1024,
    "metrics": 1024 * 1024,
    "models": 2 * 1024 * 1024,
    "slots": MAX_BODY_BYTES,
}
"""The most bytes each llama-server endpoint's answer may have; past it the endpoint is `error`."""


@dataclass
class _Target:
    """What one reading is about: the server itself, or one router model (`served_model`)."""

    served_model: str = ""
    # slot id -> (task id, when the exporter first saw that task in that slot)
    tasks: dict[int, tuple[int | None, float]] = field(default_factory=dict)


@dataclass
class _ServerState:
    """What the collector remembers of one server between scrapes (never metric objects)."""

    alias: str = ""
    build: str = ""
    router: bool = False
    targets: dict[str, _Target] = field(default_factory=dict)
    logged: dict[str, str] = field(default_factory=dict)

    def target(self, served_model: str) -> _Target:
        return self.targets.setdefault(served_model, _Target(served_model))


@dataclass
class _Part:
    """The reading of one target: its answers (None: not asked, and why)."""

    served_model: str = ""
    props: Answer | None = None
    metrics: Answer | None = None
    slots: Answer | None = None
    slots_skipped: str = ""  # why /slots was not asked ("" when it was, or the server is down)
    # `/metrics` parsed (or the ParseError's message), once per scrape: deciding on /slots and
    # exporting both need it.
    _parsed: tuple[dict[str, float], str | None] | str | None = None

    def parsed_metrics(self) -> tuple[dict[str, float], str | None]:
        """The `/metrics` answer through `_metrics`, parsed at most once; raises `ParseError`."""
        if self._parsed is None:
            body = self.metrics.body if self.metrics is not None else b""
            try:
                self._parsed = _metrics(body)
            except ParseError as exc:
                self._parsed = str(exc)
        if isinstance(self._parsed, str):
            raise ParseError(self._parsed)
        return self._parsed


@dataclass
class _Read:
    """One server's reading of one scrape."""

    health: Answer
    key_error: str | None = None
    props: Props | None = None
    models: Answer | None = None
    parts: list[_Part] = field(default_factory=list)


class LlamaCollector:
    """Reads every llama-server of the host's roster; see the module docstring."""

    name = "llama"
    reads_network = True  # the fleet collector runs it beside the local collectors

    def __init__(
        self,
        servers: Mapping[str, Server],
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._servers = {n: s for n, s in sorted(servers.items()) if s.engine == "llama"}
        self._clock = clock
        self._state = {
            name: _ServerState(router=server.router is True)
            for name, server in self._servers.items()
        }
        count = max(1, len(self._servers))
        self._lanes = Lanes(MAX_WORKERS, name="llama-read", clock=clock)
        # One driver per server: it waits on its own server's calls only, so a slow server's
        # wait never delays a neighbour's second round (/slots, router models).
        self._drivers = concurrent.futures.ThreadPoolExecutor(count, thread_name_prefix="llama")
        self._lock = threading.Lock()  # one scrape at a time: the memory is per collector
        # Series left out by the servers' budgets (`max_slots`, `max_models`), cumulative; at
        # 0 from the start, so that the first drop is an increase.
        self._dropped: dict[tuple[str, str], int] = {
            (name, reason): 0
            for name in self._servers
            for reason in (SLOTS_OVER_BUDGET, MODELS_OVER_BUDGET)
        }
        self._dropped_lock = threading.Lock()

    def dropped(self) -> dict[tuple[str, str], int]:
        """Series left out by budget so far, by (server, reason); read by the fleet collector."""
        with self._dropped_lock:
            return dict(self._dropped)

    def _drop(self, name: str, reason: str, series: int) -> None:
        if series:
            with self._dropped_lock:
                self._dropped[name, reason] += series
        # Logged when it starts (and when it ends), not every scrape.
        what = "over" if series else "ok"
        self._log_change(name, reason, what, f"{series} series left out this scrape")

    def collect(self) -> Iterator[Metric]:
        """One scrape of every server; raises `CollectorError` after yielding on a config fault."""
        if not self._servers:
            return
        with self._lock:
            start = self._clock()
            drivers = {
                name: self._drivers.submit(self._read, name, server, start)
                for name, server in self._servers.items()
            }
            families = {n: catalogue.scalar(n) for n in (*_COUNTERS.values(), *_GAUGES.values())}
            families.update({n: catalogue.scalar(n) for n in _OTHER})
            problems = []
            for name, server in self._servers.items():
                # Each driver returns by its server's deadline (every wait in it is bounded).
                read = drivers[name].result()
                self._export(name, server, read, families)
                if read.key_error:
                    problems.append(read.key_error)
        yield from (f for f in families.values() if f.samples)
        if problems:
            raise CollectorError("; ".join(problems))

    # -- reading ----------------------------------------------------------------------------

    def _read(self, name: str, server: Server, start: float) -> _Read:
        deadline = start + server.timeout_seconds
        state = self._state[name]
        lanes = self._lanes

        def ask(lane: str, path: str, headers: tuple[tuple[str, str], ...]) -> Pending:
            remaining = max(0.01, deadline - self._clock())
            request = Request(
                f"{server.url}{path}",
                remaining,
                headers=headers,
                max_bytes=BODY_CAPS[lane.split("/", maxsplit=1)[0]],
            )
            return lanes.start((name, lane), request)

        health = ask("health", "/health", ())  # never needs the key
        try:
            key = read_secret(server.api_key_file)
        except OSError as exc:
            # Without its key the server refuses the other endpoints: say why, once.
            lanes.wait([health])
            error = f"{name}: cannot read api_key_file {server.api_key_file}: {exc}"
            return _Read(health.answer(), key_error=error, parts=[_Part()])
        headers = (("Authorization", f"Bearer {key}"),) if key else ()
        first = {"props": ask("props", "/props", headers)}
        if state.router:
            first["models"] = ask("models", "/models", headers)
        else:
            first["metrics"] = ask("metrics", "/metrics", headers)
        lanes.wait([health, *first.values()])
        read = _Read(health.answer())
        props_answer = first["props"].answer()
        read.props = _parse_or_none(props_answer, parse_props)
        if read.props is not None:
            # The roster may say so (`router: true`); else /props' `role` decides.
            state.router = read.props.router or server.router is True
        if health_state(read.health) is not Health.OK:
            read.parts = [_Part(props=props_answer)]
            return read
        # /props unanswered this scrape (busy, a 401): a server known as a router stays one.
        if state.router:
            read.models = first["models"].answer() if "models" in first else None
            if read.models is None:  # first sight of a router: ask its list now
                pending = ask("models", "/models", headers)
                lanes.wait([pending])
                read.models = pending.answer()
            read.parts = self._read_router(read.models, ask, headers, lanes, server.max_models)
            return read
        part = _Part(props=props_answer, metrics=first["metrics"].answer())
        read.parts = [part]
        if _wants_slots(part, read.props):
            pending = ask("slots", "/slots", headers)
            lanes.wait([pending])
            part.slots = pending.answer()
        return read

    def _read_router(
        self,
        models: Answer,
        ask: Callable[[str, str, tuple[tuple[str, str], ...]], Pending],
        headers: tuple[tuple[str, str], ...],
        lanes: Lanes,
        max_models: int,
    ) -> list[_Part]:
        # Past the server's budget a model is neither read nor exported (`_export_router`).
        listed = (_parse_or_none(models, parse_models) or [])[:max_models]
        parts: list[_Part] = []
        pending: list[tuple[_Part, Pending, Pending]] = []
        for model in listed:
            if model.state != "loaded":
                continue  # asking a sleeping or loading child would wake or wait on it
            query = f"?model={quote(model.id, safe='')}&autoload=false"
            part = _Part(served_model=model.id)
            props = ask(f"props/{model.id}", f"/props{query}", headers)
            metrics = ask(f"metrics/{model.id}", f"/metrics{query}", headers)
            pending.append((part, props, metrics))
            parts.append(part)
        lanes.wait([p for _, *both in pending for p in both])
        for part, props, metrics in pending:
            part.props, part.metrics = props.answer(), metrics.answer()
        slots = []
        for part in parts:
            if _wants_slots(part, _parse_or_none(part.props, parse_props)):
                query = f"?model={quote(part.served_model, safe='')}&autoload=false"
                slots.append((part, ask(f"slots/{part.served_model}", f"/slots{query}", headers)))
        lanes.wait([p for _, p in slots])
        for part, answer in slots:
            part.slots = answer.answer()
        return parts

    # -- exporting --------------------------------------------------------------------------

    def _export(self, name: str, server: Server, read: _Read, f: _Fams) -> None:
        state = self._state[name]
        health = health_state(read.health)
        up = health is Health.OK
        f["gpufleet_llama_up"].add_metric([name], 1.0 if up else 0.0)
        for h in Health:
            f["gpufleet_llama_health"].add_metric([name, h.value], 1.0 if h is health else 0.0)
        self._log_change(name, "health", health.value, read.health.detail)
        props = read.props
        if props is not None:
            state.alias, state.build = props.alias, props.build
            if props.is_sleeping is not None and not props.router:
                f["gpufleet_llama_sleeping"].add_metric([name], 1.0 if props.is_sleeping else 0)
        # Identity even while down: the role and model say what is missing, `gpu` (the roster's;
        # "", no label, where it gives none) which card's loss explains it: the rules copy it
        # onto the server's alerts, for GpuLost's inhibition per card.
        gpu = "" if server.gpu is None else str(server.gpu)
        f["gpufleet_llama_info"].add_metric(
            [name, server.role, server.model, state.alias, state.build, gpu], 1.0
        )
        if not up:
            state.targets.clear()  # a restarted server starts its task ids again
            return
        if state.router:  # from this scrape's /props, else the last one that answered
            self._export_router(name, server, read, f)
        seen = set()
        states: dict[str, list[EndpointState]] = {}
        for part in read.parts:
            seen.add(part.served_model)
            target = state.target(part.served_model)
            self._export_part(name, target, part=part, f=f, read=read, states=states)
        for gone in set(state.targets) - seen:
            del state.targets[gone]
        # An endpoint not asked this scrape (/slots of an idle or sleeping server) is absent.
        for endpoint, found in states.items():
            worst = next(s for s in _SEVERITY if s in found)
            for s in EndpointState:
                f["gpufleet_llama_endpoint"].add_metric(
                    [name, endpoint, s.value], 1.0 if s is worst else 0.0
                )

    def _export_router(self, name: str, server: Server, read: _Read, f: _Fams) -> None:
        models: list[RouterModel] | None = None
        current, detail = EndpointState.ERROR, read.key_error or ""
        if read.models is not None:
            current, detail = endpoint_state(read.models), read.models.detail
            if current is EndpointState.OK:
                try:
                    models = parse_models(read.models.body)
                except ParseError as exc:
                    current, detail = EndpointState.ERROR, str(exc)
        for s in EndpointState:
            f["gpufleet_llama_endpoint"].add_metric(
                [name, "models", s.value], 1.0 if s is current else 0.0
            )
        self._log_change(name, "models", current.value, detail)
        listed = models or []
        over = listed[server.max_models :]
        # What each model past the budget would have had: info, a state per value, exit code.
        self._drop(
            name,
            MODELS_OVER_BUDGET,
            sum(1 + len(MODEL_STATES) + (m.exit_code is not None) for m in over),
        )
        for model in listed[: server.max_models]:
            f["gpufleet_llama_model_info"].add_metric([name, model.id], 1.0)
            for value in MODEL_STATES:
                f["gpufleet_llama_model_state"].add_metric(
                    [name, model.id, value], 1.0 if value == model.state else 0.0
                )
            if model.exit_code is not None:
                f["gpufleet_llama_model_exit_code"].add_metric([name, model.id], model.exit_code)

    def _export_part(
        self,
        name: str,
        target: _Target,
        *,
        part: _Part,
        f: _Fams,
        read: _Read,
        states: dict[str, list[EndpointState]],
    ) -> None:
        model = part.served_model
        # A router's own /props is the router's; only its children have slots and context.
        props: Props | None = None
        if not (read.props is not None and read.props.router) or model:
            props = self._endpoint(
                name,
                model,
                endpoint="props",
                answer=part.props,
                parse=_whole(parse_props),
                states=states,
                read=read,
            )
        metrics: dict[str, float] | None = None
        if part.metrics is not None or not model:
            metrics = self._endpoint(
                name,
                model,
                endpoint="metrics",
                answer=part.metrics,
                parse=lambda _body: part.parsed_metrics(),
                states=states,
                read=read,
            )
        slots = None
        if part.slots is not None:
            slots = self._endpoint(
                name,
                model,
                endpoint="slots",
                answer=part.slots,
                parse=_whole(parse_slots),
                states=states,
                read=read,
            )
        if props is not None and props.n_ctx_per_slot is not None:
            f["gpufleet_llama_context_tokens"].add_metric([name, model], props.n_ctx_per_slot)
        for key, family in (*_COUNTERS.items(), *_GAUGES.items()):
            if metrics and key in metrics:
                f[family].add_metric([name, model], metrics[key])
        self._export_slots(name, target, props=props, part=part, slots=slots, f=f)

    def _export_slots(
        self,
        name: str,
        target: _Target,
        *,
        props: Props | None,
        part: _Part,
        slots: list[Slot] | None,
        f: _Fams,
    ) -> None:
        model = part.served_model
        if slots is None:
            if part.slots_skipped == "idle" and props is not None and props.total_slots:
                # Nothing processing (from /metrics): every slot is idle, no /slots needed.
                f["gpufleet_llama_slots"].add_metric([name, model, "busy"], 0.0)
                f["gpufleet_llama_slots"].add_metric([name, model, "idle"], props.total_slots)
                target.tasks.clear()
            # Otherwise unknown (asleep, busy, disabled): absent, and the task memory is kept.
            return
        busy = [s for s in slots if s.busy]
        f["gpufleet_llama_slots"].add_metric([name, model, "busy"], len(busy))
        f["gpufleet_llama_slots"].add_metric([name, model, "idle"], len(slots) - len(busy))
        now = self._clock()
        seen: dict[int, tuple[int | None, float]] = {}
        # Per-slot series for the lowest ids up to the server's budget; the rest left out.
        busy.sort(key=lambda s: s.id)
        budget = self._servers[name].max_slots
        self._drop(
            name,
            SLOTS_OVER_BUDGET,
            sum(1 + (s.decoded is not None) + (s.predict_limit is not None) for s in busy[budget:]),
        )
        for slot in busy[:budget]:
            label = [name, model, str(slot.id)]
            known = target.tasks.get(slot.id)
            first_seen = known[1] if known is not None and known[0] == slot.task_id else now
            seen[slot.id] = (slot.task_id, first_seen)
            f["gpufleet_llama_slot_task_age_seconds"].add_metric(label, now - first_seen)
            if slot.decoded is not None:
                f["gpufleet_llama_slot_decoded_tokens"].add_metric(label, slot.decoded)
            if slot.predict_limit is not None:
                f["gpufleet_llama_slot_predict_limit"].add_metric(label, slot.predict_limit)
        target.tasks = seen

    def _endpoint(
        self,
        name: str,
        model: str,
        *,
        endpoint: str,
        answer: Answer | None,
        parse: Callable[[bytes], tuple[T, str | None]],
        states: dict[str, list[EndpointState]],
        read: _Read,
    ) -> T | None:
        result: T | None = None
        if answer is None:  # not asked: the API key could not be read
            current, detail = EndpointState.ERROR, read.key_error or ""
        else:
            current, detail = endpoint_state(answer), answer.detail
            if current is EndpointState.OK:
                try:
                    result, problem = parse(answer.body)
                except ParseError as exc:
                    current, detail = EndpointState.ERROR, str(exc)
                else:
                    if problem is not None:
                        current, detail = EndpointState.ERROR, problem
            elif answer.outcome is Outcome.ANSWERED:
                detail = f"HTTP {answer.status}"
        states.setdefault(endpoint, []).append(current)
        what = f"{endpoint} of {model}" if model else endpoint
        self._log_change(name, what, current.value, detail)
        return result

    def _log_change(self, name: str, what: str, value: str, detail: str) -> None:
        # One line when something changes state, not one per scrape.
        logged = self._state[name].logged
        previous = logged.get(what)
        if previous == value:
            return
        logged[what] = value
        if previous is None and value in ("ok", Health.OK.value):
            return
        log.info("server %s: %s %s -> %s %s", name, what, previous or "(start)", value, detail)

    def close(self) -> None:
        """Stop the threads (calls in flight end at their own deadline)."""
        self._drivers.shutdown(wait=False, cancel_futures=True)
        self._lanes.close()


def _whole(parse: Callable[[bytes], T]) -> Callable[[bytes], tuple[T, str | None]]:
    """A parser whose result is either complete or a `ParseError`."""

    def parse_whole(body: bytes) -> tuple[T, str | None]:
        return parse(body), None

    return parse_whole


def _metrics(body: bytes) -> tuple[dict[str, float], str | None]:
    """`/metrics`, with the expected series that went missing (an upstream rename) as a problem.

    What is there is still exported, but the endpoint reads as `error`, so the rules say so
    instead of going quiet.
    """
    values, missing = parse_metrics(body)
    return values, ("missing " + ", ".join(missing)) if missing else None


# Worst first: a router's endpoint series sums up its loaded models' (one series per server).
_SEVERITY = (EndpointState.ERROR, EndpointState.BUSY, EndpointState.DISABLED, EndpointState.OK)


def _wants_slots(part: _Part, props: Props | None) -> bool:
    """Whether to ask `/slots`: only of an awake server that is processing requests.

    `/slots` wakes a sleeping server and resets the idle timer of an awake one (module
    docstring); with nothing processing every slot is idle, which `/props` says. Sets
    `part.slots_skipped` to why not.
    """
    if props is None or props.is_sleeping is not False:
        # Unknown counts as possibly asleep: a wrong guess must not wake the server.
        part.slots_skipped = "sleeping" if props and props.is_sleeping else "unknown"
        return False
    values: dict[str, float] = {}
    if part.metrics is not None and part.metrics.ok:
        with contextlib.suppress(ParseError):
            values = part.parsed_metrics()[0]
    processing = values.get("requests_processing")
    if processing is None:
        part.slots_skipped = "unknown"
        return False
    if processing <= 0:
        part.slots_skipped = "idle"
        return False
    return True


def _parse_or_none(answer: Answer | None, parse: Callable[[bytes], T]) -> T | None:
    """The parsed 200 answer, or None (not asked, not 200, or not the shape we know)."""
    if answer is None or not answer.ok:
        return None
    try:
        return parse(answer.body)
    except ParseError:
        return None
