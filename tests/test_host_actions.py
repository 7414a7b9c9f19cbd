"""Host actions against real parts: Redis, a LiteLLM stand-in, a real llama-server, the node.

- `http_request`: local HTTP servers; a URL not in the config is refused before any request.
- `redis_delete`: the Redis server of this machine (127.0.0.1:6379), keys under a random
  prefix, cleaned up afterwards.
- `drain` with LiteLLM: a STAND-IN for the LiteLLM proxy (below). The real proxy (PyPI
  `litellm[proxy]`) keeps deployments it can block in its database through Prisma, whose
  query engine is downloaded from binaries.prisma.sh when the client is generated; this machine
  has no route outside 127.0.0.0/8, so the real proxy's `/model/block` cannot run here. The
  stand-in follows its documented admin endpoints: `POST /model/block` and `/model/unblock`
  with `{"model_id": …}`, the master key as `Authorization: Bearer`, 401 with LiteLLM's
  `{"error": {"message", "type": "auth_error", "param", "code": "401"}}` otherwise, FastAPI's
  `{"detail": …}` for an unknown deployment, and `GET /model/info` listing
  `model_info.blocked`.
- `set_power_cap` and its durable restore: the real `gpu-fleet-node` through the local
  executor, on the fake NVML backend (a stand-in for a GPU; its limits persist in a settings
  file beside the scenario), with a real Prometheus scraping the temperatures the test sets.
"""

from __future__ import annotations

import contextlib
import json
import secrets
import shutil
import threading
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import redis

from fleet.roster import Roster, load_roster
from remediator.actions.executors import ExecutorSettings
from remediator.actions.host import NoParams
from remediator.actions.integrations import HttpRequestParams, RedisDeleteParams
from remediator.actions.power import (
    RESTORED,
    SCHEDULED,
    SetPowerCapParams,
    pending_restores,
    restore_due_power_caps,
)
from remediator.actions.registry import ActionContext, run_action
from remediator.actions.serving import DrainParams
from remediator.actions.settings import ActionSettings, RedisOptions
from remediator.config import load_config
from remediator.journal import Journal
from remediator.prometheus_api import query_instant
from remediator.service import build_services
from remediator.targets import Target
from remediator.web import create_app
from tests.llama_lab import (
    LlamaServer,
    StartLlamaServer,
    free_port,
    start_generation,
    wait_until,
)
from tests.prometheus_lab import MetricsEndpoint, PrometheusServer
from tests.remediator_lab import CountingServer, Setup, write_setup
from tests.ssh_lab import REPO
from tests.test_remediator import firing

NVML_SCENARIO = Path(__file__).parent / "fixtures" / "nvml" / "two_gpus.yaml"
NODE = REPO / ".venv" / "bin" / "gpu-fleet-node"


def server_roster(tmp_path: Path, url: str, extra: str = "") -> Roster:
    path = tmp_path / "fleet.yaml"
    path.write_text(
        "hosts:\n  dioscuri:\n    address: 127.0.0.1\n    local: true\n    servers:\n"
        f"      alpha:\n        engine: llama\n        url: {url}\n"
        "        unit: llama-server@alpha.service\n        role: r\n        model: m\n" + extra
    )
    return load_roster(path)


def server_target(roster: Roster) -> Target:
    host = roster.hosts["dioscuri"]
    return Target("server", "dioscuri", host, server="alpha", server_entry=host.servers["alpha"])


def context(target: Target, settings: ActionSettings, **kw: Any) -> ActionContext:
    return ActionContext(
        target=target,
        prometheus_url=kw.pop("prometheus_url", "http://127.0.0.1:9"),
        deadline=time.monotonic() + 60,
        cancel=threading.Event(),
        dry_run=False,
        settings=settings,
        **kw,
    )


# --- http_request ---------------------------------------------------------------------------


def test_http_request_calls_only_listed_urls(tmp_path: Path) -> None:
    router = CountingServer()
    try:
        target = server_target(server_roster(tmp_path, router.url))
        allowed = f"{router.url}/reload"
        settings = ActionSettings(http_allowed_urls=frozenset({allowed}))
        refused = run_action(
            context(target, settings), "http_request",
            HttpRequestParams(url=f"{router.url}/other", method="GET"), 10,
        )  # fmt: skip
        assert not refused.ok and refused.output.startswith("refused: ")
        assert "not in the config's http_request.allowed_urls" in refused.output
        assert router.count("/other") == 0  # refused before any request

        done = run_action(
            context(target, settings), "http_request",
            HttpRequestParams(url=allowed + "/", method="GET"), 10,
        )  # fmt: skip
        assert done.ok, done.output
        assert router.count("/reload/") == 1
    finally:
        router.close()


# --- redis_delete ---------------------------------------------------------------------------


@pytest.fixture
def redis_prefix() -> Iterator[str]:
    prefix = f"gpufleet-test-{secrets.token_hex(6)}"
    client = redis.Redis(host="127.0.0.1", port=6379, socket_timeout=5)
    try:
        yield prefix
    finally:
        keys = list(client.scan_iter(match=f"{prefix}:*"))
        if keys:
            client.delete(*keys)
        client.close()


def test_redis_delete_deletes_only_allowed_keys(tmp_path: Path, redis_prefix: str) -> None:
    client = redis.Redis(host="127.0.0.1", port=6379, socket_timeout=5, decode_responses=True)
    names = [f"{redis_prefix}:breaker:alpha", f"{redis_prefix}:breaker:beta",
             f"{redis_prefix}:users:alpha"]  # fmt: skip
    for name in names:
        client.set(name, "1")
    settings = ActionSettings(
        redis=RedisOptions("redis://127.0.0.1:6379/0", (f"{redis_prefix}:breaker:*",))
    )
    target = server_target(server_roster(tmp_path, "http://127.0.0.1:31001"))

    # One exact key outside the patterns refuses the whole step: nothing is deleted.
    refused = run_action(
        context(target, settings), "redis_delete",
        RedisDeleteParams(keys=[names[0], names[2]]), 10,
    )  # fmt: skip
    assert not refused.ok and refused.output.startswith("refused: ")
    assert client.exists(*names) == 3

    # A SCAN over the whole prefix deletes the allowed keys and leaves the others alone.
    done = run_action(
        context(target, settings), "redis_delete",
        RedisDeleteParams(match=f"{redis_prefix}:*"), 10,
    )  # fmt: skip
    assert done.ok, done.output
    assert done.details["deleted"] == 2
    assert done.details["skipped"] == [names[2]]
    assert client.exists(names[0]) == 0 and client.exists(names[1]) == 0
    assert client.get(names[2]) == "1"

    # Without a redis section nothing is tried.
    none = run_action(context(target, ActionSettings()), "redis_delete",
                      RedisDeleteParams(keys=[names[2]]), 10)  # fmt: skip
    assert not none.ok and "no redis section" in none.output
    client.close()


# --- LiteLLM stand-in and drain -------------------------------------------------------------


class LiteLlmStandIn:
    """STAND-IN for the LiteLLM proxy's admin endpoints (see the module docstring)."""

    def __init__(self, master_key: str, model_ids: list[str]) -> None:
        self.master_key = master_key
        self.blocked = dict.fromkeys(model_ids, False)
        self.calls: list[tuple[str, str]] = []
        # After applying a path's change, answer late (seconds) or with a gateway's 504 (as a
        # proxy in front of LiteLLM does when LiteLLM is slow): the change stands either way.
        self.then: dict[str, float | int] = {}
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def _send(self, status: int, body: Any) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _authorized(self) -> bool:
                if self.headers.get("Authorization") == f"Bearer {outer.master_key}":
                    return True
                self._send(401, {"error": {
                    "message": "Authentication Error, Invalid proxy server token passed.",
                    "type": "auth_error", "param": "None", "code": "401"}})  # fmt: skip
                return False

            def do_GET(self) -> None:
                if self.path == "/model/info" and self._authorized():
                    rows = [{"model_name": "gpu-dense", "litellm_params": {"model": "openai/x"},
                             "model_info": {"id": mid, "blocked": blocked}}
                            for mid, blocked in outer.blocked.items()]  # fmt: skip
                    self._send(200, {"data": rows})

            def do_POST(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(length) or b"{}")
                outer.calls.append((self.path, str(body.get("model_id"))))
                if self.path not in ("/model/block", "/model/unblock"):
                    self._send(404, {"detail": "Not Found"})
                    return
                if not self._authorized():
                    return
                model_id = body.get("model_id")
                if model_id not in outer.blocked:
                    self._send(404, {"detail": f"Model id = {model_id} not found in db"})
                    return
                outer.blocked[model_id] = self.path == "/model/block"
                then = outer.then.get(self.path)
                if isinstance(then, float):
                    time.sleep(then)  # applied; the answer comes after the caller gave up
                    with contextlib.suppress(OSError):  # the caller is gone
                        self._send(200, {"model_id": model_id, "blocked": True})
                    return
                if then == 504:
                    self._send(504, {"detail": "Gateway Timeout"})
                    return
                self._send(200, {"model_id": model_id, "model_name": "gpu-dense",
                                 "blocked": outer.blocked[model_id]})  # fmt: skip

            def log_message(self, format: str, *args: object) -> None:
                del format, args

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        threading.Thread(target=self._server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


def litellm_keys(tmp_path: Path, proxy: LiteLlmStandIn, key: str, model_id: str) -> str:
    key_file = tmp_path / "litellm.key"
    key_file.write_text(key + "\n")
    return (
        f"        litellm: {{url: '{proxy.url}', model_id: {model_id}, "
        f"admin_key_file: {key_file}}}\n"
    )


def test_drain_blocks_waits_for_idle_slots_and_hands_back_an_unblock(
    tmp_path: Path, llama_server: StartLlamaServer
) -> None:
    proxy = LiteLlmStandIn("sk-master", ["deploy-1"])
    server: LlamaServer = llama_server("-c", "4096", "-np", "1", "-t", "1")
    try:
        roster = server_roster(
            tmp_path, server.url, litellm_keys(tmp_path, proxy, "sk-master", "deploy-1")
        )
        target = server_target(roster)
        generation = start_generation(server.url, n_predict=3000)
        wait_until(lambda: _busy(server.url), 20, what="a busy slot")
        result = run_action(
            context(target, ActionSettings()), "drain", DrainParams(max_wait_seconds=60), 80
        )
        assert result.ok, result.output
        assert "LiteLLM /model/block deploy-1: 200" in result.output
        assert "idle after" in result.output
        # The request was let finish, not cut.
        assert generation.wait(10)
        assert proxy.blocked == {"deploy-1": True}
        assert result.undo is not None and result.undo.action == "litellm_unblock"
        undone = run_action(context(target, ActionSettings()), result.undo.action,
                            result.undo.params, result.undo.timeout_seconds)  # fmt: skip
        assert undone.ok and proxy.blocked == {"deploy-1": False}

        # A wrong admin key: LiteLLM's 401; with require_proxy the step fails before waiting.
        wrong_keys = litellm_keys(tmp_path, proxy, "sk-wrong", "deploy-1")
        wrong = server_target(server_roster(tmp_path, server.url, wrong_keys))
        refused = run_action(context(wrong, ActionSettings()), "drain",
                             DrainParams(require_proxy=True), 30)  # fmt: skip
        assert not refused.ok and "answered 401" in refused.output and refused.undo is None
    finally:
        proxy.close()


@pytest.mark.parametrize("then", [504, 5.0], ids=["504", "late"])
def test_a_block_without_a_definite_answer_counts_as_applied(
    tmp_path: Path, then: float | int
) -> None:
    """LiteLLM applies the block, then answers 504 (a gateway) or after the call gave up: the
    unblock stays owed. Before, it was recorded as not needed and the deployment stayed out
    of routing for good."""
    proxy = LiteLlmStandIn("sk-master", ["deploy-1"])
    proxy.then["/model/block"] = then
    model = CountingServer()
    try:
        keys = litellm_keys(tmp_path, proxy, "sk-master", "deploy-1")
        target = server_target(server_roster(tmp_path, model.url, keys))
        # A step of 3 s: the late answer (5 s) comes after the call gave up.
        result = run_action(
            context(target, ActionSettings()), "drain", DrainParams(max_wait_seconds=0), 3
        )
        assert proxy.blocked == {"deploy-1": True}  # applied
        assert "may have been applied" in result.output, result.output
        assert result.undo is not None and result.undo.action == "litellm_unblock"
        # A proxy that refuses at once (connection refused): nothing applied, nothing owed.
        nobody = keys.replace(proxy.url, f"http://127.0.0.1:{free_port()}")
        refused = server_target(server_roster(tmp_path, model.url, nobody))
        nothing = run_action(context(refused, ActionSettings()), "drain", DrainParams(), 10)
        assert nothing.undo is None and "may have been applied" not in nothing.output
    finally:
        proxy.close()
        model.close()


def _busy(url: str) -> bool:
    from tests.llama_lab import get_json

    slots = get_json(url, "/slots", timeout=2)
    return any(slot.get("is_processing") for slot in slots)


def one_run(setup: Setup) -> dict[str, Any]:
    """The remediator of `setup`, in process: one firing alert in, its one run processed."""
    config = load_config(setup.config)
    services = build_services(config)
    client = create_app(config, services).test_client()
    try:
        answer = client.post(
            "/webhook/alertmanager", json=firing(),
            headers={"Authorization": f"Bearer {setup.webhook_token}"},
        )  # fmt: skip
        assert answer.status_code == 200
        assert services.engine is not None
        services.engine.process_all()
        [run] = client.get(
            "/api/runs", headers={"Authorization": f"Bearer {setup.admin_token}"}
        ).get_json()["runs"]
    finally:
        services.close()
    return dict(run)


def test_the_unblock_runs_even_when_a_later_step_fails(tmp_path: Path) -> None:
    proxy = LiteLlmStandIn("sk-master", ["deploy-1"])
    model = CountingServer()
    model.verify_status = 500
    try:
        setup = write_setup(tmp_path, servers={"alpha": model.url})
        roster = server_roster(
            tmp_path, model.url, litellm_keys(tmp_path, proxy, "sk-master", "deploy-1")
        )
        del roster
        (setup.playbooks / "probe.yaml").write_text(
            "name: drain-then-fail\n"
            "description: Test playbook - drains, then a step fails.\n"
            "match: {alertname: LlamaServerDown}\n"
            "target: server\n"
            "steps:\n"
            "  - drain: {max_wait_seconds: 0}\n"
            '  - http_probe: {url: "{server.url}/verify", expect_status: 200}\n'
            '  - http_probe: {url: "{server.url}/never", expect_status: 200}\n'
        )
        setup.roster.write_text((tmp_path / "fleet.yaml").read_text())
        run = one_run(setup)
        assert run["outcome"] == "failed"
        steps = [(s["action"], s["result"]) for s in run["steps"]]
        assert steps == [
            ("drain", "ok"), ("http_probe", "failed"), ("http_probe", "skipped"),
            ("litellm_unblock", "ok"),
        ]  # fmt: skip
        assert run["steps"][3]["output"].startswith("undo of step 0 (put deploy-1 back")
        assert [path for path, _ in proxy.calls] == ["/model/block", "/model/unblock"]
        assert proxy.blocked == {"deploy-1": False}
        assert model.count("/never") == 0
    finally:
        proxy.close()
        model.close()


@pytest.mark.parametrize(
    ("unblock", "outcome"), [(None, "healed"), (504, "not_healed")], ids=["undone", "owed"]
)
def test_a_run_is_not_healed_while_its_unblock_is_owed(
    tmp_path: Path, unblock: int | None, outcome: str
) -> None:
    """The block answered 504 after it was applied; the run's unblock must run, and while it
    has not succeeded the run is not healed, however well the server answers."""
    proxy = LiteLlmStandIn("sk-master", ["deploy-1"])
    proxy.then["/model/block"] = 504
    if unblock is not None:
        proxy.then["/model/unblock"] = unblock  # applied too, but no definite answer
    model = CountingServer()
    try:
        setup = write_setup(tmp_path, servers={"alpha": model.url})
        server_roster(tmp_path, model.url, litellm_keys(tmp_path, proxy, "sk-master", "deploy-1"))
        (setup.playbooks / "probe.yaml").write_text(
            "name: drain-then-verify\n"
            "description: Test playbook - drains, verifies with a probe that passes.\n"
            "match: {alertname: LlamaServerDown}\n"
            "target: server\n"
            "steps:\n"
            "  - drain: {max_wait_seconds: 0}\n"
            'verify:\n  probe: {http_probe: {url: "{server.url}/verify", expect_status: 200}}\n'
        )
        setup.roster.write_text((tmp_path / "fleet.yaml").read_text())
        run = one_run(setup)
        assert [path for path, _ in proxy.calls] == ["/model/block", "/model/unblock"]
        steps = [(s["action"], s["result"]) for s in run["steps"]]
        assert steps[-1] == ("litellm_unblock", "ok" if unblock is None else "failed")
        assert run["outcome"] == outcome, run["verification"]
        if unblock is not None:
            assert "NOT undone: put deploy-1 back into LiteLLM's routing" in run["verification"]
    finally:
        proxy.close()
        model.close()


# --- set_power_cap and the restore ----------------------------------------------------------


NVIDIA_BUS = "0000:41:00.0"  # the scenario's first GPU: gpu 0 on a host without other GPUs


def temperatures(celsius: float, current: float = 650, bus_id: str = NVIDIA_BUS) -> str:
    return (
        f'gpufleet_gpu_info{{gpu="0",pci_bus_id="{bus_id}",vendor="nvidia"}} 1\n'
        f'gpufleet_gpu_power_limit_watts{{gpu="0",kind="current"}} {current:g}\n'
        'gpufleet_gpu_power_limit_watts{gpu="0",kind="min"} 200\n'
        f'gpufleet_gpu_temperature_celsius{{gpu="0",sensor="gpu"}} {celsius}\n'
        'gpufleet_gpu_temperature_critical_celsius{gpu="0",sensor="gpu"} 90\n'
    )


def enforced_watts(scenario: Path) -> float | None:
    settings = Path(str(scenario) + ".settings.json")
    if not settings.exists():
        return None
    value = json.loads(settings.read_text())["0000:41:00.0"]["enforced_power_limit_milliwatts"]
    return float(value) / 1000


def power_settings(
    tmp_path: Path, bounds: str = "0: {min: 300, max: 700}"
) -> tuple[Path, Path, ActionSettings]:
    """The fake NVML scenario, the roster and the settings that run the real node on them."""
    scenario = tmp_path / "two_gpus.yaml"
    shutil.copy(NVML_SCENARIO, scenario)
    sysfs = tmp_path / "sys"
    sysfs.mkdir()
    roster_path = tmp_path / "fleet.yaml"
    roster_path.write_text(
        "hosts:\n  dioscuri:\n    address: 127.0.0.1\n    local: true\n"
        f"    gpus: {{nvidia: {{count: 2}}}}\n    power_cap_watts: {{{bounds}}}\n"
    )
    settings = ActionSettings(
        executors=ExecutorSettings(
            roster_path=roster_path,
            node_command=(
                str(NODE),
                "--nvml.fake-scenario",
                str(scenario),
                "--state-dir",
                str(tmp_path / "state"),
                "--sysfs",
                str(sysfs),
            ),
        )
    )
    return scenario, roster_path, settings


def test_power_cap_steps_down_and_is_restored_after_the_cool_down(tmp_path: Path) -> None:
    scenario, roster_path, settings = power_settings(tmp_path)
    roster = load_roster(roster_path)
    host = roster.hosts["dioscuri"]
    target = Target("gpu", "dioscuri", host, gpu=0)
    journal = Journal(f"sqlite:///{tmp_path / 'journal.db'}", replica_id="test")
    params = SetPowerCapParams(step_percent=10, restore_after_seconds=10, normal_margin_celsius=10)
    with (
        MetricsEndpoint(temperatures(88)) as endpoint,
        PrometheusServer(tmp_path / "prom", [endpoint.target], labels={"host": "dioscuri"}) as prom,
    ):
        prom.wait_for("gpufleet_gpu_temperature_celsius", count=1)
        ctx = context(target, settings, prometheus_url=prom.url, journal=journal, run_id=7)
        result = run_action(ctx, "set_power_cap", params, 60)
        assert result.ok, result.output
        assert result.output.startswith(
            f"power cap of gpu 0 ({NVIDIA_BUS}): 650 W → 585 W (floor 300 W)"
        )
        assert enforced_watts(scenario) == 585
        [pending] = pending_restores(journal)
        assert (pending.host, pending.gpu, pending.pci_bus_id) == ("dioscuri", 0, NVIDIA_BUS)
        assert journal.events(kind=SCHEDULED)[0].run_id == 7

        # The exporter reports the new limit; a second step while hot lowers from there and
        # keeps the one pending restore (of the value before the first step).
        endpoint.set(temperatures(88, current=585))
        current = 'gpufleet_gpu_power_limit_watts{kind="current"} == 585'
        wait_until(lambda: bool(query_instant(prom.url, current, timeout_seconds=2)), 20,
                   interval=0.2, what="Prometheus sees the new limit")  # fmt: skip
        assert run_action(ctx, "set_power_cap", params, 60).ok
        assert enforced_watts(scenario) == 526 and len(pending_restores(journal)) == 1

        # Due, but still hot: nothing is restored.
        later = datetime.now(UTC) + timedelta(seconds=11)
        assert restore_due_power_caps(journal, roster, settings, prom.url, now=later) == []
        assert enforced_watts(scenario) == 526

        # Cool for the whole window: restored to the value before the first step.
        endpoint.set(temperatures(60))
        restored: list[str] = []

        def restore() -> bool:
            now = datetime.now(UTC) + timedelta(seconds=11)
            restored.extend(restore_due_power_caps(journal, roster, settings, prom.url, now=now))
            return bool(restored)

        wait_until(restore, 40, interval=1, what="the restore once cool for 10 s")
        assert restored == ["gpu/dioscuri/0: restored"]
        assert enforced_watts(scenario) == 650
        assert pending_restores(journal) == [] and len(journal.events(kind=RESTORED)) == 1

        # At the floor: no change, and people are called.
        floor_roster = tmp_path / "floor.yaml"
        floor_roster.write_text(roster_path.read_text().replace("min: 300", "min: 650"))
        at_floor = load_roster(floor_roster).hosts["dioscuri"]
        floor_ctx = context(Target("gpu", "dioscuri", at_floor, gpu=0), settings,
                            prometheus_url=prom.url, journal=journal)  # fmt: skip
        floor = run_action(floor_ctx, "set_power_cap", params, 60)
        assert not floor.ok and floor.output.startswith("at the floor: ")
        assert floor.escalate is not None and "power-cap floor" in floor.escalate
    journal.close()


def test_power_cap_sends_the_bus_id_and_the_node_refuses_another_card(tmp_path: Path) -> None:
    # Prometheus says gpu 0 is 0000:c1:00.0 (an exporter that numbered otherwise): the node,
    # for which gpu 0 is 0000:41:00.0, refuses, and neither card's limit changes. The bounds
    # are keyed by the bus id the remediator read, so the step gets as far as the node.
    other = "0000:c1:00.0"
    scenario, roster_path, settings = power_settings(tmp_path, f"'{other}': {{min: 300, max: 700}}")
    host = load_roster(roster_path).hosts["dioscuri"]
    target = Target("gpu", "dioscuri", host, gpu=0)
    params = SetPowerCapParams(step_percent=10)
    with (
        MetricsEndpoint(temperatures(88, bus_id=other)) as endpoint,
        PrometheusServer(tmp_path / "prom", [endpoint.target], labels={"host": "dioscuri"}) as prom,
    ):
        prom.wait_for("gpufleet_gpu_info", count=1)
        ctx = context(target, settings, prometheus_url=prom.url)
        refused = run_action(ctx, "set_power_cap", params, 60)
        assert not refused.ok
        assert f"GPU 0 is {NVIDIA_BUS} on this host, but the request names {other}" in (
            refused.output
        ), refused.output
        assert refused.details["pci_bus_id"] == other
        assert enforced_watts(scenario) is None  # the fake's limits were never written

        # No identity in Prometheus: no action at all (the node is not called).
        endpoint.set(temperatures(88).replace("gpufleet_gpu_info", "gpufleet_other_info"))
        wait_until(lambda: not query_instant(prom.url, "gpufleet_gpu_info", timeout_seconds=2),
                   20, interval=0.2, what="the identity gone from Prometheus")  # fmt: skip
        unknown = run_action(ctx, "set_power_cap", params, 60)
        assert not unknown.ok and "gave 0 GPU(s)" in unknown.output, unknown.output
        assert enforced_watts(scenario) is None


def test_host_actions_without_an_executor_say_so(tmp_path: Path) -> None:
    target = server_target(server_roster(tmp_path, "http://127.0.0.1:31001"))
    result = run_action(context(target, ActionSettings()), "restart_server", NoParams(), 10)
    assert not result.ok and "no executor is configured" in result.output


def test_config_of_host_actions_is_checked_with_key_paths(tmp_path: Path) -> None:
    from remediator.config import ConfigError

    setup = write_setup(
        tmp_path,
        servers={"alpha": "http://127.0.0.1:31001"},
        extra=(
            "redis: {url: 'redis://:hunter2@127.0.0.1:6379/0', allowed_key_patterns: ['*']}\n"
            "http_request: {allowed_urls: ['ftp://127.0.0.1/x']}\n"
            "node_command: ['gpu-fleet-node', '--config=$(id)']\n"
            "ssh: {connect_timeout_seconds: 0, known_hosts_file: /nonexistent/known_hosts}\n"
        ),
    )
    with pytest.raises(ConfigError) as info:
        load_config(setup.config)
    lines = [line.removeprefix(f"{setup.config}: ") for line in str(info.value).splitlines()]
    assert any(line.startswith("redis.url: secrets come from files") for line in lines), lines
    assert any(line.startswith("redis.allowed_key_patterns[0]: '*' would allow") for line in lines)
    assert any(line.startswith("http_request.allowed_urls[0]: must be an http") for line in lines)
    assert any(line.startswith("node_command: '--config=$(id)'") for line in lines), lines
    assert any(line.startswith("ssh.connect_timeout_seconds: ") for line in lines)
    assert any(line.startswith("ssh.known_hosts_file: /nonexistent") for line in lines)


def test_drain_of_a_frozen_server_asks_once_and_goes_on(
    tmp_path: Path, llama_server: StartLlamaServer
) -> None:
    # A SIGSTOPped llama-server: the kernel still accepts connections, nothing answers. /props
    # times out; /slots, served by the same threads, is not asked (it cost the lab's drain a
    # second timeout), and the drain goes on, saying it cannot see the load.
    server: LlamaServer = llama_server("-c", "1024", "-np", "1", "-t", "1")
    target = server_target(server_roster(tmp_path, server.url))
    server.freeze()
    try:
        result = run_action(context(target, ActionSettings()), "drain", DrainParams(), 60)
    finally:
        server.thaw()
    assert result.ok, result.output
    assert "cannot see the server's load (/props: " in result.output, result.output
    assert "/slots" not in result.output


def test_drain_of_a_sleeping_server_does_not_wake_it(
    tmp_path: Path, llama_server: StartLlamaServer
) -> None:
    from tests.llama_lab import get_json

    server: LlamaServer = llama_server("-c", "1024", "-np", "1", "-t", "1", "--metrics",
                                       "--sleep-idle-seconds", "2")  # fmt: skip

    def sleeping() -> bool:
        return get_json(server.url, "/props")["is_sleeping"] is True

    wait_until(sleeping, 20, interval=0.2, what="the server asleep")
    target = server_target(server_roster(tmp_path, server.url))
    result = run_action(context(target, ActionSettings()), "drain", DrainParams(), 30)
    assert result.ok, result.output
    assert "sleeping, nothing in flight" in result.output
    time.sleep(0.5)
    assert sleeping(), "the drain woke the server (its /slots reloads the model)"
