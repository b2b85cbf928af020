"""The backend pool: which prefill/decode instance serves a request, their load, health and membership.

Everything here runs on the Router's one event loop, so plain attributes need no locks.

- Routing (``--routing``): :meth:`BackendPool.pick` filters the candidates and hands them to
  the configured policy of :mod:`proxy.upstream.routing`.
- Health: an instance is *healthy* until a connection to it fails or its ``GET /health`` does
  not answer 2xx; it is then skipped until a health check succeeds again. When no instance of a
  role is healthy, all of them are tried anyway (health information may be stale).
- kv_both instances (``--both-hosts``) are in both roles' lists, one state per role; a decoder is
  never the prefiller picked for the same room (its twin) while another decoder is a candidate.
  When the twin is all that is left, it is returned, and the attempt serves the request on that one
  instance alone (:meth:`proxy.request.loop.AttemptLoop.pairs`, the local path).
- Membership at run time: :meth:`BackendPool.add` and :meth:`BackendPool.remove`. A removed
  instance is *draining*: it gets no new request, its in-flight requests finish, and it leaves
  the pool when the last one ends.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable, Collection
from dataclasses import replace
from typing import Any

from proxy.router_config import ROLES, Backend, Role
from proxy.upstream.routing import POLICIES, Choice, PoolPolicy, RouteRequest, RoutingOptions, candidates, make_policy

logger = logging.getLogger("proxy")

#: Rooms whose prefiller the pool remembers (a kv_both prefiller's decoder twin is avoided for them).
ROOMS_REMEMBERED = 4096


class BackendState:
    """One instance in the pool, with its live counters."""

    __slots__ = (
        "backend",
        "healthy",
        "draining",
        "in_flight",
        "in_flight_tokens",
        "last_error",
        "status_code",
    )

    def __init__(self, backend: Backend, healthy: bool = True) -> None:
        self.backend = backend
        self.healthy = healthy
        self.draining = False
        #: Requests sent to this instance that have not ended yet.
        self.in_flight = 0
        #: Estimated prompt tokens of those requests (meaningful for prefillers).
        self.in_flight_tokens = 0
        self.last_error: str | None = None
        self.status_code: int | None = None

    def record(self, tls: bool = False) -> dict[str, Any]:
        """JSON-ready status of this instance (``/health``, ``/instances``); ``tls``: its URL is https."""
        backend = self.backend
        out: dict[str, Any] = {
            "role": backend.role,
            "host": backend.host,
            "port": backend.port,
            "url": backend.url(tls),
            "healthy": self.healthy,
            "draining": self.draining,
            "in_flight_requests": self.in_flight,
            "status_code": self.status_code,
            "error": self.last_error,
        }
        if backend.both:
            out["kv_both"] = True
        if backend.role == "prefill":
            out["bootstrap_port"] = backend.bootstrap_port
            out["bootstrap_host"] = backend.bootstrap_address[0]
            out["dp_rank"] = backend.dp_rank
            out["in_flight_prompt_tokens"] = self.in_flight_tokens
        elif backend.movable:
            out["bootstrap_port"] = backend.bootstrap_port  # movable by KV (proxy.strategies.kv_move)
        return out


class Lease:
    """One request's claim on an instance: counts it in flight until :meth:`release` (idempotent)."""

    __slots__ = ("pool", "state", "tokens", "released")

    def __init__(self, pool: BackendPool, state: BackendState, tokens: int) -> None:
        self.pool = pool
        self.state = state
        self.tokens = tokens
        self.released = False
        state.in_flight += 1
        state.in_flight_tokens += tokens

    def release(self) -> None:
        if self.released:
            return
        self.released = True
        state = self.state
        state.in_flight -= 1
        state.in_flight_tokens -= self.tokens
        if state.draining and state.in_flight == 0:
            self.pool._finish_drain(state)


class BackendPool:
    """The prefill and decode instances behind the Router."""

    def __init__(
        self,
        prefillers: tuple[Backend, ...],
        decoders: tuple[Backend, ...],
        routing: str = "room",
        options: RoutingOptions | None = None,
        tls: bool = False,
    ) -> None:
        if routing not in POLICIES:
            raise ValueError(f"unknown routing policy {routing!r}")
        self.routing = routing
        #: The Router calls these instances over HTTPS (``--backend-ssl*``): their URLs say https.
        self.tls = tls
        #: This pool's own policy (a stateful one is a fresh instance per pool).
        self.policy = make_policy(routing, options)
        #: A stateless policy is skipped when a role has one instance; a stateful one sees every request.
        self._skip_single = not isinstance(self.policy, PoolPolicy)
        #: Active (routable) instances per role, in the order they were added.
        self.active: dict[Role, list[BackendState]] = {"prefill": [], "decode": []}
        #: Removed instances whose in-flight requests have not all ended yet.
        self.draining: dict[tuple[str, str, int], BackendState] = {}
        for backend in (*prefillers, *decoders):
            self.active[backend.role].append(BackendState(backend))
        #: Called with an instance taken out of routing (what others keep about it is dropped).
        self.on_remove: list[Callable[[BackendState], None]] = []
        #: The prefiller picked for each recent room (kv_both: its decode side is not picked for that room).
        self._room_prefiller: OrderedDict[int, BackendState] = OrderedDict()

    # -- lookups ---------------------------------------------------------------------------

    def find(self, role: Role, host: str, port: int) -> BackendState | None:
        """The active or draining instance with this role, host and port."""
        for state in self.active[role]:
            if state.backend.host == host and state.backend.port == port:
                return state
        return self.draining.get((role, host, port))

    def all_states(self) -> list[BackendState]:
        """Every instance: active ones first (prefillers, then decoders), then draining ones."""
        return [*self.active["prefill"], *self.active["decode"], *self.draining.values()]

    # -- routing ---------------------------------------------------------------------------

    def pick(
        self,
        role: Role,
        room: int,
        exclude: Collection[BackendState] = (),
        request: RouteRequest | None = None,
    ) -> BackendState | None:
        """Choose the instance of ``role`` for a request with bootstrap room ``room``.

        ``exclude`` holds instances that already failed this request; they are avoided while
        another instance exists. Unhealthy instances are avoided while a healthy one exists
        (:func:`proxy.upstream.routing.candidates`); the policy chooses among the rest. ``request``
        tells the policy about the client's request (``room`` alone when absent). Returns
        ``None`` only when the role has no active instance at all.
        """
        active = self.active[role]
        if len(active) <= 1 and (self._skip_single or not active):
            picked = active[0] if active else None
        else:
            if request is None or request.room != room:
                request = RouteRequest(room) if request is None else replace(request, room=room)
            eligible = candidates(active, exclude)
            twin = self._twin_of_prefiller(room) if role == "decode" else None
            if twin is not None and len(eligible) > 1:
                eligible = [s for s in eligible if s is not twin]  # a kv_both instance is not its own decoder
            picked = self.policy(Choice(role, active, eligible, request))
        if role == "prefill":
            self._note_prefiller(room, picked)
        return picked

    def alone_with_itself(self, p: BackendState, exclude: Collection[BackendState] = ()) -> bool:
        """Whether ``p`` is a kv_both prefiller whose only decoder candidate (``exclude`` avoided, as
        :meth:`pick` does) is its own decode side: the request is then served by that instance alone."""
        if not p.backend.both:
            return False
        eligible = candidates(self.active["decode"], exclude)
        return all(s.backend.same_instance(p.backend) for s in eligible)

    def _note_prefiller(self, room: int, picked: BackendState | None) -> None:
        if picked is None or not picked.backend.both:
            self._room_prefiller.pop(room, None)
            return
        self._room_prefiller[room] = picked
        self._room_prefiller.move_to_end(room)
        while len(self._room_prefiller) > ROOMS_REMEMBERED:
            self._room_prefiller.popitem(last=False)

    def _twin_of_prefiller(self, room: int) -> BackendState | None:
        """The decode side of the kv_both instance picked as ``room``'s prefiller, if it was one."""
        p = self._room_prefiller.get(room)
        if p is None:
            return None
        return next((s for s in self.active["decode"] if s.backend.same_instance(p.backend)), None)

    def lease(self, state: BackendState, tokens: int = 0) -> Lease:
        """Count a request in flight on ``state`` until the returned lease is released."""
        return Lease(self, state, tokens)

    # -- health ----------------------------------------------------------------------------

    def mark_unhealthy(self, state: BackendState, reason: str) -> None:
        """Skip ``state`` until its health check succeeds again (called on connection failures)."""
        state.last_error = reason
        if state.healthy:
            state.healthy = False
            logger.warning("%s marked unhealthy: %s", state.backend.name, reason)

    def set_health(self, state: BackendState, healthy: bool, status_code: int | None, error: str | None) -> None:
        """Record the result of a health check of ``state``."""
        state.status_code = status_code
        if healthy:
            if not state.healthy:
                logger.info("%s is healthy again", state.backend.name)
            state.healthy = True
            state.last_error = None
        else:
            state.last_error = error
            if state.healthy:
                logger.warning("%s failed its health check: %s", state.backend.name, error)
            state.healthy = False

    # -- membership ------------------------------------------------------------------------

    def add_state(self, state: BackendState) -> None:
        """Make ``state`` routable (appended after the existing instances of its role)."""
        self.active[state.backend.role].append(state)
        logger.info("%s added to the pool", state.backend.name)

    def undrain(self, state: BackendState) -> None:
        """Make a draining instance routable again (it was re-added before its drain ended)."""
        del self.draining[state.backend.key]
        state.draining = False
        self.active[state.backend.role].append(state)
        logger.info("%s re-added while draining; it takes new requests again", state.backend.name)

    def remove(self, state: BackendState) -> bool:
        """Take ``state`` out of routing; it leaves the pool once its in-flight requests end.

        Returns True if it is gone already (nothing was in flight), False if it is draining.
        """
        if state.draining:
            return False
        self.active[state.backend.role].remove(state)
        state.draining = True
        if isinstance(self.policy, PoolPolicy):
            self.policy.forget(state)
        for forget in self.on_remove:
            forget(state)
        if state.in_flight == 0:
            logger.info("%s removed from the pool", state.backend.name)
            return True
        self.draining[state.backend.key] = state
        logger.info("%s is draining: no new requests, %d in flight will finish", state.backend.name, state.in_flight)
        return False

    def _finish_drain(self, state: BackendState) -> None:
        if self.draining.pop(state.backend.key, None) is not None:
            logger.info("%s drained and removed from the pool", state.backend.name)

    def snapshot(self) -> dict[str, Any]:
        """JSON-ready description of every instance."""
        return {
            "prefillers": [s.record(self.tls) for s in self.active["prefill"]],
            "decoders": [s.record(self.tls) for s in self.active["decode"]],
            "draining": [s.record(self.tls) for s in self.draining.values()],
        }


def health_summary(pool: BackendPool, status: str) -> dict[str, Any]:
    """What anyone may read of the pool's health: the verdict and how many instances are healthy."""
    return {
        "status": status,
        "prefill_healthy": sum(s.healthy for s in pool.active["prefill"]),
        "prefill_instances": len(pool.active["prefill"]),
        "decode_healthy": sum(s.healthy for s in pool.active["decode"]),
        "decode_instances": len(pool.active["decode"]),
    }


def pool_health(pool: BackendPool) -> tuple[bool, dict[str, Any]]:
    """Healthy means at least one active prefiller and one active decoder are healthy."""
    snapshot = pool.snapshot()
    healthy = all(any(s.healthy for s in pool.active[role]) for role in ROLES)
    return healthy, {"status": "healthy" if healthy else "unhealthy", **snapshot}
