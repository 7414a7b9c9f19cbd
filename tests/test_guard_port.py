"""`gpu-fleet-node guard-port` as systemd runs it: a real subprocess, real holders of real ports.

The stale holders are real llama-servers started by the lab (the unit's own program) and plain
Python listeners; `systemctl show` is the stand-in, put first on PATH (`SystemctlStandIn.env()`).
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from exporter.node.exec_start import fits_exec_start
from exporter.sources.procnet import read_listeners
from tests.llama_lab import StartLlamaServer, free_port
from tests.systemctl_stand_in import SystemctlStandIn
from tests.test_ports import LLAMA_ARGS, NOBODY, UNIT, PythonListener, exec_start

NODE = str(Path(sys.executable).parent / "gpu-fleet-node")
BETA_UNIT = "llama-server@beta.service"
# How the shipped llama-server@.service starts the server (systemctl show prints the variables
# unexpanded); the lab starts llama-server as `--host 127.0.0.1 --port PORT ARGS...`.
LLAMA_EXEC_ARGS = ("--host", "${LLAMA_HOST}", "--port", "${LLAMA_PORT}", "$LLAMA_ARGS")
# A unit of a Python program whose argv the listeners here fit: `python -c CODE host port`.
PYTHON_EXEC_ARGS = ("-c", "${CODE}", "$LISTENER_ARGS")


def write_roster(directory: Path, alpha_port: int, beta_port: int | None = None) -> Path:
    lines = ["hosts:", "  lab:", "    address: 127.0.0.1", "    servers:"]
    for name, unit, port in (("alpha", UNIT, alpha_port), ("beta", BETA_UNIT, beta_port)):
        if port is not None:
            lines += [
                f"      {name}:",
                "        engine: llama",
                f"        url: http://127.0.0.1:{port}",
                f"        unit: {unit}",
                "        role: gpu-dense",
                "        model: tiny",
            ]
    path = directory / "fleet.yaml"
    path.write_text("\n".join(lines) + "\n")
    return path


def guard(
    stand_in: SystemctlStandIn,
    roster: Path,
    *args: str,
    as_nobody: bool = False,
    caps: tuple[str, ...] = (),
) -> subprocess.CompletedProcess[str]:
    command = [NODE, "guard-port", "alpha", "--config", str(roster), "--host", "lab", *args]
    if as_nobody:
        # setpriv (util-linux) switches to nobody and execs with only the ambient `caps` left.
        # Not subprocess's user=: that drops privileges before exec, and the venv's interpreter
        # may live where nobody cannot even look (pyenv under /root).
        setpriv = shutil.which("setpriv")
        if setpriv is None:
            pytest.fail("setpriv (util-linux) is needed to run the guard as nobody")
        drop = [setpriv, f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups"]
        if caps:
            listed = ",".join(f"+{cap}" for cap in caps)
            drop += [f"--inh-caps={listed}", f"--ambient-caps={listed}"]
        command = [*drop, *command]
    return subprocess.run(
        command,
        env=stand_in.env(),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        cwd=roster.parent,
    )


def listening(port: int) -> bool:
    return bool(read_listeners(ports={port}).get(port))


@pytest.fixture
def stand_in(tmp_path: Path) -> SystemctlStandIn:
    return SystemctlStandIn(tmp_path)


def test_a_stale_llama_server_is_stopped_and_the_port_freed(
    llama_server: StartLlamaServer,
    llama_binary: Path,
    stand_in: SystemctlStandIn,
    tmp_path: Path,
) -> None:
    stale = llama_server(*LLAMA_ARGS)  # "killed off from its unit": the unit no longer has it
    stand_in.set_unit(
        UNIT, ActiveState="activating", SubState="start-pre", MainPID=0,
        ExecStart=exec_start(llama_binary, *LLAMA_EXEC_ARGS),
    )  # fmt: skip
    result = guard(stand_in, write_roster(tmp_path, stale.port))
    assert result.returncode == 0, result.stderr
    stale.process.wait(timeout=5)  # it is gone (SIGTERM was enough) ...
    assert not listening(stale.port)  # ... and so is its socket
    log = result.stderr
    # The evidence, before the kill: pid, program, owner, start time, command line.
    assert f"stale process of {UNIT}'s program {llama_binary}" in log
    assert f"pid {stale.pid} (llama-server), user root (uid 0), started " in log
    assert f"--port {stale.port}" in log
    assert f"sent SIGTERM to pid {stale.pid}" in log and "SIGKILL" not in log
    assert f"port {stale.port} is free; letting the unit start" in log


def test_a_frozen_stale_llama_server_is_sigkilled(
    llama_server: StartLlamaServer,
    llama_binary: Path,
    stand_in: SystemctlStandIn,
    tmp_path: Path,
) -> None:
    stale = llama_server(*LLAMA_ARGS)
    stale.freeze()  # SIGSTOP: a stopped process cannot act on SIGTERM
    stand_in.set_unit(
        UNIT, ActiveState="activating", ExecStart=exec_start(llama_binary, *LLAMA_EXEC_ARGS)
    )
    result = guard(stand_in, write_roster(tmp_path, stale.port), "--term-timeout", "0.5")
    assert result.returncode == 0, result.stderr
    assert stale.process.wait(timeout=5) == -9
    assert f"pid {stale.pid} still runs 0.5 s after SIGTERM; sending SIGKILL" in result.stderr
    assert f"sent SIGKILL to pid {stale.pid}" in result.stderr
    assert not listening(stale.port)


def test_a_sigterm_ignoring_stale_process_through_a_symlinked_exec_start_is_sigkilled(
    stand_in: SystemctlStandIn, tmp_path: Path
) -> None:
    # ExecStart= names the venv's `python`, a chain of symlinks; the process's exe is the
    # interpreter it resolves to: the same program by resolved path.
    port = free_port()
    stand_in.set_unit(
        UNIT, ActiveState="activating", ExecStart=exec_start(sys.executable, *PYTHON_EXEC_ARGS)
    )
    with PythonListener(port, ignore_sigterm=True) as stale:
        result = guard(stand_in, write_roster(tmp_path, port), "--term-timeout", "0.3")
        assert result.returncode == 0, result.stderr
        assert stale.process.wait(timeout=5) == -9
    assert os.path.realpath(sys.executable) in result.stderr
    assert "SIGKILL" in result.stderr and not listening(port)


def test_another_program_on_the_port_is_refused_and_left_alive(
    llama_binary: Path, stand_in: SystemctlStandIn, tmp_path: Path
) -> None:
    port = free_port()
    stand_in.set_unit(UNIT, ActiveState="activating", ExecStart=exec_start(llama_binary))
    with PythonListener(port) as other:
        result = guard(stand_in, write_roster(tmp_path, port))
        assert result.returncode == 1, result.stderr
        assert other.alive() and listening(port)
    log = result.stderr
    assert f"port {port} is held by pid {other.pid} (python" in log
    assert f"it runs {os.path.realpath(sys.executable)}, not {llama_binary}" in log
    assert "refusing to kill" in log and "sent SIGTERM" not in log
    assert "\\n" in log and len(log.splitlines()) == 2  # the listener's code, escaped


def test_a_bystander_sharing_the_interpreter_is_refused_and_left_alive(
    stand_in: SystemctlStandIn, tmp_path: Path
) -> None:
    """A vLLM unit runs `python -m vllm.entrypoints.openai.api_server`; a hand-started Python
    program on its port runs the same interpreter but is no copy of the unit's server."""
    port = free_port()
    vllm = ("-m", "vllm.entrypoints.openai.api_server", "--port", "${VLLM_PORT}", "$VLLM_ARGS")
    stand_in.set_unit(UNIT, ActiveState="activating", ExecStart=exec_start(sys.executable, *vllm))
    with PythonListener(port) as bystander:
        result = guard(stand_in, write_roster(tmp_path, port))
        assert result.returncode == 1, result.stderr
        assert bystander.alive() and listening(port)
    log = result.stderr
    assert f"port {port} is held by pid {bystander.pid} (python" in log
    assert "its command line does not fit" in log
    assert "-m vllm.entrypoints.openai.api_server" in log  # the ExecStart= it was held against
    assert "refusing to kill" in log and "sent SIGTERM" not in log


def test_the_units_own_main_process_is_never_killed(
    stand_in: SystemctlStandIn, tmp_path: Path
) -> None:
    port = free_port()
    with PythonListener(port) as main:
        stand_in.set_unit(
            UNIT, ActiveState="active", MainPID=main.pid, ExecStart=exec_start(sys.executable)
        )
        result = guard(stand_in, write_roster(tmp_path, port))
        assert result.returncode == 0, result.stderr
        assert main.alive()
    assert f"{UNIT}'s own main process (pid {main.pid}); nothing to do" in result.stderr


def test_the_main_process_of_another_running_unit_is_never_killed(
    stand_in: SystemctlStandIn, tmp_path: Path
) -> None:
    # beta's server, same program, listens on alpha's port (a misconfiguration): not stale.
    port = free_port()
    with PythonListener(port) as beta:
        stand_in.set_unit(UNIT, ActiveState="activating", ExecStart=exec_start(sys.executable))
        stand_in.set_unit(BETA_UNIT, ActiveState="active", MainPID=beta.pid)
        result = guard(stand_in, write_roster(tmp_path, port, free_port()))
        assert result.returncode == 1, result.stderr
        assert beta.alive()
    assert f"it is the main process of {BETA_UNIT} (active)" in result.stderr


def test_a_free_port_lets_the_unit_start(
    llama_binary: Path, stand_in: SystemctlStandIn, tmp_path: Path
) -> None:
    port = free_port()
    stand_in.set_unit(UNIT, ActiveState="activating", ExecStart=exec_start(llama_binary))
    result = guard(stand_in, write_roster(tmp_path, port))
    assert result.returncode == 0 and f"port {port} is free" in result.stderr


@pytest.mark.parametrize(
    ("case", "expected"),
    [
        ("no roster", "absent.yaml: cannot read"),
        ("bad roster", "hosts.lab.servers.alpha.engine"),
        ("unknown host", "--host 'elsewhere': no such host"),
        ("unknown server", "host 'lab' has no server 'gamma'"),
        ("systemctl failing", "Failed to connect to bus"),
        ("no ExecStart", "no ExecStart= executable"),
    ],
)
def test_the_guard_fails_open_when_it_cannot_check(
    case: str, expected: str, stand_in: SystemctlStandIn, tmp_path: Path
) -> None:
    # A stale-looking holder of the unit's own program is there: failing open kills nothing.
    port = free_port()
    roster = write_roster(tmp_path, port)
    stand_in.set_unit(UNIT, ActiveState="activating", ExecStart=exec_start(sys.executable))
    args = ["guard-port", "alpha", "--config", str(roster), "--host", "lab"]
    if case == "no roster":
        args[3] = str(tmp_path / "absent.yaml")
    elif case == "bad roster":
        roster.write_text(roster.read_text().replace("engine: llama", "engine: llamma"))
    elif case == "unknown host":
        args[5] = "elsewhere"
    elif case == "unknown server":
        args[1] = "gamma"
    elif case == "systemctl failing":
        stand_in.fail = {"exit": 1, "stderr": "Failed to connect to bus: No such file"}
        stand_in.save()
    elif case == "no ExecStart":
        stand_in.set_unit(UNIT, ExecStart="")
    with PythonListener(port) as holder:
        result = subprocess.run(
            [NODE, *args],
            env=stand_in.env(),
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert result.returncode == 0, result.stderr
        assert holder.alive()
    assert expected in result.stderr
    assert "cannot check the port" in result.stderr
    assert result.stderr.rstrip().endswith("letting the unit start")


@pytest.fixture
def shared_dir() -> Iterator[Path]:
    """A directory `nobody` can read, for the roster and the stand-in's state.

    pytest's own tmp_path lives under a 0700 directory of root's.
    """
    with tempfile.TemporaryDirectory(prefix="gpufleet-guard-") as name:
        os.chmod(name, 0o755)
        yield Path(name)


def nobody_can_use(stand_in: SystemctlStandIn, roster: Path) -> None:
    """Let nobody read the roster and the stand-in's state, and append to its call log."""
    calls = Path(str(stand_in.state_path) + ".calls")
    calls.touch()
    for path in (stand_in.state_path, calls):
        os.chmod(path, stat.S_IRUSR | stat.S_IWUSR | stat.S_IRGRP | stat.S_IROTH | stat.S_IWOTH)
    os.chmod(roster, 0o644)


def test_an_unprivileged_guard_cannot_see_and_fails_open(shared_dir: Path) -> None:
    assert os.geteuid() == 0, "this test drops from root to nobody; run it as root"
    stand_in = SystemctlStandIn(shared_dir)
    port = free_port()
    roster = write_roster(shared_dir, port)
    nobody_can_use(stand_in, roster)
    stand_in.set_unit(UNIT, ActiveState="activating", ExecStart=exec_start(sys.executable))
    with PythonListener(port) as holder:  # root's: nobody may not read its open files
        result = guard(stand_in, roster, as_nobody=True)
        assert result.returncode == 0, result.stderr
        assert holder.alive()
    assert "not allowed to see which process holds port" in result.stderr
    assert "CAP_SYS_PTRACE and CAP_DAC_READ_SEARCH" in result.stderr
    assert "letting the unit start" in result.stderr


def test_the_capabilities_it_asks_for_are_enough(shared_dir: Path) -> None:
    """nobody with CAP_SYS_PTRACE, CAP_DAC_READ_SEARCH and CAP_KILL stops a stale root process."""
    assert os.geteuid() == 0, "this test drops from root to nobody; run it as root"
    stand_in = SystemctlStandIn(shared_dir)
    port = free_port()
    roster = write_roster(shared_dir, port)
    nobody_can_use(stand_in, roster)
    stand_in.set_unit(
        UNIT, ActiveState="activating", ExecStart=exec_start(sys.executable, *PYTHON_EXEC_ARGS)
    )
    caps = ("sys_ptrace", "dac_read_search", "kill")
    with PythonListener(port) as stale:
        result = guard(stand_in, roster, as_nobody=True, caps=caps)
        assert result.returncode == 0, result.stderr
        stale.process.wait(timeout=5)
    assert f"pid {stale.pid} (python" in result.stderr and "user root (uid 0)" in result.stderr
    assert f"port {port} is free; letting the unit start" in result.stderr


@pytest.mark.parametrize(
    "args", [["restart-unit", "alpha"], ["--ssh"], ["--ssh", "guard-port", "alpha"]]
)
def test_what_is_not_a_verb_is_refused_with_exit_2(args: list[str]) -> None:
    # Once "not built yet"; now every verb exists and anything else is refused (nothing done).
    env = {k: v for k, v in os.environ.items() if k != "SSH_ORIGINAL_COMMAND"}
    result = subprocess.run(
        [NODE, *args], capture_output=True, text=True, timeout=60, check=False, env=env
    )
    assert result.returncode == 2
    assert "refused, nothing was done" in result.stderr
    assert '"ok":false' in result.stdout


def test_a_bad_guard_port_command_line_fails_open() -> None:
    # A typo in ExecStartPre= must not keep a healthy server from starting.
    result = subprocess.run(
        [NODE, "guard-port", "--term-timeout", "0"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0
    assert "bad arguments" in result.stderr and "letting the unit start" in result.stderr


@pytest.mark.parametrize(
    ("cmdline", "argv", "fits"),
    [
        (["llama", "-m", "a.gguf"], ["/usr/bin/llama", "-m", "a.gguf"], True),
        (["llama", "-m", "b.gguf"], ["/usr/bin/llama", "-m", "a.gguf"], False),
        (["x", "--port", "8080"], ["x", "--port", "${PORT}"], True),
        (["x", "--port=8080"], ["x", "--port=${PORT}"], True),
        (["x", "--port", "8080", "extra"], ["x", "--port", "${PORT}"], False),
        (["x", "--port"], ["x", "--port", "${PORT}"], False),  # ${X} is exactly one word
        (["x", "a", "b", "c"], ["x", "$ARGS"], True),
        (["x"], ["x", "$ARGS"], True),  # $X: zero or more words
        (["x", "-m", "m", "a", "b", "--metrics"], ["x", "-m", "${M}", "$A", "--metrics"], True),
        (["x", "-m", "m", "a", "b"], ["x", "-m", "${M}", "$A", "--metrics"], False),
        (["x", "$5"], ["x", "$$5"], True),
        (["python3", "-m", "http.server", "8000"], ["python", "-m", "vllm.x", "$A"], False),
        (["anything", "a"], ["/usr/bin/x", "a"], True),  # argv[0] is not compared
        ([], ["x"], False),
        (["x"], [], False),
    ],
)
def test_what_fits_an_exec_start(cmdline: list[str], argv: list[str], fits: bool) -> None:
    assert fits_exec_start(cmdline, argv) is fits
