"""`gpu-fleet-node`: not built yet.

The node helper (port guard for `ExecStartPre`, allow-listed actions behind an SSH forced
command) is planned work. Until it exists the command says so and fails, so that nobody wires
an `ExecStartPre=` or an `authorized_keys` entry to a script that does nothing.
"""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    """Say that the node helper is not built yet and exit non-zero."""
    del argv
    print(
        "gpu-fleet-node: not built yet — guard-port and the allow-listed actions are planned "
        "work; nothing was done",
        file=sys.stderr,
    )
    return 2


if __name__ == "__main__":
    sys.exit(main())
