"""Draining an instance at run time: ``POST /instances/drain`` (:class:`Drains`).

A drained instance leaves routing at once (as ``/instances/remove``: it gets no new request) and
the call returns once the instance holds nothing, or its time limit passed:

- **a decoder**: each of its resumable streams (:func:`proxy.strategies.resume_body.resumable`: a streamed
  completions request whose continuation samples what one instance would) is *moved*: its D stream
  is closed (vLLM aborts the request) and :func:`proxy.strategies.resume.resume_stream` goes on on another
  decoder with the tokens the client has. A decoder *movable by KV* (its bootstrap port known:
  ``--decoder-bootstrap-ports``) holds the aborted request's KV as the request's migrate room, and
  the other decoder loads it from there (``mode="kv"``, :mod:`proxy.strategies.kv_move`: nothing prefilled
  again); otherwise, or when that leg fails before its first chunk, P prefills the prompt plus the
  generated tokens again (``mode="replay"``). ``pd_router_drain_moves_total{mode}`` counts them
  (``failed``: cut, but no decoder took the stream over). Requests that cannot move (non-streamed,
  chat, sampling the first-token path refuses) finish where they are. Once the Router has nothing in
  flight there and every cut stream went on, D's ``/metrics`` is read until it reports no request
  running or waiting and no KV held for a move (``vllm:pd_kv_rooms_held``); ``kv_bytes_moved`` is
  the increase of its ``vllm:pd_kv_sent_bytes_total`` over the drain.
- **a prefiller**: no new room goes to it; its prefills in flight finish; then its ``/metrics`` is
  read until ``vllm:pd_kv_rooms_held`` is 0: every room's KV was pushed (or expired).

``pd_router_drains_total{role,outcome}``, ``pd_router_drain_seconds{role}``; each moved stream is
also a ``pd_router_resumes_total{reason="drain"}`` and carries a ``drain`` mark in its phase trace.

Rebalancing (``--rebalance on``, :mod:`proxy.admin.rebalance`) moves single streams of a decoder that
stays in the pool by the same cut (:meth:`Drains.rebalance_move`, cause :attr:`MoveCause.REBALANCE`): its
KV leg goes to the decoder the policy chose (:meth:`Drains.planned_target`), its phase trace gets a
``rebalance`` mark, and it is counted by the rebalancer, not as a drain's move.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time
import weakref
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from prometheus_client import Counter, Histogram

from proxy.admin.held import HELD_METRICS as HELD_METRICS  # re-exported: launch.drain, tests
from proxy.admin.held import held_counts as held_counts
from proxy.admin.held import sent_bytes, wait_empty
from proxy.admin.rebalance import Rebalancer
from proxy.errors import DECODE_FAILED, RouterError
from proxy.strategies.resume_body import StreamTracker, resume_call
from proxy.upstream.calls import Failure, FailureKind
from proxy.upstream.pool import BackendState

if TYPE_CHECKING:
    from proxy.request.context import RequestContext
    from proxy.router_state import Router

logger = logging.getLogger("proxy")

#: Default bound of one drain (``timeout_s`` in the call's body).
DEFAULT_DRAIN_TIMEOUT_S = 300.0
POLL_S = 0.05
DRAIN_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)


class MoveMode(enum.Enum):
    """How a drained decoder's stream went on elsewhere."""

    KV = "kv"  # another decoder loaded the stream's KV from the drained one (proxy.strategies.kv_move)
    REPLAY = "replay"  # P prefilled prompt + generated tokens again (the decoder's KV was dropped)
    FAILED = "failed"  # cut, but no decoder took the stream over (the client got an error event)


class MoveCause(enum.Enum):
    """Why a stream was cut to move to another decoder."""

    DRAIN = "drain"  # its decoder drains (POST /instances/drain, a role change)
    REBALANCE = "rebalance"  # its decoder is overloaded and another has room (proxy.admin.rebalance)


class LegState(enum.Enum):
    """Where a tracked stream's leg stands, as a drain sees it."""

    STREAMING = "streaming"  # D's stream is open and relayed: it can be moved
    CUT = "cut"  # its stream was cut already (by a drain, or P's failure) and the relay resumes it
    CUT_BY_DRAIN = "cut_by_drain"  # cut by a drain already; the relay resumes it
    ENDED = "ended"  # the leg ended cleanly (its answer is complete)
    CLOSED = "closed"  # the leg is over otherwise (failed, closed, or not yet streaming)


class DrainableLeg(Protocol):
    """The one leg of a relayed stream that a drain may cut (the request's attempt, seen narrowly)."""

    def leg_state(self) -> LegState:
        """Where the leg stands."""
        ...

    def cut_for_drain(self, failure: Failure) -> None:
        """Close D's open stream with ``failure``: the relay reads what was buffered, then resumes it."""
        ...


class DrainOutcome(enum.Enum):
    DRAINED = "drained"  # the instance holds nothing
    TIMEOUT = "timeout"  # the time limit passed first
    UNKNOWN = "unknown"  # the instance was not in the pool


@dataclass(slots=True)
class DrainReport:
    """One drain's result (the call's ``results`` entries)."""

    role: str
    host: str
    port: int
    outcome: DrainOutcome = DrainOutcome.DRAINED
    seconds: float = 0.0
    #: Streams moved to another decoder, by :class:`MoveMode` value.
    moved: dict[str, int] = field(default_factory=dict)
    #: Requests left to finish where they were (not movable).
    waited: int = 0
    #: KV bytes the drained decoder pushed to others over the drain (its ``vllm:pd_kv_sent_bytes_total``).
    kv_bytes_moved: int = 0
    #: What the instance's ``/metrics`` reported last (None: not read or not answered).
    held: dict[str, float] | None = None

    def record(self) -> dict[str, Any]:
        return {
            "role": self.role,
            "host": self.host,
            "port": self.port,
            "result": self.outcome.value,
            "seconds": round(self.seconds, 3),
            "moved": self.moved,
            "waited": self.waited,
            "kv_bytes_moved": self.kv_bytes_moved,
            "held": self.held,
        }


@dataclass(slots=True)
class TrackedStream:
    """One tracked stream on a decoder: its request, its leg, the room it runs with, and the room the
    decoder keeps its KV as if it is cut (None: it is replayed)."""

    request: weakref.ref[RequestContext]
    leg: DrainableLeg
    rid: str
    room: int
    kv_room: int | None

    def rebalance_may_move(self, by_replay: bool) -> bool:
        """Whether a rebalance may move it: by its KV, or, ``by_replay`` (``--rebalance-by-replay``), by
        replay when it has no KV to move (a replay prefills it all again on P)."""
        return self.kv_room is not None or by_replay


@dataclass(slots=True)
class _Cut:
    """A stream cut to move, whose next leg has not opened (or failed) yet."""

    leg: DrainableLeg
    cause: MoveCause
    request: weakref.ref[RequestContext]
    #: The decoder the move is meant for (a rebalance's choice; None: routing picks).
    target: BackendState | None = None


class Drains:
    """The decoders' movable streams and the drains in progress (one per Router)."""

    def __init__(self, router: Router) -> None:
        self.router = router
        #: Per decoder: its streams relayed through a tracker (weakly held by the tracker).
        self._streams: dict[BackendState, weakref.WeakKeyDictionary[StreamTracker, TrackedStream]] = {}
        self._running: dict[tuple[str, str, int], asyncio.Task[DrainReport]] = {}
        #: Per draining decoder: its cut streams whose next leg has not opened (or failed) yet.
        self._pending: dict[BackendState, weakref.WeakKeyDictionary[StreamTracker, _Cut]] = {}
        #: Requests cut by a rebalance whose next leg has not opened: the decoder their KV leg goes to.
        self._targets: weakref.WeakKeyDictionary[RequestContext, BackendState] = weakref.WeakKeyDictionary()
        #: Requests a rebalance moved, until their next leg is tracked: (source decoder, how it moved).
        self._landing: weakref.WeakKeyDictionary[RequestContext, tuple[BackendState, MoveMode]] = (
            weakref.WeakKeyDictionary()
        )
        #: Per draining decoder: its streams moved so far, by :class:`MoveMode` value.
        self._tally: dict[BackendState, dict[str, int]] = {}
        reg = router.metrics.registry
        self.drains = Counter(
            "pd_router_drains",
            "Instances drained (POST /instances/drain), by outcome",
            ["role", "outcome"],
            registry=reg,
        )
        self.moves = Counter(
            "pd_router_drain_moves",
            "Streams moved off a draining decoder, by how (kv: with their KV; replay: P prefilled the tokens "
            "again; failed: not continued)",
            ["mode"],
            registry=reg,
        )
        self.seconds = Histogram(
            "pd_router_drain_seconds",
            "Seconds from a drain call to the instance holding nothing",
            ["role"],
            buckets=DRAIN_BUCKETS,
            registry=reg,
        )
        #: Moves streams off overloaded decoders (``--rebalance on``); None when off.
        self.rebalancer = Rebalancer(router, self) if router.config.rebalance.enabled else None

    # -- the relay's side ----------------------------------------------------------------------

    def track(
        self,
        request: RequestContext,
        d: BackendState,
        tracker: StreamTracker,
        leg: DrainableLeg,
        room: int,
        kv_room: int | None,
    ) -> None:
        """A leg of ``request`` on decoder ``d`` (with ``room``) is relayed through ``tracker``: movable
        if ``d`` drains (``kv_room``: the room ``d`` keeps its KV as if it is cut; None: replayed).
        Called by the request's relay as each leg's stream opens."""
        streams = self._streams.get(d)
        if streams is None:
            streams = self._streams[d] = weakref.WeakKeyDictionary()
        stream = streams[tracker] = TrackedStream(weakref.ref(request), leg, request.rid, room, kv_room)
        landing = self._landing.pop(request, None)
        if landing is not None and self.rebalancer is not None:
            self.rebalancer.landed(landing[0], d, landing[1], request.rid, room)
        if self.rebalancer is not None:
            self.rebalancer.start()
        if d.draining:
            self._move(d, tracker, stream)  # opened while its decoder drains

    def streaming(self, d: BackendState) -> list[tuple[StreamTracker, TrackedStream, RequestContext]]:
        """The streams relayed from decoder ``d`` now (their leg streaming, no finish reason out yet)."""
        out = []
        for tracker, stream in list(self._streams.get(d, {}).items()):
            request = stream.request()
            if request is not None and not tracker.finished and stream.leg.leg_state() is LegState.STREAMING:
                out.append((tracker, stream, request))
        return out

    def rebalance_move(
        self, d: BackendState, tracker: StreamTracker, target: BackendState, *, by_replay: bool = False
    ) -> bool:
        """Cut ``tracker``'s stream on ``d`` so that it goes on on ``target`` with its KV (a
        rebalance: ``d`` stays in the pool), or, ``by_replay``, by replay when it has no KV to move;
        False when it cannot move (see :meth:`_move`)."""
        stream = self._streams.get(d, {}).get(tracker)
        if stream is None or not stream.rebalance_may_move(by_replay):
            return False
        return self._move(d, tracker, stream, MoveCause.REBALANCE, target)

    def planned_target(self, request: RequestContext) -> BackendState | None:
        """The decoder a rebalance cut ``request``'s stream for (once; None: routing picks)."""
        return self._targets.pop(request, None)

    def _move(
        self,
        d: BackendState,
        tracker: StreamTracker,
        stream: TrackedStream,
        cause: MoveCause = MoveCause.DRAIN,
        target: BackendState | None = None,
    ) -> bool:
        """Cut the stream's leg with a drain failure (the relay resumes it); False when it cannot
        move (ended, nothing to resume from, no resumed leg left, nowhere to go)."""
        request = stream.request()
        state = stream.leg.leg_state()
        if request is None or state is LegState.CUT_BY_DRAIN:
            return request is not None and cause is MoveCause.DRAIN
        if state is not LegState.STREAMING or tracker.finished:
            return False
        if request.progress.resumes >= self.router.config.resume_attempts or resume_call(tracker) is None:
            return False
        if target is not None and not target.healthy:
            return False
        if not any(s.healthy for s in self.router.pool.active["decode"] if s is not d):
            return False  # nowhere to go: it finishes in place
        name = d.backend.name
        why = "is draining" if cause is MoveCause.DRAIN else "is overloaded"
        error = RouterError(503, f"{name} {why}; the stream moves to another decoder", DECODE_FAILED)
        request.progress.moves.append((cause.value, time.time()))
        pending = self._pending.get(d)
        if pending is None:
            pending = self._pending[d] = weakref.WeakKeyDictionary()
        pending[tracker] = _Cut(stream.leg, cause, stream.request, target)
        if target is not None:
            self._targets[request] = target
        mode = MoveMode.KV if stream.kv_room is not None else MoveMode.REPLAY
        logger.info(
            "rid=%s room=%s moving off %s %s (%s%s%s)",
            stream.rid,
            stream.room,
            "draining" if cause is MoveCause.DRAIN else "overloaded",
            name,
            mode.value,
            f", migrate room {stream.kv_room}" if mode is MoveMode.KV else "",
            f", to {target.backend.name}" if target is not None else "",
        )
        stream.leg.cut_for_drain(Failure(d, FailureKind.DRAIN, error, True, detail=cause.value))
        return True

    def settled(self, d: BackendState, tracker: StreamTracker, mode: MoveMode | None, rid: str, room: int) -> None:
        """The stream relayed through ``tracker``, cut on decoder ``d``, went on by ``mode`` (None:
        nothing was left to move), its new leg with ``room``; called once per cut stream by
        :mod:`proxy.strategies.resume` (later calls, and calls for a stream no drain cut, are no-ops)."""
        pending = self._pending.get(d)
        if pending is None or tracker not in pending:
            return
        cut = pending.pop(tracker)
        request = cut.request()
        if request is not None:
            self._targets.pop(request, None)
        if cut.cause is MoveCause.REBALANCE:
            if mode is MoveMode.FAILED and self.rebalancer is not None:
                self.rebalancer.landed(d, None, mode, rid, room)
            elif mode is not None and request is not None:
                self._landing[request] = (d, mode)  # counted once its next leg is tracked (on which decoder)
            return
        if mode is None:
            return
        tally = self._tally.setdefault(d, {})
        tally[mode.value] = tally.get(mode.value, 0) + 1
        self.moves.labels(mode.value).inc()
        log = logger.warning if mode is MoveMode.FAILED else logger.info
        log("rid=%s room=%s moved off draining %s by %s", rid, room, d.backend.name, mode.value)

    def _unsettled(self, state: BackendState) -> bool:
        """Whether a stream cut on ``state`` has not gone on yet (one that ended cleanly at the cut
        needs nothing)."""
        pending = self._pending.get(state)
        return pending is not None and any(cut.leg.leg_state() is not LegState.ENDED for cut in pending.values())

    # -- the admin call ------------------------------------------------------------------------

    async def drain(self, state: BackendState | None, role: str, host: str, port: int, timeout: float) -> DrainReport:
        """Drain the instance (``state``; None: unknown); one drain per instance at a time."""
        if state is None:
            return DrainReport(role, host, port, DrainOutcome.UNKNOWN)
        key = state.backend.key
        task = self._running.get(key)
        if task is None:
            task = self._running[key] = self.router.spawn(self._drain(state, timeout))
            task.add_done_callback(lambda _t: self._running.pop(key, None))
        return await asyncio.shield(task)

    async def _drain(self, state: BackendState, timeout: float) -> DrainReport:
        backend = state.backend
        report = DrainReport(backend.role, backend.host, backend.port)
        start = time.monotonic()
        deadline = start + timeout
        if not state.draining:
            self.router.pool.remove(state)
        logger.info("%s draining (%d in flight, %.0f s at most)", backend.name, state.in_flight, timeout)
        sent_before = await sent_bytes(self.router, state, deadline) if backend.movable else None
        moved: set[int] = set()
        stuck: set[int] = set()
        self._tally[state] = {}
        while (state.in_flight > 0 or self._unsettled(state)) and time.monotonic() < deadline:
            if backend.role == "decode":
                for tracker, stream in list(self._streams.get(state, {}).items()):
                    if id(tracker) in moved:
                        continue
                    if self._move(state, tracker, stream):
                        moved.add(id(tracker))
                        stuck.discard(id(tracker))
                    elif stream.leg.leg_state() in (LegState.STREAMING, LegState.CUT):
                        stuck.add(id(tracker))
            await asyncio.sleep(POLL_S)
        report.moved = dict(self._tally.pop(state, {}))
        report.waited = len(stuck)
        if state.in_flight > 0 or self._unsettled(state):
            report.outcome = DrainOutcome.TIMEOUT
        else:
            report.held = await wait_empty(self.router, state, deadline)
            if report.held and any(v > 0 for v in report.held.values()):
                report.outcome = DrainOutcome.TIMEOUT
            if sent_before is not None and (sent_after := await sent_bytes(self.router, state, deadline)) is not None:
                report.kv_bytes_moved = max(0, int(sent_after - sent_before))
        self._streams.pop(state, None)
        self._pending.pop(state, None)
        report.seconds = time.monotonic() - start
        self.drains.labels(backend.role, report.outcome.value).inc()
        if report.outcome is DrainOutcome.DRAINED:
            self.seconds.labels(backend.role).observe(report.seconds)
        logger.info(
            "%s drain %s in %.3f s: moved %s, %d finished in place, KV bytes moved %d, held %s",
            backend.name,
            report.outcome.value,
            report.seconds,
            report.moved or "none",
            report.waited,
            report.kv_bytes_moved,
            report.held,
        )
        return report
