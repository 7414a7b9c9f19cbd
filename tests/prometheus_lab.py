"""A real Prometheus for the remediator's tests, scraping endpoints the test controls.

Real parts only (DESIGN.md, "Tests: real parts"): `prometheus` is Debian's binary from PATH,
started on a free 127.0.0.1 port with its TSDB in the test's tmp directory. What it scrapes is
a `MetricsEndpoint`: a stdlib HTTP server on port 0 that serves whatever exposition text the
test sets, so a test can make a series appear, change and vanish.

    with MetricsEndpoint('gpufleet_llama_up{server="alpha"} 0\n') as endpoint, \
            PrometheusServer(tmp_path, [endpoint.target]) as prometheus:
        endpoint.set('gpufleet_llama_up{server="alpha"} 1\n')
        prometheus.wait_for('gpufleet_llama_up == 1')

`PrometheusServer` returns from `start()` (and `with`) once `/-/ready` answers 200 and the first
scrape of every target has landed (`up{job="lab"}` has a sample per target), so the series of
the first text are queryable at once. That first scrape takes 5-6 s: Prometheus hands
discovered targets (static ones too) to the scrape manager on a 5 s tick, so share one server
per module where the tests allow it. Without targets, it is ready in well under a second.
A missing binary fails the test, never skips it.
"""

from __future__ import annotations

import http.server
import json
import shutil
import subprocess
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import IO, Any

from tests.llama_lab import die_with_parent, free_port, log_tail, stop_process

EXPOSITION_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class PrometheusLabError(RuntimeError):
    """Prometheus did not start, or not in time; the message holds its log's tail."""


class MetricsEndpoint:
    """A scrape target on 127.0.0.1 serving `text` at `/metrics` (changeable with `set`)."""

    def __init__(self, text: str = "") -> None:
        self._text = text.encode()
        self._lock = threading.Lock()
        self.scrapes = 0
        """Requests answered so far."""
        endpoint = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                with endpoint._lock:
                    body = endpoint._text
                    endpoint.scrapes += 1
                self.send_response(200)
                self.send_header("Content-Type", EXPOSITION_CONTENT_TYPE)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: Any) -> None:
                pass  # one line per scrape would bury the test's own output

        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self._thread: threading.Thread | None = None

    @property
    def target(self) -> str:
        """`127.0.0.1:PORT`, as a Prometheus static target."""
        return f"127.0.0.1:{self._server.server_address[1]}"

    def set(self, text: str) -> None:
        """Serve `text` from the next scrape on."""
        with self._lock:
            self._text = text.encode()

    def __enter__(self) -> MetricsEndpoint:
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self._server.shutdown()
        self._server.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5)


class PrometheusServer:
    """One real Prometheus process scraping `scrape_targets` as job `lab`.

    `labels` are added to every target (as file_sd would add `host`); `rule_files` are
    evaluated every `scrape_interval`; `extra` adds top-level config sections (`alerting`).
    `url` is the base URL of its HTTP API. Leaving the
    context always stops it (SIGTERM, SIGKILL after `grace` seconds).
    """

    def __init__(
        self,
        tmp_path: Path,
        scrape_targets: list[str],
        scrape_interval: str = "1s",
        *,
        labels: Mapping[str, str] | None = None,
        job: str = "lab",
        grace: float = 5.0,
        rule_files: Sequence[Path] = (),
        extra: Mapping[str, Any] | None = None,
        external_labels: Mapping[str, str] | None = None,
    ) -> None:
        self.directory = Path(tmp_path) / f"prometheus-{free_port()}"
        self.rule_files = [str(path) for path in rule_files]
        self.extra = dict(extra or {})
        self.external_labels = dict(external_labels or {})
        self.scrape_targets = list(scrape_targets)
        self.scrape_interval = scrape_interval
        self.labels = dict(labels or {})
        self.job = job
        self.grace = grace
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = self.directory / "prometheus.log"
        self._process: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None

    def __repr__(self) -> str:
        return f"PrometheusServer({self.url}, pid={self._process and self._process.pid})"

    @property
    def process(self) -> subprocess.Popen[bytes]:
        """The running Prometheus (for tests that stop or signal it); raises before `start`."""
        if self._process is None:
            raise RuntimeError(f"{self!r} was not started")
        return self._process

    # -- life cycle ---------------------------------------------------------------------------

    def _config(self) -> dict[str, Any]:
        static: dict[str, Any] = {"targets": self.scrape_targets}
        if self.labels:
            static["labels"] = self.labels
        return {
            "global": {
                "scrape_interval": self.scrape_interval,
                # A scrape may not outlast its interval (Prometheus refuses the config).
                "scrape_timeout": self.scrape_interval,
                "evaluation_interval": self.scrape_interval,
                **({"external_labels": self.external_labels} if self.external_labels else {}),
            },
            "scrape_configs": [{"job_name": self.job, "static_configs": [static]}]
            if self.scrape_targets
            else [],
            "rule_files": self.rule_files,
            **self.extra,
        }

    def start(self, timeout: float = 30.0) -> PrometheusServer:
        """Start Prometheus; return once it is ready and has scraped every target once."""
        if self._process is not None:
            raise PrometheusLabError(f"{self!r} was already started")
        binary = shutil.which("prometheus")
        if binary is None:
            raise PrometheusLabError(
                "the `prometheus` binary is not on PATH: install Debian's prometheus package "
                "(`make deps` does)"
            )
        self.directory.mkdir(parents=True, exist_ok=True)
        config = self.directory / "prometheus.yml"
        # JSON is YAML: no quoting questions for targets and labels.
        config.write_text(json.dumps(self._config(), indent=2))
        self._log = self.log_path.open("wb")
        self._process = subprocess.Popen(
            [
                binary,
                f"--config.file={config}",
                f"--storage.tsdb.path={self.directory / 'data'}",
                f"--web.listen-address=127.0.0.1:{self.port}",
            ],
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            # Safe here: the hook is one system call through a libc loaded before the fork.
            preexec_fn=die_with_parent,  # noqa: PLW1509
        )
        deadline = time.monotonic() + timeout
        self._wait_ready(deadline)
        if self.scrape_targets:
            self.wait_for(
                f'up{{job="{self.job}"}}',
                timeout=max(0.1, deadline - time.monotonic()),
                count=len(self.scrape_targets),
            )
        return self

    def stop(self) -> None:
        """Stop Prometheus (SIGTERM, then SIGKILL) and reap it; safe to call twice."""
        if self._process is not None:
            stop_process(self._process, self.grace)
        if self._log is not None:
            self._log.close()
            self._log = None

    def __enter__(self) -> PrometheusServer:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.stop()

    def log_tail(self, lines: int = 30) -> str:
        """The last lines of Prometheus' log, for assertion messages."""
        return log_tail(self.log_path, lines)

    # -- waits and queries --------------------------------------------------------------------

    def _raise_if_exited(self, waiting_for: str) -> None:
        if self._process is not None and self._process.poll() is not None:
            raise PrometheusLabError(
                f"prometheus exited with {self._process.returncode} while waiting for "
                f"{waiting_for}\n{self.log_tail()}"
            )

    def _wait_ready(self, deadline: float) -> None:
        last = "no answer yet"
        while True:
            self._raise_if_exited("/-/ready")
            try:
                with urllib.request.urlopen(f"{self.url}/-/ready", timeout=1.0) as response:
                    if response.status == 200:
                        return
                    last = f"HTTP {response.status}"
            except urllib.error.HTTPError as error:
                last = f"HTTP {error.code}"  # 503 while the TSDB opens
                error.close()
            except OSError as error:
                last = repr(error)
            if time.monotonic() >= deadline:
                raise PrometheusLabError(f"{self!r} not ready (last: {last})\n{self.log_tail()}")
            time.sleep(0.05)

    def query(self, expr: str) -> list[dict[str, Any]]:
        """The series of an instant query (raises on an error answer: a test bug)."""
        url = f"{self.url}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
        with urllib.request.urlopen(url, timeout=5.0) as response:
            answer = json.load(response)
        if answer.get("status") != "success":
            raise PrometheusLabError(f"query {expr!r} failed: {answer}")
        result: list[dict[str, Any]] = answer["data"]["result"]
        return result

    def wait_for(self, expr: str, *, timeout: float = 15.0, count: int = 1) -> list[dict[str, Any]]:
        """Wait until `expr` returns at least `count` series; returns them."""
        deadline = time.monotonic() + timeout
        while True:
            self._raise_if_exited(expr)
            result = self.query(expr)
            if len(result) >= count:
                return result
            if time.monotonic() >= deadline:
                raise PrometheusLabError(
                    f"{expr!r} returned {len(result)} series after {timeout} s, expected "
                    f"{count}\n{self.log_tail()}"
                )
            time.sleep(0.1)
