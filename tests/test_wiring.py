"""`examples/prometheus.yml` and `examples/alertmanager.yml`: the checkers, and a real Alertmanager.

- `promtool check config` checks that every rule file and every credentials/CA file it names
  exists, so it runs on a copy in tmp with the install paths rewritten: the rule files to this
  repository's `rules/`, the file_sd file to one the real `gpu-fleet-remediator roster file-sd`
  wrote, and (in the TLS variant, the commented block uncommented) the CA and password files to
  temporary files. Each rewrite must hit exactly once, so a moved path in the example fails here.
- `amtool check-config` on the file as it is.
- A real Alertmanager (Debian's `prometheus-alertmanager`) runs the example config with two
  changes, both needed for a test that takes seconds instead of minutes: the webhook URL and
  token file point at a receiver in this test, and `group_wait`/`group_interval` are 1 s (the
  resolved notification comes on a group interval). Through its API v2 we post alerts and check
  what the receiver gets: version-4 bodies that the remediator's own parser accepts, the bearer
  token, the inhibitions (exporter down silences its host; a lost GPU its GPU and the servers
  of that card, and those of no known card), a resolved notification, and `max_alerts`
  keeping a worst-case body under the remediator's 1 MiB limit.
Missing binaries fail the tests, never skip them.
"""

from __future__ import annotations

import fnmatch
import http.server
import json
import re
import shutil
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import IO, Any
from urllib.parse import quote_plus, urlsplit

import pytest
import yaml

from remediator.alerts import Notification, parse_notification
from remediator.config import DEFAULT_LISTEN
from remediator.webhook import MAX_BODY_BYTES
from remediator.webhook import PATH as WEBHOOK_PATH
from tests.llama_lab import die_with_parent, free_port, log_tail, stop_process

REPO = Path(__file__).resolve().parent.parent
PROMETHEUS_EXAMPLE = REPO / "examples" / "prometheus.yml"
ALERTMANAGER_EXAMPLE = REPO / "examples" / "alertmanager.yml"
FLEET_EXAMPLE = REPO / "examples" / "fleet.yaml"
RULES_DIR = REPO / "rules"
ALERT_RULES = RULES_DIR / "gpu-fleet-alerts.rules.yml"
RECORDING_RULES = RULES_DIR / "gpu-fleet-recording.rules.yml"
INSTALLED_RULES_GLOB = "/etc/prometheus/rules/gpu-fleet-*.rules.yml"
INSTALLED_TARGETS = "/etc/prometheus/gpu-fleet-targets.json"
INSTALLED_TOKEN = "/etc/alertmanager/gpu-fleet.token"
REMEDIATOR = str(Path(sys.executable).parent / "gpu-fleet-remediator")

# Issue 6's alerts; the inhibition rules name them, so a rename must show up here.
ALERT_NAMES = {
    "LlamaServerDown",
    "LlamaServerStuck",
    "LlamaServerSaturated",
    "LlamaServerRunawayGeneration",
    "LlamaServerCrashLooping",
    "LlamaServerLoadingTooLong",
    "LlamaServerMetricsMissing",
    "LlamaServerModelLoadFailed",
    "PortGhost",
    "GpuLost",
    "GpuTemperatureCritical",
    "ApuTemperatureCritical",
    "GpuThermalThrottling",
    "GpuMemoryNearlyFull",
    "GpuComputeModeDrift",
    "TokensPerSecondDegraded",
    "GpuFleetExporterDown",
    "GpuFleetRemediatorDown",
    "GpuFleetRemediatorDegraded",
}
# Issue 19: the pipeline's own health (Prometheus, Alertmanager, the dead man's switch) and the
# exporter's scrapes and collectors. The inhibition by a dead exporter leaves them out.
PIPELINE_ALERTS = {
    "Watchdog",
    "PrometheusRuleEvaluationFailures",
    "PrometheusConfigReloadFailed",
    "PrometheusNotificationsFailing",
    "AlertmanagerNotificationsFailing",
    "AlertmanagerConfigReloadFailed",
    "AlertmanagerDown",
    "GpuFleetExporterScrapeSlow",
    "GpuFleetExporterTargetsMissing",
    "GpuFleetCollectorFailing",
}
ALERT_NAMES |= PIPELINE_ALERTS
# ...and the hardware faults, warning tiers, capacity, vLLM and the canary: per host, so a dead
# exporter silences them too (its negative matcher covers them without naming them).
ALERT_NAMES |= {
    "GpuXidErrors",
    "GpuEccErrors",
    "GpuRowRemapping",
    "GpuRetiredPagesPending",
    "GpuPcieLinkDegraded",
    "GpuPcieReplays",
    "GpuHardwareSlowdown",
    "GpuFanStopped",
    "GpuTemperatureHigh",
    "ApuTemperatureHigh",
    "GpuGttNearlyFull",
    "HostMemoryNearlyFull",
    "ServerGpuMemoryGrowing",
    "VllmServerDown",
    "VllmServerSaturated",
    "TokensPerSecondCanaryStale",
}
SELF_ALERTS = {
    "GpuFleetExporterDown",
    "GpuFleetRemediatorDown",
    "GpuFleetRemediatorDegraded",
} | PIPELINE_ALERTS
LLAMA_ALERTS = {name for name in ALERT_NAMES if name.startswith("LlamaServer")}
# The model servers' alerts, which carry the roster's `gpu` of the server (issue 19): a lost
# GPU silences those of its card.
SERVER_ALERTS = LLAMA_ALERTS | {"VllmServerDown", "VllmServerSaturated", "TokensPerSecondDegraded"}
GPU_READING_ALERTS = {
    "GpuTemperatureCritical",
    "GpuTemperatureHigh",
    "GpuThermalThrottling",
    "GpuHardwareSlowdown",
    "GpuFanStopped",
    "GpuMemoryNearlyFull",
    "GpuGttNearlyFull",
    "GpuComputeModeDrift",
}


def tool(name: str, package: str) -> str:
    binary = shutil.which(name)
    if binary is None:
        pytest.fail(
            f"`{name}` is missing: `make test` installs Debian's {package} package", pytrace=False
        )
    return binary


def rewrite(text: str, old: str, new: str) -> str:
    assert text.count(old) == 1, f"expected {old!r} exactly once in the example"
    return text.replace(old, new)


def load_yaml(path: Path) -> Any:
    return yaml.safe_load(path.read_text())


def alert_rules() -> list[dict[str, Any]]:
    if not ALERT_RULES.exists():
        pytest.fail(f"{ALERT_RULES.relative_to(REPO)} is missing", pytrace=False)
    return [
        rule
        for group in load_yaml(ALERT_RULES)["groups"]
        for rule in group["rules"]
        if "alert" in rule
    ]


# -- promtool check config ---------------------------------------------------------------------


def file_sd_targets(tmp_path: Path) -> Path:
    """What the install step writes: the example roster through `roster file-sd`."""
    result = subprocess.run(
        [REMEDIATOR, "roster", "file-sd", "--roster", str(FLEET_EXAMPLE)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    path = tmp_path / "gpu-fleet-targets.json"
    path.write_text(result.stdout)
    return path


def promtool_check(config: Path) -> str:
    result = subprocess.run(
        [tool("promtool", "prometheus"), "check", "config", str(config)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    # promtool only warns about a missing file_sd file; for us that is a broken install path.
    assert "WARNING" not in output, output
    return output


def prometheus_copy(tmp_path: Path, text: str) -> Path:
    # The settings, not the install notes in the comments, which name the same paths.
    rules = RULES_DIR / "gpu-fleet-*.rules.yml"
    text = rewrite(text, f"  - {INSTALLED_RULES_GLOB}\n", f"  - {rules}\n")
    targets = file_sd_targets(tmp_path)
    text = rewrite(text, f"files: [{INSTALLED_TARGETS}]", f"files: [{targets}]")
    path = tmp_path / "prometheus.yml"
    path.write_text(text)
    return path


def test_prometheus_example_passes_promtool(tmp_path: Path) -> None:
    output = promtool_check(prometheus_copy(tmp_path, PROMETHEUS_EXAMPLE.read_text()))
    # Both rule files were found by the glob and checked.
    for rules in (RECORDING_RULES, ALERT_RULES):
        assert re.search(rf"{re.escape(str(rules))}\n\s*SUCCESS: \d+ rules found", output), output


def test_prometheus_example_with_tls_and_basic_auth_uncommented_passes_promtool(
    tmp_path: Path,
) -> None:
    # The commented TLS/basic-auth block must be valid once uncommented.
    lines = PROMETHEUS_EXAMPLE.read_text().splitlines()
    start = lines.index("    # scheme: https")
    end = next(i for i in range(start, len(lines)) if "password_file:" in lines[i])
    block = [re.sub(r"^    # ", "    ", line) for line in lines[start : end + 1]]
    text = "\n".join([*lines[:start], *block, *lines[end + 1 :]]) + "\n"
    ca, password = tmp_path / "ca.crt", tmp_path / "exporter.password"
    ca.write_text("not checked by promtool, only opened\n")
    password.write_text("example-scrape-password\n")
    text = rewrite(text, "ca_file: /etc/prometheus/gpu-fleet-ca.crt", f"ca_file: {ca}")
    text = rewrite(
        text,
        "password_file: /etc/prometheus/gpu-fleet-exporter.password",
        f"password_file: {password}",
    )
    config = prometheus_copy(tmp_path, text)
    promtool_check(config)
    job = next(
        job
        for job in load_yaml(config)["scrape_configs"]
        if job["job_name"] == "gpu-fleet-exporter"
    )
    assert job["scheme"] == "https" and job["basic_auth"]["username"] == "prometheus"


def test_prometheus_example_wires_our_jobs_rules_and_alertmanager() -> None:
    config = load_yaml(PROMETHEUS_EXAMPLE)
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    assert set(jobs) == {"gpu-fleet-exporter", "gpu-fleet-remediator", "prometheus", "alertmanager"}
    # The pipeline rules read Prometheus' and Alertmanager's own metrics, on their usual ports.
    assert jobs["prometheus"]["static_configs"][0]["targets"] == ["127.0.0.1:9090"]
    assert jobs["alertmanager"]["static_configs"][0]["targets"] == ["127.0.0.1:9093"]
    assert jobs["gpu-fleet-exporter"]["file_sd_configs"][0]["files"] == [INSTALLED_TARGETS]
    assert jobs["gpu-fleet-remediator"]["static_configs"][0]["targets"] == [DEFAULT_LISTEN]
    (pattern,) = config["rule_files"]
    # The glob takes both of our files under their installed names, and nothing else of ours.
    ours = sorted(path.name for path in RULES_DIR.glob("*.yml") if path.name.endswith(".rules.yml"))
    assert ours == [ALERT_RULES.name, RECORDING_RULES.name]
    assert all(fnmatch.fnmatch(name, Path(pattern).name) for name in ours)
    assert config["alerting"]["alertmanagers"][0]["static_configs"][0]["targets"] == [
        "127.0.0.1:9093"
    ]


def test_file_sd_targets_carry_the_host_label(tmp_path: Path) -> None:
    groups = json.loads(file_sd_targets(tmp_path).read_text())
    roster = load_yaml(FLEET_EXAMPLE)["hosts"]
    assert {group["labels"]["host"] for group in groups} == set(roster)
    for group in groups:
        assert group["targets"] == [f"{roster[group['labels']['host']]['address']}:9445"]


# -- amtool check-config and the routing --------------------------------------------------------


def test_alertmanager_example_passes_amtool() -> None:
    result = subprocess.run(
        [tool("amtool", "prometheus-alertmanager"), "check-config", str(ALERTMANAGER_EXAMPLE)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


def test_alertmanager_example_sends_everything_to_the_remediator() -> None:
    config = load_yaml(ALERTMANAGER_EXAMPLE)
    receiver, people, switch = config["receivers"]
    assert config["route"]["receiver"] == receiver["name"]
    # Only the pipeline's own alerts take another way: to people, not (only) to the remediator;
    # the Watchdog to the dead man's switch alone.
    watchdog, route, *pipeline = config["route"]["routes"]
    assert watchdog["matchers"] == ['alertname="Watchdog"']
    assert watchdog["receiver"] == "deadmans-switch" == switch["name"]
    assert "continue" not in watchdog
    assert route == {"matchers": ['alertname=~"GpuFleetRemediator.*"'], "receiver": "people"}
    assert people["name"] == "people" and people["webhook_configs"][0]["send_resolved"]
    assert [(r["receiver"], r.get("continue", False)) for r in pipeline] == [
        ("people", True),
        ("gpu-fleet-remediator", False),
    ]
    assert pipeline[0]["matchers"] == pipeline[1]["matchers"]
    (webhook,) = receiver["webhook_configs"]
    url = urlsplit(webhook["url"])
    assert url.path == WEBHOOK_PATH and url.netloc == DEFAULT_LISTEN
    assert webhook["send_resolved"] is True
    assert webhook["http_config"]["authorization"] == {
        "type": "Bearer",
        "credentials_file": INSTALLED_TOKEN,
    }
    assert 0 < webhook["max_alerts"] <= 100
    assert config["route"]["group_by"] == ["alertname", "host", "server", "gpu"]


def matching(regex: str, names: set[str]) -> set[str]:
    # Alertmanager anchors its regex matchers: ^(?:regex)$.
    return {name for name in names if re.fullmatch(f"(?:{regex})", name)}


def inhibition_targets(source: str, equal: list[str], *, also: tuple[str, ...] = ()) -> set[str]:
    """The alerts the inhibitions by `source` with this `equal` silence; `also`: the target
    matchers besides the alertname one (`gpu=""` and the like), exactly."""
    config = load_yaml(ALERTMANAGER_EXAMPLE)
    targets: set[str] = set()
    for rule in config["inhibit_rules"]:
        if rule["source_matchers"][0] == f'alertname="{source}"' and rule["equal"] == equal:
            matcher, *others = rule["target_matchers"]
            if tuple(others) != also:
                continue
            match = re.fullmatch(r'alertname(=~|!~)"(.*)"', matcher)
            assert match, matcher
            matched = matching(match[2], ALERT_NAMES)
            targets |= matched if match[1] == "=~" else ALERT_NAMES - matched
    return targets


def test_only_a_dead_exporter_inhibits_its_host() -> None:
    # A flapping exporter still delivers readings: what they show must reach people.
    (rule,) = [
        rule
        for rule in load_yaml(ALERTMANAGER_EXAMPLE)["inhibit_rules"]
        if rule["source_matchers"][0] == 'alertname="GpuFleetExporterDown"'
    ]
    assert rule["source_matchers"] == ['alertname="GpuFleetExporterDown"', 'cause="down"']
    causes = {
        rule["labels"].get("cause")
        for rule in alert_rules()
        if rule["alert"] == "GpuFleetExporterDown"
    }
    assert causes == {"down", "flapping"}


def test_the_rules_define_exactly_the_alerts_the_inhibitions_name() -> None:
    assert {rule["alert"] for rule in alert_rules()} == ALERT_NAMES


def test_inhibitions_cover_what_they_explain() -> None:
    # Exporter down: every alert of its host but the two about our own components.
    assert inhibition_targets("GpuFleetExporterDown", ["host"]) == ALERT_NAMES - SELF_ALERTS
    assert inhibition_targets("GpuLost", ["host", "gpu"]) == GPU_READING_ALERTS
    # A lost GPU: the servers of that card (the alerts that carry it), and those of no known
    # card host-wide; never by host alone a server that names its card.
    assert inhibition_targets("GpuLost", ["host", "gpu"], also=('gpu=~".+"',)) == SERVER_ALERTS
    assert inhibition_targets("GpuLost", ["host"], also=('gpu=""',)) == SERVER_ALERTS
    assert not inhibition_targets("GpuLost", ["host"])


def test_the_server_alerts_carry_the_card_their_inhibition_matches() -> None:
    # Every rule of the alerts GpuLost silences per card joins `gpu` from the servers' info.
    for rule in alert_rules():
        if rule["alert"] in SERVER_ALERTS:
            assert "group_left (gpu)" in rule["expr"], rule["alert"]
            assert "server:gpufleet_server_gpu:info" in rule["expr"], rule["alert"]


# -- a real Alertmanager -----------------------------------------------------------------------


@dataclass(frozen=True)
class Received:
    path: str
    authorization: str | None
    body: bytes
    notification: Notification


class Receiver:
    """The remediator's place: records every POST, answers 200."""

    def __init__(self) -> None:
        self.received: list[Received] = []
        self.errors: list[str] = []
        self._lock = threading.Lock()
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                try:
                    notification = parse_notification(body)  # the remediator's own validation
                except ValueError as error:
                    with outer._lock:
                        outer.errors.append(f"{error}: {body[:500]!r}")
                else:
                    item = Received(
                        self.path, self.headers.get("Authorization"), body, notification
                    )
                    with outer._lock:
                        outer.received.append(item)
                self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}{WEBHOOK_PATH}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def snapshot(self) -> list[Received]:
        with self._lock:
            assert not self.errors, self.errors
            return list(self.received)

    def for_host(self, host: str) -> list[Received]:
        return [r for r in self.snapshot() if r.notification.groupLabels.get("host") == host]


class Alertmanager:
    """Debian's Alertmanager on a free port, running a config from `text`."""

    def __init__(
        self, tmp_path: Path, text: str, cluster: Sequence[str] = ("--cluster.listen-address=",)
    ) -> None:
        """`cluster`: its `--cluster.*` flags (default: no gossip port, a single instance)."""
        self.directory = tmp_path
        self.cluster = list(cluster)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.config = tmp_path / "alertmanager.yml"
        self.config.write_text(text)
        self.log_path = tmp_path / "alertmanager.log"
        self._log: IO[bytes] | None = None
        self._process: subprocess.Popen[bytes] | None = None
        self.people: Receiver | None = None  # the example's `people` receiver, when rewritten
        self.switch: Receiver | None = None  # its `deadmans-switch` receiver, likewise

    def start(self) -> None:
        self._log = self.log_path.open("wb")
        self._process = subprocess.Popen(
            [
                tool("prometheus-alertmanager", "prometheus-alertmanager"),
                f"--config.file={self.config}",
                f"--storage.path={self.directory / 'data'}",
                f"--web.listen-address=127.0.0.1:{self.port}",
                *self.cluster,
            ],
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            # Safe here: one system call through a libc loaded before the fork.
            preexec_fn=die_with_parent,  # noqa: PLW1509
        )
        deadline = time.monotonic() + 30
        while True:
            if self._process.poll() is not None:
                raise AssertionError(f"alertmanager exited\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(f"{self.url}/-/ready", timeout=1) as response:
                    if response.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            if time.monotonic() > deadline:
                raise AssertionError(f"alertmanager not ready in 30 s\n{self.log_tail()}")
            time.sleep(0.05)

    def stop(self) -> None:
        if self._process is not None:
            stop_process(self._process, 10)
        if self._log is not None:
            self._log.close()

    def log_tail(self) -> str:
        return log_tail(self.log_path, 30)

    def post(self, alerts: list[dict[str, Any]]) -> None:
        request = urllib.request.Request(
            f"{self.url}/api/v2/alerts",
            data=json.dumps(alerts).encode(),
            headers={"Content-Type": "application/json"},
            method="POST",
        )
        with urllib.request.urlopen(request, timeout=10) as response:
            assert response.status == 200

    def alerts(self) -> list[dict[str, Any]]:
        with urllib.request.urlopen(f"{self.url}/api/v2/alerts", timeout=10) as response:
            result: list[dict[str, Any]] = json.load(response)
            return result


TOKEN = "test-webhook-token-6f1c2a"  # a test secret, written to a tmp file
FAST = 1.0  # group_wait and group_interval of the test copy, seconds


@pytest.fixture(scope="module")
def alerting(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Alertmanager, Receiver]]:
    tmp_path = tmp_path_factory.mktemp("alertmanager")
    receiver = Receiver()
    token = tmp_path / "webhook.token"
    token.write_text(TOKEN + "\n")  # Alertmanager strips the trailing newline, as we do
    text = ALERTMANAGER_EXAMPLE.read_text()
    text = rewrite(text, f"url: http://{DEFAULT_LISTEN}{WEBHOOK_PATH}", f"url: {receiver.url}")
    text = rewrite(text, f"credentials_file: {INSTALLED_TOKEN}", f"credentials_file: {token}")
    text = rewrite(text, "group_wait: 30s", f"group_wait: {FAST:g}s")
    text = rewrite(text, "group_interval: 5m", f"group_interval: {FAST:g}s")
    people = Receiver()
    text = rewrite(text, "url: http://127.0.0.1:9097/people", f"url: {people.url}")
    switch = Receiver()
    text = rewrite(text, "url: http://127.0.0.1:9098/deadmans-switch", f"url: {switch.url}")
    manager = Alertmanager(tmp_path, text)
    manager.people = people
    manager.switch = switch
    try:
        manager.start()
        yield manager, receiver
    finally:
        manager.stop()
        receiver.close()
        people.close()
        switch.close()


def alert(name: str, *, ends_in: float = 3600, **labels: str) -> dict[str, Any]:
    now = datetime.now(UTC)
    return {
        "labels": {"alertname": name, "severity": "critical", **labels},
        "annotations": {"summary": f"{name} on {labels.get('host')}"},
        "startsAt": (now - timedelta(seconds=5)).isoformat(),
        "endsAt": (now + timedelta(seconds=ends_in)).isoformat(),
        "generatorURL": "http://prometheus.example:9090/graph?g0.expr=up&g0.tab=1",
    }


def delivered_names(receiver: Receiver, hosts: set[str]) -> set[tuple[str, str, str]]:
    return {
        (a.labels["alertname"], a.labels["host"], a.labels.get("server", a.labels.get("gpu", "")))
        for r in receiver.snapshot()
        for a in r.notification.alerts
        if a.labels.get("host") in hosts and a.status == "firing"
    }


def wait_for(predicate: Any, what: str, manager: Alertmanager, timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}\n{manager.log_tail()}")
        time.sleep(0.1)


def test_alerts_reach_the_webhook_with_the_token_and_inhibitions_apply(
    alerting: tuple[Alertmanager, Receiver],
) -> None:
    manager, receiver = alerting
    hosts = {"inh-h1", "inh-h2", "inh-h3"}
    # The inhibiting alerts go first, and the rest only once those have been delivered.
    # Alertmanager feeds its inhibitor from the alert store asynchronously, and it flushes a
    # new group at once when the alert's startsAt is older than group_wait (Prometheus sends
    # startsAt as when the alert went pending, so that is the usual case): a source and its
    # target posted together race, and a loaded CI machine once let all three targets out
    # uninhibited (prometheus/alertmanager#2229). The inhibitions hold for a cause that fired
    # before its consequences, which is what this test proves.
    sources = [
        # h1: its exporter is down; the server alert it explains must stay silent.
        alert("GpuFleetExporterDown", host="inh-h1", category="infra", cause="down"),
        # h3: GPU 0 lost: its own readings and the host's servers are silenced, GPU 1's
        # readings and the port ghost (evidence) are not.
        alert("GpuLost", host="inh-h3", gpu="0", category="gpu"),
    ]
    manager.post(sources)
    wait_for(
        lambda: (
            delivered_names(receiver, hosts)
            >= {("GpuFleetExporterDown", "inh-h1", ""), ("GpuLost", "inh-h3", "0")}
        ),
        "the inhibiting alerts",
        manager,
    )
    manager.post(
        [
            alert("LlamaServerDown", host="inh-h1", server="alpha", category="inference"),
            # h2: a server down on its own: delivered.
            alert("LlamaServerDown", host="inh-h2", server="beta", category="inference"),
            alert("GpuTemperatureCritical", host="inh-h3", gpu="0", sensor="edge", category="gpu"),
            alert("GpuTemperatureCritical", host="inh-h3", gpu="1", sensor="edge", category="gpu"),
            alert("LlamaServerStuck", host="inh-h3", server="gamma", category="inference"),
            alert("PortGhost", host="inh-h3", server="gamma", port="31003", category="inference"),
        ]
    )
    expected = {
        ("GpuFleetExporterDown", "inh-h1", ""),
        ("LlamaServerDown", "inh-h2", "beta"),
        ("GpuLost", "inh-h3", "0"),
        ("GpuTemperatureCritical", "inh-h3", "1"),
        ("PortGhost", "inh-h3", "gamma"),
    }
    wait_for(lambda: delivered_names(receiver, hosts) >= expected, "the deliveries", manager)
    # Every group was flushed at the same group_wait; give a straggler two more intervals.
    time.sleep(2 * FAST)
    assert delivered_names(receiver, hosts) == expected

    # Alertmanager's own view: the silenced three are suppressed by inhibition.
    suppressed = {
        (a["labels"]["alertname"], a["labels"]["host"])
        for a in manager.alerts()
        if a["labels"].get("host") in hosts and a["status"]["inhibitedBy"]
    }
    assert suppressed == {
        ("LlamaServerDown", "inh-h1"),
        ("GpuTemperatureCritical", "inh-h3"),
        ("LlamaServerStuck", "inh-h3"),
    }

    for item in receiver.snapshot():
        if item.notification.groupLabels.get("host") not in hosts:
            continue
        assert item.path == WEBHOOK_PATH
        assert item.authorization == f"Bearer {TOKEN}"
        assert item.notification.version == "4"
        assert item.notification.receiver == "gpu-fleet-remediator"
        assert len(item.body) <= MAX_BODY_BYTES


def test_a_lost_gpu_silences_the_servers_of_its_card_only(
    alerting: tuple[Alertmanager, Receiver],
) -> None:
    # A 2-GPU host: GPU 0 is lost. The server on GPU 0 is down because of it (silenced); the
    # one on GPU 1 is down on its own (delivered: on an 8-GPU host, seven cards' servers would
    # otherwise go unheard); a server with no known card (the roster gives it no `gpu`) is
    # silenced host-wide, as examples/alertmanager.yml documents. On another host, a GpuLost
    # that names no card (`cause="missing"`) silences the servers of no known card only.
    manager, receiver = alerting
    hosts = {"card-h1", "card-h2"}
    # Sources first, targets once they are delivered: see the race in the test above.
    manager.post(
        [
            alert("GpuLost", host="card-h1", gpu="0", category="gpu", cause="down"),
            alert("GpuLost", host="card-h2", vendor="nvidia", category="gpu", cause="missing"),
        ]
    )
    wait_for(
        lambda: (
            {(n, h) for n, h, _ in delivered_names(receiver, hosts)}
            >= {("GpuLost", "card-h1"), ("GpuLost", "card-h2")}
        ),
        "the lost GPUs",
        manager,
    )
    down = "LlamaServerDown"
    manager.post(
        [
            alert(down, host="card-h1", server="on0", gpu="0", category="inference"),
            alert(down, host="card-h1", server="on1", gpu="1", category="inference"),
            alert(down, host="card-h1", server="cpu", category="inference"),
            alert("VllmServerDown", host="card-h1", server="v0", gpu="0", category="inference"),
            alert("TokensPerSecondDegraded", host="card-h1", server="t1", gpu="1",
                  category="inference", severity="warning"),
            alert(down, host="card-h2", server="on0", gpu="0", category="inference"),
            alert(down, host="card-h2", server="cpu", category="inference"),
        ]
    )  # fmt: skip
    expected = {
        ("GpuLost", "card-h1", "0"),
        ("GpuLost", "card-h2", ""),
        (down, "card-h1", "on1"),
        ("TokensPerSecondDegraded", "card-h1", "t1"),
        (down, "card-h2", "on0"),
    }
    wait_for(lambda: delivered_names(receiver, hosts) >= expected, "the deliveries", manager)
    time.sleep(2 * FAST)  # a straggler that should not come
    assert delivered_names(receiver, hosts) == expected
    suppressed = {
        (a["labels"]["alertname"], a["labels"]["host"], a["labels"]["server"])
        for a in manager.alerts()
        if a["labels"].get("host") in hosts and a["status"]["inhibitedBy"]
    }
    assert suppressed == {
        (down, "card-h1", "on0"),
        (down, "card-h1", "cpu"),
        ("VllmServerDown", "card-h1", "v0"),
        (down, "card-h2", "cpu"),
    }


def test_the_pipelines_own_alerts_reach_people_not_the_remediator(
    alerting: tuple[Alertmanager, Receiver],
) -> None:
    manager, receiver = alerting
    assert manager.people is not None
    people = manager.people
    manager.post([
        alert("GpuFleetRemediatorDegraded", instance="127.0.0.9:9095", cause="loop_dead",
              category="infra"),
        alert("LlamaServerDown", host="route-h1", server="alpha", category="inference"),
    ])  # fmt: skip

    def names(where: Receiver) -> set[str]:
        return {a.labels["alertname"] for r in where.snapshot() for a in r.notification.alerts
                if a.labels.get("instance") == "127.0.0.9:9095"
                or a.labels.get("host") == "route-h1"}  # fmt: skip

    wait_for(lambda: names(people) and names(receiver), "both deliveries", manager)
    time.sleep(2 * FAST)
    assert names(people) == {"GpuFleetRemediatorDegraded"}
    assert names(receiver) == {"LlamaServerDown"}


def test_the_watchdog_reaches_the_switch_and_pipeline_alerts_people_and_the_remediator(
    alerting: tuple[Alertmanager, Receiver],
) -> None:
    manager, receiver = alerting
    assert manager.people is not None and manager.switch is not None
    people, switch = manager.people, manager.switch
    manager.post([
        alert("Watchdog", severity="none", category="infra"),
        alert("PrometheusNotificationsFailing", instance="127.0.0.8:9090", cause="dropped",
              category="infra"),
        alert("GpuFleetCollectorFailing", host="route-h2", collector="nvidia", category="infra"),
    ])  # fmt: skip

    def names(where: Receiver) -> set[str]:
        return {a.labels["alertname"] for r in where.snapshot() for a in r.notification.alerts
                if a.labels["alertname"] == "Watchdog"
                or a.labels.get("instance") == "127.0.0.8:9090"
                or a.labels.get("host") == "route-h2"}  # fmt: skip

    pipeline = {"PrometheusNotificationsFailing", "GpuFleetCollectorFailing"}
    wait_for(
        lambda: names(switch) and names(people) >= pipeline and names(receiver) >= pipeline,
        "the deliveries",
        manager,
    )
    time.sleep(2 * FAST)
    assert names(switch) == {"Watchdog"}
    assert names(people) == pipeline
    assert names(receiver) == pipeline


def test_a_flapping_exporter_does_not_silence_its_host(
    alerting: tuple[Alertmanager, Receiver],
) -> None:
    # The readings that do arrive from a host scraped half the time still count: a lost GPU
    # there reaches the remediator beside the flapping alert (people get the flapping one too).
    manager, receiver = alerting
    assert manager.people is not None
    people = manager.people
    manager.post([
        alert("GpuFleetExporterDown", host="flap-h1", category="infra", cause="flapping"),
    ])  # fmt: skip
    wait_for(
        lambda: ("GpuFleetExporterDown", "flap-h1", "") in delivered_names(receiver, {"flap-h1"}),
        "the flapping alert",
        manager,
    )
    manager.post([alert("GpuLost", host="flap-h1", gpu="0", category="gpu", cause="down")])
    wait_for(
        lambda: ("GpuLost", "flap-h1", "0") in delivered_names(receiver, {"flap-h1"}),
        "the lost GPU, not inhibited",
        manager,
    )
    assert not [
        a
        for a in manager.alerts()
        if a["labels"].get("host") == "flap-h1" and a["status"]["inhibitedBy"]
    ]
    wait_for(
        lambda: (
            "GpuFleetExporterDown"
            in {
                a.labels["alertname"]
                for r in people.snapshot()
                for a in r.notification.alerts
                if a.labels.get("host") == "flap-h1"
            }
        ),
        "the flapping alert at people's",
        manager,
    )


def metric_names_of(url: str) -> set[str]:
    """The series names a real /metrics page exposes (samples, and families declared empty)."""
    with urllib.request.urlopen(url, timeout=10) as response:
        text = response.read().decode()
    names = set(re.findall(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{| )", text, flags=re.MULTILINE))
    names |= set(re.findall(r"^# TYPE (\w+) ", text, flags=re.MULTILINE))
    return names


def test_the_pipeline_rules_read_series_prometheus_and_alertmanager_export(
    alerting: tuple[Alertmanager, Receiver], tmp_path: Path
) -> None:
    # A misspelt prometheus_*/alertmanager_* name is no error to Prometheus: the alert just never
    # fires. Read both real servers' own /metrics (a Prometheus with our rules, sending to the
    # example's Alertmanager) for every such name the rules use.
    from tests.prometheus_lab import PrometheusServer

    manager, _ = alerting
    used = {
        name
        for rule in alert_rules()
        for name in re.findall(r"\b((?:prometheus|alertmanager)_\w+)", rule["expr"])
    }
    assert len(used) >= 7, used
    alerting_config = {
        "alerting": {
            "alertmanagers": [{"static_configs": [{"targets": [f"127.0.0.1:{manager.port}"]}]}]
        }
    }
    with PrometheusServer(
        tmp_path, [], "1s", rule_files=[RECORDING_RULES, ALERT_RULES], extra=alerting_config
    ) as prometheus:
        deadline = time.monotonic() + 20
        while True:
            exposed = metric_names_of(f"{prometheus.url}/metrics") | metric_names_of(
                f"{manager.url}/metrics"
            )
            missing = used - exposed
            if not missing or time.monotonic() > deadline:
                break
            time.sleep(0.5)  # the Alertmanager is discovered a moment after the start
    assert not missing, sorted(missing)


def test_a_resolved_alert_is_sent_too(alerting: tuple[Alertmanager, Receiver]) -> None:
    manager, receiver = alerting
    firing = alert("LlamaServerDown", host="res-h1", server="alpha", category="inference")
    manager.post([firing])
    wait_for(lambda: receiver.for_host("res-h1"), "the firing notification", manager)
    manager.post([{**firing, "endsAt": datetime.now(UTC).isoformat()}])
    wait_for(
        lambda: any(r.notification.status == "resolved" for r in receiver.for_host("res-h1")),
        "the resolved notification",
        manager,
    )


def worst_case_alert(rules: list[dict[str, Any]], index: int) -> dict[str, Any]:
    """An alert as large as ours can get, shaped by the real rules.

    Labels: every label our series and rules use, roster names at their 63-character limit and
    a model name at its 200. Annotations: the longest template of each kind, plus 512
    characters for what the templates insert (label values, `$value`). generatorURL:
    Prometheus' `/graph?g0.expr=<the longest expression, URL-encoded>&g0.tab=1`.
    """
    name63 = "n" * 63
    annotations: dict[str, str] = {}
    for rule in rules:
        for key, template in rule.get("annotations", {}).items():
            annotations[key] = max(annotations.get(key, ""), template + "x" * 512, key=len)
    longest_expr = max((str(rule["expr"]) for rule in rules), key=len)
    labels = {
        "alertname": max((str(rule["alert"]) for rule in rules), key=len),
        "severity": "critical",
        "category": "inference",
        "host": "max-h1",
        "server": name63,
        "gpu": "15",
        "sensor": f"junction{index}",
        "chip": name63,
        "role": name63,
        "model": "m" * 200,
        "instance": f"{'i' * 63}:9445",
        "job": "gpu-fleet-exporter",
        "unit": f"llama-server@{name63}.service",
        "port": "65535",
        "slot": "15",
        "phase": "generation",
        "reason": "hw_thermal_slowdown",
        "mode": "exclusive_process",
        "pool": "vis_vram",
    }
    now = datetime.now(UTC)
    return {
        "labels": labels,
        "annotations": annotations,
        "startsAt": (now - timedelta(seconds=5)).isoformat(),
        "endsAt": (now + timedelta(hours=1)).isoformat(),
        "generatorURL": "http://prometheus.example.org:9090/graph?g0.expr="
        + quote_plus(longest_expr)
        + "&g0.tab=1",
    }


def test_max_alerts_keeps_a_fleet_wide_outage_under_the_body_limit(
    alerting: tuple[Alertmanager, Receiver],
) -> None:
    manager, receiver = alerting
    webhook = load_yaml(ALERTMANAGER_EXAMPLE)["receivers"][0]["webhook_configs"][0]
    max_alerts = int(webhook["max_alerts"])
    rules = alert_rules()
    # More alerts than max_alerts in one group (they differ only in `sensor`).
    manager.post([worst_case_alert(rules, index) for index in range(max_alerts + 5)])
    # The dispatcher may flush the group before it has taken in all of them (the first
    # notification can hold only a few); the next group interval sends the full group.
    wait_for(
        lambda: any(r.notification.truncatedAlerts for r in receiver.for_host("max-h1")),
        "a notification cut at max_alerts",
        manager,
    )
    sent = receiver.for_host("max-h1")
    assert all(len(r.notification.alerts) <= max_alerts for r in sent)
    full = [r for r in sent if r.notification.truncatedAlerts]
    assert [(len(r.notification.alerts), r.notification.truncatedAlerts) for r in full] == [
        (max_alerts, 5)
    ]
    # The comment in alertmanager.yml promises under half of the remediator's limit.
    assert len(full[0].body) <= MAX_BODY_BYTES // 2, len(full[0].body)


def test_an_ha_prometheus_pair_makes_one_run_per_problem(tmp_path: Path) -> None:
    """Two real Prometheus servers (the example's HA relabelling), the real Alertmanager and a
    real remediator: the same problem, evaluated twice, is one alert and one run."""
    from tests.prometheus_lab import MetricsEndpoint, PrometheusServer
    from tests.remediator_lab import CountingServer, write_setup
    from tests.test_firing_check import RULES as HA_RULES  # LlamaServerDown on lab_fault
    from tests.test_remediator_process import Replica

    example = load_yaml(PROMETHEUS_EXAMPLE)
    relabel = example["alerting"]["alert_relabel_configs"]
    assert example["global"]["external_labels"] == {"replica": "a"}
    model = CountingServer()
    rules = tmp_path / "rules.yml"
    rules.write_text(HA_RULES)
    port = free_port()
    setup = write_setup(tmp_path, servers={"alpha": model.url}, listen=f"127.0.0.1:{port}")
    text = ALERTMANAGER_EXAMPLE.read_text()
    text = rewrite(text, f"url: http://{DEFAULT_LISTEN}{WEBHOOK_PATH}",
                   f"url: http://127.0.0.1:{port}{WEBHOOK_PATH}")  # fmt: skip
    token = tmp_path / "alertmanager.token"
    token.write_text(setup.webhook_token + "\n")
    text = rewrite(text, f"credentials_file: {INSTALLED_TOKEN}", f"credentials_file: {token}")
    text = rewrite(text, "group_wait: 30s", f"group_wait: {FAST:g}s")
    text = rewrite(text, "group_interval: 5m", f"group_interval: {FAST:g}s")
    (tmp_path / "am").mkdir()
    manager = Alertmanager(tmp_path / "am", text)
    replica: Replica | None = None
    servers: list[PrometheusServer] = []
    try:
        manager.start()
        alerting = {"alert_relabel_configs": relabel, "alertmanagers": [
            {"static_configs": [{"targets": [f"127.0.0.1:{manager.port}"]}]}]}  # fmt: skip
        with MetricsEndpoint('lab_fault{server="alpha"} 1\n') as endpoint:
            for name in ("a", "b"):
                servers.append(PrometheusServer(
                    tmp_path / name, [endpoint.target], labels={"host": "dioscuri"},
                    rule_files=[rules], extra={"alerting": alerting},
                    external_labels={"replica": name},
                ).start())  # fmt: skip
            config = setup.config.read_text().replace(
                "prometheus_url: http://127.0.0.1:9", f"prometheus_url: {servers[0].url}"
            )
            setup.config.write_text(config)
            replica = Replica(setup, port, tmp_path / "remediator.log").start()
            for server in servers:  # both evaluate the problem, both send it
                server.wait_for('ALERTS{alertname="LlamaServerDown",alertstate="firing"}')
            wait_for(lambda: bool(replica and replica.runs()), "a run", manager, timeout=60)
            assert [a["labels"].get("replica") for a in manager.alerts()] == [None]
            time.sleep(3 * FAST)  # more group intervals: resends from both servers
            wait_for(lambda: bool(replica and replica.runs()[0]["state"] == "done"),
                     "the run to end", manager, timeout=60)  # fmt: skip
            runs = replica.runs()
            assert len(runs) == 1, [(r["alert"]["labels"], r["decision"]) for r in runs]
            assert runs[0]["outcome"] == "healed"
            assert model.count("/restart") == 1
    finally:
        if replica is not None:
            replica.stop()
        for server in servers:
            server.stop()
        manager.stop()
        model.close()
