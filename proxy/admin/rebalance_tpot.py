"""The ``tpot`` rebalancing policy: move streams off a decoder whose measured inter-token latency
is over ``--rebalance-tpot-ms`` onto one with room.

A decoder is *hot* when its ITL is over the target and it has a stream to move; a decoder has
*room* when its ITL is under the target (or not measured: nothing relayed from it lately), it is
healthy, it would still have fewer requests in flight than the hot one after taking a stream
(so a move never makes the target busier than the source was: two decoders never trade a stream
back and forth), and its ITL is at least ``--rebalance-min-gain`` below the hot one's (a moved
stream pauses for its KV move, tens of ms: between two decoders nearly as fast the pause costs
more than the move gains). Hot decoders go first by ITL, highest first; each move goes to the decoder with
room that has the fewest requests in flight (then the lowest ITL); loads are updated after each
move, and at most ``budget`` moves are made.
"""

from __future__ import annotations

from collections.abc import Sequence

from proxy.admin.rebalance_policy import DecoderView, Move


class TpotPolicy:
    """See the module docstring."""

    name = "tpot"

    def __init__(self, tpot_ms: float, min_gain: float = 0.0) -> None:
        if tpot_ms <= 0:
            raise ValueError(f"--rebalance-tpot-ms must be > 0, got {tpot_ms}")
        if not 0 <= min_gain < 1:
            raise ValueError(f"--rebalance-min-gain must be in [0, 1), got {min_gain}")
        self.tpot_ms = tpot_ms
        self.min_gain = min_gain

    def faster(self, target: DecoderView, source: DecoderView) -> bool:
        """Whether ``target``'s ITL (unmeasured: idle) is at least ``min_gain`` below ``source``'s."""
        if target.itl_ms is None or source.itl_ms is None:
            return True
        return target.itl_ms <= source.itl_ms * (1 - self.min_gain)

    def hot(self, view: DecoderView) -> bool:
        """Whether ``view``'s ITL is over the target."""
        return view.itl_ms is not None and view.itl_ms > self.tpot_ms

    def decide(self, decoders: Sequence[DecoderView], budget: int) -> list[Move]:
        load = {d.key: d.in_flight for d in decoders}
        left = {d.key: d.movable for d in decoders}
        sources = sorted((d for d in decoders if self.hot(d) and d.movable > 0), key=lambda d: -(d.itl_ms or 0.0))
        cool = [d for d in decoders if d.healthy and not self.hot(d)]
        moves: list[Move] = []
        for source in sources:
            while len(moves) < budget and left[source.key] > 0:
                room = [
                    d
                    for d in cool
                    if d.key != source.key and load[d.key] + 1 < load[source.key] and self.faster(d, source)
                ]
                if not room:
                    break
                target = min(room, key=lambda d: (load[d.key], d.itl_ms or 0.0))
                moves.append(Move(source.key, target.key))
                load[source.key] -= 1
                load[target.key] += 1
                left[source.key] -= 1
        return moves
