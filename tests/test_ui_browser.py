"""The remediator's page in a real browser: Debian's `chromium`, headless.

The remediator is the one of `tests/test_ui_page.py` (its `page` fixture): a real `serve` over
TLS, a real Prometheus, real runs in its journal — one healed, one failed with its breaker
open, one whose alertname is a script, one waiting for the pause. Chromium loads `/ui/`, the
test reads the DOM chromium built (`--dump-dom`) and takes a screenshot (`--screenshot`), kept
as test output under pytest's tmp_path and copied to `.test-output/ui-page.png`.

Basic auth: chromium has no flag for a basic-auth credential, and credentials in the URL are
dropped for the page's subresources (the chart's `<img>`). So chromium talks to a small
reverse proxy on 127.0.0.1 that adds the `Authorization` header — the page's auth stays as
built — and forwards over the remediator's TLS, checked against the test CA. The proxy also
records what chromium fetched: the chart was loaded by the browser, not only linked.

Chromium is kept on the loopback: no background networking, and a host resolver that maps
every name to nothing, so nothing leaves 127.0.0.0/8.
"""

from __future__ import annotations

import http.client
import shutil
import subprocess
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from html.parser import HTMLParser
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from PIL import Image

from tests.test_ui_page import EVIL, EVIL_SUMMARY, UI_PASSWORD, Page, _basic, certs, page

__all__ = ["certs", "page"]  # the module-scoped fixtures of the page's tests, reused

REPO = Path(__file__).resolve().parent.parent
OUTPUT = REPO / ".test-output"  # ignored by git: the pictures of the last run, to look at
STABLE_SCREENSHOT = OUTPUT / "ui-page.png"
# Each chromium start is bounded: the whole test stays well under two minutes.
CHROMIUM_TIMEOUT_SECONDS = 45
# Tall enough for the whole page as the `page` fixture fills it (about 2 900 px with its two
# open runs, one with its chart): the screenshot is docs/remediator.md's picture of the page.
WINDOW = (1280, 2960)
# Answer headers the proxy passes back to chromium (the page's own policy among them).
PASSED_HEADERS = ("Content-Type", "Content-Security-Policy", "Cache-Control",
                  "X-Content-Type-Options", "Referrer-Policy", "X-Frame-Options")  # fmt: skip


@dataclass
class Fetched:
    """One request chromium made through the proxy, and what the remediator answered."""

    path: str
    status: int
    content_type: str
    length: int


class AuthProxy:
    """127.0.0.1:`port` (plain HTTP, loopback) → the remediator over TLS, with the credential."""

    def __init__(self, upstream: Page, authorization: str) -> None:
        self.fetched: list[Fetched] = []
        self.bodies: dict[str, bytes] = {}
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                conn = http.client.HTTPSConnection(
                    "127.0.0.1", upstream.port, context=upstream.context, timeout=30
                )
                try:
                    conn.request("GET", self.path, headers={"Authorization": authorization})
                    answer = conn.getresponse()
                    body = answer.read()
                finally:
                    conn.close()
                content_type = answer.getheader("Content-Type", "")
                proxy.fetched.append(Fetched(self.path, answer.status, content_type, len(body)))
                proxy.bodies[self.path] = body
                self.send_response(answer.status)
                for name in PASSED_HEADERS:
                    value = answer.getheader(name)
                    if value is not None:
                        self.send_header(name, value)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: object) -> None:
                del format, args  # quiet: the test reports what it fetched itself

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = int(self._server.server_address[1])
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=10)


def _chromium() -> str:
    found = shutil.which("chromium")
    if found is None:
        # Fail, never skip (DESIGN.md, "Tests: real parts"): a machine without the browser
        # must not report the browser test green.
        pytest.fail(
            "chromium is not installed: `make test` installs Debian's chromium (make deps)",
            pytrace=False,
        )
    return found


def _run_chromium(profile: Path, *args: str) -> subprocess.CompletedProcess[bytes]:
    argv = [
        _chromium(), "--headless=new", "--no-sandbox", "--disable-gpu",
        f"--user-data-dir={profile}", "--no-first-run", "--no-default-browser-check",
        "--disable-background-networking", "--disable-component-update", "--disable-sync",
        "--disable-extensions", "--disable-default-apps", "--disable-domain-reliability",
        "--disable-client-side-phishing-detection", "--metrics-recording-only",
        "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1",
        "--hide-scrollbars", f"--window-size={WINDOW[0]},{WINDOW[1]}", *args,
    ]  # fmt: skip
    result = subprocess.run(argv, capture_output=True, timeout=CHROMIUM_TIMEOUT_SECONDS,
                            check=False)  # fmt: skip
    assert result.returncode == 0, result.stderr.decode(errors="replace")[-3000:]
    return result


class _Dom(HTMLParser):
    """The rendered DOM's tags, text and the images' sources."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.tags: list[str] = []
        self.text: list[str] = []
        self.images: list[str] = []
        self.open_runs: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.append(tag)
        found = dict(attrs)
        if tag == "img":
            self.images.append(found.get("src") or "")
        if tag == "details" and "open" in found and found.get("class") == "run":
            self.open_runs.append(found.get("id") or "")

    def handle_data(self, data: str) -> None:
        self.text.append(data)


@pytest.fixture(scope="module")
def proxy(page: Page) -> Iterator[AuthProxy]:
    served = AuthProxy(page, _basic("ui", UI_PASSWORD)["Authorization"])
    try:
        yield served
    finally:
        served.close()


def test_chromium_renders_the_page_with_its_runs_and_chart(
    page: Page, proxy: AuthProxy, tmp_path: Path
) -> None:
    # Without the proxy's credential the browser gets the remediator's 401, not the page.
    assert page.get("/ui/")[0] == 401
    url = f"{proxy.url}/ui/"
    dom_html = _run_chromium(tmp_path / "profile-dom", "--dump-dom", url).stdout.decode()
    dom = _Dom()
    dom.feed(dom_html)
    text = " ".join("".join(dom.text).split())
    # What a person sees: the fleet table, the rails, the runs with their steps.
    assert "gpu-fleet remediator" in text
    assert "NVIDIA H200" in text and "61 / 95 (memory)" in text and "sleeping" in text
    assert "Remediation is paused (fleet-wide)" in text and "swap fans" in text
    assert "Open circuit breakers" in text and "server/dioscuri/beta" in text
    assert "http_probe" in text and "probe http_probe: ok (GET" in text
    assert "Healed" in text and "Not healed" in text and "Reported only" in text
    assert "gpu-fleet-remediator cancel 4 --reason WHY" in text
    # The hostile label and summary are text in the DOM chromium built: no script ran, no
    # element came from them.
    assert EVIL in text and EVIL_SUMMARY in text
    assert "script" not in dom.tags
    assert all(src.startswith("/ui/runs/") for src in dom.images), dom.images
    assert "/ui/runs/1/chart.png" in dom.images
    # Open as the page comes: the waiting run and the newest that acted, with its chart.
    assert dom.open_runs == ["run-4", "run-2"], dom.open_runs
    # The browser fetched the chart itself, through the credential, and got a PNG.
    charts = [f for f in proxy.fetched if f.path.endswith("/chart.png")]
    assert charts and all(f.status == 200 and f.content_type == "image/png" for f in charts)
    assert all(f.length > 1000 for f in charts), charts

    shot = tmp_path / "ui-page.png"
    _run_chromium(tmp_path / "profile-shot", f"--screenshot={shot}", url)
    with Image.open(shot) as image:
        image.load()
        assert image.size == WINDOW
        rgb = image.convert("RGB")
    # Not blank: text, table rules and the chart's lines give many colours, and no one
    # colour (the background) covers nearly all of it.
    colours = rgb.getcolors(maxcolors=WINDOW[0] * WINDOW[1]) or []
    assert len(colours) > 200, len(colours)
    assert max(count for count, _ in colours) < 0.97 * WINDOW[0] * WINDOW[1]
    OUTPUT.mkdir(exist_ok=True)
    shutil.copyfile(shot, STABLE_SCREENSHOT)
    # The chart as the browser got it, beside the screenshot (it sits in a closed run).
    (OUTPUT / "ui-chart.png").write_bytes(proxy.bodies[charts[0].path])
    print(f"screenshot: {shot} (also {STABLE_SCREENSHOT}; the chart: {OUTPUT / 'ui-chart.png'})")
