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

import io
import json
import os
import re
import signal
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

from tests.llama_lab import LabError, free_port, wait_until
from tests.pg import throwaway_database
from tests.prometheus_lab import PrometheusServer
from tests.reliability.figures import Figures, sized
from tests.reliability.harness import CountingServers, dumps, journal_rows, notification, post
from tests.remediator_lab import Setup, write_setup
from tests.ssh_lab import SshLab, keygen, node_forced_command, write_wrapper
from tests.systemctl_stand_in import SystemctlStandIn
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


def done_run(replica: Replica, name: str) -> dict[str, Any]:
    """The run on server `name` once it is done; {} before (none yet, or still going)."""
    found = [r for r in replica.runs() if (r["target"] or "").endswith(f"/{name}")]
    return found[0] if found and found[0]["state"] == "done" else {}


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

    def post(self, server: str, fingerprint: str, group: str, host: str = "dioscuri") -> None:
        """Post in the background until answered 200 (a 4xx fails the case at `join`)."""
        body = notification(server, fingerprint, group_key=group, host=host)

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
            return len(journal_rows(url, "SELECT id FROM outbox WHERE state != 'sent'"))

        def reports() -> int:
            return len(journal_rows(url, "SELECT id FROM outbox"))

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
        found_again = log.read_text(errors="replace").count("was already in Zulip")
        outbox = journal_rows(url, "SELECT id, state FROM outbox")
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
    figures.add(suite, "reports found in Zulip, not sent again", found_again)
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
                    states = journal_rows(direct, "SELECT state, wait_reason FROM runs")
                    return len(states) >= len(names) and all(
                        s == "done" or (s == "pending" and w == "cooldown") for s, w in states
                    )

                # Well inside lock_ttl_seconds: a run the cut left is ended by this replica
                # as soon as the journal is back, not taken over 15 minutes later.
                try:
                    wait_until(settled, 120, what="every run ended after the cuts")
                except LabError as exc:
                    open_runs = journal_rows(
                        direct,
                        "SELECT id, state, owner, heartbeat_at FROM runs "
                        "WHERE state IN ('claimed', 'running')",
                    )
                    raise AssertionError(f"{exc}: {open_runs}\n{replica.tail()}") from None
                stuck = settle_threads(replica, baseline)
        finally:
            replica.stop()
            model.close()
            proxy.close()
        runs = journal_rows(
            direct,
            "SELECT r.id, r.state, r.outcome, a.fingerprint FROM runs r "
            "JOIN alerts a ON a.id = r.alert_id",
        )
        journaled = {r[0] for r in journal_rows(direct, "SELECT group_key FROM notifications "
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


# --- SSH --------------------------------------------------------------------------------------

SSH_PLAYBOOK = """\
name: ssh-restart
description: Reliability - restarts the server's unit through gpu-fleet-node over SSH.
match: {alertname: LlamaServerDown}
target: server
steps:
  - restart_server: {}
    timeout_seconds: 8
policy: {cooldown_seconds: 3600, timeout_seconds: 60}
"""
SSH_STEP_SECONDS = 8


class SilentListener:
    """A port that accepts TCP connections and never says a word (a hung sshd)."""

    def __init__(self, address: str) -> None:
        self.sock = socket.socket()
        self.sock.bind((address, 0))
        self.sock.listen(16)
        self.port = int(self.sock.getsockname()[1])
        self.accepted: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                connection, _ = self.sock.accept()
            except OSError:
                return
            self.accepted.append(connection)

    def close(self) -> None:
        self.sock.close()
        for connection in self.accepted:
            connection.close()


def _closed_port(address: str) -> int:
    with socket.socket() as probe:
        probe.bind((address, 0))
        return int(probe.getsockname()[1])


def test_ssh_targets_that_hang_refuse_or_changed_their_key(
    tmp_path: Path, figures: Figures
) -> None:
    suite = f"{SUITE}: SSH"
    (tmp_path / "systemd").mkdir()
    stand_in = SystemctlStandIn(tmp_path / "systemd")
    good = SshLab(tmp_path / "good-ssh", address="127.0.0.5")
    rekeyed = SshLab(tmp_path / "rekeyed-ssh", address="127.0.0.4")
    hung = SilentListener("127.0.0.2")
    refusing_port = _closed_port("127.0.0.3")
    hosts = {"hung": "127.0.0.2", "refusing": "127.0.0.3", "rekeyed": "127.0.0.4",
             "good": "127.0.0.5"}  # fmt: skip
    ports = {"hung": hung.port, "refusing": refusing_port, "rekeyed": rekeyed.port,
             "good": good.port}  # fmt: skip
    model = CountingServers([f"{h}-s" for h in hosts])
    port = free_port()
    setup = write_setup(tmp_path, servers={}, listen=f"127.0.0.1:{port}")
    urls = model.urls()
    lines = ["hosts:"]
    for host, address in hosts.items():
        lines += [
            f"  {host}:",
            f"    address: {address}",
            f"    ssh: {{user: {good.user}, port: {ports[host]}}}",
            "    servers:",
            f"      {host}-s: {{engine: llama, url: '{urls[f'{host}-s']}', "
            f"unit: llama-server@{host}-s.service, role: gpu-dense, model: tiny}}",
        ]
    setup.roster.write_text("\n".join(lines) + "\n")
    for name in ("probe", "probe-stuck"):
        (setup.playbooks / f"{name}.yaml").unlink()
    (setup.playbooks / "ssh-restart.yaml").write_text(SSH_PLAYBOOK)
    # One remediator key for every host (as in production); the rekeyed host's sshd has a new
    # host key, the known_hosts the remediator has still names its old one.
    identity = keygen(tmp_path / "remediator_id", "remediator")
    unit = "llama-server@good-s.service"
    stand_in.declare_service(unit, ["sleep", "3600"], stop_timeout_seconds=2)
    good.add_key("node", node_forced_command(tmp_path, setup.roster, "good", stand_in.env()),
                 private=identity)  # fmt: skip
    ran_there = tmp_path / "ran-on-rekeyed"
    rekeyed.add_key("node", str(write_wrapper(tmp_path / "rekeyed.sh",
                    ["sh", "-c", f"echo ran >> {ran_there}"], {})), private=identity)  # fmt: skip
    good.start()
    rekeyed.start()
    old_key = keygen(tmp_path / "old_host_key", "the rekeyed host's old key")
    kind, blob = Path(f"{old_key}.pub").read_text().split()[:2]
    known_hosts = tmp_path / "known_hosts"
    known_hosts.write_text(
        good.known_hosts.read_text() + f"[127.0.0.4]:{rekeyed.port} {kind} {blob}\n"
    )
    known_before = known_hosts.read_text()
    with setup.config.open("a") as config:
        config.write(f"ssh: {{identity_file: {identity}, known_hosts_file: {known_hosts}, "
                     "connect_timeout_seconds: 3}\n")  # fmt: skip
    subprocess.run(["systemctl", "start", unit], env=stand_in.env(), check=True, timeout=30)
    pid_before = stand_in.main_pid(unit)
    try:
        with serving(setup, port, tmp_path / "remediator.log") as replica, \
                HealthProbe(port) as health:  # fmt: skip
            baseline = threads_of(replica)
            poster = Poster(port, setup.webhook_token)
            for index, host in enumerate(hosts):
                poster.post(f"{host}-s", f"{index:016x}", f"ssh-{host}", host=host)
                time.sleep(0.2)
            poster.join()
            wait_until(
                lambda: (
                    len(replica.runs()) == len(hosts)
                    and all(r["state"] == "done" for r in replica.runs())
                ),
                SSH_STEP_SECONDS * 4 + 30,
                what="every SSH run ended",
            )
            listed = replica.runs()
            assert all(r["target"] for r in listed), [(r["decision"], r["reason"]) for r in listed]
            runs = {r["target"].split("/")[1]: r for r in listed}
            stuck = settle_threads(replica, baseline)
    finally:
        good.stop()
        rekeyed.stop()
        hung.close()
        model.close()
        stand_in.stop_all()
    reasons = {
        "hung": ("timeout", "banner exchange", "timed out"),
        "refusing": ("Connection refused",),
        "rekeyed": ("Host key verification failed",),
    }
    unclear, late, unsafe = [], [], []
    for host, run in runs.items():
        step = run["steps"][0]
        seconds = (datetime.fromisoformat(step["finished_at"])
                   - datetime.fromisoformat(step["started_at"])).total_seconds()  # fmt: skip
        if seconds > SSH_STEP_SECONDS + 3:
            late.append(f"{host}: {seconds:.1f} s")
        if "StrictHostKeyChecking=yes" not in step["output"] or "=no" in step["output"]:
            unsafe.append(host)
        if host == "good":
            if run["outcome"] != "done_unverified" or step["result"] != "ok":
                unclear.append(f"good: {run['outcome']}: {step['output'][:300]}")
            continue
        if (
            run["outcome"] != "failed"
            or step["result"] != "failed"
            or not any(reason in step["output"] for reason in reasons[host])
        ):
            unclear.append(f"{host}: {run['outcome']}/{step['result']}: {step['output'][:300]}")
        figures.add(
            suite, f"{host}: ms to fail (limit {SSH_STEP_SECONDS} s)", round(1000 * seconds)
        )
    wrong_host = len(ran_there.read_text().splitlines()) if ran_there.exists() else 0
    restarted = stand_in.main_pid(unit) != pid_before
    wrong = health.dishonest()
    figures.add(suite, "hung host's connections (said nothing)", len(hung.accepted))
    figures.zero(suite, "steps failing without a clear reason", len(unclear))
    figures.zero(suite, "steps past their time limit", len(late))
    figures.zero(
        suite, "host key checking off", len(unsafe) + (known_hosts.read_text() != known_before)
    )
    figures.zero(suite, "commands run on the rekeyed host", wrong_host)
    figures.zero(suite, "good host not restarted", int(not restarted))
    figures.zero(suite, "dishonest /healthz samples", len(wrong))
    figures.zero(suite, "threads stuck", stuck)
    assert unclear == [] and late == [] and unsafe == [], (unclear, late, unsafe)
    assert wrong_host == 0 and restarted
    assert known_hosts.read_text() == known_before  # nothing learnt, nothing replaced
    assert wrong == [] and stuck == 0, (wrong[:5], stuck)


# --- Prometheus -------------------------------------------------------------------------------

PROMQL_VERIFY = "  promql: 'vector(1) == 1'\n  within_seconds: 2\n  interval_seconds: 0.5"


def test_prometheus_unreachable_or_hung_during_verification_is_never_healed(
    tmp_path: Path, figures: Figures
) -> None:
    suite = f"{SUITE}: Prometheus"
    names = ["m0", "m1", "m2", "m3"]
    model = CountingServers(names)
    port = free_port()
    with PrometheusServer(tmp_path, []) as prometheus, TcpProxy(prometheus.port) as front:
        setup = drain_setup(tmp_path, port, model, None, wait=1.5, verify=PROMQL_VERIFY,
                            prometheus_url=f"http://127.0.0.1:{front.port}")  # fmt: skip
        process = prometheus.process
        try:
            with serving(setup, port, tmp_path / "remediator.log") as replica, \
                    HealthProbe(port) as health:  # fmt: skip
                baseline = threads_of(replica)
                poster = Poster(port, setup.webhook_token)

                def one(name: str, fault: str) -> dict[str, Any]:
                    poster.post(name, f"{names.index(name):016x}", f"prom-{name}")
                    # The restart (after the still-firing question) is done: now the fault.
                    wait_until(lambda: model.count(name, "/restart") == 1, 30, what="restart")
                    if fault == "unreachable":
                        front.cut()
                    elif fault == "hung":
                        process.send_signal(signal.SIGSTOP)
                    wait_until(
                        lambda: bool(done_run(replica, name)), 60, what=f"{name}'s run to end"
                    )
                    if fault == "unreachable":
                        front.restore()
                    elif fault == "hung":
                        process.send_signal(signal.SIGCONT)
                    return done_run(replica, name)

                control = one("m0", "none")
                unreachable = one("m1", "unreachable")
                hung = one("m2", "hung")
                after = one("m3", "none")
                poster.join()
                stuck = settle_threads(replica, baseline)
        finally:
            if process.poll() is None:
                process.send_signal(signal.SIGCONT)
            model.close()
    healed_wrongly = [r["verification"] for r in (unreachable, hung) if r["outcome"] == "healed"]
    unclear = []
    if "unreachable" not in str(unreachable["verification"]):
        unclear.append(unreachable["verification"])
    if "did not answer within" not in str(hung["verification"]):
        unclear.append(hung["verification"])
    wrong = health.dishonest()
    figures.add(suite, "verifications with Prometheus up (healed)",
                sum(r["outcome"] == "healed" for r in (control, after)))  # fmt: skip
    figures.add(suite, "verifications with Prometheus cut or hung (not healed)",
                sum(r["outcome"] == "not_healed" for r in (unreachable, hung)))  # fmt: skip
    figures.zero(suite, "runs healed without an answer", len(healed_wrongly))
    figures.zero(suite, "verifications without the reason", len(unclear))
    figures.zero(suite, "dishonest /healthz samples", len(wrong))
    figures.zero(suite, "threads stuck", stuck)
    assert control["outcome"] == "healed" and after["outcome"] == "healed", (control, after)
    assert unreachable["outcome"] == "not_healed" and hung["outcome"] == "not_healed"
    assert unclear == [], unclear
    assert wrong == [] and stuck == 0, (wrong[:5], stuck)


# --- LiteLLM ----------------------------------------------------------------------------------


def refuse_unblocks(proxy: LiteLlmStandIn, model_ids: set[str]) -> None:
    """Make the stand-in answer 503 to `/model/unblock` of these deployments, as LiteLLM does
    when its database is gone (`{"error": {...}}`); everything else as before."""
    base: Any = proxy._server.RequestHandlerClass

    class Refusing(base):  # type: ignore[misc]
        def do_POST(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            raw: bytes = self.rfile.read(length)  # type: ignore[has-type]
            model_id = str(json.loads(raw or b"{}").get("model_id"))
            if self.path == "/model/unblock" and model_id in model_ids:
                proxy.calls.append((self.path, model_id))
                self._send(503, {"error": {"message": "DB not connected", "type": "None",
                                           "param": "None", "code": "503"}})  # fmt: skip
                return
            self.rfile = io.BytesIO(raw)
            super().do_POST()

    proxy._server.RequestHandlerClass = Refusing


def test_litellm_refusing_the_unblock_is_journaled_and_calls_people(
    tmp_path: Path, figures: Figures
) -> None:
    suite = f"{SUITE}: LiteLLM"
    names = ["l0", "l1", "l2"]
    model = CountingServers(names)
    proxy = LiteLlmStandIn(MASTER_KEY, [f"deploy-{n}" for n in names])
    refuse_unblocks(proxy, {"deploy-l0"})
    port = free_port()
    with ZulipStandIn() as zulip, TcpProxy(int(proxy.url.rsplit(":", 1)[1])) as front:
        front_url = f"http://127.0.0.1:{front.port}"
        zuliprc = zulip.write_zuliprc(tmp_path / "zuliprc")
        setup = drain_setup(tmp_path, port, model, proxy, wait=1.0, extra=zulip_config(zuliprc))
        setup.roster.write_text(setup.roster.read_text().replace(proxy.url, front_url))
        url = f"sqlite:///{tmp_path / 'journal.db'}"
        try:
            with serving(setup, port, tmp_path / "remediator.log") as replica, \
                    HealthProbe(port) as health:  # fmt: skip
                baseline = threads_of(replica)
                poster = Poster(port, setup.webhook_token)

                # l0: LiteLLM answers the unblock 503; l1: refuses connections at the unblock.
                poster.post("l0", f"{0:016x}", "litellm-l0")
                wait_until(lambda: bool(done_run(replica, "l0")), 60, what="l0's run")
                poster.post("l1", f"{1:016x}", "litellm-l1")
                wait_until(lambda: model.count("l1", "/restart") == 1, 30, what="l1 restarted")
                front.cut()
                wait_until(lambda: bool(done_run(replica, "l1")), 60, what="l1's run")
                front.restore()
                poster.post("l2", f"{2:016x}", "litellm-l2")  # LiteLLM well: nothing else lost
                wait_until(lambda: bool(done_run(replica, "l2")), 60, what="l2's run")
                poster.join()
                wait_until(
                    lambda: not journal_rows(url, "SELECT id FROM outbox WHERE state != 'sent'"),
                    60,
                    what="every report sent",
                )
                runs = {n: done_run(replica, n) for n in names}
                events = replica.request("GET", "/api/events?kind=escalation", admin=True)["events"]
                stuck = settle_threads(replica, baseline)
        finally:
            model.close()
            proxy.close()
        undos = journal_rows(url, "SELECT run_id, state, output FROM undos")
        messages = [m.content for m in [*zulip.stream_messages(), *zulip.direct_messages()]]
    by_run = {r["id"]: n for n, r in runs.items()}
    undo_state = {by_run[int(run_id)]: (state, output) for run_id, state, output in undos}
    unclear, unescalated, unreported = [], [], []
    expected = {"l0": ("answered 503",), "l1": ("Connection refused", "reset by peer")}
    for name, whys in expected.items():
        state, output = undo_state[name]
        undo_step = runs[name]["steps"][-1]
        clear = any(why in str(output) for why in whys)
        if state != "failed" or not clear or undo_step["result"] != "failed":
            unclear.append(f"{name}: {state}: {output}")
        if not any(e["run_id"] == runs[name]["id"] and "could not undo" in e["detail"]
                   for e in events):  # fmt: skip
            unescalated.append(name)
        report = [m for m in messages if f"run #{runs[name]['id']}" in m]
        if not any("FAILED" in m or "failed" in m for m in report):
            unreported.append(name)
    attempts = Counter(m for path, m in proxy.calls if path == "/model/unblock")
    figures.add(suite, "unblocks refused (503)", attempts["deploy-l0"])
    figures.add(suite, "deployments left blocked, people called", sum(proxy.blocked.values()))
    figures.zero(suite, "undo failures not journaled with the reason", len(unclear))
    figures.zero(suite, "undo failures without an escalation", len(unescalated))
    figures.zero(suite, "undo failures not in the report", len(unreported))
    figures.zero(suite, "other runs hurt", int(runs["l2"]["outcome"] != "healed"
                                                or proxy.blocked["deploy-l2"]))  # fmt: skip
    figures.zero(suite, "dishonest /healthz samples", len(health.dishonest()))
    figures.zero(suite, "threads stuck", stuck)
    assert unclear == [] and unescalated == [] and unreported == [], (
        unclear, unescalated, unreported)  # fmt: skip
    assert runs["l2"]["outcome"] == "healed" and not proxy.blocked["deploy-l2"]
    assert health.dishonest() == [] and stuck == 0
