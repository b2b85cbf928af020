"""The Router's path-choice flags (``--path-policy`` and its tuning) and their validation."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass

from proxy.planning.path_policy import PATH_POLICIES, PathOptions, describe_path_policy

#: Environment variable naming the default ``--path-policy`` (the flag wins).
PATH_POLICY_ENV = "PD_ROUTER_PATH_POLICY"


@dataclass(frozen=True, slots=True)
class PathConfig:
    """How the Router chooses each request's path (:mod:`proxy.planning.live`)."""

    policy: str = "adaptive"
    options: PathOptions = PathOptions()
    #: ``launch.plan``'s calibration JSON with the instances' step and push times (None: defaults).
    model_file: str | None = None
    #: Tokens per KV block of the instances (their prefix caches hold whole blocks).
    block_tokens: int = 32


def add_path_flags(parser: argparse.ArgumentParser) -> None:
    """Add ``--path-policy``, its tuning flags and ``--path-model`` to the Router's parser."""
    names = tuple(PATH_POLICIES)
    default = os.environ.get(PATH_POLICY_ENV) or names[0]
    described = "; ".join(f"'{name}' = {describe_path_policy(name)}" for name in names).replace("%", "%%")
    add = parser.add_argument
    add(
        "--path-policy",
        default=default,
        help=f"where each request prefills: {described} (default: %(default)s; {PATH_POLICY_ENV} sets it)",
    )
    options = PathOptions()
    add(
        "--tpot-slo-ms",
        type=float,
        default=options.tpot_slo_ms,
        help="adaptive: a path whose predicted TPOT on the decoder exceeds this many ms is ruled out "
        "(default: %(default)s)",
    )
    add(
        "--local-margin",
        type=float,
        default=options.local_margin,
        help="adaptive: the decoder prefills only when its predicted TTFT beats P's by this fraction "
        "(default: %(default)s)",
    )
    add(
        "--threshold-tokens",
        type=int,
        default=options.threshold_tokens,
        help="threshold: the decoder prefills when the uncached part of the prompt is under this many tokens "
        "(default: %(default)s) ...",
    )
    add(
        "--threshold-ratio",
        type=float,
        default=options.threshold_ratio,
        help="... and under this fraction of the prompt (default: %(default)s)",
    )
    add(
        "--non-cached-tokens",
        type=int,
        default=options.non_cached_tokens,
        help="non-cached: P prefills when more tokens than this are not cached on the decoder (default: %(default)s)",
    )
    add(
        "--prefix-block-tokens",
        type=int,
        default=32,
        help="the instances' KV block size in tokens (--block-size): a prompt prefix shorter than one block is "
        "not counted as cached (default: %(default)s)",
    )
    add(
        "--path-model",
        metavar="FILE.json",
        help="step and push times of the instances (the calibration format of python -m launch.plan); "
        "default: this machine's calibration, prefill terms rescaled by the prefills the Router sees",
    )


def path_config_from_args(args: argparse.Namespace, parser: argparse.ArgumentParser) -> PathConfig:
    """The validated :class:`PathConfig` (``parser.error`` names a bad value)."""
    from proxy.planning.live import ModelSet  # the pool's types: imported when the flags are read

    if args.prefix_block_tokens < 1:
        parser.error(f"--prefix-block-tokens {args.prefix_block_tokens}: must be at least 1")
    if args.path_policy not in PATH_POLICIES:
        parser.error(
            f"--path-policy {args.path_policy!r} (or {PATH_POLICY_ENV}): choose from {', '.join(PATH_POLICIES)}"
        )
    try:
        options = PathOptions(
            threshold_tokens=args.threshold_tokens,
            threshold_ratio=args.threshold_ratio,
            non_cached_tokens=args.non_cached_tokens,
            tpot_slo_ms=args.tpot_slo_ms,
            local_margin=args.local_margin,
        )
        ModelSet.load(args.path_model)
    except ValueError as exc:
        parser.error(str(exc))
    return PathConfig(args.path_policy, options, args.path_model, args.prefix_block_tokens)
