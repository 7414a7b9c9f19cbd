"""The remediator's page (`/ui/`) as a browser gets it: a real `serve` process over TLS.

The remediator runs with the web config's TLS (certificates made by the openssl CLI, as the
exporter's TLS tests make them) and a `ui` section; a real Prometheus scrapes the exporter's
golden GPU exposition and the llama-server series of `tests/test_status_cli.py`. Alerts go in
through the webhook as Alertmanager sends them — one with hostile labels and annotations (HTML,
script, `javascript:` links), one whose very alertname is a script — and the engine runs them:
one heals, one fails and opens its target's breaker. People act through the admin API
(maintenance, pause), and a last alert waits for the pause. Then the page is read with and
without the credential, and its HTML is parsed: only the tags and attributes the page writes,
no script, no event handler, no link anywhere but http(s) or this origin.
"""

from __future__ import annotations

import base64
import html
import http.client
import json
import re
import ssl
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import bcrypt
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from remediator.config import ConfigError, load_config
from tests.llama_lab import free_port, stop_process, wait_until
from tests.prometheus_lab import MetricsEndpoint, PrometheusServer
from tests.remediator_lab import ALERTMANAGER_FIXTURES, CountingServer, Setup, write_setup
from tests.test_remediator_process import REMEDIATOR
from tests.test_status_cli import exposition
from tests.test_webconfig import Certs, certs

__all__ = ["certs"]  # the module-scoped fixture, shared with the exporter's TLS tests
UI_PASSWORD = "page-password-789"
EVIL = "<script>alert(1)</script>"
EVIL_SUMMARY = '"><img src=x onerror=alert(1)>'
ALLOWED_TAGS = {
    "html", "head", "meta", "title", "style", "body", "h1", "h2", "h3", "h4", "p", "a", "b",
    "br", "code", "pre", "table", "thead", "tbody", "tr", "th", "td", "details", "summary",
    "span", "div", "ul", "li", "strong", "em", "time", "img",
}  # fmt: skip


def _basic(user: str, password: str) -> dict[str, str]:
    token = base64.b64encode(f"{user}:{password}".encode()).decode()
    return {"Authorization": f"Basic {token}"}


@dataclass
class Page:
    """The served remediator: its set-up and a TLS client for it."""

    setup: Setup
    port: int
    context: ssl.SSLContext
    prometheus: PrometheusServer

    def get(self, path: str, headers: dict[str, str] | None = None) -> tuple[int, Any, bytes]:
        conn = http.client.HTTPSConnection("127.0.0.1", self.port, context=self.context,
                                           timeout=30)  # fmt: skip
        try:
            conn.request("GET", path, headers=headers or {})
            answer = conn.getresponse()
            return answer.status, answer.headers, answer.read()
        finally:
            conn.close()

    def send(self, method: str, path: str, body: Any, token: str) -> Any:
        conn = http.client.HTTPSConnection("127.0.0.1", self.port, context=self.context,
                                           timeout=30)  # fmt: skip
        try:
            conn.request(method, path, body=json.dumps(body).encode(),
                         headers={"Authorization": f"Bearer {token}",
                                  "Content-Type": "application/json"})  # fmt: skip
            answer = conn.getresponse()
            data = answer.read()
            assert answer.status == 200, (answer.status, data)
            return json.loads(data)
        finally:
            conn.close()

    def runs(self) -> dict[int, Any]:
        admin = {"Authorization": f"Bearer {self.setup.admin_token}"}
        status, _, body = self.get("/api/runs?limit=50", admin)
        assert status == 200
        return {run["id"]: run for run in json.loads(body)["runs"]}

    def page(self) -> str:
        status, headers, body = self.get("/ui/", _basic("ui", UI_PASSWORD))
        assert status == 200, body[:300]
        assert headers["Content-Type"].startswith("text/html")
        return body.decode()


def _alert(fingerprint: str, prometheus: str, **changes: Any) -> dict[str, Any]:
    payload: dict[str, Any] = json.loads((ALERTMANAGER_FIXTURES / "firing.json").read_text())
    alert = payload["alerts"][0]
    alert["fingerprint"] = fingerprint
    # Now, so that the chart's window holds the lab Prometheus' samples: it has scraped for a
    # few seconds more than this (the `page` fixture waits for them), so the chart shows the
    # series before and through the incident.
    alert["startsAt"] = (datetime.now(UTC) - timedelta(seconds=4)).isoformat()
    alert["generatorURL"] = f"{prometheus}/graph?g0.expr=gpufleet_llama_up&g0.tab=1"
    for key in ("labels", "annotations"):
        alert[key].update(changes.pop(key, {}))
    alert.update(changes)
    return payload


@pytest.fixture(scope="module")
def page(tmp_path_factory: pytest.TempPathFactory, certs: Certs) -> Iterator[Page]:
    tmp_path = tmp_path_factory.mktemp("ui")
    alpha, beta = CountingServer(), CountingServer()
    beta.verify_status = 500  # beta's run does not heal: its breaker opens (max_failures 1)
    web = tmp_path / "web-config.yml"
    web.write_text(f"tls_server_config:\n  cert_file: {certs.server.cert}\n"
                   f"  key_file: {certs.server.key}\n")  # fmt: skip
    (tmp_path / "ui.password").write_text(UI_PASSWORD + "\n")
    port = free_port()
    context = ssl.create_default_context(cafile=str(certs.ca))
    with (
        MetricsEndpoint(exposition()) as endpoint,
        PrometheusServer(tmp_path, [endpoint.target], job="gpu-fleet-exporter",
                         labels={"host": "dioscuri"}) as prometheus,
    ):  # fmt: skip
        setup = write_setup(
            tmp_path,
            servers={"alpha": alpha.url, "beta": beta.url},
            prometheus_url=prometheus.url,
            listen=f"127.0.0.1:{port}",
            max_failures=1,
            extra=f"web_config_file: {web}\nui: {{password_file: {tmp_path / 'ui.password'}}}\n",
        )
        log = (tmp_path / "remediator.log").open("wb")
        proc = subprocess.Popen([REMEDIATOR, "serve", "--config", str(setup.config)],
                                stdout=log, stderr=subprocess.STDOUT)  # fmt: skip
        served = Page(setup, port, context, prometheus)

        def up() -> bool:
            assert proc.poll() is None, (tmp_path / "remediator.log").read_text()
            try:
                return served.get("/healthz")[0] == 200
            except OSError:
                return False

        try:
            wait_until(up, timeout=30, what="the remediator on TLS")
            # The charts are drawn from Prometheus' samples: a page read before its first
            # scrape of the exporter would have none to draw. Eight seconds of them, to show
            # the series before the alerts (which start 4 s ago, `_alert`).
            prometheus.wait_for('count_over_time(gpufleet_llama_up{server="alpha"}[20s]) >= 8',
                                timeout=30)  # fmt: skip
            _fill(served)
            yield served
        finally:
            stop_process(proc, 15)
            log.close()
            alpha.close()
            beta.close()


def _fill(page: Page) -> None:
    token, admin, url = page.setup.webhook_token, page.setup.admin_token, page.prometheus.url
    hostile = _alert(
        "00000000000000a1",
        url,
        labels={"evil": EVIL},
        annotations={"summary": EVIL_SUMMARY, "runbook_url": "javascript:alert(2)",
                     "description": "[click](javascript:alert(3)) <b>bold</b>"},
    )  # fmt: skip
    page.send("POST", "/webhook/alertmanager", hostile, token)
    failing = _alert("00000000000000b2", url, labels={"server": "beta"})
    page.send("POST", "/webhook/alertmanager", failing, token)
    scripted = _alert("00000000000000c3", url, labels={"alertname": EVIL})
    page.send("POST", "/webhook/alertmanager", scripted, token)
    wait_until(lambda: len(page.runs()) == 3 and all(r["state"] == "done"
                                                     for r in page.runs().values()),
               timeout=60, what="three runs done")  # fmt: skip
    page.send("POST", "/api/maintenance/theia", {"on": True, "reason": "swap fans"}, admin)
    page.send("POST", "/api/pause", {"reason": "deploy <now>"}, admin)
    waits = _alert("00000000000000d4", url)
    page.send("POST", "/webhook/alertmanager", waits, token)
    wait_until(lambda: page.runs().get(4, {}).get("wait_reason") is not None, timeout=30,
               what="run 4 waiting")  # fmt: skip


class _Tags(HTMLParser):
    """Every tag and attribute of a document."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.tags: list[tuple[str, dict[str, str | None]]] = []
        self.text: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.append((tag, dict(attrs)))

    def handle_data(self, data: str) -> None:
        self.text.append(data)


def test_the_page_needs_its_own_credential(page: Page) -> None:
    status, headers, _ = page.get("/ui/")
    assert status == 401 and headers["WWW-Authenticate"].startswith("Basic realm=")
    assert page.get("/ui/", _basic("ui", "wrong"))[0] == 401
    assert page.get("/ui/", _basic("admin", UI_PASSWORD))[0] == 401
    # Neither the webhook's token nor the admin API's opens it, however they are sent.
    webhook = page.setup.webhook_token
    assert page.get("/ui/", {"Authorization": f"Bearer {webhook}"})[0] == 401
    assert page.get("/ui/", _basic("ui", webhook))[0] == 401
    assert page.get("/ui/", {"Authorization": f"Bearer {page.setup.admin_token}"})[0] == 401
    assert page.get("/ui/runs/1/chart.png")[0] == 401
    status, headers, _ = page.get("/ui/", _basic("ui", UI_PASSWORD))
    assert status == 200
    assert "default-src 'none'" in headers["Content-Security-Policy"]
    assert headers["Cache-Control"] == "no-store"


def test_the_page_shows_the_fleet_the_rails_and_the_runs(page: Page) -> None:
    body = page.page()
    parser = _Tags()
    parser.feed(body)
    text = " ".join("".join(parser.text).split())
    assert "<meta http-equiv=refresh content=30>" in body  # refreshes by itself, without script
    # The fleet table, as `status` shows it.
    assert "NVIDIA H200" in text and "61 / 95 (memory)" in text and "115.0 / 140.4" in text
    assert "41.5 / 52.2" in text and "sleeping" in text
    # A router's speeds by model, each against its own baseline (qwen's 42 %: marked bad).
    assert "gemma: 88.0 / 90.0" in text and "qwen: 12.5 / 30.0" in text
    assert "<span class='bad'>qwen: 12.5 / 30.0</span>" in body
    # Pause and maintenance with who and why, and the command that ends each.
    assert "Remediation is paused (fleet-wide)" in text and "by admin: deploy <now>" in text
    assert "gpu-fleet-remediator resume --reason WHY" in text
    assert "In maintenance since" in text and "swap fans" in text
    assert "gpu-fleet-remediator maintenance theia off" in text
    # The breaker and the cooldowns, with the command that resets it.
    assert "Open circuit breakers" in text
    assert "gpu-fleet-remediator breaker reset server/dioscuri/beta --reason WHY" in text
    assert "Cooldowns" in text and "server/dioscuri/alpha" in text
    # The waiting run, and how to cancel it.
    assert "gpu-fleet-remediator cancel 4 --reason WHY" in text
    # The runs: decision, steps, timings, verification, and the report as Zulip shows it.
    assert "http_probe" in text and "http_request" in text
    assert "probe http_probe: ok (GET" in text  # alpha's verification
    assert "<strong>Healed</strong>" in body and "<strong>Not healed</strong>" in body
    assert "<details class=spoiler><summary>Evidence</summary>" in body
    assert "Reported only" in text  # the alert no playbook handles
    assert "<img src='/ui/runs/1/chart.png'" in body
    assert "gpu-fleet-remediator runs --json" in text and "outbox" in text.lower()


def test_the_newest_run_and_the_newest_that_acted_are_open(page: Page) -> None:
    body = page.page()
    opened = re.findall(r"<details class=run id='run-(\d+)' open>", body)
    folded = re.findall(r"<details class=run id='run-(\d+)'>", body)
    # Run 4 waits for the pause (no step yet): open, and beside it run 2, the newest that
    # acted (beta's failed restart); run 3 was only reported, run 1 acted before run 2.
    assert opened == ["4", "2"] and folded == ["3", "1"], (opened, folded)
    assert "<details class=spoiler>" in body  # a report's evidence stays folded


def test_which_runs_open() -> None:
    from dataclasses import replace

    from remediator.ui import RunView, opened_runs
    from tests.test_notify_graph import temperature_run

    acted = temperature_run()  # run 7, with steps
    assert acted.steps
    waiting = replace(acted, id=8, steps=[], state="waiting", outcome=None)
    newer = replace(acted, id=9)

    def views(*runs: Any) -> list[RunView]:
        return [RunView(run, None, False) for run in runs]

    assert opened_runs([]) == set()
    assert opened_runs(views(newer, waiting, acted)) == {9}  # the newest acted: it alone
    assert opened_runs(views(waiting, acted)) == {8, 7}
    assert opened_runs(views(waiting)) == {8}  # nothing acted yet


def test_hostile_labels_are_text_never_markup(page: Page) -> None:
    body = page.page()
    parser = _Tags()
    parser.feed(body)
    for tag, attrs in parser.tags:
        assert tag in ALLOWED_TAGS, (tag, attrs)
        for name, value in attrs.items():
            assert not name.startswith("on"), (tag, attrs)
            if name == "href":
                assert value is not None
                assert value.startswith(("http://", "https://", "/", "#")), (tag, attrs)
            if name == "src":
                assert value is not None and value.startswith("/ui/runs/"), (tag, attrs)
    assert not any(tag == "img" and attrs.get("src") == "x" for tag, attrs in parser.tags)
    assert "javascript:" not in "".join(str(a.get("href")) for _, a in parser.tags)
    text = " ".join(parser.text)
    # Shown as what they are: text.
    assert EVIL in text and EVIL_SUMMARY in text and "<b>bold</b>" in text
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in body


def test_the_chart_is_the_reports_own_picture(page: Page) -> None:
    status, headers, png = page.get("/ui/runs/1/chart.png", _basic("ui", UI_PASSWORD))
    assert status == 200, png[:200]
    assert headers["Content-Type"] == "image/png" and png.startswith(b"\x89PNG\r\n\x1a\n")
    assert page.get("/ui/runs/999/chart.png", _basic("ui", UI_PASSWORD))[0] == 404


def test_without_a_ui_section_the_page_is_off(tmp_path: Path) -> None:
    from remediator.service import build_services
    from remediator.web import create_app

    setup = write_setup(tmp_path, servers={"alpha": "http://127.0.0.1:9"})
    config = load_config(setup.config)
    services = build_services(config, with_engine=False)
    try:
        client = create_app(config, services).test_client()
        answer = client.get("/ui/", headers=_basic("ui", "anything"))
        assert answer.status_code == 404 and b"ui" in answer.data
    finally:
        services.close()


def test_the_page_password_is_checked_at_start(tmp_path: Path) -> None:
    setup = write_setup(tmp_path, servers={"alpha": "http://127.0.0.1:9"})
    base = setup.config.read_text()
    password = tmp_path / "ui.password"

    def with_ui(content: str, username: str = "ui") -> Path:
        password.write_text(content + "\n")
        setup.config.write_text(
            base + f"ui: {{username: {json.dumps(username)}, password_file: {password}}}\n"
        )
        return setup.config

    # Alertmanager's token, or the admin API's, as the page's password: refused, named.
    for secret, key in ((setup.webhook_token, "auth"), (setup.admin_token, "admin")):
        with pytest.raises(ConfigError) as refused:
            load_config(with_ui(secret))
        assert "ui.password_file" in str(refused.value) and f"{key}'s secret" in str(refused.value)
    hashed = bcrypt.hashpw(setup.webhook_token.encode(), bcrypt.gensalt(rounds=4)).decode()
    with pytest.raises(ConfigError, match="auth's secret"):
        load_config(with_ui(hashed))  # the webhook's token behind a hash: refused too
    with pytest.raises(ConfigError, match="not one"):
        load_config(with_ui("$2b$10$tooshort"))
    with pytest.raises(ConfigError, match=r"ui\.username"):
        load_config(with_ui("fine-password", username="a:b"))
    # A bcrypt hash of the page's own password works: only the password opens the page.
    from remediator.ui import PageCredential

    good = load_config(with_ui(bcrypt.hashpw(b"mine", bcrypt.gensalt(rounds=4)).decode()))
    assert good.ui is not None
    credential = PageCredential(good.ui)
    assert credential.check(_basic("ui", "mine")["Authorization"])
    assert not credential.check(_basic("ui", "other")["Authorization"])
    assert not credential.check(_basic("root", "mine")["Authorization"])


GOLDEN = Path(__file__).parent / "golden"


@pytest.mark.parametrize("name", ["healed", "cooldown", "notify-only", "resolved"])
def test_the_golden_reports_render_as_zulip_shows_them(name: str) -> None:
    from remediator.ui import markdown_html

    rendered = markdown_html((GOLDEN / f"zulip-report-{name}.md").read_text())
    parser = _Tags()
    parser.feed(rendered)
    assert {tag for tag, _ in parser.tags} <= ALLOWED_TAGS
    assert "**" not in rendered and "](" not in rendered  # no Markdown left unrendered
    if name in ("healed", "notify-only"):
        assert "<details class=spoiler><summary>" in rendered and "<pre><code>" in rendered
        assert '<a href="https://' in rendered or '<a href="http://' in rendered
    if name == "healed":
        assert "<table><thead><tr><th>step</th>" in rendered
        assert "<td><code>restart_server</code></td>" in rendered
        # markdown.escape's backslashes are gone: `http\_probe` reads http_probe.
        assert "probe http_probe: ok" in rendered
    assert "<time datetime=" in rendered


# No deadline: a property, not a speed test (speed targets belong in bench/). `&` is left out:
# notify.markdown does not escape it, so an entity in a label (`&lt;`) means its character in
# Zulip as on the page; the zero-width space is what markdown.escape adds itself.
@settings(deadline=None, max_examples=300)
@given(
    st.text(
        alphabet=st.characters(exclude_characters="&\u200b", exclude_categories=["Cs"]),
        max_size=80,
    )
)
def test_alert_text_escaped_for_zulip_renders_as_written(text: str) -> None:
    """Whatever a label holds, `inline()` then the page's renderer show exactly that text."""
    from remediator.notify.markdown import cell, code, inline, one_line
    from remediator.ui import markdown_html

    for written, expected in ((inline(text), one_line(text)), (code(text), one_line(text))):
        parser = _Tags()
        parser.feed(markdown_html(f"**x** {written} **y**"))
        assert {tag for tag, _ in parser.tags} <= {"p", "strong", "code", "br"}, written
        shown = "".join(parser.text).replace("\u200b", "")
        assert shown.split() == f"x {expected} y".split(), written
    table = markdown_html(f"| a | b |\n|---|---|\n| {cell(text)} | z |")
    parser = _Tags()
    parser.feed(table)
    assert {tag for tag, _ in parser.tags} <= {"table", "thead", "tbody", "tr", "th", "td"}
    assert [tag for tag, _ in parser.tags].count("td") == 2  # a `|` in the text splits nothing
    first, second = re.findall(r"<td>(.*?)</td>", table)
    assert html.unescape(first).replace("\u200b", "").split() == one_line(text).split()
    assert second == "z"


def test_outbox_depth_and_failures_on_the_page_and_in_status(tmp_path: Path) -> None:
    from remediator.fleet_status import as_json, gather
    from remediator.service import build_services
    from remediator.web import create_app

    (tmp_path / "ui.password").write_text(UI_PASSWORD + "\n")
    setup = write_setup(tmp_path, servers={"alpha": "http://127.0.0.1:9"},
                        extra=f"ui: {{password_file: {tmp_path / 'ui.password'}}}\n")  # fmt: skip
    config = load_config(setup.config)
    services = build_services(config, with_engine=False)
    try:
        journal = services.journal
        journal.enqueue_report("alerts-gpu", "waiting to be sent")
        refused = journal.enqueue_report("alerts-gpu", "refused")
        journal.outbox_failed(refused, "Zulip: <b>Stream 'x' does not exist</b>")
        data = as_json(gather(journal, services.roster, config.prometheus_url))
        assert data["outbox_depth"] == 1
        [failure] = data["outbox_failures"]
        assert failure["id"] == refused and "does not exist" in failure["error"]
        assert "unreachable" in data["prometheus_error"]  # write_setup's Prometheus: port 9
        answer = (
            create_app(config, services)
            .test_client()
            .get("/ui/", headers=_basic("ui", UI_PASSWORD))
        )
        assert answer.status_code == 200
        body = answer.get_data(as_text=True)
        assert "1 report(s) not sent yet" in body and "Reports Zulip refused for good" in body
        assert "Zulip: &lt;b&gt;Stream &#x27;x&#x27; does not exist&lt;/b&gt;" in body
        assert "The fleet's values are unknown" in body  # Prometheus down, said so
    finally:
        services.close()
