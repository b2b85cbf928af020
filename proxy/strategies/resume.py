"""Resuming a stream its decoder cut after it started: :func:`resume_stream`.

When D's stream breaks after bytes went to the client (connection lost, an error event, the pair's
P failing), the request's relay (:meth:`proxy.request.context.RequestContext.relay`) closes the attempt and
hands the stream here as a :class:`proxy.request.attempt.Cut` before ending it with an error event. Where :func:`proxy.request.failure_policy.resume_refusal` allows it, the stream goes on on another
decoder: a fresh room, a P/D pair the routing policy picks (not the decoder that failed, nor the
pair's P when P failed), P prefilling the leg's prompt token ids plus the generated ids the client
has, D generating the rest of the budget (:func:`proxy.strategies.resume_body.resume_call`). The new leg's
events reach the client on the same response, rewritten as the first leg's
(:class:`proxy.strategies.resume_body.StreamTracker`): one stream, one id, one ``[DONE]``, usage counting the
client's prompt and every generated token. Greedy output is what one instance gives: the new
decoder's prompt is exactly the tokens one instance had.

A drain's cut of a decoder movable by KV goes on first by a leg that loads the KV the drained decoder
holds (:mod:`proxy.strategies.kv_move`: nothing prefilled again), by the replay above if that leg fails before
its first chunk. A resumed leg that fails before its first chunk is tried again on another pair
while resumed legs are left (``--resume-attempts`` per request, each counted); then, or when no
decoder that has not failed the request is left, the relay ends the stream with the error event. A cut after the finish
reason went out needs no decoder: the Router ends the stream (usage when asked, ``[DONE]``).
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from proxy.admin.drain import MoveMode
from proxy.errors import DECODE_FAILED, RouterError
from proxy.request.attempt import Cut, Opened
from proxy.request.failure_policy import Tried, resume_refusal
from proxy.request.held_tail import settle_held_tail
from proxy.request.loop import Won
from proxy.strategies.kv_move import kv_leg
from proxy.strategies.resume_body import StreamTracker, resume_call
from proxy.upstream.calls import Failure, FailureKind
from proxy.upstream.pool import BackendState

if TYPE_CHECKING:
    from proxy.request.context import RequestContext
    from proxy.server.reply import StreamReply

logger = logging.getLogger("proxy")


def mid_stream_error(d: BackendState, event: str) -> Failure:
    """Decoder ``d``'s error event in the middle of its stream, as ``d``'s failure."""
    message = f"{d.backend.name} sent an error event mid-stream: {event}"
    return Failure(d, FailureKind.ERROR_EVENT, RouterError(502, message, DECODE_FAILED), True)


def _mark(ctx: RequestContext, phase: str, at: float | None = None) -> None:
    """A ``d_cut``/``resumed`` mark in the request's phase trace (numbered after the first)."""
    n = ctx.progress.resumes
    ctx.progress.moves.append((phase if n <= 1 else f"{phase}_{n}", time.time() if at is None else at))


async def resume_stream(ctx: RequestContext, cut: Cut, response: StreamReply, tracker: StreamTracker) -> bool:
    """Continue the client's ``response`` after its leg was cut (``cut``, the leg's attempt closed)
    mid-stream; True when the stream was taken over (it is then complete, or ended by a later leg),
    False when it was not resumed (the caller ends it with the error event, as without resume). A
    drain's cut (``FailureKind.DRAIN``) tells the drain how the stream moved
    (:meth:`proxy.admin.drain.Drains.settled`)."""
    if cut.failure.kind is not FailureKind.DRAIN:
        return await _resume(ctx, cut, response, tracker)
    try:
        return await _resume(ctx, cut, response, tracker)
    finally:
        ctx.router.drains.settled(cut.d, tracker, MoveMode.FAILED, ctx.rid, ctx.progress.room)  # no-op once settled


async def _resume(ctx: RequestContext, cut: Cut, response: StreamReply, tracker: StreamTracker) -> bool:
    router = ctx.router
    config = router.config
    failure = cut.failure
    cut_at = time.monotonic()
    if tracker.finished:
        if failure.kind is FailureKind.DRAIN:
            router.drains.settled(cut.d, tracker, None, ctx.rid, ctx.progress.room)  # nothing left to move
        # The answer's finish reason went out: only usage and [DONE] are missing.
        ctx.loop.count_cut(cut)
        logger.warning(
            "rid=%s room=%s stream cut after its last token (%s); the Router ends it",
            ctx.rid,
            ctx.progress.room,
            failure.error.message,
        )
        await response.write_eof(tracker.closing_events())
        return True
    refusal = resume_refusal(failure, ctx.progress.resumes, config.resume_attempts)
    if refusal is None:
        await settle_held_tail(ctx, cut, tracker)  # the client's last tokens whose text was held
    call = resume_call(tracker) if refusal is None else None
    if refusal is None and call is None:
        refusal = "no prompt token ids seen or no token left to generate"
    if call is None:
        logger.warning("rid=%s room=%s stream cut, not resumed: %s", ctx.rid, ctx.progress.room, refusal)
        return False
    cut_from = cut.d.backend.name
    avoid = Tried.after_cut(failure, cut.p, cut.d)
    if cut.kv_room is not None:  # a drained decoder holds the KV: move it (proxy.strategies.kv_move)
        cut_wall = time.time()
        leg = await kv_leg(ctx, cut, call, avoid)
        if leg is not None:
            ctx.progress.resumes += 1
            _mark(ctx, "d_cut", cut_wall)
            await _relay_leg(ctx, cut, leg, response, tracker, cut_at, MoveMode.KV)
            return True
    while ctx.progress.resumes < config.resume_attempts:
        ctx.progress.resumes += 1
        _mark(ctx, "d_cut")
        got = await ctx.loop.pairs(call, avoid, 1, retries=False, new_decoder=True, what="resumed leg")
        if isinstance(got, Won):
            if not isinstance(got.outcome, Opened):  # a streamed request is always Opened
                break
            await _relay_leg(ctx, cut, got, response, tracker, cut_at, MoveMode.REPLAY)
            return True
        if got.why is not None:
            logger.error("rid=%s stream cut on %s, not resumed: %s", ctx.rid, cut_from, got.why)
            return False
        if not got.retry:
            break
    logger.error("rid=%s stream cut on %s, not resumed: every resumed leg failed", ctx.rid, cut_from)
    return False


async def _relay_leg(
    ctx: RequestContext,
    cut: Cut,
    leg: Won,
    response: StreamReply,
    tracker: StreamTracker,
    cut_at: float,
    mode: MoveMode,
) -> None:
    """The resumed ``leg`` opened (by ``mode``): count the cut, log it, relay the leg to the client."""
    router = ctx.router
    failure = cut.failure
    call = leg.call
    ctx.loop.count_cut(cut)  # the cut counted (unhealthy if unreachable)
    seconds = time.monotonic() - cut_at
    # Tokens prefilled again: none when the KV moved (the target loaded it from the drained decoder).
    replayed = 0 if mode is MoveMode.KV else call.replayed - cut.call.replayed
    router.metrics.resumed(ctx.endpoint, failure.kind.value, replayed, seconds)
    _mark(ctx, "resumed")
    if not ctx.progress.decoders:
        ctx.progress.decoders.append(cut.d.backend.address)
    ctx.progress.decoders.append(leg.d.backend.address)
    if failure.kind is FailureKind.DRAIN:
        router.drains.settled(cut.d, tracker, mode, ctx.rid, leg.room)
    logger.warning(
        "rid=%s room=%s stream cut on %s (%s) after %d token(s); resumed on %s + %s in %.1f ms by %s "
        "(%d token(s) prefilled again, max_tokens %s; resumed leg %d/%d)",
        ctx.rid,
        leg.room,
        cut.d.backend.name,
        failure.kind.value,
        tracker.sent_tokens,
        leg.p.backend.name,
        leg.d.backend.name,
        seconds * 1000,
        mode.value,
        replayed,
        call.body.get("max_tokens"),
        ctx.progress.resumes,
        router.config.resume_attempts,
    )
    await ctx.relay(
        leg,
        response,
        tracker=StreamTracker(call, identity=tracker.identity, ids_ahead=tracker.ids_sent_beyond_committed()),
    )
