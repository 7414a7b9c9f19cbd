"""`make run`'s loop (examples/run_local.py) as a newcomer gets it, on free ports.

The real exporter, remediator, Prometheus and Alertmanager start on one roster; Prometheus has
every target up and the repository's rules loaded; an alert raised in Alertmanager reaches the
remediator, becomes a run, and its report lands as a Markdown file; the remediator's page
answers with the password `make run` wrote (and only with it); SIGINT stops everything.
"""

from __future__ import annotations

import base64
import json
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from tests.llama_lab import stop_process, wait_until

REPO = Path(__file__).resolve().parent.parent


def _get(url: str, token: str | None = None) -> Any:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=10) as r:
        return json.loads(r.read())


def _page_status(url: str, password: str | None) -> int:
    headers: dict[str, str] = {}
    if password is not None:
        headers["Authorization"] = "Basic " + base64.b64encode(f"ui:{password}".encode()).decode()
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=10) as r:
            return int(r.status)
    except urllib.error.HTTPError as refused:
        return refused.code


def test_make_run_runs_the_whole_loop(tmp_path: Path) -> None:
    state, ready = tmp_path / "run", tmp_path / "ready.json"
    log = (tmp_path / "run.log").open("wb")
    proc = subprocess.Popen(
        [sys.executable, str(REPO / "examples" / "run_local.py"), "--state-dir", str(state),
         "--ports", "auto", "--ready-file", str(ready)],
        stdout=log, stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:
        wait_until(lambda: ready.exists() or proc.poll() is not None, 90, what="make run ready")
        assert proc.poll() is None, (tmp_path / "run.log").read_text()
        url = json.loads(ready.read_text())
        # Prometheus: the exporter, the remediator, itself and Alertmanager, all up.
        wait_until(
            lambda: {
                t["labels"]["job"]
                for t in _get(f"{url['prometheus']}/api/v1/targets")["data"]["activeTargets"]
                if t["health"] == "up"
            } == {"gpu-fleet-exporter", "gpu-fleet-remediator", "prometheus", "alertmanager"},
            30,
            what="every target up",
        )  # fmt: skip
        rules = _get(f"{url['prometheus']}/api/v1/rules")["data"]["groups"]
        names = {rule["name"] for group in rules for rule in group["rules"]}
        assert {"LlamaServerDown", "GpuFleetRemediatorDegraded"} <= names
        # One roster: the exporter's host is the remediator's.
        roster = (state / "fleet.yaml").read_text()
        assert (
            "local:" in roster
            and f"roster: {state / 'fleet.yaml'}" in (state / "remediator.yaml").read_text()
        )
        # An alert raised in Alertmanager reaches the remediator and is reported.
        alert = [{"labels": {"alertname": "MakeRunTest", "host": "local", "severity": "info"},
                  "annotations": {"summary": "a test alert"}}]  # fmt: skip
        request = urllib.request.Request(
            f"{url['alertmanager']}/api/v2/alerts", data=json.dumps(alert).encode(),
            headers={"Content-Type": "application/json"}, method="POST",
        )  # fmt: skip
        urllib.request.urlopen(request, timeout=10).close()
        token = (state / "admin.token").read_text().strip()
        wait_until(
            lambda: any(r["alert"]["alertname"] == "MakeRunTest"
                        for r in _get(f"{url['remediator']}/api/runs", token)["runs"]),
            60,
            what="the alert's run",
        )  # fmt: skip
        wait_until(lambda: any("MakeRunTest" in p.read_text()
                               for p in (state / "reports").glob("*.md")), 30,
                   what="its report as a Markdown file")  # fmt: skip
        # The page, with the password `make run` wrote (mode 0600) and said where it is.
        password_file = state / "ui.password"
        assert password_file.stat().st_mode & 0o777 == 0o600
        password = password_file.read_text().strip()
        assert password != token
        page = f"{url['remediator']}/ui/"
        said = (tmp_path / "run.log").read_text()
        assert page in said and str(password_file) in said
        assert _page_status(page, password) == 200
        assert _page_status(page, None) == 401
        assert _page_status(page, token) == 401  # the admin API's token does not open it
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 0
        time.sleep(0.5)
        for port_url in url.values():
            if port_url.startswith("http"):
                try:
                    urllib.request.urlopen(port_url, timeout=2).close()
                    raise AssertionError(f"{port_url} still answers after Ctrl-C")
                except OSError:
                    pass
    finally:
        stop_process(proc, 20)
        log.close()
