"""The one bounded way to read model servers: lanes, whole-call deadlines, fixed workers.

Used by the llama-server collector, the vLLM collector and the canary, so that a trickling,
hung or SIGSTOPped server costs its own series only:

- A *lane* is one (server, endpoint) pair (the router's per-model reads are lanes of their
  own). A lane has at most one call in flight: a scrape that finds its lane still busy does not
  queue a second call behind the first, it reports the endpoint as busy at once.
- `/health` is a lane of its own, so it is never queued behind `/metrics` or `/slots`.
- Every call is bounded as a whole (connect + headers + body) by `http_client.call`'s
  watchdog; a lane is therefore busy for at most its timeout.
- The timeout bounds the wait too: `wait` returns by the request's timeout from `start`, and the
  call is cut `MARGIN_SECONDS` sooner (an absolute deadline, so a worker that starts late on a
  loaded CPU does not push it back), so that it can report its own timeout first. A scrape
  waits no longer than its servers' timeouts.
- The workers are a fixed pool (`max_workers`). When all are taken a new call is refused as
  busy rather than queued: the number of threads never grows with the number of hung calls.

Check by hand: `gpu-fleet-exporter --once` against a roster with a server that is stopped with
`kill -STOP PID`: its endpoints read `busy`, its neighbours `ok`, in one timeout.
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass, replace

from exporter.sources.http_client import MAX_BODY_BYTES, Answer, Outcome, Watchdog, call

# Between a call's own cut and its waiter's deadline, so that a call that times out reports
# it itself (with its detail) rather than being read as "still running". Taken out of the
# request's timeout, not added to it: the wait ends at the timeout.
MARGIN_SECONDS = 0.05
BUSY_DETAIL = "the previous call is still in flight"


@dataclass(frozen=True)
class Request:
    """One HTTP call to make: `timeout` bounds it as a whole, the wait for its answer included."""

    url: str
    timeout: float
    method: str = "GET"
    body: bytes | None = None
    headers: tuple[tuple[str, str], ...] = ()
    # What the endpoint really sends, with room: a bigger answer is an error, not read on.
    max_bytes: int = MAX_BODY_BYTES


class Pending:
    """A call started on a lane (or refused because the lane or the workers were busy)."""

    def __init__(self, future: concurrent.futures.Future[Answer] | None, deadline: float) -> None:
        self._future = future
        self.deadline = deadline

    @property
    def done(self) -> bool:
        """True once the answer is known (a refused call is known at once: busy)."""
        return self._future is None or self._future.done()

    def answer(self) -> Answer:
        """The answer, or a TIMEOUT answer while the call is still running or was refused."""
        if self._future is None:
            return Answer(Outcome.TIMEOUT, detail=BUSY_DETAIL)
        if not self._future.done():
            return Answer(Outcome.TIMEOUT, detail="still running at the deadline")
        return self._future.result()


class Lanes:
    """Calls by lane, one in flight per lane, on at most `max_workers` threads."""

    def __init__(
        self,
        max_workers: int,
        *,
        name: str = "read",
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.clock = clock
        self.watchdog = Watchdog(clock)
        self._max = max(1, max_workers)
        self._pool = concurrent.futures.ThreadPoolExecutor(self._max, thread_name_prefix=name)
        self._lock = threading.Lock()
        self._inflight: dict[Hashable, concurrent.futures.Future[Answer]] = {}

    def start(self, lane: Hashable, request: Request) -> Pending:
        """Start `request` on `lane`, unless a call of that lane (or every worker) is busy."""
        deadline = self.clock() + request.timeout
        cut = deadline - min(MARGIN_SECONDS, request.timeout / 4)
        with self._lock:
            previous = self._inflight.get(lane)
            if previous is not None and not previous.done():
                return Pending(None, deadline)
            running = sum(1 for f in self._inflight.values() if not f.done())
            if running >= self._max:
                return Pending(None, deadline)  # would queue behind calls of other lanes
            # Lanes whose call ended are forgotten, so router models that come and go do not
            # grow the map.
            self._inflight = {k: f for k, f in self._inflight.items() if not f.done()}
            future = self._pool.submit(self._call_by, request, cut)
            self._inflight[lane] = future
        return Pending(future, deadline)

    def call(self, request: Request) -> Answer:
        """Make `request` on the calling thread, bounded as a whole (the canary's way)."""
        return call(
            request.url,
            timeout=request.timeout,
            watchdog=self.watchdog,
            method=request.method,
            body=request.body,
            headers=dict(request.headers),
            max_bytes=request.max_bytes,
        )

    def _call_by(self, request: Request, cut: float) -> Answer:
        # The time left is counted from `start`, not from when a worker got to it.
        left = cut - self.clock()
        if left <= 0:
            return Answer(Outcome.TIMEOUT, detail="no worker started it before its deadline")
        return self.call(replace(request, timeout=left))

    def wait(self, pending: Iterable[Pending]) -> None:
        """Wait until every call is done or its deadline has passed."""
        for item in pending:
            remaining = item.deadline - self.clock()
            if item._future is not None and remaining > 0:
                concurrent.futures.wait([item._future], timeout=remaining)

    def close(self) -> None:
        """Stop the workers and the watchdog; calls in flight end at their socket timeout."""
        self._pool.shutdown(wait=False, cancel_futures=True)
        self.watchdog.close()
