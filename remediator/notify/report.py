"""The reports: what fired, what was done step by step, how it ended — readable on a phone.

`Reporter` turns journal records into `QueuedReport`s for the outbox:

- `run_report(run)`: a run that executed (steps, verification, outcome) or a decision that
  ran nothing (`cooldown`, `breaker_open`, `dry_run`, `paused`, `maintenance`, `rejected`,
  `rate_limited`, `locked`: which, and why); alerts no playbook handles get a shorter
  notify-only report;
- `closing_report(run)`: the alert resolved — one line in the same topic that closes the
  story ("resolved after 4 m, healed by `llama-server-unhealthy`");
- `escalation_reports(…)`: a breaker opened — a message in the topic and a direct message to
  each person in `zulip.escalate_to`;
- `interrupted_reports(run)`: the remediator stopped while a run was acting.

The topic is the alert's `category` label through `zulip.topics`, else `zulip.default_topic`.
Every piece of alert text goes through `remediator.notify.markdown` (labels cannot break the
report); times are Zulip `<time:…>` stamps, which every reader sees in their own time zone.
The sender adds the picture after the first paragraph and a marker line at the end.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any
from urllib.parse import parse_qs, quote, urlencode, urlsplit

from fleet.roster import Roster
from remediator.actions.registry import UnknownActionError, get_action
from remediator.alerts import minus
from remediator.journal import QueuedReport, RunRecord, StepRecord
from remediator.notify.markdown import (
    cell,
    cell_code,
    code,
    escape,
    evidence_block,
    fit_topic,
    inline,
    one_line,
)

# The evidence is bounded when it is journaled; the sender cuts it further to the server's
# limit. Each step's output is cut on its own first, so one chatty step leaves room for the rest.
EVIDENCE_MAX_CHARS = 20_000
STEP_OUTPUT_MAX_CHARS = 4_000
# The picture's window around the incident, and its longest span.
GRAPH_BEFORE = timedelta(minutes=15)
GRAPH_AFTER = timedelta(minutes=5)
GRAPH_MAX_SPAN = timedelta(hours=3)

SEVERITY_MARKS = {"critical": "🔴", "error": "🔴", "warning": "🟠", "info": "🔵"}
OUTCOMES = {
    "healed": ("✅", "Healed"),
    "done_unverified": ("☑️", "Done, not verified"),
    "not_healed": ("❌", "Not healed"),
    "failed": ("❌", "Failed"),
    "interrupted": ("⚠️", "Interrupted"),
    # A person paused remediation or put the host in maintenance while it acted.
    "cancelled": ("⏹️", "Stopped by a person"),
    # The alert stopped firing before a step that changes something: neither heal nor failure.
    "resolved": ("✅", "Resolved before acting"),
}
DECISIONS = {
    "notify_only": "reported only",
    "rejected": "rejected",
    "paused": "remediation paused",
    "maintenance": "host in maintenance",
    "breaker_open": "circuit breaker open",
    "cooldown": "cooldown",
    "rate_limited": "fleet-wide cap reached",
    "dry_run": "dry-run",
    "locked": "another run is acting",
    "busy": "fleet-wide concurrency cap reached",
    "resolved": "the alert resolved first",
    "expired": "waited too long",
    "cancelled": "cancelled by a person",
}
# A comparison with a number at the end of an expression (`… == 0`, `… > bool 0.9`): the
# picture shows the value compared, not the 0/1 or filtered result of the comparison.
_TRAILING_COMPARISON = re.compile(
    r"^(?P<left>.+?)\s*(?:==|!=|>=|<=|>|<)\s*(?:bool\s+)?[-+]?(?:\d+\.?\d*|\.\d+)(?:e[-+]?\d+)?\s*$",
    re.IGNORECASE | re.DOTALL,
)
_SET_OPERATOR = re.compile(r"\b(?:and|or|unless)\b", re.IGNORECASE)
_ORDERING = re.compile(
    r"(?:>=|<=|>|<)\s*(?:bool\s+)?(?P<number>[-+]?(?:\d+\.?\d*|\.\d+)(?:e[-+]?\d+)?)\s*$"
)
_QUERY_MAX_CHARS = 2000
# What an alert rule tells the picture (annotations in rules/gpu-fleet-alerts.rules.yml): the
# series to draw (`chart_query`), the line it crosses (`threshold_query`, PromQL drawn over the
# window, or `threshold`, a number), and that line's name (`threshold_label`). Drawing
# instructions, not evidence: the report's evidence block leaves them out.
CHART_ANNOTATIONS = ("chart_query", "threshold_query", "threshold", "threshold_label")


@dataclass(frozen=True)
class ReportSettings:
    """Where reports go and what they link to (the config's `zulip` section)."""

    stream: str
    topics: Mapping[str, str]
    default_topic: str = "gpu-fleet"
    escalate_to: tuple[str, ...] = ()
    grafana_url: str | None = None
    alertmanager_url: str | None = None


def stamp(when: datetime) -> str:
    """A Zulip global time: `<time:2026-11-30T03:12:45Z>`, shown in each reader's zone."""
    return f"<time:{when.astimezone(UTC):%Y-%m-%dT%H:%M:%SZ}>"


def duration(seconds: float) -> str:
    """`0.4 s`, `42 s`, `4 m 10 s`, `4 m`, `2 h 5 m`."""
    seconds = max(0.0, seconds)
    if seconds < 10:
        return f"{seconds:.1f} s"
    whole = round(seconds)
    if whole < 60:
        return f"{whole} s"
    if whole < 3600:
        minutes, rest = divmod(whole, 60)
        return f"{minutes} m {rest} s" if rest else f"{minutes} m"
    hours, rest = divmod(whole, 3600)
    return f"{hours} h {rest // 60} m" if rest // 60 else f"{hours} h"


def _safe_url(url: str) -> str | None:
    """An http(s) URL fit for a Markdown link target, or None (no `javascript:` and such)."""
    try:
        parts = urlsplit(url.strip())
    except ValueError:
        return None
    if parts.scheme not in ("http", "https") or not parts.netloc:
        return None
    # Parentheses, spaces and angle brackets would end or break the link target.
    return quote(url.strip(), safe=":/?#[]@!$&'*+,;=%~-._")


def link(text: str, url: str | None) -> str | None:
    """`[text](url)`, or None when `url` is not an http(s) URL."""
    target = _safe_url(url) if url else None
    return f"[{inline(text)}]({target})" if target else None


def generator_expr(generator_url: str) -> str | None:
    """The PromQL expression of Prometheus' `generatorURL` (`/graph?g0.expr=…`), or None."""
    try:
        query = parse_qs(urlsplit(generator_url).query)
    except ValueError:
        return None
    found = query.get("g0.expr")
    return found[0] if found and found[0].strip() else None


def graph_query(expr: str) -> str:
    """What to draw for an alert expression: the value it compares, when that is clear."""
    matched = _TRAILING_COMPARISON.match(expr.strip())
    if matched is None or _SET_OPERATOR.search(expr):
        return expr.strip()
    return matched.group("left").strip()


def graph_threshold(expr: str) -> float | None:
    """The number an alert expression's value is held against (`x > 0.9`: 0.9), when clear.

    Only an ordering (`>`, `>=`, `<`, `<=`) is a threshold a line can show; `== 0` is a state.
    """
    if graph_query(expr) == expr.strip():
        return None
    matched = _ORDERING.search(expr.strip())
    return float(matched.group("number")) if matched else None


def disruptive(step: StepRecord) -> bool:
    """Whether a step changed something (drain, restart, power cap): an instant on the picture.

    Read-only actions (probes, checks, waits) did not; a step that never ran did not either.
    An action no longer registered is taken as one that did: the picture errs toward showing.
    """
    if step.result == "skipped":
        return False
    try:
        return not get_action(step.action).read_only
    except UnknownActionError:
        return True


def _annotation_number(text: str | None) -> float | None:
    try:
        value = float(text) if text is not None and text.strip() else None
    except ValueError:
        return None
    return value if value is not None and math.isfinite(value) else None


def silence_url(alertmanager_url: str, labels: Mapping[str, str]) -> str:
    """Alertmanager's "new silence" form, pre-filled with matchers for this alert."""
    keys = [k for k in ("alertname", "host", "server", "gpu") if labels.get(k)]
    matchers = []
    for key in keys:
        value = labels[key].replace("\\", "\\\\").replace('"', '\\"')
        matchers.append(f'{key}="{value}"')
    filter_ = "{" + ",".join(matchers) + "}"
    return f"{alertmanager_url.rstrip('/')}/#/silences/new?filter={quote(filter_, safe='')}"


def grafana_link_url(
    grafana_url: str, labels: Mapping[str, str], start: datetime, end: datetime
) -> str:
    """The configured Grafana dashboard URL, for this host and server and the incident's time."""
    params = {"from": str(int(start.timestamp() * 1000)), "to": str(int(end.timestamp() * 1000))}
    for key in ("host", "server", "gpu"):
        if labels.get(key):
            params[f"var-{key}"] = labels[key]
    joiner = "&" if "?" in grafana_url else "?"
    return f"{grafana_url}{joiner}{urlencode(params)}"


def rich(text: str) -> str:
    """The engine's own one-line text: its `…` spans as code, the rest as plain text.

    Verification details quote PromQL and probe answers between backticks; when they do not
    pair up (a backtick in a probe's answer), all of it is plain text.
    """
    text = one_line(text)
    parts = text.split("`")
    if len(parts) % 2 == 0:
        return escape(text)
    return "".join(code(part) if index % 2 else escape(part) for index, part in enumerate(parts))


def _step_seconds(step: StepRecord) -> float | None:
    if step.finished_at is None:
        return None
    return (step.finished_at - step.started_at).total_seconds()


def _cut(text: str, limit: int) -> str:
    if len(text) <= limit:
        return text
    head = limit // 3
    tail = limit - head
    return f"{text[:head]}\n… [{len(text) - limit} characters cut] …\n{text[-tail:]}"


class Reporter:
    """Renders reports for the outbox from journal records and the roster."""

    def __init__(self, settings: ReportSettings, roster: Roster) -> None:
        self.settings = settings
        self.roster = roster

    # -- parts ----------------------------------------------------------------------------

    def topic(self, labels: Mapping[str, str]) -> str:
        """The topic of an alert: its `category` through `zulip.topics`, else the default."""
        category = labels.get("category", "")
        return fit_topic(self.settings.topics.get(category, self.settings.default_topic))

    def _where(self, labels: Mapping[str, str]) -> str:
        """`host `dioscuri` · server `alpha` · role `gpu-dense` · model `…`` (roster facts)."""
        host, server, gpu = labels.get("host"), labels.get("server"), labels.get("gpu")
        parts = []
        if host:
            parts.append(f"host {code(host)}")
        if server:
            parts.append(f"server {code(server)}")
        if gpu:
            parts.append(f"GPU {code(gpu)}")
        # Labels are only keys into the roster: role and model come from the roster entry.
        entry = self.roster.hosts.get(host or "")
        served = entry.servers.get(server or "") if entry is not None else None
        if served is not None:
            parts += [f"role {code(served.role)}", f"model {code(served.model)}"]
        elif server:
            parts.append("not in the roster")
        return " · ".join(parts)

    def _header(self, run: RunRecord) -> str:
        labels = run.alert.labels
        severity = labels.get("severity", "")
        mark = SEVERITY_MARKS.get(severity, "⚪")
        head = [f"{mark} **{inline(severity or 'no severity')}**",
                f"**{inline(run.alert.alertname or 'unnamed alert')}**"]  # fmt: skip
        where = self._where(labels)
        if where:
            head.append(where)
        lines = [" · ".join(head)]
        summary = run.alert.annotations.get("summary")
        if summary:
            lines.append(inline(summary))
        if run.truncated_alerts:
            lines.append(
                f"⚠️ Alertmanager left {run.truncated_alerts} more alert(s) of this group out of "
                "its notification (`max_alerts`): they are not handled; see Alertmanager."
            )
        return "\n".join(lines)

    def _window(self, run: RunRecord) -> tuple[datetime, datetime]:
        end = (run.finished_at or run.alert.last_seen) + GRAPH_AFTER
        start = min(minus(run.alert.starts_at, GRAPH_BEFORE), end - GRAPH_BEFORE)
        return max(start, end - GRAPH_MAX_SPAN), end

    def _links(self, run: RunRecord) -> str:
        labels = run.alert.labels
        start, end = self._window(run)
        found = [
            link("Alert source", run.alert.generator_url),
            link("Runbook", run.alert.annotations.get("runbook_url", "")),
        ]
        if self.settings.grafana_url:
            found.append(
                link("Grafana", grafana_link_url(self.settings.grafana_url, labels, start, end))
            )
        if self.settings.alertmanager_url:
            found.append(link("Silence", silence_url(self.settings.alertmanager_url, labels)))
        return " · ".join(item for item in found if item)

    def _graph(self, run: RunRecord, verify_query: str | None) -> dict[str, Any] | None:
        """The picture's spec (`remediator.notify.graph`): what to draw, and what to mark.

        The rule's `chart_query` annotation says what to draw; without it, the alert's own
        expression (its comparison taken off), else the playbook's verification query.
        """
        annotations = run.alert.annotations
        chart = (annotations.get("chart_query") or "").strip()
        expr = generator_expr(run.alert.generator_url) or verify_query
        query = chart or (graph_query(expr) if expr else "")
        if not query or len(query) > _QUERY_MAX_CHARS:
            return None
        start, end = self._window(run)
        incident_end = run.finished_at or run.alert.last_seen
        spec: dict[str, Any] = {
            "query": query,
            "start": start.isoformat(),
            "end": end.isoformat(),
            "marked": [run.alert.starts_at.isoformat(), incident_end.isoformat()],
        }
        threshold = _annotation_number(annotations.get("threshold"))
        threshold_query = (annotations.get("threshold_query") or "").strip()
        if threshold is None and not threshold_query and not chart and expr:
            threshold = graph_threshold(expr)  # `x > 0.9` drawn as x: 0.9 is its line
        if threshold is not None:
            spec["threshold"] = threshold
        elif threshold_query and len(threshold_query) <= _QUERY_MAX_CHARS:
            spec["threshold_query"] = threshold_query
        label = one_line(annotations.get("threshold_label") or "")
        if label and ("threshold" in spec or "threshold_query" in spec):
            spec["threshold_label"] = label[:60]
        if run.decision != "dry_run":  # under dry-run nothing that changes anything ran
            steps = [
                {"at": step.started_at.isoformat(), "label": f"{step.index + 1} {step.action}"}
                for step in run.steps
                if disruptive(step)
            ]
            if steps:
                spec["steps"] = steps
        return spec

    @staticmethod
    def _evidence(run: RunRecord, *, steps: bool) -> str:
        labels = ", ".join(f"{k}={v}" for k, v in sorted(run.alert.labels.items()))
        lines = [f"alert {run.alert.fingerprint} labels: {labels}"]
        for key, value in sorted(run.alert.annotations.items()):
            if key not in ("summary", "runbook_url", *CHART_ANNOTATIONS):
                lines.append(f"{key}: {value}")
        if steps:
            for step in run.steps:
                params = json.dumps(step.params, sort_keys=True, ensure_ascii=False)
                lines.append(f"--- step {step.index + 1} {step.action} {params}: {step.result}")
                if step.output.strip():
                    lines.append(_cut(step.output.rstrip(), STEP_OUTPUT_MAX_CHARS))
        return _cut("\n".join(lines), EVIDENCE_MAX_CHARS)

    @staticmethod
    def _steps_table(run: RunRecord) -> str:
        rows = ["| step | action | result | duration |", "|---|---|---|---|"]
        for step in run.steps:
            seconds = _step_seconds(step)
            shown = duration(seconds) if seconds is not None else "—"
            result = "skipped (dry-run)" if run.decision == "dry_run" else step.result
            rows.append(
                f"| {step.index + 1} | {cell_code(step.action)} | {cell(result)} | {shown} |"
            )
        return "\n".join(rows)

    def _timeline(self, run: RunRecord) -> str:
        fired = f"fired {stamp(run.alert.starts_at)}"
        if run.finished_at is None:
            return fired
        took = duration((run.finished_at - run.alert.starts_at).total_seconds())
        ended = "finished" if run.outcome is not None else "decided"
        return f"{fired}, {ended} {stamp(run.finished_at)} ({took} after it fired)"

    def _outcome(self, run: RunRecord) -> str:
        playbook = code(run.playbook or "?")
        target = code(run.target or "?")
        if run.outcome is not None:
            mark, word = OUTCOMES.get(run.outcome, ("❔", run.outcome))
            what = f"{mark} **{inline(word)}** — {playbook} on {target} (run #{run.id})"
            if run.outcome == "interrupted":
                what += ": the remediator stopped while it was acting; not repeated, check it"
            return what
        decision = run.decision or "?"
        word = DECISIONS.get(decision, decision)
        reason = f": {rich(run.reason)}" if run.reason else ""
        if decision == "dry_run":
            return f"🧪 **Dry-run** — {playbook} on {target} (run #{run.id}){reason}"
        on = f" — {playbook} on {target}" if run.playbook else ""
        return f"⏸️ **Nothing ran: {inline(word)}**{on} (run #{run.id}){reason}"

    # -- reports --------------------------------------------------------------------------

    def run_report(self, run: RunRecord, *, verify_query: str | None = None) -> list[QueuedReport]:
        """The report of a run that ended or was decided (its record as it is now final).

        `verify_query` (the playbook's verification PromQL, filled) is drawn when the alert's
        `generatorURL` carries no expression.
        """
        topic = self.topic(run.alert.labels)
        graph = self._graph(run, verify_query)
        if run.decision == "notify_only":
            return [QueuedReport(topic, self._notify_only(run), graph=graph)]
        parts = [self._header(run), f"{self._outcome(run)}\n{self._timeline(run)}"]
        if run.steps:
            parts.append(self._steps_table(run))
        if run.outcome is not None and run.verification:
            parts.append(f"**Verification**: {rich(run.verification)}")
        links = self._links(run)
        if links:
            parts.append(links)
        parts.append(evidence_block("Evidence", self._evidence(run, steps=True)))
        return [QueuedReport(topic, "\n\n".join(parts), graph=graph)]

    def _notify_only(self, run: RunRecord) -> str:
        name = code(run.alert.alertname or "this alert")
        parts = [
            self._header(run),
            f"📣 **Reported only** — no playbook handles {name} (run #{run.id})\n"
            f"{self._timeline(run)}",
        ]
        description = run.alert.annotations.get("description")
        if description:
            parts.append(inline(description))
        links = self._links(run)
        if links:
            parts.append(links)
        parts.append(evidence_block("Labels", self._evidence(run, steps=False)))
        return "\n\n".join(parts)

    def closing_report(self, run: RunRecord) -> list[QueuedReport]:
        """The line that closes an alert's story when it resolved (`run`: its newest run)."""
        alert = run.alert
        ended = alert.resolved_at or alert.last_seen
        after = duration((ended - alert.starts_at).total_seconds())
        what = f"**{inline(alert.alertname or 'the alert')}**"
        where = self._where(alert.labels)
        if run.outcome in ("healed", "done_unverified"):
            how = f"healed by {code(run.playbook or '?')} (run #{run.id})"
        elif run.outcome is not None:
            how = f"after {code(run.playbook or '?')} ended {inline(run.outcome)} (run #{run.id})"
        elif run.state != "done":
            how = f"while run #{run.id} was still {run.state}"
        elif run.decision == "notify_only":
            how = "on its own (reported only)"
        else:
            word = DECISIONS.get(run.decision or "", run.decision or "?")
            how = f"on its own (nothing ran: {inline(word)})"
        text = f"✅ **Resolved** after {after}, {how} — {what}"
        if where:
            text += f" · {where}"
        text += f"\nresolved {stamp(ended)}"
        return [QueuedReport(self.topic(alert.labels), text)]

    def waiting_report(
        self, run: RunRecord, *, playbook: str, target: str, verdict: Any
    ) -> list[QueuedReport]:
        """A short report: the run has waited a while for a passing reason, and waits on.

        `verdict` is the rails' `Verdict` (`wait_reason`, `reason`, `not_before`).
        """
        since = run.waiting_since or run.created_at
        waited = duration((verdict.not_before - since).total_seconds()) if verdict.not_before \
            else "a while"  # fmt: skip
        text = (
            f"⏳ **Waiting** — {code(playbook)} on {code(target)} (run #{run.id}, "
            f"**{inline(run.alert.alertname or 'alert')}**) waits "
            f"({inline(verdict.wait_reason or '?')}): {rich(verdict.reason)}. It acts once that "
            f"passes while the alert still fires; next look {stamp(verdict.not_before)} "
            f"(waiting since {stamp(since)}, {waited} by then)."
        )
        return [QueuedReport(self.topic(run.alert.labels), text)]

    def escalation_reports(
        self, run: RunRecord, *, playbook: str, target: str, why: str
    ) -> list[QueuedReport]:
        """A breaker opened: a message in the topic, and a direct message to each person."""
        topic = self.topic(run.alert.labels)
        text = (
            f"🚨 **Escalation** — circuit breaker opened for {code(playbook)} on {code(target)}: "
            f"{inline(why)}. Acting on this target stopped until a person resets the breaker "
            f"(run #{run.id}, **{inline(run.alert.alertname or 'alert')}**)."
        )
        reports = [QueuedReport(topic, text)]
        if self.settings.escalate_to:
            # `#**stream>topic**` is Zulip's link to a topic: one tap to the whole story.
            where = f"#**{self.settings.stream}>{topic}**"
            reports.append(
                QueuedReport(topic, f"{text}\n\nThe story: {where}", self.settings.escalate_to)
            )
        return reports

    def interrupted_reports(self, run: RunRecord) -> list[QueuedReport]:
        """The report of a run a restart cut short (its record marked `interrupted`)."""
        return self.run_report(run)
