"""The typed interface of a rebalancing policy (``--rebalance-policy``): what it sees, what it decides.

A policy is pure: no I/O, no clock. :class:`proxy.admin.rebalance.Rebalancer` hands it one
:class:`DecoderView` per active decoder each round and carries out the :class:`Move` list it returns
(each one stream moved by KV, the drain's D -> D path: :mod:`proxy.admin.drain`). One file per policy
(:mod:`proxy.admin.rebalance_tpot`); the names ``--rebalance-policy`` takes are
:data:`proxy.admin.rebalance_flags.POLICIES`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True, slots=True)
class DecoderView:
    """One active decoder as the Router measures it now."""

    #: ``host:port`` (the instance's address, unique among decoders).
    key: str
    #: Requests the Router has in flight there (its running batch as the Router sees it).
    in_flight: int
    #: Inter-token latency of its streams over the last rounds, in ms (None: no stream measured).
    itl_ms: float | None
    #: Streams that may be moved off it by KV now (resumable, its KV held for a move, budget left).
    movable: int
    healthy: bool = True


@dataclass(frozen=True, slots=True)
class Move:
    """Move one stream from decoder ``source`` to decoder ``target`` (their :attr:`DecoderView.key`)."""

    source: str
    target: str


class RebalancePolicy(Protocol):
    """Decides which streams to move this round."""

    #: The ``--rebalance-policy`` name.
    name: str

    def decide(self, decoders: Sequence[DecoderView], budget: int) -> list[Move]:
        """At most ``budget`` moves (the ``--rebalance-max-moves-per-s`` allowance left) for the
        decoders as they are now; each move takes one of the source's :attr:`DecoderView.movable`."""
        ...
