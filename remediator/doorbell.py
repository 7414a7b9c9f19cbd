"""The workers' doorbell: a ring wakes one sleeping worker, not all of them.

The engine's workers sleep until a run may be due. With a plain `threading.Event`, every
ring woke every worker, and each then took the journal's one writer to try a claim: for one
admitted run, four write transactions, three of them finding nothing, all queued in front of
the next webhook's admission (which waits for the same writer; issue 12's benchmark). A ring
here wakes one worker; a worker whose claim saw a second run due rings again before it acts
(the engine does), so that run finds a second worker, and the chain stops with the last run
due. Rings are counted, never lost: a ring while every worker is busy is
taken by the next worker to look (up to one per worker: a worker that is free looks again
by itself, so more rings would only be claims that find nothing). `ring_all` is for stopping.
"""

from __future__ import annotations

import threading


class Doorbell:
    """Wake one waiting worker per ring; rings made while nobody waits are kept."""

    def __init__(self, limit: int) -> None:
        """`limit`: the most rings kept while nobody waits (the number of workers)."""
        self._cond = threading.Condition(threading.Lock())
        self._limit = limit
        self._rings = 0
        self._all = False

    def ring(self) -> None:
        """A run may be due: one worker looks (now, or as soon as one is free)."""
        with self._cond:
            self._rings = min(self._limit, self._rings + 1)
            self._cond.notify()

    def ring_all(self) -> None:
        """Every worker looks now and from then on does not sleep (the engine stops)."""
        with self._cond:
            self._all = True
            self._cond.notify_all()

    def wait(self, timeout: float) -> bool:
        """Sleep until rung or `timeout` seconds passed; True when rung (the ring is taken)."""
        with self._cond:
            rung = self._cond.wait_for(lambda: self._rings > 0 or self._all, timeout)
            if rung and not self._all:
                self._rings -= 1
            return rung
