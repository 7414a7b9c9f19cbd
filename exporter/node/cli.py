"""`gpu-fleet-node`'s command line: the `--ssh` forced-command mode and the plain subcommands.

Both ends meet in `execute`: the request (verb and argument tokens, `exporter.node.protocol`)
is checked against the roster section of *this* host before anything is done, then run, and
answered with one JSON line on stdout; the log line goes to stderr (and, under `--ssh`, to
syslog, so that the host keeps its own record of what it was asked and what it refused).
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import syslog
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NoReturn

from exporter.node import gpus as gpu_verbs
from exporter.node import units
from exporter.node.guard import (
    DEFAULT_FREE_TIMEOUT,
    DEFAULT_TERM_TIMEOUT,
    GOOD_OUTCOMES,
    REFUSED,
    STILL_HELD,
    Log,
    guard_port,
)
from exporter.node.protocol import (
    EXIT_DONE,
    EXIT_FAILED,
    EXIT_REFUSED,
    TOKEN,
    VERBS,
    Failed,
    Refused,
    Reply,
    Request,
    check_tokens,
    parse_tokens,
    show,
)
from exporter.sources.nvml import load_backend
from exporter.sources.procnet import ProcNetError
from exporter.sources.systemd import SystemdError
from fleet.gpu_index import normalize_pci_bus_id
from fleet.roster import (
    DEFAULT_ROSTER_PATH,
    Host,
    PowerBounds,
    Roster,
    RosterError,
    Server,
    load_roster,
    resolve_host_name,
)

SERVER_VERBS = ("status", "evidence", "restart", "stop", "start", "guard-port")
DEFAULT_WAIT_SECONDS = 30.0
_GPU = re.compile(r"^[0-9]{1,3}$")
_WATTS = re.compile(r"^[0-9]{1,5}$")
# Options that take a value (to find the verb in a command line argparse refused).
_VALUE_OPTIONS = frozenset(
    {
        "--config",
        "--host",
        "--sysfs",
        "--state-dir",
        "--wait-seconds",
        "--nvml.fake-scenario",
        "--term-timeout",
        "--free-timeout",
    }
)


class _ArgumentError(Exception):
    """A bad command line (reported by `main`, which decides the exit code)."""


class _Parser(argparse.ArgumentParser):
    """An argument parser that raises instead of exiting 2.

    A typo in an `ExecStartPre=` line must not keep a healthy server from starting: the guard
    reports it loudly and lets the unit start; every other verb refuses with a JSON answer.
    """

    def error(self, message: str) -> NoReturn:
        raise _ArgumentError(message)


def _seconds(text: str) -> float:
    value = float(text)
    if not 0 < value <= 600:
        raise ValueError(text)
    return value


_seconds.__name__ = "seconds"  # argparse names the type in its error: "invalid seconds value"


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="gpu-fleet-node",
        description="Host-side helper of gpu-fleet: allow-listed actions on this host's roster "
        "servers and GPUs, and the ExecStartPre= port guard.",
    )
    parser.add_argument(
        "--config",
        type=Path,
        default=DEFAULT_ROSTER_PATH,
        help=f"the roster (default {DEFAULT_ROSTER_PATH})",
    )
    parser.add_argument(
        "--host",
        default=None,
        help="which roster host this is (default: /etc/gpu-fleet/host, else the hostname)",
    )
    parser.add_argument(
        "--ssh",
        action="store_true",
        help="forced-command mode: take the verb and its arguments from SSH_ORIGINAL_COMMAND",
    )
    parser.add_argument("--sysfs", default="/sys", help="sysfs root (default /sys)")
    parser.add_argument(
        "--state-dir",
        type=Path,
        default=gpu_verbs.DEFAULT_STATE_DIR,
        help=f"where power caps to restore are recorded (default {gpu_verbs.DEFAULT_STATE_DIR})",
    )
    parser.add_argument(
        "--wait-seconds",
        type=_seconds,
        default=DEFAULT_WAIT_SECONDS,
        help="how long start/stop/restart wait for the unit's new state "
        f"(default {DEFAULT_WAIT_SECONDS:g})",
    )
    parser.add_argument(
        "--nvml.fake-scenario",
        dest="nvml_fake_scenario",
        type=Path,
        default=None,
        metavar="FILE",
        help="STAND-IN FOR A GPU: answer NVML calls from this fake-NVML scenario file instead of "
        "the driver (tests and demos only; never on a production host)",
    )
    sub = parser.add_subparsers(dest="verb", metavar="VERB", parser_class=_Parser)
    helps = {
        "status": "the unit's state and who listens on the server's port",
        "evidence": "status, port owners, main process, recent journal lines, GPU processes",
        "restart": "systemctl restart the server's unit, wait for a new main process",
        "stop": "systemctl stop the server's unit, wait until it is down",
        "start": "systemctl start the server's unit, wait until it is active",
    }
    for verb, text in helps.items():
        sub.add_parser(verb, help=text).add_argument("server", metavar="SERVER")
    guard = sub.add_parser(
        "guard-port",
        help="free a server's port from a stale process of its own program (ExecStartPre=)",
        description="Clear a stale process of the unit's own program from the server's port; "
        "refuse (exit 1) when another program holds it; exit 0 when the guard cannot check.",
    )
    guard.add_argument("server", metavar="SERVER", help="the server's name in the roster")
    # Also after the verb, as the unit template writes them (`guard-port %i --config ...`).
    # SUPPRESS: an option not given here must not reset the one given before the verb.
    guard.add_argument("--config", type=Path, default=argparse.SUPPRESS, help="the roster")
    guard.add_argument("--host", default=argparse.SUPPRESS, help="which roster host this is")
    guard.add_argument(
        "--term-timeout",
        type=_seconds,
        default=DEFAULT_TERM_TIMEOUT,
        help=f"seconds from SIGTERM to SIGKILL (default {DEFAULT_TERM_TIMEOUT:g})",
    )
    guard.add_argument(
        "--free-timeout",
        type=_seconds,
        default=DEFAULT_FREE_TIMEOUT,
        help=f"seconds to wait for the port to be free (default {DEFAULT_FREE_TIMEOUT:g})",
    )
    cap = sub.add_parser("power-cap", help="set a GPU's power cap within the roster's bounds")
    cap.add_argument("gpu", metavar="GPU", help="the `gpu` index")
    cap.add_argument("watts", metavar="WATTS")
    cap.add_argument("pci_bus_id", metavar="PCI_BUS_ID", help="the GPU's bus id: 0000:41:00.0")
    sub.add_parser(
        "check-config",
        help="check the roster and this host's section in it; exit 0 (good) or 2",
        description="Read and validate the roster and find this host in it, nothing else: no "
        "systemctl, no NVML, no device, no network. Not a remote verb (refused under --ssh).",
    )
    restore = sub.add_parser("power-cap-restore", help="set a GPU's recorded power cap back")
    restore.add_argument("gpu", metavar="GPU", help="the `gpu` index")
    restore.add_argument("pci_bus_id", metavar="PCI_BUS_ID", help="the GPU's bus id")
    return parser


def _positionals(args: Sequence[str]) -> list[str]:
    """The words of a command line that are not options or option values."""
    found, skip = [], False
    for arg in args:
        if skip:
            skip = False
        elif arg in _VALUE_OPTIONS:
            skip = True
        elif not arg.startswith("-"):
            found.append(arg)
    return found


def _repeated_option(args: Sequence[str]) -> str | None:
    """An option given twice: under sudo a second `--config` could swap the allow-list."""
    seen: set[str] = set()
    for arg in args:
        if arg.startswith("--"):
            name = arg.split("=", 1)[0]
            if name in seen:
                return name
            seen.add(name)
    return None


def main(argv: Sequence[str] | None = None) -> int:
    """Run `gpu-fleet-node`; returns the exit status."""
    args = list(sys.argv[1:] if argv is None else argv)
    ssh = "--ssh" in args
    words = _positionals(args)
    try:
        options = _parser().parse_args(args)
    except _ArgumentError as exc:
        if words[:1] == ["guard-port"] and not ssh:
            # As ExecStartPre=: a typo must not keep a healthy server from starting.
            server = words[1] if len(words) > 1 else "?"
            Log(server).cannot_check(f"bad arguments: {exc}")
            return EXIT_DONE
        return _answer(_refusal(words, f"bad command line: {exc}"), ssh=ssh)
    if options.ssh:
        repeated = _repeated_option(args)
        if options.verb is not None:
            why = "--ssh takes the command from SSH_ORIGINAL_COMMAND, not from its own arguments"
            return _answer(_refusal([], why), ssh=True)
        if repeated is not None:
            why = f"{repeated} is given twice in the forced command: check authorized_keys"
            return _answer(_refusal([], why), ssh=True)
        command = os.environ.get("SSH_ORIGINAL_COMMAND")
        try:
            request = parse_tokens(command)
        except Refused as exc:
            what = "" if command is None else f" (SSH_ORIGINAL_COMMAND={show(command)})"
            return _answer(_refusal(_safe_words(command), f"{exc}{what}"), ssh=True)
        return _answer(execute(request, options), ssh=True)
    if options.verb is None:
        return _answer(_refusal([], f"no verb given; the verbs are: {', '.join(VERBS)}"), ssh=False)
    if options.verb == "guard-port":
        return _plain_guard_port(options)
    if options.verb == "check-config":
        return _answer(check_config(options.config, options.host), ssh=False)
    try:
        request = check_tokens(words)
    except Refused as exc:
        return _answer(_refusal(words, str(exc)), ssh=False)
    return _answer(execute(request, options), ssh=False)


def check_config(config: Path, host: str | None) -> Reply:
    """`check-config`: the roster validated and this host found in it, or why not (exit 2)."""
    reply = Reply(verb="check-config", args=[], host="")
    try:
        roster = load_roster(config)
        host_name = resolve_host_name(roster, host)
    except RosterError as exc:
        reply.error = str(exc)
        return reply
    entry = roster.hosts[host_name]
    reply.host, reply.ok, reply.exit_code = host_name, True, EXIT_DONE
    reply.result = {
        "roster": str(config),
        "servers": sorted(entry.servers),
        "power_cap_gpus": sorted(str(key) for key in entry.power_cap_watts),
        "pci_bus_ids": entry.gpus.expected_pci_bus_ids(),
    }
    return reply


def _safe_words(command: str | None) -> list[str]:
    """The words of a refused command that are safe to echo in the JSON answer (the verb)."""
    first = (command or "").split(" ")[0]
    return [first] if TOKEN.fullmatch(first) else []


def _refusal(words: Sequence[str], why: str, host: str = "") -> Reply:
    verb = words[0] if words and TOKEN.fullmatch(words[0]) else ""
    args = [w for w in words[1:] if TOKEN.fullmatch(w)] if verb else []
    return Reply(verb=verb, args=args, host=host, error=why, exit_code=EXIT_REFUSED)


def _answer(reply: Reply, *, ssh: bool) -> int:
    """Print the JSON answer, log the line; the exit status."""
    print(reply.to_json(), flush=True)
    request = " ".join([reply.verb, *reply.args]).strip() or "(no valid request)"
    if reply.exit_code == EXIT_DONE:
        line = f"{request}: done"
    elif reply.exit_code == EXIT_FAILED:
        line = f"{request}: failed: {reply.error}"
    else:
        line = f"{request}: refused, nothing was done: {reply.error}"
    print(f"gpu-fleet-node: {line}", file=sys.stderr, flush=True)
    if ssh:
        priority = syslog.LOG_INFO if reply.exit_code == EXIT_DONE else syslog.LOG_WARNING
        syslog.openlog("gpu-fleet-node", syslog.LOG_PID, syslog.LOG_AUTH)
        syslog.syslog(priority, f"--ssh {line}"[:2000])
        syslog.closelog()
    return reply.exit_code


def _plain_guard_port(options: argparse.Namespace) -> int:
    """`guard-port` as a plain subcommand: today's semantics (fail open), plus the JSON line.

    Exit 1 only when the port is held by what the guard may not kill (or stays held); when the
    guard cannot check it exits 0 so that the unit starts, and `ok: false` says so.
    """
    result = guard_port(
        options.server,
        config=options.config,
        host=options.host,
        term_timeout=options.term_timeout,
        free_timeout=options.free_timeout,
    )
    ok = result.outcome in GOOD_OUTCOMES
    reply = Reply(
        verb="guard-port",
        args=[options.server] if TOKEN.fullmatch(options.server) else [],
        host=options.host or "",
        ok=ok,
        result=result.as_dict(),
        error=None if ok else (result.log[-1] if result.log else result.outcome),
        exit_code=EXIT_FAILED if result.outcome in (REFUSED, STILL_HELD) else EXIT_DONE,
    )
    print(reply.to_json(), flush=True)
    return reply.exit_code


# ---------------------------------------------------------------------------------------------
# Checking a request against the roster, and running it
# ---------------------------------------------------------------------------------------------


def _server(roster: Roster, host_name: str, name: str) -> Server:
    servers = roster.hosts[host_name].servers
    server = servers.get(name)
    if server is not None:
        return server
    elsewhere = sorted(h for h, host in roster.hosts.items() if name in host.servers)
    known = ", ".join(sorted(servers)) or "none"
    if elsewhere:
        raise Refused(
            f"server {name!r} belongs to host {elsewhere[0]!r}, not to this host "
            f"{host_name!r} (its servers: {known})"
        )
    raise Refused(f"host {host_name!r} has no server {name!r} (its servers: {known})")


def _gpu_bounds(
    host: Host, host_name: str, text: str, bus_text: str
) -> tuple[int, str, PowerBounds]:
    if not _GPU.match(text):
        raise Refused(f"GPU must be a gpu index (a number), not {show(text)}")
    index = int(text)
    try:
        bus_id = normalize_pci_bus_id(bus_text)
    except ValueError:
        raise Refused(
            f"PCI_BUS_ID must be a PCI bus id (0000:41:00.0), not {show(bus_text)}"
        ) from None
    # By the bus id the request names: if it is not this host's GPU `index`, the request is
    # refused once the GPUs are read, before anything changes.
    bounds = host.power_bounds(index, bus_id)
    if bounds is None:
        allowed = ", ".join(sorted(str(key) for key in host.power_cap_watts)) or "none"
        raise Refused(
            f"GPU {index} ({bus_id}) has no power_cap_watts bounds in the roster for host "
            f"{host_name!r}: power capping is not allowed for it (allowed GPUs: {allowed})"
        )
    return index, bus_id, bounds


def _watts(text: str, bounds: PowerBounds, index: int) -> int:
    if not _WATTS.match(text):
        raise Refused(f"WATTS must be a whole number of watts, not {show(text)}")
    watts = int(text)
    if not bounds.min <= watts <= bounds.max:
        raise Refused(
            f"{watts} W is outside the roster's bounds for GPU {index}: "
            f"{bounds.min:g}-{bounds.max:g} W"
        )
    return watts


def execute(request: Request, options: argparse.Namespace) -> Reply:
    """Check `request` against this host's roster section and run it; the answer."""
    reply = Reply(verb=request.verb, args=list(request.args), host="")
    try:
        roster = load_roster(options.config)
        host_name = resolve_host_name(roster, options.host)
    except RosterError as exc:
        reply.error = f"cannot use the roster: {exc}"
        return reply
    reply.host = host_name
    try:
        reply.result = _run(request, options, roster, host_name)
    except Refused as exc:
        reply.error, reply.exit_code = str(exc), EXIT_REFUSED
        return reply
    except Failed as exc:
        reply.error, reply.exit_code, reply.result = str(exc), EXIT_FAILED, exc.result
        return reply
    reply.ok, reply.exit_code = True, EXIT_DONE
    return reply


def _run(
    request: Request,
    options: argparse.Namespace,
    roster: Roster,
    host_name: str,
) -> dict[str, Any]:
    host = roster.hosts[host_name]
    roots = units.Roots(sysfs=options.sysfs)
    verb, args = request.verb, request.args
    if verb in SERVER_VERBS:
        server = _server(roster, host_name, args[0])
        siblings = host.servers
        if verb == "status":
            try:
                return units.unit_status(server, siblings, roots)
            except (SystemdError, ProcNetError) as exc:
                raise Failed(str(exc)) from None
        if verb == "evidence":
            return units.evidence(
                server, siblings, roots, lambda: _gpu_processes(options, host, roots)
            )
        if verb == "guard-port":
            return _guard(args[0], options, host_name)
        try:
            return units.unit_job(
                verb, server, siblings, wait_seconds=options.wait_seconds, roots=roots
            )
        except units.JobFailed as exc:
            raise Failed(str(exc), exc.result) from None
        except (SystemdError, ProcNetError) as exc:
            raise Failed(f"cannot read {server.unit} before acting: {exc}") from None
    index, bus_id, bounds = _gpu_bounds(host, host_name, args[0], args[-1])
    watts = _watts(args[1], bounds, index) if verb == "power-cap" else None
    devices = _open_gpus(options, host)
    try:
        if watts is not None:
            return gpu_verbs.power_cap(
                devices, index, bus_id, watts, bounds=bounds, state_dir=options.state_dir
            )
        return gpu_verbs.power_cap_restore(devices, index, bus_id, options.state_dir)
    except gpu_verbs.GpuError as exc:
        raise Failed(str(exc)) from None
    finally:
        devices.close()


def _open_gpus(options: argparse.Namespace, host: Host) -> gpu_verbs.Gpus:
    try:
        backend = load_backend(options.nvml_fake_scenario)
    except ValueError as exc:  # the fake's ScenarioError (not imported: production never loads it)
        raise Refused(f"--nvml.fake-scenario: {exc}") from None
    try:
        return gpu_verbs.Gpus(
            backend, sysfs=options.sysfs, expected=host.gpus.expected_pci_bus_ids()
        )
    except gpu_verbs.GpuError as exc:
        raise Failed(str(exc)) from None


def _gpu_processes(
    options: argparse.Namespace, host: Host, roots: units.Roots
) -> list[dict[str, Any]]:
    try:
        devices = _open_gpus(options, host)
    except (Refused, Failed) as exc:
        raise ValueError(str(exc)) from None
    try:
        return gpu_verbs.gpu_processes(devices, host.servers, roots.procfs, roots.sysfs)
    except gpu_verbs.GpuError as exc:
        raise ValueError(str(exc)) from None
    finally:
        devices.close()


def _guard(server: str, options: argparse.Namespace, host_name: str) -> dict[str, Any]:
    """`guard-port` as a remediator verb: anything but a usable port is a failure (exit 1)."""
    result = guard_port(
        server,
        config=options.config,
        host=host_name,
        term_timeout=getattr(options, "term_timeout", DEFAULT_TERM_TIMEOUT),
        free_timeout=getattr(options, "free_timeout", DEFAULT_FREE_TIMEOUT),
    )
    if result.outcome not in GOOD_OUTCOMES:
        why = result.log[-1] if result.log else result.outcome
        raise Failed(f"guard-port {server}: {result.outcome}: {why}", result.as_dict())
    return result.as_dict()
