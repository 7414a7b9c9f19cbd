"""`gpu-fleet-remediator`: serve, check-config, replay, runs, roster file-sd, init-config.

    gpu-fleet-remediator serve --config FILE
    gpu-fleet-remediator check-config --config FILE
    gpu-fleet-remediator replay FILE.json --config FILE [--dry-run]
    gpu-fleet-remediator runs --config FILE [--limit N] [--json] [--waiting]
    gpu-fleet-remediator status --config FILE [--host HOST] [--json] [--color auto|always|never]
    gpu-fleet-remediator roster file-sd (--roster FILE | --config FILE)
    gpu-fleet-remediator init-config DIR [--roster FILE]

What people do, journaled with who (`cli:$USER`) and why (`--reason`):

    gpu-fleet-remediator pause|resume --config FILE [--reason TEXT]
    gpu-fleet-remediator maintenance HOST on|off --config FILE [--until TIME] [--reason TEXT]
    gpu-fleet-remediator breaker reset TARGET --config FILE [--reason TEXT]
    gpu-fleet-remediator escalation ack EVENT_ID --config FILE [--reason TEXT]
    gpu-fleet-remediator cancel RUN_ID --config FILE [--reason TEXT]

A config, roster or playbook that is not valid stops the command with exit status 2 and one
line per problem, each naming the file and the key path.

`status` exits 0 when it read both Prometheus and the journal, 3 when Prometheus could not be
read (it says so; the journal's part is shown, the fleet's values are unknown), 1 when the
journal could not be read (the fleet's part is shown), 2 for a bad config or an unknown
`--host`. Colour only on a terminal (`--color auto`, the default), never with `NO_COLOR` set.
"""

from __future__ import annotations

import argparse
import getpass
import json
import logging
import os
import re
import secrets
import signal
import sys
from datetime import datetime
from pathlib import Path
from types import FrameType

from fleet.roster import RosterError, load_roster
from remediator.alerts import as_utc
from remediator.config import ConfigError, RemediatorConfig, load_config
from remediator.journal import JournalError, RunRecord, RunStateError
from remediator.playbooks.loader import PlaybookError, load_playbooks
from remediator.service import Services, build_services

log = logging.getLogger("gpu-fleet-remediator")

EXIT_CONFIG = 2
EXIT_RUNTIME = 1
EXIT_PARTIAL = 3
"""`status`: Prometheus could not be read; the journal's part was shown."""
STATUS_PROMETHEUS_TIMEOUT_SECONDS = 5.0
DEFAULT_CONFIG = Path("/etc/gpu-fleet/remediator.yaml")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="gpu-fleet-remediator",
        description="Alertmanager webhooks -> playbooks -> actions -> verification -> reports.",
    )
    p.add_argument("--log.level", dest="log_level", default="info",
                   choices=["debug", "info", "warning", "error"])  # fmt: skip
    sub = p.add_subparsers(dest="command", required=True)

    def with_config(cmd: argparse.ArgumentParser) -> argparse.ArgumentParser:
        cmd.add_argument("--config", type=Path, default=DEFAULT_CONFIG,
                         help=f"the remediator's config (default {DEFAULT_CONFIG})")  # fmt: skip
        return cmd

    with_config(sub.add_parser("serve", help="serve the webhook and run playbooks"))
    with_config(sub.add_parser("check-config", help="validate config, roster and playbooks"))
    replay = with_config(sub.add_parser("replay", help="feed a saved webhook payload through"))
    replay.add_argument("payload", type=Path, help="a saved Alertmanager webhook body (JSON)")
    replay.add_argument("--live", action="store_true",
                        help="admit it into the live journal and act for real (default: a "
                        "sandbox: an in-memory journal, nothing acts)")  # fmt: skip
    replay.add_argument("--dry-run", action="store_true",
                        help="with --live: journal what would run, run none")  # fmt: skip
    runs = with_config(sub.add_parser("runs", help="recent runs, as a table"))
    runs.add_argument("--limit", type=int, default=20)
    runs.add_argument("--json", action="store_true", help="JSON instead of a table")
    runs.add_argument("--waiting", action="store_true", help="only the runs that wait")
    status = with_config(sub.add_parser("status", help="the fleet at a glance"))
    status.add_argument("--host", help="only this host (a roster name)")
    status.add_argument("--json", action="store_true", help="JSON instead of a table")
    status.add_argument(
        "--color",
        choices=["auto", "always", "never"],
        default="auto",
        help="colour the table: auto = only on a terminal, and not with NO_COLOR set",
    )

    def acting(cmd: argparse.ArgumentParser) -> argparse.ArgumentParser:
        cmd.add_argument("--reason", default="", help="why (journaled with who did it)")
        return with_config(cmd)

    acting(sub.add_parser("pause", help="pause all remediation (runs wait)"))
    acting(sub.add_parser("resume", help="resume remediation"))
    maint = acting(sub.add_parser("maintenance", help="put a host in maintenance or take it out"))
    maint.add_argument("host")
    maint.add_argument("state", choices=["on", "off"])
    maint.add_argument("--until", type=_time, help="when it ends by itself (RFC 3339, UTC)")
    breaker = sub.add_parser("breaker", help="circuit breakers")
    breaker_sub = breaker.add_subparsers(dest="breaker_command", required=True)
    reset = acting(breaker_sub.add_parser("reset", help="close a target's open breaker"))
    reset.add_argument("target", help="the target key, e.g. server/dioscuri/alpha")
    escalation = sub.add_parser("escalation", help="escalations")
    escalation_sub = escalation.add_subparsers(dest="escalation_command", required=True)
    ack = acting(escalation_sub.add_parser("ack", help="acknowledge an escalation"))
    ack.add_argument("event_id", type=int, help="the escalation's event id")
    cancel = acting(sub.add_parser("cancel", help="cancel a run that waits or is queued"))
    cancel.add_argument("run_id", type=int)
    roster = sub.add_parser("roster", help="roster helpers")
    roster_sub = roster.add_subparsers(dest="roster_command", required=True)
    file_sd = roster_sub.add_parser("file-sd", help="Prometheus file_sd JSON for the exporters")
    source = file_sd.add_mutually_exclusive_group()
    source.add_argument("--roster", type=Path, help="the roster (fleet.yaml)")
    source.add_argument("--config", type=Path, help="the remediator's config (for its roster)")
    init = sub.add_parser("init-config", help="write a local config with fresh secret files")
    init.add_argument("directory", type=Path)
    init.add_argument("--roster", type=Path, help="the roster it points at")
    return p


def _load(path: Path) -> RemediatorConfig:
    return load_config(path)


def _time(text: str) -> datetime:
    try:
        return as_utc(datetime.fromisoformat(text))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not an RFC 3339 time: {exc}") from None


_ACTS = ("pause", "resume", "maintenance", "breaker", "escalation", "cancel")


def main(argv: list[str] | None = None) -> int:
    """Run a subcommand; returns the exit status."""
    args = _parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    try:
        if args.command == "roster":
            return _file_sd(args)
        if args.command == "init-config":
            return _init_config(args.directory, args.roster)
        config = _load(args.config)
        if args.command == "check-config":
            return _check(config)
        if args.command == "status":
            return _status(config, args)
        if args.command == "replay":
            config = _replay_config(config, live=args.live)
        sandbox = args.command == "replay" and not args.live
        services = build_services(
            config,
            with_engine=args.command in ("serve", "replay"),
            dry_run=True if getattr(args, "dry_run", False) or sandbox else None,
        )
        if args.command in _ACTS:
            try:
                return _act(services, args)
            finally:
                services.close()
    except (ConfigError, RosterError, PlaybookError) as exc:
        print(f"gpu-fleet-remediator: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    except JournalError as exc:
        print(f"gpu-fleet-remediator: journal: {exc}", file=sys.stderr)
        return EXIT_RUNTIME
    try:
        if args.command == "serve":
            return _serve(services)
        if args.command == "replay":
            return _replay(services, args.payload, live=args.live)
        return _runs(services, args.limit, as_json=args.json, waiting=args.waiting)
    finally:
        services.close()


def _act(services: Services, args: argparse.Namespace) -> int:
    """A person's act on the journal, as the admin API does it; journaled with who and why."""
    journal = services.journal
    who = f"cli:{getpass.getuser()}"
    reason = args.reason
    try:
        if args.command in ("pause", "resume"):
            journal.set_paused(args.command == "pause", by=who, reason=reason)
            print(f"remediation {'paused' if args.command == 'pause' else 'resumed'}")
        elif args.command == "maintenance":
            if args.host not in services.roster.hosts:
                print(f"gpu-fleet-remediator: no host {args.host!r} in the roster", file=sys.stderr)
                return EXIT_CONFIG
            journal.set_maintenance(args.host, args.state == "on", by=who, reason=reason,
                                    until=args.until)  # fmt: skip
            print(f"host {args.host}: maintenance {args.state}")
        elif args.command == "breaker":
            if not journal.reset_breaker(args.target, by=who, reason=reason):
                print(f"gpu-fleet-remediator: the breaker of {args.target} is not open",
                      file=sys.stderr)  # fmt: skip
                return EXIT_RUNTIME
            print(f"breaker of {args.target} reset")
        elif args.command == "escalation":
            journal.acknowledge(args.event_id, by=who, reason=reason)
            print(f"escalation {args.event_id} acknowledged")
        else:
            journal.cancel_run(args.run_id, by=who, reason=reason)
            print(f"run {args.run_id} cancelled")
    except RunStateError as exc:
        print(f"gpu-fleet-remediator: {exc}", file=sys.stderr)
        return EXIT_RUNTIME
    return 0


def _check(config: RemediatorConfig) -> int:
    roster = load_roster(config.roster)
    playbooks = load_playbooks(config.playbooks_dir)
    print(
        f"ok: config {config.listen}, roster {config.roster} ({len(roster.hosts)} hosts), "
        f"{len(playbooks)} playbooks ({', '.join(p.name for p in playbooks)})"
    )
    return 0


def _serve(services: Services) -> int:
    from remediator.front import make_front  # noqa: PLC0415 - only `serve` needs it
    from remediator.web import create_app  # noqa: PLC0415

    config = services.config
    host, _, port = config.listen.rpartition(":")
    try:
        server, scheme = make_front(
            create_app(config, services),
            host.strip("[]") or "127.0.0.1",
            int(port),
            metrics=services.metrics,
            web_config_file=config.web_config_file,
        )
    except OSError as exc:
        print(f"gpu-fleet-remediator: cannot listen on {config.listen}: {exc}", file=sys.stderr)
        return EXIT_RUNTIME
    assert services.engine is not None
    try:
        services.start()  # the checkpointer, the engine, and the Zulip sender if reports go out
    except JournalError as exc:  # the journal is down, or another process has our replica id
        server.close()
        print(f"gpu-fleet-remediator: {exc}", file=sys.stderr)
        return EXIT_RUNTIME

    def on_signal(signum: int, frame: FrameType | None) -> None:
        del frame
        # Raised in the main thread, out of waitress' select loop, which re-raises only
        # SystemExit-like exceptions (anything else is swallowed by its handlers) and then
        # stops its task threads; closing the sockets from here instead would pull them
        # from under that select (EBADF).
        log.info("signal %s: shutting down", signal.Signals(signum).name)
        raise _Shutdown(0)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    log.info("listening on %s://%s, journal %s", scheme, config.listen, _safe_url(config.journal))
    try:
        server.run()  # returns after a _Shutdown: waitress catches SystemExit itself
    except _Shutdown:
        pass  # raised outside waitress' own handling (between loops): same meaning
    finally:
        server.close()
    return 0


class _Shutdown(SystemExit):
    """A termination signal arrived."""


def _safe_url(url: str) -> str:
    # Never log a database password.
    scheme, sep, rest = url.partition("://")
    if "@" in rest:
        rest = "***@" + rest.split("@", 1)[1]
    return scheme + sep + rest


def _replay_config(config: RemediatorConfig, *, live: bool) -> RemediatorConfig:
    """`replay`'s config: a sandbox by default, a replica id of its own with `--live`.

    The sandbox has an in-memory journal (the live one is never opened: no alert is used up,
    no queued run claimed) and no Zulip; `--live` acts as `<replica_id>-replay`, so the serving
    replica's runs and leases stay its own.
    """
    if live:
        return config.model_copy(update={"replica_id": f"{config.replica_id}-replay"[:128]})
    return config.model_copy(update={"journal": "sqlite://", "zulip": None})


def _replay(services: Services, payload: Path, *, live: bool) -> int:
    from remediator.alerts import PayloadError, parse_notification  # noqa: PLC0415

    try:
        body = payload.read_bytes()
        notification = parse_notification(body)
    except (OSError, PayloadError) as exc:
        print(f"gpu-fleet-remediator: {payload}: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    result = services.journal.admit(notification, body)
    assert services.engine is not None
    services.engine.process_runs(result.new_run_ids)  # its own runs only, never another's
    where = f"live journal {services.journal.safe_url}" if live else (
        "sandbox: an in-memory journal, dry-run (--live acts for real)")  # fmt: skip
    print(f"replay ({where})")
    print(
        f"notification: {len(result.new_run_ids)} new runs, {result.duplicates} duplicates, "
        f"{result.resolved} resolved"
    )
    for run_id in result.new_run_ids:
        run = services.journal.get_run(run_id)
        if run is not None:
            print(_describe(run))
    return 0


def _describe(run: RunRecord) -> str:
    lines = [
        f"run {run.id}: {run.alert.alertname} -> {run.playbook or '-'} on {run.target or '-'}: "
        f"{run.decision or run.state}{' / ' + run.outcome if run.outcome else ''}"
        + (f" ({run.reason})" if run.reason else "")
    ]
    for step in run.steps:
        lines.append(f"  step {step.index} {step.action}: {step.result} {step.output[:200]}")
    if run.verification:
        lines.append(f"  verification: {run.verification}")
    return "\n".join(lines)


def _runs(services: Services, limit: int, *, as_json: bool, waiting: bool = False) -> int:
    runs = services.journal.waiting_runs(limit) if waiting else services.journal.recent_runs(limit)
    if as_json:
        from remediator.web import run_json  # noqa: PLC0415

        print(json.dumps([run_json(r) for r in runs], indent=2))
        return 0
    header = (
        f"{'id':>6}  {'created (UTC)':19}  {'alert':24}  {'playbook':24}  {'target':28}  result"
    )
    print(header)
    for run in runs:
        result = run.outcome or run.decision or run.state
        if run.waiting:
            result = f"waiting ({run.wait_reason}) until {run.not_before:%H:%M:%S}"
        # Alert names come from the network: an escape sequence must not reach the terminal.
        name, playbook = _shown(run.alert.alertname), _shown(run.playbook or "-")
        print(
            f"{run.id:>6}  {run.created_at:%Y-%m-%d %H:%M:%S}  {name[:24]:24}  "
            f"{playbook[:24]:24}  {_shown(run.target or '-')[:28]:28}  {_shown(result)}"
        )
    return 0


_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f]")


def _shown(text: str) -> str:
    """`text` for a terminal: control characters (ESC, BEL, CR...) shown as U+FFFD."""
    return _CONTROL.sub("\ufffd", text)


def _use_color(choice: str) -> bool:
    if choice != "auto":
        return choice == "always"
    # https://no-color.org: any non-empty NO_COLOR turns colour off.
    if os.environ.get("NO_COLOR") or os.environ.get("TERM") == "dumb":
        return False
    return sys.stdout.isatty()


def _status(config: RemediatorConfig, args: argparse.Namespace) -> int:
    """The fleet at a glance (`remediator.fleet_status`): Prometheus' side and the journal's."""
    from remediator.fleet_status import as_json, gather, render_text  # noqa: PLC0415

    roster = load_roster(config.roster)
    if args.host is not None and args.host not in roster.hosts:
        known = ", ".join(sorted(roster.hosts)) or "none"
        print(
            f"gpu-fleet-remediator: no host {args.host!r} in the roster (hosts: {known})",
            file=sys.stderr,
        )
        return EXIT_CONFIG
    services: Services | None = None
    journal_error = None
    try:
        services = build_services(config, with_engine=False)
    except JournalError as exc:
        journal_error = str(exc)
    try:
        status = gather(
            services.journal if services is not None else None,
            roster,
            config.prometheus_url,
            host=args.host,
            timeout_seconds=STATUS_PROMETHEUS_TIMEOUT_SECONDS,
            journal_error=journal_error,
        )
    finally:
        if services is not None:
            services.close()
    if args.json:
        print(json.dumps(as_json(status), indent=2, ensure_ascii=False))
    else:
        sys.stdout.write(render_text(status, color=_use_color(args.color)))
    if status.prometheus_error is not None:
        print(f"gpu-fleet-remediator: {status.prometheus_error}", file=sys.stderr)
    if status.journal_error is not None:
        print(f"gpu-fleet-remediator: journal: {status.journal_error}", file=sys.stderr)
        return EXIT_RUNTIME
    return EXIT_PARTIAL if status.prometheus_error is not None else 0


def _file_sd(args: argparse.Namespace) -> int:
    if args.roster is not None:
        roster_path = args.roster
    else:
        roster_path = _load(args.config or DEFAULT_CONFIG).roster
    roster = load_roster(roster_path)
    groups = [
        {
            "targets": [
                f"[{host.address}]:{host.exporter_port}"
                if ":" in host.address
                else f"{host.address}:{host.exporter_port}"
            ],
            "labels": {"host": name},
        }
        for name, host in sorted(roster.hosts.items())
    ]
    print(json.dumps(groups, indent=2))
    return 0


def _init_config(directory: Path, roster: Path | None) -> int:
    """A local config under `directory`: SQLite journal, fresh secret files (mode 0600).

    Three secrets, each its own file: Alertmanager's token, the admin API's, and the page's
    password (`/ui/`, basic auth as user `ui`) — the config refuses a page password that is
    one of the other two, so each is drawn separately.
    """
    directory.mkdir(parents=True, exist_ok=True)
    config = directory / "remediator.yaml"
    if config.exists():
        print(f"{config} exists; left as it is")
        return 0
    for name in ("webhook.token", "admin.token", "ui.password"):
        path = directory / name
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.fchmod(fd, 0o600)  # a file already there keeps its mode through O_CREAT
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_urlsafe(32) + "\n")
    roster_path = (roster or directory / "fleet.yaml").resolve()
    base = directory.resolve()
    config.write_text(
        "# Written by `gpu-fleet-remediator init-config`: a local remediator, embedded journal.\n"
        "listen: 127.0.0.1:9095\n"
        f"roster: {roster_path}\n"
        f"journal: sqlite:///{base / 'journal.db'}\n"
        f"auth: {{bearer_token_file: {base / 'webhook.token'}}}\n"
        f"admin: {{bearer_token_file: {base / 'admin.token'}}}\n"
        f"ui: {{username: ui, password_file: {base / 'ui.password'}}}\n"
        "prometheus_url: http://127.0.0.1:9090\n"
        "dry_run: false\n"
    )
    print(f"wrote {config} (secrets in {base}/webhook.token and admin.token)")
    print(f"the page: http://127.0.0.1:9095/ui/ as user ui, password in {base / 'ui.password'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
