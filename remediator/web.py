"""The remediator's HTTP side: `create_app(config)`, a Flask app served by waitress.

- `POST /webhook/alertmanager`: Alertmanager's webhook (v4), answered by
  `remediator.webhook.WebhookEndpoint` in front of Flask (the hot path; see there).
- `GET /healthz`, `GET /metrics`.
- `/api/…`, authenticated with the *admin* secret (never the webhook's): `GET /api/runs`,
  `GET /api/events`, `POST /api/pause`, `POST /api/resume`, `GET /api/maintenance`,
  `POST /api/maintenance/<host>` (`{"on": true|false, "reason": "…"}`).
"""

from __future__ import annotations

import logging
from dataclasses import asdict
from datetime import datetime
from typing import Any

from flask import Flask, Response, jsonify, request
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from remediator.config import Credential, RemediatorConfig
from remediator.journal.store import JournalError, RunRecord
from remediator.service import Services, build_services
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

    @app.get("/healthz")
    def healthz() -> tuple[str, int]:
        try:
            journal.queue_depth()
        except JournalError as exc:
            return f"journal unavailable: {exc}\n", 503
        return "ok\n", 200

    @app.get("/metrics")
    def metrics_endpoint() -> Response:
        return Response(generate_latest(metrics.registry), content_type=CONTENT_TYPE_LATEST)

    @app.get("/api/runs")
    def runs() -> Response:
        if (denied := admin_only()) is not None:
            return denied
        limit = min(max(request.args.get("limit", default=50, type=int) or 50, 1), 1000)
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
        journal.set_paused(True, by="api", reason=_reason())
        return jsonify(paused=True)

    @app.post("/api/resume")
    def resume() -> Response:
        if (denied := admin_only()) is not None:
            return denied
        journal.set_paused(False, by="api", reason=_reason())
        if services.engine is not None:
            services.engine.wake()
        return jsonify(paused=False)

    @app.get("/api/maintenance")
    def maintenance_list() -> Response:
        if (denied := admin_only()) is not None:
            return denied
        hosts = {h: {"since": s.isoformat(), "reason": r} for h, (s, r) in
                 journal.maintenance().items()}  # fmt: skip
        return jsonify(maintenance=hosts)

    @app.post("/api/maintenance/<host>")
    def maintenance(host: str) -> tuple[Response, int] | Response:
        if (denied := admin_only()) is not None:
            return denied
        if host not in services.roster.hosts:
            return jsonify(error=f"no host {host!r} in the roster"), 404
        data = request.get_json(silent=True)
        if not isinstance(data, dict) or not isinstance(data.get("on"), bool):
            return jsonify(error='body must be {"on": true|false, "reason": "..."}'), 400
        journal.set_maintenance(host, data["on"], by="api", reason=_reason())
        return jsonify(host=host, maintenance=data["on"])

    @app.errorhandler(JournalError)
    def journal_down(exc: JournalError) -> tuple[Response, int]:
        return jsonify(error=f"journal unavailable: {exc}"), 503

    engine = services.engine
    app.wsgi_app = WebhookEndpoint(  # type: ignore[method-assign]
        app.wsgi_app,
        journal=journal,
        credential=services.webhook,
        metrics=metrics,
        accepted=engine.wake if engine is not None else lambda: None,
    )
    return app
