"""How long an idle engine step (nothing scheduled) waits in the worker for transfer progress.

vLLM keeps stepping an engine while it holds a finished request's blocks (delay free: P's
`request_finished` returned True) and until the connector reports the request in
`finished_sending`; a step with nothing scheduled still runs the worker's connector hooks, and
vLLM itself sleeps 1 ms between such steps. Waiting in the worker (`IDLE_WAIT_S`, ended at once by
a finished transfer) keeps those steps few, but a request that reaches the engine meanwhile waits
for the step to end: on P, under back-to-back traffic (the next request follows the previous
first token within milliseconds, while P still holds the previous room for D), that wait sat in
every request's TTFT. So P does not wait while it has been busy within
`BUSY_WINDOW_S` (its engine loops at vLLM's own 1 ms pace then, and a finished push reaches the
scheduler with the next step); an idle P, or D (whose new requests are not on the first-token
path), waits as before.
"""

from __future__ import annotations

import time
from collections.abc import Callable

# Longest pause of an idle engine step (nothing scheduled, transfers pending); a finished
# transfer ends the pause at once.
IDLE_WAIT_S = 0.005
# P: no pause within this long of the last step that scheduled tokens (vLLM's own workers spin
# for 1 s after their last message for the same reason: the next request is likely close).
BUSY_WINDOW_S = 1.0


class IdleWait:
    """Per worker: `seconds(idle)` is how long this step waits for transfer progress (0: none)."""

    def __init__(
        self,
        no_wait_when_busy: bool,
        wait_s: float = IDLE_WAIT_S,
        busy_window_s: float = BUSY_WINDOW_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.no_wait_when_busy = no_wait_when_busy
        self.wait_s = wait_s
        self.busy_window_s = busy_window_s
        self._clock = clock
        self._last_busy = -float("inf")

    def seconds(self, idle: bool) -> float:
        now = self._clock()
        if not idle:
            self._last_busy = now
            return 0.0
        if self.no_wait_when_busy and now - self._last_busy < self.busy_window_s:
            return 0.0
        return self.wait_s
