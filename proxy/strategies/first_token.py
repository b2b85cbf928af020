"""The first-token path: the client gets P's own first token as soon as P answers.

For an eligible streamed ``/v1/completions`` request (:func:`proxy.strategies.first_token_body.ineligible_reason`)
:class:`FirstTokenPath` replaces the two-instance attempts of :class:`proxy.request.exchange.Exchange`:

1. **P** (retried on other prefillers with fresh rooms while nothing went to the client): prefill,
   sample token 1, keep the KV for the room. Its answer names the prompt's token ids and token 1's.
2. **Token 1 goes to the client** (TTFT = P's answer time plus the Router's hop). When token 1 is the
   whole answer (EOS, a stop token, ``max_tokens`` 1) the stream ends there and a detached
   one-token D request loads, and so frees, P's KV.
3. **D** gets the continuation (prompt ids + token 1, ``prefilled_tokens`` = the prompt's length) and
   its stream is relayed (usage corrected). D failing before its first byte: the continuation is
   retried as a normal P+D attempt on another pair with a fresh room (P prefills prompt + token 1;
   what P samples there is not used). A failure after D's first byte ends the stream with an error
   event, as on the two-instance path.

P's answer without token ids (a vLLM that ignores ``return_token_ids``): D gets the client's own
request for the same room and answers from token 1 on, as on the two-instance path.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from aiohttp import web

from proxy.errors import UPSTREAM_UNAVAILABLE, RouterError
from proxy.request.attempt import Attempt, Call, Opened
from proxy.request.failure_policy import Decision, Tried, settle
from proxy.request.payloads import new_room
from proxy.request.room_release import release_attempt_room, release_room
from proxy.server.reply import ClientReply
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
from proxy.upstream.routing import RouteRequest

if TYPE_CHECKING:
    from proxy.request.exchange import Exchange

logger = logging.getLogger("proxy")


class FirstTokenPath:
    """One client request on the first-token path: its attempts go in the request's
    :class:`proxy.request.progress.RequestProgress`, their failures through :mod:`proxy.request.failure_policy`;
    its :class:`proxy.request.exchange.Exchange` answers errors, relays streams and writes the log line."""

    def __init__(self, exchange: Exchange) -> None:
        self.ex = exchange
        self.router = exchange.router
        self.call = exchange.call
        #: The request's room, attempts and first byte (the exchange's log line reads them).
        self.progress = exchange.progress
        #: The instances that failed this request.
        self.tried = Tried()

    async def run(self) -> web.StreamResponse:
        ex = self.ex
        got = await self._first_token()
        if isinstance(got, ClientReply):
            return got  # the final error answer
        p, reply, first = got
        if first is None:
            logger.warning(
                "rid=%s room=%s %s answered without token ids; D answers from the first token",
                ex.rid,
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
                ex.rid,
                self.progress.room,
                first.text,
            )
            return await self._plain_decode(p)
        return await self._stream(p, first)

    # -- 1. P's first token --------------------------------------------------------------------

    async def _first_token(self) -> tuple[BackendState, Reply, FirstToken | None] | web.StreamResponse:
        ex, router, call = self.ex, self.router, self.call
        config, pool = router.config, router.pool
        failure: Failure | None = None
        for number in range(1, config.max_retries + 1):
            if number > 1:
                router.metrics.retry(ex.endpoint)
                self.progress.room = new_room()
                delay = config.retry_delay * 2 ** (number - 2)
                if delay > 0:
                    await asyncio.sleep(delay)
            p = pool.pick(
                "prefill", self.progress.room, self.tried.p, RouteRequest(self.progress.room, call.tokens, call.body)
            )
            if p is None:
                return ex.error(RouterError(503, "no prefill instance is available", UPSTREAM_UNAVAILABLE))
            remaining = ex.deadline - time.monotonic()
            if remaining <= 0:
                break
            self.progress.attempts = number
            outcome = await self._prefill(p, remaining)
            if isinstance(outcome, Reply):
                return p, outcome, parse_first_token(outcome.body)
            failure = outcome
            decision = settle(router, call.endpoint, failure, self.tried)
            if not decision.retry or number == config.max_retries:
                break
            logger.warning(
                "rid=%s room=%s prefill attempt %d/%d failed (%s); retrying with a fresh room",
                ex.rid,
                self.progress.room,
                number,
                config.max_retries,
                failure.error.message,
            )
        if failure is None:
            return ex.error(RouterError(504, "the request timed out before a prefiller answered", UPSTREAM_UNAVAILABLE))
        return ex.final_failure(failure)

    async def _prefill(self, p: BackendState, timeout: float) -> Reply | Failure:
        router, call = self.router, self.call
        router.metrics.backend_request(call.endpoint, p.backend)
        lease = router.pool.lease(p, call.tokens)
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
        return reply if refused is None else refused

    async def _watch(self, p: BackendState, task: asyncio.Task[Reply | Failure]) -> Failure | None:
        """Wait for P's answer; while it waits, check P is alive (:mod:`proxy.strategies.prefill_watch`). A P
        that does not answer ``/health`` is given up (a retryable failure) where another prefiller
        can take the request; a lone P is waited for."""
        ex, router = self.ex, self.router
        alone_logged = False
        while True:
            done, _ = await asyncio.wait({task}, timeout=WATCH_AFTER_S)
            if done:
                return None
            if await router.prefill_watch.alive(p):
                continue
            if task.done():
                return None
            route = RouteRequest(self.progress.room, self.call.tokens, self.call.body)
            other = router.pool.pick("prefill", self.progress.room, self.tried.p | {p}, route)
            if other is None or other is p:
                if not alone_logged:
                    logger.warning(
                        "rid=%s room=%s %s does not answer /health; no other prefiller, still waiting",
                        ex.rid,
                        self.progress.room,
                        p.backend.name,
                    )
                    alone_logged = True
                continue
            message = f"{p.backend.name} stopped answering (its /health did not answer within {router.config.health_timeout:g}s)"
            return unresponsive_failure(p, message)  # marked unhealthy (proxy.request.failure_policy)

    # -- 2 and 3. token 1 to the client, then D ------------------------------------------------

    async def _stream(self, p: BackendState, first: FirstToken) -> web.StreamResponse:
        ex, call = self.ex, self.call
        prompt_len = len(first.prompt_token_ids)
        cont_body = continuation_body(call.body, first)
        cont = Call(call.endpoint, call.rid, cont_body, True, prompt_len + 1, call.headers, replayed=1)
        response = ex.stream_response(200, "text/event-stream")
        if is_whole_answer(first, call.body):
            self._release_room(p, cont, prompt_len)
            await response.prepare(ex.request)
            await response.write(first_chunk(first, final=True, token_ids=wants_token_ids(call.body)))
            self.progress.ttfb = time.monotonic() - ex.t0
            self.progress.first_token_from = FirstTokenFrom.PREFILL
            await response.write_eof(final_events(first, include_usage(call.body)))
            return response
        d = await self._pick_d(p, RouteRequest(self.progress.room, cont.tokens, cont_body), cont, prompt_len)
        if isinstance(d, ClientReply):
            return d
        try:
            await response.prepare(ex.request)
            await response.write(first_chunk(first, final=False, token_ids=wants_token_ids(call.body)))
        except BaseException:
            self._release_room(p, cont, prompt_len)  # the client left before D was asked
            raise
        self.progress.ttfb = time.monotonic() - ex.t0
        self.progress.first_token_from = FirstTokenFrom.PREFILL
        remaining = ex.deadline - time.monotonic()
        attempt = Attempt(
            self.router, cont, p, d, self.progress.room, remaining, p_answered=True, prefilled_tokens=prompt_len
        )
        fix = stream_watch(ex, ContinuationFix(include_usage(call.body), wants_token_ids(call.body)), first.text, 1)
        return await self._continue(attempt, response, fix)

    async def _continue(
        self, attempt: Attempt, response: web.StreamResponse, fix: Callable[[bytes], bytes] | None
    ) -> web.StreamResponse:
        """D's continuation: relayed on success; retried as a P+D attempt while D sent nothing."""
        ex, router = self.ex, self.router
        config, pool = router.config, router.pool
        while True:
            self.progress.attempt = attempt
            outcome = await attempt.run()
            if isinstance(outcome, Opened):
                try:
                    return await after_relay(ex, await ex.relay(attempt, outcome, response, fix), fix)
                except ConnectionResetError:
                    raise asyncio.CancelledError from None  # the client went away
            if not isinstance(outcome, Failure):  # a streamed request is always Opened
                outcome = Failure(
                    attempt.d, FailureKind.EMPTY, RouterError(502, "decoder sent no stream", "decode_failed"), False
                )
            failure = outcome
            attempt.close()
            decision = settle(router, self.call.endpoint, failure, self.tried, attempt)
            remaining = ex.deadline - time.monotonic()
            if not decision.retry or self.progress.attempts >= config.max_retries or remaining <= 0:
                if decision.release_room:
                    release_attempt_room(router, attempt)
                break
            self.progress.attempts += 1
            router.metrics.retry(ex.endpoint)
            if (other := self._other_d(attempt, decision)) is not None:
                # D never reached P: P still holds the room's KV; another decoder loads it.
                logger.warning(
                    "rid=%s room=%s %s unreachable after the first token (%s); the same room on %s",
                    ex.rid,
                    self.progress.room,
                    attempt.d.backend.name,
                    failure.error.message,
                    other.backend.name,
                )
                attempt = Attempt(
                    router, attempt.call, attempt.p, other, self.progress.room, remaining,
                    p_answered=True, prefilled_tokens=attempt.prefilled_tokens,
                )  # fmt: skip
                continue
            if decision.release_room:
                release_attempt_room(router, attempt)
            self.progress.room = new_room()
            route = RouteRequest(self.progress.room, attempt.call.tokens, attempt.call.body)
            p = pool.pick("prefill", self.progress.room, self.tried.p, route)
            d = pool.pick("decode", self.progress.room, self.tried.d, route)
            if p is None or d is None:
                break
            logger.warning(
                "rid=%s room=%s decode after the first token failed (%s); retrying the continuation on %s + %s",
                ex.rid,
                self.progress.room,
                failure.error.message,
                p.backend.name,
                d.backend.name,
            )
            attempt = Attempt(router, attempt.call, p, d, self.progress.room, remaining)
        ex.stream_cut(attempt, failure)
        await response.write(failure.error.to_sse())
        await response.write_eof()
        return response

    def _other_d(self, attempt: Attempt, decision: Decision) -> BackendState | None:
        """Another decoder for the same room, when ``attempt`` ran D only (P had answered) and D could
        not be connected to (``decision.same_room_other_d``); None otherwise or when every decoder
        failed this request."""
        if not decision.same_room_other_d:
            return None
        route = RouteRequest(self.progress.room, attempt.call.tokens, attempt.call.body)
        other = self.router.pool.pick("decode", self.progress.room, self.tried.d, route)
        return None if other is None or other in self.tried.d else other

    async def _empty_first_then_decode(self, p: BackendState, first: FirstToken) -> web.StreamResponse:
        """Token 1 has no text yet: its empty chunk goes to the client at once (as one instance
        sends it), then D answers the client's own request from P's KV; D's own first token, the
        same empty chunk again, is dropped (:class:`proxy.strategies.first_token_body.DropRepeatedFirst`)."""
        ex, call = self.ex, self.call
        prompt_len = len(first.prompt_token_ids)
        cont = Call(call.endpoint, call.rid, continuation_body(call.body, first), True, prompt_len + 1, call.headers)
        d = await self._pick_d(p, RouteRequest(self.progress.room, call.tokens, call.body), cont, prompt_len)
        if isinstance(d, ClientReply):
            return d
        response = ex.stream_response(200, "text/event-stream")
        try:
            await response.prepare(ex.request)
            await response.write(first_chunk(first, final=False))
        except BaseException:
            self._release_room(p, cont, prompt_len)  # the client left before D was asked
            raise
        self.progress.ttfb = time.monotonic() - ex.t0
        self.progress.first_token_from = FirstTokenFrom.PREFILL_EMPTY
        remaining = ex.deadline - time.monotonic()
        attempt = Attempt(self.router, call, p, d, self.progress.room, remaining, p_answered=True)
        return await self._continue(attempt, response, stream_watch(ex, DropRepeatedFirst(), first.text, 1))

    async def _pick_d(
        self, p: BackendState, route: RouteRequest, cont: Call, prompt_len: int
    ) -> BackendState | web.StreamResponse:
        """D for the rest of the answer, or the client's answer when there is none to stream from:
        503 when no decoder is available (P's KV for the room is released through ``cont`` should a
        decoder be back; else room_timeout_s frees it), or D's own answer, passed on as it is, when D
        refused P's KV lately (:mod:`proxy.upstream.pair_refusals`)."""
        d = self.router.pool.pick("decode", self.progress.room, self.tried.d, route)
        if d is None:
            self._release_room(p, cont, prompt_len)
            return self.ex.error(RouterError(503, "no decode instance is available", UPSTREAM_UNAVAILABLE))
        if self.router.pair_refusals.refused(p, d):
            return await self._plain_decode(p)
        return d

    async def _plain_decode(self, p: BackendState) -> web.StreamResponse:
        """D serves the client's own request from P's KV, its answer or error going to the client as
        it is: P's answer had no token ids, token 1 may be a partial character, or D refused this pair."""
        ex = self.ex
        d = self.router.pool.pick(
            "decode",
            self.progress.room,
            self.tried.d,
            RouteRequest(self.progress.room, self.call.tokens, self.call.body),
        )
        if d is None:
            return ex.error(RouterError(503, "no decode instance is available", UPSTREAM_UNAVAILABLE))
        attempt = Attempt(
            self.router, self.call, p, d, self.progress.room, ex.deadline - time.monotonic(), p_answered=True
        )
        self.progress.attempt = attempt
        outcome = await attempt.run()
        if not isinstance(outcome, Failure):
            return await ex.answer(attempt, outcome)
        attempt.close()
        decision = settle(self.router, self.call.endpoint, outcome, self.tried, attempt)
        if decision.release_room:
            release_attempt_room(self.router, attempt)
        if not decision.retry or self.progress.attempts >= self.router.config.max_retries:
            return ex.final_failure(outcome)
        return await ex.pair_attempts(self.progress.attempts + 1, self.tried)

    def _release_room(self, p: BackendState, cont: Call, prompt_len: int) -> None:
        """P holds the room's KV for a D that will not come: freed now (:mod:`proxy.request.room_release`)."""
        release_room(self.router, p, self.progress.room, cont, prompt_len)
