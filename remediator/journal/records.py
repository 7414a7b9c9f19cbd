"""What the journal hands out: alerts (occurrences), runs and their steps, events, reports.

Frozen dataclasses, read in one place (`runs.select_runs` for runs) and never written back:
a change goes through the module of its concern.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any


@dataclass(frozen=True)
class AlertRecord:
    """One alert occurrence: identity (fingerprint, starts_at)."""

    id: int
    fingerprint: str
    starts_at: datetime
    status: str
    alertname: str
    labels: dict[str, str]
    annotations: dict[str, str]
    generator_url: str
    first_seen: datetime
    last_seen: datetime
    resolved_at: datetime | None


@dataclass(frozen=True)
class StepRecord:
    """One step of a run, as last written."""

    index: int
    action: str
    params: dict[str, Any]
    started_at: datetime
    finished_at: datetime | None
    result: str
    output: str


@dataclass(frozen=True)
class UndoRecord:
    """An immediate undo a step asked for: `action` with `params`, within `timeout_seconds`.

    `index` orders a run's undos (they run newest first); `asked_by` is the step's index;
    `state` is `pending` until it ran (`done` or `failed`, with its `output`).
    """

    index: int
    asked_by: int
    action: str
    params: dict[str, Any]
    timeout_seconds: float
    why: str
    state: str = "pending"
    output: str | None = None


@dataclass(frozen=True)
class RunRecord:
    """One run: what an alert caused, with the alert and its steps."""

    id: int
    alert: AlertRecord
    state: str
    decision: str | None
    reason: str
    playbook: str | None
    target: str | None
    owner: str | None
    created_at: datetime
    claimed_at: datetime | None
    started_at: datetime | None
    finished_at: datetime | None
    outcome: str | None
    verification: str | None
    steps: list[StepRecord]
    not_before: datetime | None = None
    wait_reason: str | None = None
    waiting_since: datetime | None = None
    disruptive: bool | None = None
    truncated_alerts: int | None = None  # Alertmanager left these out of the notification

    @property
    def waiting(self) -> bool:
        """True while the run waits for a passing reason (pending with a `not_before`)."""
        return self.state == "pending" and self.wait_reason is not None


@dataclass(frozen=True)
class QueueState:
    """The run queue as one read saw it: whether a run is due, and when the next waiting one is."""

    due: bool
    next_due: datetime | None  # the earliest `not_before` of a waiting run; None: none waits


@dataclass(frozen=True)
class Claim:
    """A claim: the run taken (None: none was due), and whether another was due beside it."""

    run: RunRecord | None
    more_due: bool


@dataclass(frozen=True)
class Admission:
    """What admitting one notification did (all of it in one transaction)."""

    notification_id: int
    new_run_ids: list[int]
    duplicates: int
    resolved: int
    closed_run_ids: list[int]  # runs that had not started, ended because their alert resolved


@dataclass(frozen=True)
class Breaker:
    """The circuit breaker of one target, as a person sees it."""

    target: str
    open: bool
    opened_at: datetime | None
    playbook: str | None
    reason: str | None
    reset_at: datetime | None
    reset_by: str | None


@dataclass(frozen=True)
class QueuedReport:
    """A report for the outbox: a message in `topic` of the stream, or a direct message.

    `recipients` (e-mail addresses) make it a direct message; `topic` then only orders it
    among the reports of its story. `graph` (`{"query", "start", "end"}`) asks the sender for
    a picture of the metric, drawn and uploaded when the report is sent.
    """

    topic: str
    content: str
    recipients: tuple[str, ...] | None = None
    graph: Mapping[str, Any] | None = None


ReportLike = QueuedReport | tuple[str, str]
"""A report to queue: a `QueuedReport`, or `(topic, content)` for a plain stream message."""


@dataclass(frozen=True)
class OutboxEntry:
    """One report in the outbox, as last written."""

    id: int
    created_at: datetime
    topic: str
    content: str
    run_id: int | None
    state: str
    attempts: int
    next_attempt_at: datetime
    sent_at: datetime | None
    zulip_message_id: int | None
    recipients: tuple[str, ...] | None
    graph: dict[str, Any] | None
    picture: str | None
    owner: str | None
    last_error: str | None


@dataclass(frozen=True)
class Event:
    """A journaled event (pause, maintenance, escalation, interruption …)."""

    id: int
    at: datetime
    kind: str
    run_id: int | None
    playbook: str | None
    target: str | None
    detail: str
    actor: str | None = None
    ref_id: int | None = None
