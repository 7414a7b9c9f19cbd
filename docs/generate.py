"""The generated references: docs/metrics.md, docs/alerts.md and docs/actions.md, from the code.

What the code knows, the docs are generated from, so the two cannot drift:
- `metrics.md` from the exporter's metric catalogue (`exporter/collectors/catalogue.py`);
- `alerts.md` from the alerting and recording rules (`rules/*.rules.yml`);
- `actions.md` from the action registry (`remediator/actions/`: every `@action`).

`make docs` (`.venv/bin/python -m docs.generate`) writes the three pages; `--check` writes
nothing and exits 1 naming each page that differs from what the code gives, as
tests/test_docs.py does in `make test`. Each page says at its top that it is generated.

Check by hand: `.venv/bin/python -m docs.generate --check && git diff --stat docs/`.
"""

from __future__ import annotations

import argparse
import inspect
import json
import sys
import types
import typing
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import annotated_types
import yaml
from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

REPO = Path(__file__).resolve().parent.parent
DOCS = REPO / "docs"
RULES = REPO / "rules"

_RUNBOOKS_URL_PART = "/docs/runbooks/"


def _banner(source: str) -> str:
    return (
        f"<!-- Generated from {source} by `make docs` (docs/generate.py): edit the source, not "
        "this page. tests/test_docs.py fails when the two differ. -->\n"
    )


def _cell(text: str) -> str:
    """Text fit for one Markdown table cell: one line, pipes escaped."""
    return " ".join(text.split()).replace("|", "\\|")


def _table(columns: Iterable[str], rows: Iterable[str]) -> list[str]:
    """A Markdown table: the header, its rule, then `rows` (already formatted)."""
    names = list(columns)
    return ["| " + " | ".join(names) + " |", "|" + "---|" * len(names), *rows]


def _code_list(names: Iterable[str]) -> str:
    return ", ".join(f"`{name}`" for name in names)


# --- metrics.md -----------------------------------------------------------------------------

# Sections of the reference by name prefix, in the order a reader meets them; a family whose
# prefix is in none goes under the last.
_METRIC_SECTIONS = (
    ("gpufleet_gpu", "GPUs (NVIDIA through NVML, AMD through amdgpu sysfs)"),
    ("gpufleet_host", "The host: temperatures (hwmon), CPU and memory"),
    ("gpufleet_llama", "llama-server"),
    ("gpufleet_vllm", "vLLM"),
    ("gpufleet_port", "Ports and ghosts"),
    ("gpufleet_unit", "systemd units"),
    ("gpufleet_server", "Model servers' processes and GPU memory"),
    ("gpufleet_canary", "The canary (throughput probe)"),
    ("gpufleet_exporter", "The exporter itself"),
)


def _metric_section(name: str) -> str:
    for prefix, title in _METRIC_SECTIONS:
        if name == prefix or name.startswith(prefix + "_"):
            return title
    return _METRIC_SECTIONS[-1][1]


def metrics_page() -> str:
    """docs/metrics.md: every family of the catalogue, by section, in the catalogue's order."""
    from exporter.collectors.catalogue import CATALOGUE  # noqa: PLC0415

    out = [
        _banner("exporter/collectors/catalogue.py"),
        "# The exporter's metrics\n",
        "Every series `gpu-fleet-exporter` exposes, with its labels. The exporter never emits "
        "`host` or `instance`: Prometheus attaches `host` from the roster's targets "
        "([roster.md](roster.md)). A field a device does not support, or that was not read this "
        "scrape, is absent: never 0 or -1. Labels and how `gpu` is numbered: "
        "[exporter.md](exporter.md). The alerts that read these series: "
        "[alerts.md](alerts.md).\n",
    ]
    by_section: dict[str, list[str]] = {title: [] for _, title in _METRIC_SECTIONS}
    for family in CATALOGUE.values():
        unit = family.unit or "—"
        by_section[_metric_section(family.name)].append(
            f"| `{family.name}` | {family.type} | {_code_list(family.labels) or '—'} | {unit} "
            f"| {_cell(family.doc or family.help)} |"
        )
    for title, rows in by_section.items():
        if not rows:
            continue
        out.append(f"## {title}\n")
        out.extend(_table(("series", "type", "labels", "unit", "meaning"), rows))
        out.append("")
    return "\n".join(out)


# --- alerts.md ------------------------------------------------------------------------------


def _runbook_link(url: str) -> str:
    """The runbook as a link inside the repository (the rules point at the published copy)."""
    if _RUNBOOKS_URL_PART not in url:
        return _cell(url) or "—"
    page = url.split(_RUNBOOKS_URL_PART, 1)[1]
    return f"[{page.removesuffix('.md')}](runbooks/{page})"


def _rule_files() -> list[Path]:
    return sorted(RULES.glob("*.rules.yml"))


def alerts_page() -> str:
    """docs/alerts.md: every alerting rule (one row per rule) and every recording rule."""
    alert_rows: list[tuple[str, list[str]]] = []
    records: list[str] = []
    for path in _rule_files():
        document = yaml.safe_load(path.read_text(encoding="utf-8"))
        for group in document["groups"]:
            rows: list[str] = []
            for rule in group["rules"]:
                if "record" in rule:
                    records.append(
                        f"| `{rule['record']}` | `{group['name']}` | `{path.relative_to(REPO)}` |"
                    )
                    continue
                labels = rule.get("labels", {})
                notes = rule.get("annotations", {})
                keep = rule.get("keep_firing_for")
                rows.append(
                    f"| `{rule['alert']}` | {_cell(labels.get('cause', '')) or '—'} "
                    f"| {labels.get('severity', '—')} | {labels.get('category', '—')} "
                    f"| {rule.get('for', '0s')}{f' (keeps firing {keep})' if keep else ''} "
                    f"| {_cell(notes.get('summary', ''))} "
                    f"| {_runbook_link(notes.get('runbook_url', ''))} |"
                )
            if rows:
                alert_rows.append((f"{group['name']} (`{path.relative_to(REPO)}`)", rows))
    out = [
        _banner("rules/*.rules.yml"),
        "# Alerts and recording rules\n",
        "Every alerting rule that ships in `rules/`, by rule group. An alert with several rules "
        "(several ways to see one trouble) has a row per rule, told apart by its `cause` label. "
        "`severity` is `warning` or `critical`; `category` picks the Zulip topic "
        "([remediator-config.md](remediator-config.md), `zulip.topics`). The summary is the "
        "annotation's template as Alertmanager fills it. Thresholds, why each is what it is and "
        "how to change one: [rules/README.md](../rules/README.md); which playbook heals which "
        "alert: [playbooks.md](playbooks.md).\n",
    ]
    for title, rows in alert_rows:
        out.append(f"## {title}\n")
        columns = ("alert", "cause", "severity", "category", "for", "summary", "runbook")
        out.extend(_table(columns, rows))
        out.append("")
    out.append("## Recording rules\n")
    out.append(
        "The series the alerts and the dashboard read; their output labels are a contract "
        "(the baselines keep exactly `host, server, role, model`).\n"
    )
    out.extend(_table(("series", "group", "file"), records))
    out.append("")
    return "\n".join(out)


# --- actions.md -----------------------------------------------------------------------------


def _type_name(annotation: Any) -> str:
    """A field's type as a reader writes it: `float`, `str | None`, `"GET" | "POST"`."""
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin is typing.Annotated:
        return _type_name(args[0])
    if origin is typing.Literal:
        return " \\| ".join(f"`{value!r}`".replace("'", '"') for value in args)
    if origin in (typing.Union, types.UnionType):
        return " \\| ".join(_type_name(arg) for arg in args)
    if origin is not None:
        name = getattr(origin, "__name__", str(origin))
        return f"{name}[{', '.join(_type_name(arg) for arg in args)}]"
    if annotation is type(None):
        return "None"
    if isinstance(annotation, type):
        return annotation.__name__
    return str(annotation).replace("typing.", "")


_BOUNDS: tuple[tuple[type[Any], str, str], ...] = (
    (annotated_types.Gt, "gt", ">"),
    (annotated_types.Ge, "ge", "≥"),
    (annotated_types.Lt, "lt", "<"),
    (annotated_types.Le, "le", "≤"),
    (annotated_types.MinLen, "min_length", "length ≥"),
    (annotated_types.MaxLen, "max_length", "length ≤"),
)


def _bounds(field: FieldInfo) -> str:
    found: list[str] = []
    for item in field.metadata:
        for kind, attribute, sign in _BOUNDS:
            if isinstance(item, kind):
                found.append(f"{sign} {getattr(item, attribute)}")
    return ", ".join(found)


def _value(value: Any) -> str:
    """A default as YAML writes it (a playbook is YAML): `"GET"`, `30.0`, `[200, 201]`, `null`."""
    try:
        return f"`{json.dumps(value)}`"
    except TypeError:
        return f"`{value!r}`"


def _default(field: FieldInfo) -> str:
    if field.is_required() or (field.default is PydanticUndefined and not field.default_factory):
        return "required"
    if field.default_factory is not None:
        factory = typing.cast(Callable[[], Any], field.default_factory)
        return _value(factory())
    return _value(field.default)


def _paragraphs(text: str | None) -> list[str]:
    """A docstring's paragraphs, each on one line."""
    return [" ".join(p.split()) for p in inspect.cleandoc(text or "").split("\n\n") if p.strip()]


def _first_paragraph(text: str | None) -> str:
    return _cell((_paragraphs(text) or [""])[0])


def _params_table(model: type[BaseModel]) -> list[str]:
    fields = model.model_fields
    if not fields:
        return ["No params."]
    return _table(
        ("param", "type", "default", "bounds"),
        (
            f"| `{name}` | {_type_name(field.annotation)} | {_default(field)} "
            f"| {_bounds(field) or '—'} |"
            for name, field in fields.items()
        ),
    )


def actions_page() -> str:
    """docs/actions.md: every registered action, its params, what it may touch, its undo."""
    import remediator.actions  # noqa: F401, PLC0415  (registers the built-in actions)
    from remediator.actions.registry import registered  # noqa: PLC0415

    # The product's actions only: a test process registers actions of its own beside them.
    actions = sorted(
        (a for a in registered().values() if a.fn.__module__.startswith("remediator.")),
        key=lambda a: a.name,
    )
    out = [
        _banner("the action registry (remediator/actions/)"),
        "# Actions\n",
        "What a playbook step can do ([playbooks.md](playbooks.md)). A step names an action "
        "and gives its params; they are validated when the playbooks load, so an unknown key "
        "or a value out of bounds stops the start. String params may be templates "
        "(`{server.url}`), filled from the roster, never from the alert.\n",
        "- **read-only**: observes and changes nothing; may be a verification probe. Under "
        "`dry_run` no step runs, read-only ones included.",
        "- **disruptive**: touches its target (restart, drain, cap, kill) and spends the "
        "target's disruption budget (cooldown and breaker).",
        "- **acts**: changes something but touches no target (calls people): it does not run "
        "under `dry_run` and spends no budget.",
        "- **clears its alert**: its success removes what the alert measures, not the whole "
        "fault (a port ghost killed; the unit still has to start): after it the run no longer "
        "asks whether the alert still fires, it finishes its steps and verification judges.\n",
    ]
    rows = (
        f"| [`{a.name}`](#{a.name}) "
        f"| {'read-only' if a.read_only else 'disruptive' if a.disruptive else 'acts'}"
        f"{', clears its alert' if a.clears_alert else ''} "
        f"| {a.default_timeout_seconds:g} s | {_cell(a.undo) or '—'} "
        f"| {_first_paragraph(a.fn.__doc__)} |"
        for a in actions
    )
    out.extend(_table(("action", "kind", "default time limit", "undo", "what it does"), rows))
    out.append("")
    for registered_action in actions:
        out.append(f"## {registered_action.name}\n")
        # The whole docstring: the first paragraph says what it does, the rest how.
        out.extend(p + "\n" for p in _paragraphs(registered_action.fn.__doc__))
        out.extend(_params_table(registered_action.params_model))
        out.append("")
    return "\n".join(out)


# --- the command ----------------------------------------------------------------------------

PAGES: Mapping[str, Callable[[], str]] = {
    "metrics.md": metrics_page,
    "alerts.md": alerts_page,
    "actions.md": actions_page,
}


def stale_pages(docs: Path = DOCS) -> list[str]:
    """The generated pages whose file differs from what the code gives now."""
    return [
        name
        for name, make in PAGES.items()
        if not (docs / name).is_file() or (docs / name).read_text(encoding="utf-8") != make()
    ]


def main(argv: list[str] | None = None) -> int:
    """Write the generated pages (or, with `--check`, say which are stale)."""
    parser = argparse.ArgumentParser(prog="python -m docs.generate", description=__doc__)
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 if stale")
    args = parser.parse_args(argv)
    if args.check:
        stale = stale_pages()
        for name in stale:
            print(f"docs/{name} is stale: run `make docs`", file=sys.stderr)
        return 1 if stale else 0
    for name, make in PAGES.items():
        (DOCS / name).write_text(make(), encoding="utf-8")
        print(f"wrote docs/{name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
