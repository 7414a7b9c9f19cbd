"""The upgrade from the released journal (schema 2) to schema 3 keeps its history.

The journals are recorded, not built here: `tests/fixtures/journal/` holds SQL dumps of
journals the released code (commit 180eedc) made through its own API (README there: what
they hold, how to make them again). Each test loads a dump into a fresh database — a SQLite
file, or a throwaway PostgreSQL database through `psql`, as an operator restores a dump —
opens today's `Journal` on it, which migrates it, and checks the history row by row (read
through reflection, so with the columns version 2 had) and what the migration derives: budgets
per target, the running run's disruption set, one open occurrence per fingerprint, the
notification accepted but not yet made into runs.
"""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from remediator.journal import Journal, schema
from tests.journal_lab import (
    FIXTURES,
    Clock,
    admit,
    alert,
    engine,
    judge,
    load_postgresql,
    load_sqlite,
    plan,
    rows,
)
from tests.pg import throwaway_database

RECORDED = datetime(2026, 11, 30, 3, 0, tzinfo=UTC)  # the fixtures' clock started here
OPENED = RECORDED + timedelta(minutes=5)  # when the upgraded journal is opened
HISTORY = ("notifications", "alerts", "runs", "steps", "events", "outbox")
# The v2 rows (README.md of the fixtures).
RUNNING, OLD_TWIN, NEW_TWIN = 2, 3, 4  # run 1 healed before the upgrade
LEFTOVER_NOTIFICATION = 5


@pytest.fixture(params=["sqlite", "postgresql"])
def v2_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """A database holding the recorded version-2 journal, not yet opened by today's code."""
    if request.param == "sqlite":
        yield load_sqlite(FIXTURES / "v2.sqlite.sql", tmp_path / "journal.db")
    else:
        with throwaway_database() as url:
            load_postgresql(FIXTURES / "v2.postgresql.sql", url)
            yield url


def _utc(value: Any) -> Any:
    # Reflected SQLite columns give naive UTC datetimes, PostgreSQL aware ones in the
    # session's zone: compared as aware UTC.
    if isinstance(value, datetime):
        return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)
    return value


def history(url: str, columns: dict[str, list[str]] | None = None) -> dict[str, Any]:
    """The rows of the history tables by primary key, with `columns` (default: all there are).

    Reflected rather than read through `schema`, so the version-2 database reads as it is.
    """
    plain = engine(url)
    try:
        reflected = sa.MetaData()
        reflected.reflect(plain, only=list(HISTORY))
        found: dict[str, Any] = {}
        with plain.connect() as conn:
            for name in HISTORY:
                table = reflected.tables[name]
                names = columns[name] if columns is not None else [c.name for c in table.c]
                key = [c.name for c in table.primary_key]
                found[name] = {
                    tuple(row[k] for k in key): {n: _utc(row[n]) for n in names}
                    for row in conn.execute(sa.select(*(table.c[n] for n in names))).mappings()
                }
        return found
    finally:
        plain.dispose()


def test_a_version_2_journal_is_upgraded_keeping_its_history(v2_url: str) -> None:
    before = history(v2_url)
    assert len(before["runs"]) == 4 and len(before["outbox"]) == 2  # the fixture is what we think
    clock = Clock(OPENED)
    journal = Journal(v2_url, replica_id="central-1", clock=clock)
    journal.admit_leftovers()  # as the engine does at start, once its hooks are set
    try:
        assert journal.schema_version() == 3
        assert [r["version"] for r in rows(v2_url, schema.schema_version)] == [1, 2, 3]
        after = history(v2_url, {name: list(next(iter(before[name].values()))) for name in HISTORY})

        # Every row is kept; only what the upgrade had to decide changed, and how.
        expected = {name: {k: dict(v) for k, v in before[name].items()} for name in HISTORY}
        expected["notifications"][(LEFTOVER_NOTIFICATION,)]["ingested_at"] = OPENED
        # Two open occurrences of one fingerprint (an HA twin): the newest stays open; the
        # other is closed now, with its run that had not started.
        expected["alerts"][(OLD_TWIN,)].update(status="resolved", resolved_at=OPENED)
        closed = after["runs"][(OLD_TWIN,)]
        expected["runs"][(OLD_TWIN,)].update(
            state="done", decision="resolved", finished_at=OPENED, reason=closed["reason"]
        )
        assert "twin" in closed["reason"]
        for name in HISTORY:
            kept = {k: v for k, v in after[name].items() if k in before[name]}
            assert kept == expected[name], name

        # The notification answered 200 but not yet ingested is admitted: a run (how its
        # row is reused: test_a_leftover_is_admitted_as_itself).
        (leftover,) = [r for r in journal.recent_runs() if r.alert.fingerprint == "fp-leftover"]
        assert (leftover.state, leftover.created_at) == ("pending", OPENED)
        assert leftover.alert.labels["server"] == "epsilon"
        assert set(after["runs"]) - set(before["runs"]) == {(leftover.id,)}

        open_twins = [
            r for r in rows(v2_url, schema.alerts)
            if r["fingerprint"] == "fp-twin" and r["status"] == "firing"
        ]  # fmt: skip
        assert [r["id"] for r in open_twins] == [NEW_TWIN]
        # An HA copy of the closed twin joins the open one.
        assert admit(journal, alert("fp-twin", server="delta",
                                    starts="2026-11-30T03:01:00Z")).duplicates == 1  # fmt: skip

        # Budgets per target: the open breaker stays open on its target, whatever playbook
        # opened it; the closed one (a count, not a state any more) is gone; the longest of
        # the target's cooldowns is its cooldown.
        (breaker,) = journal.breakers(only_open=False)
        assert (breaker.target, breaker.open, breaker.playbook) == (
            "server/castor/gamma",
            True,
            "restart-llama",
        )
        cooled = datetime(2026, 11, 30, 3, 31, tzinfo=UTC)  # kill-stuck's, after restart-llama's
        assert journal.cooldowns() == [("server/dioscuri/beta", cooled, None)]

        # The running run holds its target as its disruption set; the old target lock is
        # gone, the outbox lease is kept (and still held by its replica).
        assert [(r["run_id"], r["target"]) for r in rows(v2_url, schema.run_targets)] == [
            (RUNNING, "server/dioscuri/alpha")
        ]
        assert [r["target"] for r in rows(v2_url, schema.locks)] == ["lease/outbox"]
        peer = Journal(v2_url, replica_id="central-2", clock=clock)
        try:
            assert not peer.take_lease("outbox", timedelta(minutes=5))
        finally:
            peer.close()
        assert journal.take_lease("outbox", timedelta(minutes=5))

        # And the rails read all of it, in the order the runs are due: the new twin's run
        # on alpha waits for the running run; the leftover's acts; a run on beta waits for
        # its cooldown; on gamma, for castor's maintenance (no end), then meets the breaker.
        assert judge(journal, NEW_TWIN, plan()).wait_reason == "locked"
        assert judge(journal, leftover.id, plan("server/dioscuri/epsilon")).may_act
        (beta,) = admit(journal, alert("fp-beta", server="beta")).new_run_ids
        assert judge(journal, beta, plan("server/dioscuri/beta")).wait_reason == "cooldown"
        (gamma,) = admit(journal, alert("fp-gamma", host="castor", server="gamma")).new_run_ids
        gamma_plan = plan("server/castor/gamma", host="castor")
        verdict = judge(journal, gamma, gamma_plan)
        assert verdict.wait_reason == "maintenance" and "until turned off" in verdict.reason
        journal.set_maintenance("castor", False, by="test")
        assert judge(journal, gamma, gamma_plan).decision == "breaker_open"
        # The run the old version left running is interrupted on recovery, as any other
        # (with the one started above: this replica "stops" here).
        assert journal.recover_interrupted() == [RUNNING, leftover.id]
    finally:
        journal.close()


def test_opening_an_upgraded_journal_again_changes_nothing(v2_url: str) -> None:
    clock = Clock(OPENED)
    first = Journal(v2_url, replica_id="central-1", clock=clock)
    first.admit_leftovers()
    first.close()
    upgraded = history(v2_url)
    clock.advance(minutes=1)
    reopened = Journal(v2_url, replica_id="central-1", clock=clock)
    assert reopened.admit_leftovers() == 0
    reopened.close()
    assert history(v2_url) == upgraded


def test_a_leftover_is_admitted_as_itself(v2_url: str) -> None:
    before = history(v2_url)["notifications"]
    journal = Journal(v2_url, replica_id="central-1", clock=Clock(OPENED))
    assert journal.admit_leftovers() == 1
    journal.close()
    after = history(v2_url)["notifications"]
    assert set(after) == set(before)  # no copy of the leftover
    leftover = max(rows(v2_url, schema.alerts), key=lambda r: int(r["id"]))
    assert leftover["notification_id"] == LEFTOVER_NOTIFICATION
