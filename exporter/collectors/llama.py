"""llama-server: health, identity, slots, requests and token counters of every roster server.

All servers, and the four endpoints of each (`/health`, `/props`, `/metrics`, `/slots`), are
read at once on the collector's thread pool, each call with the server's `timeout_seconds`; the
scrape waits at most the largest of those (plus a small margin), so a server that accepts the
connection and never answers costs one timeout and nothing else.

Sample output (server `alpha`, generating on one of two slots)::

    gpufleet_llama_up{server="alpha"} 1.0
    gpufleet_llama_health{server="alpha",state="ok"} 1.0
    gpufleet_llama_info{alias="gemma",build="b6100-1a2b3c4",model="Gemma4-31B-QAT-Q4_K_M",
                        role="gpu-dense",server="alpha"} 1.0
    gpufleet_llama_slots{server="alpha",state="busy"} 1.0
    gpufleet_llama_decode_calls_total{server="alpha"} 1630.0
    gpufleet_llama_slot_decoded_tokens{server="alpha",slot="0"} 1634.0
    gpufleet_llama_slot_predict_limit{server="alpha",slot="0"} +Inf
    gpufleet_llama_endpoint{endpoint="metrics",server="alpha",state="ok"} 1.0

Check by hand: `curl -s http://127.0.0.1:31001/health`, `curl -s .../slots | jq`,
`curl -s .../metrics | grep ^llamacpp:` (with `-H "Authorization: Bearer $(cat KEYFILE)"` when
the server has an API key).
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import TypeVar

from prometheus_client.metrics_core import Metric

from exporter.collectors import catalogue
from exporter.collectors.base import CollectorError
from exporter.roster import Server
from exporter.sources.http_client import Answer, Outcome, call, read_secret
from exporter.sources.llama_api import (
    EndpointState,
    Health,
    ParseError,
    Props,
    Slot,
    endpoint_state,
    health_state,
    parse_metrics,
    parse_props,
    parse_slots,
)

log = logging.getLogger(__name__)

T = TypeVar("T")

ENDPOINTS = ("metrics", "slots", "props")
# Waiting a little past the calls' own timeout lets a call that times out report TIMEOUT
# itself rather than be cut off as "still running".
_MARGIN_SECONDS = 0.05
_MAX_WORKERS = 64


@dataclass
class _ServerState:
    """What the collector remembers of one server between scrapes."""

    alias: str = ""
    build: str = ""
    # slot id -> (task id, when the exporter first saw that task in that slot)
    tasks: dict[int, tuple[int | None, float]] = field(default_factory=dict)
    logged: dict[str, str] = field(default_factory=dict)


@dataclass
class _Read:
    """One server's answers of one scrape."""

    health: Health
    answers: dict[str, Answer]
    key_error: str | None = None


class _Families:
    """The families of one scrape, filled server by server."""

    def __init__(self) -> None:
        _s, _ss = ["server"], ["server", "state"]
        self.up = catalogue.gauge("gpufleet_llama_up")
        self.health = catalogue.gauge("gpufleet_llama_health")
        self.info = catalogue.gauge("gpufleet_llama_info")
        self.endpoint = catalogue.gauge("gpufleet_llama_endpoint")
        self.slots = catalogue.gauge("gpufleet_llama_slots")
        self.context = catalogue.gauge("gpufleet_llama_context_tokens")
        self.processing = catalogue.gauge("gpufleet_llama_requests_processing")
        self.deferred = catalogue.gauge("gpufleet_llama_requests_deferred")
        self.decode = catalogue.counter("gpufleet_llama_decode_calls_total")
        self.prompt_tokens = catalogue.counter("gpufleet_llama_prompt_tokens_total")
        self.predicted_tokens = catalogue.counter("gpufleet_llama_predicted_tokens_total")
        self.prompt_seconds = catalogue.counter("gpufleet_llama_prompt_seconds_total")
        self.predicted_seconds = catalogue.counter("gpufleet_llama_predicted_seconds_total")
        self.decoded = catalogue.gauge("gpufleet_llama_slot_decoded_tokens")
        self.limit = catalogue.gauge("gpufleet_llama_slot_predict_limit")
        self.age = catalogue.gauge("gpufleet_llama_slot_task_age_seconds")

    def all(self) -> list[Metric]:
        return [
            self.up, self.health, self.info, self.endpoint, self.slots, self.context,
            self.processing, self.deferred, self.decode, self.prompt_tokens,
            self.predicted_tokens, self.prompt_seconds, self.predicted_seconds,
            self.decoded, self.limit, self.age,
        ]  # fmt: skip


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
        self._servers = {n: s for n, s in servers.items() if s.engine == "llama"}
        self._clock = clock
        self._state = {name: _ServerState() for name in self._servers}
        workers = min(_MAX_WORKERS, max(1, 4 * len(self._servers)))
        self._pool = concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="llama")

    def collect(self) -> Iterator[Metric]:
        """One scrape of every server; raises `CollectorError` after yielding on a config fault."""
        if not self._servers:
            return
        reads = self._read_all()
        families = _Families()
        problems = []
        for name, server in self._servers.items():
            read = reads[name]
            self._export(name, server, read, families)
            if read.key_error:
                problems.append(read.key_error)
        yield from (f for f in families.all() if f.samples)
        if problems:
            raise CollectorError("; ".join(problems))

    def _read_all(self) -> dict[str, _Read]:
        futures: dict[tuple[str, str], concurrent.futures.Future[Answer]] = {}
        key_errors: dict[str, str] = {}
        for name, server in self._servers.items():
            timeout = server.timeout_seconds
            futures[name, "health"] = self._pool.submit(
                call, f"{server.url}/health", timeout=timeout
            )
            try:
                key = read_secret(server.api_key_file)
            except OSError as exc:
                # Without its key the server refuses the other endpoints: say why, once.
                key_errors[name] = f"{name}: cannot read api_key_file {server.api_key_file}: {exc}"
                continue
            headers = {"Authorization": f"Bearer {key}"} if key else {}
            for endpoint in ENDPOINTS:
                futures[name, endpoint] = self._pool.submit(
                    call, f"{server.url}/{endpoint}", timeout=timeout, headers=headers
                )
        longest = max(s.timeout_seconds for s in self._servers.values())
        concurrent.futures.wait(futures.values(), timeout=longest + _MARGIN_SECONDS)
        reads = {}
        for name in self._servers:
            answers = {}
            for (server_name, endpoint), future in futures.items():
                if server_name != name:
                    continue
                if future.done():
                    answers[endpoint] = future.result()
                else:
                    # Still waiting past its own timeout (connect and read timed separately):
                    # for the scrape it is a timeout; the call ends on its own.
                    answers[endpoint] = Answer(Outcome.TIMEOUT, detail="no answer in time")
            reads[name] = _Read(
                health=health_state(answers["health"]),
                answers=answers,
                key_error=key_errors.get(name),
            )
        return reads

    def _export(self, name: str, server: Server, read: _Read, f: _Families) -> None:
        state = self._state[name]
        up = read.health is Health.OK
        f.up.add_metric([name], 1.0 if up else 0.0)
        for health in Health:
            f.health.add_metric([name, health.value], 1.0 if health is read.health else 0.0)
        self._log_change(name, state, "health", read.health.value, read.answers["health"].detail)
        props = slots = None
        metrics: dict[str, float] = {}
        if up:
            props = self._endpoint(name, read, "props", _whole(parse_props), f)
            slots = self._endpoint(name, read, "slots", _whole(parse_slots), f)
            metrics = self._endpoint(name, read, "metrics", _metrics, f) or {}
        if props is not None:
            state.alias, state.build = props.alias, props.build
        # Identity even while down: the role and model say what is missing.
        f.info.add_metric([name, server.role, server.model, state.alias, state.build], 1.0)
        if not up:
            state.tasks.clear()  # a restarted server starts its task ids again
            return
        self._export_slots(name, state, props, slots, f)
        for key, family in (
            ("requests_processing", f.processing),
            ("requests_deferred", f.deferred),
            ("decode_calls", f.decode),
            ("prompt_tokens", f.prompt_tokens),
            ("predicted_tokens", f.predicted_tokens),
            ("prompt_seconds", f.prompt_seconds),
            ("predicted_seconds", f.predicted_seconds),
        ):
            if key in metrics:
                family.add_metric([name], metrics[key])

    def _endpoint(
        self,
        name: str,
        read: _Read,
        endpoint: str,
        parse: Callable[[bytes], tuple[T, str | None]],
        f: _Families,
    ) -> T | None:
        answer = read.answers.get(endpoint)
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
        for s in EndpointState:
            f.endpoint.add_metric([name, endpoint, s.value], 1.0 if s is current else 0.0)
        self._log_change(name, self._state[name], endpoint, current.value, detail)
        return result

    def _export_slots(
        self,
        name: str,
        state: _ServerState,
        props: Props | None,
        slots: list[Slot] | None,
        f: _Families,
    ) -> None:
        n_ctx = props.n_ctx_per_slot if props is not None else None
        if n_ctx is None and slots:
            n_ctx = slots[0].n_ctx
        if n_ctx is not None:
            f.context.add_metric([name], n_ctx)
        if slots is None:
            return  # unknown (busy, disabled): keep the task memory for the next scrape
        busy = [s for s in slots if s.busy]
        f.slots.add_metric([name, "busy"], len(busy))
        f.slots.add_metric([name, "idle"], len(slots) - len(busy))
        now = self._clock()
        seen: dict[int, tuple[int | None, float]] = {}
        for slot in busy:
            label = [name, str(slot.id)]
            known = state.tasks.get(slot.id)
            first_seen = known[1] if known is not None and known[0] == slot.task_id else now
            seen[slot.id] = (slot.task_id, first_seen)
            f.age.add_metric(label, now - first_seen)
            if slot.decoded is not None:
                f.decoded.add_metric(label, slot.decoded)
            if slot.predict_limit is not None:
                f.limit.add_metric(label, slot.predict_limit)
        state.tasks = seen

    @staticmethod
    def _log_change(name: str, state: _ServerState, what: str, value: str, detail: str) -> None:
        # One line when something changes state, not one per scrape.
        previous = state.logged.get(what)
        if previous == value:
            return
        state.logged[what] = value
        if previous is None and value in ("ok", Health.OK.value):
            return
        log.info("server %s: %s %s -> %s %s", name, what, previous or "(start)", value, detail)

    def close(self) -> None:
        """Stop the thread pool (calls in flight end on their own timeouts)."""
        self._pool.shutdown(wait=False, cancel_futures=True)


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
