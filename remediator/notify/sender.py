"""The outbox sender: reports from the journal to Zulip, in order, once, whatever happens.

A background thread (`OutboxSender.start`) sends what `Journal.outbox_due` offers: the oldest
unsent report of each topic, when its retry time has come. Its promises:

- **Nothing lost.** A report leaves the outbox only when Zulip has it (`sent`) or refused it
  for good (`failed`, kept in the journal and counted). Zulip down, slow or answering 5xx:
  the report is tried again with exponential backoff (`backoff_base_seconds` doubling up to
  `backoff_max_seconds`), across restarts, since the state is in the journal.
- **Order within a topic.** Only a topic's oldest unsent report is ever offered, so a later
  one waits for an earlier one's retry; topics do not wait for each other.
- **Rate limits honoured.** A 429 stops all sending for its `Retry-After`; when the
  `X-RateLimit-Remaining` header reaches 0, sending waits for `X-RateLimit-Reset` instead of
  running into the 429.
- **Once.** Each message ends with a marker line (`gpu-fleet report 17 · run 12`: the outbox
  entry and its run). An entry is marked `sending` before it goes out; one found `sending`
  (a crash, a timeout, a 5xx: it may have arrived) is first looked up in its topic through
  Zulip's message search, and marked sent if it is there.
- **One sender.** Replicas share the journal; only the holder of the `zulip-sender` lease
  sends, renewing it before each report (a replica that dies leaves it to expire, one that
  stops hands it over).

A message is trimmed to the server's `max_message_length` (the evidence block is cut, never
the outcome) and its topic to `max_topic_length`; the picture, when the report asks for one,
is drawn from Prometheus, uploaded, and put after the first paragraph — or left out when
Prometheus cannot be reached.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from enum import Enum

from remediator.journal import Journal, JournalError, OutboxEntry
from remediator.metrics import RemediatorMetrics
from remediator.notify import graph
from remediator.notify.files import ReportFiles
from remediator.notify.markdown import code, fit, fit_topic, inline
from remediator.notify.zulip_api import (
    ServerLimits,
    ZulipApi,
    ZulipRateLimited,
    ZulipRefused,
    ZulipUnavailable,
)

log = logging.getLogger(__name__)

LEASE = "zulip-sender"


@dataclass(frozen=True)
class SenderSettings:
    """How the sender works; the stream from the config, the rest defaults tests may shorten."""

    stream: str
    prometheus_url: str
    poll_seconds: float = 1.0
    backoff_base_seconds: float = 2.0
    backoff_max_seconds: float = 300.0
    lease_ttl: timedelta = timedelta(seconds=60)
    batch: int = 20
    graph_timeout_seconds: float = 5.0


class _Next(Enum):
    """What the pass does after one entry."""

    DONE = "done"  # the entry left the queue (sent, found, refused for good): go on
    CONTINUE = "continue"  # nothing changed for it (another sender had it): go on
    STOP = "stop"  # Zulip is down or limiting: no more requests this pass


def marker(entry: OutboxEntry) -> str:
    """The line that identifies a report in Zulip: its outbox entry and its run."""
    run = f" · run {entry.run_id}" if entry.run_id is not None else ""
    return f"gpu-fleet report {entry.id}{run}"


def _utcnow() -> datetime:
    return datetime.now(UTC)


class OutboxSender:
    """Sends the journal's outbox to Zulip (see the module's docstring)."""

    def __init__(
        self,
        journal: Journal,
        api: ZulipApi | ReportFiles,
        settings: SenderSettings,
        *,
        metrics: RemediatorMetrics | None = None,
    ) -> None:
        self.journal = journal
        self.api = api
        self.settings = settings
        self.metrics = metrics
        self._hold_until = 0.0  # unix time: a 429 or an exhausted rate limit
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self.holds_lease = False
        """Whether this replica held the sender's lease at its last pass."""

    # -- life cycle -----------------------------------------------------------------------

    @property
    def started(self) -> bool:
        """True once `start` was called and until `stop`."""
        return self._thread is not None and not self._stop.is_set()

    @property
    def alive(self) -> bool:
        """True while the sending thread runs."""
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> None:
        """Send in a background thread until `stop`."""
        self._stop.clear()
        self._thread = threading.Thread(target=self._loop, name="zulip-sender", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Stop after the report in flight; hand the lease over at once."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)
        if self.holds_lease:
            try:
                self.journal.release_lease(LEASE)
            except JournalError as exc:
                log.warning("zulip sender: cannot release its lease (it expires): %s", exc)
            self.holds_lease = False

    def _count_error(self) -> None:
        if self.metrics is not None:
            self.metrics.loop_errors.labels("zulip-sender").inc()

    def wake(self) -> None:
        """A report was queued: look at the outbox now rather than at the next poll."""
        self._wake.set()

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.send_due()
            except JournalError as exc:
                self._count_error()
                log.error("zulip sender: journal unavailable: %s", exc)
            except Exception:
                # The thread must outlive any one bad report; the next pass tries again.
                self._count_error()
                log.exception("zulip sender: unexpected error")
            self._wake.wait(self.settings.poll_seconds)
            self._wake.clear()

    # -- one pass -------------------------------------------------------------------------

    def send_due(self) -> int:
        """Send what is due now, if this replica holds the lease; how many reports went out."""
        self.holds_lease = self.journal.take_lease(LEASE, self.settings.lease_ttl)
        if not self.holds_lease:
            return 0
        now = time.time()
        reset = self.api.rate_limit_reset
        if reset is not None and reset > now:
            self._hold_until = max(self._hold_until, reset)
        if self._hold_until > now:
            return 0
        sent = 0
        # Round after round: a report sent makes the next one of its topic due at once.
        while True:
            entries = self.journal.outbox_due(self.settings.batch)
            progressed = False
            for entry in entries:
                if self._stop.is_set() or not self.journal.take_lease(
                    LEASE, self.settings.lease_ttl
                ):
                    return sent  # stopping, or another replica took over: it carries on
                before = self.api.rate_limit_reset
                if before is not None and before > time.time():
                    self._hold_until = before
                    return sent  # the last answer said no request is left until the reset
                next_step, delivered = self._deliver(entry)
                sent += delivered
                if next_step is _Next.STOP:
                    return sent
                progressed = progressed or next_step is _Next.DONE
            if not progressed:
                return sent

    def _backoff(self, entry: OutboxEntry) -> datetime:
        delay = self.settings.backoff_base_seconds * 2 ** min(entry.attempts, 20)
        return _utcnow() + timedelta(seconds=min(delay, self.settings.backoff_max_seconds))

    def _count_failure(self, reason: str) -> None:
        if self.metrics is not None:
            self.metrics.outbox_failures.labels(reason).inc()

    def _deliver(self, entry: OutboxEntry) -> tuple[_Next, int]:
        """Send one entry (after looking it up if it may be there already)."""
        began = False
        try:
            limits = self.api.limits()
            topic = fit_topic(entry.topic, limits.max_topic_length)
            if entry.state == "sending":
                found = self.api.find(
                    marker(entry),
                    marker(entry),
                    stream=self.settings.stream,
                    topic=topic,
                    recipients=entry.recipients,
                )
                if found is not None:
                    log.info("report %d was already in Zulip (message %d)", entry.id, found)
                    self.journal.outbox_sent(entry.id, found)
                    return _Next.DONE, 0
            content = self._content(entry, limits)
            if not self.journal.outbox_begin_send(entry.id):
                return _Next.CONTINUE, 0  # sent or failed meanwhile: nothing to do
            began = True
            if entry.recipients is not None:
                message_id = self.api.send_direct(entry.recipients, content)
            else:
                message_id = self.api.send_stream(self.settings.stream, topic, content)
        except ZulipRateLimited as exc:
            self._hold_until = time.time() + exc.retry_after
            at = _utcnow() + timedelta(seconds=exc.retry_after)
            # A 429 is an answer: the message was not taken. One found `sending` before it
            # stays so (the 429 may have been its lookup's).
            self.journal.outbox_retry(
                entry.id, at=at, error=str(exc), maybe_sent=entry.state == "sending"
            )
            self._count_failure("rate_limited")
            log.warning("zulip sender: %s; waiting %.1f s", exc, exc.retry_after)
            return _Next.STOP, 0
        except ZulipUnavailable as exc:
            # No answer: it may have arrived. Look it up before sending it again.
            maybe = began or entry.state == "sending"
            self.journal.outbox_retry(
                entry.id, at=self._backoff(entry), error=str(exc), maybe_sent=maybe
            )
            self._count_failure("unavailable")
            log.warning("zulip sender: report %d not sent: %s", entry.id, exc)
            return _Next.STOP, 0
        except ZulipRefused as exc:
            if exc.permanent:
                self.journal.outbox_failed(entry.id, str(exc))
                self._count_failure("rejected")
                log.error("zulip sender: report %d refused for good: %s", entry.id, exc)
                return _Next.DONE, 0
            self.journal.outbox_retry(entry.id, at=self._backoff(entry), error=str(exc))
            self._count_failure("refused")
            log.error("zulip sender: report %d refused (fix it in Zulip): %s", entry.id, exc)
            return _Next.STOP, 0
        self.journal.outbox_sent(entry.id, message_id)
        if self.metrics is not None:
            self.metrics.outbox_sent.labels("direct" if entry.recipients else "stream").inc()
        return _Next.DONE, 1

    def _picture(self, entry: OutboxEntry) -> str:
        """The Markdown of the entry's picture ("" for none), drawn and uploaded once."""
        if entry.picture is not None or not entry.graph:
            return entry.picture or ""
        drawn = graph.draw(
            self.settings.prometheus_url,
            entry.graph,
            timeout_seconds=self.settings.graph_timeout_seconds,
        )
        markdown = ""
        if drawn is not None:
            # Raises ZulipUnavailable & co. like a send: the entry is retried, drawn again.
            path = self.api.upload(f"gpu-fleet-report-{entry.id}.png", drawn.png)
            query = str(entry.graph.get("query", ""))
            markdown = f"[📈 {code(query)}]({path})\n{inline(drawn.caption)}"
        self.journal.outbox_set_picture(entry.id, markdown)
        return markdown

    def _content(self, entry: OutboxEntry, limits: ServerLimits) -> str:
        """The message as sent: trimmed report, picture after the header, marker at the end."""
        footer = f"\n\n`{marker(entry)}`"
        picture = self._picture(entry)
        extra = len(footer) + (len(picture) + 2 if picture else 0)
        body = fit(entry.content, max(200, limits.max_message_length - extra))
        if picture:
            head, sep, rest = body.partition("\n\n")
            body = f"{head}\n\n{picture}{sep}{rest}" if sep else f"{head}\n\n{picture}"
        return body + footer
