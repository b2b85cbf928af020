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
decoder's prompt is exactly the tokens one instance had. A chat stream goes on as a completions leg
re-shaped into chat chunks (:mod:`proxy.strategies.resume_chat`); a chat request with no budget of its
own gets the model's context length less the leg's prompt, read from an instance's ``/v1/models``.
A stream of a request that may not be resumed is logged with the reason
(:func:`proxy.strategies.resume_body.resume_ineligible_reason`) before it ends with the error event.

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
from dataclasses import replace
from typing import TYPE_CHECKING

import msgspec

from proxy.admin.drain import MoveMode
from proxy.errors import DECODE_FAILED, RouterError
from proxy.request.attempt import Cut, Opened
from proxy.request.failure_policy import Tried, resume_refusal
from proxy.request.held_tail import settle_held_tail
from proxy.request.loop import Won
from proxy.strategies.kv_move import kv_leg
from proxy.strategies.resume_body import StreamTracker, resume_call, resume_ineligible_reason, why_not_resumed
from proxy.upstream.calls import Failure, FailureKind, fetch
from proxy.upstream.pool import BackendState

if TYPE_CHECKING:
    from proxy.request.attempt import Call
    from proxy.request.context import RequestContext
    from proxy.server.reply import StreamReply

logger = logging.getLogger("proxy")

#: Seconds the instances get, all together, to tell the model's context length (``GET /v1/models``).
MODELS_TIMEOUT_S = 2.0
_DECODER = msgspec.json.Decoder()


def mid_stream_error(d: BackendState, event: str) -> Failure:
    """Decoder ``d``'s error event in the middle of its stream, as ``d``'s failure."""
    message = f"{d.backend.name} sent an error event mid-stream: {event}"
    return Failure(d, FailureKind.ERROR_EVENT, RouterError(502, message, DECODE_FAILED), True)


def _mark(ctx: RequestContext, phase: str, at: float | None = None) -> None:
    """A ``d_cut``/``resumed`` mark in the request's phase trace (numbered after the first)."""
    n = ctx.progress.resumes
    ctx.progress.moves.append((phase if n <= 1 else f"{phase}_{n}", time.time() if at is None else at))


async def resume_stream(ctx: RequestContext, cut: Cut, response: StreamReply, tracker: StreamTracker | None) -> bool:
    """Continue the client's ``response`` after its leg was cut (``cut``, the leg's attempt closed)
    mid-stream; True when the stream was taken over (it is then complete, or ended by a later leg),
    False when it was not resumed (the caller ends it with the error event, as without resume). A
    drain's cut (``FailureKind.DRAIN``) tells the drain how the stream moved
    (:meth:`proxy.admin.drain.Drains.settled`). No ``tracker``: the request may not be resumed (logged
    with the reason)."""
    if tracker is None:
        call = cut.call
        reason = "resume off (--resume-attempts 0)"
        if ctx.router.config.resume_attempts > 0:
            reason = resume_ineligible_reason(call.endpoint, call.body) or "not streamed"
        logger.warning("rid=%s room=%s stream cut, not resumable: %s", ctx.rid, ctx.progress.room, reason)
        return False
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
        refusal = why_not_resumed(tracker)
    if call is not None and call.body.get("max_tokens") is None:
        call = await _with_context_budget(ctx, cut, call)
        if call is None:
            refusal = "no max_tokens given and no instance told max_model_len (GET /v1/models)"
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
    following = StreamTracker(
        call,
        identity=tracker.identity,
        ids_ahead=tracker.ids_sent_beyond_committed(),
        chat=tracker.chat,
        seed=tracker.seed,
    )
    await ctx.relay(leg, response, tracker=following)


async def _with_context_budget(ctx: RequestContext, cut: Cut, call: Call) -> Call | None:
    """``call`` (a chat stream's leg; the client gave no budget) with ``max_tokens`` = the model's
    context length less the leg's prompt, as vLLM's chat default; the length from the first instance
    whose ``/v1/models`` names it (the cut decoder's P first); None: none did, or nothing is left."""
    deadline = time.monotonic() + MODELS_TIMEOUT_S
    sources = [cut.p, cut.d]
    sources += [s for s in ctx.router.pool.all_states() if s.healthy and s not in sources]
    for state in sources:
        left = deadline - time.monotonic()
        if left <= 0:
            break
        reply = await fetch(ctx.router.http, state, "GET", "/v1/models", left, None, cut.call.headers)
        if isinstance(reply, Failure) or reply.status != 200:
            continue
        try:
            cards = _DECODER.decode(reply.body).get("data") or []
        except (msgspec.DecodeError, AttributeError):
            continue
        model = call.body.get("model")
        cards = sorted((c for c in cards if isinstance(c, dict)), key=lambda c: c.get("id") != model)
        length = next((n for c in cards if isinstance(n := c.get("max_model_len"), int)), None)
        if length is None:
            continue
        left_tokens = length - call.tokens
        if left_tokens < 1:
            return None
        return replace(call, body={**call.body, "max_tokens": left_tokens})
    return None
