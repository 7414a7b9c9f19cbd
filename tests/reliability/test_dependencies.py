"""Reliability 4: dependencies failing — Zulip, PostgreSQL, SSH, Prometheus, LiteLLM.

Each case runs a real `gpu-fleet-remediator serve` (tests/test_remediator_process.py's
`Replica`) against real parts where they exist — PostgreSQL behind `tests/tcp_proxy.py` (the
machine's server is never touched), real `sshd`s (tests/ssh_lab.py), a real Prometheus behind
a proxy — and the stand-ins otherwise (Zulip, LiteLLM), made to fail the way the real ones do.
Each case ends in a clear journaled outcome, checked through the admin API and the journal:

- **Zulip** refusing connections for a while (lab-scaled "minutes"), then rate-limiting (429
  with `Retry-After`, as Zulip's API answers it), then a proxy that loses the answer to a
  message Zulip took (504), then 5xx on a fresh process' first contact (the client's
  constructor asks `/server_settings`): every report is delivered exactly once afterwards
  (the marker lines) and the outbox empties; no request goes out inside a `Retry-After`.
- **PostgreSQL** cut mid-run, several times: webhooks during the cut answer 503 (never 200
  without the journal) and are retried as Alertmanager does; nothing answered 200 is lost;
  every run ends (healed, or interrupted with its undos run); no action twice; no
  deployment left blocked — and none of it waits for `lock_ttl_seconds` (900 s, the default).
- **SSH**: a host that accepts TCP and says nothing, one that refuses, one whose host key
  changed: each step fails with its reason within its time limit, nothing runs there (the
  forced commands count their runs), and the good host beside them still works.
- **Prometheus** unreachable, or hung (SIGSTOP), during verification: the run is
  `not_healed` with the reason, never `healed`.
- **LiteLLM** refusing the unblock (503, then connections refused): the undo is `failed` in
  the journal with LiteLLM's answer, people are called (an escalation event and message), the
  report says "FAILED"; other runs go on.

Throughout, a thread polls `/healthz`: it must answer 503 while the journal cannot write and
200 otherwise (samples within a second of a change are not judged). The serve's threads are
counted from `/proc` (a thread left hanging by a fault shows there).
"""

from __future__ import annotations

import os
import re
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from tests.llama_lab import LabError, free_port, wait_until
from tests.pg import throwaway_database
from tests.reliability.figures import Figures, sized
from tests.reliability.harness import CountingServers, dumps, notification, post
from tests.remediator_lab import Setup, write_setup
from tests.tcp_proxy import TcpProxy
from tests.test_host_actions import LiteLlmStandIn
from tests.test_notify_e2e import zulip_config
from tests.test_remediator_process import Replica
from tests.zulip_stand_in import ZulipStandIn

pytestmark = pytest.mark.reliability

SUITE = "4 dependencies"
MASTER_KEY = "sk-master"
_GRACE_SECONDS = 1.0  # /healthz samples this close to a change of the truth are not judged

# Drains (LiteLLM block; its undo the unblock), "restarts" (an allow-listed request), waits,
# verifies with a probe. Each occurrence has a server of its own, so counts per server are
# counts per occurrence.
DRAIN_PLAYBOOK = """\
name: drain-restart
description: Reliability - drains (LiteLLM), restarts, waits; its undo puts the server back.
match: {{alertname: LlamaServerDown}}
target: server
steps:
  - drain: {{max_wait_seconds: 0}}
  - http_request: {{url: "{{server.url}}/restart", method: GET, expect_status: [200]}}
  - wait: {{seconds: {wait}}}
verify:
{verify}
policy: {{cooldown_seconds: 3600, timeout_seconds: 120}}
"""
PROBE_VERIFY = '  probe: {http_probe: {url: "{server.url}/verify", expect_status: 200}}'


# --- what every case shares -------------------------------------------------------------------


class HealthProbe:
    """Polls `/healthz` of a serve; judges each answer against what the test knows is true.

    `truth(ok)`: from now on /healthz must answer 200 (`True`), must not (`False`: 503), or is
    not judged (`None`: the process restarts). A sample is dishonest when it disagrees with
    the truth of its whole duration; one within `_GRACE_SECONDS` of a change is not judged.
    """

    def __init__(self, port: int) -> None:
        self.port = port
        self.samples: list[tuple[float, float, int]] = []  # start, end, status (0: no answer)
        self._changes: list[tuple[float, bool | None]] = [(time.monotonic(), True)]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="healthz-probe", daemon=True)

    def truth(self, ok: bool | None) -> None:
        """What /healthz must say from now on."""
        self._changes.append((time.monotonic(), ok))

    def _run(self) -> None:
        url = f"http://127.0.0.1:{self.port}/healthz"
        while not self._stop.wait(0.2):
            began = time.monotonic()
            try:
                with urllib.request.urlopen(url, timeout=5) as response:
                    status = int(response.status)
            except urllib.error.HTTPError as error:
                status = int(error.code)
            except OSError:
                status = 0
            self.samples.append((began, time.monotonic(), status))

    def _truth_at(self, at: float) -> bool | None:
        current: bool | None = True
        for when, ok in self._changes:
            if when <= at:
                current = ok
        return current

    def dishonest(self) -> list[str]:
        """The samples that disagree with the truth (each as a line saying how)."""
        wrong = []
        for began, ended, status in self.samples:
            if any(began - _GRACE_SECONDS <= when <= ended + _GRACE_SECONDS
                   for when, _ in self._changes[1:]):  # fmt: skip
                continue
            ok = self._truth_at(began)
            if ok is None:
                continue
            if (ok and status != 200) or (not ok and status != 503):
                wrong.append(f"{status or 'no answer'} while {'ok' if ok else 'failing'}")
        return wrong

    def first_ok_after(self, at: float) -> float | None:
        """Seconds from `at` to the first 200 that began after it."""
        later = [began for began, _, status in self.samples if began >= at and status == 200]
        return min(later) - at if later else None

    def __enter__(self) -> HealthProbe:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)


def threads_of(replica: Replica) -> int:
    """How many threads the serve process has now."""
    assert replica.proc is not None
    return len(os.listdir(f"/proc/{replica.proc.pid}/task"))


def settle_threads(replica: Replica, baseline: int, timeout: float = 30.0) -> int:
    """Threads over `baseline` that are still there after `timeout` (0 once they are gone)."""
    deadline = time.monotonic() + timeout
    while threads_of(replica) > baseline and time.monotonic() < deadline:
        time.sleep(0.2)
    return max(0, threads_of(replica) - baseline)


@dataclass
class Poster:
    """Posts notifications as Alertmanager does: each retried until it is answered 200."""

    port: int
    token: str
    answered: list[str] = field(default_factory=list)  # group keys answered 200
    refused: Counter[int] = field(default_factory=Counter)  # answers other than 200, by status
    _threads: list[threading.Thread] = field(default_factory=list)

    def post(self, server: str, fingerprint: str, group: str) -> None:
        """Post in the background until answered 200 (a 4xx fails the case at `join`)."""
        body = notification(server, fingerprint, group_key=group)

        def run() -> None:
            while True:
                try:
                    status = post(self.port, self.token, dumps(body), timeout=10)
                except (OSError, urllib.error.URLError):
                    status = 0
                if status == 200:
                    self.answered.append(group)
                    return
                self.refused[status] += 1
                if 400 <= status < 500:
                    return  # lost for good: Alertmanager drops a 4xx
                time.sleep(0.5)

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        self._threads.append(thread)

    def join(self, timeout: float = 120.0) -> None:
        """Wait until every post was answered 200."""
        deadline = time.monotonic() + timeout
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        assert not any(t.is_alive() for t in self._threads), "posts not answered 200 in time"
        assert not [s for s in self.refused if 400 <= s < 500], self.refused


def write_roster(
    path: Path, model: CountingServers, proxy: LiteLlmStandIn | None, names: list[str]
) -> None:
    """dioscuri (local) with one server per name, each its own LiteLLM deployment."""
    key_file = path.parent / "litellm.key"
    key_file.write_text(MASTER_KEY + "\n")
    lines = ["hosts:", "  dioscuri:", "    address: 127.0.0.1", "    local: true", "    servers:"]
    urls = model.urls()
    for name in names:
        lines += [
            f"      {name}:",
            "        engine: llama",
            f"        url: {urls[name]}",
            f"        unit: llama-server@{name}.service",
            "        role: gpu-dense",
            "        model: tiny",
        ]
        if proxy is not None:
            lines.append(
                f"        litellm: {{url: '{proxy.url}', model_id: deploy-{name}, "
                f"admin_key_file: {key_file}}}"
            )
    path.write_text("\n".join(lines) + "\n")


def drain_setup(
    tmp_path: Path,
    port: int,
    model: CountingServers,
    proxy: LiteLlmStandIn | None,
    *,
    journal_url: str | None = None,
    extra: str = "",
    wait: float = 0.2,
    verify: str = PROBE_VERIFY,
    prometheus_url: str = "http://127.0.0.1:9",
) -> Setup:
    """A serve's files: the drain-restart playbook only, every server of `model` in the roster."""
    restart_urls = ", ".join(f"{url}/restart" for url in model.urls().values())
    setup = write_setup(
        tmp_path,
        servers={},
        journal_url=journal_url,
        listen=f"127.0.0.1:{port}",
        prometheus_url=prometheus_url,
        extra=f"http_request: {{allowed_urls: [{restart_urls}]}}\n"
        + "limits: {max_concurrent_runs: 8, max_runs_per_hour: 100000}\nworkers: 4\n"
        + extra,
    )
    write_roster(setup.roster, model, proxy, sorted(model.urls()))
    for name in ("probe", "probe-stuck"):
        (setup.playbooks / f"{name}.yaml").unlink()
    (setup.playbooks / "drain-restart.yaml").write_text(
        DRAIN_PLAYBOOK.format(wait=wait, verify=verify)
    )
    return setup


def rows(url: str, sql: str) -> list[Any]:
    """Rows of a query on the journal (SQLite or PostgreSQL), outside the remediator."""
    engine = sa.create_engine(
        url.replace("postgresql://", "postgresql+psycopg://", 1), poolclass=sa.pool.NullPool
    )
    try:
        with engine.connect() as conn:
            return list(conn.execute(sa.text(sql)))
    finally:
        engine.dispose()


def markers(zulip: ZulipStandIn) -> Counter[int]:
    """How many Zulip messages carry each report's marker line."""
    messages = [*zulip.stream_messages(), *zulip.direct_messages()]
    return Counter(
        int(found) for m in messages for found in re.findall(r"gpu-fleet report (\d+)", m.content)
    )


@contextmanager
def serving(setup: Setup, port: int, log: Path) -> Iterator[Replica]:
    """A started `serve`, stopped (SIGTERM) afterwards."""
    replica = Replica(setup, port, log).start()
    try:
        yield replica
    finally:
        replica.stop()


# --- Zulip ------------------------------------------------------------------------------------


def test_zulip_down_rate_limiting_lost_answers_and_5xx_first_contact(
    tmp_path: Path, figures: Figures
) -> None:
    suite = f"{SUITE}: Zulip"
    down_seconds = sized(4, 120)  # "down for minutes" at full size
    names = [f"z{i}" for i in range(12)]
    model = CountingServers(names)
    port = free_port()
    fresh = iter(names)

    def alert(poster: Poster) -> None:
        name = next(fresh)
        poster.post(name, f"{names.index(name):016x}", f"zulip-{name}")

    with ZulipStandIn() as zulip:
        setup = drain_setup(
            tmp_path, port, model, None,
            extra=zulip_config(zulip.write_zuliprc(tmp_path / "zuliprc")),
        )  # fmt: skip
        url = f"sqlite:///{tmp_path / 'journal.db'}"

        def unsent() -> int:
            return len(rows(url, "SELECT id FROM outbox WHERE state != 'sent'"))

        def reports() -> int:
            return len(rows(url, "SELECT id FROM outbox"))

        log = tmp_path / "remediator.log"
        replica = Replica(setup, port, log).start()
        poster = Poster(port, setup.webhook_token)
        try:
            with HealthProbe(port) as health:
                baseline = threads_of(replica)
                alert(poster)  # a control: Zulip up, delivered at once
                wait_until(lambda: reports() == 1 and unsent() == 0, 60, what="the first report")

                # Down: connections refused. Runs go on; their reports wait in the outbox.
                zulip.go_down("refuse")
                for _ in range(3):
                    alert(poster)
                wait_until(lambda: reports() == 4, 60, what="reports queued while Zulip is down")
                time.sleep(down_seconds)
                assert unsent() == 3
                zulip.come_back()
                back = time.monotonic()
                wait_until(lambda: unsent() == 0, 60 + down_seconds, what="the queue sent")
                figures.add(suite, "seconds down (connections refused)", down_seconds)
                figures.add(suite, "seconds from back to the queue sent",
                            round(time.monotonic() - back))  # fmt: skip

                # Rate limiting: two 429s with Retry-After, then a limit of 2 per 2 s.
                zulip.force_429(1.5, times=2)
                zulip.rate_limit(2, 2.0)
                for _ in range(4):
                    alert(poster)
                wait_until(lambda: reports() == 8 and unsent() == 0, 60, what="rate-limited")

                # A proxy loses the answer to a message Zulip took: looked up, not sent again.
                zulip.rate_limit(1000, 1.0)
                zulip.lose_answers(1)
                alert(poster)
                wait_until(lambda: reports() == 9 and unsent() == 0, 60, what="lost answer")

                # 5xx on first contact: a fresh process whose client's first request gets 502.
                health.truth(None)
                replica.stop()
                zulip.go_down("5xx")
                replica.start()
                health.truth(True)
                baseline = threads_of(replica)
                for _ in range(2):
                    alert(poster)
                wait_until(lambda: reports() == 11, 60, what="reports queued on a 5xx Zulip")
                wait_until(
                    lambda: "first contact" in log.read_text(errors="replace"),
                    30,
                    what="the sender to meet the 5xx on first contact",
                )
                zulip.come_back()
                wait_until(lambda: unsent() == 0, 60, what="the queue sent after the 5xx")
                poster.join()
                stuck = settle_threads(replica, baseline)
        finally:
            replica.stop()
            model.close()
        sent = markers(zulip)
        outbox = rows(url, "SELECT id, state FROM outbox")
        requests = list(zulip.requests)
    # No request while a Retry-After runs: the two forced 429s said 1.5 s each.
    early = 0
    for request in [r for r in requests if r.status == 429][:2]:
        early += sum(1 for r in requests if request.at < r.at < request.at + 1.45)
    lost = [entry for entry, state in outbox if state != "sent" or sent[entry] == 0]
    twice = [entry for entry, n in sent.items() if n > 1]
    wrong = health.dishonest()
    figures.add(suite, "reports queued", len(outbox))
    figures.add(suite, "429 answers (Retry-After)", sum(1 for r in requests if r.status == 429))
    figures.add(suite, "5xx answers", sum(1 for r in requests if r.status >= 500))
    figures.add(suite, "answers lost after Zulip took the message", 1)
    figures.add(suite, "/healthz samples", len(health.samples))
    figures.zero(suite, "reports lost (not delivered)", len(lost))
    figures.zero(suite, "reports delivered twice", len(twice))
    figures.zero(suite, "requests inside a Retry-After", early)
    figures.zero(suite, "dishonest /healthz samples", len(wrong))
    figures.zero(suite, "threads stuck", stuck)
    assert lost == [] and twice == [], (lost, twice, sent)
    assert early == 0
    assert wrong == [], wrong[:5]
    assert stuck == 0


# --- PostgreSQL -------------------------------------------------------------------------------


def test_postgresql_cut_mid_run_loses_nothing_and_acts_once(
    tmp_path: Path, figures: Figures
) -> None:
    suite = f"{SUITE}: PostgreSQL"
    cuts = sized(2, 8)
    per_cut = 3
    names = [f"p{i}" for i in range(cuts * per_cut * 2)]
    model = CountingServers(names)
    proxy = LiteLlmStandIn(MASTER_KEY, [f"deploy-{n}" for n in names])
    port = free_port()
    fresh = iter(names)
    rng_delays = [0.3, 0.9, 0.1, 1.4, 0.6, 1.1, 0.2, 0.8]
    with throwaway_database() as direct, TcpProxy(5432) as database:
        url = direct.replace(":5432/", f":{database.port}/", 1)
        # lock_ttl_seconds is the default's: a run the cut left must not wait for it.
        setup = drain_setup(tmp_path, port, model, proxy, journal_url=url, wait=1.5,
                            extra="lock_ttl_seconds: 900\n")  # fmt: skip
        replica = Replica(setup, port, tmp_path / "remediator.log").start()
        poster = Poster(port, setup.webhook_token)
        recoveries: list[float] = []
        try:
            with HealthProbe(port) as health:
                baseline = threads_of(replica)
                for cut in range(cuts):
                    for _ in range(per_cut):
                        name = next(fresh)
                        poster.post(name, f"{names.index(name):016x}", f"pg-{name}")
                    # Cut while runs are in their steps (the drain, the restart, the wait).
                    acted = cut * per_cut + 1
                    wait_until(
                        lambda: sum(model.count(n, "/restart") for n in names) >= acted,  # noqa: B023
                        60,
                        what="a run of this round acting",
                    )
                    time.sleep(rng_delays[cut % len(rng_delays)])
                    database.cut()
                    health.truth(False)
                    for _ in range(per_cut):  # posted during the cut: 503, retried
                        name = next(fresh)
                        poster.post(name, f"{names.index(name):016x}", f"pg-{name}")
                    time.sleep(sized(3, 10))
                    database.restore()
                    health.truth(True)
                    restored = time.monotonic()
                    wait_until(
                        lambda: health.first_ok_after(restored) is not None,  # noqa: B023
                        60,
                        what="/healthz ok after the restore",
                    )
                    recoveries.append(health.first_ok_after(restored) or 0.0)
                poster.join()

                def settled() -> bool:
                    states = rows(direct, "SELECT state, wait_reason FROM runs")
                    return len(states) >= len(names) and all(
                        s == "done" or (s == "pending" and w == "cooldown") for s, w in states
                    )

                # Well inside lock_ttl_seconds: a run the cut left is ended by this replica
                # as soon as the journal is back, not taken over 15 minutes later.
                try:
                    wait_until(settled, 120, what="every run ended after the cuts")
                except LabError as exc:
                    open_runs = rows(direct, "SELECT id, state, owner, heartbeat_at FROM runs "
                                     "WHERE state IN ('claimed', 'running')")  # fmt: skip
                    raise AssertionError(f"{exc}: {open_runs}\n{replica.tail()}") from None
                stuck = settle_threads(replica, baseline)
        finally:
            replica.stop()
            model.close()
            proxy.close()
        runs = rows(
            direct,
            "SELECT r.id, r.state, r.outcome, a.fingerprint FROM runs r "
            "JOIN alerts a ON a.id = r.alert_id",
        )
        journaled = {r[0] for r in rows(direct, "SELECT group_key FROM notifications "
                                                "WHERE rejected IS NULL")}  # fmt: skip
    lost = [g for g in poster.answered if g not in journaled]
    with_run = {int(r[3], 16) for r in runs}
    runless = [n for n in names if names.index(n) not in with_run]
    twice = [f"{n}: {model.count(n, '/restart')} restarts" for n in names
             if model.count(n, "/restart") > 1]  # fmt: skip
    blocks = Counter(m for path, m in proxy.calls if path == "/model/block")
    twice += [f"{m}: {k} blocks" for m, k in blocks.items() if k > 1]
    left_blocked = [m for m, b in proxy.blocked.items() if b]
    wrong = health.dishonest()
    outcomes = Counter(str(r[2]) for r in runs if r[1] == "done")
    figures.add(suite, "cuts", cuts)
    figures.add(suite, "notifications answered 200", len(poster.answered))
    figures.add(suite, "webhooks answered 503 during a cut", poster.refused[503])
    figures.add(suite, "runs healed", outcomes["healed"])
    figures.add(suite, "runs interrupted (journal lost mid-run)", outcomes["interrupted"])
    figures.add(suite, "slowest /healthz recovery after a restore (ms)",
                round(1000 * max(recoveries)))  # fmt: skip
    figures.zero(suite, "webhooks answered other than 200/503", sum(
        n for s, n in poster.refused.items() if s not in (0, 503)))  # fmt: skip
    figures.zero(suite, "lost: 200 but not journaled", len(lost))
    figures.zero(suite, "occurrences without a run", len(runless))
    figures.zero(suite, "actions run twice", len(twice))
    figures.zero(suite, "blocks left undone", len(left_blocked))
    figures.zero(suite, "dishonest /healthz samples", len(wrong))
    figures.zero(suite, "threads stuck", stuck)
    assert lost == [] and runless == [], (lost, runless)
    assert twice == [] and left_blocked == [], (twice, left_blocked)
    assert wrong == [], wrong[:5]
    assert stuck == 0
