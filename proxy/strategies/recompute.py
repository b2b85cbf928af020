"""Continuing an answer D cut with ``stop_reason: "recomputed"`` on a fresh P/D pair.

vLLM-Ascend's decoders with ``recompute_scheduler_enable`` drop a request they have no KV blocks
for and answer ``finish_reason: "stop"``, ``stop_reason: "recomputed"``; the front end is to send
the prompt plus the text generated so far to a new prefill and decode (vLLM-Ascend's example proxy
does, :mod:`proxy.strategies.recompute_body` says how the continuation's body is built). Here the exchange
(both its two-instance path and the first-token path) hands such an answer to this module:

- a whole JSON answer (:func:`continue_answer`): legs are run one after another until one does not
  stop with ``recomputed``; the client gets one answer (the text of every leg, ``completion_tokens``
  summed, the last leg's finish reason);
- a stream (:func:`stream_watch` wraps the relay's transform; :func:`after_relay`): the
  ``recomputed`` event and what follows it are held back, the client's stream stays open, and the
  next leg's events follow on it (one answer id, usage summed, one ``[DONE]``).

Each continuation is one INFO line with the request id; a leg runs on a pair the routing policy
picks (another decoder than the one that cut the answer where there is one), with a fresh room,
retried on other pairs like any attempt. After ``--max-recomputes`` continuations, or when a
continuation cannot be made (no token budget left, the request not continuable, no pair answered),
the answer so far goes to the client as it is (``stop_reason: "recomputed"`` included), with a log
line saying why.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from aiohttp import web

from proxy.request.attempt import Answered, Attempt, Call, Opened
from proxy.request.failure_policy import Tried, settle
from proxy.request.payloads import estimate_prompt_tokens, new_room
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
from proxy.upstream.calls import Failure, passthrough_response
from proxy.upstream.pool import BackendState
from proxy.upstream.routing import RouteRequest

if TYPE_CHECKING:
    from proxy.request.exchange import Exchange

logger = logging.getLogger("proxy")

__all__ = ["StreamWatch", "after_relay", "continue_answer", "recomputed_answer", "stream_watch"]


def stream_watch(
    ex: Exchange, inner: Callable[[bytes], bytes] | None, text: str = "", tokens: int = 0
) -> Callable[[bytes], bytes] | None:
    """The relay transform of a streamed answer's first leg: ``inner`` watched for ``recomputed``
    (``text``/``tokens``: what the client already has of the answer), or ``inner`` itself when
    continuations are off (``--max-recomputes 0``) or the request cannot be continued."""
    if ex.router.config.max_recomputes < 1 or unsupported_reason(ex.endpoint, ex.call.body) is not None:
        return inner
    return StreamWatch(inner, Progress(), leg=0, client_usage=_client_usage(ex), text=text, tokens=tokens)


def _client_usage(ex: Exchange) -> bool:
    options = ex.call.body.get("stream_options")
    return isinstance(options, dict) and options.get("include_usage") is True


async def after_relay(
    ex: Exchange, response: web.StreamResponse, transform: Callable[[bytes], bytes] | None
) -> web.StreamResponse:
    """After the relay of a leg: continue the client's stream while D cut it with ``recomputed``."""
    watch = transform
    while isinstance(watch, StreamWatch) and watch.held_open:
        progress = watch.progress
        progress.text += watch.text
        progress.tokens += watch.leg_tokens
        got = await _next_leg(ex, progress, watch.leg_tokens)
        if got is None:
            await response.write_eof(watch.held)
            return response
        attempt, outcome = got
        if not isinstance(outcome, Opened):
            attempt.close()
            logger.error(
                "rid=%s room=%s continuation answered without a stream; the answer ends as is", ex.rid, ex.progress.room
            )
            await response.write_eof(watch.held)
            return response
        watch = StreamWatch(None, progress, leg=progress.continuations, client_usage=_client_usage(ex))
        response = await ex.relay(attempt, outcome, response, watch)
    return response


async def continue_answer(
    ex: Exchange, attempt: Attempt, answered: Answered, first: dict[str, Any]
) -> web.StreamResponse:
    """D's whole answer ``first`` stopped with ``recomputed``: continue it, and answer the client
    once with every leg merged."""
    status, content_type = answered.status, answered.content_type
    progress = Progress(id=first.get("id"))
    legs = [first]
    reason = unsupported_reason(ex.endpoint, ex.call.body)
    if reason is not None:
        logger.warning(
            "rid=%s room=%s D stopped with recomputed; passed on as is: %s", ex.rid, ex.progress.room, reason
        )
    while reason is None and is_recomputed(legs[-1]):
        progress.text += answer_text(legs[-1])
        tokens = answer_tokens(legs[-1])
        progress.tokens += tokens
        got = await _next_leg(ex, progress, tokens)
        if got is None:
            break
        leg_attempt, outcome = got
        answer = parse_answer(outcome.body) if isinstance(outcome, Answered) else None
        if answer is None:
            leg_attempt.close()
            logger.error(
                "rid=%s room=%s continuation's answer is no JSON answer; the answer ends as is",
                ex.rid,
                ex.progress.room,
            )
            break
        legs.append(answer)
        status, content_type = outcome.status, outcome.content_type
    if len(legs) > 1 and not is_recomputed(legs[-1]):
        progress.text += answer_text(legs[-1])
        progress.tokens += answer_tokens(legs[-1])
    body = answered.body if len(legs) == 1 else merged_answer(legs, progress)
    ex.status = status
    ex.progress.ttfb = time.monotonic() - ex.t0
    return passthrough_response(status, body, content_type, ex.out_headers)


async def _next_leg(ex: Exchange, progress: Progress, leg_tokens: int) -> tuple[Attempt, Opened | Answered] | None:
    """The next leg's attempt and D's answer; None (logged) when there is none to be had."""
    config = ex.router.config
    cut_by = ex.progress.attempt.d if ex.progress.attempt is not None else None
    where = cut_by.backend.name if cut_by is not None else "D"
    if progress.continuations >= config.max_recomputes:
        logger.warning(
            "rid=%s room=%s %s stopped with recomputed after %d tokens; %d continuations made "
            "(--max-recomputes), the answer ends as is",
            ex.rid,
            ex.progress.room,
            where,
            progress.tokens,
            progress.continuations,
        )
        return None
    body = continuation_body(ex.endpoint, ex.call.body, progress)
    if body is None:
        logger.warning(
            "rid=%s room=%s %s stopped with recomputed after %d tokens, no token left to generate; "
            "the answer ends as is",
            ex.rid,
            ex.progress.room,
            where,
            progress.tokens,
        )
        return None
    progress.continuations += 1
    if ex.call.stream:
        body["stream_options"] = {**(body.get("stream_options") or {}), "include_usage": True}
    logger.info(
        "rid=%s room=%s %s stopped with recomputed after %d tokens (%d in all); continuation %d/%d: "
        "prompt + %d characters on a fresh pair, max_tokens %s",
        ex.rid,
        ex.progress.room,
        where,
        leg_tokens,
        progress.tokens,
        progress.continuations,
        config.max_recomputes,
        len(progress.text),
        body.get("max_tokens", body.get("max_completion_tokens")),
    )
    call = Call(ex.endpoint, ex.rid, body, ex.call.stream, estimate_prompt_tokens(body), ex.call.headers)
    return await _run_leg(ex, call, cut_by)


async def _run_leg(ex: Exchange, call: Call, cut_by: BackendState | None) -> tuple[Attempt, Opened | Answered] | None:
    """Attempts of one leg on pairs the routing policy picks (fresh rooms; another decoder than
    ``cut_by`` where one is left), up to ``--max-retries``; the first that does not fail."""
    router = ex.router
    config, pool = router.config, router.pool
    tried = Tried(d=set() if cut_by is None else {cut_by})
    if ex.progress.attempt is not None:
        ex.progress.attempt.close()  # the leg before: D is done, P detached
    failure: Failure | None = None
    for number in range(1, config.max_retries + 1):
        ex.progress.room = new_room()
        route = RouteRequest(ex.progress.room, call.tokens, call.body)
        p = pool.pick("prefill", ex.progress.room, tried.p, route)
        d = pool.pick("decode", ex.progress.room, tried.d, route)
        remaining = ex.deadline - time.monotonic()
        if p is None or d is None or remaining <= 0:
            break
        ex.progress.attempts += 1
        ex.progress.attempt = attempt = Attempt(router, call, p, d, ex.progress.room, remaining)
        outcome = await attempt.run()
        if not isinstance(outcome, Failure):
            return attempt, outcome
        failure = outcome
        attempt.close()
        decision = settle(router, ex.endpoint, failure, tried, attempt)
        if not decision.retry:
            break
        logger.warning(
            "rid=%s room=%s continuation attempt %d/%d failed (%s)",
            ex.rid,
            ex.progress.room,
            number,
            config.max_retries,
            failure.error.message,
        )
    logger.error(
        "rid=%s room=%s no pair answered the continuation (%s); the answer ends as is",
        ex.rid,
        ex.progress.room,
        failure.error.message if failure is not None else "no instance or no time left",
    )
    return None
