"""The remediator's HTTP side: `create_app(config)`, a Flask app served by waitress.

- `POST /webhook/alertmanager`: Alertmanager's webhook (v4), answered by
  `remediator.webhook.WebhookEndpoint` in front of Flask (the hot path; see there).
- `GET /healthz`, `GET /metrics`.
- `/api/…`, authenticated with the *admin* secret (never the webhook's):
  `GET /api/runs` (`?waiting=1`: only waiting runs), `GET /api/events`,
  `POST /api/pause`, `POST /api/resume`,
  `GET /api/maintenance`, `POST /api/maintenance/<host>`
  (`{"on": true|false, "reason": "…", "until": "2026-12-01T06:00:00Z"}`),
  `GET /api/breakers`, `POST /api/breakers/reset` (`{"target": "server/h/s", "reason"}`),
  `GET /api/cooldowns`, `POST /api/escalations/<event id>/ack` (`{"reason"}`),
  `POST /api/runs/<id>/cancel` (`{"reason"}`: a run that waits or is queued).

Every act of a person is journaled with who (the admin credential's name: its basic-auth
user, `admin` for a bearer token) and why (`reason`).

`GET /ui/` is the remediator's read-only page (`remediator.ui`), and `GET /ui/runs/<id>/chart.png`
the chart of a run's report: HTTP basic auth with the `ui` credential (never the webhook's or the
admin API's); off (404) without a `ui` section in the config.

`GET /healthz` answers 503 while a background loop is dead or the journal cannot write.
"""

from __future__ import annotations

import logging
from dataclasses import asdict
from datetime import datetime
from typing import Any

from flask import Flask, Response, jsonify, redirect, request
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from remediator import fleet_status, ui
from remediator.alerts import as_utc
from remediator.config import Credential, RemediatorConfig
from remediator.journal import JournalError, RunRecord, RunStateError
from remediator.notify import graph
from remediator.notify.report import Reporter, ReportSettings
from remediator.service import FILE_REPORTS_STREAM, Services, build_services, report_settings
from remediator.webhook import WebhookEndpoint

log = logging.getLogger(__name__)


def _json(value: Any) -> Any:
    if isinstance(value, datetime):
        return value.isoformat()
    if isinstance(value, dict):
        return {k: _json(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_json(v) for v in value]
    return value


def run_json(run: RunRecord) -> dict[str, Any]:
    """A run as `/api/runs` shows it."""
    data: dict[str, Any] = _json(asdict(run))
    return data


def _unauthorized(credential: Credential) -> Response:
    response = jsonify(error="unauthorized")
    response.status_code = 401
    response.headers["WWW-Authenticate"] = credential.www_authenticate
    return response


PAGE_RUNS = 30
"""Runs the page shows (`?limit=` up to `PAGE_RUNS_MAX`)."""
PAGE_RUNS_MAX = 200
PAGE_PROMETHEUS_TIMEOUT_SECONDS = 3.0
_PAGE_HEADERS = {
    "Content-Security-Policy": ui.CSP,
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
}


def _page_routes(app: Flask, config: RemediatorConfig, services: Services) -> None:
    """`/ui/` and its charts, behind the page's own credential (none configured: 404)."""
    credential = ui.page_credential(config.ui)
    journal = services.journal
    # The reports as the engine renders them; without a zulip section, as the file reports are.
    reporter = Reporter(
        report_settings(config) or ReportSettings(stream=FILE_REPORTS_STREAM, topics={}),
        services.roster,
    )
    if credential is not None and config.web_config_file is None:
        host, _ = config.listen_address()
        if host not in ("127.0.0.1", "::1", "localhost"):
            log.warning(
                "the page's password crosses the network in clear: %s is not loopback "
                "and there is no web_config_file with TLS",
                config.listen,
            )

    def page_only() -> Response | None:
        if credential is None:
            return Response(
                "the page is off: give the config a `ui` section\n",
                404,
                content_type="text/plain; charset=utf-8",
            )
        if not credential.check(request.headers.get("Authorization")):
            return Response(
                "401 Unauthorized: the page needs the `ui` user's password\n",
                401,
                {"WWW-Authenticate": credential.www_authenticate, **_PAGE_HEADERS},
                content_type="text/plain; charset=utf-8",
            )
        return None

    def report_of(run: RunRecord) -> tuple[str | None, dict[str, Any] | None]:
        if run.state != "done":
            return None, None  # a report is written when a run ends
        [first, *_] = reporter.run_report(run)
        return first.content, dict(first.graph) if first.graph else None

    @app.get("/ui")
    def page_redirect() -> Response:
        return redirect("/ui/", code=308)  # type: ignore[return-value]

    @app.get("/ui/")
    def page() -> Response:
        if (denied := page_only()) is not None:
            return denied
        limit = min(
            max(request.args.get("limit", default=PAGE_RUNS, type=int) or PAGE_RUNS, 1),
            PAGE_RUNS_MAX,
        )
        status = fleet_status.gather(
            journal,
            services.roster,
            config.prometheus_url,
            timeout_seconds=PAGE_PROMETHEUS_TIMEOUT_SECONDS,
        )
        views = []
        try:
            runs = journal.recent_runs(limit)
        except JournalError:
            runs = []  # said on the page: status.journal_error
        for run in runs:
            content, spec = report_of(run)
            views.append(ui.RunView(run, content, spec is not None))
        body = ui.render_page(status, views)
        return Response(body, 200, _PAGE_HEADERS, content_type="text/html; charset=utf-8")

    @app.get("/ui/runs/<int:run_id>/chart.png")
    def page_chart(run_id: int) -> Response:
        if (denied := page_only()) is not None:
            return denied
        run = journal.get_run(run_id)
        spec = report_of(run)[1] if run is not None else None
        picture = graph.draw(config.prometheus_url, spec) if spec is not None else None
        if picture is None:
            return Response(
                f"run {run_id} has no chart (no report with a query, or no data)\n",
                404,
                _PAGE_HEADERS,
                content_type="text/plain; charset=utf-8",
            )
        headers = dict(_PAGE_HEADERS)
        end = datetime.fromisoformat(str(spec["end"])) if spec is not None else None
        if end is not None and end < datetime.now(end.tzinfo):
            # The window is over: the picture no longer changes; spare Prometheus the redraws.
            headers["Cache-Control"] = "private, max-age=3600"
        return Response(picture.png, 200, headers, content_type="image/png")


def create_app(config: RemediatorConfig, services: Services | None = None) -> Flask:
    """The Flask app for a config; `services` (journal, engine…) are built from it unless given."""
    if services is None:
        services = build_services(config)
    app = Flask("gpu-fleet-remediator")
    # The admin API takes small JSON bodies; Flask answers 413 past this, before reading it.
    app.config["MAX_CONTENT_LENGTH"] = 64 * 1024
    journal, metrics = services.journal, services.metrics

    def admin_only() -> Response | None:
        if not services.admin.check_authorization_header(request.headers.get("Authorization")):
            return _unauthorized(services.admin)
        return None

    who = services.admin.username or "admin"

    @app.get("/healthz")
    def healthz() -> tuple[str, int]:
        dead = services.dead_loops()
        if dead:
            return f"background loops dead: {', '.join(dead)}\n", 503
        try:
            journal.check_writable()
        except JournalError as exc:
            return f"journal cannot write: {exc}\n", 503
        return "ok\n", 200

    @app.get("/metrics")
    def metrics_endpoint() -> Response:
        return Response(generate_latest(metrics.registry), content_type=CONTENT_TYPE_LATEST)

    @app.get("/api/runs")
    def runs() -> Response:
        if (denied := admin_only()) is not None:
            return denied
        limit = min(max(request.args.get("limit", default=50, type=int) or 50, 1), 1000)
        if request.args.get("waiting"):
            return jsonify(runs=[run_json(r) for r in journal.waiting_runs(limit)])
        return jsonify(runs=[run_json(r) for r in journal.recent_runs(limit)])

    @app.get("/api/events")
    def events() -> Response:
        if (denied := admin_only()) is not None:
            return denied
        kind = request.args.get("kind")
        return jsonify(events=[_json(asdict(e)) for e in journal.events(kind=kind, limit=200)])

    def _reason() -> str:
        data = request.get_json(silent=True)
        reason = data.get("reason", "") if isinstance(data, dict) else ""
        return str(reason)[:500]

    @app.post("/api/pause")
    def pause() -> Response:
        if (denied := admin_only()) is not None:
            return denied
        journal.set_paused(True, by=who, reason=_reason())
        return jsonify(paused=True)

    @app.post("/api/resume")
    def resume() -> Response:
        if (denied := admin_only()) is not None:
            return denied
        journal.set_paused(False, by=who, reason=_reason())
        if services.engine is not None:
            services.engine.wake()
        return jsonify(paused=False)

    @app.get("/api/maintenance")
    def maintenance_list() -> Response:
        if (denied := admin_only()) is not None:
            return denied
        hosts = {
            host: {"since": since.isoformat(), "until": until.isoformat() if until else None,
                   "reason": why, "by": by}
            for host, (since, until, why, by) in journal.maintenance_windows().items()
        }  # fmt: skip
        return jsonify(maintenance=hosts)

    @app.post("/api/maintenance/<host>")
    def maintenance(host: str) -> tuple[Response, int] | Response:
        if (denied := admin_only()) is not None:
            return denied
        if host not in services.roster.hosts:
            return jsonify(error=f"no host {host!r} in the roster"), 404
        data = request.get_json(silent=True)
        if not isinstance(data, dict) or not isinstance(data.get("on"), bool):
            return jsonify(error='body must be {"on": true|false, "reason": "...", '
                           '"until": "RFC 3339 time (optional)"}'), 400  # fmt: skip
        until = None
        if data.get("until") is not None:
            try:
                until = as_utc(datetime.fromisoformat(str(data["until"])))
            except ValueError as exc:
                return jsonify(error=f"until: not an RFC 3339 time: {exc}"), 400
        journal.set_maintenance(host, data["on"], by=who, reason=_reason(), until=until)
        if services.engine is not None:
            services.engine.wake()
        return jsonify(host=host, maintenance=data["on"],
                       until=until.isoformat() if until else None)  # fmt: skip

    @app.get("/api/breakers")
    def breakers() -> Response:
        if (denied := admin_only()) is not None:
            return denied
        return jsonify(breakers=[_json(asdict(b)) for b in journal.breakers()])

    @app.post("/api/breakers/reset")
    def breaker_reset() -> tuple[Response, int] | Response:
        if (denied := admin_only()) is not None:
            return denied
        data = request.get_json(silent=True)
        target = data.get("target") if isinstance(data, dict) else None
        if not isinstance(target, str) or not target:
            return jsonify(
                error='body must be {"target": "server/HOST/SERVER", "reason": ...}'
            ), 400
        if not journal.reset_breaker(target, by=who, reason=_reason()):
            return jsonify(error=f"the breaker of {target} is not open"), 404
        return jsonify(target=target, reset=True)

    @app.get("/api/cooldowns")
    def cooldowns() -> Response:
        if (denied := admin_only()) is not None:
            return denied
        return jsonify(cooldowns=[{"target": t, "until": u.isoformat(), "playbook": p}
                                  for t, u, p in journal.cooldowns()])  # fmt: skip

    @app.post("/api/escalations/<int:event_id>/ack")
    def acknowledge(event_id: int) -> tuple[Response, int] | Response:
        if (denied := admin_only()) is not None:
            return denied
        try:
            ack = journal.acknowledge(event_id, by=who, reason=_reason())
        except RunStateError as exc:
            return jsonify(error=str(exc)), 404
        return jsonify(escalation=event_id, acknowledged=ack)

    @app.post("/api/runs/<int:run_id>/cancel")
    def cancel(run_id: int) -> tuple[Response, int] | Response:
        if (denied := admin_only()) is not None:
            return denied
        try:
            journal.cancel_run(run_id, by=who, reason=_reason())
        except RunStateError as exc:
            return jsonify(error=str(exc)), 409
        return jsonify(run=run_id, cancelled=True)

    _page_routes(app, config, services)

    @app.errorhandler(JournalError)
    def journal_down(exc: JournalError) -> tuple[Response, int]:
        return jsonify(error=f"journal unavailable: {exc}"), 503

    engine = services.engine
    app.wsgi_app = WebhookEndpoint(  # type: ignore[method-assign]
        app.wsgi_app,
        journal=journal,
        credential=services.webhook,
        metrics=metrics,
        admitted=engine.wake if engine is not None else lambda: None,
    )
    return app
