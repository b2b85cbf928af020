"""TaskPool: the transfer threads (backend writes on P, handshakes on D); no failure goes unlogged."""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

logger = logging.getLogger(__name__)


class TaskPool:
    def __init__(self, threads: int, initializer: Callable[[], object] | None = None) -> None:
        """``initializer`` runs once at each thread's start (the rank's device binding, ``device_sync``)."""
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="pd-xfer", initializer=initializer)

    def submit(self, fn: Callable[..., object], *args: object) -> None:
        """Run fn(*args) on the pool; an exception is logged, never silently dropped with its future."""
        name = getattr(fn, "__name__", repr(fn))

        def log_failure(future: Future) -> None:
            if future.cancelled():  # dropped at shutdown
                return
            exc = future.exception()
            if exc is not None:
                logger.error("%s%r failed: %r", name, args[:1], exc, exc_info=exc)

        try:
            self._pool.submit(fn, *args).add_done_callback(log_failure)
        except RuntimeError as exc:  # pool shut down
            logger.error("cannot run %s: %s", name, exc)

    def shutdown(self, wait: bool = False) -> None:
        """Stop taking work; queued tasks are dropped, running ones finish (``wait``: wait for them)."""
        self._pool.shutdown(wait=wait, cancel_futures=True)
