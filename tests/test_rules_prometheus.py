"""The rules in a real Prometheus, scraping the real exporter over a fixture sysfs tree.

The whole production path but the hardware: the roster names the host and its exporter port;
the real `gpu-fleet-remediator roster file-sd` turns it into the file_sd targets (with their
`host` label); Debian's Prometheus scrapes them as job `gpu-fleet-exporter` and evaluates
`rules/gpu-fleet-*.rules.yml` (the glob of examples/prometheus.yml); the exporter,
`gpu-fleet-exporter` as a subprocess, reads a sysfs tree (tests/sysfs_tree.py) with a discrete
AMD card, a Strix Halo-like APU and its k10temp chip. What is hot:

- card 0 (gpu 0) `junction` at 108 °C against amdgpu's temp2_crit 110: over the 5 °C margin;
  its `edge` at 94 °C against 100, one degree short of the margin, must stay quiet;
- k10temp `Tctl` at 92 °C against the roster's `thermal` critical 95; `Tccd1` stays cool;
- the APU's own GPU (gpu 1) reports `edge` without any crit file: no critical, no alert.

The rules are loaded unmodified except for what issue 6 allows: every `for:` becomes 2 s and the
evaluation interval 1 s (a group's own `interval:` too), so the alerts fire in seconds.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.llama_lab import free_port, stop_process
from tests.prometheus_lab import PrometheusServer
from tests.sysfs_tree import apu_spec, discrete_spec, set_value, write_amd_card, write_k10temp

REPO = Path(__file__).resolve().parent.parent
RULE_FILES = sorted((REPO / "rules").glob("gpu-fleet-*.rules.yml"))
BIN = Path(sys.executable).parent
HOST = "strix"
JOB = "gpu-fleet-exporter"
SHORT_FOR = "2s"
EVALUATION = "1s"


def shortened_rules(tmp_path: Path) -> list[Path]:
    """The rule files with `for:` and group intervals shortened, nothing else changed."""
    names = [path.name for path in RULE_FILES]
    assert names == ["gpu-fleet-alerts.rules.yml", "gpu-fleet-recording.rules.yml"], names
    out = []
    for path in RULE_FILES:
        document = yaml.safe_load(path.read_text())
        for group in document["groups"]:
            if "interval" in group:
                group["interval"] = EVALUATION
            for rule in group["rules"]:
                if "for" in rule:
                    rule["for"] = SHORT_FOR
        copy = tmp_path / path.name
        copy.write_text(yaml.safe_dump(document, sort_keys=False, allow_unicode=True))
        out.append(copy)
    return out


class RulesPrometheus(PrometheusServer):
    """The lab's Prometheus with our rule files and a file_sd job instead of its static one."""

    def __init__(self, tmp_path: Path, *, rule_files: list[Path], file_sd: Path) -> None:
        # No static targets: start() then returns once Prometheus is ready, and the test
        # waits for the file_sd target itself.
        super().__init__(tmp_path, [], scrape_interval=EVALUATION, job=JOB, rule_files=rule_files)
        self.file_sd = file_sd

    def _config(self) -> dict[str, Any]:
        config = super()._config()
        config["scrape_configs"] = [
            {"job_name": JOB, "file_sd_configs": [{"files": [str(self.file_sd)]}]}
        ]
        return config

    def api(self, path: str) -> Any:
        with urllib.request.urlopen(f"{self.url}{path}", timeout=5) as response:
            answer = json.load(response)
        assert answer["status"] == "success", answer
        return answer["data"]


def write_fixture(tmp_path: Path, exporter_port: int) -> tuple[Path, Path]:
    """The sysfs tree and the roster; returns (sysfs, roster)."""
    sysfs = tmp_path / "sys"
    card = write_amd_card(sysfs, discrete_spec(card=0))  # 0000:03:00.0: gpu 0
    write_amd_card(sysfs, apu_spec(card=1))  # 0000:c5:00.0: gpu 1
    k10temp = write_k10temp(sysfs)
    # temp1 edge (crit 100), temp2 junction (crit 110), temp3 mem (crit 100): DISCRETE_TEMPS.
    set_value(card.hwmon_file("temp1_input"), 94_000)
    set_value(card.hwmon_file("temp2_input"), 108_000)
    set_value(k10temp / "temp1_input", 92_000)  # Tctl; Tccd1 (temp2) stays at 58 °C
    roster = tmp_path / "fleet.yaml"
    roster.write_text(
        f"hosts:\n"
        f"  {HOST}:\n"
        f"    address: 127.0.0.1\n"
        f"    exporter_port: {exporter_port}\n"
        f"    gpus:\n"
        f"      amd: {{count: 2}}\n"
        f"    thermal:\n"
        f"      k10temp/Tctl: {{critical_celsius: 95}}\n"
    )
    return sysfs, roster


def file_sd(tmp_path: Path, roster: Path) -> Path:
    result = subprocess.run(
        [str(BIN / "gpu-fleet-remediator"), "roster", "file-sd", "--roster", str(roster)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    path = tmp_path / "targets.json"
    path.write_text(result.stdout)
    return path


@pytest.fixture(scope="module")
def prometheus(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RulesPrometheus]:
    tmp_path = tmp_path_factory.mktemp("rules-prometheus")
    port = free_port()
    sysfs, roster = write_fixture(tmp_path, port)
    exporter_log = (tmp_path / "exporter.log").open("wb")
    exporter = subprocess.Popen(
        [
            str(BIN / "gpu-fleet-exporter"),
            "--config",
            str(roster),
            "--host",
            HOST,
            "--sysfs",
            str(sysfs),
            "--web.listen-address",
            f"127.0.0.1:{port}",
        ],
        stdin=subprocess.DEVNULL,
        stdout=exporter_log,
        stderr=subprocess.STDOUT,
    )
    server = RulesPrometheus(
        tmp_path, rule_files=shortened_rules(tmp_path), file_sd=file_sd(tmp_path, roster)
    )
    try:
        server.start()
        # The first scrape of a discovered target lands within ~6 s (Prometheus' 5 s
        # target-update tick); `up == 1` also proves the exporter answered.
        server.wait_for(f'up{{job="{JOB}",host="{HOST}"}} == 1', timeout=30)
        yield server
    finally:
        server.stop()
        stop_process(exporter, 10)
        exporter_log.close()


def all_rules(prometheus: RulesPrometheus) -> list[dict[str, Any]]:
    groups = prometheus.api("/api/v1/rules")["groups"]
    return [rule for group in groups for rule in group["rules"]]


def test_every_rule_loads_and_evaluates_without_error(prometheus: RulesPrometheus) -> None:
    expected = sum(
        len(group["rules"])
        for path in RULE_FILES
        for group in yaml.safe_load(path.read_text())["groups"]
    )
    deadline = time.monotonic() + 20
    # "unknown" until a rule's first evaluation.
    while any(rule["health"] == "unknown" for rule in all_rules(prometheus)):
        assert time.monotonic() < deadline, prometheus.log_tail()
        time.sleep(0.2)
    rules = all_rules(prometheus)
    assert len(rules) == expected, prometheus.log_tail()
    broken = [
        (rule["name"], rule["health"], rule.get("lastError"))
        for rule in rules
        if rule["health"] != "ok" or rule.get("lastError")
    ]
    assert not broken, broken


def firing(prometheus: RulesPrometheus, name: str) -> list[dict[str, str]]:
    return [
        alert["labels"]
        for alert in prometheus.api("/api/v1/alerts")["alerts"]
        if alert["labels"]["alertname"] == name and alert["state"] == "firing"
    ]


def wait_firing(prometheus: RulesPrometheus, name: str) -> list[dict[str, str]]:
    deadline = time.monotonic() + 30
    while not (labels := firing(prometheus, name)):
        assert time.monotonic() < deadline, f"{name} never fired\n{prometheus.log_tail()}"
        time.sleep(0.2)
    return labels


def test_gpu_temperature_critical_fires_for_the_hot_sensor_only(
    prometheus: RulesPrometheus,
) -> None:
    fired = wait_firing(prometheus, "GpuTemperatureCritical")
    assert [(a["host"], a["gpu"], a["sensor"]) for a in fired] == [(HOST, "0", "junction")]
    (labels,) = fired
    assert labels["severity"] == "critical" and labels["category"] == "gpu"
    # The cool sensors (edge one degree short of the margin, mem, the APU's edge without a
    # critical value) have had the same time to fire: nothing of them, pending or firing.
    others = [
        alert
        for alert in prometheus.api("/api/v1/alerts")["alerts"]
        if alert["labels"]["alertname"] == "GpuTemperatureCritical"
    ]
    assert [a["labels"]["sensor"] for a in others] == ["junction"], others


def test_apu_temperature_critical_fires_for_tctl(prometheus: RulesPrometheus) -> None:
    fired = wait_firing(prometheus, "ApuTemperatureCritical")
    assert [(a["host"], a["chip"], a["sensor"]) for a in fired] == [(HOST, "k10temp", "Tctl")]
    (labels,) = fired
    assert labels["severity"] == "critical" and labels["category"] == "gpu"
    # The critical value is the roster's (95), not the built-in default (90).
    (critical,) = prometheus.query(
        f'gpufleet_host_temperature_critical_celsius{{host="{HOST}",sensor="Tctl"}}'
    )
    assert float(critical["value"][1]) == 95.0


def test_the_description_names_host_value_and_critical(prometheus: RulesPrometheus) -> None:
    wait_firing(prometheus, "GpuTemperatureCritical")
    (alert,) = [
        a
        for a in prometheus.api("/api/v1/alerts")["alerts"]
        if a["labels"]["alertname"] == "GpuTemperatureCritical" and a["state"] == "firing"
    ]
    # The annotation templates (with their `query` lookups) render against live data.
    description = alert["annotations"]["description"]
    assert HOST in description and "108.0" in description and "110.0" in description, description
