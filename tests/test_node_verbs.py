"""`gpu-fleet-node` verbs against real llama-servers that the systemctl stand-in really runs.

Real parts: the llama-server is the lab's real binary (tests/llama_lab.py) on a tiny model,
started, stopped and restarted as a process by the systemctl stand-in (systemd is not PID 1
here; tests/systemctl_stand_in.py); the node runs as a subprocess, as sshd would run it, and
is judged by its JSON answer, its exit code, and the processes and ports themselves.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from exporter.sources.procnet import read_listeners
from tests.llama_lab import StartLlamaServer, free_port, http_get, wait_until
from tests.systemctl_stand_in import SystemctlStandIn
from tests.test_ports import LLAMA_ARGS, PythonListener, exec_start

NODE = str(Path(sys.executable).parent / "gpu-fleet-node")
UNIT = "llama-server@alpha.service"


def write_roster(directory: Path, port: int, extra_host: str = "") -> Path:
    """Host `lab` with server alpha on `port`; host `elsewhere` with server gamma."""
    text = f"""\
hosts:
  lab:
    address: 127.0.0.1
    gpus: {{nvidia: {{count: 2}}, amd: {{count: 1}}}}
    power_cap_watts: {{0: {{min: 150, max: 300}}, 1: {{min: 100, max: 600}}}}
    servers:
      alpha:
        engine: llama
        url: http://127.0.0.1:{port}
        unit: {UNIT}
        role: gpu-dense
        model: tiny
  elsewhere:
    address: 127.0.0.2
    servers:
      gamma:
        engine: llama
        url: http://127.0.0.1:{port}
        unit: llama-server@gamma.service
        role: gpu-dense
        model: tiny
{extra_host}"""
    path = directory / "fleet.yaml"
    path.write_text(text)
    return path


@dataclass
class Answer:
    """What one run of gpu-fleet-node gave."""

    code: int
    json: dict[str, Any]
    stderr: str

    @property
    def result(self) -> dict[str, Any]:
        result: dict[str, Any] = self.json["result"]
        return result


def run_node(
    stand_in: SystemctlStandIn,
    roster: Path,
    *args: str,
    ssh: str | None = None,
    options: tuple[str, ...] = (),
    timeout: float = 120,
) -> Answer:
    """`gpu-fleet-node --config ROSTER --host lab [OPTIONS] ARGS`.

    With `ssh`, the forced-command form: `... --ssh` with `SSH_ORIGINAL_COMMAND=ssh`.
    """
    env = stand_in.env()
    env.pop("SSH_ORIGINAL_COMMAND", None)
    if ssh is not None:
        env["SSH_ORIGINAL_COMMAND"] = ssh
        options = (*options, "--ssh")
    command = [NODE, "--config", str(roster), "--host", "lab", *options, *args]
    done = subprocess.run(
        command, env=env, capture_output=True, text=True, timeout=timeout, check=False
    )
    lines = done.stdout.splitlines()
    assert len(lines) == 1, f"not one line of JSON: {done.stdout!r}\n{done.stderr}"
    answer = json.loads(lines[0])
    assert set(answer) == {"ok", "verb", "args", "host", "result", "error"}
    assert answer["ok"] == (done.returncode == 0) or answer["verb"] == "guard-port"
    return Answer(done.returncode, answer, done.stderr)


def alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie has exited: the stand-in's services are orphans)."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return text[text.rfind(")") + 2 :].split()[0] not in ("Z", "X")


def listening(port: int) -> bool:
    return bool(read_listeners(ports={port}).get(port))


def healthy(url: str) -> bool:
    try:
        return http_get(url, "/health", timeout=2).status == 200
    except OSError:
        return False


@dataclass
class Lab:
    """A roster whose server alpha is a unit of the stand-in that runs a real llama-server."""

    stand_in: SystemctlStandIn
    roster: Path
    port: int
    binary: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def node(self, *args: str, **kwargs: Any) -> Answer:
        return run_node(self.stand_in, self.roster, *args, **kwargs)

    def main_pid(self) -> int | None:
        return self.stand_in.main_pid(UNIT)

    def wait_healthy(self) -> None:
        wait_until(lambda: healthy(self.url), timeout=60, what=f"{self.url}/health 200")


def llama_argv(binary: Path, model: Path, port: int) -> list[str]:
    """The ExecStart= of alpha: the lab's llama-server on `port`."""
    return [str(binary), "-m", str(model), "--host", "127.0.0.1", "--port", str(port), *LLAMA_ARGS]


@pytest.fixture
def lab(llama_binary: Path, tiny_model: Path, tmp_path: Path) -> Iterator[Lab]:
    stand_in = SystemctlStandIn(tmp_path)
    port = free_port()
    stand_in.declare_service(
        UNIT, llama_argv(llama_binary, tiny_model, port), stop_timeout_seconds=5
    )
    try:
        yield Lab(stand_in, write_roster(tmp_path, port), port, llama_binary)
    finally:
        stand_in.stop_all()


def test_start_status_evidence_restart_stop_of_a_real_server(lab: Lab, tmp_path: Path) -> None:
    started = lab.node("start", "alpha")
    assert started.code == 0, started.stderr
    assert started.json["ok"] and started.json["host"] == "lab"
    assert started.result["before"]["active_state"] == "inactive"
    assert started.result["after"]["active_state"] == "active"
    first = lab.main_pid()
    assert first is not None and started.result["after"]["main_pid"] == first
    lab.wait_healthy()

    status = lab.node("status", "alpha")
    assert status.code == 0, status.stderr
    assert status.result["unit"] == UNIT and status.result["sub_state"] == "running"
    assert status.result["port"] == lab.port and status.result["ghost"] is False
    assert status.result["listeners"] == [{"pid": first, "comm": "llama-server", "user": "root"}]
    assert isinstance(status.result["state_change_timestamp"], float)

    # The fake NVML (a stand-in for a GPU) lists the server's pid as a compute process.
    scenario = tmp_path / "gpu.yaml"
    scenario.write_text(
        "gpus:\n  - pci_bus_id: '0000:41:00.0'\n    pci_device_id: 0x233510DE\n"
        f"    processes: [{{pid: {first}, used_bytes: 1073741824}}, {{pid: 1, used_bytes: 5}}]\n"
    )
    evidence = lab.node(
        "evidence", "alpha", options=("--nvml.fake-scenario", str(scenario), "--sysfs", "/nope")
    )
    assert evidence.code == 0, evidence.stderr
    result = evidence.result
    assert result["unit"]["main_pid"] == first
    (owner,) = result["port_owner"]
    assert owner["pid"] == first and owner["exe"] == os.path.realpath(lab.binary)
    assert f"--port {lab.port}" in owner["cmdline"] and owner["user"] == "root"
    main = result["main_process"]
    assert main["pid"] == first and main["rss_bytes"] > 0 and main["threads"] >= 1
    assert main["cgroup"]  # /proc/PID/cgroup as the kernel writes it
    assert any(f"Started {UNIT}." in line for line in result["journal"]), result["journal"]
    assert any(f"llama-server[{first}]: " in line for line in result["journal"])
    assert result["gpu_processes"] == [  # by pid
        {"pid": 1, "gpu": 0, "memory_bytes": 5, "server": None},
        {"pid": first, "gpu": 0, "memory_bytes": 1073741824, "server": "alpha"},
    ]

    # Restart over --ssh: a new main process, the old one gone, the port answering again.
    restarted = lab.node(ssh="restart alpha")
    assert restarted.code == 0, restarted.stderr
    second = lab.main_pid()
    assert second is not None and second != first and not alive(first)
    assert restarted.result["before"]["main_pid"] == first
    assert restarted.result["after"]["main_pid"] == second
    lab.wait_healthy()

    # Stop a server that does not react to SIGTERM (SIGSTOPped: hung): SIGKILL follows.
    os.kill(second, signal.SIGSTOP)
    stopped = lab.node("stop", "alpha")
    assert stopped.code == 0, stopped.stderr
    assert stopped.result["after"]["active_state"] == "inactive"
    assert not alive(second) and not listening(lab.port)

    again = lab.node(ssh="start alpha")
    assert again.code == 0, again.stderr
    assert lab.main_pid() not in (None, first, second)
    lab.wait_healthy()


def test_a_start_that_fails_at_once_exits_1(lab: Lab, tmp_path: Path) -> None:
    # A missing model: the real llama-server exits at once; systemd would mark the unit failed.
    argv = llama_argv(lab.binary, tmp_path / "missing.gguf", lab.port)
    lab.stand_in.declare_service(UNIT, argv, start_check_seconds=5)
    answer = lab.node("start", "alpha", options=("--wait-seconds", "10"))
    assert answer.code == 1
    assert not answer.json["ok"]
    assert answer.result["after"]["active_state"] == "failed"
    assert answer.result["systemctl"]["exit"] == 1
    assert f"start {UNIT}: active not reached (now failed)" in answer.json["error"]
    assert "Job for" in answer.json["error"]  # systemctl's own message is passed on
    assert "failed: " in answer.stderr


def test_restart_of_a_unit_past_its_start_limit_resets_it_first(lab: Lab, tiny_model: Path) -> None:
    # A ghost on the port: the real llama-server cannot bind and exits, Restart=on-failure
    # starts it again, and after StartLimitBurst= starts systemd gives up (start-limit-hit)
    # and refuses even a manual start. Once the ghost is gone, the node's restart must work.
    lab.stand_in.declare_service(
        UNIT, llama_argv(lab.binary, tiny_model, lab.port),
        restart="on-failure", restart_sec=0.2, start_limit_interval_seconds=600,
        start_limit_burst=3, stop_timeout_seconds=5,
    )  # fmt: skip
    with PythonListener(lab.port) as ghost:
        # The first start may fail already (the process exits at once): what counts is after.
        subprocess.run(["systemctl", "start", UNIT], check=False, env=lab.stand_in.env(),
                       timeout=60)  # fmt: skip
        wait_until(lambda: lab.stand_in.units[UNIT].get("Result") == "start-limit-hit",
                   timeout=90, what="the unit to hit its start limit")  # fmt: skip
        refused = subprocess.run(["systemctl", "start", UNIT], check=False,
                                 env=lab.stand_in.env(), capture_output=True, text=True,
                                 timeout=60)  # fmt: skip
        assert refused.returncode != 0  # systemd's own refusal, which the node must get past
        ghost.process.kill()
        ghost.process.wait(timeout=5)
    answer = lab.node("restart", "alpha", options=("--wait-seconds", "60"))
    assert answer.code == 0, answer.json
    assert answer.result["before"]["active_state"] == "failed"
    assert answer.result["reset_failed"]["exit"] == 0
    assert answer.result["after"]["active_state"] == "active"
    lab.wait_healthy()


def test_restart_of_a_unit_up_again_after_a_crash_loop_resets_its_start_limit_first(
    lab: Lab, tiny_model: Path, tmp_path: Path
) -> None:
    # The loop ended by itself (its ghost gone), the unit is active again, and systemd's own
    # restarts have spent the start limit: a manual start counts too, so a restart without
    # reset-failed would stop the server and then be refused (start-limit-hit), leaving it
    # down. Two failed starts, then the real server: three starts, a burst of three.
    counter = tmp_path / "attempts"
    script = (
        'n=$(cat "$0" 2>/dev/null || echo 0); echo $((n + 1)) > "$0"; '
        '[ "$n" -ge 2 ] || exit 1; exec "$@"'
    )
    argv = ["/bin/sh", "-c", script, str(counter), *llama_argv(lab.binary, tiny_model, lab.port)]
    lab.stand_in.declare_service(
        UNIT, argv,
        restart="on-failure", restart_sec=0.2, start_limit_interval_seconds=600,
        start_limit_burst=3, stop_timeout_seconds=5,
    )  # fmt: skip
    subprocess.run(["systemctl", "start", UNIT], check=False, env=lab.stand_in.env(), timeout=60)
    wait_until(lambda: lab.stand_in.units[UNIT].get("ActiveState") == "active", timeout=60,
               what="the unit active after its loop")  # fmt: skip
    lab.wait_healthy()
    answer = lab.node("restart", "alpha", options=("--wait-seconds", "60"))
    assert answer.code == 0, answer.json
    assert answer.result["before"]["active_state"] == "active"
    assert answer.result["before"]["n_restarts"] == 2
    assert answer.result["reset_failed"]["exit"] == 0
    assert answer.result["after"]["active_state"] == "active"
    lab.wait_healthy()


def test_status_names_a_ghost_and_guard_port_over_ssh_clears_it(
    lab: Lab, llama_server: StartLlamaServer
) -> None:
    # A stale llama-server on alpha's port while the unit is down (killed off from its unit).
    stale = llama_server(*LLAMA_ARGS)
    roster = write_roster(lab.roster.parent, stale.port)
    # The unit as shipped starts `llama-server … $LLAMA_ARGS` (systemctl show prints the
    # variables unexpanded): the stale server's command line fits it.
    shipped = ("--host", "${LLAMA_HOST}", "--port", "${LLAMA_PORT}", "$LLAMA_ARGS")
    lab.stand_in.set_unit(UNIT, ExecStart=exec_start(lab.binary, *shipped))
    status = run_node(lab.stand_in, roster, "status", "alpha")
    assert status.code == 0, status.stderr
    assert status.result["ghost"] is True
    assert [entry["pid"] for entry in status.result["listeners"]] == [stale.pid]

    guarded = run_node(lab.stand_in, roster, ssh="guard-port alpha")
    assert guarded.code == 0, guarded.stderr
    assert guarded.json["ok"] and guarded.result["outcome"] == "cleared"
    assert guarded.result["stopped"] == [stale.pid]
    (holder,) = guarded.result["holders"]
    assert holder["pid"] == stale.pid and holder["verdict"] == "stale"
    stale.process.wait(timeout=5)
    assert not listening(stale.port)


def test_guard_port_over_ssh_refuses_another_program_with_exit_1(lab: Lab) -> None:
    port = free_port()
    roster = write_roster(lab.roster.parent, port)
    with PythonListener(port) as other:
        answer = run_node(lab.stand_in, roster, ssh="guard-port alpha")
        assert answer.code == 1
        assert other.alive() and listening(port)
    assert not answer.json["ok"] and answer.result["outcome"] == "refused"
    assert answer.result["stopped"] == []
    assert f"it runs {os.path.realpath(sys.executable)}" in answer.result["holders"][0]["verdict"]


def test_plain_guard_port_keeps_failing_open_and_says_so_in_json(lab: Lab) -> None:
    # As ExecStartPre=: it cannot check (no server gamma on this host), so the unit may start.
    done = subprocess.run(
        [NODE, "guard-port", "gamma", "--config", str(lab.roster), "--host", "lab"],
        env=lab.stand_in.env(),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0
    answer = json.loads(done.stdout)
    assert not answer["ok"] and answer["result"]["outcome"] == "cannot-check"
    assert "host 'lab' has no server 'gamma'" in answer["error"]
    assert "letting the unit start" in done.stderr


def test_systemctl_failing_makes_status_exit_1(lab: Lab) -> None:
    lab.stand_in.fail = {"exit": 1, "stderr": "Failed to connect to bus: No such file"}
    lab.stand_in.save()
    answer = lab.node("status", "alpha")
    assert answer.code == 1 and not answer.json["ok"]
    assert "Failed to connect to bus" in answer.json["error"]
    restart = lab.node("restart", "alpha")
    assert restart.code == 1 and "cannot read" in restart.json["error"]
    assert not any(call.startswith("restart") for call in lab.stand_in.calls())
