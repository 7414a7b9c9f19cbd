r"""Actions on a host through `gpu-fleet-node`: evidence, restart, the port ghost, escalation.

Each runs one node verb through the host's executor (SSH, or local for `local: true` hosts;
`remediator/actions/executors/`). The words sent are the roster's own: the target's server
name, never an alert label, and they are checked again before anything runs.

    - capture_evidence: {}                 # node `evidence SERVER` (port owner, main process,
                                           # the unit's journal, GPU processes), kept in the
                                           # step output; read-only, so it runs under dry-run
        promql: ['gpufleet_gpu_up{host="{host}"}']   # optional: a Prometheus snapshot too
    - restart_server: {}                   # node `restart SERVER` (systemctl restart)
    - kill_port_ghost: {}                  # node `guard-port SERVER`: a stale copy of the
                                           # unit's own server holding the port is killed
    - escalate: {why: "crash loop: restarting does not heal it"}   # call people now

A GPU or host target's `capture_evidence` takes the evidence of every roster server on that
GPU (or host), at most `max_servers`.
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import Field

from remediator.actions.executors import NodeAnswer, executor_for
from remediator.actions.registry import ActionContext, ActionParams, StepResult, action
from remediator.prometheus_api import QueryError, query_instant

# The node's own answer is bounded (1 MiB); what a step output quotes of it is less, so that
# the journal's 64 KiB per step holds several servers' evidence.
_EVIDENCE_CHARS = 16_000
_QUERY_TIMEOUT_SECONDS = 5.0


def node_call(ctx: ActionContext, verb: str, args: list[str]) -> NodeAnswer:
    """Run one node request for the target's host within the step's time."""
    settings = ctx.settings.executors
    if settings is None:
        return NodeAnswer(
            False,
            f"{verb}: no executor is configured (the remediator's config sets them up)",
            (),
            None,
            0.0,
        )
    executor = executor_for(ctx.target.host, ctx.target.host_entry, settings)
    return executor.run(verb, args, timeout=ctx.remaining(), cancel=ctx.cancel)


def _server_of(ctx: ActionContext, what: str) -> str | StepResult:
    if ctx.target.server is None:
        return StepResult(False, f"error: {what} acts on a server target, not {ctx.target.key}")
    return ctx.target.server


def _servers_of(ctx: ActionContext, limit: int) -> list[str]:
    """The roster servers the target covers: itself, those on its GPU, or all of its host."""
    target = ctx.target
    if target.server is not None:
        return [target.server]
    servers = target.host_entry.servers
    if target.gpu is not None:
        names = [name for name, entry in servers.items() if entry.gpu == target.gpu]
    else:
        names = list(servers)
    return sorted(names)[:limit]


def _shown(result: dict[str, Any]) -> str:
    text = json.dumps(result, indent=1, sort_keys=True, default=str)
    if len(text) > _EVIDENCE_CHARS:
        text = text[:_EVIDENCE_CHARS] + f"\n… ({len(text) - _EVIDENCE_CHARS} characters cut)"
    return text


class CaptureEvidenceParams(ActionParams):
    """`capture_evidence`: PromQL snapshots, how many servers at most, and whether it must work.

    `required` (default): a failure to capture fails the step, so nothing is killed without
    evidence (DESIGN.md, "Safety rails").
    """

    promql: list[str] = Field(default=[], max_length=10)
    max_servers: int = Field(default=8, ge=1, le=64)
    required: bool = True


@action("capture_evidence", CaptureEvidenceParams, default_timeout_seconds=60.0, read_only=True)
def capture_evidence(ctx: ActionContext, params: CaptureEvidenceParams) -> StepResult:
    """Collect the node's `evidence` for the target's servers, and PromQL snapshots.

    Node `evidence SERVER` for the target's server (or every server on the target GPU / host),
    plus PromQL snapshots, into the step output — and so into the Zulip report.
    """
    parts: list[str] = []
    failures: list[str] = []
    collected: dict[str, Any] = {}
    for server in _servers_of(ctx, params.max_servers):
        answer = node_call(ctx, "evidence", [server])
        if answer.ok:
            collected[server] = answer.result
            shown = _shown(answer.result)
            parts.append(f"## evidence of {server} ({answer.seconds:.1f} s)\n{shown}")
        else:
            failures.append(f"{server}: {answer.summary}")
            parts.append(f"## evidence of {server}: FAILED\n{answer.journal_text()}")
    for query in params.promql:
        try:
            series = query_instant(
                ctx.prometheus_url,
                query,
                timeout_seconds=max(0.2, min(_QUERY_TIMEOUT_SECONDS, ctx.remaining())),
            )
        except QueryError as exc:
            parts.append(f"## PromQL {query}\nnot available: {exc}")
            continue
        rows = [
            f"{item.get('metric', {})} {item.get('value', ['', ''])[1]}"
            for item in series[:50]
            if isinstance(item, dict)
        ]
        parts.append(f"## PromQL {query}\n" + ("\n".join(rows) or "(no series)"))
    if not collected and not failures and not params.promql:
        return StepResult(True, f"no roster server on {ctx.target.key}: no node evidence to take")
    head = (
        f"evidence of {', '.join(collected) or 'no server'} captured"
        if not failures
        else f"evidence incomplete: {'; '.join(failures)}"
    )
    ok = not failures or not params.required
    return StepResult(ok, head + "\n\n" + "\n\n".join(parts), {"servers": sorted(collected)})


class NoParams(ActionParams):
    """No params: the action works on the target alone."""


def _state(snapshot: Any) -> str:
    if not isinstance(snapshot, dict):
        return "?"
    pid = snapshot.get("main_pid")
    state = f"{snapshot.get('active_state', '?')}/{snapshot.get('sub_state', '?')}"
    return f"{state} pid {pid}" if pid else state


@action("restart_server", NoParams, default_timeout_seconds=120.0)
def restart_server(ctx: ActionContext, params: NoParams) -> StepResult:
    """Restart the target server's unit through the node (`restart SERVER`).

    Node `restart SERVER`; the output shows state and MainPID before → after.
    """
    server = _server_of(ctx, "restart_server")
    if isinstance(server, StepResult):
        return server
    answer = node_call(ctx, "restart", [server])
    result = answer.result
    if not answer.ok:
        return StepResult(False, answer.journal_text(), {"exit_code": answer.exit_code})
    before, after = result.get("before"), result.get("after")
    summary = f"restarted {server}: {_state(before)} → {_state(after)}"
    details = {"before": before, "after": after}
    return StepResult(True, f"{summary}\n{answer.journal_text()}", details)


# Clears its alert: with the ghost gone PortGhost resolves within a scrape, often before the
# playbook's restart is asked for; that restart must still run (a crash-looping unit may have
# spent its start limit and stay down).
@action("kill_port_ghost", NoParams, default_timeout_seconds=60.0, clears_alert=True)
def kill_port_ghost(ctx: ActionContext, params: NoParams) -> StepResult:
    """Clear a stale copy of the unit's own server from the server's port (`guard-port`).

    Node `guard-port SERVER`: kills a process holding the port only when it runs the unit's
    own executable and its command line fits the unit's `ExecStart=` (or it is in the unit's
    cgroup); refuses anything else, with the evidence.
    """
    server = _server_of(ctx, "kill_port_ghost")
    if isinstance(server, StepResult):
        return server
    answer = node_call(ctx, "guard-port", [server])
    if not answer.ok:
        return StepResult(False, answer.journal_text(), {"exit_code": answer.exit_code})
    return StepResult(True, f"port of {server} guarded\n{answer.journal_text()}", answer.result)


class EscalateParams(ActionParams):
    """`escalate`: why people must look (shown in the escalation and the report)."""

    why: str = Field(min_length=1, max_length=500)


# Not disruptive: it touches no target, so a playbook that only gathers evidence and calls
# people (llama-server-crash-looping) spends no budget and leaves no cooldown — a crash loop's
# real fix (a port ghost killed) must not wait an hour behind it.
@action("escalate", EscalateParams, default_timeout_seconds=5.0, disruptive=False)
def escalate(ctx: ActionContext, params: EscalateParams) -> StepResult:
    """Ask the engine to escalate the run to people (an event, a metric, a report).

    Calls people now: an `escalation` event, `gpufleet_remediator_escalations_total`, and a
    direct message to `zulip.escalate_to` (not run under dry-run; touches no target, so it
    spends no disruption budget).
    """
    return StepResult(True, f"escalated to people: {params.why}", escalate=params.why)
