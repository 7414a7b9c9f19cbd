"""The remediator as real processes: crash safety (SIGKILL mid-run) and two replicas on the real
PostgreSQL of this machine, each action's side effect counted on local stand-in model servers.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.llama_lab import free_port, stop_process, wait_until
from tests.pg import throwaway_database
from tests.remediator_lab import ALERTMANAGER_FIXTURES, CountingServer, Setup, write_setup

REMEDIATOR = str(Path(sys.executable).parent / "gpu-fleet-remediator")


class Replica:
    """One `gpu-fleet-remediator serve` process."""

    def __init__(self, setup: Setup, port: int, log: Path) -> None:
        self.setup = setup
        self.port = port
        self.log = log
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> Replica:
        out = self.log.open("ab")
        self.proc = subprocess.Popen(
            [REMEDIATOR, "serve", "--config", str(self.setup.config)],
            stdout=out,
            stderr=subprocess.STDOUT,
        )
        wait_until(self._healthy, timeout=30, what=f"remediator on {self.port}")
        return self

    def _healthy(self) -> bool:
        assert self.proc is not None
        if self.proc.poll() is not None:
            raise AssertionError(f"remediator exited {self.proc.returncode}:\n{self.tail()}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/healthz", timeout=2) as r:
                return bool(r.status == 200)
        except OSError:
            return False

    def tail(self) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-30:])

    def request(self, method: str, path: str, body: Any = None, *, admin: bool = False) -> Any:
        token = self.setup.admin_token if admin else self.setup.webhook_token
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(
            f"http://127.0.0.1:{self.port}{path}",
            data=data,
            method=method,
            headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=30) as response:
            return json.loads(response.read())

    def runs(self) -> list[dict[str, Any]]:
        runs: list[dict[str, Any]] = self.request("GET", "/api/runs?limit=200", admin=True)["runs"]
        return runs

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=10)

    def stop(self) -> None:
        if self.proc is not None:
            stop_process(self.proc, 15)


def alert_for(server: str, fingerprint: str, starts: str = "2026-11-30T07:00:00Z") -> Any:
    payload = json.loads((ALERTMANAGER_FIXTURES / "firing.json").read_text())
    alert = payload["alerts"][0]
    alert["labels"]["server"] = server
    alert["fingerprint"] = fingerprint
    alert["startsAt"] = starts
    return payload


@pytest.fixture
def servers() -> Iterator[dict[str, CountingServer]]:
    made = {f"s{i}": CountingServer() for i in range(8)}
    yield made
    for server in made.values():
        server.close()


def test_a_run_killed_mid_step_is_interrupted_not_repeated(
    tmp_path: Path, servers: dict[str, CountingServer]
) -> None:
    port = free_port()
    setup = write_setup(
        tmp_path,
        servers={name: s.url for name, s in servers.items()},
        wait_seconds=60,  # a slow step to be killed in
        listen=f"127.0.0.1:{port}",
        # One worker, held by s0's slow step: s1's run cannot start before the kill, so the
        # interleaving this test is about (answered, not yet started, then killed) is forced.
        extra="workers: 1\n",
    )
    replica = Replica(setup, port, tmp_path / "remediator.log").start()
    try:
        replica.request("POST", "/webhook/alertmanager", alert_for("s0", "0" * 16))
        wait_until(
            lambda: any(r["state"] == "running" for r in replica.runs()),
            timeout=20,
            what="the run to be executing",
        )
        # Answered 200 just before the crash: must not be lost.
        replica.request("POST", "/webhook/alertmanager", alert_for("s1", "1" * 16))
        replica.kill()
        assert servers["s0"].count("/health") == 1
        replica.start()
        wait_until(
            lambda: (
                {r["alert"]["labels"]["server"]: r for r in replica.runs()}["s0"]["outcome"]
                == "interrupted"
            ),
            timeout=20,
            what="the killed run to be marked interrupted",
        )
        runs = {r["alert"]["labels"]["server"]: r for r in replica.runs()}
        assert runs["s0"]["state"] == "done"
        events = replica.request("GET", "/api/events?kind=interrupted", admin=True)["events"]
        assert [e["run_id"] for e in events] == [runs["s0"]["id"]]
        # The notification answered before the crash ran after the restart (its wait is slow:
        # its first step is enough to prove it).
        wait_until(lambda: servers["s1"].count("/health") == 1, timeout=20, what="s1's run")
        time.sleep(1)
        assert servers["s0"].count("/health") == 1  # never repeated blindly
    finally:
        replica.stop()


def test_two_replicas_on_postgresql_act_exactly_once(
    tmp_path: Path, servers: dict[str, CountingServer]
) -> None:
    with throwaway_database() as url:
        replicas = []
        for name in ("a", "b"):
            directory = tmp_path / name
            directory.mkdir()
            port = free_port()
            setup = write_setup(
                directory,
                servers={n: s.url for n, s in servers.items()},
                journal_url=url,
                listen=f"127.0.0.1:{port}",
                extra=f"replica_id: replica-{name}\n",
            )
            replicas.append(Replica(setup, port, directory / "remediator.log"))
        try:
            for replica in replicas:
                replica.start()
            payloads = [alert_for(n, f"{i:016x}") for i, n in enumerate(servers)]
            # Both "Alertmanagers" deliver every notification to both replicas at once.
            barrier = threading.Barrier(2 * len(payloads))
            errors: list[BaseException] = []

            def deliver(replica: Replica, payload: Any) -> None:
                barrier.wait(timeout=30)
                try:
                    replica.request("POST", "/webhook/alertmanager", payload)
                except (OSError, urllib.error.HTTPError) as exc:
                    errors.append(exc)

            threads = [
                threading.Thread(target=deliver, args=(replica, payload))
                for payload in payloads
                for replica in replicas
            ]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(timeout=60)
            assert errors == []
            wait_until(
                lambda: (
                    all(r["state"] == "done" for r in replicas[0].runs())
                    and len(replicas[0].runs()) == len(payloads)
                ),
                timeout=60,
                what="every run done",
            )
            runs = replicas[0].runs()
            assert len(runs) == len(payloads)
            assert {r["outcome"] for r in runs} == {"healed"}, [
                (r["decision"], r["reason"]) for r in runs
            ]
            for name, server in servers.items():
                assert server.count("/health") == 1, name  # each side effect exactly once
                assert server.count("/verify") == 1, name
            owners = {r["owner"] for r in runs}
            assert owners <= {"replica-a", "replica-b"}
        finally:
            for replica in replicas:
                replica.stop()


DRAIN_THEN_WAIT = """\
name: drain-wait-restart
description: Test playbook - drains (LiteLLM), waits, restarts; verification waits too.
match: {{alertname: LlamaServerDown}}
target: server
steps:
  - drain: {{max_wait_seconds: 0}}
  - wait: {{seconds: {wait}}}
  - http_request: {{url: "{{server.url}}/restart", method: GET, expect_status: [200]}}
verify:
  promql: 'up == 1'
  within_seconds: {verify}
  interval_seconds: 1
policy: {{cooldown_seconds: 600, timeout_seconds: 300}}
"""


@pytest.mark.parametrize(
    ("signum", "boundary"),
    [
        (signal.SIGTERM, "after the drain"),
        (signal.SIGKILL, "after the drain"),
        (signal.SIGTERM, "in the verification"),
        (signal.SIGKILL, "in the verification"),
    ],
)
def test_a_stop_or_a_crash_undoes_the_drain_once_and_reports_it(
    tmp_path: Path, signum: signal.Signals, boundary: str
) -> None:
    from tests.test_host_actions import LiteLlmStandIn, litellm_keys, server_roster
    from tests.test_notify_e2e import zulip_config
    from tests.zulip_stand_in import ZulipStandIn

    proxy = LiteLlmStandIn("sk-master", ["deploy-1"])
    model = CountingServer()
    port = free_port()
    in_verification = boundary == "in the verification"
    with ZulipStandIn() as zulip:
        try:
            setup = write_setup(
                tmp_path,
                servers={"alpha": model.url},
                listen=f"127.0.0.1:{port}",
                extra=zulip_config(zulip.write_zuliprc(tmp_path / "zuliprc")),
            )
            server_roster(tmp_path, model.url, litellm_keys(tmp_path, proxy, "sk-master",
                                                            "deploy-1"))  # fmt: skip
            (setup.playbooks / "probe.yaml").write_text(
                DRAIN_THEN_WAIT.format(wait=0.1 if in_verification else 60, verify=60)
            )
            replica = Replica(setup, port, tmp_path / "remediator.log").start()
            replica.request("POST", "/webhook/alertmanager", alert_for("alpha", "a" * 16))

            def at_boundary() -> bool:
                runs = replica.runs()
                if not runs or runs[-1]["state"] != "running":
                    return False
                steps = runs[-1]["steps"]
                if in_verification:  # every step and the undo done: verifying now
                    return len(steps) == 4 and all(s["result"] == "ok" for s in steps)
                return len(steps) >= 2 and steps[1]["result"] == "running"

            wait_until(at_boundary, timeout=30, what=f"the run {boundary}")
            assert proxy.blocked["deploy-1"] is (not in_verification)
            assert replica.proc is not None
            started = time.monotonic()
            replica.proc.send_signal(signum)
            replica.proc.wait(timeout=30)
            if signum == signal.SIGTERM:
                assert time.monotonic() - started < 20  # within the unit's TimeoutStopSec
                assert replica.proc.returncode == 0, replica.tail()
                assert proxy.blocked["deploy-1"] is False  # undone before it exited
            replica.start()
            wait_until(lambda: not proxy.blocked["deploy-1"], timeout=30, what="the unblock")
            wait_until(
                lambda: any("Interrupted" in m.content for m in zulip.stream_messages()),
                timeout=30,
                what="the interruption's report",
            )
            runs = replica.runs()
            first = runs[-1]
            assert first["outcome"] == "interrupted", first
            unblocks = [call for call in proxy.calls if call[0] == "/model/unblock"]
            assert len(unblocks) == 1, proxy.calls  # undone exactly once
            assert model.count("/restart") == (1 if in_verification else 0)  # never repeated
            undo_steps = [s for s in first["steps"] if s["action"] == "litellm_unblock"]
            assert [s["result"] for s in undo_steps] == ["ok"]
            if signum == signal.SIGTERM and not in_verification:
                assert "undone: put deploy-1 back into LiteLLM's routing" in first["verification"]
            [report] = [m for m in zulip.stream_messages() if "Interrupted" in m.content]
            assert "litellm_unblock" in report.content
            # Still firing: judged again through admission, and the interrupted run left a
            # cooldown on the server, so the new run waits instead of acting at once.
            wait_until(lambda: len(replica.runs()) == 2, timeout=30, what="the new run")
            again = replica.runs()[0]
            assert again["state"] == "pending" and again["wait_reason"] == "cooldown", again
        finally:
            if "replica" in locals():
                replica.stop()
            model.close()
            proxy.close()


@pytest.mark.parametrize("how", ["SIGKILL", "SIGSTOP"])
def test_a_lost_replicas_run_is_taken_over_and_it_acts_no_more(tmp_path: Path, how: str) -> None:
    from tests.test_host_actions import LiteLlmStandIn, litellm_keys, server_roster

    proxy = LiteLlmStandIn("sk-master", ["deploy-1"])
    model = CountingServer()
    replicas: list[Replica] = []
    with throwaway_database() as url:
        try:
            for name in ("a", "b"):
                directory = tmp_path / name
                directory.mkdir()
                port = free_port()
                setup = write_setup(
                    directory,
                    servers={"alpha": model.url},
                    journal_url=url,
                    listen=f"127.0.0.1:{port}",
                    extra=f"replica_id: replica-{name}\nlock_ttl_seconds: 10\n",
                )
                server_roster(directory, model.url, litellm_keys(directory, proxy, "sk-master",
                                                                 "deploy-1"))  # fmt: skip
                (setup.playbooks / "probe.yaml").write_text(
                    DRAIN_THEN_WAIT.format(wait=15, verify=5)
                )
                replicas.append(Replica(setup, port, directory / "remediator.log").start())
            for replica in replicas:  # both Alertmanagers deliver to both replicas
                replica.request("POST", "/webhook/alertmanager", alert_for("alpha", "c" * 16))
            wait_until(lambda: any(r["state"] == "running" for r in replicas[0].runs()),
                       timeout=30, what="the run to act")  # fmt: skip
            [run] = replicas[0].runs()
            owner = next(r for r in replicas if run["owner"].endswith(r.setup.config.parent.name))
            other = next(r for r in replicas if r is not owner)
            # `running` is claimed and judged; the drain is its first step, a moment later. Lost
            # in the wait step after it (the drain journaled): what the fence below is about.
            wait_until(lambda: proxy.blocked.get("deploy-1", False), timeout=30,
                       what="the drain to block the deployment")  # fmt: skip
            wait_until(lambda: any(s["action"] == "drain" and s["result"] == "ok"
                                   for s in other.runs()[-1]["steps"]),
                       timeout=30, what="the drain journaled")  # fmt: skip
            assert owner.proc is not None
            owner.proc.send_signal(getattr(signal, how))
            lost = time.monotonic()
            wait_until(
                lambda: other.runs()[-1]["outcome"] == "interrupted",
                timeout=40,
                what="the other replica to take the run over",
            )
            taken = other.runs()[-1]
            assert taken["owner"] == f"replica-{other.setup.config.parent.name}"
            assert time.monotonic() - lost < 10 + 5 + 10  # the TTL, a heartbeat, slack
            wait_until(lambda: not proxy.blocked["deploy-1"], timeout=20, what="the unblock")
            events = other.request("GET", "/api/events?kind=takeover", admin=True)["events"]
            assert len(events) == 1 and "taken over" in events[0]["detail"]
            if how == "SIGSTOP":
                owner.proc.send_signal(signal.SIGCONT)
                # Its wait step ends now; the fence stops it before the restart.
                wait_until(lambda: "acting on it no more" in owner.tail(), timeout=30,
                           what="the resumed replica to stand down")  # fmt: skip
            time.sleep(1)
            assert model.count("/restart") == 0  # the half-done run was not carried on
            unblocks = [call for call in proxy.calls if call[0] == "/model/unblock"]
            assert len(unblocks) == 1, proxy.calls
        finally:
            for replica in replicas:
                if replica.proc is not None and replica.proc.poll() is None:
                    replica.proc.send_signal(signal.SIGCONT)
                replica.stop()
            model.close()
            proxy.close()


def test_two_live_processes_cannot_share_one_replica_id(tmp_path: Path) -> None:
    port = free_port()
    setup = write_setup(tmp_path, servers={"alpha": "http://127.0.0.1:9"},
                        listen=f"127.0.0.1:{port}")  # fmt: skip
    first = Replica(setup, port, tmp_path / "first.log").start()
    try:
        other = free_port()
        config = tmp_path / "second.yaml"
        config.write_text(setup.config.read_text().replace(f"127.0.0.1:{port}",
                                                           f"127.0.0.1:{other}"))  # fmt: skip
        started = time.monotonic()
        argv = [REMEDIATOR, "serve", "--config", str(config)]
        second = subprocess.run(argv, capture_output=True, text=True, timeout=90, check=False)
        assert second.returncode == 1, second.stderr
        assert "is held by another live process" in second.stderr
        assert time.monotonic() - started >= 15  # it waited out a lease a live process renews
        assert first._healthy()
        # After a crash the same replica id is taken again at once: its holder's pid is gone.
        first.kill()
        restarted = time.monotonic()
        first.start()
        assert time.monotonic() - restarted < 10
    finally:
        first.stop()
