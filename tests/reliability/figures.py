"""The reliability suite's one table of figures, and its two sizes.

Every test of `tests/reliability/` adds what it counted to the session's `Figures` (the
`figures` fixture): cases run, answers by class, kills, and the figures that must stay 0 —
losses, duplicate actions, wrong actions. `conftest.py` prints the table at the end of the run
and fails the session when any must-be-zero figure is not, even if the test that counted it
forgot to assert.

Sizes: short (the default, inside `make test`: at most a few minutes on two cores) and full
(`GPUFLEET_RELIABILITY=full`, what `make reliability` runs and `docs/reliability.md` quotes).
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass, field

FULL = os.environ.get("GPUFLEET_RELIABILITY", "short") == "full"
SIZE = "full" if FULL else "short"


def sized(short: int, full: int) -> int:
    """`full` under `GPUFLEET_RELIABILITY=full`, else `short`."""
    return full if FULL else short


@dataclass
class Figures:
    """Counts by (suite, figure), in the order first counted; some must end at 0."""

    counts: dict[tuple[str, str], int] = field(default_factory=dict)
    must_be_zero: set[tuple[str, str]] = field(default_factory=set)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, suite: str, figure: str, n: int = 1) -> None:
        """Count `n` more of `figure`."""
        with self._lock:
            self.counts[(suite, figure)] = self.counts.get((suite, figure), 0) + n

    def zero(self, suite: str, figure: str, n: int = 0) -> None:
        """Count `n` of a figure that fails the run unless it is 0 (shown even when 0)."""
        with self._lock:
            self.must_be_zero.add((suite, figure))
            self.counts[(suite, figure)] = self.counts.get((suite, figure), 0) + n

    def failures(self) -> list[str]:
        """The must-be-zero figures that are not."""
        return [
            f"{s}: {f} = {self.counts[(s, f)]}"
            for s, f in sorted(self.must_be_zero)
            if self.counts[(s, f)] != 0
        ]

    def table(self) -> str:
        """The figures as one plain-text table (suite, figure, count, and `!` on a failure)."""
        if not self.counts:
            return ""
        width_suite = max(len(s) for s, _ in self.counts)
        width_figure = max(len(f) for _, f in self.counts)
        lines = [f"{'suite':<{width_suite}}  {'figure':<{width_figure}}  {'count':>9}"]
        lines.append("-" * len(lines[0]))
        # By suite (their names start with the number), each in the order counted.
        order = {key: index for index, key in enumerate(self.counts)}
        for (suite, figure), count in sorted(
            self.counts.items(), key=lambda item: (item[0][0], order[item[0]])
        ):
            flag = ""
            if (suite, figure) in self.must_be_zero:
                flag = "  must be 0" + ("  FAILED" if count else "")
            lines.append(f"{suite:<{width_suite}}  {figure:<{width_figure}}  {count:>9}{flag}")
        return "\n".join(lines)
