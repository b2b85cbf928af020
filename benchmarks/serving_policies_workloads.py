"""The workloads of the path-policy phase (`serving_policies.py`): its flags, the paced traces, the
closed-loop point summary.

- Poisson traces (`serving_trace.make_trace`, prompts stratified over `POISSON_EDGES`) at a low-load
  and a near-saturation rate: given (`--policies-rates`) or `LOW_LOAD` and `NEAR_SATURATION` x
  always-pd's capacity, which `serving_policies.measure_capacity` measures at the start; each
  trace has at least `--policies-requests` requests and `TRACE_SPAN_S` seconds of arrivals;
- a bursty trace (`bursty_trace`): bursts of `BURST_SIZE` requests sent together whose prompts
  share a `SHARED_TOKENS`-token prefix and end in `UNIQUE_TOKENS` tokens of their own, the
  bursts taking turns over a few prefixes (later bursts find theirs cached);
- `closed_point`: TTFT and TPOT of one closed-loop point (`serving_closed.closed_loop`).
"""

from __future__ import annotations

import argparse
import math
import random
from collections.abc import Sequence
from typing import Any

from benchmarks.serving_policies_report import POLICIES
from benchmarks.serving_trace import PROMPT_TOKEN_IDS, Result, TraceRequest, make_trace, ms, percentile

POISSON_EDGES = [64, 500, 1000, 1500, 2000]
BURST_SIZE = 4
SHARED_TOKENS = 1500
UNIQUE_TOKENS = 100
BURST_GAP_S = 5.0
#: The Poisson rates when not given: these fractions of always-pd's measured capacity.
LOW_LOAD = 0.25
NEAR_SATURATION = 0.9
#: Rates used when the capacity could not be measured (P and D did not start in round 1).
FALLBACK_RATES = (0.3, 0.8)
#: Prompts of the capacity probe, and the least seconds of arrivals of a Poisson trace.
PROBE_PROMPTS = 8
TRACE_SPAN_S = 10.0


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The phase's flags on `serving.py`'s parser."""
    p.add_argument("--policies", action="store_true", help="also run the path-policy phase (serving_policies.py)")
    p.add_argument("--policies-only", action="store_true", help="run only the path-policy phase")
    p.add_argument("--policies-repeats", type=int, help="rounds of the path-policy phase (default 2; quick 1)")
    p.add_argument(
        "--policies-list", nargs="+", choices=POLICIES, default=list(POLICIES), help="Router path policies to compare"
    )
    p.add_argument(
        "--policies-rates",
        type=float,
        nargs="+",
        help="Poisson rates (req/s) of the phase's paced traces (default: measured at the start, "
        f"{LOW_LOAD} and {NEAR_SATURATION} x always-pd's capacity: one over the mean TTFT of the trace's prompt "
        "lengths sent one at a time)",
    )
    p.add_argument(
        "--policies-requests",
        type=int,
        help="closed-loop requests per (length, concurrency) point and requests per Poisson trace, at least "
        f"(a trace has at least {TRACE_SPAN_S:g} s of arrivals) (default 12 and 16; quick 2 and 4)",
    )
    p.add_argument(
        "--policies-bursts", type=int, help=f"bursts of {BURST_SIZE} in the bursty trace (default 4; quick 2)"
    )


def finish_arguments(args: argparse.Namespace, p: argparse.ArgumentParser) -> None:
    """Defaults that depend on --quick, and range checks naming the flag."""
    if args.policies_repeats is None:
        args.policies_repeats = 1 if args.quick else 2
    if args.policies_requests is None:
        args.closed_requests, args.trace_requests = (2, 4) if args.quick else (12, 16)
    else:
        args.closed_requests = args.trace_requests = args.policies_requests
    args.trace_span_s = 3.0 if args.quick else TRACE_SPAN_S
    if args.policies_bursts is None:
        args.policies_bursts = 2 if args.quick else 4
    if args.policies_repeats < 1 or args.closed_requests < 1 or args.policies_bursts < 1:
        p.error(
            f"--policies-repeats {args.policies_repeats}, --policies-requests {args.policies_requests} and "
            f"--policies-bursts {args.policies_bursts} must be >= 1"
        )
    if args.policies_rates and any(rate <= 0 for rate in args.policies_rates):
        p.error(f"--policies-rates {args.policies_rates} must be > 0")


def bursty_trace(
    bursts: int,
    seed: int,
    output_tokens: int,
    *,
    size: int = BURST_SIZE,
    shared: int = SHARED_TOKENS,
    unique: int = UNIQUE_TOKENS,
    gap_s: float = BURST_GAP_S,
    prefixes: int | None = None,
) -> list[TraceRequest]:
    """`bursts` bursts of `size` requests sent together every `gap_s`; a burst's prompts start
    with one of `prefixes` shared `shared`-token prefixes (taken in turn; default half as many as
    bursts) and end in `unique` tokens of their own."""
    rng = random.Random(f"bursty:{seed}")
    count = prefixes or max(1, bursts // 2)
    docs = [[rng.choice(PROMPT_TOKEN_IDS) for _ in range(shared)] for _ in range(count)]
    trace = []
    for b in range(bursts):
        for _ in range(size):
            tail = [rng.choice(PROMPT_TOKEN_IDS) for _ in range(unique)]
            trace.append(TraceRequest(at_s=b * gap_s, prompt=docs[b % count] + tail, max_tokens=output_tokens))
    return trace


def trace_size(rate: float, least: int, span_s: float = TRACE_SPAN_S) -> int:
    """Requests of a Poisson trace: at least `least` and `span_s` seconds of arrivals, whole rounds of buckets."""
    buckets = len(POISSON_EDGES) - 1
    return buckets * max(math.ceil(least / buckets), math.ceil(rate * span_s / buckets))


def rates_from_capacity(capacity_rps: float) -> list[float]:
    """The low-load and near-saturation rates for a measured capacity (2 decimals, at least 0.05)."""
    return [max(0.05, round(capacity_rps * f, 2)) for f in (LOW_LOAD, NEAR_SATURATION)]


def make_traces(args: argparse.Namespace, rates: Sequence[float]) -> dict[str, tuple[float, list[TraceRequest]]]:
    """Name -> (nominal rate, trace); the same for every variant."""
    out: dict[str, tuple[float, list[TraceRequest]]] = {}
    for rate in rates:
        count = trace_size(rate, args.trace_requests, args.trace_span_s)
        trace = make_trace(rate, count, args.seed + 7, POISSON_EDGES, args.output_tokens)
        out[f"poisson_{rate:g}rps"] = (rate, trace)
    bursty = bursty_trace(args.policies_bursts, args.seed, args.output_tokens)
    out["bursty_shared_prefix"] = (BURST_SIZE / BURST_GAP_S, bursty)
    return out


def closed_point(results: Sequence[Result], skip: int) -> dict[str, Any]:
    """TTFT and TPOT p50/p99 of a closed-loop point's results after the first `skip`."""
    kept = [r for r in results[skip:] if not r.error]
    tpots = [(r.e2e_s - r.ttft_s) / (r.output_tokens - 1) for r in kept if r.output_tokens > 1]
    ttfts = [r.ttft_s for r in kept]
    return {
        "requests": len(results),
        "counted": len(kept),
        "failed": sum(1 for r in results if r.error),
        "errors": sorted({r.error for r in results if r.error})[:3],
        "ttft_ms": {"p50": ms(percentile(ttfts, 0.5)), "p99": ms(percentile(ttfts, 0.99))},
        "tpot_ms": {"p50": ms(percentile(tpots, 0.5)), "p99": ms(percentile(tpots, 0.99))},
    }
