"""Errors the exporter keeps between reads must not grow: a stored exception raised again.

Raising the same exception object again adds the new raise's frames to its `__traceback__`,
and each of those frames keeps its locals alive. `UnitsReader` keeps systemctl's failure for
its max age and three collectors read it every scrape, so it raises a fresh error each time.
Found with tracemalloc while looking for the exporter benchmark's RSS creep
(bench/exporter_servers.py).
"""

from __future__ import annotations

from pathlib import Path
from types import TracebackType

import pytest

from exporter.sources.systemd import SystemdError, UnitsReader


def depth(traceback: TracebackType | None) -> int:
    count = 0
    while traceback is not None:
        count += 1
        traceback = traceback.tb_next
    return count


def test_a_kept_systemctl_failure_is_raised_anew_each_read(tmp_path: Path) -> None:
    missing = str(tmp_path / "no-systemctl")
    # The clock never moves: every read after the first answers from the kept failure.
    reader = UnitsReader(["llama-server@alpha.service"], systemctl=missing, clock=lambda: 1.0)
    raised = []
    for _ in range(50):
        with pytest.raises(SystemdError) as info:
            reader.statuses()
        raised.append(info.value)
    assert all("not found" in str(error) for error in raised)
    assert len({id(error) for error in raised}) == len(raised)
    depths = {depth(error.__traceback__) for error in raised}
    assert len(depths) == 1, depths  # the 50th traceback is as short as the first
