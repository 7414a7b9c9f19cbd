"""The lab: the whole loop from a fault to its report, with real parts, on 127.0.0.0/8.

A lab host runs a real `llama-server` (the tiny model) under the systemctl stand-in, and the
real exporter (in-process) reads it; a real Prometheus scrapes it every second and evaluates
the repository's `rules/` rewritten for lab time (`lab_rules`); the real Alertmanager, with
`examples/alertmanager.yml`'s routes, sends to a real `gpu-fleet-remediator serve`, which
acts on the host through `gpu-fleet-node` (the local executor) and reports to the Zulip
stand-in. Scenarios inject a fault and assert on outcomes — the journal, the processes,
Prometheus' `ALERTS`, the report's text — never on wall-clock times.

**Lab time**: a minute of production is a second here. Every `for:` of the rules, every range
selector (`[5m]` → `[5s]`) and every group's `interval:` (the speed's recording group, `1m` →
`1s`; its hourly one, `1h` → `60s`) is divided by 60 (at least 1 s; a range at least 3 s,
three scrapes), so an alert that needs its condition for 1 minute needs it for 1 s; a rule
whose range that floor stretched has its `for:` stretched alike (`[1m]` → `[3s]`, `for: 2m` →
`6s`), so that it still takes the product's number of failed scrapes to fire. Offsets,
subqueries (`[1h:5m]`) and `[7d]` baselines are left as they are: a fresh lab has no history,
as the rules expect of a new server, unless a scenario backfills it (`history=`: OpenMetrics
that `promtool tsdb create-blocks-from openmetrics` writes into Prometheus' data directory
before it starts; `tokens_per_second_history` is a 7-day baseline's: the hourly means the
baseline rule reads, hours old, real history to the real rule). The runaway rule's token
thresholds are divided by 8 (8192 → 1024, 2048 → 256): tokens are time at a server's speed,
and the tiny model on one thread here slows to well under 100 tokens a second as its context
fills, so 8192 took two minutes. Alertmanager's `group_wait` and `group_interval` are 1 s.
Playbooks in lab time: `lab_playbook` (the one rule for every lab and the bench).

    with Lab(tmp_path, llama_binary, tiny_model, monkeypatch) as lab:
        lab.freeze()                         # SIGSTOP the server
        lab.wait_firing("LlamaServerDown")
        run = lab.wait_run_done()

Options for the scenarios: `unit={...}` more of alpha's unit for the systemctl stand-in (its
Restart=, RestartSec=, start limit: `SystemctlStandIn.declare_service`; `guard_argv()` and
`guard_env()` are the port guard as its ExecStartPre=), `llama_args` more flags for alpha,
`neighbours` more servers on dioscuri (`Neighbour`), `playbooks` more playbook files in the
remediator's playbooks_dir (`lab_playbooks` gives built-ins in lab time), `canary` alpha's
canary probe (the roster's `canary:` keys: `interval_seconds`, at least 10, `max_tokens`),
`history` the TSDB's backfill (above). `ghost()` starts a stray llama-server on alpha's port,
outside its unit: the leftover of an earlier run that DESIGN.md's port guard is for;
`runaway()` a request that generates without end (`CRASH_LOOPING_UNIT` and `RUNAWAY_ARGS`
are what those scenarios start alpha with); `slow()` a SIGSTOP/SIGCONT duty cycle on alpha's
process (`Slowdown`), `complete()` one request of a user.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import http.client
import json
import math
import os
import re
import signal
import subprocess
import threading
import time
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, Protocol

import pytest
import yaml

from exporter.http import MetricsServer
from exporter.registry import ExporterSettings, FleetCollector, build_registry
from fleet.roster import load_roster
from tests.llama_lab import die_with_parent, free_port, http_get, wait_until
from tests.prometheus_lab import PrometheusServer
from tests.remediator_lab import drop_test_playbooks, write_setup
from tests.systemctl_stand_in import BIN, SystemctlStandIn, exec_start_value
from tests.test_remediator_process import Replica
from tests.test_wiring import (
    ALERTMANAGER_EXAMPLE,
    INSTALLED_TOKEN,
    PROMETHEUS_EXAMPLE,
    Alertmanager,
    rewrite,
)
from tests.zulip_stand_in import ZulipStandIn

REPO = Path(__file__).resolve().parent.parent
UNIT = "llama-server@alpha.service"
NODE = REPO / ".venv" / "bin" / "gpu-fleet-node"
# `for:` and `keep_firing_for:` alike: a rule's minute of bridging is a lab second too.
_FOR = re.compile(r"^(\s*(?:keep_firing_)?for:\s*)(\d+)([smh])\s*$", re.MULTILINE)
_RANGE = re.compile(r"\[(\d+)([mh])\]")
_RULE = re.compile(r"^(?=\s*- (?:alert|record):)", re.MULTILINE)
_INTERVAL = re.compile(r"^(\s*interval:\s*)(\d+)([smh])\s*$", re.MULTILINE)  # a group's
# A selector's braces may hold a playbook's `{host}` placeholders: one level of nesting.
_TOKENS = re.compile(
    r"(gpufleet_llama_slot_decoded_tokens(?:\{(?:[^{}]|\{[^{}]*\})*\})?\s*>\s*)(\d+)"
)
_SECONDS = {"s": 1, "m": 60, "h": 3600}
LAB_TOKENS = 8  # the runaway thresholds in tokens are divided by this (see the docstring)


def _lab_tokens(text: str) -> str:
    return _TOKENS.sub(lambda m: m[1] + str(int(m[2]) // LAB_TOKENS), text)


def _lab_rule(text: str) -> str:
    """One rule (or the text before the first) in lab time: its ranges, then its `for:`."""
    stretch = 1.0

    def lab_range(match: re.Match[str]) -> str:
        nonlocal stretch
        seconds = int(match[1]) * _SECONDS[match[2]]
        # A range holds at least three of the lab's 1 s scrapes (`[1m]` → `[3s]`, not `[1s]`,
        # which a scrape's jitter would leave empty now and then).
        lab = max(3, seconds // 60)
        stretch = max(stretch, lab / (seconds / 60))
        return f"[{lab}s]"

    text = _RANGE.sub(lab_range, text)
    # A range stretched by that floor stretches the rule's `for:` alike: `last_over_time(
    # ...[1m]) for: 2m` (LlamaServerDown) wants failures a minute apart for two minutes;
    # `[3s]` with `for: 2s` would fire on one failed scrape (a restart), `for: 6s` does not.
    return _FOR.sub(
        lambda m: f"{m[1]}{math.ceil(int(m[2]) * _SECONDS[m[3]] / 60 * stretch)}s", text
    )


def lab_rules(directory: Path) -> list[Path]:
    """The repository's rule files, rewritten for lab time (see the module docstring)."""
    directory.mkdir(parents=True, exist_ok=True)
    written = []
    for path in sorted((REPO / "rules").glob("*.rules.yml")):
        text = "".join(_lab_rule(part) for part in _RULE.split(path.read_text()))
        # A group's own interval (the speed's: once a minute) in lab time too: at `1m` its
        # ratio would move once a lab hour, and TokensPerSecondDegraded's `for:` of 15 s
        # would see one evaluation of it.
        text = _INTERVAL.sub(lambda m: f"{m[1]}{max(1, int(m[2]) * _SECONDS[m[3]] // 60)}s", text)
        target = directory / path.name
        target.write_text(_lab_tokens(text))
        written.append(target)
    return written


BUILTIN_PLAYBOOKS = REPO / "remediator" / "playbooks" / "builtin"
# A playbook's waits, which a run sits through in full (a cooldown, the drain's wait for busy
# slots, a restore's window of normal readings, the verification's re-check interval), and the
# floor of each in lab time (the power cap's restore action refuses less than 10 s).
_WAITS = {"cooldown_seconds": 1, "max_wait_seconds": 1, "restore_after_seconds": 10,
          "interval_seconds": 1}  # fmt: skip
_WAIT = re.compile(rf"\b({'|'.join(_WAITS)}):(\s*)(\d+)\b")
_NAME = re.compile(r"^name: .*$", re.MULTILINE)
LAB_SUFFIX = "-lab"


def lab_playbook_name(name: str) -> str:
    """The name of built-in `name`'s lab copy, in the journal and the reports: `<name>-lab`."""
    return f"{name}{LAB_SUFFIX}"


def lab_playbook(name: str) -> str:
    """Built-in playbook `name` in lab time, as `<name>-lab` (the text of its file).

    The one rule of every lab (tests/lab.py, tests/lab_hosts.py) and of bench/time_to_heal.py:
    each wait a run sits through in full is divided by 60, as the rules' `for:` are —
    `cooldown_seconds` (a flapping fault would wait 10 minutes between runs), the drain's
    `max_wait_seconds` (a runaway never ends, so its drain waits all of it), the power cap's
    `restore_after_seconds` (at least 10, the action's own minimum: 900 → 15) and the
    verification's `interval_seconds` (at least 1 s each otherwise). Deadlines stay the
    product's (`within_seconds`, `timeout_seconds`, an action's time limit): they end as soon
    as their condition holds, so a shorter one gains nothing when the fix works and, on a busy
    2-core machine, would read a slow restart or a slow cool-down as a failure. The breaker's
    count and window, the steps and the verification's queries stay the product's too, except
    the runaway thresholds in tokens, divided by 8 as the rule's are (the module docstring).

    playbooks_dir is matched before the built-ins (remediator/playbooks/loader.py), so the
    copy handles the alert; `lab_playbooks` gives the files for `Lab(playbooks=...)`.
    """
    text = (BUILTIN_PLAYBOOKS / f"{name}.yaml").read_text()
    text = _NAME.sub(f"name: {lab_playbook_name(name)}", text, count=1)
    text = _WAIT.sub(lambda m: f"{m[1]}:{m[2]}{max(_WAITS[m[1]], int(m[3]) // 60)}", text)
    return _lab_tokens(text)  # its verification uses the rule's thresholds


def lab_playbooks(*names: str) -> dict[str, str]:
    """The lab copies of built-ins `names`, as `Lab(playbooks=...)` takes them (file → text)."""
    return {f"{lab_playbook_name(name)}.yaml": lab_playbook(name) for name in names}


@dataclass(frozen=True)
class Neighbour:
    """Another model server on dioscuri, beside alpha, with its own port and unit.

    `argv` (with `{port}` for the free port the lab picks): its ExecStart=, started under the
    systemctl stand-in. Or `url` and `main_pid` of a server the test runs itself (a stand-in
    server in this process): its unit is only shown, active with that main process.
    """

    name: str
    argv: tuple[str, ...] = ()
    url: str = ""
    main_pid: int = 0

    @property
    def unit(self) -> str:
        """Its unit, `llama-server@NAME.service`."""
        return f"llama-server@{self.name}.service"


# systemd/llama-server@.service in lab time: Restart=on-failure; RestartSec=10 becomes 2 s (a
# crash loop the 1 s scrapes can see, not 0.17 s); StartLimitBurst=6 per hour becomes per minute.
CRASH_LOOPING_UNIT: Mapping[str, Any] = {
    "restart": "on-failure",
    "restart_sec": 2.0,
    "start_limit_interval_seconds": 60,
    "start_limit_burst": 6,
}
# A runaway needs room: the model's own 32768 tokens of context, not the lab's 256.
RUNAWAY_ARGS = ("-c", "32768")


class Runaway:
    """A request without a cap (n_predict -1) that never meets an end-of-sequence, in a thread.

    It runs until the context is full or the server goes. `cut` is how it ended without an
    answer (the restart that must end it), `answer` the status and start of an answer if one
    came. Started by `Lab.runaway()`.
    """

    def __init__(self, port: int) -> None:
        self.port = port
        self.cut: str | None = None
        self.answer: tuple[int, bytes] | None = None
        self.thread = threading.Thread(target=self._generate, name="runaway", daemon=True)
        self.thread.start()

    def _generate(self) -> None:
        body = {"prompt": "once upon a time", "n_predict": -1, "ignore_eos": True,
                "cache_prompt": False}  # fmt: skip
        connection = http.client.HTTPConnection("127.0.0.1", self.port, timeout=300)
        try:
            connection.request("POST", "/completion", json.dumps(body),
                               {"Content-Type": "application/json"})  # fmt: skip
            answer = connection.getresponse()
            self.answer = (answer.status, answer.read()[:200])
        except (OSError, http.client.HTTPException) as error:
            self.cut = repr(error)
        finally:
            connection.close()

    def join(self, timeout: float) -> None:
        """Until the request has ended (or `timeout`)."""
        self.thread.join(timeout)


class Slowdown:
    """A SIGSTOP/SIGCONT duty cycle on one process, in a thread: degraded throughput.

    llama-server's `timings` are wall-clock, so a generation stopped for 180 ms of every 200
    (`Lab.slow()`'s) reports about a tenth of its speed; /health still answers within the
    cycle (under the roster's 0.4 s timeout), so nothing but the speed looks wrong. It ends on
    `stop()`, or by itself once `main_pid()` names another process (or none): the restart
    replaced the slow one. The process is left running (SIGCONT) whichever way it ends.
    """

    def __init__(
        self, pid: int, running: float, period: float, main_pid: Callable[[], int | None]
    ) -> None:
        assert 0 < running < 1 and period > 0
        self.pid = pid
        self.cycles = 0
        self._running = running * period
        self._stopped = period - self._running
        self._main_pid = main_pid
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._cycle, name=f"slowdown-{pid}", daemon=True)
        self.thread.start()

    def _cycle(self) -> None:
        try:
            while not self._stop.is_set() and self._main_pid() == self.pid:
                os.kill(self.pid, signal.SIGSTOP)
                self._stop.wait(self._stopped)
                os.kill(self.pid, signal.SIGCONT)
                self.cycles += 1
                self._stop.wait(self._running)
        except ProcessLookupError:
            pass  # it exited: nothing left to slow
        finally:
            with contextlib.suppress(OSError):
                os.kill(self.pid, signal.SIGCONT)

    @property
    def active(self) -> bool:
        """The cycle still runs."""
        return self.thread.is_alive()

    def stop(self) -> None:
        """End the cycle; the process runs at full speed again."""
        self._stop.set()
        self.thread.join(timeout=10)


BASELINE_HOURS = 9  # of history before the rule's `offset 1h`: the rule wants at least 6


def tokens_per_second_history(
    tokens_per_second: float, *, labels: Mapping[str, str], now: float | None = None
) -> str:
    """OpenMetrics for `backfill`: a speed's hourly means over the `BASELINE_HOURS` before the
    last hour, so that the real baseline rule reads `tokens_per_second` as the 7-day baseline.

    `server_model:gpufleet_tokens_per_second:avg1h` (what the hourly rule records) once a
    minute with `labels` (the `current` series': host, server, role, model): the baseline's
    `count_over_time(...[7d:1h] offset 1h)` finds a sample within each hourly step's lookback,
    and `avg_over_time(...[7d] offset 1h)` averages them to the value.
    """
    end = (time.time() if now is None else now) - 3600 - 120  # behind the rule's offset 1h
    name = "server_model:gpufleet_tokens_per_second:avg1h"
    inside = ",".join(f'{key}="{value}"' for key, value in sorted(labels.items()))
    lines = [f"# TYPE {name} gauge"]
    for minute in range(BASELINE_HOURS * 60, -1, -1):
        lines.append(f"{name}{{{inside}}} {tokens_per_second!r} {end - minute * 60:.0f}")
    return "\n".join([*lines, "# EOF"]) + "\n"


def backfill(data: Path, openmetrics: str) -> None:
    """Write `openmetrics` into the TSDB at `data` (`promtool tsdb create-blocks-from
    openmetrics`), before the Prometheus using it starts: its blocks are loaded at start."""
    data.mkdir(parents=True, exist_ok=True)
    source = data.parent / "history.om"
    source.write_text(openmetrics)
    command = ["promtool", "tsdb", "create-blocks-from", "openmetrics", str(source), str(data)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stdout + done.stderr


def lab_alertmanager_config(
    webhooks: Sequence[str], token_file: Path, *, repeat_interval: str | None = None
) -> str:
    """`examples/alertmanager.yml` for the lab: its routes, `group_wait` and `group_interval`
    1 s, the webhook token from `token_file`, the remediator's receiver sending to every one of
    `webhooks` (the replicas), and, given, a shorter `repeat_interval` (so every alert arrives
    more than once)."""
    text = ALERTMANAGER_EXAMPLE.read_text()
    text = rewrite(text, f"credentials_file: {INSTALLED_TOKEN}", f"credentials_file: {token_file}")
    text = rewrite(text, "group_wait: 30s", "group_wait: 1s")
    text = rewrite(text, "group_interval: 5m", "group_interval: 1s")
    if repeat_interval is not None:
        text = rewrite(text, "repeat_interval: 4h", f"repeat_interval: {repeat_interval}")
    config = yaml.safe_load(text)
    receiver = next(r for r in config["receivers"] if r["name"] == "gpu-fleet-remediator")
    (hook,) = receiver["webhook_configs"]
    receiver["webhook_configs"] = [{**hook, "url": url} for url in webhooks]
    return yaml.safe_dump(config, sort_keys=False)


def alertmanager_cluster(count: int) -> list[list[str]]:
    """Each Alertmanager's `--cluster.*` flags: one alone (no gossip), or a pair gossiping on
    loopback, each the other's peer."""
    if count == 1:
        return [["--cluster.listen-address="]]
    gossip = [free_port() for _ in range(count)]
    return [
        [
            f"--cluster.listen-address=127.0.0.1:{port}",
            f"--cluster.advertise-address=127.0.0.1:{port}",
            *(f"--cluster.peer=127.0.0.1:{peer}" for peer in gossip if peer != port),
            "--cluster.peer-timeout=2s",  # lab time: 15 s in production
        ]
        for port in gossip
    ]


def _get(url: str, token: str | None = None) -> Any:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=10) as r:
        return json.loads(r.read())


def _healthy(url: str) -> bool:
    try:
        return http_get(url, "/health", timeout=1).status == 200
    except OSError:
        return False


class ExtraHosts(Protocol):
    """More lab hosts beside dioscuri (tests/lab_hosts.py: `LabHosts`)."""

    def roster_text(self) -> str:
        """Their sections, appended under the roster's `hosts:`."""
        ...

    def config_text(self) -> str:
        """Lines added to the remediator's config (its `ssh:` client)."""
        ...

    def start(self, roster: Path, env: Mapping[str, str]) -> None:
        """Start them (before Prometheus and the remediator)."""
        ...

    def targets(self) -> dict[str, str]:
        """Host name → its exporter's scrape target."""
        ...

    def close(self) -> None:
        """Stop them."""
        ...


class Lab:
    """One lab host (dioscuri, server alpha), Prometheus, Alertmanager, remediator, Zulip.

    `hosts` adds more hosts (their roster sections, exporters and sshds; tests/lab_hosts.py).
    `ha`: two Prometheus replicas (`a`, `b`: `examples/prometheus.yml`'s external label and
    alert relabelling) and an Alertmanager HA pair (gossip on loopback), each Prometheus sending
    to both Alertmanagers and each Alertmanager to the remediator; the pair resends a firing
    group every 2 s (`repeat_interval`), so every alert arrives more than once.
    `replicas`: that many `gpu-fleet-remediator serve` processes on one `journal_url`
    (PostgreSQL: tests/pg.py), each Alertmanager sending to every one of them.
    """

    def __init__(
        self,
        tmp_path: Path,
        llama_binary: Path,
        tiny_model: Path,
        monkeypatch: pytest.MonkeyPatch,
        *,
        litellm: str = "",
        hosts: ExtraHosts | None = None,
        ha: bool = False,
        replicas: int = 1,
        journal_url: str | None = None,
        unit: Mapping[str, Any] | None = None,
        llama_args: Sequence[str] = (),
        neighbours: Sequence[Neighbour] = (),
        playbooks: Mapping[str, str] | None = None,
        canary: Mapping[str, float] | None = None,
        history: Callable[[Lab], str] | None = None,
    ) -> None:
        """`litellm`: the roster lines of the server's LiteLLM deployment (drains block it);
        `unit`, `llama_args`, `neighbours`, `playbooks`, `canary`: see the module
        docstring. `history(lab)`, called once alpha is healthy and before the exporter and
        Prometheus start: OpenMetrics backfilled into Prometheus' TSDB (`# EOF` ended)."""
        self.tmp = tmp_path
        self.history = history
        self.slowdowns: list[Slowdown] = []
        self.hosts = hosts
        self.ha = ha
        assert replicas == 1 or journal_url is not None, "replicas share a PostgreSQL journal"
        self.stand_in = SystemctlStandIn(tmp_path)
        self.stand_in.activate(monkeypatch)  # the remediator's node finds the stand-in
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.argv = [
            str(llama_binary), "-m", str(tiny_model), "--host", "127.0.0.1", "--port",
            str(self.port), "-c", "256", "-np", "1", "-t", "1", "--metrics", *llama_args,
        ]  # fmt: skip
        self.ghosts: list[subprocess.Popen[bytes]] = []
        self.neighbours = list(neighbours)
        self.neighbour_urls: dict[str, str] = {}
        self.zulip = ZulipStandIn()
        remediator_port = free_port()
        zuliprc = self.zulip.write_zuliprc(tmp_path / "zuliprc")
        self.setup = write_setup(
            tmp_path,
            servers={"alpha": self.url},
            listen=f"127.0.0.1:{remediator_port}",
            journal_url=journal_url,
            extra=(
                f"node_command: [{NODE}]\n"
                f"zulip:\n  zuliprc: {zuliprc}\n  stream: agent-hub\n"
                "  topics: {gpu: alerts-gpu, inference: alerts-gpu, infra: alerts-infra}\n"
                + (hosts.config_text() if hosts is not None else "")
            ),
        )
        drop_test_playbooks(self.setup)  # the built-in playbooks handle the alerts
        for file_name, text in (playbooks or {}).items():
            (self.setup.playbooks / file_name).write_text(text)
        # A timeout well under the 1 s scrape: a frozen server costs its own series only.
        self.setup.roster.write_text(
            "hosts:\n  dioscuri:\n    address: 127.0.0.1\n    local: true\n    servers:\n"
            f"      alpha:\n        engine: llama\n        url: {self.url}\n        unit: {UNIT}\n"
            "        role: gpu-dense\n        model: tiny\n        timeout_seconds: 0.4\n"
            + (f"        canary: {json.dumps(dict(canary))}\n" if canary is not None else "")
            + litellm
            + self._neighbours_roster(llama_binary)
            + (hosts.roster_text() if hosts is not None else "")
        )
        options: dict[str, Any] = {"stop_timeout_seconds": 5, **(unit or {})}
        self.stand_in.declare_service(UNIT, self.argv, **options)
        self.replica = Replica(self.setup, remediator_port, tmp_path / "remediator.log")
        self.replicas = [self.replica]  # the first is `replica`; each its own config and port
        for number in range(2, replicas + 1):
            setup = dataclasses.replace(self.setup, config=tmp_path / f"remediator-{number}.yaml")
            log = tmp_path / f"remediator-{number}.log"
            self.replicas.append(Replica(setup, free_port(), log))
        self.timeline: list[tuple[float, str]] = []
        self._began = time.monotonic()
        self.exporter: MetricsServer | None = None
        self.fleet: FleetCollector | None = None
        self.prometheus: PrometheusServer | None = None
        self.alertmanager: Alertmanager | None = None
        self.alertmanagers: list[Alertmanager] = []  # the HA pair, or the one
        self.prometheus_b: PrometheusServer | None = None  # the HA lab's second replica

    def guard_argv(self) -> list[str]:
        """The port guard as alpha's ExecStartPre=, as systemd/llama-server@.service has it."""
        return [str(NODE), "guard-port", "alpha", "--config", str(self.setup.roster),
                "--host", "dioscuri"]  # fmt: skip

    def guard_env(self) -> dict[str, str]:
        """The guard's environment: the stand-in's systemctl first on its PATH."""
        return {
            "PATH": f"{BIN}{os.pathsep}/usr/sbin:/usr/bin:/sbin:/bin",
            "GPUFLEET_SYSTEMCTL_STATE": str(self.stand_in.state_path),
        }

    def _neighbours_roster(self, binary: Path) -> str:
        """The neighbours' roster lines; their units declared (or shown) in the stand-in."""
        lines = ""
        for neighbour in self.neighbours:
            url = neighbour.url
            if neighbour.argv:
                port = free_port()
                url = f"http://127.0.0.1:{port}"
                argv = [a.replace("{port}", str(port)) for a in neighbour.argv]
                self.stand_in.declare_service(neighbour.unit, argv, stop_timeout_seconds=5)
            else:
                self.stand_in.set_unit(
                    neighbour.unit, LoadState="loaded", ActiveState="active",
                    SubState="running", MainPID=neighbour.main_pid,
                    ExecStart=exec_start_value([str(binary)]),
                )  # fmt: skip
            self.neighbour_urls[neighbour.name] = url
            lines += (
                f"      {neighbour.name}:\n        engine: llama\n        url: {url}\n"
                f"        unit: {neighbour.unit}\n        role: gpu-light\n"
                "        model: tiny\n        timeout_seconds: 0.4\n"
            )
        return lines

    # -- life cycle ---------------------------------------------------------------------------

    def __enter__(self) -> Lab:
        try:
            self._start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(
        self, kind: type[BaseException] | None, value: BaseException | None,
        tb: TracebackType | None,
    ) -> None:  # fmt: skip
        if kind is not None and not issubclass(kind, KeyboardInterrupt):
            self._print_evidence()
        self.close()

    def _print_evidence(self) -> None:
        """A scenario failed: what each replica logged and journaled, into the test's output.

        CI shows only the output of a failed test; the lab's phases say where it stopped, this
        says why (a run ended `resolved` by a lagging Prometheus was found from these lines).
        """
        for number, replica in enumerate(self.replicas, start=1):
            print(f"--- remediator replica {number}: the end of {replica.log.name}", flush=True)
            with contextlib.suppress(OSError):
                print(replica.tail(), flush=True)
        for number, replica in enumerate(self.replicas, start=1):
            try:
                runs = replica.runs()
            except (OSError, ValueError) as exc:
                print(f"--- replica {number}'s runs could not be read: {exc}", flush=True)
                continue
            print(f"--- the journal's runs, read through replica {number}", flush=True)
            for run in runs:
                alertname = run.get("alert", {}).get("labels", {}).get("alertname")
                print(f"run {run.get('id')}: {alertname} {run.get('state')} "
                      f"{run.get('decision')} {run.get('outcome')}: {run.get('reason')}",
                      flush=True)  # fmt: skip
            break  # one journal: the first replica that answers shows every run

    def _start(self) -> None:
        subprocess.run(["systemctl", "start", UNIT], check=True, timeout=30)
        for neighbour in self.neighbours:
            if neighbour.argv:
                subprocess.run(["systemctl", "start", neighbour.unit], check=True, timeout=30)
        wait_until(lambda: _healthy(self.url), 60, interval=0.2, what="llama-server healthy")
        for name, url in self.neighbour_urls.items():
            wait_until(functools.partial(_healthy, url), 60, interval=0.2, what=f"{name} healthy")
        # Measured now, before the exporter's canary and the rest of the lab share the CPU.
        history = self.history(self) if self.history is not None else None
        if self.hosts is not None:
            self.hosts.start(self.setup.roster, self.stand_in.env())
        host = load_roster(self.setup.roster).hosts["dioscuri"]
        registry, self.fleet = build_registry(
            ExporterSettings(host=host, sysfs=str(self.tmp / "nosys"))
        )
        self.exporter = MetricsServer(registry, "127.0.0.1", 0)
        self.exporter.start()
        token = self.tmp / "alertmanager.token"
        token.write_text(self.setup.webhook_token + "\n")
        text = lab_alertmanager_config(
            [f"http://127.0.0.1:{r.port}/webhook/alertmanager" for r in self.replicas],
            token,
            repeat_interval="2s" if self.ha else None,
        )
        self._start_alertmanagers(text)
        targets = [f"127.0.0.1:{manager.port}" for manager in self.alertmanagers]
        alerting: dict[str, Any] = {"alertmanagers": [{"static_configs": [{"targets": targets}]}]}
        if self.ha:  # the example's: alerts drop `replica`, so both copies are one alert
            example = yaml.safe_load(PROMETHEUS_EXAMPLE.read_text())
            alerting["alert_relabel_configs"] = example["alerting"]["alert_relabel_configs"]
        # Each host its own `host` label, as the roster's file_sd gives it.
        exporters = {"dioscuri": f"127.0.0.1:{self.exporter.port}"}
        exporters.update(self.hosts.targets() if self.hosts is not None else {})
        static = [{"targets": [t], "labels": {"host": h}} for h, t in exporters.items()]
        scrape = [{"job_name": "lab", "static_configs": static}]
        self.prometheus = PrometheusServer(
            self.tmp / "prom", list(exporters.values()), labels={"host": "dioscuri"},
            rule_files=lab_rules(self.tmp / "rules"),
            extra={"alerting": alerting, "scrape_configs": scrape},
            external_labels={"replica": "a"} if self.ha else None,
        )  # fmt: skip
        if history is not None:
            backfill(self.prometheus.directory / "data", history)
        self.prometheus.start()
        if self.ha:
            self.prometheus_b = PrometheusServer(
                self.tmp / "prom-b", list(exporters.values()), labels={"host": "dioscuri"},
                rule_files=lab_rules(self.tmp / "rules-b"),
                extra={"alerting": alerting, "scrape_configs": scrape},
                external_labels={"replica": "b"},
            )  # fmt: skip
            if history is not None:
                backfill(self.prometheus_b.directory / "data", history)
            self.prometheus_b.start()
        self.prometheus.wait_for('gpufleet_llama_up{server="alpha"} == 1', timeout=30)
        config = self.setup.config.read_text().replace(
            "prometheus_url: http://127.0.0.1:9", f"prometheus_url: {self.prometheus.url}"
        )
        if len(self.replicas) > 1:  # one journal, a replica id each
            config += "replica_id: lab-1\n"
            for number, replica in enumerate(self.replicas[1:], start=2):
                replica.setup.config.write_text(config.replace(
                    f"listen: 127.0.0.1:{self.replica.port}\n",
                    f"listen: 127.0.0.1:{replica.port}\n",
                ).replace("replica_id: lab-1\n", f"replica_id: lab-{number}\n"))  # fmt: skip
        self.setup.config.write_text(config)
        for replica in self.replicas:
            replica.start()

    def _start_alertmanagers(self, text: str) -> None:
        """One Alertmanager, or (`ha`) a pair gossiping on loopback (each the other's peer)."""
        for index, cluster in enumerate(alertmanager_cluster(2 if self.ha else 1)):
            directory = self.tmp / ("am" if index == 0 else f"am{index + 1}")
            directory.mkdir()
            manager = Alertmanager(directory, text, cluster)
            self.alertmanagers.append(manager)
            manager.start()
        self.alertmanager = self.alertmanagers[0]

    def close(self) -> None:
        """Stop everything the lab started, whatever state it is in (each part apart: one that
        fails to stop must not leave the others, a detached llama-server above all, running)."""
        for slowdown in self.slowdowns:
            slowdown.stop()
        pid = self.stand_in.main_pid(UNIT)
        if pid:  # a frozen server must be able to stop
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGCONT)
        with contextlib.ExitStack() as stack:
            stack.callback(self.zulip.close)
            stack.callback(self.stand_in.stop_all)
            stack.callback(self._stop_ghosts)
            if self.hosts is not None:
                stack.callback(self.hosts.close)
            if self.fleet is not None:
                stack.callback(self.fleet.close)
            if self.exporter is not None:
                stack.callback(self.exporter.stop)
            for manager in self.alertmanagers:
                stack.callback(manager.stop)
            if self.prometheus is not None:
                stack.callback(self.prometheus.stop)
            if self.prometheus_b is not None:
                stack.callback(self.prometheus_b.stop)
            for replica in self.replicas:
                stack.callback(replica.stop)

    def phase(self, what: str) -> float:
        """Mark a phase of the scenario: kept in `timeline` and printed (`make lab` shows it)."""
        now = time.monotonic()
        self.timeline.append((now, what))
        print(f"lab +{now - self._began:6.1f} s  {what}", flush=True)
        return now

    # -- faults -------------------------------------------------------------------------------

    def server_pid(self) -> int:
        """The llama-server's main pid now."""
        pid = self.stand_in.main_pid(UNIT)
        assert pid is not None, "the unit has no main process"
        return pid

    def freeze(self) -> int:
        """SIGSTOP the server (a hang: /health times out); its pid."""
        pid = self.server_pid()
        os.kill(pid, signal.SIGSTOP)
        return pid

    def thaw(self, pid: int) -> None:
        """SIGCONT a frozen server: it answers again."""
        os.kill(pid, signal.SIGCONT)

    def slow(self, running: float = 0.1, period: float = 0.2) -> Slowdown:
        """Slow alpha's process down: stopped (SIGSTOP) for all but `running` of every
        `period` seconds, from a thread, until `Slowdown.stop()` or until the process is no
        longer the unit's (a restart ends the slowdown, as it ends a fault of the process)."""
        slowdown = Slowdown(self.server_pid(), running, period,
                            lambda: self.stand_in.main_pid(UNIT))  # fmt: skip
        self.slowdowns.append(slowdown)
        return slowdown

    def complete(self, n_predict: int = 8) -> dict[str, Any]:
        """One request of a user on alpha (a short completion); llama-server's answer."""
        body = json.dumps({"prompt": "hello", "n_predict": n_predict}).encode()
        request = urllib.request.Request(f"{self.url}/completion", body,
                                         {"Content-Type": "application/json"})  # fmt: skip
        with urllib.request.urlopen(request, timeout=60) as answer:
            result: dict[str, Any] = json.loads(answer.read())
        return result

    def runaway(self) -> Runaway:
        """Start a runaway request on alpha (started with `RUNAWAY_ARGS`); it generates on.

        Its server's threads get nice 10 first: a runaway takes a core flat out and this
        machine has two, and the lab's own parts (the exporter, Prometheus) must keep their
        1 s pace: a scrape past its 1 s timeout drops every series at once, and a firing alert
        resolves mid-run.
        """
        pid = self.server_pid()
        for task in Path(f"/proc/{pid}/task").iterdir():
            with contextlib.suppress(OSError):  # a thread that ended meanwhile
                os.setpriority(os.PRIO_PROCESS, int(task.name), 10)
        return Runaway(self.port)

    def ghost(self) -> subprocess.Popen[bytes]:
        """A stray llama-server on alpha's port, outside its unit (started by this process).

        What DESIGN.md's port guard is for: the unit's own program (the same binary), left
        over from an earlier run, in no unit. It dies with this process at the latest;
        `close()` kills it. Start it while alpha's port is free.
        """
        path = self.tmp / f"ghost-{len(self.ghosts)}.log"
        with path.open("wb") as log:
            process = subprocess.Popen(
                self.argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=die_with_parent,  # noqa: PLW1509 - one system call through libc
            )  # fmt: skip
        self.ghosts.append(process)
        wait_until(lambda: _healthy(self.url) or process.poll() is not None, 60, interval=0.1,
                   what="the ghost listening")  # fmt: skip
        assert process.poll() is None, path.read_text()
        return process

    def _stop_ghosts(self) -> None:
        for process in self.ghosts:
            if process.poll() is None:
                with contextlib.suppress(OSError):
                    os.killpg(process.pid, signal.SIGKILL)
                process.wait(timeout=10)

    def unit_state(self, unit: str = UNIT) -> dict[str, Any]:
        """The unit as the stand-in records it (ActiveState, NRestarts, Result, ...)."""
        return dict(self.stand_in.units.get(unit, {}))

    def admin(self, method: str, path: str, body: Any = None) -> Any:
        """The remediator's admin API."""
        return self.replica.request(method, path, body, admin=True)

    # -- what happened ------------------------------------------------------------------------

    def alerts(self, name: str, state: str = "firing") -> list[dict[str, Any]]:
        """Prometheus' ALERTS of that name and state."""
        assert self.prometheus is not None
        return self.prometheus.query(f'ALERTS{{alertname="{name}",alertstate="{state}"}}')

    def wait_firing(self, name: str, timeout: float = 60) -> None:
        """Until Prometheus fires `name`."""
        wait_until(lambda: bool(self.alerts(name)), timeout, interval=0.1,
                   what=f"{name} firing in Prometheus")  # fmt: skip
        self.phase(f"{name} fires in Prometheus")

    def runs(self) -> list[dict[str, Any]]:
        """The remediator's runs, newest first."""
        return self.replica.runs()

    def wait_run_done(self, timeout: float = 120) -> dict[str, Any]:
        """The first run, once it is done."""
        wait_until(lambda: bool(self.runs()) and self.runs()[-1]["state"] == "done", timeout,
                   interval=0.3, what="the run to end")  # fmt: skip
        run: dict[str, Any] = self.runs()[-1]
        return run

    def reports(self) -> list[str]:
        """What reached Zulip, oldest first."""
        return [message.content for message in self.zulip.stream_messages()]

    def healthy(self) -> bool:
        """The server answers /health 200 now."""
        return _healthy(self.url)

    def wait(self, condition: Any, what: str, timeout: float = 60) -> None:
        """Until `condition()` holds."""
        wait_until(condition, timeout, interval=0.3, what=what)

    @staticmethod
    def sleep(seconds: float) -> None:
        """Let the lab's clocks move (a scrape, an evaluation)."""
        time.sleep(seconds)
