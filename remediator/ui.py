"""The remediator's own page: read-only HTML at `/ui/`, behind a credential a browser can send.

What it shows (`render_page`): the fleet table (`remediator.fleet_status`, the same data as
`gpu-fleet-remediator status`); pause and maintenance with who set them and why; open
breakers and cooldowns; runs that wait; the recent runs with their decision, steps, timings,
verification and the report as Zulip would render it, chart included (`/ui/runs/<id>/chart.png`,
drawn by the report's own `remediator.notify.graph.draw`) — the newest run unfolded, and the
newest that acted when the newest did not (`opened_runs`); the outbox's depth and its failures.
Each view names the CLI command a person runs to act: the page itself changes nothing.

Air-gapped by construction: one HTML document, CSS inline, no script, no font, no request to
anywhere but the remediator itself (the chart is an `<img>` of this origin); it refreshes
itself with `<meta http-equiv="refresh">`. The answer's Content-Security-Policy says the same
(`default-src 'none'`: a page that tried to load anything else would be refused by the browser).

Hostile input: alert labels and annotations, step output and Prometheus label values are
written by others. Everything is escaped with `html.escape` where it is written into the page,
and a report's Markdown goes through `markdown_html`, a small renderer of the subset the reports
use (`remediator/notify/markdown.py` writes it) that emits only the tags it knows, escapes all
text, and keeps a link only when it is `http(s)://` or a path of this origin.

The credential (`ui` in the config): HTTP basic auth for one user (`ui` by default) whose
password, or its bcrypt hash, is in `ui.password_file`; it must differ from the webhook's and
the admin API's secrets. Without a `ui` section the page is off (404). With the web config's
TLS (`web_config_file`) the page is served over it like every other route (remediator/front.py).

Check by hand: `curl -su ui:$(cat /etc/gpu-fleet/ui.password) http://127.0.0.1:9095/ui/`.
"""

from __future__ import annotations

import html
import re
import shlex
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from remediator.config import BCRYPT_HASH, Credential, UiSettings, read_secret
from remediator.fleet_status import (
    GIB,
    FleetStatus,
    GpuStatus,
    HostStatus,
    ServerStatus,
    ratio,
)
from remediator.journal import RunRecord

REALM = "gpu-fleet-remediator page"
REFRESH_SECONDS = 30
CSP = (
    "default-src 'none'; style-src 'unsafe-inline'; img-src 'self'; base-uri 'none'; "
    "form-action 'none'; frame-ancestors 'none'"
)
"""The page's Content-Security-Policy: inline CSS and this origin's images, nothing else."""
CLI = "gpu-fleet-remediator"


# --- the credential -------------------------------------------------------------------------


class PageCredential:
    """The page's basic-auth user: a password (re-read when its file changes) or a bcrypt hash."""

    def __init__(self, settings: UiSettings) -> None:
        secret = read_secret(settings.password_file)
        self.username = settings.username
        self._plain: Credential | None = None
        self._hashed = None
        if BCRYPT_HASH.match(secret):
            from fleet.webconfig import BasicAuthChecker  # noqa: PLC0415

            self._hashed = BasicAuthChecker({settings.username: secret})
        else:
            self._plain = Credential("basic", settings.password_file, settings.username, secret)

    def __repr__(self) -> str:
        return f"PageCredential(username={self.username!r})"

    @property
    def www_authenticate(self) -> str:
        """The `WWW-Authenticate` value of a 401: the browser asks for the user and password."""
        return f'Basic realm="{REALM}", charset="UTF-8"'

    def check(self, authorization: str | None) -> bool:
        """Whether an `Authorization` header carries the page's user and password."""
        if self._hashed is not None:
            return self._hashed.check_header(authorization)
        assert self._plain is not None
        return self._plain.check_authorization_header(authorization)


def page_credential(settings: UiSettings | None) -> PageCredential | None:
    """The page's credential, or None when the config has no `ui` (the page is off)."""
    return PageCredential(settings) if settings is not None else None


# --- Markdown, as Zulip renders the reports -------------------------------------------------

_FENCE = re.compile(r"^(`{3,})(.*)$")
_TABLE_RULE = re.compile(r"^\|?\s*:?-{3,}:?\s*(\|\s*:?-{3,}:?\s*)*\|?\s*$")
_PUNCTUATION = set("!\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~")
_TIME = re.compile(r"<time:([0-9T:.+\-Z]{10,40})>")
_MAX_FAILED_SCANS = 64


def safe_href(url: str) -> str | None:
    """`url` when a link may point there: http(s), or a path of this origin; else None."""
    url = url.strip()
    if re.match(r"^https?://[^\s\"'<>]+$", url, re.IGNORECASE):
        return url
    if url.startswith("/") and not url.startswith("//") and not re.search(r"[\s\"'<>\\]", url):
        return url
    return None


def _text(segment: str) -> str:
    # Entities (`&lt;`, as markdown.escape writes `<`) mean their character, as in CommonMark;
    # everything is escaped again on the way out.
    return html.escape(html.unescape(segment), quote=True)


def _find_closing(text: str, start: int, marker: str) -> int:
    """Where `marker` next occurs in `text` from `start`, skipping backslash escapes; -1 if not."""
    i = start
    while i < len(text):
        if text[i] == "\\":
            i += 2
            continue
        if text.startswith(marker, i):
            return i
        i += 1
    return -1


def _paren_end(text: str, start: int) -> int:
    """The `)` closing the `(` at `start`, nested ones counted as CommonMark does; or -1."""
    depth = 0
    for i in range(start, len(text)):
        if text[i] == "(":
            depth += 1
        elif text[i] == ")":
            depth -= 1
            if depth == 0:
                return i
        elif text[i].isspace():
            return -1  # a destination has no spaces: this is not a link
    return -1


def _bracket_end(text: str, start: int) -> int:
    """The `]` that closes the `[` at `start` (nesting and escapes counted), or -1."""
    depth, i = 0, start
    while i < len(text):
        char = text[i]
        if char == "\\":
            i += 2
            continue
        if char == "[":
            depth += 1
        elif char == "]":
            depth -= 1
            if depth == 0:
                return i
        i += 1
    return -1


def inline_html(text: str, *, links: bool = True) -> str:
    """One line of Zulip Markdown as HTML: code, bold, emphasis, links, times; the rest text."""
    out: list[str] = []
    plain: list[str] = []
    i = 0
    # Where a marker is known to have no closing any more: hostile text full of openers costs
    # one scan per marker, not one per opener (the reports escape them anyway).
    unclosed: dict[str, int] = {}

    def closing(start: int, marker: str) -> int:
        if unclosed.get(marker, len(text) + 1) <= start:
            return -1
        found = _find_closing(text, start, marker)
        if found < 0:
            unclosed[marker] = start
        return found

    def flush() -> None:
        if plain:
            out.append(_text("".join(plain)))
            plain.clear()

    while i < len(text):
        char = text[i]
        if char == "\\" and i + 1 < len(text) and text[i + 1] in _PUNCTUATION:
            flush()
            out.append(html.escape(text[i + 1], quote=True))
            i += 2
            continue
        if char == "`":
            run = len(text[i:]) - len(text[i:].lstrip("`"))
            fence = "`" * run
            end = i + run
            while True:
                end = text.find(fence, end)
                if end < 0 or not text.startswith("`", end + run):
                    break
                end += len(text[end:]) - len(text[end:].lstrip("`"))
            if end >= 0:
                flush()
                inner = text[i + run : end]
                if inner.startswith(" ") and inner.endswith(" ") and inner.strip():
                    inner = inner[1:-1]
                out.append(f"<code>{html.escape(inner, quote=True)}</code>")
                i = end + run
                continue
            plain.append(fence)
            i += run
            continue
        if char == "<":
            stamp = _TIME.match(text, i)
            if stamp is not None:
                flush()
                when = stamp.group(1)
                out.append(
                    f'<time datetime="{html.escape(when, quote=True)}">'
                    f"{html.escape(_utc(when))}</time>"
                )
                i = stamp.end()
                continue
        if text.startswith("**", i):
            end = closing(i + 2, "**")
            if end > i + 2:
                flush()
                out.append(f"<strong>{inline_html(text[i + 2 : end], links=links)}</strong>")
                i = end + 2
                continue
        if char in "*_" and i + 1 < len(text) and not text[i + 1].isspace():
            before = text[i - 1] if i > 0 else " "
            if char == "*" or not before.isalnum():
                end = closing(i + 1, char)
                after = text[end + 1] if 0 <= end < len(text) - 1 else " "
                if (
                    end > i + 1
                    and not text[end - 1].isspace()
                    and (char == "*" or not after.isalnum())
                ):
                    flush()
                    out.append(f"<em>{inline_html(text[i + 1 : end], links=links)}</em>")
                    i = end + 1
                    continue
        if char == "[" and links:
            # Nested brackets make "no closing from here" say nothing of later openers: the
            # failed scans are counted instead, and bounded.
            close = -1 if unclosed.get("[", 0) >= _MAX_FAILED_SCANS else _bracket_end(text, i)
            if close < 0:
                unclosed["["] = unclosed.get("[", 0) + 1
            if close > i and text.startswith("(", close + 1):
                end = _paren_end(text, close + 1)
                if end > close + 1:
                    flush()
                    label = inline_html(text[i + 1 : close], links=False)
                    href = safe_href(text[close + 2 : end])
                    if href is None:
                        out.append(label)
                    else:
                        out.append(
                            f'<a href="{html.escape(href, quote=True)}" '
                            f'rel="noreferrer noopener">{label}</a>'
                        )
                    i = end + 1
                    continue
        plain.append(char)
        i += 1
    flush()
    return "".join(out)


def _utc(when: str) -> str:
    try:
        return f"{datetime.fromisoformat(when).astimezone(UTC):%Y-%m-%d %H:%M:%S} UTC"
    except ValueError:
        return when


def _cells(line: str) -> list[str]:
    line = line.strip()
    line = line.removeprefix("|")
    if line.endswith("|") and not line.endswith("\\|"):
        line = line[:-1]
    cells, current, i = [], [], 0
    while i < len(line):
        if line.startswith("\\|", i):
            current.append("\\|")
            i += 2
            continue
        if line[i] == "|":
            cells.append("".join(current).strip())
            current = []
        else:
            current.append(line[i])
        i += 1
    cells.append("".join(current).strip())
    return cells


def markdown_html(text: str) -> str:
    """A report's Zulip Markdown as safe HTML (paragraphs, tables, code, spoilers, inline)."""
    return "".join(_blocks(text.split("\n")))


def _blocks(lines: Sequence[str]) -> Iterable[str]:
    i = 0
    paragraph: list[str] = []

    def close_paragraph() -> Iterable[str]:
        if paragraph:
            # Zulip keeps a paragraph's line breaks.
            yield "<p>" + "<br>\n".join(inline_html(line) for line in paragraph) + "</p>\n"
            paragraph.clear()

    while i < len(lines):
        line = lines[i]
        fence = _FENCE.match(line)
        if fence is not None:
            yield from close_paragraph()
            marker, info = fence.group(1), fence.group(2).strip()
            end = next(
                (j for j in range(i + 1, len(lines)) if lines[j].rstrip() == marker), len(lines)
            )
            body = lines[i + 1 : end]
            if info.startswith("spoiler"):
                title = info.removeprefix("spoiler").strip() or "Spoiler"
                yield (
                    f"<details class=spoiler><summary>{inline_html(title)}</summary>\n"
                    + "".join(_blocks(body))
                    + "</details>\n"
                )
            else:
                yield f"<pre><code>{html.escape(chr(10).join(body), quote=True)}</code></pre>\n"
            i = end + 1
            continue
        if line.lstrip().startswith("|") and i + 1 < len(lines) and _TABLE_RULE.match(lines[i + 1]):
            yield from close_paragraph()
            head = _cells(line)
            rows = []
            j = i + 2
            while j < len(lines) and lines[j].lstrip().startswith("|"):
                rows.append(_cells(lines[j]))
                j += 1
            parts = ["<table><thead><tr>"]
            parts += [f"<th>{inline_html(cell)}</th>" for cell in head]
            parts.append("</tr></thead><tbody>")
            for row in rows:
                padded = (row + [""] * len(head))[: len(head)]
                parts.append(
                    "<tr>" + "".join(f"<td>{inline_html(c)}</td>" for c in padded) + "</tr>"
                )
            parts.append("</tbody></table>\n")
            yield "".join(parts)
            i = j
            continue
        if not line.strip():
            yield from close_paragraph()
        else:
            paragraph.append(line)
        i += 1
    yield from close_paragraph()


# --- the page -------------------------------------------------------------------------------


def esc(value: object) -> str:
    """Text for HTML (element content or a quoted attribute)."""
    return html.escape("" if value is None else str(value), quote=True)


def _when(value: datetime | None) -> str:
    if value is None:
        return "—"
    return f"{value.astimezone(UTC):%Y-%m-%d %H:%M:%S}Z"


def _num(value: float | None, digits: int = 0) -> str:
    return "?" if value is None else f"{value:.{digits}f}"


def _pair(value: float | None, reference: float | None, digits: int = 0) -> str:
    if value is None and reference is None:
        return "?"
    return f"{_num(value, digits)} / {_num(reference, digits)}"


def command(*words: str, config: Path | None) -> str:
    """A CLI command, each word shell-quoted, as HTML `<code>`."""
    line = " ".join(shlex.quote(word) for word in (CLI, *words))
    if config is not None:
        line += f" --config {shlex.quote(str(config))}"
    return f"<code class=cmd>{esc(line)}</code>"


_STYLE = """
body{font:14px/1.4 system-ui,sans-serif;margin:1em 2em;color:#1d232b;background:#fff}
h1{font-size:20px;margin:.2em 0}h2{font-size:17px;margin:1.4em 0 .4em;border-bottom:1px solid #ccd}
h3{font-size:15px;margin:1em 0 .3em}
table{border-collapse:collapse;margin:.3em 0}th,td{border:1px solid #d5d9e0;padding:2px 7px;
text-align:left;vertical-align:top}th{background:#f1f3f6}td.n{text-align:right}
.good{color:#137333}.warn{color:#a15c00;font-weight:600}.bad{color:#b3261e;font-weight:700}
.dim{color:#7a828e}.act{color:#3c4657;font-size:13px;margin:.3em 0}
code{font:12.5px ui-monospace,monospace;background:#f4f5f7;padding:0 3px}
code.cmd{background:#eef3ff}pre{background:#f4f5f7;padding:6px;overflow-x:auto;max-height:30em}
details.run{border:1px solid #d5d9e0;margin:.4em 0;padding:.3em .6em}
details.run>summary{cursor:pointer}.report{border-left:3px solid #8fb3ff;padding-left:.8em}
.report img{max-width:100%}.banner{padding:.4em .8em;margin:.4em 0;border-radius:3px}
.banner.bad{background:#fdecea}.banner.warn{background:#fff4e0}
"""


@dataclass(frozen=True)
class RunView:
    """A run for the page: its record, its report's Markdown (None: not reported) and chart."""

    run: RunRecord
    report: str | None
    chart: bool


def _tone_state(state: str | None) -> str:
    if state is None:
        return "dim"
    if state in ("ok", "up", "router", "sleeping"):
        return "good"
    return "bad" if state in ("error", "unreachable", "timeout", "down") else "warn"


def _gpu_rows(gpus: Sequence[GpuStatus]) -> str:
    rows = [
        "<table><tr><th>GPU</th><th>model</th><th>up</th><th>temperature / critical °C"
        "</th><th>VRAM used / total GiB</th><th>power / cap W</th></tr>"
    ]
    for gpu in gpus:
        temp_tone = ""
        if gpu.temperature_celsius is not None and gpu.critical_celsius is not None:
            margin = gpu.critical_celsius - gpu.temperature_celsius
            temp_tone = "bad" if margin <= 5 else "warn" if margin <= 15 else "good"
        used = None if gpu.vram_used_bytes is None else gpu.vram_used_bytes / GIB
        total = None if gpu.vram_total_bytes is None else gpu.vram_total_bytes / GIB
        share = ratio(gpu.vram_used_bytes, gpu.vram_total_bytes)
        vram_tone = (
            "" if share is None else "bad" if share >= 0.97 else "warn" if share >= 0.9 else ""
        )
        up = (
            "lost"
            if gpu.up is False
            else "hung"
            if gpu.read_timeout
            else ("yes" if gpu.up else "?")
        )
        sensor = f" ({esc(gpu.temperature_sensor)})" if gpu.temperature_sensor else ""
        rows.append(
            f"<tr><td>{esc(gpu.gpu)}</td><td>{esc(gpu.model or '?')}</td>"
            f"<td class={'good' if gpu.up else 'bad' if gpu.up is False else 'dim'}>{up}</td>"
            f"<td class='n {temp_tone}'>{_pair(gpu.temperature_celsius, gpu.critical_celsius)}"
            f"{sensor}</td><td class='n {vram_tone}'>{_pair(used, total, 1)}</td>"
            f"<td class=n>{_pair(gpu.power_watts, gpu.power_cap_watts)}</td></tr>"
        )
    rows.append("</table>")
    return "".join(rows)


def _server_rows(servers: Sequence[ServerStatus]) -> str:
    rows = [
        "<table><tr><th>server</th><th>role</th><th>model</th><th>state</th><th>context</th>"
        "<th>slots busy / total</th><th>deferred</th><th>tok/s now / baseline</th>"
        "<th>ghost</th></tr>"
    ]
    for server in servers:
        state = server.state or ("inactive" if server.unit_active is False else "?")
        if server.router_models:
            models = ", ".join(
                f"{esc(name or '-')}: {esc(s)}" for name, s in server.router_models.items()
            )
            state_html = f"{esc(state)}<br><span class=dim>{models}</span>"
        else:
            state_html = esc(state)
        speed = ratio(server.tokens_per_second, server.baseline_tokens_per_second)
        speed_tone = _speed_tone(speed)
        speed_html = _pair(server.tokens_per_second, server.baseline_tokens_per_second, 1)
        if server.model_speeds:  # a router: each model against its own baseline
            speed_html = "<br>".join(
                f"<span class='{_speed_tone(ratio(m.now, m.baseline))}'>{esc(name)}: "
                f"{_pair(m.now, m.baseline, 1)}</span>"
                for name, m in server.model_speeds.items()
            )
        name = esc(server.server) + (
            "" if server.in_roster else " <span class=warn>(not in the roster)</span>"
        )
        rows.append(
            f"<tr><td>{name}</td><td>{esc(server.role or '?')}</td>"
            f"<td>{esc(server.model or '?')}</td>"
            f"<td class={_tone_state(server.state)}>{state_html}</td>"
            f"<td class=n>{_num(server.context_tokens)}</td>"
            f"<td class=n>{_pair(server.slots_busy, server.slots_total)}</td>"
            f"<td class='n {'warn' if server.deferred else ''}'>{_num(server.deferred)}</td>"
            f"<td class='n {speed_tone}'>{speed_html}</td>"
            f"<td class={'bad' if server.ghost else ''}>"
            f"{'?' if server.ghost is None else 'yes' if server.ghost else 'no'}</td></tr>"
        )
    rows.append("</table>")
    return "".join(rows)


def _speed_tone(share: float | None) -> str:
    """A speed against its baseline: bad under half, a warning under 70 %."""
    return "" if share is None else "bad" if share < 0.5 else "warn" if share < 0.7 else ""


def _host_section(host: HostStatus, status: FleetStatus, config: Path | None) -> str:
    exporter = {
        True: ("good", "exporter up"),
        False: ("bad", "exporter down"),
        None: ("dim", "exporter not scraped"),
    }[host.exporter_up]
    if status.prometheus_error is not None:
        exporter = ("dim", "exporter ?")
    parts = [
        f"<h3 id='host-{esc(host.host)}'>{esc(host.host)} "
        f"<span class={exporter[0]}>· {exporter[1]}</span>"
        + ("" if host.in_roster else " <span class=warn>(not in the roster)</span>")
        + "</h3>"
    ]
    if host.maintenance is not None:
        m = host.maintenance
        until = f" until {_when(m.until)}" if m.until else " (until turned off)"
        parts.append(
            f"<div class='banner warn'>In maintenance since {_when(m.since)}{until} by "
            f"<b>{esc(m.by)}</b>: {esc(m.reason or '(no reason given)')}. "
            f"End it: {command('maintenance', host.host, 'off', config=config)}</div>"
        )
    if host.gpus:
        parts.append(_gpu_rows(host.gpus))
    if host.servers:
        parts.append(_server_rows(host.servers))
    if host.last_runs:
        items = "".join(
            f"<li><a href='#run-{r.id}'>run #{r.id}</a> {_when(r.created_at)} "
            f"<code>{esc(r.target)}</code> {esc(r.alertname)} → {esc(r.playbook or '-')}: "
            f"<b>{esc(r.result)}</b></li>"
            for r in host.last_runs
        )
        parts.append(f"<div>Last run of each target:<ul>{items}</ul></div>")
    return "".join(parts)


def _rails_section(status: FleetStatus, config: Path | None) -> str:
    parts = ["<h2 id=rails>Pause, maintenance, breakers, cooldowns</h2>"]
    pause = status.pause
    if pause.paused:
        parts.append(
            f"<div class='banner warn'>Remediation is <b>paused</b> (fleet-wide) since "
            f"{_when(pause.at)} by <b>{esc(pause.by or '?')}</b>: "
            f"{esc(pause.reason or '(no reason given)')}. Runs wait. "
            f"Resume: {command('resume', '--reason', 'WHY', config=config)}</div>"
        )
    elif pause.paused is False:
        parts.append(
            f"<p>Remediation is <span class=good>active</span>. Pause it: "
            f"{command('pause', '--reason', 'WHY', config=config)}</p>"
        )
    maintenance = [h for h in status.hosts if h.maintenance is not None]
    if maintenance:
        rows = "".join(
            f"<tr><td>{esc(h.host)}</td><td>{_when(h.maintenance.since)}</td>"
            f"<td>{_when(h.maintenance.until) if h.maintenance.until else 'until turned off'}"
            f"</td><td>{esc(h.maintenance.by)}</td><td>{esc(h.maintenance.reason)}</td>"
            f"<td>{command('maintenance', h.host, 'off', config=config)}</td></tr>"
            for h in maintenance
            if h.maintenance is not None
        )
        parts.append(
            "<h3>Hosts in maintenance</h3><table><tr><th>host</th><th>since</th>"
            "<th>until</th><th>by</th><th>why</th><th>end it</th></tr>"
            f"{rows}</table>"
        )
    else:
        parts.append(
            "<p>No host is in maintenance. Start one: "
            f"{command('maintenance', 'HOST', 'on', '--reason', 'WHY', config=config)}"
            "</p>"
        )
    breakers = [b for h in status.hosts for b in h.breakers]
    if breakers:
        rows = "".join(
            f"<tr><td><code>{esc(b.target)}</code></td><td>{_when(b.opened_at)}</td>"
            f"<td>{esc(b.playbook or '?')}</td><td>{esc(b.reason or '')}</td>"
            f"<td>{command('breaker', 'reset', b.target, '--reason', 'WHY', config=config)}"
            "</td></tr>"
            for b in breakers
        )
        parts.append(
            "<h3 class=bad>Open circuit breakers</h3><p class=act>Acting on these "
            "targets stopped until a person resets the breaker.</p><table><tr>"
            "<th>target</th><th>opened</th><th>playbook</th><th>why</th>"
            f"<th>reset it</th></tr>{rows}</table>"
        )
    else:
        parts.append("<p>No circuit breaker is open.</p>")
    cooldowns = [c for h in status.hosts for c in h.cooldowns]
    if cooldowns:
        rows = "".join(
            f"<tr><td><code>{esc(c.target)}</code></td><td>{_when(c.until)}</td>"
            f"<td>{esc(c.playbook or '?')}</td></tr>"
            for c in cooldowns
        )
        parts.append(
            "<h3>Cooldowns</h3><p class=act>A cooldown ends by itself; a run that "
            "meets one waits for it.</p><table><tr><th>target</th><th>until</th>"
            f"<th>left by</th></tr>{rows}</table>"
        )
    else:
        parts.append("<p>No target is cooling down.</p>")
    if status.waiting_runs:
        rows = "".join(
            f"<tr><td><a href='#run-{r.id}'>#{r.id}</a></td><td><code>{esc(r.target)}</code>"
            f"</td><td>{esc(r.alertname)}</td><td>{esc(r.playbook or '-')}</td>"
            f"<td>{esc(r.wait_reason)}</td><td>{_when(r.not_before)}</td>"
            f"<td>{command('cancel', str(r.id), '--reason', 'WHY', config=config)}</td></tr>"
            for r in status.waiting_runs
        )
        parts.append(
            "<h3>Runs that wait</h3><table><tr><th>run</th><th>target</th>"
            "<th>alert</th><th>playbook</th><th>waits for</th><th>next look</th>"
            f"<th>cancel it</th></tr>{rows}</table>"
        )
    return "".join(parts)


def _step_seconds(started: datetime, finished: datetime | None) -> str:
    if finished is None:
        return "—"
    return f"{(finished - started).total_seconds():.1f} s"


def opened_runs(runs: Sequence[RunView]) -> set[int]:
    """The runs the page shows unfolded (`runs` newest first): what a person comes to read.

    The newest run (what happens now), and, when that one took no step (it waits, was only
    reported, or resolved first), the newest run that acted: the last thing the remediator did
    to the fleet, with its steps and its report's chart. The rest stay folded, one line each.
    Chosen by the page, not left to the reader: it refreshes itself every 30 s without a
    script, which folds again whatever a person unfolded.
    """
    opened = {runs[0].run.id} if runs else set()
    acted = next((view.run.id for view in runs if view.run.steps), None)
    if acted is not None and not runs[0].run.steps:
        opened.add(acted)
    return opened


def _run_section(view: RunView, config: Path | None, *, opened: bool = False) -> str:
    run = view.run
    result = run.outcome or run.decision or run.state
    if run.waiting:
        result = f"waiting ({run.wait_reason})"
    tone = (
        "good"
        if run.outcome in ("healed", "done_unverified", "resolved")
        else "bad"
        if run.outcome in ("not_healed", "failed", "interrupted")
        else ""
    )
    summary = (
        f"<summary><b>#{run.id}</b> {_when(run.created_at)} · <b>{esc(run.alert.alertname)}</b>"
        f" → {esc(run.playbook or '-')} on <code>{esc(run.target or '-')}</code>: "
        f"<span class='{tone}'>{esc(result)}</span></summary>"
    )
    facts = [
        ("decision", esc(run.decision or "—") + (f": {esc(run.reason)}" if run.reason else "")),
        ("state / outcome", f"{esc(run.state)} / {esc(run.outcome or '—')}"),
        (
            "alert",
            f"{esc(run.alert.status)} since {_when(run.alert.starts_at)}, fingerprint "
            f"<code>{esc(run.alert.fingerprint)}</code>",
        ),
        (
            "labels",
            ", ".join(
                f"{esc(k)}=<code>{esc(v)}</code>" for k, v in sorted(run.alert.labels.items())
            ),
        ),
        (
            "created / started / finished",
            f"{_when(run.created_at)} / {_when(run.started_at)} / {_when(run.finished_at)}",
        ),
        ("owner", esc(run.owner or "—")),
        ("verification", esc(run.verification or "—")),
    ]
    if run.waiting:
        facts.append(
            (
                "act",
                f"next look {_when(run.not_before)}; cancel it: "
                f"{command('cancel', str(run.id), '--reason', 'WHY', config=config)}",
            )
        )
    parts = [f"<details class=run id='run-{run.id}'{' open' * opened}>{summary}<table>"]
    parts += [f"<tr><th>{name}</th><td>{value}</td></tr>" for name, value in facts]
    parts.append("</table>")
    if run.steps:
        parts.append(
            "<table><tr><th>step</th><th>action</th><th>result</th><th>started</th>"
            "<th>took</th><th>output</th></tr>"
        )
        for step in run.steps:
            output = step.output if len(step.output) <= 4000 else step.output[:4000] + " …"
            parts.append(
                f"<tr><td class=n>{step.index + 1}</td><td><code>{esc(step.action)}</code></td>"
                f"<td>{esc(step.result)}</td><td>{_when(step.started_at)}</td>"
                f"<td class=n>{_step_seconds(step.started_at, step.finished_at)}</td>"
                f"<td><pre>{esc(output)}</pre></td></tr>"
            )
        parts.append("</table>")
    if view.report is not None:
        report = markdown_html(view.report)
        if view.chart:
            # Where the sender puts the picture: after the report's first paragraph.
            chart = (
                f"<p><img src='/ui/runs/{run.id}/chart.png' alt='the metric around the "
                f"incident' loading=lazy width=720></p>\n"
            )
            head, sep, rest = report.partition("</p>\n")
            report = f"{head}{sep}{chart}{rest}" if sep else f"{chart}{report}"
        parts.append(f"<h4>The report, as Zulip shows it</h4><div class=report>{report}</div>")
    parts.append("</details>")
    return "".join(parts)


def _outbox_section(status: FleetStatus) -> str:
    if status.journal_error is not None:
        return ""
    oldest = f", the oldest from {_when(status.outbox_oldest)}" if status.outbox_oldest else ""
    parts = [
        f"<h2 id=outbox>Outbox</h2><p>{_num(status.outbox_depth)} report(s) not sent yet"
        f"{oldest}.</p>"
    ]
    if status.outbox_failures:
        rows = "".join(
            f"<tr><td>{f.id}</td><td>{_when(f.created_at)}</td><td>{esc(f.topic)}</td>"
            f"<td>{'#' + str(f.run_id) if f.run_id is not None else '—'}</td>"
            f"<td class=n>{f.attempts}</td><td>{esc(f.error or '')}</td></tr>"
            for f in status.outbox_failures
        )
        parts.append(
            "<h3 class=bad>Reports Zulip refused for good</h3><table><tr><th>id</th>"
            "<th>queued</th><th>topic</th><th>run</th><th>attempts</th><th>error</th>"
            f"</tr>{rows}</table>"
        )
    else:
        parts.append("<p>No report failed.</p>")
    return "".join(parts)


def render_page(
    status: FleetStatus, runs: Sequence[RunView], *, config_path: Path | None = None
) -> str:
    """The whole page (an HTML document), from the fleet's status and the recent runs."""
    banners = []
    if status.prometheus_error is not None:
        banners.append(
            f"<div class='banner bad'>Prometheus ({esc(status.prometheus_url)}): "
            f"{esc(status.prometheus_error)}. The fleet's values are unknown (?); "
            "the journal's part is shown.</div>"
        )
    if status.journal_error is not None:
        banners.append(
            f"<div class='banner bad'>The journal cannot be read: {esc(status.journal_error)}</div>"
        )
    hosts = "".join(_host_section(h, status, config_path) for h in status.hosts)
    opened = opened_runs(runs)
    run_parts = (
        "".join(_run_section(view, config_path, opened=view.run.id in opened) for view in runs)
        or "<p>No runs.</p>"
    )
    return (
        "<!DOCTYPE html>\n<html lang=en><head><meta charset=utf-8>"
        f"<meta http-equiv=refresh content={REFRESH_SECONDS}>"
        "<meta name=viewport content='width=device-width, initial-scale=1'>"
        "<meta name=referrer content=no-referrer>"
        f"<title>gpu-fleet remediator</title><style>{_STYLE}</style></head><body>"
        f"<h1>gpu-fleet remediator</h1><p class=dim>{_when(status.at)} · refreshes every "
        f"{REFRESH_SECONDS} s · read-only: each view names the <code>{CLI}</code> command "
        "that acts (add <code>--config FILE</code> where it is not "
        "<code>/etc/gpu-fleet/remediator.yaml</code>) · <a href='#fleet'>fleet</a> · "
        "<a href='#rails'>rails</a> · "
        "<a href='#runs'>runs</a> · <a href='#outbox'>outbox</a></p>"
        + "".join(banners)
        + f"<h2 id=fleet>Fleet</h2><p class=act>The same view in a terminal: "
        f"{command('status', config=config_path)}</p>{hosts}"
        + _rails_section(status, config_path)
        + f"<h2 id=runs>Recent runs</h2><p class=act>As JSON: "
        f"{command('runs', '--json', config=config_path)}</p>{run_parts}"
        + _outbox_section(status)
        + "</body></html>\n"
    )
