"""Live rebalancing (``--rebalance on``): running streams move off an overloaded decoder by KV.

Every ``--rebalance-interval-s`` the :class:`Rebalancer`

1. measures each active decoder's inter-token latency on the streams the Router relays from it
   (the streams a drain could move, :meth:`proxy.admin.drain.Drains.streaming`): the time each
   stream spent over the round divided by the tokens it got (a stalled stream counts its whole
   round), averaged with the rounds before (``pd_router_rebalance_itl_ms{backend}``); a decoder
   with no stream relayed has no measurement;
2. hands the decoders (in flight, ITL, streams movable now) to the policy (``--rebalance-policy``,
   :mod:`proxy.admin.rebalance_policy`; ``tpot``: ITL over ``--rebalance-tpot-ms`` on one, another
   with room), within the moves left of ``--rebalance-max-moves-per-s`` (a token bucket);
3. carries each move out by the drain's per-stream move (:meth:`proxy.admin.drain.Drains.rebalance_move`):
   D's stream is closed, the decoder holds the request's KV as its migrate room, and the chosen
   decoder loads it (:mod:`proxy.strategies.kv_move`) and goes on from the tokens the client has.

Movable are the streams a drain moves by KV (their decoder started with the connector's
``migration`` and known by ``--decoder-bootstrap-ports``; a resumable streamed request) that were never
moved or resumed before and have at least ``--rebalance-min-tokens-left`` tokens of their budget
left; the one with the most left goes first. Others are left alone. A move shows as a ``rebalance``
mark in the request's phase trace, ``moved=D1>D2`` in its log line, a log line of its own and
``pd_router_rebalance_moves_total{from,to,mode}`` (``mode``: ``kv``; ``replay`` when the KV leg failed
before its first chunk and P prefilled the tokens again; ``failed``: not continued).
"""

from __future__ import annotations

import asyncio
import logging
import time
import weakref
from typing import TYPE_CHECKING

from prometheus_client import Counter, Gauge

from proxy.admin.rebalance_policy import DecoderView

if TYPE_CHECKING:
    from proxy.admin.drain import Drains, MoveMode, TrackedStream
    from proxy.request.context import RequestContext
    from proxy.router_state import Router
    from proxy.strategies.resume_body import StreamTracker
    from proxy.upstream.pool import BackendState

logger = logging.getLogger("proxy")

#: Weight of a round's measurement in a decoder's running ITL.
ITL_WEIGHT = 0.5
#: Tokens a stream's current leg must have generated before it may move (its ITL was measured).
MIN_LEG_TOKENS = 2
#: Tokens left of a stream whose request names no budget (a chat request without max_tokens).
UNBOUNDED = 1 << 30


def tokens_left(tracker: StreamTracker) -> int:
    """Tokens of its leg's budget the stream has still to generate."""
    body = tracker.call.body
    budget = body.get("max_tokens", body.get("max_completion_tokens"))
    if not isinstance(budget, int) or isinstance(budget, bool):
        return UNBOUNDED
    return budget - len(tracker.generated)


class Rebalancer:
    """Measures the decoders and moves streams off overloaded ones (one per Router)."""

    def __init__(self, router: Router, drains: Drains) -> None:
        self.router = router
        self.drains = drains
        self.config = router.config.rebalance
        self.policy = self.config.make_policy()
        self._task: asyncio.Task[None] | None = None
        #: Per stream: when it was last sampled and how many tokens its leg had then.
        self._samples: weakref.WeakKeyDictionary[StreamTracker, tuple[float, int]] = weakref.WeakKeyDictionary()
        #: Per decoder: its running ITL in ms (absent: no stream measured lately).
        self.itl: dict[BackendState, float] = {}
        self._capacity = max(1.0, self.config.max_moves_per_s)
        self._allowance = self._capacity
        self._refilled_at: float | None = None
        reg = router.metrics.registry
        self.moves = Counter(
            "pd_router_rebalance_moves",
            "Streams moved off an overloaded decoder (--rebalance), by source, target and how (kv; replay: the KV "
            "leg failed and P prefilled the tokens again; failed: not continued, to='none')",
            ["from", "to", "mode"],
            registry=reg,
        )
        self.itl_gauge = Gauge(
            "pd_router_rebalance_itl_ms",
            "A decoder's inter-token latency over its relayed streams, as the rebalancer measures it (ms)",
            ["backend"],
            registry=reg,
        )

    def start(self) -> None:
        """Run the rounds (from the first stream tracked on; stopped with the Router's tasks)."""
        if self._task is None or self._task.done():
            self._task = self.router.spawn(self._rounds())

    async def _rounds(self) -> None:
        while True:
            await asyncio.sleep(self.config.interval_s)
            try:
                self.round(time.monotonic())
            except Exception:  # a bug here must not stop rebalancing for good
                logger.exception("rebalance round failed")

    # -- one round ---------------------------------------------------------------------------

    def measure(self, now: float) -> dict[BackendState, float]:
        """Update and return each active decoder's running ITL (ms) from its streams since the last round."""
        active = self.router.pool.active["decode"]
        for d in list(self.itl):
            if d not in active:
                del self.itl[d]
        for d in active:
            spent, tokens, streams = 0.0, 0, 0
            for tracker, _stream, _request in self.drains.streaming(d):
                count = len(tracker.generated)
                last = self._samples.get(tracker)
                self._samples[tracker] = (now, count)
                if last is None or now <= last[0]:
                    continue
                spent += now - last[0]
                tokens += max(0, count - last[1])
                streams += 1
            if streams == 0:
                self.itl.pop(d, None)  # nothing relayed now: no measurement (an idle decoder has room)
                continue
            ms = 1000.0 * spent / max(tokens, streams)  # no token at all: at least the round, per stream
            old = self.itl.get(d)
            self.itl[d] = ms if old is None else (1 - ITL_WEIGHT) * old + ITL_WEIGHT * ms
            self.itl_gauge.labels(d.backend.address).set(round(self.itl[d], 3))
        return self.itl

    def movable(self, d: BackendState) -> list[tuple[StreamTracker, TrackedStream, RequestContext]]:
        """``d``'s streams that may move now, the one with the most tokens left first."""
        limit = self.router.config.resume_attempts
        out = [
            (tracker, stream, request)
            for tracker, stream, request in self.drains.streaming(d)
            if stream.rebalance_may_move(self.config.by_replay)
            and request.progress.resumes == 0
            and request.progress.resumes < limit
            and len(tracker.generated) >= MIN_LEG_TOKENS
            and tokens_left(tracker) >= self.config.min_tokens_left
        ]
        out.sort(key=lambda item: -tokens_left(item[0]))
        return out

    def _refill(self, now: float) -> None:
        if self._refilled_at is not None:
            self._allowance = min(
                self._capacity, self._allowance + (now - self._refilled_at) * self.config.max_moves_per_s
            )
        self._refilled_at = now

    def round(self, now: float) -> int:
        """Measure, decide and move; the number of streams cut to move."""
        itl = self.measure(now)
        self._refill(now)
        budget = int(self._allowance)
        if budget < 1:
            return 0
        decoders = list(self.router.pool.active["decode"])
        candidates = {d: self.movable(d) for d in decoders}
        views = [
            DecoderView(d.backend.address, d.in_flight, itl.get(d), len(candidates[d]), d.healthy) for d in decoders
        ]
        by_key = {d.backend.address: d for d in decoders}
        made = 0
        for move in self.policy.decide(views, budget):
            source, target = by_key.get(move.source), by_key.get(move.target)
            if source is None or target is None or source is target:
                continue
            while candidates[source]:
                tracker, stream, _request = candidates[source].pop(0)
                if self.drains.rebalance_move(source, tracker, target, by_replay=self.config.by_replay):
                    made += 1
                    self._allowance -= 1
                    logger.info(
                        "rid=%s room=%s rebalance (%s): %s ITL %.1f ms over %.1f ms, %d in flight; moving the stream "
                        "(%d token(s) left) to %s (ITL %s, %d in flight)",
                        stream.rid,
                        stream.room,
                        self.policy.name,
                        source.backend.name,
                        itl.get(source, 0.0),
                        self.config.tpot_ms,
                        source.in_flight,
                        tokens_left(tracker),
                        target.backend.name,
                        "-" if itl.get(target) is None else f"{itl[target]:.1f} ms",
                        target.in_flight,
                    )
                    break
        return made

    # -- the moved stream's side ---------------------------------------------------------------

    def landed(self, source: BackendState, target: BackendState | None, mode: MoveMode, rid: str, room: int) -> None:
        """A stream a rebalance cut on ``source`` went on on ``target`` by ``mode`` (None: it did not)."""
        to = target.backend.address if target is not None else "none"
        self.moves.labels(source.backend.address, to, mode.value).inc()
        log = logger.info if target is not None else logger.warning
        log(
            "rid=%s room=%s moved off overloaded %s to %s by %s",
            rid,
            room,
            source.backend.name,
            target.backend.name if target is not None else "no decoder",
            mode.value,
        )
