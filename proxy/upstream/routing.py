"""Routing policies (``--routing``): which prefill or decode instance serves a request.

A policy is a function ``(Choice) -> BackendState``. :data:`POLICIES` maps each
``--routing`` name to its function; the function's docstring is that policy's help text
(``--help``; README lists the same). Adding a policy is one function and one line in
:data:`POLICIES`. A policy with state of its own (``cache-aware``: what each prefiller
recently prefilled) is a callable object that is also a :class:`PoolPolicy`: the table holds a
prototype, and every :class:`proxy.upstream.pool.BackendPool` routes with its own
:meth:`PoolPolicy.fresh` copy (tuned by :class:`RoutingOptions`), which it tells about instances
removed from the pool (:meth:`PoolPolicy.forget`).

Every policy chooses among the same :func:`candidates` (the shared filter): the healthy
instances that have not failed this request yet; else the untried ones, healthy or not; else
all of them (health information may be stale, and a role is never left without an instance).

This module imports nothing from :mod:`proxy` at run time but :mod:`proxy.upstream.prefix_tree`, which
imports nothing from :mod:`proxy` (so :mod:`proxy.router_config` can read the table).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from proxy.upstream.prefix_tree import PrefixTree, prompt_key

if TYPE_CHECKING:
    from proxy.router_config import Role
    from proxy.upstream.pool import BackendState


@dataclass(frozen=True, slots=True)
class RouteRequest:
    """What a policy may know about the client's request."""

    #: The bootstrap room of this attempt (a random 63-bit number unless the client chose it).
    room: int
    #: Estimated prompt tokens (:func:`proxy.request.payloads.estimate_prompt_tokens`).
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


@dataclass(frozen=True, slots=True)
class RoutingOptions:
    """Tuning of the stateful policies (the ``--cache-aware-*`` flags)."""

    #: Loads are imbalanced when the busiest candidate prefiller has more than this many
    #: in-flight prompt tokens over the idlest ...
    cache_aware_balance_abs: int = 8192
    #: ... and more than this many times the idlest's.
    cache_aware_balance_rel: float = 1.5
    #: Below this fraction of the prompt matched, the prompt goes to the least-loaded prefiller.
    cache_aware_min_match: float = 0.3
    #: Prompt characters remembered per prefiller (its tree's bound).
    cache_aware_max_chars: int = 4 * 1024 * 1024


@runtime_checkable
class PoolPolicy(Protocol):
    """A policy with per-pool state."""

    def __call__(self, choice: Choice) -> BackendState: ...

    def fresh(self, options: RoutingOptions) -> PoolPolicy:
        """A new instance with empty state, for one pool."""
        ...

    def forget(self, state: BackendState) -> None:
        """``state`` left the pool: drop what is kept about it."""
        ...


class CacheAware:
    """P: the longest prompt-prefix match with what each prefiller recently prefilled (an approximate prefix
    tree per prefiller), least-loaded while loads are imbalanced or below the minimum match; D: least-loaded"""

    def __init__(self, options: RoutingOptions | None = None) -> None:
        self.options = options or RoutingOptions()
        #: One tree per prefiller chosen so far (dropped by :meth:`forget`).
        self.trees: dict[BackendState, PrefixTree] = {}

    def fresh(self, options: RoutingOptions) -> CacheAware:
        return CacheAware(options)

    def forget(self, state: BackendState) -> None:
        self.trees.pop(state, None)

    def __call__(self, choice: Choice) -> BackendState:
        if choice.role != "prefill":
            return least_loaded(choice)
        key = prompt_key(choice.request.body)
        chosen = self._prefiller(choice, key) if key else None
        if chosen is None:
            chosen = least_loaded(choice)
        tree = self.trees.get(chosen)
        if tree is None:
            tree = self.trees[chosen] = PrefixTree(self.options.cache_aware_max_chars)
        tree.insert(key)
        return chosen

    def _prefiller(self, choice: Choice, key: str) -> BackendState | None:
        """The best-matching candidate, or ``None`` (least-loaded decides) if imbalanced or no good match."""
        options = self.options
        eligible = choice.candidates
        loads = [choice.load(s) for s in eligible]
        high, low = max(loads), min(loads)
        if high - low > options.cache_aware_balance_abs and high > options.cache_aware_balance_rel * low:
            return None
        trees = self.trees
        matches = [tree.match(key) if (tree := trees.get(s)) is not None else 0 for s in eligible]
        best = max(matches)
        if best == 0 or best < options.cache_aware_min_match * len(key):
            return None
        tied = [(load, i) for i, (load, m) in enumerate(zip(loads, matches, strict=True)) if m == best]
        fewest = min(tied)[0]
        tied = [t for t in tied if t[0] == fewest]
        return eligible[tied[choice.request.room % len(tied)][1]]


#: ``--routing`` name -> policy.
POLICIES: dict[str, Policy] = {
    "room": by_room,
    "least-loaded": least_loaded,
    "cache-aware": CacheAware(),
}


def make_policy(name: str, options: RoutingOptions | None = None) -> Policy:
    """The policy one pool routes with: the table's function, or a fresh :class:`PoolPolicy`."""
    policy = POLICIES[name]
    if isinstance(policy, PoolPolicy):
        return policy.fresh(options or RoutingOptions())
    return policy


def describe(name: str) -> str:
    """One policy's help text: its function's docstring, on one line."""
    doc = POLICIES[name].__doc__ or ""
    return " ".join(doc.split()).rstrip(".")
