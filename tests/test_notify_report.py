"""The Zulip reports as text: their format (golden files), topics, safety and trimming.

The golden files under tests/golden/zulip-*.md are the reports exactly as the sender hands
them to Zulip, less the picture and marker lines it adds; docs/remediator.md's sample is the
first.
`GPUFLEET_UPDATE_GOLDEN=1` rewrites them after an intended change (review the diff like code).
"""

from __future__ import annotations

import difflib
import os
import re
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from urllib.parse import unquote

from fleet.roster import Roster
from remediator.journal import AlertRecord, RunRecord, StepRecord
from remediator.notify.markdown import code, evidence_block, fit, fit_topic, inline
from remediator.notify.report import (
    Reporter,
    ReportSettings,
    duration,
    generator_expr,
    graph_query,
    silence_url,
)
from tests.golden import GOLDEN_DIR

T0 = datetime(2026, 11, 30, 3, 12, 45, tzinfo=UTC)

ROSTER = Roster.model_validate(
    {
        "hosts": {
            "dioscuri": {
                "address": "192.0.2.10",
                "servers": {
                    "alpha": {
                        "engine": "llama",
                        "url": "http://192.0.2.10:31001",
                        "unit": "llama-server@alpha.service",
                        "role": "gpu-dense",
                        "model": "Gemma4-31B-QAT-Q4_K_M",
                    }
                },
            }
        }
    }
)

SETTINGS = ReportSettings(
    stream="agent-hub",
    topics={
        "gpu": "alerts-gpu",
        "inference": "alerts-gpu",
        "infra": "alerts-infra",
        "pm2": "alerts-pm2",
    },
    default_topic="gpu-fleet",
    escalate_to=("oncall@example.org",),
    grafana_url="https://grafana.example.org/d/gpu-fleet/gpu-fleet",
    alertmanager_url="https://alertmanager.example.org",
)


def alert(**labels: str) -> AlertRecord:
    base = {
        "alertname": "LlamaServerDown",
        "host": "dioscuri",
        "server": "alpha",
        "severity": "critical",
        "category": "inference",
    }
    base.update(labels)
    base = {key: value for key, value in base.items() if value}
    return AlertRecord(
        id=1,
        fingerprint="5f2a9c0e1b3d4a67",
        starts_at=T0,
        status="firing",
        alertname=base.get("alertname", ""),
        labels=base,
        annotations={
            "summary": "llama-server alpha on dioscuri does not answer /health",
            "description": "GET /health was refused for 1 minute.",
            "runbook_url": "https://github.com/gpu-fleet/gpu-fleet/blob/main/docs/runbooks/"
            "llama-server-down.md",
        },
        generator_url="http://prometheus.example.org:9090/graph?g0.expr="
        "gpufleet_llama_up+%3D%3D+0&g0.tab=1",
        first_seen=T0,
        last_seen=T0,
        resolved_at=None,
    )


def healed_run() -> RunRecord:
    started = T0 + timedelta(seconds=62)
    return RunRecord(
        id=12,
        alert=alert(),
        state="done",
        decision="run",
        reason="",
        playbook="llama-server-unhealthy",
        target="server/dioscuri/alpha",
        owner="central-1",
        created_at=T0 + timedelta(seconds=61),
        claimed_at=started,
        started_at=started,
        finished_at=started + timedelta(seconds=188),
        outcome="healed",
        verification='PromQL `gpufleet_llama_up{host="dioscuri",server="alpha"} == 1`: held '
        "(holds after 2 evaluation(s) in 5.1 s: 1 series); probe http_probe: ok (HTTP 200)",
        steps=[
            StepRecord(
                index=0,
                action="capture_evidence",
                params={},
                started_at=started,
                finished_at=started + timedelta(seconds=1.2),
                result="ok",
                output="evidence of alpha captured\n\n## evidence of alpha (1.1 s)\n"
                "unit: failed/failed, NRestarts 4; port 31001: no listener\n"
                "journal: llama-server[4242]: ggml_cuda_init: out of memory",
            ),
            StepRecord(
                index=1,
                action="drain",
                params={"max_wait_seconds": 20},
                started_at=started + timedelta(seconds=1.2),
                finished_at=started + timedelta(seconds=1.5),
                result="ok",
                output="drain: cannot see the server's load (GET /slots refused): "
                "nothing to wait for",
            ),
            StepRecord(
                index=2,
                action="restart_server",
                params={},
                started_at=started + timedelta(seconds=1.5),
                finished_at=started + timedelta(seconds=4.0),
                result="ok",
                output="restarted alpha: failed/failed → active/running pid 5120",
            ),
            StepRecord(
                index=3,
                action="wait_healthy",
                params={"within_seconds": 180},
                started_at=started + timedelta(seconds=4.0),
                finished_at=started + timedelta(seconds=41.0),
                result="ok",
                output="healthy after 37.0 s",
            ),
        ],
    )


def assert_golden_text(text: str, name: str) -> None:
    path = GOLDEN_DIR / f"{name}.md"
    if os.environ.get("GPUFLEET_UPDATE_GOLDEN") == "1":
        path.write_text(text)
    assert path.exists(), f"no golden file {path}: run with GPUFLEET_UPDATE_GOLDEN=1"
    expected = path.read_text()
    if text != expected:
        diff = "".join(
            difflib.unified_diff(
                expected.splitlines(keepends=True), text.splitlines(keepends=True), str(path),
                "rendered",
            )
        )  # fmt: skip
        raise AssertionError(f"report differs from {path}:\n{diff}")


REPORTER = Reporter(SETTINGS, ROSTER)


# -- format ---------------------------------------------------------------------------------


def test_a_healed_run_report_matches_its_golden_file() -> None:
    [report] = REPORTER.run_report(healed_run())
    assert report.topic == "alerts-gpu" and report.recipients is None
    assert_golden_text(report.content, "zulip-report-healed")
    # The picture is of what fired: the alert's expression, its comparison taken off.
    assert report.graph is not None and report.graph["query"] == "gpufleet_llama_up"


def test_a_notify_only_report_is_shorter() -> None:
    run = replace(
        healed_run(),
        alert=replace(
            alert(
                alertname="GpuVramNearlyFull",
                server="",
                category="gpu",
                gpu="1",
                severity="warning",
            ),
            annotations={"summary": "GPU 1 on dioscuri: VRAM 97 % full for 10 minutes"},
            generator_url="http://prometheus.example.org:9090/graph?g0.expr="
            "gpufleet_gpu_memory_used_bytes+%2F+gpufleet_gpu_memory_total_bytes+%3E+0.95",
        ),
        decision="notify_only",
        reason="no playbook handles GpuVramNearlyFull",
        playbook=None,
        target=None,
        outcome=None,
        verification=None,
        steps=[],
    )
    [report] = REPORTER.run_report(run)
    assert_golden_text(report.content, "zulip-report-notify-only")
    assert len(report.content) < len(REPORTER.run_report(healed_run())[0].content)
    assert "| step |" not in report.content


def test_a_decision_that_ran_nothing_says_which_and_why() -> None:
    run = replace(
        healed_run(),
        decision="cooldown",
        reason="cooldown of llama-server-unhealthy on server/dioscuri/alpha until 03:27:45",
        outcome=None,
        verification=None,
        steps=[],
    )
    [report] = REPORTER.run_report(run)
    assert_golden_text(report.content, "zulip-report-cooldown")


def test_a_resolution_closes_the_story_in_the_same_topic() -> None:
    run = replace(
        healed_run(),
        alert=replace(alert(), status="resolved", resolved_at=T0 + timedelta(minutes=4)),
    )
    [report] = REPORTER.closing_report(run)
    assert report.topic == REPORTER.run_report(healed_run())[0].topic
    assert_golden_text(report.content, "zulip-report-resolved")
    assert report.content.startswith(
        "✅ **Resolved** after 4 m, healed by `llama-server-unhealthy` (run #12)"
    )


def test_an_escalation_goes_to_the_topic_and_to_each_person() -> None:
    topic_report, direct = REPORTER.escalation_reports(
        healed_run(), playbook="llama-server-unhealthy", target="server/dioscuri/alpha",
        why="3 runs did not heal",
    )  # fmt: skip
    assert topic_report.recipients is None and topic_report.topic == "alerts-gpu"
    assert direct.recipients == ("oncall@example.org",)
    assert "#**agent-hub>alerts-gpu**" in direct.content
    assert "circuit breaker opened" in topic_report.content


# -- topics ---------------------------------------------------------------------------------


def test_the_topic_comes_from_the_category_label() -> None:
    assert REPORTER.topic({"category": "gpu"}) == "alerts-gpu"
    assert REPORTER.topic({"category": "inference"}) == "alerts-gpu"
    assert REPORTER.topic({"category": "infra"}) == "alerts-infra"
    assert REPORTER.topic({"category": "pm2"}) == "alerts-pm2"  # our users' extra category
    assert REPORTER.topic({"category": "storage"}) == "gpu-fleet"  # unmapped: the default
    assert REPORTER.topic({}) == "gpu-fleet"


def test_a_topic_never_exceeds_sixty_characters() -> None:
    long = Reporter(replace(SETTINGS, default_topic="t" * 60, topics={"x": "é" * 80}), ROSTER)
    assert len(long.topic({"category": "x"})) == 60
    assert long.topic({"category": "x"}).endswith("…")
    assert fit_topic("a\nb") == "a b"


# -- safety ---------------------------------------------------------------------------------


def test_labels_and_annotations_cannot_break_the_report() -> None:
    hostile = "x | y ``` `z`\n# heading\n```` ````spoiler q @**all** <time:2020-01-01> [l](u)"
    run = replace(
        healed_run(),
        alert=replace(
            alert(alertname=hostile, host=hostile, server=hostile),
            annotations={"summary": hostile, "description": hostile},
        ),
        reason=hostile,
        verification=hostile,
        steps=[
            replace(
                healed_run().steps[0],
                action=hostile,
                result=hostile,
                output=hostile + "\n" + "`" * 12,
            )
        ],
    )
    [report] = REPORTER.run_report(run)
    lines = report.content.split("\n")
    evidence = next(i for i, line in enumerate(lines) if "spoiler Evidence" in line)
    # No line but ours starts a block: no heading, no quote, no list before the evidence
    # (inside its code block, text is shown as it is).
    assert not any(line.startswith(("#", ">", "- ", "```")) for line in lines[:evidence])
    table = [line for line in lines if line.startswith("| ")]
    separators = [len(re.findall(r"(?<!\\)\|", line)) for line in table]
    assert len(set(separators)) == 1, "a label added or removed a table cell"
    # Outside code spans (where text is literal), nothing of it is markup.
    prose = "\n".join(lines[:evidence]).replace(code(hostile), "")
    assert "`" not in prose.replace("\\`", "").replace(code("server/dioscuri/alpha"), "").replace(
        code("llama-server-unhealthy"), ""
    ), "a code span was left open"
    assert "@**all**" not in prose and "<time:2020" not in prose and "[l](u)" not in prose
    # The evidence block is closed by our fence only: exactly one spoiler, at the end.
    outer = lines[evidence].split("spoiler")[0]
    inner = outer[:-1]
    assert lines.index(outer, evidence + 1) == len(lines) - 1
    assert lines[evidence + 1] == inner + "text"
    assert [i for i, line in enumerate(lines) if line == inner] == [len(lines) - 2]
    assert "`" * 12 in lines[evidence + 2 : -2]  # the evidence is in it, verbatim
    # Unknown host and server: no roster facts, said so.
    assert "not in the roster" in report.content


def test_inline_and_code_keep_text_literal() -> None:
    assert inline("*bold* _it_ `c` [a](b)") == r"\*bold\* \_it\_ \`c\` \[a\](b)"
    assert inline("- item") == r"\- item" and inline("1. item") == r"1\. item"
    assert code("a`b") == "``a`b``" and code("`") == "`` ` ``"
    block = evidence_block("E", "```\ninside\n```")
    assert block.split("\n")[0] == "`````spoiler E" and block.endswith("\n`````")


def test_links_are_http_only_and_encoded() -> None:
    evil = replace(alert(), generator_url="javascript:alert(1)")
    [report] = REPORTER.run_report(replace(healed_run(), alert=evil))
    assert "javascript:" not in report.content
    url = silence_url("https://am.example.org/", {"alertname": "A", "host": 'h"x', "job": "j"})
    assert url.startswith("https://am.example.org/#/silences/new?filter=")
    assert unquote(url.split("filter=")[1]) == '{alertname="A",host="h\\"x"}'


def test_graph_query_takes_the_comparison_off_only_when_clear() -> None:
    assert graph_query("gpufleet_llama_up == 0") == "gpufleet_llama_up"
    assert graph_query("x > bool 0.9") == "x"
    assert graph_query("a > 0.9 * b") == "a > 0.9 * b"
    assert graph_query("a == 0 and on() b > 1") == "a == 0 and on() b > 1"
    assert generator_expr("http://p:9090/graph?g0.expr=up%3D%3D0&g0.tab=1") == "up==0"
    assert generator_expr("http://p:9090/graph") is None


def test_durations_read_like_a_person_would_say_them() -> None:
    assert [duration(s) for s in (0.4, 42, 240, 250, 7500)] == [
        "0.4 s", "42 s", "4 m", "4 m 10 s", "2 h 5 m"
    ]  # fmt: skip


# -- trimming -------------------------------------------------------------------------------


def test_trimming_cuts_the_evidence_never_the_outcome() -> None:
    noisy = replace(healed_run().steps[0], output="\n".join(f"line {i}" for i in range(3000)))
    [report] = REPORTER.run_report(replace(healed_run(), steps=[noisy]))
    assert len(report.content) > 2000
    trimmed = fit(report.content, 2000)
    assert len(trimmed) <= 2000
    evidence_at = report.content.index("`spoiler Evidence")
    before = report.content[: report.content.rindex("\n", 0, evidence_at)]
    assert trimmed.startswith(before), "the header, steps and outcome are kept whole"
    assert "characters cut to fit Zulip's message limit" in trimmed
    assert "line 0" in trimmed and "line 2999" in trimmed  # head and tail of the evidence
    assert trimmed.rstrip().endswith("`" * 4)  # the spoiler is still closed


def test_too_small_a_limit_drops_the_evidence_and_keeps_the_outcome() -> None:
    [report] = REPORTER.run_report(healed_run())
    evidence_at = report.content.index("````spoiler")
    limit = evidence_at + 80
    trimmed = fit(report.content, limit)
    assert len(trimmed) <= limit
    assert "spoiler" not in trimmed and "evidence left out" in trimmed
    assert "✅ **Healed**" in trimmed and "| 4 | `wait_healthy` | ok | 37 s |" in trimmed


def test_a_report_within_the_limit_is_untouched() -> None:
    [report] = REPORTER.run_report(healed_run())
    assert fit(report.content, 10_000) == report.content


def test_the_docs_show_the_healed_report_as_it_renders() -> None:
    page = (GOLDEN_DIR.parent.parent / "docs" / "remediator.md").read_text()
    golden = (GOLDEN_DIR / "zulip-report-healed.md").read_text()
    assert f"`````markdown\n{golden.rstrip()}\n`````" in page
