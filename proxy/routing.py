"""Routing policies (``--routing``): which prefill or decode instance serves a request.

A policy is a function ``(Choice) -> BackendState``. :data:`POLICIES` maps each
``--routing`` name to its function; the function's docstring is that policy's help text
(``--help``; README lists the same). Adding a policy is one function and one line in
:data:`POLICIES`.

Every policy chooses among the same :func:`candidates` (the shared filter): the healthy
instances that have not failed this request yet; else the untried ones, healthy or not; else
all of them (health information may be stale, and a role is never left without an instance).

This module imports nothing from :mod:`proxy` at run time (so :mod:`proxy.config` can read
the table).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from proxy.backends import BackendState
    from proxy.config import Role


@dataclass(frozen=True, slots=True)
class RouteRequest:
    """What a policy may know about the client's request."""

    #: The bootstrap room of this attempt (a random 63-bit number unless the client chose it).
    room: int
    #: Estimated prompt tokens (:func:`proxy.payloads.estimate_prompt_tokens`).
    tokens: int = 0
    #: The client's parsed JSON body (read only), e.g. for prefix-aware routing.
    body: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Choice:
    """One routing decision: the role's instances, the eligible ones and the request."""

    role: Role
    #: Every active instance of the role, in pool order (their live load: ``in_flight``,
    #: ``in_flight_tokens``).
    instances: Sequence[BackendState]
    #: The eligible ones (see :func:`candidates`), in pool order; never empty.
    candidates: Sequence[BackendState]
    request: RouteRequest

    def load(self, state: BackendState) -> int:
        """A prefiller's in-flight prompt tokens, a decoder's in-flight requests."""
        return state.in_flight_tokens if self.role == "prefill" else state.in_flight


Policy = Callable[[Choice], "BackendState"]


def candidates(instances: Sequence[BackendState], exclude: Collection[BackendState] = ()) -> list[BackendState]:
    """Healthy and untried instances; else untried ones; else all (in pool order)."""
    untried = [s for s in instances if s not in exclude] if exclude else list(instances)
    healthy = [s for s in untried if s.healthy]
    return healthy or untried or list(instances)


def by_room(choice: Choice) -> BackendState:
    """prefillers[room % nP], decoders[room % nD] over the active instances, walking on to the
    next candidate (a client retrying with the same room reaches the same pair)"""
    instances, eligible = choice.instances, choice.candidates
    n = len(instances)
    start = choice.request.room % n
    for i in range(n):
        state = instances[(start + i) % n]
        if state in eligible:
            return state
    return eligible[0]  # pragma: no cover (candidates are among the instances)


def least_loaded(choice: Choice) -> BackendState:
    """fewest in-flight prompt tokens (P) and in-flight requests (D), ties broken by the room"""
    best = min(choice.load(s) for s in choice.candidates)
    tied = [s for s in choice.candidates if choice.load(s) == best]
    return tied[choice.request.room % len(tied)]


#: ``--routing`` name -> policy.
POLICIES: dict[str, Policy] = {
    "room": by_room,
    "least-loaded": least_loaded,
}


def describe(name: str) -> str:
    """One policy's help text: its function's docstring, on one line."""
    doc = POLICIES[name].__doc__ or ""
    return " ".join(doc.split()).rstrip(".")
