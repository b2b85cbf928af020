"""Refusal log lines, rate-limited: a flood of bad calls must not write one WARNING per call.

``LogLimiter.warning(key, msg, *args)`` writes the line while ``key`` (what was refused and
from where, e.g. ``("token", "10.0.0.7")``; never attacker-chosen text, which would make the
keys unbounded) has written fewer than ``burst`` lines in its current ``interval_s`` window;
after that it only counts, and the first line of a later window ends with ``(K similar
line(s) suppressed before this one: at most B per N s)``. So a flood writes at most ``burst`` lines per key per
window, and the first few refusals of an incident are all in the log. The counters beside
these lines (``auth_refused``, ``bad_frames``, the bootstrap server's ``refused``,
``pd_router_auth_refused_total``) still count every refusal. Keys are bounded
(``max_keys``): past that, expired windows are forgotten (with any count they held back) and,
if the table is still full, new keys share one overflow key. Thread-safe. One limiter per
server or listener (bootstrap app, transfer channel, heartbeats, the Router's gate), so two of
them never hide each other's lines.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass

#: Default window, in seconds.
INTERVAL_S = 10.0
#: Default lines a key may write per window.
BURST = 10
#: Default bound on the keys remembered at once.
MAX_KEYS = 1024
_OVERFLOW = ("*", "overflow")


@dataclass
class _Window:
    start: float  # when this window began (its first line)
    written: int = 0  # lines written in it
    suppressed: int = 0  # lines held back in it


class LogLimiter:
    """At most ``burst`` log lines per key per ``interval_s``; the held-back ones are counted."""

    def __init__(
        self,
        logger: logging.Logger,
        interval_s: float = INTERVAL_S,
        burst: int = BURST,
        max_keys: int = MAX_KEYS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if interval_s < 0 or burst < 1 or max_keys < 1:
            raise ValueError(
                f"LogLimiter needs interval_s >= 0, burst >= 1, max_keys >= 1; got {interval_s}, {burst}, {max_keys}"
            )
        self._logger = logger
        self._interval = interval_s
        self._burst = burst
        self._max_keys = max_keys
        self._clock = clock
        self._lock = threading.Lock()
        self._windows: dict[Hashable, _Window] = {}

    def warning(self, key: Hashable, msg: str, *args: object) -> bool:
        """Log ``msg % args`` at WARNING unless ``key`` used up its window; True if written."""
        return self.log(logging.WARNING, key, msg, *args)

    def log(self, level: int, key: Hashable, msg: str, *args: object) -> bool:
        """Like :meth:`warning`, at ``level``."""
        now = self._clock()
        with self._lock:
            key = self._admit(key, now)
            window = self._windows.get(key)
            held_back = 0
            if window is None or now - window.start >= self._interval:
                held_back = window.suppressed if window is not None else 0
                window = self._windows[key] = _Window(now)
            if window.written >= self._burst:
                window.suppressed += 1
                return False
            window.written += 1
        if held_back:
            msg += " (%d similar line(s) suppressed before this one: at most %d per %g s)"
            args = (*args, held_back, self._burst, self._interval)
        self._logger.log(level, msg, *args)
        return True

    def _admit(self, key: Hashable, now: float) -> Hashable:
        """``key``, or the overflow key when the table is full of live windows (lock held)."""
        if key in self._windows or len(self._windows) < self._max_keys:
            return key
        for k in [k for k, w in self._windows.items() if now - w.start >= self._interval]:
            del self._windows[k]
        return key if len(self._windows) < self._max_keys else _OVERFLOW
