"""The outbox sender against the Zulip stand-in, through the real `zulip` client.

What is real: the journal (a SQLite file; PostgreSQL for the two-replica test), the `zulip`
package's `Client` and its HTTP stack, Prometheus (for the picture). What stands in: Zulip's
server (tests/zulip_stand_in.py), which keeps its API contract. Timings are shortened through
`SenderSettings` (backoff from 0.1 s), never by reaching into the sender.
"""

from __future__ import annotations

import io
import threading
import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from PIL import Image
from prometheus_client import generate_latest

from remediator.journal import Journal, OutboxEntry
from remediator.metrics import RemediatorMetrics
from remediator.notify.graph import HEIGHT, PALETTE, WIDTH, render
from remediator.notify.sender import OutboxSender, SenderSettings, marker
from remediator.notify.zulip_api import ZulipApi
from tests.journal_lab import FIXTURES, load_sqlite
from tests.pg import throwaway_database
from tests.prometheus_lab import MetricsEndpoint, PrometheusServer
from tests.test_notify_report import REPORTER, healed_run
from tests.zulip_stand_in import ZulipStandIn

STREAM = "agent-hub"
CLOSED_PORT_URL = "http://127.0.0.1:9"  # discard: nothing listens there


@pytest.fixture
def zulip() -> Iterator[ZulipStandIn]:
    with ZulipStandIn(streams=(STREAM,)) as stand_in:
        yield stand_in


@pytest.fixture
def journal(tmp_path: Path) -> Iterator[Journal]:
    journal = Journal(f"sqlite:///{tmp_path / 'journal.db'}", replica_id="central-1")
    yield journal
    journal.close()


def make_sender(
    journal: Journal,
    zuliprc: Path,
    *,
    prometheus_url: str = CLOSED_PORT_URL,
    metrics: RemediatorMetrics | None = None,
) -> OutboxSender:
    settings = SenderSettings(
        stream=STREAM,
        prometheus_url=prometheus_url,
        poll_seconds=0.05,
        backoff_base_seconds=0.1,
        backoff_max_seconds=0.4,
        lease_ttl=timedelta(seconds=5),
        graph_timeout_seconds=2.0,
    )
    return OutboxSender(journal, ZulipApi(zuliprc, timeout_seconds=3), settings, metrics=metrics)


def wait_until(condition: Callable[[], bool], timeout: float = 20.0, what: str = "it") -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def unsent(journal: Journal) -> list[OutboxEntry]:
    return [e for e in journal.outbox_entries() if e.state in ("pending", "sending")]


def markers_of(zulip: ZulipStandIn) -> list[str]:
    return [m.content.rsplit("\n", 1)[-1].strip("`") for m in zulip.messages]


def assert_each_once_in_order(zulip: ZulipStandIn, journal: Journal) -> None:
    """Every entry arrived exactly once, and within each topic in the order queued."""
    entries = journal.outbox_entries()
    assert all(e.state == "sent" for e in entries), [(e.id, e.state) for e in entries]
    got = markers_of(zulip)
    assert sorted(got) == sorted(marker(e) for e in entries), "lost or duplicated reports"
    for topic in {e.topic for e in entries if e.recipients is None}:
        arrived = [m.content.rsplit("\n", 1)[-1].strip("`") for m in zulip.stream_messages(topic)]
        assert arrived == [marker(e) for e in entries if e.topic == topic and not e.recipients]
    assert not any(m.truncated for m in zulip.messages)


# -- delivery -------------------------------------------------------------------------------


def test_reports_arrive_in_their_topics_in_order_with_their_marker(
    zulip: ZulipStandIn, journal: Journal, tmp_path: Path
) -> None:
    for index in range(3):
        journal.enqueue_report("alerts-gpu", f"gpu report {index}", run_id=10 + index)
        journal.enqueue_report("alerts-infra", f"infra report {index}", run_id=20 + index)
    journal.enqueue_report("alerts-gpu", "escalation", run_id=12, recipients=["oncall@example.org"])
    sender = make_sender(journal, zulip.write_zuliprc(tmp_path / "zuliprc"))
    assert sender.send_due() == 7
    assert_each_once_in_order(zulip, journal)
    [direct] = zulip.direct_messages()
    assert direct.recipients == ("oncall@example.org",)
    assert direct.content == "escalation\n\n`gpu-fleet report 7 · run 12`"
    gpu = zulip.stream_messages("alerts-gpu")
    assert [m.content.split("\n")[0] for m in gpu] == [f"gpu report {i}" for i in range(3)]
    assert all(m.stream == STREAM for m in gpu)
    # The entries know their Zulip message.
    assert {e.zulip_message_id for e in journal.outbox_entries()} == {m.id for m in zulip.messages}
    # Every request but the unauthenticated server_settings carried the bot's credentials.
    assert all(r.status == 200 for r in zulip.requests)
    form = next(r.form for r in zulip.requests if r.path == "/api/v1/messages")
    assert set(form) == {"type", "to", "topic", "content"} and form["type"] == "stream"


def test_the_servers_limits_are_kept_evidence_cut_outcome_whole(
    tmp_path: Path, journal: Journal
) -> None:
    noisy = healed_run().steps[0]
    noisy = type(noisy)(**{**noisy.__dict__, "output": "x" * 30_000})
    run = type(healed_run())(**{**healed_run().__dict__, "steps": [noisy]})
    [report] = REPORTER.run_report(run)
    long_topic = "alerts-" + "very-long-category-name-" * 4
    journal.enqueue_report(long_topic, report.content, run_id=run.id)
    with ZulipStandIn(max_message_length=2000) as zulip:
        assert make_sender(journal, zulip.write_zuliprc(tmp_path / "zuliprc")).send_due() == 1
        [message] = zulip.messages
    assert not message.truncated, "the server had to cut it: the sender did not trim"
    assert len(message.content) <= 2000 and len(message.topic) <= 60
    assert message.topic.endswith("…")
    assert message.content.startswith(report.content.split("````spoiler")[0])  # outcome whole
    assert "characters cut to fit Zulip's message limit" in message.content
    assert message.content.endswith(f"`gpu-fleet report 1 · run {run.id}`")


# -- outages, rate limits -------------------------------------------------------------------


@pytest.mark.parametrize("how", ["refuse", "5xx"])
def test_an_outage_delays_reports_and_loses_none(
    zulip: ZulipStandIn, journal: Journal, tmp_path: Path, how: str
) -> None:
    metrics = RemediatorMetrics(journal)
    sender = make_sender(journal, zulip.write_zuliprc(tmp_path / "zuliprc"), metrics=metrics)
    journal.enqueue_report("alerts-gpu", "before the outage", run_id=1)
    assert sender.send_due() == 1  # connected once: the client knows the server
    zulip.go_down(how)  # type: ignore[arg-type]
    for index in range(6):
        journal.enqueue_report(("alerts-gpu", "alerts-infra")[index % 2], f"report {index}")
    sender.start()
    try:
        wait_until(lambda: sum(e.attempts for e in journal.outbox_entries()) >= 4,
                   what="several failed attempts")  # fmt: skip
        assert len(zulip.messages) == 1 and len(unsent(journal)) == 6
        failures = metrics.registry.get_sample_value(
            "gpufleet_remediator_outbox_failures_total", {"reason": "unavailable"}
        )
        assert failures is not None and failures >= 4
        if how == "5xx":
            # A 5xx may come from a proxy after the message got through: such entries are
            # looked up before they are sent again.
            assert any(e.state == "sending" for e in journal.outbox_entries())
        zulip.come_back()
        wait_until(lambda: not unsent(journal), what="all reports sent after the outage")
    finally:
        sender.stop()
    assert_each_once_in_order(zulip, journal)
    if how == "5xx":
        assert any(r.path == "/api/v1/messages" and r.method == "GET" for r in zulip.requests)


@pytest.mark.parametrize("how", ["refuse", "5xx"])
def test_zulip_down_at_first_contact_is_an_outage_not_a_crash(
    zulip: ZulipStandIn, journal: Journal, tmp_path: Path, how: str
) -> None:
    # Down before the sender ever connected: the client's constructor, which asks for the
    # server settings, meets the outage (a 5xx there was an AssertionError inside zulip).
    zulip.go_down(how)  # type: ignore[arg-type]
    metrics = RemediatorMetrics(journal)
    sender = make_sender(journal, zulip.write_zuliprc(tmp_path / "zuliprc"), metrics=metrics)
    journal.enqueue_report("alerts-gpu", "while Zulip is down")
    assert sender.send_due() == 0
    [entry] = journal.outbox_entries()
    assert entry.state == "pending" and entry.attempts == 1
    assert entry.last_error is not None and ("first contact" in entry.last_error
                                             or "cannot reach" in entry.last_error)  # fmt: skip
    failures = metrics.registry.get_sample_value(
        "gpufleet_remediator_outbox_failures_total", {"reason": "unavailable"}
    )
    assert failures == 1
    sender.start()
    try:
        zulip.come_back()
        wait_until(lambda: not unsent(journal), what="the report sent once Zulip is back")
    finally:
        sender.stop()
    assert [m.content.split("\n")[0] for m in zulip.messages] == ["while Zulip is down"]


def test_a_429_stops_sending_for_its_retry_after(
    zulip: ZulipStandIn, journal: Journal, tmp_path: Path
) -> None:
    sender = make_sender(journal, zulip.write_zuliprc(tmp_path / "zuliprc"))
    for index in range(3):
        journal.enqueue_report("alerts-gpu", f"report {index}")
    sender.api.limits()  # connect first: the 429 is for the first message
    zulip.force_429(retry_after=1.2)
    sender.start()
    try:
        wait_until(lambda: not unsent(journal), what="the reports after the 429")
    finally:
        sender.stop()
    limited = next(r for r in zulip.requests if r.status == 429)
    after = [r for r in zulip.requests if r.at > limited.at]
    assert after and after[0].at - limited.at >= 1.15, "a request came before Retry-After"
    assert_each_once_in_order(zulip, journal)


def test_the_rate_limit_headers_keep_the_sender_under_the_limit(
    zulip: ZulipStandIn, journal: Journal, tmp_path: Path
) -> None:
    sender = make_sender(journal, zulip.write_zuliprc(tmp_path / "zuliprc"))
    zulip.rate_limit(3, window_seconds=1.0)
    for index in range(7):
        journal.enqueue_report("alerts-gpu", f"report {index}")
    started = time.monotonic()
    sender.start()
    try:
        wait_until(lambda: not unsent(journal), what="seven reports at three a second")
    finally:
        sender.stop()
    assert time.monotonic() - started >= 1.5  # it waited for the windows to reset
    assert not [r for r in zulip.requests if r.status == 429], "it ran into the limit"
    assert_each_once_in_order(zulip, journal)


# -- a crash between sending and marking ----------------------------------------------------


def test_a_report_found_half_sent_is_looked_up_before_it_is_sent_again(
    zulip: ZulipStandIn, journal: Journal, tmp_path: Path
) -> None:
    arrived = journal.enqueue_report("alerts-gpu", "arrived before the crash", run_id=7)
    lost = journal.enqueue_report("alerts-gpu", "lost in the crash", run_id=8)
    # The crash: both were marked `sending`; only the first reached Zulip before it.
    for entry_id in (arrived, lost):
        assert journal.outbox_begin_send(entry_id)
    first = journal.outbox_entries()[0]
    existing = zulip.add_message(STREAM, "alerts-gpu", f"{first.content}\n\n`{marker(first)}`")
    # A restart: a new journal and sender on the same database.
    journal.close()
    restarted = Journal(f"sqlite:///{tmp_path / 'journal.db'}", replica_id="central-1")
    try:
        sender = make_sender(restarted, zulip.write_zuliprc(tmp_path / "zuliprc"))
        assert sender.send_due() == 1
        entries = restarted.outbox_entries()
    finally:
        restarted.close()
    posts = [r for r in zulip.requests if r.method == "POST" and r.path == "/api/v1/messages"]
    assert [p.form["content"].split("\n")[0] for p in posts] == ["lost in the crash"]
    assert [(e.state, e.zulip_message_id) for e in entries] == [
        ("sent", existing),
        ("sent", zulip.messages[-1].id),
    ]
    searches = [r.form["narrow"] for r in zulip.requests if r.method == "GET" and r.form]
    assert any('"topic"' in s and "alerts-gpu" in s for s in searches)
    assert len(zulip.messages) == 2


# -- refusals -------------------------------------------------------------------------------


def test_a_wrong_key_is_retried_until_fixed_and_a_bad_recipient_is_dropped(
    zulip: ZulipStandIn, journal: Journal, tmp_path: Path
) -> None:
    zuliprc = zulip.write_zuliprc(tmp_path / "zuliprc", key="not-the-key")
    sender = make_sender(journal, zuliprc)
    journal.enqueue_report("alerts-gpu", "to nobody", recipients=["nobody@example.org"])
    journal.enqueue_report("alerts-gpu", "after it")
    assert sender.send_due() == 0
    [entry, _] = journal.outbox_entries()
    assert entry.state == "pending" and entry.attempts == 1
    assert entry.last_error is not None and "INVALID_API_KEY" in entry.last_error
    zulip.write_zuliprc(zuliprc)  # fixed: read again without a restart
    wait_until(lambda: sender.send_due() > 0 or not unsent(journal), what="the fixed key")
    refused, after = journal.outbox_entries()
    assert refused.state == "failed" and "Invalid email" in (refused.last_error or "")
    assert after.state == "sent"  # a report Zulip refuses for good does not block its topic
    assert [m.content.split("\n")[0] for m in zulip.messages] == ["after it"]


def test_a_missing_stream_is_retried_not_dropped(journal: Journal, tmp_path: Path) -> None:
    with ZulipStandIn(streams=("elsewhere",)) as zulip:
        sender = make_sender(journal, zulip.write_zuliprc(tmp_path / "zuliprc"))
        journal.enqueue_report("alerts-gpu", "waits for the stream")
        assert sender.send_due() == 0
        [entry] = journal.outbox_entries()
        assert entry.state == "pending" and "STREAM_DOES_NOT_EXIST" in (entry.last_error or "")
        zulip.streams.append(STREAM)  # an operator creates it
        wait_until(lambda: sender.send_due() == 1, what="the stream to exist")
        assert [m.stream for m in zulip.messages] == [STREAM]


# -- the picture ----------------------------------------------------------------------------


def png_pixels(data: bytes) -> tuple[int, int, bytes]:
    """Width, height and RGB pixels of a PNG, decoded whole by Pillow (a broken one raises)."""
    assert data.startswith(b"\x89PNG\r\n\x1a\n")
    image = Image.open(io.BytesIO(data))
    image.load()
    return image.width, image.height, image.convert("RGB").tobytes()


def test_render_draws_a_valid_png_with_the_series() -> None:
    from remediator.notify.graph import Series

    points = [(float(t), float(t % 7)) for t in range(0, 600, 5)]
    data = render([Series({}, points)], 0.0, 600.0, marked=(100.0, 200.0))
    width, height, raw = png_pixels(data)
    assert (width, height) == (WIDTH, HEIGHT)
    assert bytes(PALETTE[0]) in raw, "the series' line is not drawn"


def test_a_report_shows_a_picture_of_the_metric_from_prometheus(
    zulip: ZulipStandIn, journal: Journal, tmp_path: Path
) -> None:
    with (
        MetricsEndpoint('gpufleet_llama_up{server="alpha"} 0\n') as endpoint,
        PrometheusServer(tmp_path, [endpoint.target]) as prometheus,
    ):
        endpoint.set('gpufleet_llama_up{server="alpha"} 1\n')
        prometheus.wait_for("gpufleet_llama_up == 1")
        now = datetime.now(UTC)
        graph = {
            "query": "gpufleet_llama_up",
            "start": (now - timedelta(minutes=2)).isoformat(),
            "end": (now + timedelta(seconds=30)).isoformat(),
            "marked": [(now - timedelta(seconds=20)).isoformat(), now.isoformat()],
        }
        journal.enqueue_report("alerts-gpu", "header line\n\nthe outcome", run_id=3, graph=graph)
        sender = make_sender(
            journal, zulip.write_zuliprc(tmp_path / "zuliprc"), prometheus_url=prometheus.url
        )
        assert sender.send_due() == 1
    [(path, data)] = zulip.uploads.items()
    assert path.endswith("/gpu-fleet-report-1.png")
    width, _, raw = png_pixels(data)
    assert width == WIDTH and bytes(PALETTE[0]) in raw
    [message] = zulip.messages
    head, shown, outcome, _ = message.content.split("\n\n")
    picture, caption = shown.split("\n")
    assert head == "header line" and picture == f"[📈 `gpufleet_llama_up`]({path})"
    assert "server=alpha" in caption and outcome == "the outcome"
    [entry] = journal.outbox_entries()
    assert entry.picture is not None and path in entry.picture


def test_without_prometheus_the_report_goes_out_without_a_picture(
    zulip: ZulipStandIn, journal: Journal, tmp_path: Path
) -> None:
    graph = {
        "query": "up",
        "start": "2026-11-30T03:00:00+00:00",
        "end": "2026-11-30T03:20:00+00:00",
    }
    journal.enqueue_report("alerts-gpu", "header\n\noutcome", run_id=4, graph=graph)
    sender = make_sender(journal, zulip.write_zuliprc(tmp_path / "zuliprc"))  # closed port
    assert sender.send_due() == 1
    assert zulip.uploads == {}
    assert [m.content for m in zulip.messages] == [
        "header\n\noutcome\n\n`gpu-fleet report 1 · run 4`"
    ]
    assert journal.outbox_entries()[0].picture == ""


# -- replicas -------------------------------------------------------------------------------


def test_two_replicas_on_postgresql_send_each_report_once(
    zulip: ZulipStandIn, tmp_path: Path
) -> None:
    zuliprc = zulip.write_zuliprc(tmp_path / "zuliprc")
    with throwaway_database() as url:
        journals = [Journal(url, replica_id=name) for name in ("central-1", "central-2")]
        senders = [make_sender(j, zuliprc) for j in journals]
        try:
            for index in range(12):
                journals[index % 2].enqueue_report(f"alerts-{index % 3}", f"report {index}")
            for sender in senders:
                sender.start()
            wait_until(lambda: not unsent(journals[0]), what="twelve reports")
            holder = next(s for s in senders if s.holds_lease)
            other = next(s for s in senders if s is not holder)
            assert not other.holds_lease  # one sends, the other waits
            # The holder stops (a rolling restart): it hands the lease over, nothing is lost.
            holder.stop()
            for index in range(4):
                journals[0].enqueue_report("alerts-0", f"after the handover {index}")
            wait_until(lambda: not unsent(journals[0]), what="the other replica to take over")
            assert other.holds_lease
            assert_each_once_in_order(zulip, journals[0])
            owners = {e.owner for e in journals[0].outbox_entries()}
            assert owners == {"central-1", "central-2"}
        finally:
            for sender in senders:
                sender.stop()
            for journal in journals:
                journal.close()


# -- metrics, schema ------------------------------------------------------------------------


def test_outbox_depth_and_age_are_exported(journal: Journal) -> None:
    metrics = RemediatorMetrics(journal)
    empty = generate_latest(metrics.registry).decode()
    assert "gpufleet_remediator_outbox_depth 0.0" in empty
    assert "gpufleet_remediator_outbox_oldest_age_seconds 0.0" in empty
    journal.enqueue_report("alerts-gpu", "waiting")
    time.sleep(0.2)
    depth = metrics.registry.get_sample_value("gpufleet_remediator_outbox_depth")
    age = metrics.registry.get_sample_value("gpufleet_remediator_outbox_oldest_age_seconds")
    assert depth == 1 and age is not None and age >= 0.2


def test_a_version_1_journal_is_migrated_with_its_reports(tmp_path: Path) -> None:
    # Recorded from the first release's schema (tests/fixtures/journal/README.md).
    url = load_sqlite(FIXTURES / "v1.sqlite.sql", tmp_path / "old.db")
    journal = Journal(url, replica_id="central-1")
    try:
        assert journal.schema_version() == 3
        sent, unsent = journal.outbox_entries()
        assert (sent.content, sent.state, sent.zulip_message_id) == ("sent by v1", "sent", 17)
        assert sent.run_id is not None and journal.get_run(sent.run_id) is not None
        [entry] = journal.outbox_due()
        assert entry == unsent
        assert (entry.content, entry.recipients, entry.graph, entry.picture) == (
            "queued by v1",
            None,
            None,
            None,
        )
        journal.enqueue_report("alerts-gpu", "v3", recipients=["oncall@example.org"])
        assert journal.outbox_entries()[2].recipients == ("oncall@example.org",)
    finally:
        journal.close()


def test_the_sender_thread_survives_and_stops_promptly(
    zulip: ZulipStandIn, journal: Journal, tmp_path: Path
) -> None:
    sender = make_sender(journal, zulip.write_zuliprc(tmp_path / "zuliprc"))
    sender.start()
    journal.enqueue_report("alerts-gpu", "woken")
    sender.wake()
    wait_until(lambda: len(zulip.messages) == 1, what="the woken sender")
    started = time.monotonic()
    sender.stop()
    assert time.monotonic() - started < 2
    assert not any(t.name == "zulip-sender" and t.is_alive() for t in threading.enumerate())
