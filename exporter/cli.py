"""`gpu-fleet-exporter`: the exporter for one GPU host.

    gpu-fleet-exporter [--config FILE] [--host NAME] [--web.listen-address ADDR]
                       [--web.config.file FILE] [--sysfs DIR] [--procfs DIR] [--once]
                       [--check-config] [--nvml.fake-scenario FILE]

With no roster at the default path (and no `--config`), it detects the hardware and watches no
servers. A roster that is given but unusable, or a host that cannot be determined, stops the
start with exit status 2 and a message naming the file and key; so does a web config file
(`--web.config.file`: TLS and basic auth, see `fleet.webconfig`) with one line per problem.

`--check-config` runs those checks and nothing else: it reads the files (the roster, the web
config and the TLS files it names) and exits 0 or 2, without starting NVML, reading a device
or sending a packet to any server the roster lists.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from types import FrameType

from prometheus_client import CollectorRegistry

from exporter import __version__
from exporter.exposition import TextWriter
from exporter.http import MetricsServer
from exporter.registry import ExporterSettings, build_registry
from fleet.http_front import parse_listen_address
from fleet.roster import DEFAULT_ROSTER_PATH, Host, RosterError, load_roster, resolve_host_name
from fleet.webconfig import TLSLoadError, WebConfig, WebConfigError, load_web_config

log = logging.getLogger("gpu-fleet-exporter")

EXIT_USAGE = 2


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="gpu-fleet-exporter",
        description="Prometheus exporter for a GPU host serving LLMs (NVML, amdgpu, hwmon).",
    )
    p.add_argument(
        "--config",
        type=Path,
        default=None,
        help=f"the roster (fleet.yaml); default {DEFAULT_ROSTER_PATH}, and without one there, "
        "the exporter detects the hardware and watches no servers",
    )
    p.add_argument("--host", default=None, help="which roster host this is (see docs/roster.md)")
    p.add_argument(
        "--web.listen-address",
        dest="listen_address",
        default=":9445",
        help="address to serve /metrics on (default :9445, all interfaces)",
    )
    p.add_argument(
        "--web.config.file",
        dest="web_config_file",
        type=Path,
        default=None,
        help="TLS and basic auth: a web config file in the Prometheus exporter-toolkit format "
        "(as node_exporter's); without it, plain HTTP and no auth",
    )
    p.add_argument("--sysfs", default="/sys", help="sysfs mount point (default /sys)")
    p.add_argument("--procfs", default="/proc", help="procfs mount point (default /proc)")
    p.add_argument("--once", action="store_true", help="print one scrape to stdout and exit 0")
    p.add_argument(
        "--check-config",
        dest="check_config",
        action="store_true",
        help="check the roster (and this host in it) and the web config, then exit 0 (good) or "
        "2; contacts nothing: no NVML, no device, no model server",
    )
    p.add_argument(
        "--nvml.fake-scenario",
        dest="nvml_fake_scenario",
        type=Path,
        default=None,
        help="STAND-IN FOR A GPU: read NVIDIA data from this fake-NVML scenario file instead of "
        "the driver (the e2e lab and demos on machines without a GPU; never in production)",
    )
    p.add_argument(
        "--collector.timeout",
        dest="collector_timeout",
        type=float,
        default=4.0,
        help="deadline in seconds for NVML's calls in one scrape (default 4)",
    )
    p.add_argument(
        "--log.level",
        dest="log_level",
        default="info",
        choices=["debug", "info", "warning", "error"],
    )
    p.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    return p


def _roster_host(config: Path | None, host_name: str | None) -> Host | None:
    """This host's roster entry, or None when there is no roster at all."""
    path = config if config is not None else DEFAULT_ROSTER_PATH
    if config is None and not path.exists():
        if host_name is not None:
            raise RosterError(f"--host {host_name!r} needs a roster, and {path} does not exist")
        log.info("no roster at %s: detecting hardware, watching no servers", path)
        return None
    roster = load_roster(path)
    name = resolve_host_name(roster, host_name)
    log.info("roster %s: this is host %s", path, name)
    return roster.hosts[name]


def main(argv: list[str] | None = None) -> int:
    """Run the exporter; returns the process exit status."""
    args = _parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    if args.collector_timeout <= 0:
        print("gpu-fleet-exporter: --collector.timeout: must be > 0", file=sys.stderr)
        return EXIT_USAGE
    try:
        listen = parse_listen_address(args.listen_address)
    except ValueError as exc:
        print(f"gpu-fleet-exporter: --web.listen-address: {exc}", file=sys.stderr)
        return EXIT_USAGE
    web_config = None
    if args.web_config_file is not None:
        try:
            web_config = load_web_config(args.web_config_file)
        except WebConfigError as exc:
            for problem in exc.problems:
                print(f"gpu-fleet-exporter: {problem}", file=sys.stderr)
            return EXIT_USAGE
        for note in web_config.notes:
            log.warning("%s: %s", args.web_config_file, note)
    try:
        host = _roster_host(args.config, args.host)
    except RosterError as exc:
        print(f"gpu-fleet-exporter: {exc}", file=sys.stderr)
        return EXIT_USAGE
    if args.check_config:
        print(_checked(args.config, host, args.web_config_file, web_config))
        return 0
    settings = ExporterSettings(
        host=host,
        sysfs=args.sysfs,
        procfs=args.procfs,
        nvml_fake_scenario=args.nvml_fake_scenario,
        collector_timeout_seconds=args.collector_timeout,
    )
    registry, fleet = build_registry(settings)
    try:
        if args.once:
            sys.stdout.buffer.write(TextWriter().render_registry(registry))
            sys.stdout.flush()
            return 0
        return _serve(registry, listen, web_config, on_stop=fleet.interrupt)
    finally:
        fleet.close()


def _checked(
    config: Path | None, host: Host | None, web_file: Path | None, web: WebConfig | None
) -> str:
    """The one line `--check-config` prints for good files."""
    if host is None:
        roster = f"no roster at {DEFAULT_ROSTER_PATH}: the hardware found, no servers"
    else:
        vendors = [
            f"{count.count} {name}"
            for name, count in (("nvidia", host.gpus.nvidia), ("amd", host.gpus.amd))
            if count is not None
        ]
        gpus = ", ".join(vendors) or "none named"
        roster = (
            f"roster {config or DEFAULT_ROSTER_PATH}: good; this host: {len(host.servers)} "
            f"server(s), GPUs {gpus}"
        )
    web_text = f"; web config {web_file}: good ({web.describe()})" if web is not None else ""
    return f"gpu-fleet-exporter: {roster}{web_text}"


def _serve(
    registry: CollectorRegistry,
    listen: tuple[str, int],
    web_config: WebConfig | None,
    *,
    on_stop: Callable[[], None],
) -> int:
    try:
        server = MetricsServer(registry, *listen, web_config=web_config)
    except OSError as exc:
        print(
            f"gpu-fleet-exporter: cannot listen on {listen[0]}:{listen[1]}: {exc}",
            file=sys.stderr,
        )
        return 1
    except TLSLoadError as exc:  # the TLS files changed since they were checked
        source = web_config.source if web_config is not None else "--web.config.file"
        print(f"gpu-fleet-exporter: {source}: tls_server_config.{exc.key}: {exc}", file=sys.stderr)
        return EXIT_USAGE
    stop = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        del frame
        log.info("signal %s: shutting down", signal.Signals(signum).name)
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    server.start()
    log.info("serving /metrics on %s://%s:%d", server.scheme, listen[0], server.port)
    if web_config is not None:
        log.info("%s: %s", web_config.source, web_config.describe())
    stop.wait()
    # Scrapes in progress answer now: serving stops within seconds whatever source is stuck
    # (a stuck read stays on a daemon thread, which does not hold the process).
    on_stop()
    server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
