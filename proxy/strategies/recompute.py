"""Continuing an answer D cut with ``stop_reason: "recomputed"`` on a fresh P/D pair.

vLLM-Ascend's decoders with ``recompute_scheduler_enable`` drop a request they have no KV blocks
for and answer ``finish_reason: "stop"``, ``stop_reason: "recomputed"``; the front end is to send
the prompt plus the text generated so far to a new prefill and decode (vLLM-Ascend's example proxy
does, :mod:`proxy.strategies.recompute_body` says how the continuation's body is built). The request's
answer (after the two-instance path or the first-token path, through its
:class:`proxy.request.context.RequestContext`) hands such an answer to this module:

- a whole JSON answer (:func:`continue_answer`): legs are run one after another until one does not
  stop with ``recomputed``; the client gets one answer (the text of every leg, ``completion_tokens``
  summed, the last leg's finish reason);
- a stream (:func:`stream_watch` wraps the relay's transform; :func:`after_relay`): the
  ``recomputed`` event and what follows it are held back, the client's stream stays open, and the
  next leg's events follow on it (one answer id, usage summed, one ``[DONE]``).

Each continuation is one INFO line with the request id; a leg runs on a pair the routing policy
picks (another decoder than the one that cut the answer where there is one), with a fresh room,
retried on other pairs like any attempt (:meth:`proxy.request.loop.AttemptLoop.pairs`). After ``--max-recomputes`` continuations, or when a
continuation cannot be made (no token budget left, the request not continuable, no pair answered),
the answer so far goes to the client as it is (``stop_reason: "recomputed"`` included), with a log
line saying why.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from proxy.request.attempt import Answered, Call, Opened
from proxy.request.failure_policy import Tried
from proxy.request.loop import Won
from proxy.request.payloads import estimate_prompt_tokens
from proxy.strategies.recompute_body import (
    Progress,
    StreamWatch,
    answer_text,
    answer_tokens,
    continuation_body,
    is_recomputed,
    merged_answer,
    parse_answer,
    recomputed_answer,
    unsupported_reason,
)
from proxy.upstream.pool import BackendState

if TYPE_CHECKING:
    from proxy.request.context import RequestContext
    from proxy.server.reply import ClientReply, StreamReply

logger = logging.getLogger("proxy")

__all__ = ["StreamWatch", "after_relay", "continue_answer", "recomputed_answer", "stream_watch"]


def stream_watch(
    ctx: RequestContext, inner: Callable[[bytes], bytes] | None, text: str = "", tokens: int = 0
) -> Callable[[bytes], bytes] | None:
    """The relay transform of a streamed answer's first leg: ``inner`` watched for ``recomputed``
    (``text``/``tokens``: what the client already has of the answer), or ``inner`` itself when
    continuations are off (``--max-recomputes 0``) or the request cannot be continued."""
    if ctx.router.config.max_recomputes < 1 or unsupported_reason(ctx.endpoint, ctx.call.body) is not None:
        return inner
    return StreamWatch(inner, Progress(), leg=0, client_usage=_client_usage(ctx), text=text, tokens=tokens)


def _client_usage(ctx: RequestContext) -> bool:
    options = ctx.call.body.get("stream_options")
    return isinstance(options, dict) and options.get("include_usage") is True


async def after_relay(
    ctx: RequestContext, response: StreamReply, transform: Callable[[bytes], bytes] | None
) -> ClientReply:
    """After the relay of a leg: continue the client's stream while D cut it with ``recomputed``."""
    watch = transform
    while isinstance(watch, StreamWatch) and watch.held_open:
        progress = watch.progress
        progress.text += watch.text
        progress.tokens += watch.leg_tokens
        got = await _next_leg(ctx, progress, watch.leg_tokens)
        if got is None:
            await response.write_eof(watch.held)
            return response
        if not isinstance(got.outcome, Opened):  # closed when the request ends (AttemptLoop.close)
            logger.error(
                "rid=%s room=%s continuation answered without a stream; the answer ends as is",
                ctx.rid,
                ctx.progress.room,
            )
            await response.write_eof(watch.held)
            return response
        watch = StreamWatch(None, progress, leg=progress.continuations, client_usage=_client_usage(ctx))
        response = await ctx.relay(got, response, watch)
    return response


async def continue_answer(ctx: RequestContext, answered: Answered, first: dict[str, Any]) -> ClientReply:
    """D's whole answer ``first`` stopped with ``recomputed``: continue it, and answer the client
    once with every leg merged."""
    status, content_type = answered.status, answered.content_type
    progress = Progress(id=first.get("id"))
    legs = [first]
    reason = unsupported_reason(ctx.endpoint, ctx.call.body)
    if reason is not None:
        logger.warning(
            "rid=%s room=%s D stopped with recomputed; passed on as is: %s", ctx.rid, ctx.progress.room, reason
        )
    while reason is None and is_recomputed(legs[-1]):
        progress.text += answer_text(legs[-1])
        tokens = answer_tokens(legs[-1])
        progress.tokens += tokens
        got = await _next_leg(ctx, progress, tokens)
        if got is None:
            break
        outcome = got.outcome
        answer = parse_answer(outcome.body) if isinstance(outcome, Answered) else None
        if answer is None:  # the leg is closed when the request ends (AttemptLoop.close)
            logger.error(
                "rid=%s room=%s continuation's answer is no JSON answer; the answer ends as is",
                ctx.rid,
                ctx.progress.room,
            )
            break
        legs.append(answer)
        status, content_type = outcome.status, outcome.content_type
    if len(legs) > 1 and not is_recomputed(legs[-1]):
        progress.text += answer_text(legs[-1])
        progress.tokens += answer_tokens(legs[-1])
    body = answered.body if len(legs) == 1 else merged_answer(legs, progress)
    return ctx.answered(status, body, content_type)


async def _next_leg(ctx: RequestContext, progress: Progress, leg_tokens: int) -> Won | None:
    """The next leg's attempt that answered; None (logged) when there is none to be had."""
    config = ctx.router.config
    cut_by = ctx.loop.current_decoder()
    where = cut_by.backend.name if cut_by is not None else "D"
    if progress.continuations >= config.max_recomputes:
        logger.warning(
            "rid=%s room=%s %s stopped with recomputed after %d tokens; %d continuations made "
            "(--max-recomputes), the answer ends as is",
            ctx.rid,
            ctx.progress.room,
            where,
            progress.tokens,
            progress.continuations,
        )
        return None
    body = continuation_body(ctx.endpoint, ctx.call.body, progress)
    if body is None:
        logger.warning(
            "rid=%s room=%s %s stopped with recomputed after %d tokens, no token left to generate; "
            "the answer ends as is",
            ctx.rid,
            ctx.progress.room,
            where,
            progress.tokens,
        )
        return None
    progress.continuations += 1
    if ctx.call.stream:
        body["stream_options"] = {**(body.get("stream_options") or {}), "include_usage": True}
    logger.info(
        "rid=%s room=%s %s stopped with recomputed after %d tokens (%d in all); continuation %d/%d: "
        "prompt + %d characters on a fresh pair, max_tokens %s",
        ctx.rid,
        ctx.progress.room,
        where,
        leg_tokens,
        progress.tokens,
        progress.continuations,
        config.max_recomputes,
        len(progress.text),
        body.get("max_tokens", body.get("max_completion_tokens")),
    )
    call = Call(ctx.endpoint, ctx.rid, body, ctx.call.stream, estimate_prompt_tokens(body), ctx.call.headers)
    return await _run_leg(ctx, call, cut_by)


async def _run_leg(ctx: RequestContext, call: Call, cut_by: BackendState | None) -> Won | None:
    """Attempts of one leg on pairs the routing policy picks (fresh rooms; another decoder than
    ``cut_by`` where one is left), up to ``--max-retries``; the first that does not fail."""
    tried = Tried(d=set() if cut_by is None else {cut_by})
    tries = ctx.router.config.max_retries
    got = await ctx.loop.pairs(call, tried, tries, retries=False, what="continuation attempt")
    if isinstance(got, Won):
        return got
    logger.error(
        "rid=%s room=%s no pair answered the continuation (%s); the answer ends as is",
        ctx.rid,
        ctx.progress.room,
        got.failure.error.message if got.failure is not None else got.why or "no instance or no time left",
    )
    return None
