"""Is a prefiller that keeps a request waiting still alive? :class:`PrefillWatch`.

On the first-token path the Router waits for P's answer itself (no D is there to notice, through
the connector's heartbeats, that P went silent). A long prefill is normal; a frozen P (stopped,
hung host) is not, and vLLM's ``GET /health``, served by its API server while the engine
computes, tells the two apart. While a P request waits longer than :data:`WATCH_AFTER_S`, the
Router asks the watch every :data:`WATCH_AFTER_S`; the watch probes P's ``/health`` (one probe
per backend at a time, its result shared for :data:`FRESH_S` by every request waiting on that
P, so many waiting requests cost one probe a second).
"""

from __future__ import annotations

import asyncio
import time

from proxy.upstream.calls import probe
from proxy.upstream.http1 import Http1Pool
from proxy.upstream.pool import BackendState

#: Seconds a P request waits before (and between) liveness checks of its prefiller.
WATCH_AFTER_S = 1.0
#: Seconds a probe's result stays valid for other requests waiting on the same prefiller.
FRESH_S = 1.0


class PrefillWatch:
    """Shared, rate-limited ``/health`` probes of the prefillers requests are waiting on."""

    def __init__(self, http: Http1Pool, timeout: float) -> None:
        self.http = http
        self.timeout = timeout
        self._last: dict[BackendState, tuple[float, bool]] = {}
        self._running: dict[BackendState, asyncio.Task[bool]] = {}

    async def alive(self, state: BackendState) -> bool:
        """Whether ``state``'s backend answered ``/health`` (now, or within :data:`FRESH_S`)."""
        last = self._last.get(state)
        if last is not None and time.monotonic() - last[0] < FRESH_S:
            return last[1]
        task = self._running.get(state)
        if task is None:
            task = asyncio.get_running_loop().create_task(self._probe(state))
            self._running[state] = task
        return await asyncio.shield(task)  # a waiter that is cancelled leaves the probe to the others

    async def _probe(self, state: BackendState) -> bool:
        try:
            healthy, _status, _error = await probe(self.http, state, self.timeout)
        finally:
            self._running.pop(state, None)
        self._last[state] = (time.monotonic(), healthy)
        return healthy
