"""The canary throughput probe: a small fixed chat completion, now and then, per llama-server.

Traffic-dependent counters give a throughput that falls as concurrency rises and says nothing
when the server is idle; the canary is the controlled measurement the degradation baseline
prefers. For every roster server with a `canary:` key, a background thread waits
`interval_seconds` and then, when the rules below allow, sends one chat completion
(temperature 0, `max_tokens` set, thinking off, `cache_prompt: false` so the prompt is
processed again and its tok/s covers the whole prompt, not one token) and keeps the tok/s
that llama-server reports in the answer's `timings`. Probes run on their own schedule, never
during a scrape: the collector only reads the last result.

When a probe runs (checked in this order, each from an endpoint that wakes nothing: `/health`,
`/props` and `/metrics` answer a sleeping server from cache; `/slots` is never read, since it
wakes a sleeper and resets its idle timer):

1. `/health` is 200, else `skipped_down`;
2. the server is not asleep (`/props` `is_sleeping`), else `skipped_sleeping`: a completion
   would wake it and reload its model;
3. a slot is free (`/metrics` `requests_processing` below `/props` `total_slots`), else
   `skipped_busy`;
4. real traffic came since the probe's last run (llama-server's finished-request counters
   moved from what they read right after that run, or a request is processing), else
   `skipped_idle`. Every completion resets the idle timer of a server started with
   `--sleep-idle-seconds`, so a canary on an idle server would keep it awake for ever; an idle
   server has no throughput to defend either. The first probe after the exporter starts has
   no last run and goes ahead; so does the first after a restart (the counters went back: a
   new process, which the last reading, the old process's, says nothing about).

In router mode (`/props` `role: "router"`) each child whose `/models` status is `loaded` is
probed (the request names it and carries `autoload=false`); a sleeping, loading or unloaded
child never is. Results carry the child's id as `served_model` ("" outside router mode).

Sample output::

    gpufleet_canary_tokens_per_second{phase="generation",served_model="",server="alpha"} 61.8
    gpufleet_canary_tokens_per_second{phase="prompt",served_model="",server="alpha"} 512.4
    gpufleet_canary_last_run_timestamp_seconds{served_model="",server="alpha"} 1.7964e+09
    gpufleet_canary_runs_total{outcome="ok",server="alpha"} 12.0
    gpufleet_canary_runs_total{outcome="skipped_idle",server="alpha"} 3.0

Check by hand: `curl -s URL/props | jq .is_sleeping` before sending a completion yourself.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import TypeVar
from urllib.parse import quote

from prometheus_client.metrics_core import Metric

from exporter.collectors import catalogue
from exporter.sources.bounded import Lanes, Request
from exporter.sources.http_client import Answer, read_secret
from exporter.sources.llama_api import (
    ParseError,
    Props,
    parse_metrics,
    parse_models,
    parse_props,
)
from fleet.roster import Canary, Server

log = logging.getLogger(__name__)

T = TypeVar("T")

# Fixed, so that runs compare: a short prompt and a bounded, deterministic answer.
PROMPT = "Count from one to twenty in words, separated by commas."
OUTCOMES = (
    "ok",
    "skipped_down",
    "skipped_sleeping",
    "skipped_busy",
    "skipped_idle",
    "skipped_unknown",
    "error",
)
# The counters that move when a request finishes: real traffic since the last run shows here.
_TRAFFIC = ("prompt_tokens", "predicted_tokens")


@dataclass(frozen=True)
class CanaryResult:
    """One successful probe."""

    generation_tokens_per_second: float | None
    prompt_tokens_per_second: float | None
    finished_at: float  # Unix time


def _rate(timings: Mapping[str, object], key: str) -> float | None:
    value = timings.get(key)
    if isinstance(value, int | float) and not isinstance(value, bool) and value >= 0:
        return float(value)
    return None


class CanaryProbe:
    """The probe of one server; `run_once()` is one attempt, `start()` runs it periodically."""

    def __init__(
        self,
        name: str,
        server: Server,
        settings: Canary,
        *,
        first_delay_seconds: float | None = None,
        wall_clock: Callable[[], float] = time.time,
        lanes: Lanes | None = None,
    ) -> None:
        self.name = name
        # A probe made alone (a test, a one-off run) brings its own reader and closes it.
        self._own_lanes = lanes is None
        self._lanes = lanes or Lanes(1, name=f"canary-{name}")
        self._server = server
        self._settings = settings
        # Not all servers at once after a restart of the exporter, and not the full interval.
        self._first_delay = (
            min(30.0, settings.interval_seconds)
            if first_delay_seconds is None
            else first_delay_seconds
        )
        self._wall_clock = wall_clock
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._latest: dict[str, CanaryResult] = {}
        # This attempt's results, published with its outcome count in one step (run_once),
        # so a snapshot never shows a result without the run that made it.
        self._measured: dict[str, CanaryResult] = {}
        # Per served_model: the finished-request counters right after its last run.
        self._after_last_run: dict[str, tuple[float, ...]] = {}
        self._runs = dict.fromkeys(OUTCOMES, 0)
        self._thread = threading.Thread(target=self._loop, name=f"canary-{name}", daemon=True)

    def start(self) -> None:
        """Probe in the background until `stop()`."""
        self._thread.start()

    def stop(self) -> None:
        """Stop probing; a probe in flight ends on its own timeout."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=1.0)
        if self._own_lanes:
            self._lanes.close()

    def snapshot(self) -> tuple[dict[str, CanaryResult], dict[str, int]]:
        """The last successful result per served_model, and the count of runs by outcome."""
        with self._lock:
            return dict(self._latest), dict(self._runs)

    def _loop(self) -> None:
        delay = self._first_delay
        while not self._stop.wait(delay):
            try:
                self.run_once()
            except Exception:
                log.exception("canary %s: probe failed", self.name)
                self._count("error")
            delay = self._settings.interval_seconds

    def _count(self, outcome: str) -> None:
        with self._lock:
            self._runs[outcome] += 1

    def run_once(self) -> str:
        """One attempt; returns its outcome (one of `OUTCOMES`)."""
        self._measured = {}
        outcome = self._attempt()
        with self._lock:
            self._latest.update(self._measured)
            self._runs[outcome] += 1
        return outcome

    def _get(self, path: str, headers: tuple[tuple[str, str], ...]) -> Answer:
        server = self._server
        return self._lanes.call(
            Request(f"{server.url}{path}", server.timeout_seconds, headers=headers)
        )

    def _attempt(self) -> str:
        if not self._get("/health", ()).ok:
            return "skipped_down"
        try:
            key = read_secret(self._server.api_key_file)
        except OSError as exc:
            log.warning("canary %s: cannot read %s: %s", self.name, self._server.api_key_file, exc)
            return "error"
        headers = (("Authorization", f"Bearer {key}"),) if key else ()
        props = _parsed(self._get("/props", headers), parse_props)
        if props is None:
            return "skipped_unknown"
        if not props.router:
            return self._probe("", "", props, headers)
        models = _parsed(self._get("/models", headers), parse_models)
        if models is None:
            return "skipped_unknown"
        # Within the server's model budget, as the llama collector reads them.
        models = models[: self._server.max_models]
        self._forget_all_but({m.id for m in models})
        loaded = [m.id for m in models if m.state == "loaded"]
        if not loaded:
            # Every child asleep or unloaded: asking one would load or wake it.
            return "skipped_sleeping"
        outcomes = []
        for model in loaded:
            query = f"?model={quote(model, safe='')}&autoload=false"
            child = _parsed(self._get(f"/props{query}", headers), parse_props)
            outcomes.append(
                self._probe(model, query, child, headers) if child else "skipped_unknown"
            )
        # One outcome per attempt: the best one says whether the attempt measured anything.
        return min(outcomes, key=OUTCOMES.index)

    def _forget_all_but(self, listed: set[str]) -> None:
        """Forget the children a router no longer lists.

        Removed from the router, their last results would be exported for ever, and the
        memory grow with every model swap.
        """
        with self._lock:
            for gone in set(self._latest) - listed:
                del self._latest[gone]
        for gone in set(self._after_last_run) - listed:
            del self._after_last_run[gone]

    def _probe(
        self, model: str, query: str, props: Props, headers: tuple[tuple[str, str], ...]
    ) -> str:
        """One completion against the server (or one router child), if the rules allow it."""
        if props.is_sleeping is not False:
            # Unknown counts as asleep: a wrong guess must not wake the server.
            return "skipped_sleeping" if props.is_sleeping else "skipped_unknown"
        values = _parsed(self._get(f"/metrics{query}", headers), lambda b: parse_metrics(b)[0])
        processing = values.get("requests_processing") if values else None
        if values is None or processing is None or props.total_slots is None:
            return "skipped_unknown"
        if processing >= props.total_slots:
            return "skipped_busy"
        before = self._after_last_run.get(model)
        # Moved at all, not "moved up": counters that went back are a new process (a restart
        # reset them), whose speed the old process's reading must not stand for. Comparing
        # with `<=` read a restarted server as idle until it had served as much as the old one
        # (the lab's degraded scenario: the slow reading stayed, and its alert with it).
        if before is not None and processing == 0 and _traffic(values) == before:
            return "skipped_idle"
        outcome = self._complete(model, query, headers)
        after = _parsed(self._get(f"/metrics{query}", headers), lambda b: parse_metrics(b)[0])
        if after is not None:
            # What the counters read with this run in: only later traffic moves them past it.
            self._after_last_run[model] = _traffic(after)
        return outcome

    def _complete(self, model: str, query: str, headers: tuple[tuple[str, str], ...]) -> str:
        payload: dict[str, object] = {
            "messages": [{"role": "user", "content": PROMPT}],
            "max_tokens": self._settings.max_tokens,
            "temperature": 0,
            "stream": False,
            # The same prompt every run: from the cache its "prompt" tok/s would cover one token.
            "cache_prompt": False,
            "chat_template_kwargs": {"enable_thinking": False},
        }
        if model:
            payload["model"] = model
        answer = self._lanes.call(
            Request(
                f"{self._server.url}/v1/chat/completions{query}",
                self._settings.timeout_seconds,
                method="POST",
                body=json.dumps(payload).encode(),
                headers=(*headers, ("Content-Type", "application/json")),
            )
        )
        if not answer.ok:
            log.info("canary %s: completion failed: %s", self.name, answer.detail or answer.status)
            return "error"
        try:
            timings = json.loads(answer.body).get("timings")
        except (ValueError, AttributeError):
            timings = None
        if not isinstance(timings, dict):
            log.info("canary %s: answer without timings", self.name)
            return "error"
        result = CanaryResult(
            generation_tokens_per_second=_rate(timings, "predicted_per_second"),
            prompt_tokens_per_second=_rate(timings, "prompt_per_second"),
            finished_at=self._wall_clock(),
        )
        self._measured[model] = result
        return "ok"


def _traffic(values: Mapping[str, float]) -> tuple[float, ...]:
    return tuple(values.get(key, 0.0) for key in _TRAFFIC)


def _parsed(answer: Answer, parse: Callable[[bytes], T]) -> T | None:
    if not answer.ok:
        return None
    try:
        return parse(answer.body)
    except ParseError:
        return None


class CanaryCollector:
    """Exports the probes' last results; owns the probe threads."""

    name = "canary"

    def __init__(
        self, servers: Mapping[str, Server], *, first_delay_seconds: float | None = None
    ) -> None:
        # One bounded reader for every probe: each probe calls on its own thread, so a lane of
        # workers is never used; the watchdog bounds each call as a whole.
        self._lanes = Lanes(1, name="canary")
        self.probes = [
            CanaryProbe(
                name,
                server,
                server.canary,
                first_delay_seconds=first_delay_seconds,
                lanes=self._lanes,
            )
            for name, server in servers.items()
            if server.canary is not None
        ]
        for probe in self.probes:
            probe.start()

    def collect(self) -> Iterator[Metric]:
        """The last result of every probe (nothing for a server not yet probed)."""
        if not self.probes:
            return
        rate = catalogue.gauge("gpufleet_canary_tokens_per_second")
        last = catalogue.gauge("gpufleet_canary_last_run_timestamp_seconds")
        runs = catalogue.counter("gpufleet_canary_runs_total")
        for probe in self.probes:
            results, counts = probe.snapshot()
            for outcome, count in counts.items():
                runs.add_metric([probe.name, outcome], count)
            for model, result in sorted(results.items()):
                last.add_metric([probe.name, model], result.finished_at)
                for phase, value in (
                    ("generation", result.generation_tokens_per_second),
                    ("prompt", result.prompt_tokens_per_second),
                ):
                    if value is not None:
                        rate.add_metric([probe.name, model, phase], value)
        yield from (f for f in (rate, last, runs) if f.samples)

    def close(self) -> None:
        """Stop every probe thread."""
        for probe in self.probes:
            probe.stop()
        self._lanes.close()
