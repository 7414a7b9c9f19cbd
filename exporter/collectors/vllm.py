"""vLLM model servers: `/health` and `/metrics` of every roster server with engine `vllm`.

Sample output (`tests/golden/vllm_v1.prom`: one vLLM with two data-parallel engines)::

    gpufleet_vllm_info{gpu="",model="Qwen3-32B-AWQ",role="gpu-dense",
                       served_model="Qwen/Qwen3-32B-AWQ",server="gamma"} 1.0
    gpufleet_vllm_up{server="gamma"} 1.0
    gpufleet_vllm_endpoint{endpoint="metrics",server="gamma",state="ok"} 1.0
    gpufleet_vllm_endpoint{endpoint="metrics",server="gamma",state="busy"} 0.0
    gpufleet_vllm_requests_running{server="gamma"} 5.0
    gpufleet_vllm_kv_cache_usage_ratio{server="gamma"} 0.016934579439252362
    gpufleet_vllm_prompt_tokens_total{server="gamma"} 3.454905e+06
    gpufleet_vllm_time_to_first_token_seconds_bucket{le="0.25",server="gamma"} 1690.0

Check a server by hand: `curl -s -o /dev/null -w '%{http_code}' http://HOST:PORT/health`
(200 = up) and `curl -s http://HOST:PORT/metrics | grep ^vllm:` (add
`-H "Authorization: Bearer $(cat KEYFILE)"` when the roster gives the server an `api_key_file`).

How it reads:

- Every server, and both endpoints of each, are read at once through
  `exporter.sources.bounded` (the llama collector's and the canary's way too): each call is
  bounded as a whole by the server's `timeout_seconds` (a server that trickles its answer is
  cut at that deadline), `/health` and `/metrics` are lanes of their own, and a lane whose
  call is still in flight is reported busy at once instead of queueing a second call.
- `gpufleet_vllm_up` is `/health` alone (200 = up; vLLM answers 503 once its engine died).
  A server that is down, refuses or times out is what `up 0` reports, not a collector failure.
- `/metrics` is parsed with prometheus_client's own parser and looked up by sample name, so the
  `_created` gauges, python/process/http series and any other family are simply ignored.
  vLLM labels its series `model_name` and `engine`; neither is exported: values are summed
  over vLLM's engines (data parallelism gives one label set per engine), except the KV-cache
  ratio, which is their mean (each engine has its own cache of the same size; vLLM's own log
  line averages it the same way), and the TTFT histogram, summed per `le`.
- vLLM's `--api-key` guards only `/v1/*`, so `/metrics` normally needs no key; the bearer key
  is sent when the roster names a key file (a proxy in front of vLLM may ask for it). A key
  file that cannot be read is a problem of this host: the endpoint shows `error`, the log
  names the file, and the collector raises `CollectorError` after yielding the rest.
- A `/metrics` that answers 200 without any `vllm:` series is `disabled`: that is vLLM started
  with `--disable-log-stats`, which registers no stat logger.
- Counters summed over engines stay counters when one engine restarts. vLLM restarts a dead
  data-parallel engine on its own, and its counters start again from 0: the plain sum would
  drop, and `rate()` would read the drop as a reset and count the whole sum as new (a spike
  of millions of tokens). So the collector remembers each engine's last value (per label
  set); when one goes down, the value it had reached is carried as an offset, and an engine
  that vanishes keeps its last value in the sum. The sum only resets when the exporter does.
- The KV-cache ratio comes from `vllm:kv_cache_usage_perc` (a 0-1 fraction despite its name),
  else from its name before vLLM 0.9, `vllm:gpu_cache_usage_perc`. A series vLLM does not
  export is left out, never reported as 0.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from exporter.collectors import catalogue
from exporter.collectors.base import CollectorError
from exporter.sources.bounded import MARGIN_SECONDS, Lanes, Pending, Request
from exporter.sources.http_client import Answer, Outcome, read_secret
from exporter.sources.scan import OverBudget, check_head, our_lines, plausible
from exporter.sources.text import clean_label
from fleet.roster import Server

log = logging.getLogger(__name__)

ENGINE = "vllm"
ENDPOINT_STATES = ("ok", "busy", "disabled", "error")
# Past the calls' own deadline, so that a call which times out reports it itself.
DEFAULT_MARGIN_SECONDS = MARGIN_SECONDS
METRICS_MAX_BYTES = 4 * 1024 * 1024
"""The most bytes a vLLM `/metrics` answer may have (one engine's is ~100 KB, mostly buckets)."""
METRICS_MAX_LINES = 50_000
"""The most `vllm:` lines it may have (histograms per engine: a few thousand on a big host)."""

# vLLM's sample names (the text format's, with the counters' `_total`), from
# vllm/v1/metrics/loggers.py PrometheusStatLogger.
_RUNNING = "vllm:num_requests_running"
_WAITING = "vllm:num_requests_waiting"
_KV_USAGE = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")  # current, before 0.9
_PROMPT_TOKENS = "vllm:prompt_tokens_total"
_GENERATION_TOKENS = "vllm:generation_tokens_total"
_PREEMPTIONS = "vllm:num_preemptions_total"
_TTFT = "vllm:time_to_first_token_seconds"
# The counter samples (histogram buckets, sums and counts are counters too).
_COUNTERS = (
    _PROMPT_TOKENS,
    _GENERATION_TOKENS,
    _PREEMPTIONS,
    f"{_TTFT}_bucket",
    f"{_TTFT}_sum",
    f"{_TTFT}_count",
)

_Samples = dict[str, list[Sample]]
# The labels that tell vLLM's engines (and models) apart: summed over, never exported.
_ENGINE_LABELS = frozenset({"engine", "model_name"})
RETIRE_AFTER_SCRAPES = 20
"""Answered scrapes without an engine's counters before it counts as gone (5 min at 15 s)."""


@dataclass(frozen=True)
class _MetricsRead:
    """What one `/metrics` call gave: an endpoint state and, when `ok`, vLLM's samples."""

    state: str
    samples: _Samples = field(default_factory=dict)
    detail: str = ""
    # Set when the server's API key file could not be used: a fault of this host, not the server.
    key_problem: str = ""


@dataclass
class _Memory:
    """What the collector keeps of one server between scrapes (strings, never metric objects)."""

    # The model name vLLM reported last; kept while the server is down so that the info series
    # does not change its labels on every restart.
    served_model: str = ""
    status: str = ""  # the last logged summary, to log changes instead of every scrape
    key_problem: str = ""
    # Per vLLM counter sample (name and labels: one engine, one bucket): its last value and
    # what it had counted before its resets, so sums over engines never go down.
    counters: dict[tuple[str, tuple[tuple[str, str], ...]], tuple[float, float]] = field(
        default_factory=dict
    )
    # Consecutive answered scrapes without a remembered sample; past RETIRE_AFTER_SCRAPES its
    # engine is gone and what it counted moves into `retired`, by counter and bucket only, so
    # the memory stays bounded however many engines and models came and went.
    unseen: dict[tuple[str, tuple[tuple[str, str], ...]], int] = field(default_factory=dict)
    retired: dict[tuple[str, tuple[tuple[str, str], ...]], float] = field(default_factory=dict)

    def monotonic(self, samples: _Samples, *, answered: bool = True) -> _Samples:
        """`samples` with each counter as counted since the exporter started.

        Every engine's restarts are absorbed, and what engines that vanished had counted stays
        in the sums. `answered`: `/metrics` was read this scrape (else nothing is "unseen").
        """
        adjusted = dict(samples)
        seen = set()
        for name in _COUNTERS:
            for sample in samples.get(name, ()):
                key = (name, tuple(sorted(sample.labels.items())))
                seen.add(key)
                last, offset = self.counters.get(key, (0.0, 0.0))
                if sample.value < last:  # this engine restarted: keep what it had counted
                    offset += last
                self.counters[key] = (sample.value, offset)
        if answered:
            self._retire(seen)
        for name in _COUNTERS:
            remembered = [
                Sample(name, dict(labels), last + offset)
                for (counter, labels), (last, offset) in self.counters.items()
                if counter == name
            ]
            remembered += [
                Sample(name, dict(labels), value)
                for (counter, labels), value in self.retired.items()
                if counter == name
            ]
            if remembered:
                adjusted[name] = remembered
        return adjusted

    def _retire(self, seen: set[tuple[str, tuple[tuple[str, str], ...]]]) -> None:
        for key in list(self.counters):
            if key in seen:
                self.unseen.pop(key, None)
                continue
            missed = self.unseen.get(key, 0) + 1
            if missed < RETIRE_AFTER_SCRAPES:
                self.unseen[key] = missed
                continue
            last, offset = self.counters.pop(key)
            del self.unseen[key]
            name, labels = key
            kept = tuple((k, v) for k, v in labels if k not in _ENGINE_LABELS)
            self.retired[name, kept] = self.retired.get((name, kept), 0.0) + last + offset


@dataclass
class _Families:
    """This scrape's families, fresh every time."""

    info: GaugeMetricFamily = field(default_factory=lambda: catalogue.gauge("gpufleet_vllm_info"))
    up: GaugeMetricFamily = field(default_factory=lambda: catalogue.gauge("gpufleet_vllm_up"))
    endpoint: GaugeMetricFamily = field(
        default_factory=lambda: catalogue.gauge("gpufleet_vllm_endpoint")
    )
    running: GaugeMetricFamily = field(
        default_factory=lambda: catalogue.gauge("gpufleet_vllm_requests_running")
    )
    waiting: GaugeMetricFamily = field(
        default_factory=lambda: catalogue.gauge("gpufleet_vllm_requests_waiting")
    )
    kv_cache: GaugeMetricFamily = field(
        default_factory=lambda: catalogue.gauge("gpufleet_vllm_kv_cache_usage_ratio")
    )
    prompt_tokens: CounterMetricFamily = field(
        default_factory=lambda: catalogue.counter("gpufleet_vllm_prompt_tokens_total")
    )
    generation_tokens: CounterMetricFamily = field(
        default_factory=lambda: catalogue.counter("gpufleet_vllm_generation_tokens_total")
    )
    preemptions: CounterMetricFamily = field(
        default_factory=lambda: catalogue.counter("gpufleet_vllm_preemptions_total")
    )
    ttft: HistogramMetricFamily = field(
        default_factory=lambda: catalogue.histogram("gpufleet_vllm_time_to_first_token_seconds")
    )

    def nonempty(self) -> list[Metric]:
        """The families that have samples, in exposition order."""
        families: list[Metric] = [
            self.info,
            self.up,
            self.endpoint,
            self.running,
            self.waiting,
            self.kv_cache,
            self.prompt_tokens,
            self.generation_tokens,
            self.preemptions,
            self.ttft,
        ]
        return [family for family in families if family.samples]


class VllmCollector:
    """Reads the vLLM servers of the roster concurrently, under one deadline per scrape."""

    name = "vllm"
    reads_network = True  # the fleet collector runs it beside the local collectors

    def __init__(
        self,
        servers: Mapping[str, Server],
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        # The roster's servers of other engines (llama) belong to other collectors.
        self._servers = {
            name: server for name, server in sorted(servers.items()) if server.engine == ENGINE
        }
        self._clock = clock
        self._budget = (
            max((s.timeout_seconds for s in self._servers.values()), default=0.0)
            + DEFAULT_MARGIN_SECONDS
        )
        # Two lanes per server (/health, /metrics), each with one call in flight at most: a call
        # never waits for a free worker, so its deadline is the only wait it has.
        self._lanes = Lanes(2 * len(self._servers), name="vllm-read", clock=clock)
        self._memory = {name: _Memory() for name in self._servers}
        # One scrape at a time: the in-flight calls and the memory are per collector.
        self._lock = threading.Lock()

    @property
    def budget_seconds(self) -> float:
        """The longest a scrape waits for the servers: the largest timeout plus the margin."""
        return self._budget

    def collect(self) -> Iterator[Metric]:
        """One scrape of every server; `CollectorError` after the families on a host-side fault."""
        with self._lock:
            families, failures = self._scrape()
        yield from families
        if failures:
            raise CollectorError("; ".join(failures))

    def close(self) -> None:
        """Stop the worker threads; a call still in flight ends at its own deadline."""
        self._lanes.close()

    def _scrape(self) -> tuple[list[Metric], list[str]]:
        failures: list[str] = []
        health: dict[str, Pending] = {}
        metrics: dict[str, Pending | _MetricsRead] = {}
        for name, server in self._servers.items():
            # vLLM answers /health without a key (its --api-key guards /v1/* only).
            health[name] = self._lanes.start(
                (name, "health"),
                Request(f"{server.url}/health", server.timeout_seconds, max_bytes=64 * 1024),
            )
            metrics[name] = self._start_metrics(name, server, failures)
        self._lanes.wait(
            [*health.values(), *(m for m in metrics.values() if isinstance(m, Pending))]
        )
        families = _Families()
        for name, server in self._servers.items():
            pending = metrics[name]
            read = _metrics_read(pending.answer()) if isinstance(pending, Pending) else pending
            self._export(name, server, health=health[name].answer(), read=read, f=families)
            if read.key_problem:
                failures.append(f"server {name}: {read.key_problem}")
        return families.nonempty(), failures

    def _start_metrics(
        self, name: str, server: Server, failures: list[str]
    ) -> Pending | _MetricsRead:
        """Start the /metrics call, or the reason it cannot be made (the key file)."""
        headers: tuple[tuple[str, str], ...] = ()
        if server.api_key_file is not None:
            try:
                key, problem = _api_key(server.api_key_file)
            except Exception as exc:
                # A bug on this side must cost this server's /metrics only, and be said.
                log.exception("vllm server %s: reading /metrics crashed", name)
                failures.append(
                    f"server {name}: reading /metrics crashed: {type(exc).__name__}: {exc}"
                )
                return _MetricsRead("error", detail="read crashed")
            if problem:
                # Calling without the key would only earn a 401 and hide the real cause.
                return _MetricsRead("error", detail=problem, key_problem=problem)
            headers = (("Authorization", f"Bearer {key}"),)
        request = Request(
            f"{server.url}/metrics",
            server.timeout_seconds,
            headers=headers,
            max_bytes=METRICS_MAX_BYTES,
        )
        return self._lanes.start((name, "metrics"), request)

    def _export(
        self, name: str, server: Server, *, health: Answer, read: _MetricsRead, f: _Families
    ) -> None:
        memory = self._memory[name]
        up = health.ok
        health_detail = "" if up else _describe(health)
        self._note_key_problem(name, server, read.key_problem, memory)
        served = _served_model(read.samples)
        if served:
            memory.served_model = served
        # `gpu`: the roster's card ("", no label, where it gives none), which the rules copy
        # onto the server's alerts for GpuLost's inhibition per card.
        gpu = "" if server.gpu is None else str(server.gpu)
        f.info.add_metric([name, server.role, server.model, memory.served_model, gpu], 1.0)
        f.up.add_metric([name], 1.0 if up else 0.0)
        self._log_status(name, memory, f"down ({health_detail})" if not up else read.state, read)
        if not up:
            # The endpoint states describe a running server; a down one has only `up 0`.
            return
        for state in ENDPOINT_STATES:
            f.endpoint.add_metric([name, "metrics", state], 1.0 if read.state == state else 0.0)
        _export_samples(name, memory.monotonic(read.samples, answered=read.state == "ok"), f)

    def _note_key_problem(self, name: str, server: Server, problem: str, memory: _Memory) -> None:
        if problem:
            if problem != memory.key_problem:
                log.warning("vllm server %s: %s", name, problem)
        elif memory.key_problem:
            log.info("vllm server %s: API key file %s readable again", name, server.api_key_file)
        memory.key_problem = problem

    @staticmethod
    def _log_status(name: str, memory: _Memory, status: str, read: _MetricsRead) -> None:
        # Log changes, not every scrape: a server down for a day would write a line per scrape.
        if status == memory.status:
            return
        if status == "ok":
            log.info("vllm server %s: up, /metrics ok", name)
        elif status.startswith("down"):
            log.warning("vllm server %s: %s", name, status)
        else:
            log.warning("vllm server %s: up, /metrics %s (%s)", name, status, read.detail)
        memory.status = status


def _metrics_read(answer: Answer) -> _MetricsRead:
    """What a `/metrics` answer says: its endpoint state and vLLM's samples."""
    if answer.outcome is Outcome.TIMEOUT:
        return _MetricsRead("busy", detail=answer.detail)
    if answer.outcome is not Outcome.ANSWERED:
        return _MetricsRead("error", detail=_describe(answer))
    if answer.status in (404, 501):
        return _MetricsRead("disabled", detail=f"HTTP {answer.status}")
    if answer.status != 200:
        return _MetricsRead("error", detail=f"HTTP {answer.status}")
    try:
        samples = _vllm_samples(our_lines(answer.body, "vllm:", max_lines=METRICS_MAX_LINES))
    except OverBudget as exc:
        return _MetricsRead("error", detail=str(exc))
    except ValueError as exc:  # UnicodeDecodeError is one too
        return _MetricsRead("error", detail=f"unparsable: {exc}")
    if not samples:
        try:
            check_head(answer.body)
        except ValueError as exc:
            return _MetricsRead("error", detail=f"unparsable: {exc}")
        # vLLM registers its stat logger only without --disable-log-stats; what is left
        # (python_*, process_*, http_*) says nothing about the engine.
        return _MetricsRead("disabled", detail="no vllm: series (--disable-log-stats?)")
    return _MetricsRead("ok", samples)


def _api_key(path: Path) -> tuple[str, str]:
    """The key in the file, or "" and what is wrong with the file (naming it)."""
    try:
        key = read_secret(path) or ""
    except OSError as exc:
        return "", f"cannot read API key file {path}: {exc.strerror or exc}"
    if not key:
        return "", f"API key file {path} is empty"
    if "\n" in key or "\r" in key:
        # A second line would end up inside the HTTP header.
        return "", f"API key file {path} has more than one line"
    return key, ""


def _vllm_samples(text: str) -> _Samples:
    """The `vllm:` samples by sample name; `ValueError` when the text is not the text format.

    A value that is NaN, infinite or negative is left out: unknown (`scan.plausible`).
    """
    samples: _Samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.startswith("vllm:") and plausible(sample.value):
                samples.setdefault(sample.name, []).append(sample)
    return samples


def _describe(answer: Answer) -> str:
    if answer.outcome is Outcome.ANSWERED:
        return f"HTTP {answer.status}"
    return f"{answer.outcome.value}: {answer.detail}" if answer.detail else answer.outcome.value


def _served_model(samples: _Samples) -> str:
    for name in (_RUNNING, *sorted(samples)):
        for sample in samples.get(name, ()):
            model = sample.labels.get("model_name")
            if model:
                return clean_label(model)
    return ""


def _total(samples: _Samples, name: str) -> float | None:
    values = [s.value for s in samples.get(name, ())]
    return math.fsum(values) if values else None


def _mean(samples: _Samples, name: str) -> float | None:
    values = [s.value for s in samples.get(name, ())]
    return math.fsum(values) / len(values) if values else None


def _histogram(samples: _Samples, base: str) -> tuple[list[tuple[str, float]], float] | None:
    """Buckets summed per `le` over vLLM's label sets, and the summed `_sum`; None if absent."""
    counts: dict[float, float] = {}
    texts: dict[float, str] = {}
    for sample in samples.get(f"{base}_bucket", ()):
        le = sample.labels.get("le")
        if le is None:
            continue
        try:
            bound = float(le)
        except ValueError:
            continue
        # Keyed by value, so `1` and `1.0` are one bucket; vLLM's own spelling is kept.
        texts.setdefault(bound, le)
        counts[bound] = counts.get(bound, 0.0) + sample.value
    total = _total(samples, f"{base}_sum")
    # Without +Inf there is no count, and without _sum no mean: not a histogram to pass on.
    if math.inf not in counts or total is None:
        return None
    return [(texts[b], counts[b]) for b in sorted(counts)], total


def _export_samples(name: str, samples: _Samples, f: _Families) -> None:
    for family, value in (
        (f.running, _total(samples, _RUNNING)),
        (f.waiting, _total(samples, _WAITING)),
        (f.kv_cache, _kv_usage(samples)),
        (f.prompt_tokens, _total(samples, _PROMPT_TOKENS)),
        (f.generation_tokens, _total(samples, _GENERATION_TOKENS)),
        (f.preemptions, _total(samples, _PREEMPTIONS)),
    ):
        if value is not None:
            family.add_metric([name], value)
    ttft = _histogram(samples, _TTFT)
    if ttft is not None:
        buckets, total = ttft
        f.ttft.add_metric([name], buckets, total)


def _kv_usage(samples: _Samples) -> float | None:
    for sample_name in _KV_USAGE:
        value = _mean(samples, sample_name)
        if value is not None:
            return value
    return None
