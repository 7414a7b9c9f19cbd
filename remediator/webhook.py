"""`POST /webhook/alertmanager`, answered by a plain WSGI handler in front of the Flask app.

Admission happens in the request: authenticate, bound the size, validate completely, then
admit in one transaction (`Journal.admit`: the notification recorded, its alerts deduped into
occurrences, runs created or closed), and only then answer 200. "Answered 200" therefore
means "admitted": no later step can lose it or choke on it. Alertmanager sends one request per
group per `group_interval`, so the cost of the transaction is nothing beside that promise.

Answers: 401 (secret missing or wrong, compared in constant time), 405 (not POST), 413 (over
1 MiB), 400 (not JSON, not a v4 notification, a time UTC cannot hold — the message names the
field — or a body that failed admission in an unforeseen way, which is journaled as rejected
with the reason: a retry could not help, and it must never block another), 503 (the journal
cannot write: Alertmanager retries only 5xx), 200 (admitted).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterable
from wsgiref.types import StartResponse, WSGIApplication, WSGIEnvironment

from remediator.alerts import PayloadError, parse_notification
from remediator.config import Credential
from remediator.journal import Journal, JournalError
from remediator.metrics import RemediatorMetrics

log = logging.getLogger(__name__)

PATH = "/webhook/alertmanager"
MAX_BODY_BYTES = 1024 * 1024
_Answer = tuple[str, dict[str, object], list[tuple[str, str]]]


class WebhookEndpoint:
    """WSGI middleware: answers the webhook path itself, passes everything else on."""

    def __init__(
        self,
        inner: WSGIApplication,
        *,
        journal: Journal,
        credential: Credential,
        metrics: RemediatorMetrics,
        admitted: Callable[[], None],
    ) -> None:
        self._inner = inner
        self._journal = journal
        self._credential = credential
        self._metrics = metrics
        self._admitted = admitted  # wakes the engine's workers

    def __call__(self, environ: WSGIEnvironment, start_response: StartResponse) -> Iterable[bytes]:
        """Answer the webhook; hand every other request to the Flask app."""
        if environ.get("PATH_INFO") != PATH:
            return self._inner(environ, start_response)
        status, payload, extra = self._handle(environ)
        self._metrics.webhook_requests.labels(status.split(" ", 1)[0]).inc()
        body = json.dumps(payload).encode()
        headers = [("Content-Type", "application/json"), ("Content-Length", str(len(body)))]
        start_response(status, headers + extra)
        return [body]

    def _handle(self, environ: WSGIEnvironment) -> _Answer:
        if environ.get("REQUEST_METHOD") != "POST":
            return "405 Method Not Allowed", {"error": "POST only"}, [("Allow", "POST")]
        if not self._credential.check_authorization_header(environ.get("HTTP_AUTHORIZATION")):
            return (
                "401 Unauthorized",
                {"error": "unauthorized"},
                [("WWW-Authenticate", self._credential.www_authenticate)],
            )
        try:
            length = int(environ.get("CONTENT_LENGTH") or 0)
        except ValueError:
            return "400 Bad Request", {"error": "bad Content-Length"}, []
        if length < 0:
            return "400 Bad Request", {"error": "bad Content-Length"}, []
        if length > MAX_BODY_BYTES:
            return "413 Content Too Large", {"error": f"body over {MAX_BODY_BYTES} bytes"}, []
        body = environ["wsgi.input"].read(length) if length else b""
        try:
            notification = parse_notification(body)
        except PayloadError as exc:
            return "400 Bad Request", {"error": str(exc)}, []
        if notification.truncatedAlerts:
            # Alertmanager's max_alerts cut the group: those alerts never reach us this way.
            log.warning("webhook: Alertmanager left %d alerts of group %s out of the notification",
                        notification.truncatedAlerts, notification.groupKey[:200])  # fmt: skip
            self._metrics.alerts_truncated.inc(notification.truncatedAlerts)
        try:
            admission = self._journal.admit(notification, body)
        except JournalError as exc:
            log.error("webhook: journal cannot write, answering 503 so Alertmanager retries: %s",
                      exc)  # fmt: skip
            return "503 Service Unavailable", {"error": "journal unavailable; retry"}, []
        except Exception as exc:  # noqa: BLE001 - any other failure: refused, never a 5xx loop
            return self._refuse(body, exc)
        if admission.new_run_ids or admission.closed_run_ids:
            self._admitted()
        return (
            "200 OK",
            {
                "status": "ok",
                "notification": admission.notification_id,
                "runs": admission.new_run_ids,
                "duplicates": admission.duplicates,
                "resolved": admission.resolved,
            },
            [],
        )

    def _refuse(self, body: bytes, exc: Exception) -> _Answer:
        """A valid-looking body that admission could not take: journaled, answered 400."""
        reason = f"{type(exc).__name__}: {exc}"[:500]
        log.error("webhook: a notification failed admission, answered 400: %s", reason,
                  exc_info=exc)  # fmt: skip
        self._metrics.admission_errors.inc()
        try:
            notification_id: int | None = self._journal.reject_notification(body, reason)
        except JournalError as journal_exc:
            log.error("webhook: cannot journal the refused notification: %s", journal_exc)
            notification_id = None
        return (
            "400 Bad Request",
            {"error": f"cannot admit this notification: {reason}", "notification": notification_id},
            [],
        )
