"""`gpu-fleet-remediator status` as a person runs it: a real Prometheus, a real journal.

Prometheus (Debian's binary, `tests/prometheus_lab.py`) scrapes, as job `gpu-fleet-exporter` with
`host="dioscuri"` (as the roster's file_sd labels it), the exporter's own golden exposition of two
NVIDIA GPUs (`tests/golden/nvidia_two_gpus.prom`) and the llama-server series of two servers,
one of them asleep, plus a server the roster does not have whose labels are hostile (terminal
escapes). The journal is filled through the CLI, as people and Alertmanager fill it: a replayed
alert whose run does not heal (its breaker opens, a cooldown starts), a host in maintenance,
the pause, and a run that waits for it.
"""

from __future__ import annotations

import json
import os
import pty
import select
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.prometheus_lab import MetricsEndpoint, PrometheusServer
from tests.remediator_lab import ALERTMANAGER_FIXTURES, CountingServer, Setup, write_setup

REMEDIATOR = str(Path(sys.executable).parent / "gpu-fleet-remediator")
GOLDEN_GPUS = Path(__file__).parent / "golden" / "nvidia_two_gpus.prom"
HOSTILE = "\x1b[2J\x1b]0;owned\x07<script>alert(1)</script>"

TINY = 'role="gpu-dense",model="tiny"'
LLAMA = f"""\
# TYPE gpufleet_llama_info gauge
gpufleet_llama_info{{server="alpha",role="gpu-dense",model="tiny",alias="tiny",build="b1"}} 1
gpufleet_llama_info{{server="beta",role="gpu-dense",model="tiny",alias="tiny",build="b1"}} 1
gpufleet_llama_info{{server="stray",role="x",model="{HOSTILE}",alias="",build=""}} 1
# TYPE gpufleet_llama_up gauge
gpufleet_llama_up{{server="alpha"}} 1
gpufleet_llama_up{{server="beta"}} 1
gpufleet_llama_up{{server="stray"}} 0
# TYPE gpufleet_llama_health gauge
gpufleet_llama_health{{server="alpha",state="ok"}} 1
gpufleet_llama_health{{server="alpha",state="loading"}} 0
gpufleet_llama_health{{server="beta",state="ok"}} 1
gpufleet_llama_health{{server="stray",state="ok"}} 0
gpufleet_llama_health{{server="stray",state="unreachable"}} 1
gpufleet_llama_health{{server="omni",state="ok"}} 1
# TYPE gpufleet_llama_model_state gauge
gpufleet_llama_model_state{{server="omni",served_model="qwen",state="loaded"}} 1
gpufleet_llama_model_state{{server="omni",served_model="qwen",state="unloaded"}} 0
gpufleet_llama_model_state{{server="omni",served_model="gemma",state="sleeping"}} 1
# TYPE gpufleet_llama_sleeping gauge
gpufleet_llama_sleeping{{server="alpha"}} 0
gpufleet_llama_sleeping{{server="beta"}} 1
# TYPE gpufleet_llama_slots gauge
gpufleet_llama_slots{{server="alpha",state="busy"}} 1
gpufleet_llama_slots{{server="alpha",state="idle"}} 1
# TYPE gpufleet_llama_context_tokens gauge
gpufleet_llama_context_tokens{{server="alpha"}} 32768
gpufleet_llama_context_tokens{{server="beta"}} 8192
# TYPE gpufleet_llama_requests_deferred gauge
gpufleet_llama_requests_deferred{{server="alpha"}} 2
# TYPE gpufleet_port_ghost gauge
gpufleet_port_ghost{{server="alpha",port="31001"}} 0
gpufleet_port_ghost{{server="beta",port="31002"}} 1
# TYPE gpufleet_unit_active gauge
gpufleet_unit_active{{server="alpha",unit="llama-server@alpha.service"}} 1
# TYPE server_model:gpufleet_tokens_per_second:current gauge
server_model:gpufleet_tokens_per_second:current{{server="alpha",{TINY}}} 41.5
# TYPE server_model:gpufleet_tokens_per_second:baseline_7d gauge
server_model:gpufleet_tokens_per_second:baseline_7d{{server="alpha",{TINY}}} 52.25
server_model:gpufleet_tokens_per_second:current{{server="omni",served_model="qwen"}} 12.5
server_model:gpufleet_tokens_per_second:baseline_7d{{server="omni",served_model="qwen"}} 30
server_model:gpufleet_tokens_per_second:current{{server="omni",served_model="gemma"}} 88
server_model:gpufleet_tokens_per_second:baseline_7d{{server="omni",served_model="gemma"}} 90
"""


def exposition() -> str:
    """The golden GPU exposition (the exporter's own output) and the servers' series."""
    return GOLDEN_GPUS.read_text() + LLAMA


def run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([REMEDIATOR, *args], capture_output=True, text=True, timeout=60,
                          check=False, env=env)  # fmt: skip


@dataclass
class Lab:
    """The set-up the tests share: config, Prometheus, the model servers."""

    setup: Setup
    prometheus: PrometheusServer
    config: list[str]


def fill_journal(setup: Setup) -> None:
    """Runs, a breaker, a cooldown, maintenance, the pause and a waiting run, via the CLI."""
    config = ["--config", str(setup.config)]
    firing = ALERTMANAGER_FIXTURES / "firing.json"
    replayed = run("replay", str(firing), *config, "--live")  # verification fails: not healed
    assert replayed.returncode == 0, replayed.stderr
    assert "not_healed" in replayed.stdout, replayed.stdout
    on = run("maintenance", "theia", "on", *config, "--reason", "swap fans")
    assert on.returncode == 0, on.stderr
    assert run("pause", *config, "--reason", "deploy").returncode == 0
    beta = json.loads(firing.read_text())
    beta["alerts"][0]["labels"]["server"] = "beta"
    beta["alerts"][0]["fingerprint"] = "00000000000000be"
    payload = setup.config.parent / "beta.json"
    payload.write_text(json.dumps(beta))
    waiting = run("replay", str(payload), *config, "--live")
    assert waiting.returncode == 0, waiting.stderr


@pytest.fixture(scope="module")
def lab(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Lab]:
    tmp_path = tmp_path_factory.mktemp("status")
    alpha, beta = CountingServer(), CountingServer()
    alpha.verify_status = 500
    with (
        MetricsEndpoint(exposition()) as endpoint,
        PrometheusServer(tmp_path, [endpoint.target], job="gpu-fleet-exporter",
                         labels={"host": "dioscuri"}) as prometheus,
    ):  # fmt: skip
        try:
            setup = write_setup(tmp_path, servers={"alpha": alpha.url, "beta": beta.url},
                                prometheus_url=prometheus.url, max_failures=1)  # fmt: skip
            fill_journal(setup)
            yield Lab(setup, prometheus, ["--config", str(setup.config)])
        finally:
            alpha.close()
            beta.close()


def test_the_table_fits_100_columns_and_shows_both_sides(lab: Lab) -> None:
    result = run("status", *lab.config)
    assert result.returncode == 0, result.stderr
    text = result.stdout
    lines = text.splitlines()
    assert max(len(line) for line in lines) <= 100, max(lines, key=len)
    assert "\x1b" not in text  # not a terminal: no colour, and no escape from a label either
    assert "\x07" not in text
    assert "Prometheus " + lab.prometheus.url + ": ok" in text
    # GPUs: the golden exposition's values, against their limits.
    gpu0 = next(line for line in lines if line.startswith("  0 "))
    assert "NVIDIA H200" in gpu0 and "yes" in gpu0
    assert "61/95 memory" in gpu0  # the sensor nearest its critical value (gpu: 54/92)
    assert "115.0/140.4" in gpu0 and "412/650" in gpu0
    alpha = next(line for line in lines if line.startswith("  alpha "))
    assert alpha.split()[1:4] == ["gpu-dense", "tiny", "ok"]
    assert "32768" in alpha and "1/2" in alpha and "41.5/52.2" in alpha
    assert alpha.split()[6] == "2"  # deferred
    beta = next(line for line in lines if line.startswith("  beta "))
    assert "sleeping" in beta and beta.rstrip().endswith("yes")  # a ghost on its port
    stray = next(line for line in lines if line.startswith("  stray! "))
    assert "unreachable" in stray
    omni = next(line for line in lines if line.startswith("  omni! "))
    assert "router 1/2" in omni  # a router: loaded of listed models
    # Its speeds by model, each against its own baseline, under its row (none on the row).
    assert "12.5/30.0" not in omni and "88.0/90.0" not in omni
    below = lines[lines.index(omni) + 1 : lines.index(omni) + 3]
    assert "· gemma" in below[0] and "sleeping" in below[0] and "88.0/90.0" in below[0], below
    assert "· qwen" in below[1] and "loaded" in below[1] and "12.5/30.0" in below[1], below
    # The remediator's side.
    assert "remediation PAUSED by cli:" in text and ": deploy" in text
    assert "breaker OPEN server/dioscuri/alpha" in text
    assert "cooldown server/dioscuri/alpha until" in text
    assert "last run #1 " in text and "LlamaServerDown → probe-llama: not_healed" in text
    theia = text[text.index("\ntheia") + 1 :]
    assert "exporter not scraped" in theia.splitlines()[0]
    assert "MAINTENANCE since" in theia and "by cli:" in theia and "swap fans" in theia
    assert "waiting run #2 server/dioscuri/beta" in text and "paused" in text
    assert "outbox: 0 unsent, 0 failed" in text


def test_json_carries_the_fields_and_unknown_is_null(lab: Lab) -> None:
    result = run("status", *lab.config, "--json")
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert data["prometheus_error"] is None and data["journal_error"] is None
    assert data["pause"]["paused"] is True and data["pause"]["reason"] == "deploy"
    assert data["pause"]["by"].startswith("cli:")
    hosts = {h["host"]: h for h in data["hosts"]}
    assert set(hosts) == {"dioscuri", "theia"}
    dioscuri = hosts["dioscuri"]
    assert dioscuri["exporter_up"] is True
    gpus = {g["gpu"]: g for g in dioscuri["gpus"]}
    assert gpus["0"]["temperature_celsius"] == 61 and gpus["0"]["critical_celsius"] == 95
    assert gpus["0"]["vram_used_bytes"] == 1.2348030976e11
    assert gpus["1"]["power_watts"] == 98 and gpus["1"]["power_cap_watts"] == 700
    servers = {s["server"]: s for s in dioscuri["servers"]}
    assert servers["alpha"]["slots_busy"] == 1 and servers["alpha"]["slots_total"] == 2
    assert servers["alpha"]["tokens_per_second"] == 41.5
    assert servers["alpha"]["baseline_tokens_per_second"] == 52.25
    assert servers["beta"]["state"] == "sleeping" and servers["beta"]["ghost"] is True
    # Not known is null, never 0: beta's slots are not exported while it sleeps.
    assert servers["beta"]["slots_busy"] is None and servers["beta"]["deferred"] is None
    assert servers["stray"]["in_roster"] is False and servers["stray"]["model"] == HOSTILE
    assert servers["omni"]["state"] == "router"
    assert servers["omni"]["router_models"] == {"gemma": "sleeping", "qwen": "loaded"}
    assert servers["omni"]["model_speeds"] == {
        "gemma": {"now": 88, "baseline": 90},
        "qwen": {"now": 12.5, "baseline": 30},
    }
    assert servers["omni"]["tokens_per_second"] is None  # not one number across its models
    assert servers["alpha"]["model_speeds"] == {}
    [breaker] = dioscuri["breakers"]
    assert breaker["target"] == "server/dioscuri/alpha" and breaker["playbook"] == "probe-llama"
    assert [c["target"] for c in dioscuri["cooldowns"]] == ["server/dioscuri/alpha"]
    runs = {r["target"]: r for r in dioscuri["last_runs"]}
    assert runs["server/dioscuri/alpha"]["outcome"] == "not_healed"
    assert runs["server/dioscuri/beta"]["wait_reason"] == "paused"
    theia = hosts["theia"]
    assert theia["exporter_up"] is None and theia["gpus"] == [] and theia["servers"] == []
    assert theia["maintenance"]["reason"] == "swap fans"
    assert data["outbox_depth"] == 0 and data["outbox_failures"] == []


def test_host_narrows_and_an_unknown_host_is_refused(lab: Lab) -> None:
    narrowed = json.loads(run("status", *lab.config, "--json", "--host", "theia").stdout)
    assert [h["host"] for h in narrowed["hosts"]] == ["theia"]
    assert narrowed["waiting_runs"] == []  # the waiting run is dioscuri's
    table = run("status", *lab.config, "--host", "dioscuri")
    assert table.returncode == 0 and "\ntheia" not in table.stdout and "alpha" in table.stdout
    unknown = run("status", *lab.config, "--host", "nowhere")
    assert unknown.returncode == 2 and "no host 'nowhere'" in unknown.stderr


def test_prometheus_down_says_so_and_still_shows_the_journal(lab: Lab, tmp_path: Path) -> None:
    from tests.llama_lab import free_port

    config = lab.setup.config.read_text().replace(
        lab.prometheus.url, f"http://127.0.0.1:{free_port()}"
    )
    down = tmp_path / "down.yaml"
    down.write_text(config)
    result = run("status", "--config", str(down))
    assert result.returncode == 3, result.stderr
    assert "unreachable" in result.stderr
    assert "unreachable" in result.stdout and "the journal's part follows" in result.stdout
    assert "breaker OPEN server/dioscuri/alpha" in result.stdout
    assert "MAINTENANCE since" in result.stdout and "remediation PAUSED" in result.stdout
    alpha = next(line for line in result.stdout.splitlines() if line.startswith("  alpha "))
    assert alpha.split()[1:4] == ["gpu-dense", "tiny", "?"]  # from the roster; state unknown
    data = json.loads(run("status", "--config", str(down), "--json").stdout)
    assert "unreachable" in data["prometheus_error"]
    servers = {s["server"]: s for s in data["hosts"][0]["servers"]}
    assert servers["alpha"]["state"] is None and servers["alpha"]["ghost"] is None
    assert data["hosts"][0]["breakers"] != []


def _on_a_terminal(args: list[str], env: dict[str, str]) -> str:
    """What the command writes to a pseudo-terminal (its stdout is a TTY)."""
    main, secondary = pty.openpty()
    proc = subprocess.Popen([REMEDIATOR, *args], stdout=secondary, stderr=subprocess.DEVNULL,
                            env=env)  # fmt: skip
    os.close(secondary)
    chunks: list[bytes] = []
    deadline = time.monotonic() + 60
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([main], [], [], 1)
            if not ready:
                if proc.poll() is not None:
                    break
                continue
            try:
                chunk = os.read(main, 65536)
            except OSError:  # EIO: the command closed its side
                break
            if not chunk:
                break
            chunks.append(chunk)
    finally:
        proc.wait(timeout=30)
        os.close(main)
    return b"".join(chunks).decode(errors="replace")


def test_colour_on_a_terminal_only_and_never_with_no_color(lab: Lab) -> None:
    env: dict[str, Any] = {k: v for k, v in os.environ.items() if k != "NO_COLOR"}
    env["TERM"] = "xterm"
    coloured = _on_a_terminal(["status", *lab.config], env)
    assert "\x1b[31;1m" in coloured and "breaker OPEN" in coloured
    assert "\x1b[2J" not in coloured and "\x07" not in coloured  # the label's escapes are not
    plain = _on_a_terminal(["status", *lab.config], {**env, "NO_COLOR": "1"})
    assert "breaker OPEN" in plain and "\x1b" not in plain
