"""The remediator's own `/metrics`: webhook requests, runs, queue, breakers, escalations.

Counters count what this replica did; the queue depth, open breakers, pause and maintenance are
read from the journal at scrape time, so every replica shows the fleet's shared state.

Sample output::

    gpufleet_remediator_webhook_requests_total{code="200"} 412.0
    gpufleet_remediator_runs_total{outcome="healed",playbook="llama-server-unhealthy"} 3.0
    gpufleet_remediator_queue_depth 0.0
    gpufleet_remediator_breaker_open{host="dioscuri",playbook="llama-server-unhealthy",
                                     server="alpha"} 1.0
    gpufleet_remediator_escalations_total{playbook="llama-server-unhealthy"} 1.0
    gpufleet_remediator_outbox_depth 0.0
    gpufleet_remediator_outbox_oldest_age_seconds 0.0
    gpufleet_remediator_outbox_sent_total{kind="stream"} 12.0
    gpufleet_remediator_outbox_failures_total{reason="unavailable"} 3.0
    gpufleet_remediator_runs_waiting{reason="cooldown"} 2.0
    gpufleet_remediator_oldest_waiting_seconds 95.0
    gpufleet_remediator_loop_errors_total{loop="engine-0"} 0.0
    gpufleet_remediator_admission_errors_total 0.0

`breaker_open` is per target now (budgets belong to targets); `playbook` names the playbook
whose judgement opened it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Mapping
from datetime import UTC, datetime

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.metrics_core import Metric

from remediator.journal import Journal, JournalError

log = logging.getLogger(__name__)

RUN_BUCKETS = (1, 5, 15, 30, 60, 120, 300, 600, 1800, float("inf"))


def split_target(key: str) -> tuple[str, str]:
    """`(host, server)` of a target key (`server/dioscuri/alpha`, `host/x`, `gpu/x/0`)."""
    parts = key.split("/")
    host = parts[1] if len(parts) > 1 else ""
    server = parts[2] if len(parts) > 2 and parts[0] == "server" else ""
    return host, server


class _JournalState:
    """Gauges read from the journal on every scrape."""

    def __init__(self, journal: Journal) -> None:
        self._journal = journal

    def collect(self) -> Iterator[Metric]:
        up = GaugeMetricFamily(
            "gpufleet_remediator_journal_up", "1 when the journal answered this scrape."
        )
        try:
            depth = self._journal.queue_depth()
            breakers = self._journal.open_breakers()
            paused = self._journal.paused()
            maintenance = self._journal.maintenance()
            outbox_depth, oldest = self._journal.outbox_stats()
            waiting, oldest_wait = self._journal.waiting_stats()
        except JournalError as exc:
            log.warning("metrics: journal unreadable: %s", exc)
            up.add_metric([], 0)
            yield up
            return
        up.add_metric([], 1)
        yield up
        queue = GaugeMetricFamily(
            "gpufleet_remediator_queue_depth", "Alerts journaled and waiting for a worker."
        )
        queue.add_metric([], depth)
        yield queue
        queued = GaugeMetricFamily(
            "gpufleet_remediator_runs_waiting",
            "Runs waiting for a passing reason (paused, maintenance, cooldown, rate_limited, "
            "busy, locked), fleet-wide.",
            labels=["reason"],
        )
        for reason, count in sorted(waiting.items()):
            queued.add_metric([reason], count)
        yield queued
        longest = GaugeMetricFamily(
            "gpufleet_remediator_oldest_waiting_seconds",
            "How long the longest-waiting run has waited; 0 when none waits.",
        )
        longest.add_metric(
            [], max(0.0, (datetime.now(UTC) - oldest_wait).total_seconds()) if oldest_wait else 0.0
        )
        yield longest
        open_ = GaugeMetricFamily(
            "gpufleet_remediator_breaker_open",
            "1 while the circuit breaker of a target is open (acting on it stopped); playbook: "
            "the one whose judgement opened it.",
            labels=["playbook", "host", "server"],
        )
        for target, playbook, _ in breakers:
            host, server = split_target(target)
            open_.add_metric([playbook, host, server], 1)
        yield open_
        pause = GaugeMetricFamily(
            "gpufleet_remediator_paused", "1 while all remediation is paused."
        )
        pause.add_metric([], 1 if paused else 0)
        yield pause
        hosts = GaugeMetricFamily(
            "gpufleet_remediator_maintenance",
            "1 for each host in maintenance (nothing runs on it).",
            labels=["host"],
        )
        for host in sorted(maintenance):
            hosts.add_metric([host], 1)
        yield hosts
        unsent = GaugeMetricFamily(
            "gpufleet_remediator_outbox_depth",
            "Zulip reports in the journal's outbox not yet sent (fleet-wide).",
        )
        unsent.add_metric([], outbox_depth)
        yield unsent
        age = GaugeMetricFamily(
            "gpufleet_remediator_outbox_oldest_age_seconds",
            "Age of the oldest unsent Zulip report; 0 when the outbox is empty.",
        )
        age.add_metric(
            [], max(0.0, (datetime.now(UTC) - oldest).total_seconds()) if oldest else 0.0
        )
        yield age


class _Loops:
    """`gpufleet_remediator_loop_up{loop}`: 1 while a background loop runs, 0 once it died."""

    def __init__(self, metrics: RemediatorMetrics) -> None:
        self._metrics = metrics

    def collect(self) -> Iterator[Metric]:
        family = GaugeMetricFamily(
            "gpufleet_remediator_loop_up",
            "1 while a background loop (a worker, the heartbeat, the Zulip sender, the journal's "
            "checkpointer, the replica id's lease) runs; 0 once it died: /healthz answers 503 "
            "then.",
            labels=["loop"],
        )
        states = self._metrics.loop_states
        for name, alive in sorted((states() if states is not None else {}).items()):
            family.add_metric([name], 1 if alive else 0)
        yield family


class RemediatorMetrics:
    """The remediator's registry and the counters the web app and the engine update."""

    def __init__(self, journal: Journal) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.webhook_requests = Counter(
            "gpufleet_remediator_webhook_requests",
            "Webhook requests by HTTP status code.",
            ["code"],
            registry=self.registry,
        )
        self.runs = Counter(
            "gpufleet_remediator_runs",
            "Runs by playbook and outcome (decisions that ran nothing included).",
            ["playbook", "outcome"],
            registry=self.registry,
        )
        self.run_duration = Histogram(
            "gpufleet_remediator_run_duration_seconds",
            "Time from a run's first step to its verification's end.",
            ["playbook"],
            buckets=RUN_BUCKETS,
            registry=self.registry,
        )
        self.escalations = Counter(
            "gpufleet_remediator_escalations",
            "Circuit breakers opened: acting stopped and people were called.",
            ["playbook"],
            registry=self.registry,
        )
        self.outbox_sent = Counter(
            "gpufleet_remediator_outbox_sent",
            "Zulip reports this replica sent, by kind (stream message or direct message).",
            ["kind"],
            registry=self.registry,
        )
        self.outbox_failures = Counter(
            "gpufleet_remediator_outbox_failures",
            "Attempts to send a Zulip report that failed, by reason: unavailable (no answer, "
            "5xx), rate_limited (429), refused (retried: fix it in Zulip), rejected (for good).",
            ["reason"],
            registry=self.registry,
        )
        self.loop_errors = Counter(
            "gpufleet_remediator_loop_errors",
            "Unexpected errors a background loop (worker, heartbeat, Zulip sender) survived.",
            ["loop"],
            registry=self.registry,
        )
        self.http_responses = Counter(
            "gpufleet_remediator_http_responses",
            "Answers the remediator's app gave, by handler (webhook, api, healthz, metrics, "
            "other) and HTTP status code.",
            ["handler", "code"],
            registry=self.registry,
        )
        self.alerts_truncated = Counter(
            "gpufleet_remediator_alerts_truncated",
            "Alerts Alertmanager left out of notifications (`truncatedAlerts`, its max_alerts): "
            "never handled, named in the group's reports.",
            registry=self.registry,
        )
        self.admission_errors = Counter(
            "gpufleet_remediator_admission_errors",
            "Notifications that parsed but failed admission in an unforeseen way (answered "
            "400, journaled as rejected).",
            registry=self.registry,
        )
        self.roster_hosts = Gauge(
            "gpufleet_remediator_roster_hosts",
            "Hosts in the remediator's roster: GpuFleetExporterTargetsMissing compares it with "
            "the exporters Prometheus scrapes.",
            registry=self.registry,
        )
        self.loop_states: Callable[[], Mapping[str, bool]] | None = None
        """Set by `build_services`: each background loop of the process, alive or not."""
        self.registry.register(_JournalState(journal))
        self.registry.register(_Loops(self))
