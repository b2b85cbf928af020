"""The Router's rebalancing flags (``--rebalance`` and its tuning) and their validation.

Rebalancing (:mod:`proxy.admin.rebalance`) moves running streams from a decoder whose measured
inter-token latency is over a target to one with room, by KV (the drain's D -> D move).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass

from proxy.admin.rebalance_policy import RebalancePolicy
from proxy.admin.rebalance_tpot import TpotPolicy


@dataclass(frozen=True, slots=True)
class RebalanceConfig:
    """Whether and how the Router moves streams between decoders under load (``--rebalance*``)."""

    enabled: bool = False
    #: One of :data:`POLICIES`.
    policy: str = "tpot"
    #: A decoder whose streams' inter-token latency is over this many ms is overloaded.
    tpot_ms: float = 100.0
    #: Moves per second at most, over all decoders (a token bucket holding one second's worth, at least 1).
    max_moves_per_s: float = 1.0
    #: Seconds between two looks at the decoders (each measures their ITL and may move streams).
    interval_s: float = 0.5
    #: A stream with fewer tokens than this left of its budget is not worth moving.
    min_tokens_left: int = 16
    #: A stream moves only to a decoder whose ITL is at least this fraction below its source's.
    min_gain: float = 0.1
    #: Also move streams that cannot move by KV (D prefilled them, or their decoder has no migration) by
    #: replay: the prompt and the tokens so far are prefilled again for the target.
    by_replay: bool = False

    def make_policy(self) -> RebalancePolicy:
        return POLICIES[self.policy](self)


#: ``--rebalance-policy`` name -> the policy for a configuration.
POLICIES: dict[str, Callable[[RebalanceConfig], RebalancePolicy]] = {
    "tpot": lambda config: TpotPolicy(config.tpot_ms, config.min_gain),
}


def add_rebalance_flags(parser: argparse.ArgumentParser) -> None:
    """Add ``--rebalance`` and its tuning flags to the Router's parser."""
    defaults = RebalanceConfig()
    add = parser.add_argument
    add(
        "--rebalance",
        choices=("off", "on"),
        default="off",
        help="on: move running streams off a decoder whose measured inter-token latency is over --rebalance-tpot-ms "
        "to one with room (lower ITL, fewer in flight), WITH their KV (the drain's D -> D move: decoders with the "
        "connector's migration, --decoder-bootstrap-ports); other streams stay where they are (default: %(default)s)",
    )
    add(
        "--rebalance-policy",
        choices=tuple(POLICIES),
        default=defaults.policy,
        help="which streams move (proxy/admin/rebalance_tpot.py) (default: %(default)s)",
    )
    add(
        "--rebalance-tpot-ms",
        type=float,
        default=defaults.tpot_ms,
        help="a decoder whose streams' inter-token latency, as the Router relays them, is over this is "
        "overloaded (default: %(default)s)",
    )
    add(
        "--rebalance-max-moves-per-s",
        type=float,
        default=defaults.max_moves_per_s,
        help="streams moved per second at most, over all decoders (default: %(default)s)",
    )
    add(
        "--rebalance-interval-s",
        type=float,
        default=defaults.interval_s,
        help="seconds between two looks at the decoders' latency (default: %(default)s)",
    )
    add(
        "--rebalance-min-gain",
        type=float,
        default=defaults.min_gain,
        help="a stream moves only to a decoder whose inter-token latency is at least this fraction below its "
        "decoder's, both taken one move later (0.1: 10%% lower); a move pauses the stream for its KV move "
        "(default: %(default)s)",
    )
    add(
        "--rebalance-by-replay",
        action="store_true",
        help="also move streams that cannot move by KV (prefilled on their decoder by the local path, or on a "
        "decoder without migration) by replay: the prompt and the tokens so far are prefilled again for the target "
        "(default: off, such streams stay)",
    )
    add(
        "--rebalance-min-tokens-left",
        type=int,
        default=defaults.min_tokens_left,
        help="a stream with fewer tokens left of its max_tokens is not moved (default: %(default)s)",
    )


def rebalance_config_from_args(args: argparse.Namespace, parser: argparse.ArgumentParser) -> RebalanceConfig:
    """The validated :class:`RebalanceConfig` of parsed arguments (errors exit with code 2)."""
    for flag in ("--rebalance-tpot-ms", "--rebalance-max-moves-per-s", "--rebalance-interval-s"):
        value = getattr(args, flag[2:].replace("-", "_"))
        if not value > 0:
            parser.error(f"{flag} must be > 0 (got {value})")
    if not 0 <= args.rebalance_min_gain < 1:
        parser.error(f"--rebalance-min-gain must be in [0, 1) (got {args.rebalance_min_gain})")
    if args.rebalance_min_tokens_left < 1:
        parser.error(f"--rebalance-min-tokens-left must be at least 1 (got {args.rebalance_min_tokens_left})")
    return RebalanceConfig(
        enabled=args.rebalance == "on",
        policy=args.rebalance_policy,
        tpot_ms=args.rebalance_tpot_ms,
        max_moves_per_s=args.rebalance_max_moves_per_s,
        interval_s=args.rebalance_interval_s,
        min_tokens_left=args.rebalance_min_tokens_left,
        min_gain=args.rebalance_min_gain,
        by_replay=args.rebalance_by_replay,
    )
