"""A unit's recent journal lines, from `journalctl` as found on PATH.

`journalctl -u UNIT -n N --no-pager -o short-iso` (journalctl(1)): one entry a line, an ISO 8601
timestamp, the host, the identifier and pid, the message. Run as found on PATH, like
`systemctl`, so that operators and tests can interpose their own; an argv list, never a shell.

Manual check: `journalctl -u llama-server@alpha.service -n 50 --no-pager -o short-iso`.
"""

from __future__ import annotations

from exporter.sources.systemd import run_tool

JOURNALCTL = "journalctl"
MAX_LINE_CHARS = 2000  # a log line can be a whole prompt; evidence keeps the start of it


class JournalError(Exception):
    """journalctl could not be run, or failed."""


def unit_journal(
    unit: str, *, lines: int = 50, journalctl: str = JOURNALCTL, timeout: float = 10.0
) -> list[str]:
    """The last `lines` journal lines of `unit`, each cut to `MAX_LINE_CHARS`.

    `unit` must already have been checked against the roster. Raises `JournalError`.
    """
    command = [journalctl, "-u", unit, "-n", str(lines), "--no-pager", "-o", "short-iso"]
    done = run_tool(command, timeout=timeout, what=journalctl, error=JournalError)
    if done.returncode != 0:
        stderr = done.stderr.decode("utf-8", "replace").strip()[:MAX_LINE_CHARS]
        raise JournalError(f"{journalctl} exited {done.returncode}: {stderr}")
    text = done.stdout.decode("utf-8", "replace")
    return [line[:MAX_LINE_CHARS] for line in text.splitlines()[-lines:]]
