"""Wiring: the journal, roster, playbooks, engine, metrics and secrets a remediator runs on.

`build_services(config)` makes them from a validated config; the web app and the CLI share it,
so `serve`, `replay` and the tests run the very same engine. With a `zulip` section, the
engine renders reports into the outbox and an `OutboxSender` sends them (started with the
engine by `Services.start`).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

from fleet.roster import Roster, load_roster
from remediator.actions.settings import action_settings
from remediator.config import Credential, RemediatorConfig, load_secrets
from remediator.engine import Engine, EngineSettings
from remediator.journal import Journal
from remediator.journal.checkpoint import LOOP_NAME as CHECKPOINT_LOOP
from remediator.metrics import RemediatorMetrics
from remediator.notify.files import ReportFiles
from remediator.notify.report import Reporter, ReportSettings
from remediator.notify.sender import OutboxSender, SenderSettings
from remediator.notify.zulip_api import ZulipApi
from remediator.playbooks.loader import load_playbooks


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
    sender: OutboxSender | None = None

    def start(self) -> None:
        """Start the journal's checkpointer, the engine's workers and the Zulip sender (`serve`)."""
        self.journal.start_checkpointer(
            on_error=self.metrics.loop_errors.labels(CHECKPOINT_LOOP).inc
        )
        if self.engine is not None:
            self.engine.start()
        if self.sender is not None:
            self.sender.start()

    def loop_states(self) -> dict[str, bool]:
        """Every background loop of this process (the journal's, the engine's, the sender's)."""
        states = self.journal.loop_states()
        if self.engine is not None:
            states.update(self.engine.loop_states())
        if self.sender is not None and self.sender.started:
            states["zulip-sender"] = self.sender.alive
        return states

    def dead_loops(self) -> list[str]:
        """The background loops that died: `/healthz` answers 503 while there is one."""
        return [name for name, alive in self.loop_states().items() if not alive]

    def close(self) -> None:
        """Stop the engine and the sender, and close the journal."""
        if self.engine is not None:
            self.engine.stop()
        if self.sender is not None:
            self.sender.stop()
        self.journal.close()


def engine_settings(config: RemediatorConfig, *, dry_run: bool | None = None) -> EngineSettings:
    """The engine's settings from the config (`dry_run` overrides the config's)."""
    return EngineSettings(
        workers=config.workers,
        dry_run=config.dry_run if dry_run is None else dry_run,
        prometheus_url=config.prometheus_url,
        actions=action_settings(config),
    )


FILE_REPORTS_STREAM = "reports"


def report_settings(config: RemediatorConfig) -> ReportSettings | None:
    """Where reports go and what they link to; None without `zulip` or `reports_dir`."""
    zulip = config.zulip
    if zulip is None:
        if config.reports_dir is None:
            return None
        return ReportSettings(stream=FILE_REPORTS_STREAM, topics={})
    return ReportSettings(
        stream=zulip.stream,
        topics=dict(zulip.topics),
        default_topic=zulip.default_topic,
        escalate_to=tuple(zulip.escalate_to),
        grafana_url=zulip.grafana_url,
        alertmanager_url=zulip.alertmanager_url,
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
        limits=config.limits,
        lock_ttl=timedelta(seconds=config.lock_ttl_seconds),
        dedupe_window=timedelta(seconds=config.dedupe_window_seconds),
    )
    metrics = RemediatorMetrics(journal)
    metrics.roster_hosts.set(len(roster.hosts))
    reporting = report_settings(config)
    reporter = Reporter(reporting, roster) if reporting is not None else None
    sender = None
    if with_engine and config.zulip is not None:
        sender = OutboxSender(
            journal,
            ZulipApi(config.zulip.zuliprc),
            SenderSettings(stream=config.zulip.stream, prometheus_url=config.prometheus_url),
            metrics=metrics,
        )
    elif with_engine and config.reports_dir is not None:
        # No Zulip: the same outbox and sender, writing each report as a Markdown file.
        sender = OutboxSender(
            journal,
            ReportFiles(config.reports_dir),
            SenderSettings(stream=FILE_REPORTS_STREAM, prometheus_url=config.prometheus_url),
            metrics=metrics,
        )
    if reporter is not None:
        # A resolution closes its story in the topic, queued with the resolution itself.
        journal.resolved_reports = reporter.closing_report
    engine = (
        Engine(
            journal,
            roster,
            playbooks,
            engine_settings(config, dry_run=dry_run),
            metrics=metrics,
            reporter=reporter,
            on_report=sender.wake if sender is not None else None,
        )
        if with_engine
        else None
    )
    services = Services(
        config=config,
        journal=journal,
        engine=engine,
        roster=roster,
        metrics=metrics,
        webhook=secrets.webhook,
        admin=secrets.admin,
        sender=sender,
    )
    metrics.loop_states = services.loop_states
    return services
