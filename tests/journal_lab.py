"""What the journal's tests share: a hand-moved clock, notification bodies, plans, table peeks.

The bodies go through the real parser (`parse_notification`) and the real `Journal.admit`, the
path the webhook takes; plans are what `Engine.plan` hands the rails (`remediator.journal.rails
.Plan`), with disruption sets written out as `remediator.playbooks.budget` computes them for
host dioscuri (GPU 0 runs server alpha, GPU 1 runs beta):

    HOST_SET   = host/dioscuri, gpu/dioscuri/0, gpu/dioscuri/1, server/dioscuri/alpha, …/beta
    GPU0_SET   = gpu/dioscuri/0, server/dioscuri/alpha
    a server   = itself (server/dioscuri/alpha)
"""

from __future__ import annotations

import json
import sqlite3
import subprocess
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import sqlalchemy as sa

from remediator.alerts import parse_notification
from remediator.journal import Admission, Journal, Plan, RunRecord, Verdict, schema
from remediator.journal.rails import RailsReports

T0 = datetime(2026, 1, 1, tzinfo=UTC)

FIXTURES = Path(__file__).parent / "fixtures" / "journal"
"""Journals the released versions made, as SQL dumps (see the README there)."""

ALPHA = "server/dioscuri/alpha"
BETA = "server/dioscuri/beta"
GPU0 = "gpu/dioscuri/0"
HOST = "host/dioscuri"
GPU0_SET = (GPU0, ALPHA)
HOST_SET = (HOST, GPU0, "gpu/dioscuri/1", ALPHA, BETA)


class Clock:
    """A clock the test moves by hand (the journal's `clock`)."""

    def __init__(self, start: datetime = T0) -> None:
        self.now = start

    def __call__(self) -> datetime:
        return self.now

    def advance(self, **delta: float) -> None:
        self.now += timedelta(**delta)


def alert(
    fingerprint: str,
    *,
    status: str = "firing",
    starts: str = "2026-01-01T00:00:00Z",
    ends: str | None = None,
    name: str = "LlamaServerDown",
    **labels: str,
) -> dict[str, Any]:
    """One alert of a notification, as Alertmanager writes it."""
    if ends is None:
        # Alertmanager's zero time is every firing alert's endsAt.
        ends = "2026-01-01T00:10:00Z" if status == "resolved" else "0001-01-01T00:00:00Z"
    return {
        "status": status,
        "labels": {"alertname": name, "host": "dioscuri", "server": "alpha", **labels},
        "annotations": {"summary": f"{name} on dioscuri/alpha"},
        "startsAt": starts,
        "endsAt": ends,
        "generatorURL": "http://127.0.0.1:9090/graph?g0.expr=up",
        "fingerprint": fingerprint,
    }


def body(*alerts: dict[str, Any]) -> bytes:
    """A webhook body holding `alerts`."""
    status = "firing" if any(a["status"] == "firing" for a in alerts) else "resolved"
    return json.dumps(
        {
            "version": "4",
            "groupKey": '{}:{alertname="LlamaServerDown"}',
            "status": status,
            "receiver": "remediator",
            "groupLabels": {"alertname": "LlamaServerDown"},
            "externalURL": "http://127.0.0.1:9093",
            "alerts": list(alerts),
        }
    ).encode()


def admit(journal: Journal, *alerts: dict[str, Any]) -> Admission:
    """Admit a notification of `alerts`, as the webhook does."""
    raw = body(*alerts)
    return journal.admit(parse_notification(raw), raw)


def plan(
    target: str = ALPHA,
    *,
    disruption: tuple[str, ...] | None = None,
    playbook: str = "restart-llama",
    host: str = "dioscuri",
    cooldown: float = 0.0,
    max_failures: int = 3,
    window: float = 3600.0,
) -> Plan:
    """A plan on `target`; its disruption set is the target alone unless given (() read-only)."""
    return Plan(
        playbook=playbook,
        host=host,
        target=target,
        disruption=(target,) if disruption is None else disruption,
        cooldown_seconds=cooldown,
        max_failures=max_failures,
        window_seconds=window,
    )


def claim(journal: Journal, run_id: int) -> RunRecord:
    """Claim the next due run, which must be `run_id`."""
    run = journal.claim_next_run()
    assert run is not None, f"run {run_id} is not due"
    assert run.id == run_id, f"claimed run {run.id}, not {run_id}"
    return run


def judge(
    journal: Journal, run_id: int, the_plan: Plan, reports: RailsReports | None = None
) -> Verdict:
    """Claim `run_id` (it must be the one due) and ask the rails, as `Engine.handle` does."""
    claim(journal, run_id)
    return journal.admit_to_act(run_id, the_plan, reports=reports)


def start(journal: Journal, fingerprint: str, the_plan: Plan | None = None, **labels: str) -> int:
    """A new run of a new alert, admitted by the rails: `running`; its id."""
    (run_id,) = admit(journal, alert(fingerprint, **labels)).new_run_ids
    verdict = judge(journal, run_id, the_plan or plan())
    assert verdict.may_act, verdict
    return run_id


def engine(url: str) -> sa.Engine:
    """A plain engine on the journal's database, to look at (or tamper with) its tables."""
    parsed = sa.make_url(url)
    if parsed.drivername == "postgresql":
        parsed = parsed.set(drivername="postgresql+psycopg")
    return sa.create_engine(parsed)


def rows(url: str, table: sa.Table) -> list[dict[str, Any]]:
    """Every row of `table`, as dicts."""
    plain = engine(url)
    try:
        with plain.connect() as conn:
            return [dict(row) for row in conn.execute(sa.select(table)).mappings()]
    finally:
        plain.dispose()


def counts(url: str) -> dict[str, int]:
    """Rows per table."""
    plain = engine(url)
    try:
        with plain.connect() as conn:
            return {
                table.name: int(
                    conn.execute(sa.select(sa.func.count()).select_from(table)).scalar_one()
                )
                for table in schema.metadata.sorted_tables
            }
    finally:
        plain.dispose()


def load_sqlite(dump: Path, path: Path) -> str:
    """A SQLite file made from `dump` (an `iterdump`); its URL."""
    with sqlite3.connect(path) as conn:
        conn.executescript(dump.read_text())
    return f"sqlite:///{path}"


def load_postgresql(dump: Path, url: str) -> None:
    """Restore `dump` (pg_dump's plain SQL) into the database at `url` with psql.

    psql, as an operator restores a dump: pg_dump 15.14 and later write `\\restrict` lines
    that only psql understands. It stops at the first error.
    """
    subprocess.run(
        ["psql", "-X", "-q", "-v", "ON_ERROR_STOP=1", "-d", url, "-f", str(dump)],
        check=True,
        capture_output=True,
        timeout=60,
    )
