"""`gpu-fleet-remediator`: not built yet.

The remediator (webhook, journal, playbooks, Zulip reports) is planned work. Until it exists
the command says so and fails, so that nobody mistakes an installed script for a working one.
"""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    """Say that the remediator is not built yet and exit non-zero."""
    del argv
    print(
        "gpu-fleet-remediator: not built yet — the remediator is planned work; nothing was started",
        file=sys.stderr,
    )
    return 2


if __name__ == "__main__":
    sys.exit(main())
