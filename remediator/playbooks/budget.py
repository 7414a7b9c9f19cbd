"""What a run disrupts: the targets whose budgets (lock, cooldown, breaker) a run spends.

A run's *disruption set* is the target it acts on and everything beneath it in the roster:

    host/H      ⊃  gpu/H/i (every GPU the roster expects on H)  ⊃  server/H/s on GPU i
    host/H      ⊃  server/H/s (every server of H, on a GPU or not)
    gpu/H/i     ⊃  server/H/s whose roster `gpu` is i
    server/H/s  =  itself

so restarting a host's servers, capping a GPU and restarting a server on it all share the
server's budget: a host-wide run cools every GPU and server of the host down, and a server
cooling down holds off a power cap of its GPU (which would slow it) as much as another
restart. Nothing above is taken: a server's run does not cool its host down, so the host's
other servers stay free.

A playbook none of whose steps is a disruptive action (probes, checks, waits, evidence, an
escalation to people: `RegisteredAction.disruptive`) disrupts nothing: its set is empty.
`policy.budget_scope: target` narrows the set to the target itself (for a playbook whose
actions touch only that, e.g. one that reads a GPU's evidence and caps nothing).

Check by hand: `gpu-fleet-remediator replay --dry-run` shows each run's target; the set is
journaled per running run in `run_targets`.
"""

from __future__ import annotations

from fleet.roster import Roster
from remediator.actions.registry import get_action
from remediator.playbooks.model import Playbook, expected_gpu_count
from remediator.targets import Target


def disrupts_nothing(playbook: Playbook) -> bool:
    """True when no step of `playbook` is a disruptive action (none touches a target)."""
    return not any(get_action(step.action).disruptive for step in playbook.steps)


def disruption_set(playbook: Playbook, target: Target, roster: Roster) -> tuple[str, ...]:
    """The target keys a run of `playbook` on `target` disrupts, its own key first."""
    if disrupts_nothing(playbook):
        return ()
    if playbook.policy.budget_scope == "target" or target.kind == "server":
        return (target.key,)
    host = roster.hosts[target.host]
    servers = sorted(host.servers.items())
    if target.kind == "gpu":
        on_gpu = [name for name, server in servers if server.gpu == target.gpu]
        return (target.key, *(f"server/{target.host}/{name}" for name in on_gpu))
    gpus = set(range(expected_gpu_count(host) or 0))
    gpus |= {server.gpu for _, server in servers if server.gpu is not None}
    return (
        target.key,
        *(f"gpu/{target.host}/{index}" for index in sorted(gpus)),
        *(f"server/{target.host}/{name}" for name, _ in servers),
    )
