"""Reliability 3: crash consistency — a `serve` process SIGKILLed at random moments of a storm.

A real `gpu-fleet-remediator serve` on a SQLite journal (and on this machine's PostgreSQL, a
database of its own) receives a storm of notifications — every occurrence on a server of its
own, each posted twice (Alertmanager's repeat) and retried until answered 200, as
Alertmanager retries — while the test SIGKILLs it at random moments and starts it again.
Each run drains its server (LiteLLM `block`, whose undo is the `unblock`), "restarts" it (an
allow-listed request to `/sK/restart`), waits and verifies; reports go to the Zulip stand-in.

Afterwards:
- every notification answered 200 is in the journal, and every occurrence has its run;
- no action ran twice for one occurrence (`/sK/restart` and LiteLLM `block` at most once);
- every interrupted run was reported, and every block was undone (no deployment left out of
  LiteLLM's routing);
- the outbox delivered every report exactly once: each report's marker line is in exactly
  one Zulip message. (The sender marks a report `sending` before it goes out; one found
  `sending` after a crash is looked up in Zulip by its marker before it is sent again, so a
  crash between Zulip taking a message and the journal recording it does not duplicate it.)

Undos are at-least-once: a crash between LiteLLM's `unblock` and its journal commit runs it
again at recovery (it is idempotent). That figure is counted, not failed.
"""

from __future__ import annotations

import random
import re
import threading
import time
import urllib.error
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from tests.llama_lab import free_port, wait_until
from tests.pg import throwaway_database
from tests.reliability.figures import Figures, sized
from tests.reliability.harness import CountingServers, dumps, journal_rows, notification, post
from tests.remediator_lab import write_setup
from tests.test_host_actions import LiteLlmStandIn
from tests.test_notify_e2e import zulip_config
from tests.test_remediator_process import Replica
from tests.zulip_stand_in import ZulipStandIn

pytestmark = pytest.mark.reliability

SUITE = "3 crashes"
MASTER_KEY = "sk-master"

PLAYBOOK = """\
name: drain-restart
description: Reliability - drains (LiteLLM), restarts, waits; its undo puts the server back.
match: {alertname: LlamaServerDown}
target: server
steps:
  - drain: {max_wait_seconds: 0}
  - http_request: {url: "{server.url}/restart", method: GET, expect_status: [200]}
  - wait: {seconds: 0.4}
verify:
  probe: {http_probe: {url: "{server.url}/verify", expect_status: 200}}
policy: {cooldown_seconds: 3600, timeout_seconds: 120}
"""


def _roster(path: Path, model: CountingServers, proxy: LiteLlmStandIn, count: int) -> None:
    key_file = path.parent / "litellm.key"
    key_file.write_text(MASTER_KEY + "\n")
    lines = ["hosts:", "  dioscuri:", "    address: 127.0.0.1", "    local: true", "    servers:"]
    urls = model.urls()
    for index in range(count):
        lines += [
            f"      s{index}:",
            "        engine: llama",
            f"        url: {urls[f's{index}']}",
            f"        unit: llama-server@s{index}.service",
            "        role: gpu-dense",
            "        model: tiny",
            f"        litellm: {{url: '{proxy.url}', model_id: deploy-{index}, "
            f"admin_key_file: {key_file}}}",
        ]
    path.write_text("\n".join(lines) + "\n")


class _Storm:
    """Posts occurrence after occurrence (each twice), retrying each post until it is a 200.

    It posts the occurrences `release(n)` let go, so the storm keeps pace with the kills
    (a restart takes seconds of imports, more on a loaded machine) and never runs dry.
    """

    def __init__(self, port: int, token: str, count: int) -> None:
        self.port = port
        self.token = token
        self.count = count
        self._credits = threading.Semaphore(0)
        self.answered: list[str] = []  # group keys answered 200
        self.refused = 0  # posts that found the process dead (retried, as Alertmanager does)
        self.occurrences = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _post(self, body: dict[str, Any], group: str) -> None:
        body["groupKey"] = group
        while not self._stop.is_set():
            try:
                status = post(self.port, self.token, dumps(body), timeout=10)
            except (OSError, urllib.error.URLError):
                status = 0
            if status == 200:
                self.answered.append(group)
                return
            assert status in (0, 503), status  # a 4xx would be a lost notification
            self.refused += 1
            time.sleep(0.1)

    def release(self, occurrences: int) -> None:
        """Let `occurrences` more be posted."""
        self._credits.release(occurrences)

    def _run(self) -> None:
        for index in range(self.count):
            while not self._credits.acquire(timeout=0.1):
                if self._stop.is_set():
                    return
            body = notification(f"s{index}", f"{index:016x}")
            self._post(body, f"occ-{index}")
            self._post(body, f"occ-{index}-repeat")
            self.occurrences = index + 1
            time.sleep(0.3)  # spread over the kill cycle: some land while it is down

    def __enter__(self) -> _Storm:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(30)


@contextmanager
def _journal_url(kind: str, tmp_path: Path) -> Iterator[str]:
    if kind == "sqlite":
        yield f"sqlite:///{tmp_path / 'journal.db'}"
    else:
        with throwaway_database() as url:
            yield url


@pytest.mark.parametrize("journal", ["sqlite", "postgresql"])
def test_sigkill_during_a_storm_loses_nothing_and_acts_once(
    tmp_path: Path, figures: Figures, journal: str
) -> None:
    # A restart costs seconds of imports on a loaded two-core machine: the short size kills few.
    kills = sized(3, 50) if journal == "sqlite" else sized(2, 25)
    # Occurrences: more than the kills get through (the config allows 200 restart URLs).
    per_kill = 3
    count = min(200, kills * per_kill + per_kill)
    model = CountingServers([f"s{i}" for i in range(count)])
    proxy = LiteLlmStandIn(MASTER_KEY, [f"deploy-{i}" for i in range(count)])
    port = free_port()
    rng = random.Random(f"crash-{journal}")
    suite = f"{SUITE} ({journal})"
    restart_urls = ", ".join(f"{url}/restart" for url in model.urls().values())
    with ZulipStandIn() as zulip, _journal_url(journal, tmp_path) as url:
        setup = write_setup(
            tmp_path,
            servers={},
            journal_url=url,
            listen=f"127.0.0.1:{port}",
            extra=zulip_config(zulip.write_zuliprc(tmp_path / "zuliprc"))
            + f"http_request: {{allowed_urls: [{restart_urls}]}}\n"
            + "limits: {max_concurrent_runs: 8, max_runs_per_hour: 100000}\nworkers: 4\n",
        )
        _roster(setup.roster, model, proxy, count)
        for name in ("probe", "probe-stuck"):
            (setup.playbooks / f"{name}.yaml").unlink()
        (setup.playbooks / "drain-restart.yaml").write_text(PLAYBOOK)
        replica = Replica(setup, port, tmp_path / "remediator.log").start()
        done_kills = 0
        try:
            with _Storm(port, setup.webhook_token, count) as storm:
                while done_kills < kills:
                    storm.release(per_kill - 1)
                    time.sleep(rng.uniform(0.1, 1.5))
                    replica.kill()
                    done_kills += 1
                    storm.release(1)  # one posted while it is down: retried until answered
                    replica.start()
                storm.release(per_kill)  # and a last few after the last restart
                wait_until(
                    lambda: storm.occurrences == count,
                    timeout=120,
                    what="the storm to post every occurrence",
                )
            answered = list(storm.answered)

            def settled() -> bool:
                states = journal_rows(url, "SELECT state, wait_reason FROM runs")
                outbox = journal_rows(url, "SELECT state FROM outbox WHERE state != 'sent'")
                # A run judged again after its interruption waits out the cooldown: decided.
                return not outbox and all(
                    s == "done" or (s == "pending" and w == "cooldown") for s, w in states
                )

            wait_until(settled, timeout=180, what="every run ended and every report sent")
        finally:
            replica.stop()
            model.close()
            proxy.close()
        journaled = {
            r[0]
            for r in journal_rows(url, "SELECT group_key FROM notifications WHERE rejected IS NULL")
        }
        runs = journal_rows(
            url,
            "SELECT r.id, r.state, r.outcome, a.fingerprint FROM runs r "
            "JOIN alerts a ON a.id = r.alert_id",
        )
        outbox = journal_rows(url, "SELECT id, run_id, state, content FROM outbox")
        messages = [*zulip.stream_messages(), *zulip.direct_messages()]
    lost = [g for g in answered if g not in journaled]
    occurrences = {g.split("-")[1] for g in answered}
    with_run = {int(r[3], 16) for r in runs}
    runless = [o for o in occurrences if int(o) not in with_run]
    restarts = {i: model.count(f"s{i}", "/restart") for i in range(count)}
    blocks = Counter(m for path, m in proxy.calls if path == "/model/block")
    unblocks = Counter(m for path, m in proxy.calls if path == "/model/unblock")
    twice = [f"s{i}: {n} restarts" for i, n in restarts.items() if n > 1]
    twice += [f"{m}: {n} blocks" for m, n in blocks.items() if n > 1]
    left_blocked = [m for m, b in proxy.blocked.items() if b]
    interrupted = [r[0] for r in runs if r[2] == "interrupted"]
    markers = Counter(
        int(found) for m in messages for found in re.findall(r"gpu-fleet report (\d+)", m.content)
    )
    unsent = [e[0] for e in outbox if e[2] != "sent"]
    delivered_twice = [i for i, n in markers.items() if n > 1]
    not_delivered = [e[0] for e in outbox if markers[e[0]] == 0]
    reported = {e[1] for e in outbox if e[1] is not None and "Interrupted" in e[3]}
    unreported = [r for r in interrupted if r not in reported]
    figures.add(suite, "SIGKILLs (each restarted)", done_kills)
    figures.add(suite, "notifications answered 200", len(answered))
    figures.add(suite, "posts that found it dead (retried)", storm.refused)
    figures.add(suite, "occurrences", len(occurrences))
    figures.add(suite, "runs interrupted", len(interrupted))
    figures.add(suite, "runs healed", sum(1 for r in runs if r[2] == "healed"))
    figures.add(suite, "reports delivered", len(markers))
    log = (tmp_path / "remediator.log").read_text(errors="replace")
    # The outbox's dedup at work: sent before a crash, found by its marker, not sent again.
    figures.add(suite, "reports found in Zulip after a crash", log.count("was already in Zulip"))
    figures.add(
        suite, "runs judged again, waiting (cooldown)", sum(1 for r in runs if r[1] == "pending")
    )
    figures.add(
        suite, "undos repeated (idempotent unblock)", sum(max(0, n - 1) for n in unblocks.values())
    )
    figures.zero(suite, "lost: 200 but not journaled", len(lost))
    figures.zero(suite, "occurrences without a run", len(runless))
    figures.zero(suite, "actions run twice for one occurrence", len(twice))
    figures.zero(suite, "interrupted runs not reported", len(unreported))
    figures.zero(suite, "blocks left undone", len(left_blocked))
    figures.zero(suite, "reports delivered twice", len(delivered_twice))
    figures.zero(suite, "reports not delivered", len(not_delivered) + len(unsent))
    assert lost == [] and runless == [], (lost, runless)
    assert twice == [], twice
    assert unreported == [] and left_blocked == [], (unreported, left_blocked)
    assert delivered_twice == [] and not_delivered == [] and unsent == []
