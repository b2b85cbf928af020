"""One attempt of a client request on one P/D pair: :class:`Attempt`.

An attempt owns its pair, its two tasks (P's request and D's), its two leases (in-flight
counts on P and D) and D's open stream, and :meth:`Attempt.close` ends all of them at once.

- :meth:`Attempt.run` starts P and D as two tasks and waits for D's answer (its first chunk,
  when streaming) and P's failure together: whichever says how the attempt went first. A P that
  fails first ends the attempt with P's failure, D still running (the caller closes the
  attempt, which cancels D's task). Nothing cancels the caller's task, so a cancellation there
  is always the client going away.
- After D answered, the attempt is ``STREAMING`` (D's stream is relayed; a P failure now closes
  D's stream, see :attr:`Attempt.late_p_failure`) or ``ANSWERED`` (D's answer is complete: P is
  left to end on its own, a failure only logged).
- :meth:`Attempt.close` (idempotent, synchronous) cancels what still runs and releases the
  leases. A cancelled task closes its connection when it next runs; closing a backend
  connection makes vLLM abort the request and free its KV blocks.

Attempts are made, run and closed by the request's :class:`proxy.request.loop.AttemptLoop`; nothing
else keeps one. What outlives a cut stream is a :class:`Cut`, a frozen copy of what the next leg needs
(:mod:`proxy.strategies.resume`); a drain cuts a stream through :meth:`Attempt.cut_for_drain`.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from proxy.admin.drain import LegState
from proxy.request.payloads import decode_body, local_body, prefill_body
from proxy.upstream.calls import (
    Failure,
    FailureKind,
    empty_failure,
    error_event_failure,
    exception_failure,
    fetch,
    http_failure,
    refused_failure,
)
from proxy.upstream.http1 import Response, UpstreamError, encode_json
from proxy.upstream.pool import BackendState

if TYPE_CHECKING:
    from proxy.router_state import Router

logger = logging.getLogger("proxy")


@dataclass(frozen=True, slots=True)
class Call:
    """What every attempt of one client request sends: endpoint, body, headers."""

    endpoint: str
    rid: str
    #: The client's parsed body (never changed: P's and D's bodies are copies).
    body: dict[str, Any]
    stream: bool
    #: Estimated prompt tokens (counted in flight on P).
    tokens: int
    #: Headers sent to P and D (``X-Request-Id``, ``Authorization``).
    headers: dict[str, str]
    #: Trailing prompt tokens the client has as generated ones (the first-token path's token 1, a
    #: resumed stream's tokens: :mod:`proxy.strategies.resume`).
    replayed: int = 0


class Opened:
    """D's streamed answer, open: its response and first chunk."""

    __slots__ = ("response", "first")

    def __init__(self, response: Response, first: bytes) -> None:
        self.response = response
        self.first = first


class Answered:
    """D's whole (non-streamed) 2xx answer."""

    __slots__ = ("status", "body", "content_type")

    def __init__(self, status: int, body: bytes, content_type: str) -> None:
        self.status = status
        self.body = body
        self.content_type = content_type


Outcome = Opened | Answered | Failure


@dataclass(frozen=True, slots=True)
class Cut:
    """An attempt whose stream began and was cut, as what comes after it needs it (the attempt itself
    closed): :mod:`proxy.strategies.resume` continues the stream from it, :mod:`proxy.strategies.kv_move`
    moves its KV, :mod:`proxy.request.held_tail` asks its instances. Built where the cut is seen: the
    request's relay (:meth:`proxy.request.exchange.Exchange.relay`), or a strategy whose stream's next
    leg failed before it opened."""

    failure: Failure
    #: The cut attempt's prefiller and decoder.
    p: BackendState
    d: BackendState
    #: What the cut attempt sent (a resumed stream's call counts the tokens it replayed).
    call: Call
    #: The room the cut decoder holds the request's KV as, when a drain cut it and the KV moves with
    #: the stream (:mod:`proxy.strategies.kv_move`); None: the stream is replayed.
    kv_room: int | None


class AttemptState(enum.Enum):
    WAITING = "waiting"  # P and D sent, D has not answered yet
    STREAMING = "streaming"  # D's stream is open and being relayed
    ANSWERED = "answered"  # D's answer is complete; P may still run (detached)
    CLOSED = "closed"  # everything ended (failed, aborted, or finished)


class Attempt:
    """One try of a client request on prefiller ``p`` and decoder ``d`` with bootstrap ``room``."""

    def __init__(
        self,
        router: Router,
        call: Call,
        p: BackendState,
        d: BackendState,
        room: int,
        timeout: float,
        *,
        p_answered: bool = False,
        prefilled_tokens: int | None = None,
        migrate_room: int | None = None,
        resumable: bool = False,
        local: bool = False,
    ) -> None:
        """``p_answered``: P already answered (the first-token path) and holds the room's KV; the
        attempt then runs D only (``p`` may then be a drained decoder holding the KV:
        :mod:`proxy.strategies.kv_move`). ``prefilled_tokens``: that KV covers only the first that many
        tokens of D's prompt (None: all of it). ``migrate_room``: the room D holds the request's KV
        as if the Router aborts it (None: D is not movable by KV or the stream not resumable);
        :meth:`proxy.request.loop.AttemptLoop.new_attempt` draws it. ``resumable``: the stream may
        go on on another decoder if cut (:func:`proxy.strategies.resume_body.resumable`), so D sends its
        token ids. ``local``: D prefills the request itself (``--path-policy``), an ordinary vLLM
        request with no ``kv_transfer_params``; P (``p``: the prefiller routing picked, or D itself when
        there is none) is not asked.

        Attempts are made by :class:`proxy.request.loop.AttemptLoop` alone."""
        self.router = router
        self.p_answered = p_answered
        self.prefilled_tokens = prefilled_tokens
        self.call = call
        self.p = p
        self.d = d
        self.room = room
        self.timeout = timeout
        self.state = AttemptState.WAITING
        #: D is movable by KV and the stream may be moved: the room D holds the request's KV as
        #: if the Router aborts it (a drain's move loads it from there: proxy.strategies.kv_move).
        self.migrate_room = migrate_room
        self.resumable = resumable
        self.local = local
        pool = router.pool
        #: P had nothing else in flight: its answer time is its prefill time (the path model's sample).
        self.p_idle = p.in_flight == 0
        self.p_lease = pool.lease(p, 0 if p_answered or local else call.tokens)
        self.sent_at = 0.0
        self.d_lease = pool.lease(d)
        self.opened: Opened | None = None
        #: P's failure while D's stream was relayed (the stream then ends with P's error).
        self.late_p_failure: Failure | None = None
        self.p_task: asyncio.Task[Failure | None] | None = None
        self.p_answered_at: float | None = None
        self.d_task: asyncio.Task[Outcome] | None = None
        #: While ``WAITING``: set when D's task ends or P fails, whichever comes first.
        self._settled: asyncio.Future[None] | None = None

    # -- running -----------------------------------------------------------------------------

    async def run(self) -> Outcome:
        """Send P's and D's requests at once; D's answer (its first chunk, when streaming), or
        the attempt's failure (P's when P failed: D waits for P's KV, so P's error is the cause)."""
        router = self.router
        metrics, endpoint = router.metrics, self.call.endpoint
        loop = asyncio.get_running_loop()
        self._settled = settled = loop.create_future()
        self.sent_at = time.monotonic()
        metrics.backend_request(endpoint, self.d.backend)
        # D's request first (as both go out in the same loop turn, D's answer is the critical path).
        self.d_task = d_task = loop.create_task(self._decode())
        p_task: asyncio.Task[Failure | None] | None = None
        if not self.p_answered and not self.local:
            metrics.backend_request(endpoint, self.p.backend)
            self.p_task = p_task = loop.create_task(self._prefill())
            p_task.add_done_callback(self._prefill_done)
        else:
            self.p_lease.release()  # P answered already, or D prefills
        try:
            await settled  # a cancellation here is the caller's own (the client went away)
        finally:
            self._settled = None
        if p_task is not None and p_task.done() and (failure := p_task.result()) is not None:
            return failure
        outcome = d_task.result()
        if isinstance(outcome, Opened):
            self.state = AttemptState.STREAMING
        elif isinstance(outcome, Answered):
            self.state = AttemptState.ANSWERED
        return outcome

    async def _prefill(self) -> Failure | None:
        call, state = self.call, self.p
        data = encode_json(prefill_body(call.body, self.room))
        nominal = self.router.config.request_timeout
        reply = await fetch(self.router.http, state, "POST", call.endpoint, self.timeout, data, call.headers, nominal)
        if isinstance(reply, Failure):
            return reply
        if reply.status >= 300:
            return http_failure(state, reply.status, reply.body, reply.content_type)
        refused = refused_failure(state, reply.body)
        if refused is None and self.p_idle:
            self.router.paths.observe_prefill(state, call.tokens, (time.monotonic() - self.sent_at) * 1000)
        return refused

    async def _decode(self) -> Outcome:
        state, call = self.d, self.call
        backend = state.backend
        if self.local:
            body = local_body(call.body)
        else:
            body = decode_body(call.body, self.room, self.p.backend, self.prefilled_tokens, self.migrate_room)
        if self.resumable:
            body["return_token_ids"] = True  # stripped for the client unless it asked (proxy.strategies.resume_body)
        data = encode_json(body)
        response: Response | None = None
        try:
            response = await self.router.http.post(
                backend.host, backend.port, call.endpoint, data, call.headers, self.timeout
            )
            status = response.status
            content_type = response.content_type
            if status >= 300 or not call.stream:
                content = await response.read()
                response.release()
                if status >= 300:
                    return http_failure(state, status, content, content_type)
                if not content:
                    return empty_failure(state, status)
                return Answered(status, content, content_type or "application/json")
            first = await response.next_chunk()
            if not first:
                response.release()
                return empty_failure(state, status)
            failure = error_event_failure(state, first)
            if failure is not None:
                response.close()
                return failure
            self.opened = Opened(response, first)  # from here on, close() closes it
            return self.opened
        except BaseException as exc:
            if response is not None:
                response.close()
            if isinstance(exc, UpstreamError):
                return exception_failure(state, exc, self.router.config.request_timeout)
            raise
        finally:
            self._settle()  # wakes run() as this task ends (a done callback would take a loop turn more)

    def _settle(self) -> None:
        settled = self._settled
        if settled is not None and not settled.done():
            settled.set_result(None)

    def _prefill_done(self, task: asyncio.Task[Failure | None]) -> None:
        self.p_answered_at = time.time()  # wall clock, for the request's phase trace
        self.p_lease.release()
        if task.cancelled():
            return
        if task.exception() is not None:
            self._settle()  # run() raises it
            return
        failure = task.result()
        if failure is None:
            return
        if self.state is AttemptState.WAITING:
            self._settle()  # run() returns it
        elif self.state is AttemptState.STREAMING and self.opened is not None:
            self.late_p_failure = failure
            self.opened.response.close()  # the relay sees the stream end, then P's failure
        elif self.state is AttemptState.ANSWERED:
            logger.error(
                "rid=%s room=%s prefill failed after D had answered: %s",
                self.call.rid,
                self.room,
                failure.error.message,
            )

    def leg_state(self) -> LegState:
        """Where the attempt's stream stands, as a drain sees it (:class:`proxy.admin.drain.DrainableLeg`)."""
        if self.state is AttemptState.ANSWERED:
            return LegState.ENDED
        if self.state is not AttemptState.STREAMING or self.opened is None:
            return LegState.CLOSED
        if self.late_p_failure is None:
            return LegState.STREAMING
        return LegState.CUT_BY_DRAIN if self.late_p_failure.kind is FailureKind.DRAIN else LegState.CUT

    def cut_for_drain(self, failure: Failure) -> None:
        """A drain cuts the open stream with ``failure``: the relay reads what was buffered, then
        sees ``failure`` as it would a late P failure and resumes the stream elsewhere."""
        if self.opened is None:
            return
        self.late_p_failure = failure
        self.opened.response.close()

    def kv_room_after(self, failure: Failure) -> int | None:
        """The room D keeps the request's KV as once ``failure`` cut its stream: the migrate room when
        a drain cut a decoder that holds it (:mod:`proxy.strategies.kv_move`), else None."""
        return self.migrate_room if failure.kind is FailureKind.DRAIN and self.holds_kv_for_move() else None

    def holds_kv_for_move(self) -> bool:
        """Whether D keeps the request's KV as the attempt's migrate room if the Router aborts it."""
        return self.migrate_room is not None and self.d.backend.movable

    def holds_p_room(self) -> bool:
        """Whether P holds this attempt's room: it answered before the attempt, or its prefill here
        ended well (not cancelled: a cancelled P request is aborted, which frees its KV)."""
        if self.p_answered:
            return True
        if self.local:
            return False
        task = self.p_task
        if task is None or not task.done() or task.cancelled() or task.exception() is not None:
            return False
        return task.result() is None

    # -- ending ------------------------------------------------------------------------------

    def finish(self) -> None:
        """D's stream ended cleanly: its connection goes back to the pool; P runs on, detached."""
        if self.opened is not None:
            self.opened.response.release()
            self.opened = None
        self.d_lease.release()
        self.state = AttemptState.ANSWERED

    def close(self) -> None:
        """End the attempt: cancel what still runs and release the leases (idempotent, synchronous).

        An ``ANSWERED`` attempt stays so: its P, detached, ends on its own.
        """
        if self.state is AttemptState.ANSWERED:  # D is done; P runs on, detached
            self.d_lease.release()
            if self.p_task is not None and not self.p_task.done():
                self.router.keep(self.p_task)
            return
        if self.state is AttemptState.CLOSED:
            return
        self.state = AttemptState.CLOSED
        if self.p_task is None:  # never run
            self.p_lease.release()
        elif not self.p_task.done():
            self.p_task.cancel()  # its done callback releases P's lease
            self.router.keep(self.p_task)
        if self.d_task is not None and not self.d_task.done():
            self.d_task.cancel()
            self.router.keep(self.d_task)
        if self.opened is not None:
            self.opened.response.close()
            self.opened = None
        self.d_lease.release()
