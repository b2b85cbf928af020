"""One client generation request: :func:`generate` and its :class:`Exchange`.

:func:`generate` validates the body and claims its room; the :class:`Exchange` then serves the request:
its attempts belong to its :class:`proxy.request.loop.AttemptLoop` (rooms, counts, backoff, failures),
a strategy runs them (:func:`proxy.strategies.two_instance.two_instance`, or
:class:`proxy.strategies.first_token.FirstTokenPath` for eligible streamed completions: P's own first
token first), and the exchange answers the client: D's JSON, or D's stream relayed byte for byte
(:meth:`Exchange.relay`, which hands a cut stream to :mod:`proxy.strategies.resume`). The exchange is
the strategies' :class:`proxy.request.context.RequestContext`; the client's answers are made in
:meth:`Exchange.stream_response` and :meth:`Exchange.answered` alone (errors: :mod:`proxy.errors`). Its
``finally`` closes the loop (the current attempt, the request's rooms) and writes the request's one
INFO log line.

The handler task is cancelled only by the Router's server (:mod:`proxy.server.hot_server`, or aiohttp
for what it hands over), when the client goes away: the exchange then closes both backend
requests (vLLM aborts them) and has every room of the request released on its prefiller's bootstrap
server at once (:meth:`proxy.request.loop.AttemptLoop.client_left`): P frees the KV even when its
decoder never saw the request.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from aiohttp import web

from pd_connector.trace import PhaseTrace
from proxy.errors import (
    CLIENT_DISCONNECTED,
    INTERNAL_ERROR,
    RouterError,
    error_response,
)
from proxy.planning.live import Decided
from proxy.request.attempt import Answered, Attempt, Call, Cut, Opened
from proxy.request.incoming import backend_headers, read_json, request_id
from proxy.request.loop import AttemptLoop, Next, Won
from proxy.request.payloads import check_prefill_dp_rank, estimate_prompt_tokens, resolve_room, validate_body
from proxy.request.progress import RequestProgress
from proxy.router_state import Router
from proxy.server.reply import BodyReply, ClientReply, StreamReply
from proxy.strategies.first_token import FirstTokenPath
from proxy.strategies.first_token_body import FirstTokenFrom, ineligible_reason
from proxy.strategies.local import local_prefill
from proxy.strategies.recompute import StreamWatch, after_relay, continue_answer, recomputed_answer, stream_watch
from proxy.strategies.resume import mid_stream_error, resume_stream
from proxy.strategies.resume_body import StreamTracker
from proxy.strategies.two_instance import two_instance
from proxy.upstream.calls import Failure, exception_failure, passthrough_response
from proxy.upstream.http1 import UpstreamError

logger = logging.getLogger("proxy")

#: Status recorded (nginx convention) when the client went away before the answer ended.
CLIENT_CLOSED_REQUEST = 499


async def generate(router: Router, request: web.Request, endpoint: str) -> ClientReply:
    """Serve ``POST /v1/completions`` and ``POST /v1/chat/completions``."""
    t0 = time.monotonic()
    rid = request_id(request)
    try:
        body = await read_json(request, router.config.max_body_size)
        validate_body(body, endpoint)
        check_prefill_dp_rank(body, [s.backend.dp_rank for s in router.pool.active["prefill"]])
        room = resolve_room(body, router.rooms.rng, trust_client=router.config.trust_client_room)
        router.rooms.claim(room)  # given back when the request ends (AttemptLoop.close)
    except RouterError as error:
        logger.warning("rid=%s POST %s rejected: HTTP %d %s", rid, endpoint, error.status, error.message)
        router.metrics.error(endpoint, error.error_type)
        router.metrics.request_done(endpoint, error.status, None, time.monotonic() - t0)
        return error.to_response({"X-Request-Id": rid})
    tokens = estimate_prompt_tokens(body)
    call = Call(
        endpoint,
        rid,
        body,
        body.get("stream") is True,
        tokens,
        backend_headers(request, rid, router.config.backend_authorization),
    )
    return await Exchange(router, request, call, room, t0).run()


class Exchange:
    """One client generation request: its attempts, its answer, its cleanup and its log line."""

    def __init__(self, router: Router, request: web.Request, call: Call, room: int, t0: float) -> None:
        self.router = router
        self.request = request
        self.call = call
        self.endpoint = call.endpoint
        self.rid = call.rid
        #: The request's attempts, whichever strategy runs them.
        self.loop = AttemptLoop(router, call, room, t0)
        self.t0 = t0
        self.out_headers = {"X-Request-Id": call.rid}
        self.status = 0
        #: The last bytes relayed to the client; a stream whose tail is ``data: [DONE]`` is complete
        #: even if the client hangs up before the Router ends the chunked body.
        self._tail = b""
        #: the error type a begun stream was ended with (its status stays the 200 already sent)
        self.stream_error: str | None = None
        #: The request's path choice (``--path-policy``), once made.
        self.decided: Decided | None = None
        self._decided_at = 0.0

    @property
    def progress(self) -> RequestProgress:
        """The request's room, attempts and first byte (its loop's)."""
        return self.loop.progress

    # -- the whole request ------------------------------------------------------------------

    @property
    def sent_done_event(self) -> bool:
        """Whether the client already has the stream's final ``data: [DONE]`` event."""
        return self._tail.rstrip().endswith(b"data: [DONE]")

    async def run(self) -> ClientReply:
        try:
            return await self._attempts()
        except asyncio.CancelledError:
            if self.sent_done_event:
                logger.debug("rid=%s room=%s client closed the connection after [DONE]", self.rid, self.progress.room)
                raise
            self.status = CLIENT_CLOSED_REQUEST
            self.router.metrics.error(self.endpoint, CLIENT_DISCONNECTED)
            when = "mid-stream" if self.progress.ttfb is not None else "before the answer"
            logger.warning(
                "rid=%s room=%s client disconnected %s; closing the backend requests and releasing P's rooms",
                self.rid,
                self.progress.room,
                when,
            )
            self.loop.client_left(f"client disconnected {when}")  # close() releases its rooms on P
            raise
        except Exception as exc:
            logger.exception("rid=%s room=%s unexpected error", self.rid, self.progress.room)
            self.status = 500
            self.router.metrics.error(self.endpoint, INTERNAL_ERROR)
            if self.progress.ttfb is not None:
                raise
            return error_response(500, f"internal Router error: {type(exc).__name__}", INTERNAL_ERROR, self.out_headers)
        finally:
            self.loop.close()
            self._log_done()

    def _log_done(self) -> None:
        elapsed = time.monotonic() - self.t0
        attempt = self.loop.current
        if self.decided is not None and attempt is not None and self.status < 300:
            self.router.paths.computed(self.decided, None if attempt.local else attempt.p, attempt.d)
        self.router.metrics.request_done(self.endpoint, self.status, self.progress.ttfb, elapsed)
        if not logger.isEnabledFor(logging.INFO):
            return  # nor build the phase trace
        # One line a request (its phase trace, pd_connector.trace's summary, at its end): logging
        # is a large share of the Router's time per request.
        logger.info(
            "rid=%s room=%s POST %s stream=%s path=%s P=%s D=%s status=%d attempts=%d ttfb_ms=%s total_ms=%.1f "
            "first=%s%s%s",
            self.rid,
            self.progress.room,
            self.endpoint,
            self.call.stream,
            self._path_text(),
            attempt.p.backend.address if attempt and not attempt.local else "-",
            attempt.d.backend.address if attempt else "-",
            self.status,
            self.progress.attempts,
            f"{self.progress.ttfb * 1000:.1f}" if self.progress.ttfb is not None else "-",
            elapsed * 1000,
            self.progress.first_token_from.value,
            " moved=" + ">".join(self.progress.decoders)
            if self.progress.decoders
            else "",  # resumed (proxy.strategies.resume)
            "" if attempt is None else " | " + self._phase_trace(attempt, elapsed).line(),
        )

    def _path_text(self) -> str:
        """The path and why, with the predicted TTFT when the policy predicted one (``pd(policy)``,
        ``local(lower_ttft) predicted_ttft_ms=41.2``)."""
        decided = self.decided
        if decided is None:
            return "-"
        choice = decided.choice
        text = f"{choice.path.value}({choice.reason})"
        if choice.predicted_ttft_ms is not None:
            text += f" predicted_ttft_ms={choice.predicted_ttft_ms:.1f}"
        return text

    def _phase_trace(self, attempt: Attempt, elapsed: float) -> PhaseTrace:
        """The request's phases as the Router saw them (pd_connector.trace's summary line)."""
        received = time.time() - elapsed
        if self.stream_error is not None:
            outcome = f"stream_error:{self.stream_error}"
        else:
            outcome = "ok" if self.status < 300 else f"http_{self.status}"
        trace = PhaseTrace("router", attempt.room, self.rid, outcome=outcome)
        trace.mark("received", received)
        if self.decided is not None:  # path_pd, path_delta or path_local (--path-policy)
            trace.mark(f"path_{self.decided.choice.path.value}", self._decided_at)
        if attempt.p_answered_at is not None:
            trace.mark("p_answered", attempt.p_answered_at)
        for phase, at in self.progress.moves:  # a stream resumed on another decoder (proxy.strategies.resume)
            trace.mark(phase, at)
        if self.progress.ttfb is not None:
            trace.mark("d_first_byte", received + self.progress.ttfb)
        trace.mark("done", received + elapsed)
        return trace

    async def _attempts(self) -> ClientReply:
        """The request's path (``--path-policy``), its strategy, then the one it hands the request to
        (:class:`proxy.request.loop.Next`)."""
        first_token = (
            self.router.config.first_token_from_prefill and ineligible_reason(self.endpoint, self.call.body) is None
        )
        self.decided = decided = self._decide(first_token)
        self._decided_at = time.time()
        if decided.choice.local:
            got = await local_prefill(self, decided)
            if got is not Next.TWO_INSTANCE:
                return got
            first_token = False
        if first_token:
            got = await FirstTokenPath(self).run()
            if got is not Next.TWO_INSTANCE:
                return got
        return await two_instance(self)

    def _decide(self, first_token: bool) -> Decided:
        """Where the request prefills, for the pair routing picks (:mod:`proxy.planning.live`)."""
        paths = self.router.paths
        if paths.name == "always-pd":
            return paths.pd_only()
        loop, room = self.loop, self.progress.room
        p = loop.pick("prefill", self.call, room, ())
        d = loop.pick("decode", self.call, room, ())
        loop.plan(room, p, d)  # the attempts start on this pair
        return paths.decide(self.call.body, self.call.tokens, p, d, first_token_from_p=first_token)

    # -- answers -------------------------------------------------------------------------------

    def error(self, error: RouterError) -> BodyReply:
        """The client's answer for a Router-side error (counted and logged)."""
        self.status = error.status
        self.router.metrics.error(self.endpoint, error.error_type)
        logger.error("rid=%s room=%s answering HTTP %d: %s", self.rid, self.progress.room, error.status, error.message)
        return error.to_response(self.out_headers)

    def final_failure(self, failure: Failure) -> BodyReply:
        """The client's answer once no attempt is left: the last failure (a backend's own HTTP
        error passed through where it has one)."""
        self.status = failure.passthrough[0] if failure.passthrough else failure.error.status
        self.router.metrics.error(self.endpoint, failure.error.error_type)
        logger.error(
            "rid=%s room=%s answering HTTP %d after %d attempt(s): %s",
            self.rid,
            self.progress.room,
            self.status,
            self.progress.attempts,
            failure.error.message,
        )
        return failure.response(self.out_headers)

    async def answer(self, won: Won) -> ClientReply:
        """D's answer to the client: a whole JSON answer as it is, a stream through :meth:`relay`."""
        outcome = won.outcome
        if isinstance(outcome, Answered):
            if self.router.config.max_recomputes and (cut := recomputed_answer(outcome.body)) is not None:
                return await continue_answer(self, outcome, cut)
            return self.answered(outcome.status, outcome.body, outcome.content_type)
        try:
            watch = stream_watch(self, None)
            return await after_relay(self, await self.relay(won, transform=watch), watch)
        except ConnectionResetError:
            raise asyncio.CancelledError from None  # the client went away

    def answered(self, status: int, body: bytes, content_type: str) -> BodyReply:
        """A whole answer for the client, as it is (its first byte is now)."""
        self.status = status
        self.first_byte()
        reply = passthrough_response(status, body, content_type, self.out_headers)
        reply.usage_path = self.usage_path  # usage.pd_kv.path (proxy.server.reply)
        return reply

    def usage_path(self) -> str:
        """The path the answer took, for its ``usage.pd_kv.path``: ``local`` (D prefilled it), else the
        path choice's (``pd``, ``delta``), ``pd`` without one."""
        attempt = self.loop.current
        if attempt is not None and attempt.local:
            return "local"
        choice = self.decided.choice if self.decided is not None else None
        return "pd" if choice is None or choice.local else choice.path.value

    def first_byte(self, source: FirstTokenFrom | None = None) -> None:
        """The client got the answer's first byte now (``source``: who sent its first token)."""
        if self.progress.ttfb is None:
            self.progress.ttfb = time.monotonic() - self.t0
            decided = self.decided
            if decided is not None and self.call.stream and 0 < self.status < 300 and self.progress.attempts == 1:
                self.router.paths.observe_ttft(decided, self.progress.ttfb * 1000)  # the path's TTFT correction
        if source is not None:
            self.progress.first_token_from = source

    async def open_stream(self, response: StreamReply) -> None:
        """Send ``response``'s status and headers to the client."""
        await response.prepare(self.request)

    def stream_response(self, status: int, content_type: str | None) -> ClientReply:
        """The client's streamed answer (not yet prepared)."""
        self.status = status
        headers = {
            "Content-Type": content_type or "text/event-stream",
            "Cache-Control": "no-cache",
            "X-Request-Id": self.rid,
        }
        reply = StreamReply(status, headers)
        reply.usage_path = self.usage_path  # usage.pd_kv.path (proxy.server.reply)
        return reply

    async def relay(
        self,
        won: Won,
        response: StreamReply | None = None,
        transform: Callable[[bytes], bytes] | None = None,
        tracker: StreamTracker | None = None,
    ) -> ClientReply:
        """Send the stream of the attempt that ``won`` to the client (unchanged, or through
        ``transform``) on ``response`` (prepared already, or a new one); if P or D fails, the loop
        closes the attempt (:meth:`proxy.request.loop.AttemptLoop.cut`) and the stream is resumed on
        another decoder (:mod:`proxy.strategies.resume`, through ``tracker``: a resumed leg's, else one
        made here for a resumable request) or ended with an error event. A
        :class:`proxy.strategies.recompute.StreamWatch` transform that saw ``recomputed`` leaves it open."""
        attempt, opened = won.attempt, won.outcome
        if not isinstance(opened, Opened):
            raise TypeError(f"relay of an attempt with no open stream: {type(opened).__name__}")
        watch = transform if isinstance(transform, StreamWatch) else None
        if tracker is None and attempt.resumable:
            tracker = StreamTracker(attempt.call)
        if tracker is not None:  # movable if its decoder drains (proxy.admin.drain)
            kv_room = attempt.migrate_room if attempt.holds_kv_for_move() else None
            self.router.drains.track(self, attempt.d, tracker, attempt, attempt.room, kv_room)
        upstream = opened.response
        failure: Failure | None = None
        eof_sent = False
        chunk = opened.first
        if response is None:
            response = self.stream_response(upstream.status, upstream.content_type)
            await self.open_stream(response)
        chunks, opened_at = 0, time.monotonic()  # D's inter-token latency, for the path choice
        while True:
            chunks += 1
            if tracker is not None:
                chunk = tracker.feed(chunk, end=upstream.at_eof())
                if tracker.error is not None:
                    await response.write(transform(chunk) if transform is not None else chunk)
                    failure = mid_stream_error(attempt.d, tracker.error)
                    break
            if transform is not None:
                chunk = transform(chunk)
            if upstream.at_eof() and attempt.late_p_failure is None and not (watch and watch.recomputed):
                # The end of D's stream came with this chunk: send both in one write.
                await response.write_eof(chunk)
                eof_sent = True
            else:
                await response.write(chunk)
            self._tail = (self._tail + chunk)[-64:]
            if self.progress.ttfb is None:
                self.first_byte()
            if eof_sent:
                break
            try:
                chunk = await upstream.next_chunk()
            except UpstreamError as exc:
                failure = exception_failure(attempt.d, exc, self.router.config.request_timeout)
                break
            if not chunk:
                break
        if eof_sent:
            failure = None
        elif attempt.late_p_failure is not None:
            failure = attempt.late_p_failure
        if failure is None:
            if chunks > 2:
                self.router.paths.observe_itl(attempt.d, (time.monotonic() - opened_at) * 1000 / (chunks - 1))
            self.loop.finished(attempt)
            if watch is not None and watch.recomputed:
                watch.held_open = True
                return response  # proxy.strategies.recompute continues it
        else:
            cut = Cut(failure, attempt.p, attempt.d, attempt.call, attempt.kv_room_after(failure))
            self.loop.cut(attempt)
            if await resume_stream(self, cut, response, tracker):  # None: logs why not resumable
                return response  # continued on another decoder (its relay ended the stream)
            self.stream_cut(cut)
            await response.write(failure.error.to_sse())
        if not eof_sent:
            await response.write_eof()
        return response

    def stream_cut(self, cut: Cut) -> None:
        """A stream that began ends with ``cut``'s failure: counted, logged."""
        self.loop.count_cut(cut)
        self.stream_error = cut.failure.error.error_type
        self.router.metrics.error(self.endpoint, cut.failure.error.error_type)
        logger.error(
            "rid=%s room=%s stream cut after it started: %s; ending it with an error event",
            self.rid,
            self.progress.room,
            cut.failure.error.message,
        )
