"""End to end: Alertmanager's webhook → journal → run → outbox → Zulip (the stand-in).

The remediator is the real app and engine over a SQLite journal (tests/remediator_lab.py), with
a `zulip` section in its config whose zuliprc points at the Zulip stand-in; the sender is the
one `build_services` made, driven pass by pass so the test sees each report arrive.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from remediator.engine import Engine, alert_of
from remediator.playbooks.model import resolve_target
from remediator.targets import Target
from tests.test_remediator import Lab, firing, fixture, make_lab
from tests.zulip_stand_in import ZulipStandIn


def zulip_config(zuliprc: Path) -> str:
    return (
        "zulip:\n"
        f"  zuliprc: {zuliprc}\n"
        "  stream: agent-hub\n"
        "  topics: {gpu: alerts-gpu, inference: alerts-gpu, infra: alerts-infra}\n"
        "  escalate_to: [oncall@example.org]\n"
        "  alertmanager_url: http://127.0.0.1:9093\n"
        "  grafana_url: http://127.0.0.1:3000/d/gpu-fleet/gpu-fleet\n"
    )


@pytest.fixture
def zulip() -> Iterator[ZulipStandIn]:
    with ZulipStandIn() as stand_in:
        yield stand_in


def lab_with_zulip(tmp_path: Path, zulip: ZulipStandIn, **options: Any) -> Iterator[Lab]:
    zuliprc = zulip.write_zuliprc(tmp_path / "zuliprc")
    yield from make_lab(tmp_path, extra=zulip_config(zuliprc), **options)


def send(lab: Lab) -> int:
    sender = lab.services.sender
    assert sender is not None, "a config with a zulip section has a sender"
    return sender.send_due()


def test_an_alert_is_healed_and_reported_in_its_topic_then_closed(
    tmp_path: Path, zulip: ZulipStandIn
) -> None:
    for lab in lab_with_zulip(tmp_path, zulip):
        assert lab.post(fixture("firing")).status_code == 200
        lab.process()
        assert send(lab) == 1
        [report] = zulip.stream_messages()
        # category "inference" → alerts-gpu, through the config's topics
        assert (report.stream, report.topic) == ("agent-hub", "alerts-gpu")
        lines = report.content.split("\n")
        assert lines[0].startswith("🔴 **critical** · **LlamaServerDown** · host `dioscuri`")
        assert "role `gpu-dense` · model `tiny`" in lines[0]  # from the roster
        assert "✅ **Healed** — `probe-llama` on `server/dioscuri/alpha` (run #1)" in lines
        assert "| 1 | `http_probe` | ok |" in report.content
        assert "**Verification**: probe http\\_probe: ok" in report.content
        assert "[Silence](http://127.0.0.1:9093/#/silences/new?filter=" in report.content
        assert lines[-1] == "`gpu-fleet report 1 · run 1`"
        # The run and its report were journaled together; the report is now marked sent.
        [entry] = lab.services.journal.outbox_entries()
        assert (entry.run_id, entry.state, entry.zulip_message_id) == (1, "sent", report.id)

        assert lab.post(fixture("resolved")).status_code == 200
        lab.process()
        assert send(lab) == 1
        closing = zulip.stream_messages("alerts-gpu")[-1]
        assert closing.content.startswith(
            "✅ **Resolved** after 4 m 5 s, healed by `probe-llama` (run #1)"
        )
        # Metrics: nothing left, two sent.
        text = lab.client.get("/metrics").get_data(as_text=True)
        assert "gpufleet_remediator_outbox_depth 0.0" in text
        assert 'gpufleet_remediator_outbox_sent_total{kind="stream"} 2.0' in text


def test_notify_only_and_decisions_are_reported_too(tmp_path: Path, zulip: ZulipStandIn) -> None:
    for lab in lab_with_zulip(tmp_path, zulip):
        other = firing(alertname="SomethingElse", fingerprint="e" * 16)
        other["alerts"][0]["labels"]["category"] = "infra"
        lab.post(other)
        lab.post(firing(host="nowhere", fingerprint="f" * 16))
        lab.process()
        assert send(lab) == 2
        [notify_only] = zulip.stream_messages("alerts-infra")
        assert "📣 **Reported only** — no playbook handles `SomethingElse`" in notify_only.content
        [rejected] = zulip.stream_messages("alerts-gpu")
        assert "⏸️ **Nothing ran: rejected**" in rejected.content
        assert "nowhere" in rejected.content


def test_a_breaker_that_opens_escalates_to_people_directly(
    tmp_path: Path, zulip: ZulipStandIn
) -> None:
    for lab in lab_with_zulip(tmp_path, zulip, cooldown=0, max_failures=1):
        lab.alpha.verify_status = 500
        lab.post(fixture("firing"))
        lab.process()
        assert send(lab) == 3
        report, escalation = zulip.stream_messages("alerts-gpu")
        assert "❌ **Not healed**" in report.content
        assert escalation.content.startswith("🚨 **Escalation** — circuit breaker opened")
        [direct] = zulip.direct_messages()
        assert direct.recipients == ("oncall@example.org",)
        assert "#**agent-hub>alerts-gpu**" in direct.content


def test_a_run_interrupted_by_a_restart_is_reported(tmp_path: Path, zulip: ZulipStandIn) -> None:
    for lab in lab_with_zulip(tmp_path, zulip):
        journal, engine = lab.services.journal, lab.services.engine
        assert engine is not None
        lab.post(fixture("firing"))
        run = journal.claim_next_run()
        assert run is not None
        playbook = next(p for p in engine.playbooks if p.name == "probe-llama")
        target = resolve_target(playbook, alert_of(run.alert), engine.roster)
        assert isinstance(target, Target)
        assert journal.admit_to_act(run.id, engine.plan(playbook, target)).may_act
        # The process dies here; the next start recovers (same replica, same journal).
        restarted = Engine(
            journal,
            engine.roster,
            engine.playbooks,
            engine.settings,
            metrics=engine.metrics,
            reporter=engine.reporter,
        )
        assert restarted.recover() == [run.id]
        assert send(lab) == 1
        [report] = zulip.stream_messages("alerts-gpu")
        assert "⚠️ **Interrupted** — `probe-llama` on `server/dioscuri/alpha`" in report.content
        assert lab.alpha.count("/health") == 0  # not re-run


def test_without_a_zulip_section_nothing_is_queued(tmp_path: Path) -> None:
    for lab in make_lab(tmp_path):
        lab.post(fixture("firing"))
        lab.process()
        assert lab.services.sender is None
        assert lab.services.journal.outbox_entries() == []
        assert lab.runs()[0]["outcome"] == "healed"


def test_truncated_alerts_are_counted_and_said_in_the_groups_report(
    tmp_path: Path, zulip: ZulipStandIn
) -> None:
    for lab in lab_with_zulip(tmp_path, zulip):
        body = fixture("firing")
        body["truncatedAlerts"] = 3  # Alertmanager's max_alerts cut the group
        assert lab.post(body).status_code == 200
        lab.process()
        assert send(lab) == 1
        [report] = zulip.stream_messages()
        assert "Alertmanager left 3 more alert(s) of this group out" in report.content
        metrics = lab.client.get("/metrics").get_data(as_text=True)
        assert "gpufleet_remediator_alerts_truncated_total 3.0" in metrics


def test_without_zulip_reports_are_markdown_files(tmp_path: Path) -> None:
    reports = tmp_path / "reports"
    for lab in make_lab(tmp_path, extra=f"reports_dir: {reports}\n"):
        sender = lab.services.sender
        assert sender is not None, "reports_dir gives a sender that writes files"
        lab.post(fixture("firing"))
        lab.process()
        lab.post(fixture("resolved"))
        assert sender.send_due() == 2
        first, second = sorted(reports.glob("*.md"))
        assert first.name == "000001-gpu-fleet.md"
        text = first.read_text()
        assert "✅ **Healed** — `probe-llama` on `server/dioscuri/alpha` (run #1)" in text
        assert text.rstrip().endswith("`gpu-fleet report 1 · run 1`")
        assert "**Resolved**" in second.read_text()
        # Sent once: a second pass writes nothing new, and the outbox says sent.
        assert sender.send_due() == 0
        assert {e.state for e in lab.services.journal.outbox_entries()} == {"sent"}
