"""Outbox: finished sends and receives waiting for vLLM's next get_finished() (any thread puts)."""

from __future__ import annotations

import threading


class Outbox:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._sent: set[str] = set()
        self._received: set[str] = set()
        self._failed: dict[str, list[int]] = {}
        self._progress = threading.Event()  # set whenever something is put

    def sent(self, req_id: str) -> None:
        """P: vLLM may free this request's blocks."""
        with self._lock:
            self._sent.add(req_id)
            self._progress.set()

    def received(self, req_id: str, failed_blocks: list[int] | None = None) -> None:
        """D: this load ended; ``failed_blocks`` (its destination blocks) when it failed."""
        with self._lock:
            if failed_blocks is not None:
                self._failed[req_id] = failed_blocks
            self._received.add(req_id)
            self._progress.set()

    def take(self) -> tuple[set[str], set[str], dict[str, list[int]]]:
        """(finished_sending, finished_recving incl. failed, failed -> their dst blocks); empties it."""
        with self._lock:
            sent, self._sent = self._sent, set()
            received, self._received = self._received, set()
            failed, self._failed = self._failed, {}
        return sent, received, failed

    def wait(self, timeout: float) -> None:
        """Block up to ``timeout`` s, less if something is (or gets) put meanwhile."""
        with self._lock:
            if self._sent or self._received:
                return
            self._progress.clear()
        self._progress.wait(timeout)
