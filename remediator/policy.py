"""The safety rails: whether a matched, resolved run may act now, and if not, why.

Checked in this order, each journaled with its reason when it stops a run: the global pause,
the host's maintenance, the target's circuit breaker, its cooldown, the fleet's hourly cap,
dry-run. The per-target lock and the concurrency cap are taken by the engine right before it
acts, because they are about what runs *now* across replicas.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta

from remediator.journal.store import Journal
from remediator.playbooks.model import Playbook


@dataclass(frozen=True)
class Limits:
    """Fleet-wide caps."""

    max_concurrent_runs: int
    max_runs_per_hour: int


@dataclass(frozen=True)
class Verdict:
    """`decision` is `run` when the run may act; otherwise why it may not."""

    decision: str
    reason: str

    @property
    def may_act(self) -> bool:
        """True when the run may execute its steps."""
        return self.decision == "run"


def judge(
    journal: Journal,
    playbook: Playbook,
    *,
    target_key: str,
    host: str,
    limits: Limits,
    dry_run: bool,
    now: datetime,
) -> Verdict:
    """The first rail that stops this run, or `run`."""
    if journal.paused():
        return Verdict("paused", "remediation is paused (POST /api/resume to continue)")
    maintenance = journal.maintenance()
    if host in maintenance:
        since, why = maintenance[host]
        return Verdict("maintenance", f"host {host} is in maintenance since {since:%F %T}: {why}")
    breaker = journal.breaker(target_key, playbook.name)
    if breaker.open:
        return Verdict(
            "breaker_open",
            f"circuit breaker open since {breaker.opened_at:%F %T} after {breaker.failures} "
            "runs that did not heal; people were called, acting stays stopped until reset",
        )
    until = journal.cooldown_until(target_key, playbook.name)
    if until is not None and until > now:
        return Verdict("cooldown", f"cooldown of {playbook.name} on {target_key} until {until:%T}")
    started = journal.count_started_since(now - timedelta(hours=1))
    if started >= limits.max_runs_per_hour:
        return Verdict(
            "rate_limited",
            f"fleet-wide cap: {started} runs started in the last hour "
            f"(max_runs_per_hour {limits.max_runs_per_hour})",
        )
    if dry_run or playbook.policy.dry_run:
        return Verdict("dry_run", "dry-run: the steps were journaled, none was run")
    return Verdict("run", "")
