"""The Router's log handler: lines written once per event-loop turn, not once per line.

Every request logs a line (two with its phase trace); a ``StreamHandler`` writes and flushes
each one, a system call per line. :class:`LoopFlushingHandler` formats each record at once (as
any handler) but, on the event loop's thread, appends it to a buffer written with one call at
the end of the current loop turn (``call_soon``), so under load one write carries the lines
of many requests, and a line still reaches the stream within the turn it was logged in.
Records from other threads, or with no loop running, are written at once.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from typing import TextIO


class LoopFlushingHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """A ``StreamHandler`` whose writes on the event loop's thread are coalesced per loop turn."""

    def __init__(self, stream: TextIO) -> None:
        super().__init__(stream)
        self._pending: list[str] = []
        self._scheduled = False
        self._thread = threading.main_thread()

    def emit(self, record: logging.LogRecord) -> None:
        try:
            line = self.format(record) + self.terminator
        except Exception:  # noqa: BLE001 (logging's contract: report, never raise)
            self.handleError(record)
            return
        loop = None
        if threading.current_thread() is self._thread:
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:
                loop = None
        if loop is None or loop.is_closed():
            lines, self._pending = self._pending, []  # lines of a loop that stopped first, in order
            self._write("".join(lines) + line)
            return
        self._pending.append(line)
        if not self._scheduled:
            self._scheduled = True
            loop.call_soon(self._flush_pending)

    def _flush_pending(self) -> None:
        self._scheduled = False
        if self._pending:
            lines, self._pending = self._pending, []
            self._write("".join(lines))

    def _write(self, text: str) -> None:
        with self.lock:  # type: ignore[union-attr]
            self.stream.write(text)
            self.stream.flush()

    def flush(self) -> None:
        if self._pending:
            lines, self._pending = self._pending, []
            self._scheduled = False
            self._write("".join(lines))
        super().flush()

    def close(self) -> None:
        self.flush()
        super().close()
