"""Reliability 5: HA — two remediator replicas, one lost mid-run (SIGKILL, or SIGSTOP past the TTL).

Two real `gpu-fleet-remediator serve` processes share one journal on this machine's PostgreSQL
(a database of their own), behind the real Alertmanager HA pair (`examples/alertmanager.yml`,
gossip on loopback, each manager sending to both replicas). The test feeds the pair as the two
Prometheus replicas do once `examples/prometheus.yml`'s relabelling dropped `replica`: every
alert, twice (startsAt a moment apart), to both managers, re-sent every few seconds with a
fresh endsAt. Each alert is a LlamaServerDown on a counting server of its own
(`harness.CountingServers`), whose run drains it (LiteLLM `block`, undo `unblock`), waits,
"restarts" it (a request to `/sK/restart` that takes two seconds to answer, so restarts in
flight can be counted at the servers), waits and verifies.

Round after round, a few alerts are posted and the replica acting on one of them is lost in a
disruptive moment — drained, mid-restart or just restarted:
- SIGKILL, then started again at once: the restarted replica finds its run interrupted, undoes
  the drain and reports it; or SIGKILL and left dead past `lock_ttl_seconds`: the other replica
  takes the run over (undo, report), then the dead one is started again;
- SIGSTOP past `lock_ttl_seconds`, then SIGCONT: the other takes the run over; the resumed one
  fails the fence (`Runs.owns`) and acts on it no more.

Afterwards, for every alert: one occurrence, and at most one run that acted, owned by one of
the replicas; no restart or block twice; every interrupted run reported, every drain undone
(nothing left out of LiteLLM's routing); never more restarts in flight at the servers than
`max_concurrent_runs`, never more disruptive runs than `max_runs_per_hour` (the last alerts
meet that cap and wait); and once a lost run was interrupted and undone, nothing acts on its
server again, not even a verification. Counted, not failed: the most deployments out of
LiteLLM's routing at once. Alerts keep coming while a replica is lost, and a silent run gives
up its place under the cap once its heartbeat is older than `lock_ttl_seconds`, while its drain
is undone only at the takeover, at the other replica's next heartbeat (up to 5 s later): in
that gap more deployments than `max_concurrent_runs` can be drained.

A second test loses a replica at the worst moment: its fence check passed for a step that
changes something, and it is asking Prometheus whether the alert still fires (a real
Prometheus, SIGSTOPped: the question hangs for its 5 s timeout). Taken over meanwhile, the
resumed replica must stand down, not drain a server whose undos the taker already ran.

In the first test the alerts are the fault: no Prometheus evaluates LlamaServerDown there, so
the journal's state decides whether an alert still fires (remediator/firing.py); the Prometheus
pair's part, two copies becoming one alert, is the lab's scenario 7 (tests/test_lab_hosts.py).
Alerts on counting servers rather than real faults on llama-servers: a round then takes seconds
(the lost replica's TTL), not the half-minute of a real fault, so the short size has three.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import random
import re
import signal
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from tests.lab import alertmanager_cluster, lab_alertmanager_config
from tests.llama_lab import free_port, wait_until
from tests.pg import throwaway_database
from tests.prometheus_lab import PrometheusServer
from tests.reliability.figures import Figures, sized
from tests.reliability.harness import CountingServers, dumps, journal_rows, notification, post
from tests.reliability.test_crash_consistency import MASTER_KEY, _roster
from tests.remediator_lab import drop_test_playbooks, write_setup
from tests.test_host_actions import LiteLlmStandIn
from tests.test_notify_e2e import zulip_config
from tests.test_remediator_process import Replica
from tests.test_wiring import Alertmanager
from tests.zulip_stand_in import ZulipStandIn

pytestmark = pytest.mark.reliability

SUITE = "5 HA"
LOCK_TTL = 10  # seconds: the config's minimum; a lost replica's runs are taken over 10-15 s on
CONCURRENT = 2  # max_concurrent_runs: four alerts a round, so runs wait for a place
PER_ROUND = 4
# Alerts posted while a replica is lost past the TTL: a silent run gives up its place under
# the cap once its heartbeat is older than lock_ttl_seconds (journal/rails.py), and is taken
# over (its drain undone) at the other replica's next heartbeat, up to 5 s later.
DURING_A_LOSS = sized(3, 4)
BEYOND_HOURLY_CAP = 2  # alerts posted after max_runs_per_hour is spent: they must wait
RESTART_SECONDS = 2.0  # how long a /restart takes to answer: restarts in flight, countable
MOMENTS = ("drained", "restarting", "restarted")
# Each way of losing a replica goes through the moments in turn, from its own first one, so the
# short size has each moment once: a stop in the last step (after it, no fence check of a step
# is left), a kill mid-restart (the server finishes it), a kill after the drain.
FIRST_MOMENT = {"stop": 2, "kill-restart": 1, "kill-takeover": 0}

PLAYBOOK = """\
name: ha-drain-restart
description: Reliability HA - drains (LiteLLM), waits, restarts (2 s), waits; undo puts it back.
match: {alertname: LlamaServerDown}
target: server
steps:
  - drain: {max_wait_seconds: 0}
  - wait: {seconds: 0.5}
  - http_request: {url: "{server.url}/restart", method: GET, expect_status: [200]}
  - wait: {seconds: 0.5}
verify:
  probe: {http_probe: {url: "{server.url}/verify", expect_status: 200}}
policy: {cooldown_seconds: 3600, timeout_seconds: 120}
"""


class _Restarts(CountingServers):
    """`CountingServers` whose `/restart` takes `seconds` to answer, restarts in flight counted.

    A restart is in flight at its server from the request's arrival to its answer, whether or
    not the replica that asked is still there to read it (a killed one is not): what a
    concurrency cap must bound is what the servers see.
    """

    def __init__(self, names: Iterable[str], seconds: float) -> None:
        super().__init__(names)
        self.in_flight: set[str] = set()
        self.most = 0  # restarts in flight at once, at most
        self._flight = threading.Lock()
        for name, server in self._servers.items():
            handler = server.RequestHandlerClass  # a class of its own per server (harness.py)
            answer = getattr(handler, "do_GET")  # noqa: B009 - the harness's own method

            def slow(request: Any, name: str = name, answer: Any = answer) -> None:
                if request.path.split("?", 1)[0] != "/restart":
                    answer(request)
                    return
                with self._flight:
                    self.in_flight.add(name)
                    self.most = max(self.most, len(self.in_flight))
                try:
                    time.sleep(seconds)
                    answer(request)
                finally:
                    with self._flight:
                        self.in_flight.discard(name)

            setattr(handler, "do_GET", slow)  # noqa: B010 - wraps the harness's method

    def restarting(self, name: str) -> bool:
        """Whether a restart of `name` is in flight now."""
        with self._flight:
            return name in self.in_flight


def _alertmanager_pair(tmp_path: Path, webhooks: list[str], token: str) -> list[Alertmanager]:
    """`examples/alertmanager.yml` in a gossiping pair, each sending to every webhook.

    As tests/lab.py's HA lab rewrites it: group_wait and group_interval 1 s, the firing group
    resent every 5 s (so every alert arrives more than once), the token file the test's.
    """
    token_file = tmp_path / "alertmanager.token"
    token_file.write_text(token + "\n")
    text = lab_alertmanager_config(webhooks, token_file, repeat_interval="5s")
    managers = []
    for index, cluster in enumerate(alertmanager_cluster(2)):
        directory = tmp_path / f"am{index + 1}"
        directory.mkdir()
        managers.append(Alertmanager(directory, text, cluster))
    return managers


class _PrometheusPair:
    """Sends the alerts posted so far to both managers, as replicas a and b would, every 3 s.

    Each alert twice, startsAt 0.7 s apart (two evaluations), endsAt a minute on (Prometheus
    sets it ahead of its next resend), labels as the relabelling leaves them: without
    `replica`, so both copies are one alert in each manager.
    """

    def __init__(self, managers: list[Alertmanager]) -> None:
        self.managers = managers
        self.started: dict[str, datetime] = {}
        self.posts = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="prometheus-pair", daemon=True)

    def fire(self, servers: Iterable[str]) -> None:
        """Start firing LlamaServerDown on each of `servers` (posted at once, then resent)."""
        with self._lock:
            for server in servers:
                self.started[server] = datetime.now(UTC)
        self._send()

    def _send(self) -> None:
        with self._lock:
            started = dict(self.started)
        ends = datetime.now(UTC) + timedelta(minutes=1)
        batch = []
        for server, at in started.items():
            labels = {"alertname": "LlamaServerDown", "host": "dioscuri", "server": server,
                      "severity": "critical", "category": "inference",
                      "job": "gpu-fleet-exporter"}  # fmt: skip
            for offset in (0.0, 0.7):  # replica a's evaluation, then b's
                batch.append({
                    "labels": labels,
                    "annotations": {"summary": f"LlamaServerDown on dioscuri/{server}"},
                    "startsAt": (at + timedelta(seconds=offset)).isoformat(),
                    "endsAt": ends.isoformat(),
                    "generatorURL": "http://127.0.0.1:9090/graph?g0.expr=LlamaServerDown",
                })  # fmt: skip
        for manager in self.managers:  # each Prometheus sends to both managers
            manager.post(batch)
            with self._lock:
                self.posts += 1

    def _run(self) -> None:
        while not self._stop.wait(3):
            self._send()

    def __enter__(self) -> _PrometheusPair:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(30)


@dataclass
class _Loss:
    """One round's lost replica: how, when in the run, which run, who took it."""

    how: str  # kill-restart, kill-takeover, stop
    moment: str
    server: str
    run_id: int
    lost: str  # the replica id lost
    finished_by: str = ""
    acts: tuple[int, int, int] = (0, 0, 0)  # its server's restarts, blocks, verifications


class _Journal:
    """Reads of the shared journal (the replicas keep writing)."""

    def __init__(self, url: str) -> None:
        self.url = url

    def runs(self) -> list[dict[str, Any]]:
        rows = journal_rows(
            self.url,
            "SELECT r.id, r.state, r.outcome, r.owner, r.started_at, r.wait_reason, "
            "r.disruptive, a.id, a.labels FROM runs r JOIN alerts a ON a.id = r.alert_id "
            "ORDER BY r.id",
        )
        return [
            {"id": r[0], "state": r[1], "outcome": r[2], "owner": r[3], "started": r[4],
             "wait_reason": r[5], "disruptive": r[6], "alert_id": r[7],
             "server": json.loads(r[8])["server"]}
            for r in rows
        ]  # fmt: skip

    def run(self, run_id: int) -> dict[str, Any]:
        return next(r for r in self.runs() if r["id"] == run_id)

    def running_on(self, server: str) -> dict[str, Any] | None:
        return next(
            (r for r in self.runs() if r["server"] == server and r["state"] == "running"), None
        )


def _replicas(
    tmp_path: Path, url: str, *, model: CountingServers, proxy: LiteLlmStandIn, zuliprc: Path,
    count: int, hourly: int, prometheus_url: str = "http://127.0.0.1:9",
) -> list[Replica]:  # fmt: skip
    restart_urls = ", ".join(f"{u}/restart" for u in model.urls().values())
    replicas = []
    for name in ("a", "b"):
        directory = tmp_path / name
        directory.mkdir()
        port = free_port()
        setup = write_setup(
            directory,
            servers={},
            journal_url=url,
            listen=f"127.0.0.1:{port}",
            prometheus_url=prometheus_url,
            extra=zulip_config(zuliprc)
            + f"http_request: {{allowed_urls: [{restart_urls}]}}\n"
            + f"replica_id: ha-{name}\nlock_ttl_seconds: {LOCK_TTL}\nworkers: 3\n"
            + f"limits: {{max_concurrent_runs: {CONCURRENT}, max_runs_per_hour: {hourly}}}\n",
        )
        _roster(setup.roster, model, proxy, count)
        drop_test_playbooks(setup)
        (setup.playbooks / "ha-drain-restart.yaml").write_text(PLAYBOOK)
        replicas.append(Replica(setup, port, directory / "remediator.log"))
    return replicas


@contextlib.contextmanager
def _running(managers: list[Alertmanager], replicas: list[Replica]) -> Iterator[None]:
    try:
        for manager in managers:
            manager.start()
        for replica in replicas:
            replica.start()
        yield
    finally:
        for replica in replicas:
            if replica.proc is not None and replica.proc.poll() is None:
                replica.proc.send_signal(signal.SIGCONT)  # a stopped one must be able to stop
            replica.stop()
        for manager in managers:
            manager.stop()


def test_a_replica_killed_or_stopped_mid_run_loses_nothing_and_nothing_runs_twice(
    tmp_path: Path, figures: Figures
) -> None:
    kills = sized(2, 10)
    stops = sized(1, 5)
    plan = ["stop"] * stops + [("kill-restart", "kill-takeover")[i % 2] for i in range(kills)]
    rng = random.Random("ha")
    rng.shuffle(plan)
    # Each round's alerts, and those posted while its replica is lost past the TTL.
    rounds: list[tuple[list[str], list[str]]] = []
    hourly = 0  # the rounds' alerts spend the hourly cap exactly
    for how in plan:
        during = DURING_A_LOSS if how != "kill-restart" else 0
        first = [f"s{i}" for i in range(hourly, hourly + PER_ROUND)]
        rounds.append((first, [f"s{i}" for i in range(hourly + PER_ROUND,
                                                       hourly + PER_ROUND + during)]))  # fmt: skip
        hourly += PER_ROUND + during
    count = hourly + BEYOND_HOURLY_CAP
    names = [f"s{i}" for i in range(count)]
    model = _Restarts(names, RESTART_SECONDS)
    proxy = LiteLlmStandIn(MASTER_KEY, [f"deploy-{i}" for i in range(count)])
    losses: list[_Loss] = []
    with ZulipStandIn() as zulip, throwaway_database() as url:
        journal = _Journal(url)
        zuliprc = zulip.write_zuliprc(tmp_path / "zuliprc")
        replicas = _replicas(tmp_path, url, model=model, proxy=proxy, zuliprc=zuliprc,
                             count=count, hourly=hourly)  # fmt: skip
        by_id = {f"ha-{r.setup.config.parent.name}": r for r in replicas}
        webhooks = [f"http://127.0.0.1:{r.port}/webhook/alertmanager" for r in replicas]
        managers = _alertmanager_pair(tmp_path, webhooks, replicas[0].setup.webhook_token)
        try:
            with _running(managers, replicas), _PrometheusPair(managers) as prometheus:
                for number, (how, (batch, later)) in enumerate(zip(plan, rounds, strict=True)):
                    prometheus.fire(batch)
                    moment = MOMENTS[(FIRST_MOMENT[how] + plan[:number].count(how)) % 3]
                    meanwhile = functools.partial(prometheus.fire, later)
                    losses.append(_lose(how, moment, batch, journal=journal, model=model,
                                        proxy=proxy, by_id=by_id, during=meanwhile))  # fmt: skip
                prometheus.fire(names[hourly:])
                wait_until(lambda: _settled(journal, url, count), timeout=180,
                           what="every alert decided, every report sent")  # fmt: skip
                posts = prometheus.posts
            runs = journal.runs()
            outbox = journal_rows(url, "SELECT id, run_id, state, content FROM outbox")
            deliveries = journal_rows(
                url, "SELECT replica FROM notifications WHERE rejected IS NULL"
            )
            takeovers = journal_rows(url, "SELECT run_id FROM events WHERE kind = 'takeover'")
            messages = [*zulip.stream_messages(), *zulip.direct_messages()]
            logs = [r.log.read_text(errors="replace") for r in replicas]
        finally:
            model.close()
            proxy.close()

    by_alert: dict[int, list[dict[str, Any]]] = {}
    for run in runs:
        by_alert.setdefault(run["alert_id"], []).append(run)
    occurrences = Counter(group[0]["server"] for group in by_alert.values())
    acted = [r for r in runs if r["started"] is not None]
    acted_by_server = Counter(r["server"] for r in acted)
    restarts = {n: model.count(n, "/restart") for n in names}
    blocks = Counter(m for path, m in proxy.calls if path == "/model/block")
    unblocks = Counter(m for path, m in proxy.calls if path == "/model/unblock")
    twice = [f"{n}: {k} restarts" for n, k in restarts.items() if k > 1]
    twice += [f"{m}: {k} blocks" for m, k in blocks.items() if k > 1]
    handled_twice = [n for n in names if occurrences[n] > 1 or acted_by_server[n] > 1]
    rate_limited = [r for r in runs if r["state"] == "pending" and r["wait_reason"] ==
                    "rate_limited"]  # fmt: skip
    decided = {r["server"] for r in acted if r["state"] == "done"}
    decided |= {r["server"] for r in rate_limited}
    unhandled = [n for n in names if n not in decided or occurrences[n] != 1]
    unhandled += [f"run {r['id']}: {r['outcome']}" for r in acted
                  if r["outcome"] not in ("healed", "interrupted")]  # fmt: skip
    strangers = [r["id"] for r in acted if r["owner"] not in by_id]
    left_blocked = [m for m, b in proxy.blocked.items() if b]
    interrupted = [r["id"] for r in runs if r["outcome"] == "interrupted"]
    reported = {e[1] for e in outbox if e[1] is not None and "Interrupted" in e[3]}
    unreported = [r for r in interrupted if r not in reported]
    markers = Counter(
        int(found) for m in messages for found in re.findall(r"gpu-fleet report (\d+)", m.content)
    )
    delivered_twice = [i for i, n in markers.items() if n > 1]
    lost_runs = [loss for loss in losses if _outcome(runs, loss.run_id) != "interrupted"]
    # Once a lost run was interrupted and undone, nothing acts on its server again: not the
    # resumed replica (the fence), not the restarted one, not the run judged again (cooldown).
    now_acts = {loss.run_id: _acts(loss.server, model, proxy) for loss in losses}
    acted_after = [loss for loss in losses if now_acts[loss.run_id][:2] != loss.acts[:2]]
    # Nor does a lost replica go on to verify a run it lost (its finish would be refused).
    verified_after = [loss for loss in losses if now_acts[loss.run_id][2] != loss.acts[2]]
    disruptive = [r for r in acted if r["disruptive"]]

    figures.add(SUITE, "alerts (each twice, to both Alertmanagers)", count)
    figures.add(SUITE, "posts to the Alertmanager pair", posts)
    figures.add(SUITE, "notifications admitted (both replicas)", len(deliveries))
    for replica in sorted(by_id):
        figures.add(SUITE, f"notifications admitted by {replica}",
                    sum(1 for d in deliveries if d[0] == replica))  # fmt: skip
    figures.add(SUITE, "rounds", len(losses))
    figures.add(SUITE, "SIGKILLs (restarted at once)", plan.count("kill-restart"))
    figures.add(SUITE, "SIGKILLs (left dead past the TTL)", plan.count("kill-takeover"))
    figures.add(SUITE, "SIGSTOPs (past the TTL, then SIGCONT)", plan.count("stop"))
    for replica in sorted(by_id):
        figures.add(SUITE, f"runs acted by {replica}", sum(1 for r in acted
                                                          if r["owner"] == replica))  # fmt: skip
    figures.add(SUITE, "runs taken over by the other replica", len(takeovers))
    figures.add(SUITE, "runs interrupted", len(interrupted))
    figures.add(SUITE, "runs healed", sum(1 for r in acted if r["outcome"] == "healed"))
    figures.add(SUITE, "runs judged again, waiting (cooldown)",
                sum(1 for r in runs if r["wait_reason"] == "cooldown"))  # fmt: skip
    figures.add(SUITE, "alerts waiting at the hourly cap", len(rate_limited))
    figures.add(SUITE, f"most restarts in flight at once (cap {CONCURRENT})", model.most)
    figures.add(SUITE, f"most deployments drained at once (cap {CONCURRENT} runs)",
                _most_blocked(proxy.calls))  # fmt: skip
    figures.add(SUITE, "resumed replicas fenced before a step",
                sum(log.count("acting on it no more") for log in logs))  # fmt: skip
    figures.add(SUITE, "undos repeated (idempotent unblock)",
                sum(max(0, n - 1) for n in unblocks.values()))  # fmt: skip
    figures.zero(SUITE, "actions run twice for one alert", len(twice))
    figures.zero(SUITE, "alerts handled twice (occurrences or acting runs)", len(handled_twice))
    figures.zero(SUITE, "alerts unhandled", len(unhandled))
    figures.zero(SUITE, "lost runs not interrupted", len(lost_runs))
    figures.zero(SUITE, "actions after the run was taken over", len(acted_after))
    figures.zero(SUITE, "verifications after the run was taken over", len(verified_after))
    figures.zero(SUITE, "runs acted by neither replica", len(strangers))
    figures.zero(SUITE, "undos missing (left out of LiteLLM)", len(left_blocked))
    figures.zero(SUITE, "interrupted runs not reported", len(unreported))
    figures.zero(SUITE, "reports delivered twice", len(delivered_twice))
    figures.zero(SUITE, "concurrency cap exceeded", max(0, model.most - CONCURRENT))
    figures.zero(SUITE, "hourly cap exceeded",
                 max(0, len(disruptive) - hourly, sum(restarts.values()) - hourly))  # fmt: skip
    assert twice == [] and handled_twice == [], (twice, handled_twice)
    assert unhandled == [] and strangers == [], (unhandled, strangers)
    assert lost_runs == [] and acted_after == [], (lost_runs, acted_after)
    assert verified_after == [], verified_after
    assert left_blocked == [] and unreported == [], (left_blocked, unreported)
    assert delivered_twice == []
    assert model.most <= CONCURRENT and len(disruptive) <= hourly
    # The hourly cap was met, not only respected: the alerts beyond it wait.
    assert len(rate_limited) == BEYOND_HOURLY_CAP, [(r["server"], r["state"]) for r in runs]
    # Who finished each lost run: the restarted replica itself, or the other one.
    for loss in losses:
        finisher = _owner(runs, loss.run_id)
        if loss.how == "kill-restart":
            assert finisher in by_id, loss
        else:
            assert finisher != loss.lost, loss  # taken over: the lost one never came back to it


def _most_blocked(calls: list[tuple[str, str]]) -> int:
    """The most deployments out of LiteLLM's routing at once, replaying its calls in order."""
    blocked: set[str] = set()
    most = 0
    for path, model_id in calls:
        if path == "/model/block":
            blocked.add(model_id)
        elif path == "/model/unblock":
            blocked.discard(model_id)
        most = max(most, len(blocked))
    return most


def _outcome(runs: list[dict[str, Any]], run_id: int) -> str | None:
    """The outcome of run `run_id` in `runs`."""
    return next((r["outcome"] for r in runs if r["id"] == run_id), None)


def _owner(runs: list[dict[str, Any]], run_id: int) -> str | None:
    """The owner of run `run_id` in `runs`."""
    return next((r["owner"] for r in runs if r["id"] == run_id), None)


def _at(moment: str, server: str, model: _Restarts, proxy: LiteLlmStandIn) -> bool:
    """Whether `server`'s run is at `moment` now (seen at the server and at LiteLLM)."""
    deployment = f"deploy-{server[1:]}"
    blocked = proxy.blocked.get(deployment, False)
    restarted = model.count(server, "/restart")
    if moment == "drained":  # in the wait after the drain
        return blocked and restarted == 0 and not model.restarting(server)
    if moment == "restarting":
        return model.restarting(server)
    return blocked and restarted == 1 and model.count(server, "/verify") == 0  # the last wait


def _lose(
    how: str, moment: str, batch: list[str], *, journal: _Journal, model: _Restarts,
    proxy: LiteLlmStandIn, by_id: dict[str, Replica], during: Callable[[], None],
) -> _Loss:  # fmt: skip
    """Lose the replica acting on one of `batch` at `moment`, `how`; back to two replicas.

    `during()` is called once it is lost (the round's alerts that arrive meanwhile).
    """
    found: list[tuple[str, dict[str, Any]]] = []

    def at_moment() -> bool:
        for server in batch:
            if _at(moment, server, model, proxy):
                run = journal.running_on(server)
                if run is not None and run["owner"] in by_id and _at(moment, server, model,
                                                                     proxy):  # fmt: skip
                    found.append((server, run))
                    return True
        return False

    wait_until(at_moment, timeout=60, interval=0.02, what=f"a run of {batch} {moment}")
    server, run = found[-1]
    lost = by_id[run["owner"]]
    assert lost.proc is not None
    loss = _Loss(how, moment, server, run["id"], run["owner"])
    deployment = f"deploy-{server[1:]}"

    def finished() -> bool:
        current = journal.run(loss.run_id)
        return current["state"] == "done" and not proxy.blocked.get(deployment, False)

    if how == "stop":
        lost.proc.send_signal(signal.SIGSTOP)
        during()
        try:  # the TTL, a heartbeat, the undo, slack
            wait_until(finished, timeout=LOCK_TTL + 30, what=f"run {loss.run_id} taken over")
            loss.acts = _acts(server, model, proxy)  # before it wakes
        finally:
            lost.proc.send_signal(signal.SIGCONT)
        # Woken, it must act on its lost run no more: its wait step ends, then the fence (or,
        # after its last step, the finish the journal refuses). Any late action would show in
        # the counts at the end.
        wait_until(lost._healthy, timeout=30, what=f"{loss.lost} answering again")
    else:
        lost.kill()
        during()
        if how == "kill-takeover":
            wait_until(finished, timeout=LOCK_TTL + 30, what=f"run {loss.run_id} taken over")
            loss.acts = _acts(server, model, proxy)  # before it is started again
            lost.start()
        else:
            # Dead; a restart it sent may still be answering (it is counted as it ends).
            wait_until(lambda: not model.restarting(server), timeout=10, what="the restart")
            loss.acts = _acts(server, model, proxy)  # what the restarted one must not add to
            lost.start()
            wait_until(finished, timeout=60, what=f"run {loss.run_id} interrupted, undone")
    loss.finished_by = str(journal.run(loss.run_id)["owner"])
    return loss


def _acts(server: str, model: CountingServers, proxy: LiteLlmStandIn) -> tuple[int, int, int]:
    """The restarts `server` got, the blocks its deployment got, its verifications, so far."""
    deployment = f"deploy-{server[1:]}"
    blocks = sum(1 for path, m in list(proxy.calls) if path == "/model/block" and m == deployment)
    return model.count(server, "/restart"), blocks, model.count(server, "/verify")


def _settled(journal: _Journal, url: str, count: int) -> bool:
    """Every alert has its occurrence and every run is decided; every report is sent."""
    runs = journal.runs()
    if len({r["server"] for r in runs}) < count:
        return False
    waiting = ("cooldown", "rate_limited")
    if not all(r["state"] == "done" or (r["state"] == "pending" and r["wait_reason"] in waiting)
               for r in runs):  # fmt: skip
        return False
    return not journal_rows(url, "SELECT id FROM outbox WHERE state != 'sent'")


def _connected_to(pid: int, port: int) -> bool:
    """Whether process `pid` holds an established TCP connection to 127.0.0.1:`port`."""
    try:
        inodes = {
            os.readlink(fd)[len("socket:[") : -1]
            for fd in Path(f"/proc/{pid}/fd").iterdir()
            if os.readlink(fd).startswith("socket:[")
        }
        table = Path(f"/proc/{pid}/net/tcp").read_text().splitlines()[1:]
    except OSError:  # an fd closed while listed
        return False
    for line in table:
        fields = line.split()
        remote, state, inode = fields[2], fields[3], fields[9]
        if state == "01" and int(remote.split(":")[1], 16) == port and inode in inodes:
            return True
    return False


def test_a_replica_stopped_between_its_fence_check_and_its_action_acts_no_more(
    tmp_path: Path, figures: Figures
) -> None:
    # The worst moment to lose a replica: after its fence check passed for a step that changes
    # something, before the step acts. A Prometheus that hangs (the real one, SIGSTOPped before
    # anything asked it: no rule names cached) holds each replica in its before-the-step
    # "does the alert still fire?" question for its 5 s timeout; the replica is SIGSTOPped
    # there, the other takes the run over, and once resumed it must not drain the server now:
    # nobody would ever undo that block (the taker already ran the run's undos).
    model = _Restarts(["s0"], RESTART_SECONDS)
    proxy = LiteLlmStandIn(MASTER_KEY, ["deploy-0"])
    prometheus = PrometheusServer(tmp_path / "prometheus", [])
    with ZulipStandIn() as zulip, throwaway_database() as url, prometheus:
        prometheus_pid = _pid(prometheus)
        os.kill(prometheus_pid, signal.SIGSTOP)
        journal = _Journal(url)
        replicas = _replicas(tmp_path, url, model=model, proxy=proxy,
                             zuliprc=zulip.write_zuliprc(tmp_path / "zuliprc"), count=1,
                             hourly=10, prometheus_url=prometheus.url)  # fmt: skip
        by_id = {f"ha-{r.setup.config.parent.name}": r for r in replicas}
        try:
            with _running([], replicas):
                body = dumps(notification("s0", "f" * 16))
                for replica in replicas:  # both Alertmanagers deliver to both replicas
                    assert post(replica.port, replica.setup.webhook_token, body) == 200
                found: list[dict[str, Any]] = []

                def in_the_question() -> bool:
                    run = journal.running_on("s0")
                    if run is None or run["owner"] not in by_id:
                        return False
                    owner = by_id[run["owner"]]
                    steps = journal_rows(
                        url, f"SELECT idx FROM steps WHERE run_id = {int(run['id'])}"
                    )
                    assert owner.proc is not None
                    if steps or not _connected_to(owner.proc.pid, prometheus.port):
                        return False
                    found.append(run)
                    return True

                # Claimed, judged (its own 5 s question first), started: then step 0's question.
                wait_until(in_the_question, timeout=60, interval=0.05,
                           what="the run's owner asking Prometheus before its drain")  # fmt: skip
                run = found[-1]
                lost = by_id[run["owner"]]
                assert lost.proc is not None
                lost.proc.send_signal(signal.SIGSTOP)
                try:
                    wait_until(lambda: journal.run(run["id"])["state"] == "done",
                               timeout=LOCK_TTL + 30, what="the run taken over")  # fmt: skip
                    taker = journal.run(run["id"])["owner"]
                finally:
                    lost.proc.send_signal(signal.SIGCONT)
                # Its question times out (Prometheus is still frozen): the journal says the
                # alert fires. Then it either stands down or drains.
                wait_until(lambda: "acting on it no more" in lost.tail()
                           or bool(proxy.calls), timeout=30,
                           what="the resumed replica to stand down or act")  # fmt: skip
        finally:
            os.kill(prometheus_pid, signal.SIGCONT)
            model.close()
            proxy.close()
    blocks = [c for c in proxy.calls if c[0] == "/model/block"]
    figures.add(SUITE, "SIGSTOPs between the fence check and the action", 1)
    figures.zero(SUITE, "actions after the run was taken over", len(blocks)
                 + model.count("s0", "/restart"))  # fmt: skip
    figures.zero(SUITE, "undos missing (left out of LiteLLM)", int(proxy.blocked["deploy-0"]))
    assert taker != run["owner"], taker
    assert blocks == [] and model.count("s0", "/restart") == 0, proxy.calls
    assert not proxy.blocked["deploy-0"]


def _pid(prometheus: PrometheusServer) -> int:
    """The Prometheus process's pid."""
    return prometheus.process.pid
