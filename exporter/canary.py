"""The canary throughput probe: a small fixed chat completion, now and then, per llama-server.

Traffic-dependent counters give a throughput that falls as concurrency rises and says nothing
when the server is idle; the canary is the controlled measurement the degradation baseline
prefers. For every roster server with a `canary:` key, a background thread waits
`interval_seconds`, checks that the server is up and has an idle slot, sends one chat
completion (temperature 0, `max_tokens` set, thinking off) and keeps the tok/s that
llama-server reports in the answer's `timings`. Probes run on their own schedule, never
during a scrape: the collector only reads the last result.

Sample output::

    gpufleet_canary_tokens_per_second{phase="generation",server="alpha"} 61.8
    gpufleet_canary_tokens_per_second{phase="prompt",server="alpha"} 512.4
    gpufleet_canary_last_run_timestamp_seconds{server="alpha"} 1.7964e+09
    gpufleet_canary_runs_total{outcome="ok",server="alpha"} 12.0
    gpufleet_canary_runs_total{outcome="skipped_busy",server="alpha"} 3.0
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass

from prometheus_client.metrics_core import Metric

from exporter.collectors import catalogue
from exporter.roster import Canary, Server
from exporter.sources.http_client import Outcome, call, read_secret
from exporter.sources.llama_api import ParseError, parse_metrics, parse_props, parse_slots

log = logging.getLogger(__name__)

# Fixed, so that runs compare: a short prompt and a bounded, deterministic answer.
PROMPT = "Count from one to twenty in words, separated by commas."
OUTCOMES = ("ok", "skipped_down", "skipped_busy", "skipped_unknown", "error")


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
    ) -> None:
        self.name = name
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
        self._latest: CanaryResult | None = None
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

    def snapshot(self) -> tuple[CanaryResult | None, dict[str, int]]:
        """The last successful result and the count of runs by outcome."""
        with self._lock:
            return self._latest, dict(self._runs)

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
        outcome = self._attempt()
        self._count(outcome)
        return outcome

    def _attempt(self) -> str:
        server = self._server
        timeout = server.timeout_seconds
        if not call(f"{server.url}/health", timeout=timeout).ok:
            return "skipped_down"
        try:
            key = read_secret(server.api_key_file)
        except OSError as exc:
            log.warning("canary %s: cannot read %s: %s", self.name, server.api_key_file, exc)
            return "error"
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        idle = self._has_idle_slot(headers)
        if idle is None:
            return "skipped_unknown"
        if not idle:
            return "skipped_busy"
        payload = {
            "messages": [{"role": "user", "content": PROMPT}],
            "max_tokens": self._settings.max_tokens,
            "temperature": 0,
            "stream": False,
            "chat_template_kwargs": {"enable_thinking": False},
        }
        answer = call(
            f"{server.url}/v1/chat/completions",
            timeout=self._settings.timeout_seconds,
            method="POST",
            body=json.dumps(payload).encode(),
            headers={**headers, "Content-Type": "application/json"},
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
        with self._lock:
            self._latest = result
        return "ok"

    def _has_idle_slot(self, headers: dict[str, str]) -> bool | None:
        """Whether a slot is free: from /slots, else /metrics against /props; None if unknown."""
        server = self._server
        timeout = server.timeout_seconds
        slots = call(f"{server.url}/slots", timeout=timeout, headers=headers)
        if slots.ok:
            try:
                return any(not slot.busy for slot in parse_slots(slots.body))
            except ParseError:
                return None
        if slots.outcome is Outcome.TIMEOUT:
            return False  # /slots waits behind a long prompt batch: the server is busy
        metrics = call(f"{server.url}/metrics", timeout=timeout, headers=headers)
        props = call(f"{server.url}/props", timeout=timeout, headers=headers)
        if not (metrics.ok and props.ok):
            return None
        try:
            values, _ = parse_metrics(metrics.body)
            total = parse_props(props.body).total_slots
        except ParseError:
            return None
        processing = values.get("requests_processing")
        if total is None or processing is None:
            return None
        return processing < total


class CanaryCollector:
    """Exports the probes' last results; owns the probe threads."""

    name = "canary"

    def __init__(
        self, servers: Mapping[str, Server], *, first_delay_seconds: float | None = None
    ) -> None:
        self.probes = [
            CanaryProbe(name, server, server.canary, first_delay_seconds=first_delay_seconds)
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
            result, counts = probe.snapshot()
            for outcome, count in counts.items():
                runs.add_metric([probe.name, outcome], count)
            if result is None:
                continue
            last.add_metric([probe.name], result.finished_at)
            for phase, value in (
                ("generation", result.generation_tokens_per_second),
                ("prompt", result.prompt_tokens_per_second),
            ):
                if value is not None:
                    rate.add_metric([probe.name, phase], value)
        yield from (f for f in (rate, last, runs) if f.samples)

    def close(self) -> None:
        """Stop every probe thread."""
        for probe in self.probes:
            probe.stop()
