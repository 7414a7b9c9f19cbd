"""`gpu-fleet-node` runs under sudo: it must not load the exporter's HTTP/exposition stack.

Every module the root-run helper imports is code that runs as root on each remediation; the
web server, the exposition writer, the collectors and the remediator's web stack have no
business there. Each check imports the entry point in a fresh interpreter (this test process
has imported everything already) and lists what it loaded.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

# Top-level packages and modules the node must not load.
FORBIDDEN_PACKAGES = (
    "prometheus_client",
    "werkzeug",
    "flask",
    "waitress",
    "sqlalchemy",
    "psycopg",
    "zulip",
    "requests",
    "redis",
    "bcrypt",
    "remediator",
    "wsgiref",
)
FORBIDDEN_MODULES = (
    "exporter.http",
    "exporter.exposition",
    "fleet.http_front",
    "fleet.webconfig",
    "exporter.registry",
    "exporter.cli",
    "exporter.canary",
    "exporter.collectors",
    "http.server",
)

PROBE = """
import json, sys
import {module}
print(json.dumps(sorted(sys.modules)))
"""


def loaded_by(module: str) -> list[str]:
    """The forbidden modules that importing `module` in a fresh interpreter loads."""
    done = subprocess.run(
        [sys.executable, "-c", PROBE.format(module=module)],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    modules: list[str] = json.loads(done.stdout)
    return [
        name
        for name in modules
        if name.split(".")[0] in FORBIDDEN_PACKAGES
        or any(name == bad or name.startswith(bad + ".") for bad in FORBIDDEN_MODULES)
    ]


@pytest.mark.parametrize("module", ["exporter.node", "exporter.node.cli"])
def test_the_node_entry_point_loads_no_http_or_exposition_stack(module: str) -> None:
    assert loaded_by(module) == []


def test_the_probe_sees_the_exporter_stack_where_it_is() -> None:
    # The same probe on the exporter's entry point finds what the node must not have: the
    # check above cannot pass merely because the probe sees nothing.
    found = loaded_by("exporter.cli")
    assert "prometheus_client" in found and "exporter.http" in found
    assert "exporter.exposition" in found and "fleet.webconfig" in found
    assert "fleet.http_front" in found
