"""Whether an alert still fires: asked of Prometheus where it matters, the journal otherwise.

The engine asks before a run is judged and before every step that is not read-only: a run
whose alert resolved while it waited, or while an earlier step ran, must not restart anything.

Prometheus keeps `ALERTS{alertname, alertstate, <the alert's labels>}` for every pending and
firing alert its rules produce. The alert that Alertmanager sent also carries Prometheus'
external labels (and whatever relabelling added), which `ALERTS` does not have; so the answer
is "firing" when some `ALERTS{alertstate="firing", alertname=…}` series has labels that are
all among the alert's own (a subset match), not only on an exact match.

A series that is only `pending` here is the alert's condition holding now in this Prometheus,
not yet for the rule's `for:`. In an HA pair the other Prometheus evaluates at another offset
and fires up to an evaluation (and a scrape) interval earlier; its alert reaches the remediator
while this one still counts the `for:` down. Read as "no longer firing", that ended the run as
resolved and nothing healed the fault: Alertmanager's repeats of the occurrence were
duplicates (tests/test_lab_hosts.py, scenario 7, caught it). So pending counts as firing while
the journal holds the occurrence firing; once Alertmanager sent its resolution, a pending series
is a new occurrence, not this one. The gap left: a pair drifting apart by more than the rule's
`for:` (1 minute at least in rules/, against 15 s intervals in the example configuration).

Prometheus cannot tell when it is unreachable, answers an error, or does not evaluate a rule
of that name at all (the alert comes from another Prometheus, or a test): then the journal's
state of the occurrence decides, which Alertmanager's resolution updates.

Check by hand: `curl -G http://127.0.0.1:9090/api/v1/query
--data-urlencode 'query=ALERTS{alertname="LlamaServerDown"}'` (`alertstate` says which).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass

from remediator.prometheus_api import QueryError, alerting_rule_names, query_instant

_RULES_TTL_SECONDS = 60.0
_TIMEOUT_SECONDS = 5.0


@dataclass(frozen=True)
class Firing:
    """The answer, and who gave it (`prometheus` or `journal`) with why."""

    firing: bool
    source: str
    detail: str


def _quote(value: str) -> str:
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


class FiringCheck:
    """Asks Prometheus whether alerts fire; caches the rule names it evaluates for a minute."""

    def __init__(self, prometheus_url: str, *, timeout_seconds: float = _TIMEOUT_SECONDS) -> None:
        self._url = prometheus_url
        self._timeout = timeout_seconds
        self._lock = threading.Lock()
        self._rules: set[str] | None = None
        self._rules_at = 0.0

    def _rule_names(self) -> set[str]:
        with self._lock:
            fresh = time.monotonic() - self._rules_at < _RULES_TTL_SECONDS
            if self._rules is not None and fresh:
                return self._rules
        names = alerting_rule_names(self._url, timeout_seconds=self._timeout)
        with self._lock:
            self._rules, self._rules_at = names, time.monotonic()
        return names

    def check(self, labels: Mapping[str, str], *, journal_firing: bool) -> Firing:
        """Whether the alert with `labels` fires now; the journal's state when unknowable."""
        fallback = "firing" if journal_firing else "resolved"
        alertname = labels.get("alertname", "")
        try:
            if alertname not in self._rule_names():
                return Firing(journal_firing, "journal", f"{fallback} in the journal (Prometheus "
                              f"evaluates no rule {alertname!r})")  # fmt: skip
            query = f"ALERTS{{alertname={_quote(alertname)}}}"  # firing and pending
            series = query_instant(self._url, query, timeout_seconds=self._timeout)
        except QueryError as exc:
            return Firing(journal_firing, "journal", f"{fallback} in the journal ({exc})")
        wanted = dict(labels)
        states = set()
        for found in series:
            metric = found.get("metric", {}) if isinstance(found, dict) else {}
            own = {k: v for k, v in metric.items() if k not in ("__name__", "alertstate")}
            if all(wanted.get(k) == v for k, v in own.items()):
                states.add(metric.get("alertstate"))
        if "firing" in states:
            return Firing(True, "prometheus", "firing in Prometheus")
        if "pending" in states and journal_firing:
            why = "firing in the journal: another Prometheus fired it first"
            return Firing(True, "prometheus", f"pending in Prometheus, {why}")
        if "pending" in states:
            why = "a new occurrence: Alertmanager resolved this one"
            return Firing(False, "prometheus", f"only pending in Prometheus ({why})")
        return Firing(False, "prometheus", "no longer firing in Prometheus")
