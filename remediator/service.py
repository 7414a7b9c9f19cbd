"""Wiring: the journal, roster, playbooks, engine, metrics and secrets a remediator runs on.

`build_services(config)` makes them from a validated config; the web app and the CLI share it,
so `serve`, `replay` and the tests run the very same engine.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

from exporter.roster import Roster, load_roster
from remediator.config import Credential, RemediatorConfig, load_secrets
from remediator.engine import Engine, EngineSettings
from remediator.journal.store import Journal
from remediator.metrics import RemediatorMetrics
from remediator.playbooks.loader import load_playbooks
from remediator.policy import Limits


@dataclass
class Services:
    """What the app and the engine work with."""

    config: RemediatorConfig
    journal: Journal
    engine: Engine | None
    roster: Roster
    metrics: RemediatorMetrics
    webhook: Credential
    admin: Credential

    def close(self) -> None:
        """Stop the engine and close the journal."""
        if self.engine is not None:
            self.engine.stop()
        self.journal.close()


def engine_settings(config: RemediatorConfig, *, dry_run: bool | None = None) -> EngineSettings:
    """The engine's settings from the config (`dry_run` overrides the config's)."""
    topics = config.zulip.topics if config.zulip is not None else {}
    return EngineSettings(
        workers=config.workers,
        limits=Limits(
            max_concurrent_runs=config.limits.max_concurrent_runs,
            max_runs_per_hour=config.limits.max_runs_per_hour,
        ),
        dry_run=config.dry_run if dry_run is None else dry_run,
        prometheus_url=config.prometheus_url,
        lock_ttl=timedelta(seconds=config.lock_ttl_seconds),
        report_topic=topics.get("infra", "alerts-infra"),
    )


def build_services(
    config: RemediatorConfig, *, with_engine: bool = True, dry_run: bool | None = None
) -> Services:
    """Everything from the config. Raises the loaders' own errors (RosterError, …)."""
    roster = load_roster(config.roster)
    playbooks = load_playbooks(config.playbooks_dir)
    secrets = load_secrets(config)
    journal = Journal(
        config.journal,
        replica_id=config.replica_id,
        retention=timedelta(days=config.retention_days),
    )
    metrics = RemediatorMetrics(journal)
    engine = (
        Engine(
            journal, roster, playbooks, engine_settings(config, dry_run=dry_run), metrics=metrics
        )
        if with_engine
        else None
    )
    return Services(
        config=config,
        journal=journal,
        engine=engine,
        roster=roster,
        metrics=metrics,
        webhook=secrets.webhook,
        admin=secrets.admin,
    )
