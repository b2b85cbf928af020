"""The first-token path: the client gets P's own first token as soon as P answers.

For an eligible streamed ``/v1/completions`` request (:func:`proxy.strategies.first_token_body.ineligible_reason`)
:class:`FirstTokenPath` replaces the two-instance attempts (:mod:`proxy.strategies.two_instance`):

1. **P** (retried on other prefillers with fresh rooms while nothing went to the client): prefill,
   sample token 1, keep the KV for the room. Its answer names the prompt's token ids and token 1's.
2. **Token 1 goes to the client** (TTFT = P's answer time plus the Router's hop). When token 1 is the
   whole answer (EOS, a stop token, ``max_tokens`` 1) the stream ends there and a detached
   one-token D request loads, and so frees, P's KV.
3. **D** gets the continuation (prompt ids + token 1, ``prefilled_tokens`` = the prompt's length) and
   its stream is relayed (usage corrected). D failing before its first byte: the continuation is
   retried on another decoder with the same room where D could not be connected to (P still holds
   the KV), else as a normal P+D attempt on another pair with a fresh room (P prefills prompt +
   token 1; what P samples there is not used). A failure after D's first byte ends the stream with an error
   event, as on the two-instance path.

P's answer without token ids (a vLLM that ignores ``return_token_ids``): D gets the client's own
request for the same room and answers from token 1 on, as on the two-instance path.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from proxy.errors import UPSTREAM_UNAVAILABLE, RouterError
from proxy.request.attempt import Call, Cut, Opened
from proxy.request.loop import Next, Won
from proxy.strategies.first_token_body import (
    ContinuationFix,
    DropRepeatedFirst,
    FirstToken,
    FirstTokenFrom,
    continuation_body,
    final_events,
    first_chunk,
    include_usage,
    is_whole_answer,
    parse_first_token,
    prefill_first_body,
    text_may_be_partial,
    wants_token_ids,
)
from proxy.strategies.prefill_watch import WATCH_AFTER_S
from proxy.strategies.recompute import after_relay, stream_watch
from proxy.upstream.calls import Failure, FailureKind, Reply, fetch, http_failure, refused_failure, unresponsive_failure
from proxy.upstream.http1 import encode_json
from proxy.upstream.pool import BackendState

if TYPE_CHECKING:
    from proxy.request.context import RequestContext
    from proxy.server.reply import ClientReply, StreamReply

logger = logging.getLogger("proxy")


@dataclass(frozen=True, slots=True)
class PrefillAnswer:
    """P's answer with token 1: the prefiller that holds the room's KV, and token 1 (None: P's
    answer named no token ids)."""

    p: BackendState
    first: FirstToken | None


@dataclass(frozen=True, slots=True)
class Leg:
    """D's continuation after P's first token: D loads P's KV of ``room`` (the first
    ``prefilled_tokens`` of ``call``'s prompt; None: all of it)."""

    call: Call
    p: BackendState
    d: BackendState
    room: int
    prefilled_tokens: int | None


class FirstTokenPath:
    """One client request on the first-token path, run through its
    :class:`proxy.request.context.RequestContext`: its attempts and their failures through the
    request's :class:`proxy.request.loop.AttemptLoop`, its answer, relay and errors through the context.
    :meth:`run` gives the client's answer, or :attr:`proxy.request.loop.Next.TWO_INSTANCE` when the
    request goes on by two-instance attempts."""

    def __init__(self, ctx: RequestContext) -> None:
        self.ctx = ctx
        self.router = ctx.router
        self.call = ctx.call
        self.loop = ctx.loop
        #: The request's room, attempts and first byte (the exchange's log line reads them).
        self.progress = ctx.progress

    async def run(self) -> ClientReply | Next:
        ctx = self.ctx
        got = await self._first_token()
        if not isinstance(got, PrefillAnswer):
            return got  # the final error answer
        p, first = got.p, got.first
        if first is None:
            logger.warning(
                "rid=%s room=%s %s answered without token ids; D answers from the first token",
                ctx.rid,
                self.progress.room,
                p.backend.name,
            )
            return await self._plain_decode(p)
        if not is_whole_answer(first, self.call.body) and text_may_be_partial(first.text):
            # Token 1 may be the first bytes of a character (byte-level tokenizers): P's text then
            # lacks them and D, seeing them as its prompt, would not print them either. D answers from
            # the first token, from P's KV, as on the two-instance path; P's empty chunk goes first.
            if first.text == "" and not wants_token_ids(self.call.body):
                return await self._empty_first_then_decode(p, first)
            logger.info(
                "rid=%s room=%s token 1's text %r may be a partial character; D answers from the first token",
                ctx.rid,
                self.progress.room,
                first.text,
            )
            return await self._plain_decode(p)
        return await self._stream(p, first)

    # -- 1. P's first token --------------------------------------------------------------------

    async def _first_token(self) -> PrefillAnswer | ClientReply | Next:
        ctx, loop, call = self.ctx, self.loop, self.call
        config = self.router.config
        failure: Failure | None = None
        for number in range(1, config.max_retries + 1):
            if number > 1:
                self.progress.room = loop.next_room()
            await loop.backoff(number)
            p = loop.pick("prefill", call, self.progress.room, loop.tried.p)
            if p is None:
                return ctx.error(RouterError(503, "no prefill instance is available", UPSTREAM_UNAVAILABLE))
            if self.router.pool.alone_with_itself(p, loop.tried.d):
                return Next.TWO_INSTANCE  # a kv_both instance with no other decoder: served by it alone
            remaining = loop.remaining()
            if remaining <= 0:
                break
            self.progress.attempts = number
            outcome = await self._prefill(p, remaining)
            if isinstance(outcome, Reply):
                return PrefillAnswer(p, parse_first_token(outcome.body))
            failure = outcome
            decision = loop.fail_call(failure)
            if not decision.retry or number == config.max_retries:
                break
            logger.warning(
                "rid=%s room=%s prefill attempt %d/%d failed (%s); retrying with a fresh room",
                ctx.rid,
                self.progress.room,
                number,
                config.max_retries,
                failure.error.message,
            )
        if failure is None:
            return ctx.error(
                RouterError(504, "the request timed out before a prefiller answered", UPSTREAM_UNAVAILABLE)
            )
        return ctx.final_failure(failure)

    async def _prefill(self, p: BackendState, timeout: float) -> Reply | Failure:
        router, call = self.router, self.call
        router.metrics.backend_request(call.endpoint, p.backend)
        idle = p.in_flight == 0  # P's answer time is then its prefill time (the path model's sample)
        lease = router.pool.lease(p, call.tokens)
        sent = time.monotonic()
        data = encode_json(prefill_first_body(call.body, self.progress.room))
        nominal = router.config.request_timeout
        task = asyncio.get_running_loop().create_task(
            fetch(router.http, p, "POST", call.endpoint, timeout, data, call.headers, nominal)
        )
        try:
            frozen = await self._watch(p, task)
        finally:
            lease.release()
            if not task.done():
                task.cancel()  # closes P's connection: vLLM aborts the request (when it runs again)
        if frozen is not None:
            return frozen
        reply = task.result()
        if isinstance(reply, Failure):
            return reply
        if reply.status >= 300:
            return http_failure(p, reply.status, reply.body, reply.content_type)
        refused = refused_failure(p, reply.body)
        if refused is None and idle:
            router.paths.observe_prefill(p, call.tokens, (time.monotonic() - sent) * 1000)
        return reply if refused is None else refused

    async def _watch(self, p: BackendState, task: asyncio.Task[Reply | Failure]) -> Failure | None:
        """Wait for P's answer; while it waits, check P is alive (:mod:`proxy.strategies.prefill_watch`). A P
        that does not answer ``/health`` is given up (a retryable failure) where another prefiller
        can take the request; a lone P is waited for."""
        ctx, router = self.ctx, self.router
        alone_logged = False
        while True:
            done, _ = await asyncio.wait({task}, timeout=WATCH_AFTER_S)
            if done:
                return None
            if await router.prefill_watch.alive(p):
                continue
            if task.done():
                return None
            other = self.loop.pick("prefill", self.call, self.progress.room, self.loop.tried.p | {p})
            if other is None or other is p:
                if not alone_logged:
                    logger.warning(
                        "rid=%s room=%s %s does not answer /health; no other prefiller, still waiting",
                        ctx.rid,
                        self.progress.room,
                        p.backend.name,
                    )
                    alone_logged = True
                continue
            message = f"{p.backend.name} stopped answering (its /health did not answer within {router.config.health_timeout:g}s)"
            return unresponsive_failure(p, message)  # marked unhealthy (proxy.request.failure_policy)

    # -- 2 and 3. token 1 to the client, then D ------------------------------------------------

    async def _stream(self, p: BackendState, first: FirstToken) -> ClientReply | Next:
        ctx, call, loop = self.ctx, self.call, self.loop
        prompt_len = len(first.prompt_token_ids)
        cont_body = continuation_body(call.body, first)
        cont = Call(call.endpoint, call.rid, cont_body, True, prompt_len + 1, call.headers, replayed=1)
        room = self.progress.room
        loop.p_holds(p, room, cont, prompt_len)  # released as the request ends unless D takes it over
        if is_whole_answer(first, call.body):
            response = ctx.stream_response(200, "text/event-stream")
            await ctx.open_stream(response)
            await response.write(first_chunk(first, final=True, token_ids=wants_token_ids(call.body)))
            ctx.first_byte(FirstTokenFrom.PREFILL)
            await response.write_eof(final_events(first, include_usage(call.body)))
            return response
        token_1 = first_chunk(first, final=False, token_ids=wants_token_ids(call.body))
        opened = await self._token_1_then_decoder(p, cont, room, token_1, FirstTokenFrom.PREFILL)
        if not isinstance(opened, tuple):
            return opened
        d, response = opened
        fix = stream_watch(ctx, ContinuationFix(include_usage(call.body), wants_token_ids(call.body)), first.text, 1)
        return await self._continue(Leg(cont, p, d, room, prompt_len), response, fix)

    async def _token_1_then_decoder(
        self, p: BackendState, pick_for: Call, room: int, token_1: bytes, source: FirstTokenFrom
    ) -> tuple[BackendState, StreamReply] | ClientReply | Next:
        """The decoder that continues after token 1 (picked for ``pick_for``), and the client's stream
        opened with ``token_1``'s chunk; or the answer instead: 503 with no decoder, D serving the
        client's own request when it refused this pair (:meth:`_plain_decode`)."""
        ctx, loop = self.ctx, self.loop
        d = loop.pick("decode", pick_for, room, loop.tried.d)
        if d is None:
            return ctx.error(RouterError(503, "no decode instance is available", UPSTREAM_UNAVAILABLE))
        if self.router.pair_refusals.refused(p, d):
            return await self._plain_decode(p)
        response = ctx.stream_response(200, "text/event-stream")
        await ctx.open_stream(response)
        await response.write(token_1)
        ctx.first_byte(source)
        return d, response

    async def _continue(self, leg: Leg, response: StreamReply, fix: Callable[[bytes], bytes] | None) -> ClientReply:
        """D's continuation (``leg``: D loads P's KV of its room): relayed on success; retried while D
        sent nothing: on another decoder with the same room where D never reached P, else as a P+D
        attempt on a fresh pair."""
        ctx, loop = self.ctx, self.loop
        call, p, d, room = leg.call, leg.p, leg.d, leg.room
        attempt = loop.new_attempt(call, p, d, room, p_answered=True, prefilled_tokens=leg.prefilled_tokens)
        while True:
            got = await loop.run(attempt, same_room=True)
            if isinstance(got, Won):
                if isinstance(got.outcome, Opened):
                    try:
                        return await after_relay(ctx, await ctx.relay(got, response, fix), fix)
                    except ConnectionResetError:
                        raise asyncio.CancelledError from None  # the client went away
                error = RouterError(502, "decoder sent no stream", "decode_failed")  # a stream is always Opened
                got = loop.fail(attempt, Failure(d, FailureKind.EMPTY, error, False), same_room=True)
            failure = got.failure
            if not loop.may_retry(got.decision):
                break
            await loop.backoff(loop.count())
            if got.same_room_d is not None:
                # D never reached P: P still holds the room's KV; another decoder loads it.
                logger.warning(
                    "rid=%s room=%s %s unreachable after the first token (%s); the same room on %s",
                    ctx.rid,
                    room,
                    d.backend.name,
                    failure.error.message,
                    got.same_room_d.backend.name,
                )
                d = got.same_room_d
                attempt = loop.new_attempt(call, p, d, room, p_answered=True, prefilled_tokens=leg.prefilled_tokens)
                continue
            fresh = loop.next_room()
            next_p = loop.pick("prefill", call, fresh, loop.tried.p)
            next_d = loop.pick("decode", call, fresh, loop.tried.d)
            if next_p is None or next_d is None:
                break
            logger.warning(
                "rid=%s room=%s decode after the first token failed (%s); retrying the continuation on %s + %s",
                ctx.rid,
                fresh,
                failure.error.message,
                next_p.backend.name,
                next_d.backend.name,
            )
            p, d, room = next_p, next_d, fresh
            attempt = loop.new_attempt(call, p, d, room)
        ctx.stream_cut(Cut(failure, p, d, call, None))  # the last attempt closed by loop.fail
        await response.write(failure.error.to_sse())
        await response.write_eof()
        return response

    async def _empty_first_then_decode(self, p: BackendState, first: FirstToken) -> ClientReply | Next:
        """Token 1 has no text yet: its empty chunk goes to the client at once (as one instance
        sends it), then D answers the client's own request from P's KV; D's own first token, the
        same empty chunk again, is dropped (:class:`proxy.strategies.first_token_body.DropRepeatedFirst`)."""
        ctx, call, loop = self.ctx, self.call, self.loop
        prompt_len = len(first.prompt_token_ids)
        cont = Call(call.endpoint, call.rid, continuation_body(call.body, first), True, prompt_len + 1, call.headers)
        room = self.progress.room
        loop.p_holds(p, room, cont, prompt_len)  # released as the request ends unless D takes it over
        opened = await self._token_1_then_decoder(
            p, call, room, first_chunk(first, final=False), FirstTokenFrom.PREFILL_EMPTY
        )
        if not isinstance(opened, tuple):
            return opened
        d, response = opened
        return await self._continue(
            Leg(call, p, d, room, None), response, stream_watch(ctx, DropRepeatedFirst(), first.text, 1)
        )

    async def _plain_decode(self, p: BackendState) -> ClientReply | Next:
        """D serves the client's own request from P's KV, its answer or error going to the client as
        it is: P's answer had no token ids, token 1 may be a partial character, or D refused this pair.
        A retryable failure leaves the request to two-instance attempts while attempts are left."""
        ctx, loop = self.ctx, self.loop
        room = self.progress.room
        loop.p_holds(p, room, self.call, None)  # released as the request ends unless D takes it over
        d = loop.pick("decode", self.call, room, loop.tried.d)
        if d is None:
            return ctx.error(RouterError(503, "no decode instance is available", UPSTREAM_UNAVAILABLE))
        got = await loop.run(loop.new_attempt(self.call, p, d, room, p_answered=True))
        if isinstance(got, Won):
            return await ctx.answer(got)
        if not got.decision.retry or not loop.attempts_left():
            return ctx.final_failure(got.failure)
        return Next.TWO_INSTANCE
