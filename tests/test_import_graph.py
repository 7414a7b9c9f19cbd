"""The import graph points one way: `fleet` below both sides, targets below actions and playbooks.

What both sides share (the roster, its YAML loader, GPU numbering, the bounded HTTP front and
its web config) is the package `fleet`; the host side (`exporter`) and the central side
(`remediator`) each import it and never each other, so neither can grow a dependency on the
other unnoticed. Inside the remediator, playbooks name actions, so actions know nothing of
playbooks; what both need (a target, its template filling) is `remediator.targets`, below both.

Every import statement counts, at any depth (inside a function, under `TYPE_CHECKING`): a lazy
import is still a dependency. The modules are read as source (`ast`), so a module that is never
imported by the tests is checked too.
"""

from __future__ import annotations

import ast
import importlib
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PACKAGES = ("fleet", "exporter", "remediator")

# (importer prefix, imported prefix, why it is forbidden)
FORBIDDEN = (
    ("fleet", "exporter", "fleet is below both sides"),
    ("fleet", "remediator", "fleet is below both sides"),
    ("remediator", "exporter", "the central side does not depend on the host agent"),
    ("exporter", "remediator", "the host side does not depend on the central service"),
    ("remediator.actions", "remediator.playbooks", "actions sit below playbooks"),
    ("remediator.targets", "remediator.playbooks", "targets sit below playbooks"),
    ("remediator.targets", "remediator.actions", "targets sit below actions"),
)


def module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports_of(path: Path) -> set[str]:
    """Every module `path` imports, by absolute name (the packages use no relative imports)."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"{path}:{node.lineno}: a relative import"
            base = node.module or ""
            found.add(base)
            # `from remediator import playbooks` imports the submodule.
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return found


def modules() -> dict[str, set[str]]:
    return {
        module_name(path): imports_of(path)
        for package in PACKAGES
        for path in sorted((REPO / package).rglob("*.py"))
    }


def under(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def violations(graph: dict[str, set[str]]) -> list[str]:
    return sorted(
        f"{importer} imports {imported}: {why}"
        for importer, imported_set in graph.items()
        for imported in imported_set
        for src, dst, why in FORBIDDEN
        if under(importer, src) and under(imported, dst)
    )


def test_no_import_points_the_wrong_way() -> None:
    assert violations(modules()) == []


def test_the_scanner_sees_imports_at_every_depth() -> None:
    # The check above cannot pass merely because the scanner sees nothing: it finds the
    # remediator's use of the shared roster, a lazy import inside a function, and the
    # exporter's own imports of its sources.
    graph = modules()
    assert "fleet.roster" in graph["remediator.cli"]
    assert "fleet.webconfig" in graph["remediator.config"]  # imported inside a function
    assert "exporter.sources.pci" in graph["exporter.registry"]
    assert "remediator.targets" in graph["remediator.actions.registry"]
    # And the rules bite: an edge of each forbidden kind is reported.
    fake = {
        "fleet.roster": {"exporter.sources.sysfs"},
        "remediator.cli": {"exporter.roster"},
        "exporter.cli": {"remediator"},
        "remediator.actions.registry": {"remediator.playbooks.model"},
        "remediator.targets": {"remediator.actions.registry"},
    }
    assert len(violations(fake)) == 5


@pytest.mark.parametrize(
    "name",
    sorted(module_name(path) for package in PACKAGES for path in (REPO / package).rglob("*.py")),
)
def test_every_module_imports(name: str) -> None:
    importlib.import_module(name)


def test_every_console_script_resolves() -> None:
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    assert {"gpu-fleet-exporter", "gpu-fleet-node", "gpu-fleet-remediator"} <= set(scripts)
    for script, target in scripts.items():
        module, _, attribute = target.partition(":")
        assert callable(getattr(importlib.import_module(module), attribute)), script


def test_the_shared_package_is_installed_with_the_others() -> None:
    # A package left out of the distribution imports here (the repository is on the path) and
    # fails on a host: the build's package list must name it.
    config = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert "fleet*" in config["packages"]["find"]["include"]
    assert "py.typed" in config["package-data"]["fleet"]
