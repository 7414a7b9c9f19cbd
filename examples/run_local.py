"""`make run`: the whole loop on this one machine — exporter, Prometheus, Alertmanager, remediator.

Everything listens on 127.0.0.1 and keeps its state under one directory (`.run/`):

- `fleet.yaml` — the roster of this machine (host `local`, `local: true`), written once: edit
  it to add the model servers this machine runs. The exporter and the remediator read it both.
- `remediator.yaml` — written at every start from the ports in use (the secret files beside it,
  `webhook.token`, `admin.token` and `ui.password`, are made once); reports go to `reports/`
  as Markdown files, the text Zulip would get (add a `zulip:` section and a zuliprc to send
  them there). The remediator's page is at `/ui/`: user `ui`, the password in `ui.password`.
- `prometheus/` — its config (scraping the exporter, the remediator, itself and Alertmanager
  every 5 s, evaluating the repository's `rules/`), its data and its log.
- `alertmanager/` — `examples/alertmanager.yml` with every receiver pointed at this remediator
  (the people's and the dead man's switch too: their reports land in `reports/`), and a
  shorter `group_wait` so an alert shows within seconds.
- `logs/` — each process's output.

The preferred ports are the usual ones (Prometheus 9090, Alertmanager 9093, remediator 9095,
exporter 9445); one already held by another program (a packaged Prometheus, say) is said so
and the next free one taken. `--ports auto` takes free ports throughout (the tests use it).
Once all four answer, it prints what runs where and how to raise an alert by hand; Ctrl-C (or
SIGTERM) stops everything it started. If one of them dies, the rest are stopped and the exit
status is 1.

    python examples/run_local.py [--state-dir .run] [--ports usual|auto] [--ready-file FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import IO

import yaml

REPO = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
USUAL_PORTS = {"prometheus": 9090, "alertmanager": 9093, "remediator": 9095, "exporter": 9445}
HOST = "local"
READY_TIMEOUT_SECONDS = 60.0


class RunError(Exception):
    """Something the person running it must fix; the message says what."""


def _free(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _any_free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def choose_ports(mode: str, say: Callable[[str], None]) -> dict[str, int]:
    """The port of each part: the usual one, else the next free one (said), or any free one."""
    ports: dict[str, int] = {}
    for name, usual in USUAL_PORTS.items():
        if mode == "auto":
            ports[name] = _any_free_port()
            continue
        port = usual
        while not _free(port) or port in ports.values():
            port += 1
            if port > usual + 50:
                raise RunError(f"no free port for {name} near {usual}")
        if port != usual:
            say(f"port {usual} ({name}'s usual) is in use by another program: {name} takes {port}")
        ports[name] = port
    return ports


def _tool(*names: str) -> str:
    for name in names:
        found = shutil.which(name)
        if found is not None:
            return found
    raise RunError(
        f"{names[0]} is not installed: `make run` installs Debian's prometheus and "
        "prometheus-alertmanager (`make deps`)"
    )


def write_roster(path: Path, exporter_port: int) -> None:
    """The roster of this machine, once; a roster already there is the person's own."""
    if path.exists():
        hosts = (yaml.safe_load(path.read_text()) or {}).get("hosts", {})
        port = (hosts.get(HOST) or {}).get("exporter_port", 9445)
        if port != exporter_port:
            raise RunError(
                f"{path}: host {HOST}'s exporter_port is {port}, but the exporter runs on "
                f"{exporter_port} (port {port} is taken): set exporter_port: {exporter_port} there"
            )
        return
    path.write_text(
        "# The roster of this machine, written once by `make run`: add the model servers it\n"
        "# runs under `servers:` (see examples/fleet.yaml for every key).\n"
        f"hosts:\n  {HOST}:\n    address: 127.0.0.1\n    exporter_port: {exporter_port}\n"
        "    local: true\n"
    )


def _secret(path: Path) -> None:
    if path.exists():
        return
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as handle:
        handle.write(secrets.token_urlsafe(32) + "\n")


def write_remediator_config(state: Path, ports: dict[str, int]) -> Path:
    """`remediator.yaml` for these ports (rewritten each start), its secrets made once.

    Three secrets, each drawn on its own: the config refuses a page password (`ui.password`)
    that is Alertmanager's token or the admin API's.
    """
    for name in ("webhook.token", "admin.token", "ui.password"):
        _secret(state / name)
    config = state / "remediator.yaml"
    config.write_text(
        "# Written by `make run` at every start (examples/run_local.py): edit fleet.yaml instead.\n"
        f"listen: 127.0.0.1:{ports['remediator']}\n"
        f"roster: {state / 'fleet.yaml'}\n"
        f"journal: sqlite:///{state / 'journal.db'}\n"
        f"auth: {{bearer_token_file: {state / 'webhook.token'}}}\n"
        f"admin: {{bearer_token_file: {state / 'admin.token'}}}\n"
        f"ui: {{username: ui, password_file: {state / 'ui.password'}}}\n"
        f"prometheus_url: http://127.0.0.1:{ports['prometheus']}\n"
        f"reports_dir: {state / 'reports'}\n"
        "replica_id: local\n"
        "dry_run: false\n"
    )
    return config


def write_prometheus_config(state: Path, ports: dict[str, int]) -> Path:
    """Prometheus's config: every part scraped, the repository's rules, the local Alertmanager.

    The exporter's target carries its `host` label, as file_sd gives it on a fleet.
    """
    directory = state / "prometheus"
    directory.mkdir(parents=True, exist_ok=True)
    config = {
        "global": {"scrape_interval": "5s", "scrape_timeout": "5s", "evaluation_interval": "5s"},
        "rule_files": [str(path) for path in sorted((REPO / "rules").glob("*.rules.yml"))],
        "alerting": {
            "alertmanagers": [
                {"static_configs": [{"targets": [f"127.0.0.1:{ports['alertmanager']}"]}]}
            ]
        },
        "scrape_configs": [
            {
                "job_name": "gpu-fleet-exporter",
                "static_configs": [
                    {"targets": [f"127.0.0.1:{ports['exporter']}"], "labels": {"host": HOST}}
                ],
            },
            {
                "job_name": "gpu-fleet-remediator",
                "static_configs": [{"targets": [f"127.0.0.1:{ports['remediator']}"]}],
            },
            {
                "job_name": "prometheus",
                "static_configs": [{"targets": [f"127.0.0.1:{ports['prometheus']}"]}],
            },
            {
                "job_name": "alertmanager",
                "static_configs": [{"targets": [f"127.0.0.1:{ports['alertmanager']}"]}],
            },
        ],
    }
    path = directory / "prometheus.yml"
    path.write_text(json.dumps(config, indent=2))  # JSON is YAML
    return path


def write_alertmanager_config(state: Path, ports: dict[str, int]) -> Path:
    """examples/alertmanager.yml, sending to this remediator with its token, faster groups."""
    directory = state / "alertmanager"
    directory.mkdir(parents=True, exist_ok=True)
    config = yaml.safe_load((REPO / "examples" / "alertmanager.yml").read_text())
    config["route"]["group_wait"] = "5s"
    config["route"]["group_interval"] = "30s"
    # Every receiver — the remediator's, and on this one machine also `people` and the dead
    # man's switch, whose placeholder URLs lead nowhere — goes to this remediator: what would
    # reach people shows in .run/reports/ too, and Alertmanager has no failing notifications.
    for receiver in config["receivers"]:
        for webhook in receiver.get("webhook_configs", []):
            webhook["url"] = f"http://127.0.0.1:{ports['remediator']}/webhook/alertmanager"
            webhook["http_config"] = {
                "authorization": {
                    "type": "Bearer",
                    "credentials_file": str(state / "webhook.token"),
                }
            }
    path = directory / "alertmanager.yml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


@dataclass
class Part:
    """One process this command runs."""

    name: str
    argv: list[str]
    ready_url: str
    process: subprocess.Popen[bytes] | None = None
    log: IO[bytes] | None = None


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return bool(response.status == 200)
    except (urllib.error.URLError, OSError):
        return False


def start(parts: list[Part], logs: Path) -> None:
    """Start every part; return once each answers its ready URL. RunError if one does not."""
    logs.mkdir(parents=True, exist_ok=True)
    for part in parts:
        part.log = (logs / f"{part.name}.log").open("ab")
        part.process = subprocess.Popen(
            part.argv, stdin=subprocess.DEVNULL, stdout=part.log, stderr=subprocess.STDOUT
        )
    deadline = time.monotonic() + READY_TIMEOUT_SECONDS
    waiting = list(parts)
    while waiting:
        for part in list(waiting):
            assert part.process is not None
            if part.process.poll() is not None:
                raise RunError(
                    f"{part.name} exited with status {part.process.returncode}; see "
                    f"{logs / (part.name + '.log')}"
                )
            if _answers(part.ready_url):
                waiting.remove(part)
        if waiting and time.monotonic() > deadline:
            names = ", ".join(p.name for p in waiting)
            raise RunError(f"{names} did not answer within {READY_TIMEOUT_SECONDS:.0f} s")
        time.sleep(0.2)


def stop(parts: list[Part]) -> None:
    """SIGTERM each part, SIGKILL what is still there after 15 s; close the logs."""
    for part in parts:
        if part.process is not None and part.process.poll() is None:
            part.process.terminate()
    deadline = time.monotonic() + 15
    for part in parts:
        if part.process is None:
            continue
        try:
            part.process.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            part.process.kill()
            part.process.wait()
    for part in parts:
        if part.log is not None:
            part.log.close()


class _Stop(Exception):
    """A signal asked to stop."""


def _on_signal(signum: int, frame: FrameType | None) -> None:
    del frame
    raise _Stop(signal.Signals(signum).name)


def say(line: str) -> None:
    """One line of what `make run` does, for the person watching."""
    print(f"make run: {line}", flush=True)


def main(argv: list[str] | None = None) -> int:
    """Run the loop until a signal; the exit status."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--state-dir", type=Path, default=REPO / ".run")
    parser.add_argument("--ports", choices=["usual", "auto"], default="usual")
    parser.add_argument("--ready-file", type=Path, help="write the URLs here (JSON) when ready")
    args = parser.parse_args(argv)
    state: Path = args.state_dir.resolve()
    state.mkdir(parents=True, exist_ok=True)
    signal.signal(signal.SIGINT, _on_signal)
    signal.signal(signal.SIGTERM, _on_signal)
    parts: list[Part] = []
    try:
        ports = choose_ports(args.ports, say)
        write_roster(state / "fleet.yaml", ports["exporter"])
        remediator_config = write_remediator_config(state, ports)
        prometheus_config = write_prometheus_config(state, ports)
        alertmanager_config = write_alertmanager_config(state, ports)
        url = {name: f"http://127.0.0.1:{port}" for name, port in ports.items()}
        parts = [
            Part("exporter", [str(BIN / "gpu-fleet-exporter"), "--config",
                              str(state / "fleet.yaml"), "--host", HOST, "--web.listen-address",
                              f"127.0.0.1:{ports['exporter']}"],
                 f"{url['exporter']}/metrics"),
            Part("remediator", [str(BIN / "gpu-fleet-remediator"), "serve", "--config",
                                str(remediator_config)], f"{url['remediator']}/healthz"),
            Part("prometheus", [_tool("prometheus"), f"--config.file={prometheus_config}",
                                f"--storage.tsdb.path={state / 'prometheus' / 'data'}",
                                f"--web.listen-address=127.0.0.1:{ports['prometheus']}"],
                 f"{url['prometheus']}/-/ready"),
            Part("alertmanager", [_tool("prometheus-alertmanager", "alertmanager"),
                                  f"--config.file={alertmanager_config}",
                                  f"--storage.path={state / 'alertmanager' / 'data'}",
                                  f"--web.listen-address=127.0.0.1:{ports['alertmanager']}",
                                  "--cluster.listen-address="],
                 f"{url['alertmanager']}/-/ready"),
        ]  # fmt: skip
        start(parts, state / "logs")
        if args.ready_file is not None:
            args.ready_file.write_text(json.dumps({**url, "state": str(state)}))
        say("all four run, on 127.0.0.1:")
        for name in ports:
            say(f"  {name:12} {url[name]}")
        say(f"roster {state / 'fleet.yaml'} (edit it to add servers), reports in "
            f"{state / 'reports'}, logs in {state / 'logs'}")  # fmt: skip
        say("raise an alert by hand and watch it go through:")
        say(f"  amtool --alertmanager.url={url['alertmanager']} alert add Test host={HOST}")
        say(f"  curl -s -H 'Authorization: Bearer '$(cat {state / 'admin.token'}) "
            f"{url['remediator']}/api/runs   # then: ls {state / 'reports'}")  # fmt: skip
        say(f"the remediator's page: {url['remediator']}/ui/ (user ui, password in "
            f"{state / 'ui.password'})")  # fmt: skip
        say("Ctrl-C stops everything.")
        while True:
            for part in parts:
                assert part.process is not None
                if part.process.poll() is not None:
                    raise RunError(f"{part.name} exited with status {part.process.returncode}")
            time.sleep(1)
    except _Stop as stopped:
        say(f"{stopped}: stopping")
        return 0
    except RunError as exc:
        print(f"make run: {exc}", file=sys.stderr, flush=True)
        return 1
    finally:
        stop(parts)


if __name__ == "__main__":
    sys.exit(main())
