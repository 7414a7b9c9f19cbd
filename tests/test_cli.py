"""`gpu-fleet-exporter` as a user runs it: real processes, fixture trees, the fake NVML backend.

`promtool check metrics` (Debian's prometheus package, installed by `make test`) judges every
exposition here.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from fleet.roster import DEFAULT_ROSTER_PATH
from tests.llama_lab import free_port
from tests.sysfs_tree import write_amd_fleet

REPO = Path(__file__).resolve().parent.parent
EXPORTER = str(Path(sys.executable).parent / "gpu-fleet-exporter")
TWO_GPUS = REPO / "tests" / "fixtures" / "nvml" / "two_gpus.yaml"
PROMTOOL = shutil.which("promtool")


def run(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [EXPORTER, *args], capture_output=True, text=True, timeout=timeout, check=False
    )


def promtool_check(text: str) -> None:
    if PROMTOOL is None:
        pytest.fail("promtool is missing: `make test` installs Debian's prometheus package")
    result = subprocess.run(
        [PROMTOOL, "check", "metrics"], input=text, capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stdout + result.stderr


def roster(tmp_path: Path, body: str) -> Path:
    path = tmp_path / "fleet.yaml"
    path.write_text(body)
    return path


AMD_HOST = """\
hosts:
  strix:
    address: 127.0.0.1
    gpus:
      amd: {count: 8}
"""


@pytest.mark.skipif(DEFAULT_ROSTER_PATH.exists(), reason="this machine has a real roster")
def test_once_without_roster_or_gpu_prints_host_metrics(tmp_path: Path) -> None:
    empty_sysfs = tmp_path / "sys"
    empty_sysfs.mkdir()
    result = run("--once", "--sysfs", str(empty_sysfs))
    assert result.returncode == 0, result.stderr
    assert "gpufleet_host_memory_total_bytes " in result.stdout
    assert 'gpufleet_exporter_collector_success{collector="host"} 1.0' in result.stdout
    # No roster: NVML's absence is silent and nothing is "expected".
    assert 'gpufleet_exporter_collector_success{collector="nvidia"} 1.0' in result.stdout
    assert "gpufleet_gpus_expected" not in result.stdout
    assert "gpufleet_gpu_info" not in result.stdout
    promtool_check(result.stdout)


def test_once_over_a_fixture_tree_prints_every_card(tmp_path: Path) -> None:
    sysfs = tmp_path / "sys"
    cards = [0, 1, 2, 3, 10, 11, 12, 13]
    write_amd_fleet(sysfs, cards)
    config = roster(tmp_path, AMD_HOST)
    result = run("--once", "--config", str(config), "--host", "strix", "--sysfs", str(sysfs))
    assert result.returncode == 0, result.stderr
    info = [line for line in result.stdout.splitlines() if line.startswith("gpufleet_gpu_info{")]
    assert len(info) == len(cards)
    for card in cards:
        assert f'card="card{card}"' in result.stdout
    for gpu in range(len(cards)):
        assert f'gpufleet_gpu_up{{gpu="{gpu}"}} 1.0' in result.stdout
    assert 'gpufleet_gpus_expected{vendor="amd"} 8.0' in result.stdout
    assert 'gpufleet_gpus_lost{vendor="amd"} 0.0' in result.stdout
    # The roster expects no NVIDIA card here: NVML's absence is silent.
    assert 'gpufleet_exporter_collector_success{collector="nvidia"} 1.0' in result.stdout
    assert "instance=" not in result.stdout and "host=" not in result.stdout
    promtool_check(result.stdout)


def test_once_with_the_fake_nvml_backend(tmp_path: Path) -> None:
    config = roster(
        tmp_path,
        "hosts:\n  theia:\n    address: 127.0.0.1\n    gpus:\n"
        "      nvidia: {count: 2, compute_mode: exclusive_process}\n",
    )
    empty_sysfs = tmp_path / "sys"
    empty_sysfs.mkdir()
    result = run(
        "--once",
        "--config",
        str(config),
        "--host",
        "theia",
        "--sysfs",
        str(empty_sysfs),
        "--nvml.fake-scenario",
        str(TWO_GPUS),
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.count("gpufleet_gpu_info{") == 2
    assert 'gpufleet_exporter_collector_success{collector="nvidia"} 1.0' in result.stdout
    assert 'gpufleet_gpu_compute_mode_expected{gpu="0",mode="exclusive_process"} 1.0' in (
        result.stdout
    )
    promtool_check(result.stdout)


def test_nvml_missing_on_a_host_that_expects_nvidia_is_a_collector_failure(
    tmp_path: Path,
) -> None:
    config = roster(
        tmp_path,
        "hosts:\n  dioscuri:\n    address: 127.0.0.1\n    gpus:\n      nvidia: {count: 2}\n",
    )
    scenario = tmp_path / "missing.yaml"
    scenario.write_text("library_missing: true\n")
    empty_sysfs = tmp_path / "sys"
    empty_sysfs.mkdir()
    result = run(
        "--once",
        "--config",
        str(config),
        "--host",
        "dioscuri",
        "--sysfs",
        str(empty_sysfs),
        "--nvml.fake-scenario",
        str(scenario),
    )
    assert result.returncode == 0, result.stderr
    assert 'gpufleet_exporter_collector_success{collector="nvidia"} 0.0' in result.stdout
    assert 'gpufleet_gpus_lost{vendor="nvidia"} 2.0' in result.stdout
    assert "gpufleet_host_memory_total_bytes " in result.stdout  # the rest of the scrape
    promtool_check(result.stdout)


@pytest.mark.parametrize(
    ("body", "args", "expected"),
    [
        (
            "hosts:\n  a:\n    address: 127.0.0.1\n    servrs: {}\n",
            ["--host", "a"],
            "hosts.a.servrs: unknown key",
        ),
        ("hosts:\n  a:\n    address: 127.0.0.1\n", ["--host", "b"], "--host 'b': no such host"),
        ("hosts: [\n", ["--host", "a"], "not valid YAML"),
    ],
)
def test_a_bad_roster_stops_the_start_with_exit_2(
    tmp_path: Path, body: str, args: list[str], expected: str
) -> None:
    config = roster(tmp_path, body)
    result = run("--once", "--config", str(config), *args)
    assert result.returncode == 2
    assert str(config) in result.stderr or "--host" in result.stderr
    assert expected in result.stderr
    assert result.stdout == ""


def test_missing_explicit_roster_and_bad_flags_exit_2(tmp_path: Path) -> None:
    result = run("--once", "--config", str(tmp_path / "absent.yaml"), "--host", "a")
    assert result.returncode == 2 and "absent.yaml: cannot read" in result.stderr
    result = run("--once", "--web.listen-address", "nonsense")
    assert result.returncode == 2 and "--web.listen-address" in result.stderr
    result = run("--once", "--collector.timeout", "0")
    assert result.returncode == 2 and "--collector.timeout" in result.stderr


def test_serves_metrics_and_stops_cleanly_on_sigterm(tmp_path: Path) -> None:
    sysfs = tmp_path / "sys"
    write_amd_fleet(sysfs, [0])
    config = roster(tmp_path, AMD_HOST.replace("count: 8", "count: 1"))
    port = free_port()
    proc = subprocess.Popen(
        [
            EXPORTER,
            "--config",
            str(config),
            "--host",
            "strix",
            "--sysfs",
            str(sysfs),
            "--web.listen-address",
            f"127.0.0.1:{port}",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env={**os.environ},
    )
    try:
        body = ""
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
                    assert r.headers["Content-Type"].startswith("text/plain")
                    body = r.read().decode()
                break
            except (urllib.error.URLError, ConnectionError):
                time.sleep(0.1)
        assert "gpufleet_gpu_info{" in body
        promtool_check(body)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=15) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


# --- --check-config: the files, and nothing else --------------------------------------------


class Listener:
    """A socket on 127.0.0.1 that counts the connections made to it (nobody should)."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.sock.settimeout(0.05)
        self.port = self.sock.getsockname()[1]

    def connections(self) -> int:
        count = 0
        while True:
            try:
                conn, _ = self.sock.accept()
            except TimeoutError:
                return count
            conn.close()
            count += 1


def test_check_config_reads_the_files_and_contacts_nothing(tmp_path: Path) -> None:
    listener, second = Listener(), Listener()  # one address per server
    try:
        # Servers of every engine, a canary and a LiteLLM proxy, all at the listening socket:
        # a scrape would connect to it (--once does, as the control below shows).
        path = roster(
            tmp_path,
            "hosts:\n  lab:\n    address: 127.0.0.1\n    gpus: {nvidia: {count: 2}}\n"
            "    servers:\n"
            "      alpha:\n        engine: llama\n"
            f"        url: http://127.0.0.1:{listener.port}\n"
            "        unit: llama-server@alpha.service\n        role: gpu-dense\n"
            "        model: tiny\n        canary: {interval_seconds: 10}\n"
            f"        litellm: {{url: 'http://127.0.0.1:{listener.port}', model_id: d1,"
            " admin_key_file: /nonexistent/key}\n"
            "      beta:\n        engine: vllm\n"
            f"        url: http://127.0.0.1:{second.port}\n"
            "        unit: vllm@beta.service\n        role: gpu-light\n        model: small\n",
        )
        web = tmp_path / "web.yml"
        web.write_text("http_server_config:\n  headers:\n    X-Content-Type-Options: nosniff\n")
        # An NVML whose enumeration hangs for 30 s: touching it would cost --collector.timeout.
        scenario = tmp_path / "hang.yaml"
        scenario.write_text(
            TWO_GPUS.read_text()
            + "    hang: {call: nvmlDeviceGetPciInfo, seconds: 30}\n"  # on the second GPU
        )
        started = time.monotonic()
        checked = run(
            "--check-config", "--config", str(path), "--host", "lab",
            "--web.config.file", str(web), "--nvml.fake-scenario", str(scenario),
            "--collector.timeout", "10", "--sysfs", str(tmp_path / "sys"),
        )  # fmt: skip
        elapsed = time.monotonic() - started
        assert checked.returncode == 0, checked.stderr
        assert checked.stdout.startswith(f"gpu-fleet-exporter: roster {path}: good; this host:")
        assert "2 server(s), GPUs 2 nvidia" in checked.stdout
        assert f"web config {web}: good (TLS off, basic auth off)" in checked.stdout
        assert elapsed < 8, f"{elapsed:.1f} s: NVML was started"
        assert (listener.connections(), second.connections()) == (0, 0)

        # The control: one scrape does contact the servers (so the count above can fail).
        once = run("--once", "--config", str(path), "--host", "lab", "--sysfs", str(tmp_path))
        assert once.returncode == 0, once.stderr
        assert listener.connections() > 0 and second.connections() > 0
    finally:
        listener.sock.close()
        second.sock.close()


def test_check_config_names_the_file_and_key_and_exits_2(tmp_path: Path) -> None:
    path = roster(tmp_path, AMD_HOST.replace("count: 8", "count: many"))
    bad = run("--check-config", "--config", str(path), "--host", "strix")
    assert bad.returncode == 2 and bad.stdout == ""
    assert f"{path}: hosts.strix.gpus.amd.count: Input should be a valid integer" in bad.stderr
    good = roster(tmp_path, AMD_HOST)
    unknown = run("--check-config", "--config", str(good), "--host", "nowhere")
    assert unknown.returncode == 2 and "--host 'nowhere': no such host" in unknown.stderr
    web = tmp_path / "web.yml"
    web.write_text("basic_auth_users:\n  prometheus: not-a-bcrypt-hash\n")
    web_bad = run("--check-config", "--config", str(good), "--host", "strix",
                  "--web.config.file", str(web))  # fmt: skip
    assert web_bad.returncode == 2
    assert f"{web}: basic_auth_users.prometheus:" in web_bad.stderr, web_bad.stderr
