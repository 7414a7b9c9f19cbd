"""The unit files of `systemd/`: `systemd-analyze verify`, the properties issue 6 requires, and
the command lines they run, parsed by the real programs' own argument parsers.

systemd is not PID 1 here (nor on CI), so `systemd-analyze verify` runs offline against a
throw-away root (`--root=DIR`): the host's own unit directory is copied into it (the units pull
in `sysinit.target`, `network-online.target`…), our units go to `DIR/etc/systemd/system`, and
*stand-in* executables (a two-line shell script each, named as such in it) sit at the
`ExecStart*=` paths, because verify refuses a command that is not an executable file under the
root. verify exits 0 even after "Unknown key" or an unparsable value (it only logs and ignores
the line), so any output at all counts as a failure; `test_verify_catches_broken_units` proves
each kind is caught. A missing `systemd-analyze` fails the tests, never skips them.
"""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import tomllib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import yaml

from exporter import cli as exporter_cli
from exporter import node
from fleet.roster import DEFAULT_EXPORTER_PORT
from remediator import cli as remediator_cli
from remediator.config import DEFAULT_JOURNAL

REPO = Path(__file__).resolve().parent.parent
SYSTEMD_DIR = REPO / "systemd"
EXPORTER_UNIT = "gpu-fleet-exporter.service"
REMEDIATOR_UNIT = "gpu-fleet-remediator.service"
LLAMA_TEMPLATE = "llama-server@.service"
LLAMA_INSTANCE = "llama-server@alpha.service"
UNITS = (EXPORTER_UNIT, REMEDIATOR_UNIT, LLAMA_TEMPLATE)
ENV_EXAMPLE = SYSTEMD_DIR / "llama-server.env.example"
# Where the host keeps its unit files (Debian: /lib is a symlink to usr/lib).
HOST_UNIT_DIR = Path("/usr/lib/systemd/system")
GHOST_CHECK_CAPABILITIES = {"CAP_SYS_PTRACE", "CAP_DAC_READ_SEARCH"}
# `systemd-analyze security` exposure (0 best, 10 worst) of the units as written, with a little
# room: removing a hardening line pushes a unit over its bound. Measured with Debian 12's
# systemd 252: exporter 2.6, remediator 1.7, llama-server 3.6 (GPU devices, no syscall filter).
EXPOSURE_BOUNDS = {EXPORTER_UNIT: 3.0, REMEDIATOR_UNIT: 2.0, LLAMA_INSTANCE: 4.0}


def systemd_analyze() -> str:
    binary = shutil.which("systemd-analyze")
    if binary is None:
        pytest.fail(
            "systemd-analyze is missing: `make test` installs Debian's systemd package",
            pytrace=False,
        )
    return binary


# -- a unit-file reader -----------------------------------------------------------------------


@dataclass
class Unit:
    """A unit file's settings: section -> key -> every value, in order (keys may repeat)."""

    name: str
    sections: dict[str, dict[str, list[str]]] = field(default_factory=dict)

    def all(self, section: str, key: str) -> list[str]:
        return self.sections.get(section, {}).get(key, [])

    def get(self, section: str, key: str) -> str | None:
        """The effective value of a single-valued setting: the last one (systemd's rule)."""
        values = self.all(section, key)
        return values[-1] if values else None

    def service(self, key: str) -> str | None:
        return self.get("Service", key)


def read_unit(path: Path) -> Unit:
    unit = Unit(path.name)
    section: dict[str, list[str]] | None = None
    pending = ""
    for raw in path.read_text().splitlines():
        line = pending + raw.strip() if pending else raw.strip()
        pending = ""
        if line.endswith("\\"):  # a continuation line (systemd joins them with a space)
            pending = line[:-1] + " "
            continue
        if not line or line[0] in "#;":
            continue
        if line.startswith("[") and line.endswith("]"):
            section = unit.sections.setdefault(line[1:-1], {})
            continue
        assert section is not None, f"{path.name}: {line!r} before any [Section]"
        key, sep, value = line.partition("=")
        assert sep, f"{path.name}: {line!r} is not KEY=VALUE"
        section.setdefault(key.strip(), []).append(value.strip())
    assert not pending, f"{path.name}: ends inside a continuation line"
    return unit


def unit(name: str) -> Unit:
    return read_unit(SYSTEMD_DIR / name)


def words(value: str | None) -> set[str]:
    return set((value or "").split())


def is_true(value: str | None) -> bool:
    return (value or "").lower() in {"yes", "true", "on", "1"}


def command(value: str) -> tuple[str, list[str]]:
    """An `Exec*=` value: its prefix characters (`+`, `-`, `@`…) and its argv."""
    prefix = re.match(r"^[-+@:!]*", value)
    assert prefix is not None
    return prefix.group(0), shlex.split(value[prefix.end() :])


def expand(argv: list[str], env: Mapping[str, str], instance: str) -> list[str]:
    """systemd's expansion of a command line: `%i`, `${VAR}` inside a word (unset: empty) and a
    word that is exactly `$VAR` (split at whitespace; unset or empty: no word at all)."""
    out: list[str] = []
    for raw in argv:
        word = raw.replace("%i", instance)
        whole = re.fullmatch(r"\$([A-Za-z_][A-Za-z0-9_]*)", word)
        if whole:
            out.extend(env.get(whole.group(1), "").split())
            continue
        out.append(re.sub(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}", lambda m: env.get(m[1], ""), word))
    return out


def read_env_file(path: Path) -> dict[str, str]:
    """An `EnvironmentFile=` in the subset our example uses: KEY=VALUE, optionally quoted."""
    env: dict[str, str] = {}
    for number, raw in enumerate(path.read_text().splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        match = re.fullmatch(r"([A-Za-z_][A-Za-z0-9_]*)=(.*)", line)
        assert match, f"{path.name}:{number}: not KEY=VALUE: {raw!r}"
        value = match[2]
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "\"'":
            value = value[1:-1]
        env[match[1]] = value
    return env


def unit_environment(u: Unit) -> dict[str, str]:
    env: dict[str, str] = {}
    for value in u.all("Service", "Environment"):
        for assignment in shlex.split(value):
            key, _, val = assignment.partition("=")
            env[key] = val
    return env


# -- systemd-analyze verify -------------------------------------------------------------------

STAND_IN = """#!/bin/sh
# stand-in for {path}: systemd-analyze verify only checks that an executable is here.
exit 0
"""


def executables(units: list[Path]) -> set[str]:
    paths = set()
    for path in units:
        u = read_unit(path)
        for key in ("ExecStartPre", "ExecStart", "ExecStartPost", "ExecStop", "ExecReload"):
            for value in u.all("Service", key):
                paths.add(command(value)[1][0])
    return paths


def make_root(tmp_path: Path, units: list[Path]) -> Path:
    """A root for `verify --root`: the host's units, ours, and stand-ins at our Exec paths."""
    if not HOST_UNIT_DIR.is_dir():
        pytest.fail(f"{HOST_UNIT_DIR} is missing: is Debian's systemd package installed?")
    root = tmp_path / "root"
    shutil.copytree(HOST_UNIT_DIR, root / HOST_UNIT_DIR.relative_to("/"), symlinks=True)
    unit_dir = root / "etc" / "systemd" / "system"
    unit_dir.mkdir(parents=True)
    for path in units:
        shutil.copy(path, unit_dir / path.name)
    for executable in executables(units):
        assert executable.startswith("/"), f"{executable}: Exec paths must be absolute"
        stand_in = root / executable.lstrip("/")
        stand_in.parent.mkdir(parents=True, exist_ok=True)
        stand_in.write_text(STAND_IN.format(path=executable))
        stand_in.chmod(0o755)
    return root


def verify(root: Path, *names: str) -> list[str]:
    """`systemd-analyze verify` under `root`; returns its complaints (none: the units are fine)."""
    result = subprocess.run(
        [systemd_analyze(), "verify", f"--root={root}", "--man=no", "--generators=no", *names],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    problems = [line for line in (result.stdout + result.stderr).splitlines() if line.strip()]
    if result.returncode != 0 and not problems:
        problems.append(f"exit status {result.returncode} without a message")
    return problems


def our_units() -> list[Path]:
    return [SYSTEMD_DIR / name for name in UNITS]


def test_every_unit_passes_systemd_analyze_verify(tmp_path: Path) -> None:
    root = make_root(tmp_path, our_units())
    # The template is verified as an instance, the way systemd loads it.
    assert verify(root, EXPORTER_UNIT, REMEDIATOR_UNIT, LLAMA_INSTANCE) == []


@pytest.mark.parametrize(
    ("edit", "expected"),
    [
        (lambda text: text.replace("[Service]\n", "[Service]\nRestartSecs=5\n"), "Unknown key"),
        (
            lambda text: text.replace("Restart=on-failure", "Restart=on-failur"),
            "Failed to parse service restart specifier",
        ),
        (
            lambda text: text.replace("ProtectSystem=full", "ProtectSystem=fully"),
            "Failed to parse",
        ),
        (lambda text: text.replace("[Unit]\n", "[Unti]\n", 1), "Unknown section"),
    ],
    ids=["unknown-key", "bad-restart", "bad-protect-system", "unknown-section"],
)
def test_verify_catches_broken_units(
    tmp_path: Path, edit: Callable[[str], str], expected: str
) -> None:
    broken = tmp_path / LLAMA_TEMPLATE
    original = (SYSTEMD_DIR / LLAMA_TEMPLATE).read_text()
    text = edit(original)
    assert text != original, "the edit did not apply: the test would prove nothing"
    broken.write_text(text)
    problems = verify(make_root(tmp_path, [broken]), LLAMA_INSTANCE)
    assert any(expected in line for line in problems), problems


def test_verify_catches_a_missing_executable(tmp_path: Path) -> None:
    root = make_root(tmp_path, our_units())
    (root / "usr" / "local" / "bin" / "llama-server").unlink()
    problems = verify(root, LLAMA_INSTANCE)
    assert any("llama-server is not executable" in line for line in problems), problems


def exposure(root: Path, name: str) -> float:
    result = subprocess.run(
        [systemd_analyze(), "security", "--offline=yes", f"--root={root}", name],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    match = re.search(r"Overall exposure level for \S+: ([0-9.]+)", result.stdout)
    assert match, result.stdout[-2000:] + result.stderr
    return float(match.group(1))


def test_hardening_keeps_the_exposure_low(tmp_path: Path) -> None:
    root = make_root(tmp_path, our_units())
    levels = {name: exposure(root, name) for name in EXPOSURE_BOUNDS}
    assert all(levels[name] <= bound for name, bound in EXPOSURE_BOUNDS.items()), levels


def test_an_unhardened_unit_exceeds_its_bound(tmp_path: Path) -> None:
    # The exposure check above must be able to fail: the exporter without its sandbox lines.
    text = (SYSTEMD_DIR / EXPORTER_UNIT).read_text()
    stripped = "\n".join(
        line
        for line in text.splitlines()
        if not re.match(r"(Protect|Private|Restrict|NoNewPriv|SystemCall|Capability)", line)
    )
    (tmp_path / EXPORTER_UNIT).write_text(stripped + "\n")
    root = make_root(tmp_path, [tmp_path / EXPORTER_UNIT])
    assert exposure(root, EXPORTER_UNIT) > EXPOSURE_BOUNDS[EXPORTER_UNIT]


# -- the properties issue 6 asks for ----------------------------------------------------------


@pytest.mark.parametrize("name", UNITS)
def test_every_unit_restarts_on_failure_within_a_start_limit(name: str) -> None:
    u = unit(name)
    assert u.service("Restart") == "on-failure"
    # The start limit belongs in [Unit] (systemd ignores it in [Service] with a warning).
    interval, burst = u.get("Unit", "StartLimitIntervalSec"), u.get("Unit", "StartLimitBurst")
    assert interval is not None and int(interval) > 0
    assert burst is not None and int(burst) > 0


def number(u: Unit, section: str, key: str) -> int:
    value = u.get(section, key)
    assert value is not None, f"{u.name}: {section}.{key} is missing"
    return int(value)


def test_the_llama_start_limit_stops_a_slow_crash_loop_after_the_hourly_alert() -> None:
    # Issue 19: a 6-minute load, a crash, RestartSec=10 -- 8 restarts in 50 minutes -- must hit
    # the start limit, and only after the hourly LlamaServerCrashLooping (5 restarts) has fired.
    u = unit(LLAMA_TEMPLATE)
    interval = number(u, "Unit", "StartLimitIntervalSec")
    burst = number(u, "Unit", "StartLimitBurst")
    cycle = 6 * 60 + number(u, "Service", "RestartSec")
    assert interval // cycle + 1 > burst, "a 6-minute load-crash loop never reaches the limit"
    # `burst` starts are the first one and burst - 1 restarts: the alert needs 5 restarts.
    assert burst - 1 >= 5, "the unit gives up before the hourly alert's 5th restart"
    assert "nvidia-persistenced.service" in (u.get("Unit", "After") or "").split()


def test_the_remediator_retries_a_passing_outage_for_ever() -> None:
    # Restart= alone never reaches the start limit: starts are RestartSec apart at the least.
    u = unit(REMEDIATOR_UNIT)
    interval = number(u, "Unit", "StartLimitIntervalSec")
    burst = number(u, "Unit", "StartLimitBurst")
    assert interval // number(u, "Service", "RestartSec") + 1 < burst


@pytest.mark.parametrize("name", UNITS)
def test_every_unit_runs_unprivileged_and_sandboxed(name: str) -> None:
    u = unit(name)
    assert u.service("User") not in (None, "root", "0")
    assert is_true(u.service("NoNewPrivileges"))
    assert u.service("ProtectSystem") in ("strict", "full")
    assert u.service("DevicePolicy") == "closed"
    # Only the remediator may hide /dev: the others need the GPUs' device nodes.
    assert is_true(u.service("PrivateDevices")) == (name == REMEDIATOR_UNIT)


def test_the_exporter_has_exactly_the_ghost_check_capabilities() -> None:
    u = unit(EXPORTER_UNIT)
    assert words(u.service("AmbientCapabilities")) == GHOST_CHECK_CAPABILITIES
    assert words(u.service("CapabilityBoundingSet")) == GHOST_CHECK_CAPABILITIES
    assert u.service("User") not in (None, unit(LLAMA_TEMPLATE).service("User"))
    # It reads other users' /proc/PID: these would hide exactly what the ghost check needs.
    assert u.service("ProtectProc") in (None, "default")
    assert u.service("ProcSubset") in (None, "all")
    assert any(value.startswith("char-nvidia") for value in u.all("Service", "DeviceAllow"))


def test_the_remediator_has_no_capabilities_and_owns_the_journal_directory() -> None:
    u = unit(REMEDIATOR_UNIT)
    assert u.service("CapabilityBoundingSet") == ""
    assert u.service("AmbientCapabilities") in (None, "")
    # The default journal (sqlite:////var/lib/gpu-fleet/journal.db) must be in the one
    # directory the sandbox lets it write.
    state = u.service("StateDirectory")
    assert state is not None
    assert DEFAULT_JOURNAL.startswith(f"sqlite:////var/lib/{state}/"), (DEFAULT_JOURNAL, state)


def test_the_llama_template_guards_its_port_and_caps_generation() -> None:
    u = unit(LLAMA_TEMPLATE)
    pre = [command(value) for value in u.all("Service", "ExecStartPre")]
    guards = [(p, argv) for p, argv in pre if argv[1:3] == ["guard-port", "%i"]]
    assert len(guards) == 1, pre
    prefix, argv = guards[0]
    assert Path(argv[0]).name == "gpu-fleet-node"
    # "+": the guard runs as root, outside the sandbox, so it can see and signal a stale
    # process of another user; User=llama has no capabilities at all.
    assert "+" in prefix
    assert u.service("CapabilityBoundingSet") == ""

    (start,) = u.all("Service", "ExecStart")
    _, argv = command(start)
    # The binary itself (the guard matches a stale process by the executable's path).
    assert argv[0] == "/usr/local/bin/llama-server"
    assert "--metrics" in argv
    assert "--port" in argv and argv[argv.index("--port") + 1]
    assert "-n" in argv and argv[argv.index("-n") + 1]
    assert u.service("EnvironmentFile") == "/etc/gpu-fleet/llama-server/%i.env"  # required


def test_the_llama_template_keeps_what_mps_and_models_under_home_need() -> None:
    u = unit(LLAMA_TEMPLATE)
    # MPS clients reach the daemon through its pipe directory under /tmp.
    assert not is_true(u.service("PrivateTmp"))
    assert u.service("ProtectSystem") == "full"
    # Models under /home must stay visible (yes and tmpfs hide /home).
    assert u.service("ProtectHome") in (None, "no", "false", "read-only")
    # RemoveIPC would delete the MPS daemon's and sibling instances' IPC (same user).
    assert not is_true(u.service("RemoveIPC"))
    allowed = {value.split()[0] for value in u.all("Service", "DeviceAllow")}
    assert allowed == {"char-nvidia*", "char-drm", "char-kfd"}


# -- the command lines, as the programs themselves parse them ---------------------------------


def test_exec_paths_are_the_venvs_console_scripts() -> None:
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    for path in executables(our_units()):
        if path == "/usr/local/bin/llama-server":
            continue
        assert Path(path).parent == Path("/opt/gpu-fleet/bin"), path
        assert Path(path).name in scripts, path


def test_the_exporter_command_line_parses() -> None:
    u = unit(EXPORTER_UNIT)
    (start,) = u.all("Service", "ExecStart")
    _, argv = command(start)
    args = exporter_cli._parser().parse_args(expand(argv, {}, "")[1:])
    assert str(args.config) == "/etc/gpu-fleet/fleet.yaml"
    assert args.listen_address == f":{DEFAULT_EXPORTER_PORT}"
    assert args.web_config_file is None
    # The documented way to add flags: EXPORTER_ARGS in /etc/gpu-fleet/exporter.env.
    assert u.all("Service", "EnvironmentFile") == ["-/etc/gpu-fleet/exporter.env"]
    extra = {"EXPORTER_ARGS": "--web.config.file /etc/gpu-fleet/web-config.yml"}
    args = exporter_cli._parser().parse_args(expand(argv, extra, "")[1:])
    assert str(args.web_config_file) == "/etc/gpu-fleet/web-config.yml"


def test_the_remediator_command_line_parses() -> None:
    (start,) = unit(REMEDIATOR_UNIT).all("Service", "ExecStart")
    _, argv = command(start)
    args = remediator_cli._parser().parse_args(expand(argv, {}, "")[1:])
    assert args.command == "serve"
    assert str(args.config) == "/etc/gpu-fleet/remediator.yaml"


def test_the_guard_command_line_parses() -> None:
    u = unit(LLAMA_TEMPLATE)
    (guard,) = (v for v in u.all("Service", "ExecStartPre") if "guard-port" in v)
    _, argv = command(guard)
    # The guard's parser raises on a bad flag (its main() then lets the unit start: a typo
    # here would silently disable the guard, so it is caught here instead).
    args = node._parser().parse_args(expand(argv, {}, "alpha")[1:])
    assert args.verb == "guard-port" and args.server == "alpha"
    assert str(args.config) == "/etc/gpu-fleet/fleet.yaml"


def llama_command_line() -> list[str]:
    """The template's ExecStart as systemd runs it for `alpha` with the example env file."""
    u = unit(LLAMA_TEMPLATE)
    env = unit_environment(u) | read_env_file(ENV_EXAMPLE)  # the file overrides Environment=
    (start,) = u.all("Service", "ExecStart")
    _, argv = command(start)
    used = set(re.findall(r"\$\{?([A-Za-z_][A-Za-z0-9_]*)", start))
    missing = sorted(used - env.keys())
    assert not missing, f"ExecStart uses variables neither the unit nor the example sets: {missing}"
    return expand(argv, env, "alpha")


def test_the_example_env_file_matches_the_example_roster() -> None:
    argv = llama_command_line()
    roster = yaml.safe_load((REPO / "examples" / "fleet.yaml").read_text())
    server = roster["hosts"]["dioscuri"]["servers"]["alpha"]
    # The port the server binds is the one the guard and the exporter take from the roster.
    assert argv[argv.index("--port") + 1] == str(urlsplit(server["url"]).port)
    assert server["unit"] == LLAMA_INSTANCE
    assert all(word for word in argv), argv  # no variable expanded to an empty argument


def test_the_real_llama_server_knows_every_flag(llama_binary: Path) -> None:
    # The pinned llama-server build (the one the lab runs) must accept every flag the template
    # and the example pass; a renamed flag would crash-loop every instance.
    result = subprocess.run(
        [str(llama_binary), "--help"], capture_output=True, text=True, timeout=60, check=False
    )
    assert result.returncode == 0, result.stderr[-2000:]
    help_text = result.stdout + result.stderr
    flags = [word for word in llama_command_line()[1:] if re.fullmatch(r"--?[a-z][a-z-]*", word)]
    assert {"--metrics", "--port", "-n", "--host", "-m"} <= set(flags)
    unknown = [
        flag
        for flag in flags
        if not re.search(rf"(^|[\s,]){re.escape(flag)}([\s,=]|$)", help_text, re.MULTILINE)
    ]
    assert not unknown, f"llama-server --help does not list {unknown}"
