"""P, ``transfer_mode: "layer"``: the threads that run layer writes, one queue per decode peer.

``layerwise.LayerStreams`` hands every layer write here with the peer it goes to (the D rank's
transfer descriptor). Each peer has a FIFO queue, and at most one thread serves a peer's queue at a
time, so the writes to one D rank run in the order they were queued (a reader's layers, a late
reader's backlog before its live layers). Different peers are served by different threads, at most
``max_workers`` of them: a D that stalls (frozen, its writes hanging until the transport's timeout)
holds only the thread serving it, and every other D's layers keep flowing. When every thread is busy,
a peer with work waits for the next free thread; a thread whose peer still has work while others
wait hands that peer back to the end of the line after each write (no peer is starved). A thread
with nothing to do for ``idle_s`` retires; a new one starts (and binds the rank's device through
``initializer``) when work comes.

Peer states (``PeerQueueState``, derived): IDLE (no queued write) -> WAITING (writes queued, no thread)
-> SERVED (a thread runs its writes) -> IDLE, or back to WAITING when it yields its thread.
"""

from __future__ import annotations

import enum
import logging
import threading
from collections import deque
from collections.abc import Callable, Hashable

logger = logging.getLogger(__name__)

#: Threads writing layers at most; each serves one decode peer at a time.
MAX_LAYER_WRITERS = 8
#: Seconds a writer thread with nothing to do waits for work before it retires.
WRITER_IDLE_S = 5.0

Job = Callable[[], None]


class PeerQueueState(enum.Enum):
    IDLE = "idle"  # nothing queued
    WAITING = "waiting"  # writes queued, no thread serves it yet
    SERVED = "served"  # a thread runs its writes, in order


class PeerWriters:
    """Per-peer FIFO queues of jobs served by a bounded, self-retiring set of threads."""

    def __init__(
        self,
        max_workers: int = MAX_LAYER_WRITERS,
        initializer: Callable[[], object] | None = None,
        name: str = "pd-layer-push",
        idle_s: float = WRITER_IDLE_S,
    ) -> None:
        if max_workers < 1:
            raise ValueError(f"layer writers: max_workers must be >= 1, got {max_workers}")
        self._max = max_workers
        self._init = initializer
        self._name = name
        self._idle_s = idle_s
        self._cond = threading.Condition()
        self._queues: dict[Hashable, deque[Job]] = {}
        self._waiting: deque[Hashable] = deque()  # peers with queued jobs and no thread, oldest first
        self._served: set[Hashable] = set()
        self._workers = 0
        self._idle = 0
        self._started = 0
        self._closed = False

    def submit(self, peer: Hashable, job: Job) -> None:
        """Queue ``job`` behind ``peer``'s earlier jobs; it runs on a writer thread. Dropped once closed."""
        with self._cond:
            if self._closed:
                logger.warning("layer writers are closed: dropping a write to %r", peer)
                return
            self._queues.setdefault(peer, deque()).append(job)
            if peer in self._served or peer in self._waiting:
                return
            self._waiting.append(peer)
            if self._idle > 0:
                self._cond.notify()
            if len(self._waiting) > self._idle and self._workers < self._max:
                # An idle thread each for the waiting peers, else a new one (a busy one may be stalled).
                self._workers += 1
                self._started += 1
                threading.Thread(target=self._run, name=f"{self._name}-{self._started}", daemon=True).start()

    def state(self, peer: Hashable) -> PeerQueueState:
        with self._cond:
            if peer in self._served:
                return PeerQueueState.SERVED
            return PeerQueueState.WAITING if peer in self._waiting else PeerQueueState.IDLE

    @property
    def workers(self) -> int:
        """Writer threads alive now."""
        with self._cond:
            return self._workers

    def close(self) -> None:
        """Stop taking jobs; queued ones are dropped, running ones finish; idle threads leave at once."""
        with self._cond:
            self._closed = True
            self._queues.clear()
            self._waiting.clear()
            self._cond.notify_all()

    # ----------------------------------------------------------------- threads

    def _run(self) -> None:
        if self._init is not None:
            try:
                self._init()
            except Exception:  # noqa: BLE001 - the queued writes still run (and fail, reported to D) rather than hang
                logger.exception("layer writer thread could not bind the rank's device")
        with self._cond:
            try:
                while self._next_peer():
                    self._serve(self._waiting.popleft())
            finally:  # counted out under the same lock that saw no work: submit never relies on a leaving thread
                self._workers -= 1

    def _next_peer(self) -> bool:
        """Wait (up to idle_s) until a peer waits for a thread; False: retire. Caller holds the lock."""
        while not self._waiting:
            if self._closed:
                return False
            self._idle += 1
            try:
                woken = self._cond.wait(self._idle_s)
            finally:
                self._idle -= 1
            if not woken and not self._waiting:
                return False
        return not self._closed

    def _serve(self, peer: Hashable) -> None:
        """Run ``peer``'s jobs in order until its queue is empty or another peer waits. Caller holds the lock."""
        self._served.add(peer)
        try:
            while True:
                queue = self._queues.get(peer)
                if not queue:
                    self._queues.pop(peer, None)
                    return
                job = queue.popleft()
                self._cond.release()
                try:
                    job()
                except Exception:  # noqa: BLE001 - a job reports its own failures; never lose the thread
                    logger.exception("layer write to %r raised", peer)
                finally:
                    self._cond.acquire()
                if self._waiting and self._queues.get(peer):
                    self._waiting.append(peer)  # others wait for a thread: take turns, order per peer kept
                    return
        finally:
            self._served.discard(peer)
