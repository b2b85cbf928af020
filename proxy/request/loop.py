"""The attempt loop of one client request: :class:`AttemptLoop`.

Every attempt a request makes is made, run and settled here, whichever strategy asks for it (the
two-instance attempts of :mod:`proxy.strategies.two_instance`, the first-token path of
:mod:`proxy.strategies.first_token`, the continuations of :mod:`proxy.strategies.recompute`, the
resumed legs of :mod:`proxy.strategies.resume`, a KV move of :mod:`proxy.strategies.kv_move`). A
strategy reaches the loop through its :class:`proxy.request.context.RequestContext`:

- :meth:`AttemptLoop.next_room`: a fresh room from the Router's one room factory
  (:meth:`proxy.request.rooms_in_flight.RoomsInUse.fresh`), held until the request ends;
- :meth:`AttemptLoop.count` and :meth:`AttemptLoop.backoff`: the attempts counted against
  ``--max-retries``, ``pd_router_retries`` and the exponential ``--retry-delay`` before a retry;
- :meth:`AttemptLoop.new_attempt`: an :class:`proxy.request.attempt.Attempt`, which becomes the
  request's current one (the one before it is closed; a decoder movable by KV gets its migrate room);
- :meth:`AttemptLoop.run`: the attempt run; a failure goes to :meth:`AttemptLoop.fail`, which closes
  the attempt, settles it by :mod:`proxy.request.failure_policy` (counted, its backend marked
  unhealthy, the instances to avoid noted, a decoder's refusal of the pair remembered) and
  releases P's room;
- :meth:`AttemptLoop.cut`: an attempt whose stream began and was cut, closed (what comes after it gets
  a narrow :class:`proxy.request.attempt.Cut`), counted by :meth:`AttemptLoop.count_cut`;
- :meth:`AttemptLoop.pairs`: attempts on P/D pairs the routing policy picks, one after the other,
  until one answers (:class:`Won`) or none is left (:class:`Lost`).

**Releasing P's room** (through :mod:`proxy.request.room_release`: P's bootstrap server first, a
decoder's load as the fallback) is the loop's alone, by two rules. A client that leaves, at any point
(:meth:`AttemptLoop.client_left`, then :meth:`AttemptLoop.close`): every room of the request sent to a
prefiller (:meth:`AttemptLoop.pick` and :meth:`AttemptLoop.new_attempt` note them) is released on its
prefiller's bootstrap server, whether P is still prefilling, holds the KV, pushes it or already sent it
(``_release_client_rooms``). Otherwise (``_release_p_room``) P's KV of a room is released as soon as the
Router knows that no decoder of this request asked, or will ask, for it:

- :meth:`AttemptLoop.fail`: the failed attempt's decoder could not be connected to while P holds the
  room's KV (:attr:`proxy.request.failure_policy.Decision.release_room`) and the room goes on to no
  other decoder: released at once, as the request goes on on another pair;
- :meth:`AttemptLoop.close`: P answered with the room's KV held (:meth:`AttemptLoop.p_holds`, the
  first-token path) and no attempt took it over (:meth:`AttemptLoop.new_attempt` with that P and room):
  the answer was token 1 alone, no decoder was available, or the client left first; released as
  the request ends.

:meth:`AttemptLoop.close`, when the request ends, also closes the current attempt and gives the
request's rooms back.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time
from collections.abc import Collection
from dataclasses import dataclass
from typing import TYPE_CHECKING

from proxy.request.attempt import Answered, Attempt, Call, Cut, Opened
from proxy.request.failure_policy import Decision, Tried, count_failure, settle
from proxy.request.progress import RequestProgress
from proxy.request.room_release import release_on_p, release_room
from proxy.strategies.resume_body import resumable
from proxy.upstream.calls import Failure
from proxy.upstream.pool import BackendState
from proxy.upstream.routing import RouteRequest

if TYPE_CHECKING:
    from proxy.router_state import Router

logger = logging.getLogger("proxy")


class Next(enum.Enum):
    """What a strategy that did not answer the client leaves the request to."""

    #: Two-instance attempts on fresh P/D pairs (the attempts made so far stay counted).
    TWO_INSTANCE = "two_instance"


@dataclass(frozen=True, slots=True)
class Won:
    """An attempt that did not fail: D's open stream or whole answer. A strategy hands it on as it
    is (:meth:`proxy.request.context.RequestContext.answer`, :meth:`~proxy.request.context.RequestContext.relay`);
    what it may read of the attempt is below."""

    attempt: Attempt
    outcome: Opened | Answered

    @property
    def p(self) -> BackendState:
        return self.attempt.p

    @property
    def d(self) -> BackendState:
        return self.attempt.d

    @property
    def room(self) -> int:
        return self.attempt.room

    @property
    def call(self) -> Call:
        return self.attempt.call


@dataclass(frozen=True, slots=True)
class Settled:
    """A failed attempt, closed and settled by :meth:`AttemptLoop.fail`."""

    attempt: Attempt
    failure: Failure
    decision: Decision
    #: Another decoder that takes the same room over (P holds its KV, the failed decoder never
    #: asked for it), when the caller asked for one; P's room is then not released.
    same_room_d: BackendState | None = None


@dataclass(frozen=True, slots=True)
class HeldRoom:
    """A room whose KV P holds for a decoder of this request (P answered: the first-token path)."""

    p: BackendState
    room: int
    #: The request as P's KV covers it, and how many of its prompt tokens that KV holds.
    call: Call
    prefilled_tokens: int | None
    #: A decoder that failed to load it (another one is asked to, and so frees it).
    failed_d: BackendState | None = None


@dataclass(frozen=True, slots=True)
class Lost:
    """:meth:`AttemptLoop.pairs` found no attempt that answered."""

    #: The last attempt's failure (None: no attempt was made).
    failure: Failure | None
    #: Why no (further) attempt was made: no instance, no time left (None: attempts ran out or the
    #: last failure is not retried).
    why: str | None = None
    #: The role that had no instance (``why`` says it), for the client's 503.
    missing: str | None = None
    #: The last failure is one the policy retries (more tries would have been made).
    retry: bool = False


class AttemptLoop:
    """One client request's attempts: the instances they tried, their progress, their rooms."""

    def __init__(self, router: Router, call: Call, room: int, t0: float) -> None:
        self.router = router
        self.call = call
        #: The request's current room, attempts made, first byte (its log line reads it).
        self.progress = RequestProgress(room)
        #: The request's current attempt (closed by the next one, or by :meth:`close`).
        self.current: Attempt | None = None
        #: The instances that failed this request (routing avoids them on its retries).
        self.tried = Tried()
        self.deadline = t0 + router.config.request_timeout
        #: The rooms this request holds in the Router's room factory (given back by :meth:`close`).
        self._rooms = [room]
        #: P's KV of a room that no attempt took over yet (released by :meth:`close`).
        self._held: HeldRoom | None = None
        #: Every room of the request sent (or about to be sent) to a prefiller, and that prefiller.
        self._p_rooms: dict[int, BackendState] = {}
        #: Why the client went away (:meth:`client_left`); None while it is there.
        self._left: str | None = None
        #: The pair the request's path was chosen for (:meth:`plan`): each role's first pick in that room.
        self._planned: dict[str, BackendState] = {}
        self._planned_room: int | None = None

    # -- rooms, counts, time ------------------------------------------------------------------

    def remaining(self) -> float:
        """Seconds left before ``--request-timeout``."""
        return self.deadline - time.monotonic()

    def next_room(self) -> int:
        """A fresh room for this request (held until it ends)."""
        room = self.router.rooms.fresh()
        self._rooms.append(room)
        return room

    def count(self) -> int:
        """One more attempt of the request; its number."""
        self.progress.attempts += 1
        return self.progress.attempts

    def attempts_left(self) -> bool:
        """Whether ``--max-retries`` allows another attempt."""
        return self.progress.attempts < self.router.config.max_retries

    async def backoff(self, number: int) -> None:
        """Before attempt ``number`` (a retry when above 1): ``pd_router_retries`` and the wait of
        ``--retry-delay`` doubled on each retry."""
        if number <= 1:
            return
        config = self.router.config
        self.router.metrics.retry(self.call.endpoint)
        delay = config.retry_delay * 2 ** (number - 2)
        if delay > 0:
            await asyncio.sleep(delay)

    def plan(self, room: int, p: BackendState | None, d: BackendState | None) -> None:
        """The pair the path choice (:mod:`proxy.planning.live`) was made for, picked in ``room``: the
        first :meth:`pick` of each role in that room returns it (so the request runs where its path was
        decided, and the routing policy is asked once), unless it is to be avoided or left the pool."""
        self._planned = {role: s for role, s in (("prefill", p), ("decode", d)) if s is not None}
        self._planned_room = room

    def pick(self, role: str, call: Call, room: int, avoid: Collection[BackendState]) -> BackendState | None:
        """An instance of ``role`` for ``call`` with ``room``, the routing policy's choice (those in
        ``avoid`` only when nothing else is left; None: the role has no instance), or the planned one
        (:meth:`plan`). A prefiller picked is noted as the room's (released there if the client leaves)."""
        planned = self._planned.pop(role, None) if room == self._planned_room else None
        if planned is not None and planned not in avoid and planned in self.router.pool.active[role]:
            picked: BackendState | None = planned
        else:
            picked = self.router.pool.pick(role, room, avoid, RouteRequest(room, call.tokens, call.body))
        if role == "prefill" and picked is not None:
            self._p_rooms[room] = picked
        return picked

    # -- attempts -----------------------------------------------------------------------------

    def new_attempt(
        self,
        call: Call,
        p: BackendState,
        d: BackendState,
        room: int,
        *,
        p_answered: bool = False,
        prefilled_tokens: int | None = None,
        local: bool = False,
    ) -> Attempt:
        """The request's next attempt (its current one from now on; the one before is closed). With
        ``p_answered``, the attempt takes over P's KV of ``room`` (:meth:`p_holds`); ``local``: D
        prefills the request itself (:mod:`proxy.strategies.local`)."""
        if self.current is not None:
            self.current.close()
        held = self._held
        if p_answered and held is not None and held.p is p and held.room == room:
            self._held = None  # the attempt holds it now (Attempt.holds_p_room)
        if not local:
            self._p_rooms[room] = p
        resumes = resumable(call, self.router.config.resume_attempts)
        movable = d.backend.movable and resumes and not local
        attempt = Attempt(
            self.router,
            call,
            p,
            d,
            room,
            self.remaining(),
            p_answered=p_answered,
            prefilled_tokens=prefilled_tokens,
            migrate_room=self.next_room() if movable else None,
            resumable=resumes,
            local=local,
        )
        self.progress.room = room
        self.current = attempt
        return attempt

    async def run(self, attempt: Attempt, tried: Tried | None = None, *, same_room: bool = False) -> Won | Settled:
        """Run ``attempt``: D's answer, or its failure settled (:meth:`fail`, with ``tried`` and
        ``same_room``)."""
        outcome = await attempt.run()
        if isinstance(outcome, Failure):
            return self.fail(attempt, outcome, tried, same_room=same_room)
        return Won(attempt, outcome)

    def fail(
        self, attempt: Attempt, failure: Failure, tried: Tried | None = None, *, same_room: bool = False
    ) -> Settled:
        """``attempt`` failed with ``failure``: close it, settle it (``tried``: the instances to avoid,
        the request's own when None) and release P's room where the policy says so. With
        ``same_room``, a retry allowed and P's KV still unclaimed, another decoder is picked for the
        same room (:attr:`Settled.same_room_d`) and the room stays on P."""
        attempt.close()
        tried = self.tried if tried is None else tried
        decision = settle(self.router, self.call.endpoint, failure, tried, attempt)
        self.router.pair_refusals.note(attempt.p, failure)
        other: BackendState | None = None
        if same_room and decision.same_room_other_d and self.may_retry(decision):
            other = self.pick("decode", attempt.call, attempt.room, tried.d)
            if other is not None and other in tried.d:
                other = None
        if decision.release_room and other is None:
            held = HeldRoom(attempt.p, attempt.room, attempt.call, attempt.prefilled_tokens, attempt.d)
            self._release_p_room(held)
        return Settled(attempt, failure, decision, other)

    def current_decoder(self) -> BackendState | None:
        """The decoder of the request's current attempt (None: no attempt was made)."""
        return self.current.d if self.current is not None else None

    def finished(self, attempt: Attempt) -> None:
        """``attempt``'s stream ended cleanly: its connection back to the pool, and the pair known to
        work (a decoder's earlier refusal of it forgotten)."""
        attempt.finish()
        self.router.pair_refusals.clear(attempt.p, attempt.d)

    def cut(self, attempt: Attempt) -> None:
        """``attempt``'s stream, begun, was cut: the attempt closed (what comes after it gets a
        :class:`proxy.request.attempt.Cut`; counted by :meth:`count_cut`)."""
        attempt.close()

    def count_cut(self, cut: Cut) -> None:
        """A cut stream's failure counted, its backend marked unhealthy where the policy says so
        (:func:`proxy.request.failure_policy.count_failure`), a decoder's refusal of the pair remembered;
        once the stream ended, or went on on another leg."""
        self.router.pair_refusals.note(cut.p, cut.failure)
        count_failure(self.router, self.call.endpoint, cut.failure)

    def fail_call(self, failure: Failure) -> Decision:
        """A backend call of the request outside any attempt failed (the first-token path's P
        request): settled as an attempt's failure is, against the request's own ``tried``."""
        return settle(self.router, self.call.endpoint, failure, self.tried)

    def may_retry(self, decision: Decision) -> bool:
        """Whether a failure settled as ``decision`` is retried: retryable, attempts and time left."""
        return decision.retry and self.attempts_left() and self.remaining() > 0

    def p_holds(self, p: BackendState, room: int, call: Call, prefilled_tokens: int | None) -> None:
        """P answered and holds ``room``'s KV (of ``call``, ``prefilled_tokens`` of its prompt) for a
        decoder: released when the request ends unless an attempt takes it over first."""
        self._held = HeldRoom(p, room, call, prefilled_tokens)

    def _release_p_room(self, held: HeldRoom) -> None:
        """No decoder of this request will load ``held``: P's bootstrap server frees it now, or, when
        that fails, a decoder (not ``held.failed_d``) loads, and so frees, it (see the module docstring)."""
        avoid = () if held.failed_d is None else {held.failed_d}
        router = self.router

        def through_a_decoder() -> None:
            release_room(router, held.p, held.room, held.call, held.prefilled_tokens, avoid)

        self._p_rooms.pop(held.room, None)
        why = "no decoder of the request will load it"
        release_on_p(router, held.p, held.room, held.call.rid, why, through_a_decoder)

    def client_left(self, why: str) -> None:
        """The client went away (``why``): :meth:`close` releases every room of the request on its
        prefiller, at once."""
        self._left = why

    def _release_client_rooms(self, why: str) -> None:
        """The client left: each room sent to a prefiller is released on its bootstrap server; P's KV no
        attempt took over falls back to a decoder's load if that fails (no decoder will ask for it)."""
        held, self._held = self._held, None
        for room, p in self._p_rooms.items():
            if held is not None and held.room == room and held.p is p:
                self._release_p_room(held)
                held = None
                continue
            release_on_p(self.router, p, room, self.call.rid, why)
        if held is not None:
            self._release_p_room(held)
        self._p_rooms.clear()

    async def pairs(
        self,
        call: Call,
        tried: Tried,
        tries: int,
        *,
        first_room: int | None = None,
        retries: bool = True,
        new_decoder: bool = False,
        what: str = "attempt",
    ) -> Won | Lost:
        """Up to ``tries`` attempts of ``call`` on P/D pairs the routing policy picks (avoiding
        ``tried``), each with a fresh room (``first_room`` for the first where given), until one does
        not fail. ``retries``: each after the first is a retry of the request (``pd_router_retries``,
        backoff). ``new_decoder``: a decoder in ``tried`` is never used. ``what`` names the attempts
        in the log."""
        failure: Failure | None = None
        for index in range(tries):
            room = first_room if index == 0 and first_room is not None else self.next_room()
            number = self.progress.attempts + 1
            if retries:
                await self.backoff(number)
            p = self.pick("prefill", call, room, tried.p)
            d = self.pick("decode", call, room, tried.d)
            if p is None or d is None:
                missing = "prefill" if p is None else "decode"
                return Lost(failure, f"no {missing} instance is available", missing)
            if new_decoder and d in tried.d:
                return Lost(failure, "no decoder left that has not failed this request")
            if self.remaining() <= 0:
                return Lost(failure, "no time left")
            self.progress.attempts = number
            local = p.backend.same_instance(d.backend)  # a kv_both instance alone: it serves the request itself
            got = await self.run(self.new_attempt(call, p, d, room, local=local), tried)
            if isinstance(got, Won):
                return got
            failure = got.failure
            again = got.decision.retry and index < tries - 1
            logger.warning(
                "rid=%s room=%s %s %d on %s + %s failed (%s)%s",
                call.rid,
                room,
                what,
                number,
                p.backend.name,
                d.backend.name,
                failure.error.message,
                "; retrying on another pair with a fresh room" if again else "",
            )
            if not again:
                return Lost(failure, retry=got.decision.retry)
        return Lost(failure, retry=failure is not None and failure.retryable)

    # -- the end ------------------------------------------------------------------------------

    def close(self) -> None:
        """The request ended: close its current attempt, release P's KV no attempt took over, and
        give its rooms back."""
        if self.current is not None:
            self.current.close()
        if self._left is not None:
            self._release_client_rooms(self._left)
        elif self._held is not None:
            self._release_p_room(self._held)
            self._held = None
        for room in self._rooms:
            self.router.rooms.release(room)
        self._rooms.clear()
