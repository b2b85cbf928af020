"""The ``tpot`` rebalancing policy: move streams off a decoder whose measured inter-token latency
is over ``--rebalance-tpot-ms`` onto one with room.

Each decoder's ITL is taken to grow in proportion to the streams it runs (``itl * n' / n`` once it
runs ``n'`` instead of ``n``): the cost of one of its streams is what it measures, whatever makes that
decoder slow (a bigger batch, a core it shares, a slower device). A decoder is *hot* when its ITL is
over the target and it has a stream to move. A decoder has *room* when it is healthy, its ITL after
taking one more stream would stay under the target and be at least ``--rebalance-min-gain`` below
the hot decoder's after giving the stream up (a decoder not measured, because nothing was relayed
from it lately, has room while it runs fewer streams than the hot one would after the move; one that
runs nothing is taken at the ITL it last measured). So a move never makes the target slower than its source
becomes (two decoders never trade a stream back and forth), and between two decoders nearly as fast
nothing moves: a moved stream pauses for its KV move, tens of ms, which costs more than it gains
there. Hot decoders go first by ITL, highest first; each move goes to the decoder with room whose
ITL after the move is lowest (then the fewest requests in flight); loads and ITLs are updated after
each move, a source stops once it is no longer hot, and at most ``budget`` moves are made.
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

    def hot(self, view: DecoderView) -> bool:
        """Whether ``view``'s ITL is over the target."""
        return view.itl_ms is not None and view.itl_ms > self.tpot_ms

    def decide(self, decoders: Sequence[DecoderView], budget: int) -> list[Move]:
        load = {d.key: d.in_flight for d in decoders}
        itl = {d.key: d.itl_ms for d in decoders}
        left = {d.key: d.movable for d in decoders}
        sources = sorted((d for d in decoders if self.hot(d) and d.movable > 0), key=lambda d: -(d.itl_ms or 0.0))
        healthy = [d for d in decoders if d.healthy]

        def scaled(key: str, delta: int) -> float | None:
            """``key``'s ITL with ``delta`` streams more (None: not measured; as measured: running nothing)."""
            now, n = itl[key], load[key]
            if now is None or n <= 0:
                return now
            return now * max(n + delta, 0) / n

        moves: list[Move] = []
        for source in sources:
            while len(moves) < budget and left[source.key] > 0 and (itl[source.key] or 0.0) > self.tpot_ms:
                after = scaled(source.key, -1)
                if after is None:
                    break
                room: list[tuple[float, int, str]] = []
                for d in healthy:
                    if d.key == source.key:
                        continue
                    taken = scaled(d.key, +1)
                    if taken is None:  # not measured: it takes streams while it runs fewer than the source
                        if load[d.key] + 1 < load[source.key]:
                            room.append((0.0, load[d.key], d.key))
                    elif taken <= self.tpot_ms and taken <= after * (1 - self.min_gain):
                        room.append((taken, load[d.key], d.key))
                if not room:
                    break
                _, _, target = min(room)
                moves.append(Move(source.key, target))
                taken = scaled(target, +1)
                itl[source.key], itl[target] = after, taken
                load[source.key] -= 1
                load[target] += 1
                left[source.key] -= 1
        return moves
