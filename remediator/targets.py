"""What a run acts on, and the one place templates are filled: `Target` and `fill_templates`.

A target is a host, a model server or a GPU, resolved in the roster (by
`remediator.playbooks.model.resolve_target`); its `key` names it for locks, cooldowns and
breakers. Playbooks name targets and actions take them, so this module sits below both
(`remediator.actions` and `remediator.playbooks` import it; it imports neither:
tests/test_import_graph.py).

`Target.fill` is the security boundary between alerts and actions: a step's params and a
verification's PromQL are templates (`"{server.url}/health"`) filled from roster-validated
names and fields only, never from alert labels, in one pass, so a roster value that happens to
contain `{host}` stays literal.

Check by hand: `python -c "from remediator.targets import PLACEHOLDERS; print(PLACEHOLDERS)"`.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from fleet.roster import Host, Server

TargetKind = Literal["host", "server", "gpu"]
TARGET_KINDS: tuple[TargetKind, ...] = ("host", "server", "gpu")

# A placeholder is `{name}` or `{name.field}` and nothing else, so PromQL label matchers
# (`{host="{host}"}`) and JSON (`{"a": 1}`) are left alone: only a brace around a bare
# identifier is a placeholder, and every such one must be known (a typo fails at load).
PLACEHOLDER = re.compile(r"\{([A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)?)\}")

_HOST_PLACEHOLDERS = ("host", "host.address", "host.exporter_port")
_SERVER_PLACEHOLDERS = (
    "server",
    "server.url",
    "server.unit",
    "server.role",
    "server.model",
    "server.engine",
)

PLACEHOLDERS: Mapping[TargetKind, tuple[str, ...]] = {
    "host": _HOST_PLACEHOLDERS,
    "server": (*_HOST_PLACEHOLDERS, *_SERVER_PLACEHOLDERS),
    "gpu": (*_HOST_PLACEHOLDERS, "gpu"),
}
"""The placeholders each target kind can fill, all from roster-validated names and fields."""

ALL_PLACEHOLDERS = frozenset(name for names in PLACEHOLDERS.values() for name in names)


@dataclass(frozen=True)
class Target:
    """What a playbook acts on: a host, a model server or a GPU, resolved in the roster.

    `host` and `server` are roster keys (validated names), `gpu` an index checked against the
    roster; `key` names the target for locks, cooldowns and breakers: `host/dioscuri`,
    `server/dioscuri/alpha`, `gpu/dioscuri/0`.
    """

    kind: TargetKind
    host: str
    host_entry: Host
    server: str | None = None
    server_entry: Server | None = None
    gpu: int | None = None
    # A router's child (llama-server --models-dir) that the alert is about: the alert's
    # `served_model` label, checked against `_SERVED_MODEL`. The budget stays the server's
    # (`key`): restarting a router restarts every child.
    served_model: str | None = None
    key: str = field(init=False)

    def __post_init__(self) -> None:
        if self.served_model is not None and self.kind != "server":
            raise ValueError("only a server target names a served model")
        if self.kind == "server":
            if self.server is None or self.server_entry is None or self.gpu is not None:
                raise ValueError("a server target needs server and server_entry, and no gpu")
            key = f"server/{self.host}/{self.server}"
        elif self.kind == "gpu":
            if self.gpu is None or self.server is not None or self.server_entry is not None:
                raise ValueError("a gpu target needs gpu, and no server")
            key = f"gpu/{self.host}/{self.gpu}"
        else:
            if self.server is not None or self.server_entry is not None or self.gpu is not None:
                raise ValueError("a host target has no server and no gpu")
            key = f"host/{self.host}"
        # Frozen: the key is derived once, here, so it can never disagree with the fields.
        object.__setattr__(self, "key", key)

    def values(self) -> dict[str, str]:
        """Every placeholder this target fills, name to value."""
        out = {
            "host": self.host,
            "host.address": self.host_entry.address,
            "host.exporter_port": str(self.host_entry.exporter_port),
        }
        if self.server is not None and self.server_entry is not None:
            out.update(
                {
                    "server": self.server,
                    "server.url": self.server_entry.url,
                    "server.unit": self.server_entry.unit,
                    "server.role": self.server_entry.role,
                    "server.model": self.server_entry.model,
                    # `llama` or `vllm` (the roster allows no other): the engine's own series,
                    # `gpufleet_{server.engine}_up`.
                    "server.engine": self.server_entry.engine,
                }
            )
        if self.gpu is not None:
            out["gpu"] = str(self.gpu)
        return out

    def fill(self, template: str) -> str:
        """`template` with every placeholder replaced by this target's value.

        One pass over the template: a substituted value is never scanned again, so a roster
        field that happens to contain `{host}` stays literal. A placeholder this target cannot
        fill raises `KeyError`; the loader refuses such templates, so that is a bug.
        """
        values = self.values()

        def substitute(match: re.Match[str]) -> str:
            name = match.group(1)
            if name not in values:
                raise KeyError(f"placeholder {{{name}}} cannot be filled for a {self.kind} target")
            return values[name]

        return PLACEHOLDER.sub(substitute, template)


def fill_templates(raw: Mapping[str, Any], target: Target) -> dict[str, Any]:
    """A copy of `raw` with every string (in nested mappings and lists too) filled by `target`."""

    def fill(value: Any) -> Any:
        if isinstance(value, str):
            return target.fill(value)
        if isinstance(value, Mapping):
            return {key: fill(item) for key, item in value.items()}
        if isinstance(value, list | tuple):
            return [fill(item) for item in value]
        return value

    return {key: fill(value) for key, value in raw.items()}
