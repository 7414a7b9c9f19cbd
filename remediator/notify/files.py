"""Reports as Markdown files: the outbox's destination when no Zulip is configured.

`ReportFiles` answers the calls the outbox sender makes of Zulip (`limits`, `send_stream`,
`send_direct`, `upload`, `find`) by writing files under one directory, so reports keep every
promise of the outbox — in order per topic, once, nothing lost — on a machine without Zulip
(`make run`, a first try). Each report is one file, `NNNNNN-TOPIC.md` (direct messages
`NNNNNN-direct.md`), holding exactly the text Zulip would get; a picture is written beside it
and linked by its file name. A report is written to a temporary name and renamed, so a reader
never sees half of one, and `find` recognises one written before a crash by its marker line.

Check by hand: `ls .run/reports/ && cat .run/reports/*.md`.
"""

from __future__ import annotations

import os
import re
import threading
from collections.abc import Sequence
from pathlib import Path

from remediator.notify.zulip_api import ServerLimits, ZulipUnavailable

# The file system's limits, not Zulip's: a report is never cut, a topic only to a file name.
_MAX_MESSAGE_LENGTH = 1_000_000
_MAX_TOPIC_LENGTH = 60
_UNSAFE = re.compile(r"[^A-Za-z0-9._-]+")


class ReportFiles:
    """A directory that takes reports as the outbox sender sends them."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.rate_limit_reset: float | None = None  # never rate-limited
        self._lock = threading.Lock()

    def limits(self) -> ServerLimits:
        """No server: limits that never cut a report."""
        return ServerLimits(_MAX_MESSAGE_LENGTH, _MAX_TOPIC_LENGTH, feature_level=1000)

    def _next_id(self) -> int:
        numbers = [int(p.name[:6]) for p in self.directory.glob("[0-9]" * 6 + "-*")]
        return max(numbers, default=0) + 1

    def _write(self, label: str, content: str) -> int:
        with self._lock:
            try:
                self.directory.mkdir(parents=True, exist_ok=True)
                number = self._next_id()
                final = self.directory / f"{number:06d}-{_UNSAFE.sub('_', label)[:60]}.md"
                temporary = final.with_suffix(".tmp")
                temporary.write_text(content + "\n", encoding="utf-8")
                os.replace(temporary, final)
            except OSError as exc:
                # Like Zulip unreachable: the outbox keeps the report and tries again.
                raise ZulipUnavailable(
                    f"cannot write a report in {self.directory}: {exc}"
                ) from None
        return number

    def send_stream(self, stream: str, topic: str, content: str) -> int:
        """Write one report of `topic`; its number."""
        del stream
        return self._write(topic, content)

    def send_direct(self, recipients: Sequence[str], content: str) -> int:
        """Write one direct message; its number."""
        return self._write("direct", f"To: {', '.join(recipients)}\n\n{content}")

    def upload(self, name: str, data: bytes) -> str:
        """Write a picture beside the reports; the name the report links it by."""
        safe = _UNSAFE.sub("_", name)
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            (self.directory / safe).write_bytes(data)
        except OSError as exc:
            raise ZulipUnavailable(f"cannot write {safe} in {self.directory}: {exc}") from None
        return safe

    def find(
        self,
        marker: str,
        search: str,
        *,
        stream: str | None = None,
        topic: str | None = None,
        recipients: Sequence[str] | None = None,
    ) -> int | None:
        """The number of a report already written with `marker` (after a crash), or None."""
        del search, stream, topic, recipients
        for path in sorted(self.directory.glob("[0-9]" * 6 + "-*.md")):
            try:
                if marker in path.read_text(encoding="utf-8", errors="replace"):
                    return int(path.name[:6])
            except OSError:
                continue
        return None
