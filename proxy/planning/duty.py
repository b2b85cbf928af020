"""How much of a decoder's recent time went to prefilling requests itself: :class:`PrefillDuty`.

A local prefill stalls every stream D is decoding for as long as it runs. One prefill now and then
costs the streams a one-off gap; prefills arriving back to back (a closed loop, a burst of prompts)
leave D's streams only the time between them, so their inter-token latency grows as
``step / (1 - duty)``, where ``duty`` is the share of D's time spent prefilling. The Router (and the
planner's simulator, with its own clock) records the predicted time of each prefill it sends to a
decoder here; :meth:`PrefillDuty.recent_ms` is that time decayed exponentially with the age of each
prefill (time constant :data:`DUTY_WINDOW_MS`), so ``recent_ms / DUTY_WINDOW_MS`` is the share of the
last window or so that D spent prefilling. O(1) per call.
"""

from __future__ import annotations

import math

#: Time constant (ms) of the decay: a prefill this old counts 1/e of its time.
DUTY_WINDOW_MS = 2000.0


class PrefillDuty:
    """An exponentially decayed sum of one decoder's recent local prefill time (ms)."""

    __slots__ = ("_ms", "_at")

    def __init__(self) -> None:
        self._ms = 0.0
        self._at = 0.0

    def recent_ms(self, now_ms: float) -> float:
        """The decayed prefill time at ``now_ms`` (the caller's clock, in ms)."""
        if self._ms <= 0.0:
            return 0.0
        age = max(0.0, now_ms - self._at)
        return self._ms * math.exp(-age / DUTY_WINDOW_MS)

    def add(self, now_ms: float, prefill_ms: float) -> None:
        """A prefill of ``prefill_ms`` (predicted) was sent to the decoder at ``now_ms``."""
        self._ms = self.recent_ms(now_ms) + max(0.0, prefill_ms)
        self._at = now_ms
