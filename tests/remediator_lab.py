"""A remediator set up in a temporary directory, and a model server that counts what it gets.

`write_setup(tmp_path, ...)` writes a roster whose servers point at `CountingServer`s (local
HTTP servers that answer `/health` and count every request by path: the side effects of the
playbooks' `http_probe` steps), secret files, test playbooks and the remediator's config.
"""

from __future__ import annotations

import threading
from collections import Counter
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

ALERTMANAGER_FIXTURES = Path(__file__).parent / "fixtures" / "alertmanager"

# Test playbooks: probe the server, "restart" it (an allow-listed request to /restart: a step
# that changes something, so the run spends the server's disruption budget), verify with a
# probe. Two of them, for two alerts on one server: they share its budget.
PROBE_PLAYBOOK = """\
name: {name}
description: Test playbook - probes /health, calls /restart; verification probes /verify.
match:
  alertname: {alertname}
target: server
steps:
  - http_probe: {{url: "{{server.url}}/health", expect_status: 200}}
  - http_request: {{url: "{{server.url}}/restart", method: GET, expect_status: [200]}}
  - wait: {{seconds: {wait_seconds}}}
verify:
  probe: {{http_probe: {{url: "{{server.url}}/verify", expect_status: 200}}}}
policy:
  cooldown_seconds: {cooldown}
  timeout_seconds: 120
  breaker: {{max_failures: {max_failures}, window_seconds: 3600}}
"""


class CountingServer:
    """A local HTTP server standing in for a model server's health endpoint.

    Counts requests by path; `/verify` answers `verify_status` (to make a run heal or not).
    """

    def __init__(self) -> None:
        self.hits: Counter[str] = Counter()
        self.verify_status = 200
        self._lock = threading.Lock()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                path = self.path.split("?", 1)[0]
                with outer._lock:
                    outer.hits[path] += 1
                status = outer.verify_status if path == "/verify" else 200
                body = b'{"status":"ok"}'
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: object) -> None:
                del format, args

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.port = self._server.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    def count(self, path: str) -> int:
        """How many requests reached `path`."""
        with self._lock:
            return self.hits[path]

    def close(self) -> None:
        """Stop serving."""
        self._server.shutdown()
        self._server.server_close()


@dataclass
class Setup:
    """Paths and secrets of one remediator set-up."""

    config: Path
    roster: Path
    playbooks: Path
    webhook_token: str
    admin_token: str


def drop_test_playbooks(setup: Setup) -> None:
    """Remove the test playbooks, so the built-in ones handle every alert."""
    for name in ("probe", "probe-stuck"):
        (setup.playbooks / f"{name}.yaml").unlink()


def write_setup(
    tmp_path: Path,
    *,
    servers: dict[str, str],
    journal_url: str | None = None,
    prometheus_url: str = "http://127.0.0.1:9",
    dry_run: bool = False,
    wait_seconds: float = 0.01,
    cooldown: int = 600,
    max_failures: int = 3,
    extra: str = "",
    listen: str = "127.0.0.1:9095",
) -> Setup:
    """Write roster, secrets, playbooks and config; `servers` maps dioscuri's servers to URLs."""
    roster = tmp_path / "fleet.yaml"
    lines = ["hosts:", "  dioscuri:", "    address: 127.0.0.1", "    servers:"]
    for index, (name, url) in enumerate(servers.items()):
        lines += [
            f"      {name}:",
            "        engine: llama",
            f"        url: {url}",
            f"        unit: llama-server@{name}.service",
            "        role: gpu-dense",
            "        model: tiny",
            f"        gpu: {index}",
        ]
    lines += [f"    gpus: {{nvidia: {{count: {max(1, len(servers))}}}}}"]
    lines += ["  theia:", "    address: 127.0.0.2"]
    roster.write_text("\n".join(lines) + "\n")
    (tmp_path / "webhook.token").write_text("webhook-secret-123\n")
    (tmp_path / "admin.token").write_text("admin-secret-456\n")
    playbooks = tmp_path / "playbooks"
    playbooks.mkdir(exist_ok=True)
    test_playbooks = (
        ("probe", "probe-llama", "LlamaServerDown"),
        ("probe-stuck", "probe-llama-stuck", "LlamaServerStuck"),
    )
    for file, name, alertname in test_playbooks:
        (playbooks / f"{file}.yaml").write_text(
            PROBE_PLAYBOOK.format(
                name=name,
                alertname=alertname,
                wait_seconds=wait_seconds,
                cooldown=cooldown,
                max_failures=max_failures,
            )
        )
    restart_urls = ", ".join(f"{url}/restart" for url in servers.values())
    if "http_request:" not in extra:
        extra = f"http_request: {{allowed_urls: [{restart_urls}]}}\n" + extra
    config = tmp_path / "remediator.yaml"
    journal = journal_url or f"sqlite:///{tmp_path / 'journal.db'}"
    config.write_text(
        f"listen: {listen}\n"
        f"roster: {roster}\n"
        f"journal: {journal}\n"
        f"auth: {{bearer_token_file: {tmp_path / 'webhook.token'}}}\n"
        f"admin: {{bearer_token_file: {tmp_path / 'admin.token'}}}\n"
        f"prometheus_url: {prometheus_url}\n"
        f"playbooks_dir: {playbooks}\n"
        f"dry_run: {'true' if dry_run else 'false'}\n" + extra
    )
    return Setup(config, roster, playbooks, "webhook-secret-123", "admin-secret-456")
