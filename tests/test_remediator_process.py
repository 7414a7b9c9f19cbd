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
