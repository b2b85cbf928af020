"""The path-policy phase of `benchmarks/serving.py` (`--policies` / `--policies-only`).

The Router's `--path-policy` decides per request whether P prefills and pushes the KV to D
(`pd`) or D prefills the request itself (`local`). This phase compares the five policies
(adaptive, always-pd, always-local, threshold: NVIDIA Dynamo's static rule, non-cached: llm-d's)
on the SAME 1P1D instances (P's whole process tree on `--p-cpus`, D's on `--d-cpus`, as
`serving_systems.py`'s `pd`), and the `colocated` baseline (two plain instances on the same
cores, each instance alone, started once PD is stopped).

Per round: P and D start once; each policy gets its own Router, started in turn (the previous
one stopped), and P's and D's prefix caches are reset (vLLM's `/reset_prefix_cache`, served
under `VLLM_SERVER_DEV_MODE=1`) before each workload, so no policy sees prompts an earlier one
left cached. Then PD stops and `colocated` runs the same workloads. Odd rounds run everything in
the reverse order (colocated first, the policies reversed), so the machine's drift hits all alike.

Workloads, per variant:

1. the closed loop of `serving_closed.py` (each client's next request as soon as its previous
   first token came) at every (length, concurrency) of `LENGTHS` x `CONCURRENCY`;
2. paced traces (`serving_trace.py`'s client): Poisson at a low-load and a near-saturation rate
   (given, or fractions of always-pd's capacity measured at the start: `measure_capacity`),
   prompts stratified over 64-2000 tokens, and a bursty trace whose bursts of requests arrive at
   once and share a long prefix, the bursts taking turns over a few such prefixes (later bursts
   find theirs cached). The shapes: `serving_policies_workloads.py`.

Per variant and workload: TTFT and TPOT p50/p99, goodput (requests/s meeting both SLOs) for the
traces, and the Router's `pd_router_path_total` counted during the workload. Judging and
aggregation: `serving_policies_report.py`.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import httpx

from benchmarks.serving_closed import CONCURRENCY, LENGTHS, closed_loop, prompts_for
from benchmarks.serving_policies_report import (
    COLOCATED,
    acceptance,
    counts_delta,
    goodput_sweep,
    judge_sweep,
    path_counts,
    path_totals,
    summarize,
)
from benchmarks.serving_policies_workloads import (
    BURST_GAP_S,
    BURST_SIZE,
    FALLBACK_RATES,
    POISSON_EDGES,
    PROBE_PROMPTS,
    SHARED_TOKENS,
    UNIQUE_TOKENS,
    closed_point,
    make_traces,
    rates_from_capacity,
)
from benchmarks.serving_trace import RunStats, TraceRequest, make_trace, ms
from benchmarks.serving_trace import run_trace as run_paced
from launch.processes import (
    ManagedProcess,
    ProcessFailed,
    ProcessGroup,
    free_ports,
    router_cmd,
    start_pd_stack,
    wait_http_ok,
)

#: Pause after each closed-loop point and trace (vLLM's CPU workers spin about a second after work).
QUIET_S = 1.0

Say = Callable[[str], None]


class Target:
    """Where a variant answers: its front URL, the Router's /metrics (None for colocated) and the
    instances whose prefix caches are reset before each workload."""

    def __init__(self, url: str, router: str | None, instances: Sequence[str]) -> None:
        self.url, self.router, self.instances = url, router, list(instances)

    def scrape(self) -> dict[str, float] | None:
        if self.router is None:
            return None
        reply = httpx.get(f"{self.router}/metrics", timeout=10.0, trust_env=False)
        reply.raise_for_status()
        return path_counts(reply.text)

    def reset_caches(self) -> list[str]:
        """Reset every instance's prefix cache (retried while blocks are still held); what failed."""
        failed = []
        for base in self.instances:
            for _ in range(20):
                try:
                    reply = httpx.post(f"{base}/reset_prefix_cache", timeout=10.0, trust_env=False)
                    if reply.status_code == 200 and reply.json().get("success"):
                        break
                except (httpx.HTTPError, ValueError):
                    pass
                time.sleep(0.5)
            else:
                failed.append(base)
        return failed


def _with_paths(target: Target, before: dict[str, float] | None, entry: dict[str, Any]) -> dict[str, Any]:
    if before is not None:
        entry["paths"] = counts_delta(before, target.scrape() or {})
    return entry


def run_workloads(
    target: Target, model: str, args: argparse.Namespace, traces: dict[str, tuple[float, list[TraceRequest]]], say: Say
) -> dict[str, Any]:
    """Every closed-loop point, then every trace, against one variant."""
    out: dict[str, Any] = {"closed": {}, "traces": {}, "cache_reset_failed": []}
    out["cache_reset_failed"] += target.reset_caches()
    for length in LENGTHS:
        for conc in CONCURRENCY:
            prompts = prompts_for(length, args.closed_requests + conc, args.seed * 1000 + conc)
            before = target.scrape()
            results = asyncio.run(closed_loop(target.url, model, prompts, conc, args.output_tokens))
            point = _with_paths(target, before, closed_point(results, conc))
            out["closed"][f"{length}x{conc}"] = point
            say(
                f"  closed {length}x{conc}: TTFT p50 {point['ttft_ms']['p50']} ms, TPOT p99 {point['tpot_ms']['p99']} "
                f"ms, failed {point['failed']}, paths {point.get('paths')}"
            )
            time.sleep(QUIET_S)
    for name, (rate, trace) in traces.items():
        out["cache_reset_failed"] += target.reset_caches()
        before = target.scrape()
        stats: RunStats = asyncio.run(run_paced(target.url, model, trace, rate))
        run = stats.summary(args.slo_ttft_ms / 1e3, args.slo_tpot_ms / 1e3)
        run["goodput_by_ttft_slo_ms"] = goodput_sweep(stats.results, stats.offered_s, args.slo_tpot_ms)
        for key in ("requests_ttft_ms", "requests_bucket", "buckets"):
            run.pop(key, None)
        out["traces"][name] = _with_paths(target, before, run)
        say(
            f"  {name}: TTFT p50 {run['ttft_ms']['p50']} p99 {run['ttft_ms']['p99']} ms, TPOT p50 "
            f"{run['tpot_ms']['p50']} p99 {run['tpot_ms']['p99']} ms, goodput {run['goodput_rps']}/s, "
            f"failed {run['failed']}, paths {out['traces'][name].get('paths')}"
        )
        time.sleep(QUIET_S)
    return out


def router_flags() -> set[str]:
    """The long flags `python -m proxy --help` lists."""
    text = subprocess.run(
        [sys.executable, "-m", "proxy", "--help"], capture_output=True, text=True, check=False, timeout=60
    ).stdout
    return {word.strip("[],") for word in text.split() if word.startswith(("--", "[--"))}


def policy_args(policy: str, flags: set[str], tpot_slo_ms: float) -> list[str]:
    """Router flags for `policy`; ValueError when this Router cannot run it."""
    if "--path-policy" not in flags:
        if policy == "always-pd":
            return []  # a Router before --path-policy: every request takes the PD path
        raise ValueError(f"policy {policy!r}: this Router has no --path-policy flag (python -m proxy --help)")
    args = ["--path-policy", policy]
    if policy == "adaptive" and "--tpot-slo-ms" in flags:
        args += ["--tpot-slo-ms", f"{tpot_slo_ms:g}"]
    return args


def _warm(url: str, model: str, args: argparse.Namespace) -> None:
    for length in (LENGTHS[0], LENGTHS[-1]):
        result = asyncio.run(closed_loop(url, model, prompts_for(length, 1, -1), 1, 4))[0]
        if result.error:
            raise RuntimeError(f"warm-up request of {length} tokens failed: {result.error}")


def measure_capacity(url: str, model: str, args: argparse.Namespace, say: Say) -> dict[str, Any]:
    """always-pd's capacity: `PROBE_PROMPTS` prompts of the Poisson traces' lengths, one at a time
    (each sent at the previous one's first token): 1 / their mean TTFT (P is busy about that long
    per prompt; a slight underestimate, as the TTFT also holds the Router hop and D's first step)."""
    prompts = [r.prompt for r in make_trace(1.0, PROBE_PROMPTS, args.seed + 11, POISSON_EDGES, 4)]
    results = asyncio.run(closed_loop(url, model, prompts, 1, 4))
    ttfts = [r.ttft_s for r in results if not r.error]
    if len(ttfts) < len(results):
        raise RuntimeError(f"capacity probe: {len(results) - len(ttfts)} request(s) failed: {results[0].error}")
    mean = statistics.fmean(ttfts)
    out = {"prompts": len(prompts), "mean_prompt_tokens": round(statistics.fmean(map(len, prompts)))}
    out.update(mean_ttft_ms=ms(mean), capacity_rps=round(1.0 / mean, 3), rates_rps=rates_from_capacity(1.0 / mean))
    say(
        f"policies: always-pd capacity {out['capacity_rps']}/s (mean TTFT {out['mean_ttft_ms']} ms): rates {out['rates_rps']}"
    )
    return out


def _error(label: str, exc: BaseException, say: Say) -> str:
    text = f"{type(exc).__name__}: {exc}"[:2000]
    say(f"policies {label}: failed: {text[:600]}")
    if not isinstance(exc, ProcessFailed | ValueError):
        traceback.print_exc(file=sys.stderr)
    return text


def run_pd_block(
    policies: Sequence[str], model: str, args: argparse.Namespace, serve_args: Sequence[str], ctx: dict[str, Any]
) -> dict[str, Any]:
    """P and D once, then each policy's Router in turn and its workloads; {policy: entry}."""
    say: Say = ctx["say"]
    out: dict[str, Any] = {}
    mode = {"transfer_mode": args.pd_transfer_mode}
    with ProcessGroup(ctx["log_dir"] / "pd", report=say) as group:
        try:
            t0 = time.monotonic()
            stack = start_pd_stack(
                group, model, p_args=serve_args, d_args=serve_args, p_cpus=args.p_cpus, d_cpus=args.d_cpus,
                timeout=args.start_timeout, extra_p_config=mode, extra_d_config=mode,
                router_args=policy_args("always-pd", ctx["router_flags"], args.slo_tpot_ms),
            )  # fmt: skip
            stack.prefill.drain = stack.decode.drain = None  # each Router here is stopped before P and D
            say(f"policies: P and D up after {time.monotonic() - t0:.1f} s")
            _warm(stack.router_url, model, args)
            if ctx["traces"] is None:
                ctx["calibration"] = measure_capacity(stack.router_url, model, args, say)
                ctx["traces"] = make_traces(args, ctx["calibration"]["rates_rps"])
        except Exception as exc:  # noqa: BLE001 - every policy of this round reports it
            return {policy: {"error": _error("P and D", exc, say)} for policy in policies}
        router: ManagedProcess = stack.router
        host = stack.host
        for policy in policies:
            entry: dict[str, Any] = {}
            t0 = time.monotonic()
            try:
                flags = policy_args(policy, ctx["router_flags"], args.slo_tpot_ms)
                group.stop(router)
                (port,) = free_ports(1)
                cmd = router_cmd(port, [(host, stack.prefill_port, stack.bootstrap_port)], [(host, stack.decode_port)])
                router = group.start(
                    f"router-{policy}", [*cmd, *flags], env=dict(os.environ, PYTHONUNBUFFERED="1"), cpus=""
                )
                url = f"http://{host}:{port}"
                wait_http_ok(f"{url}/health", 60.0, router)
                say(f"policies: {policy}: Router up ({' '.join(flags) or 'default flags'})")
                _warm(url, model, args)
                target = Target(url, url, [stack.prefill_url, stack.decode_url])
                entry = run_workloads(target, model, args, ctx["traces"], say)
                entry["router_args"] = flags
            except Exception as exc:  # noqa: BLE001 - reported in the JSON; the other policies still run
                entry["error"] = _error(policy, exc, say)
            entry["wall_s"] = round(time.monotonic() - t0, 1)
            out[policy] = entry
    return out


def run_colocated(
    model: str, args: argparse.Namespace, serve_args: Sequence[str], ctx: dict[str, Any]
) -> dict[str, Any]:
    """Two plain instances on P's and D's cores behind a round-robin front end, every workload."""
    from benchmarks.serving_systems import start_colocated

    say: Say = ctx["say"]
    entry: dict[str, Any] = {}
    t0 = time.monotonic()
    with ProcessGroup(ctx["log_dir"] / "colocated", report=say) as group:
        try:
            url = start_colocated(group, model, serve_args, (args.p_cpus, args.d_cpus), args.start_timeout)
            say(f"policies: colocated up after {time.monotonic() - t0:.1f} s")
            _warm(url, model, args)
            # a fresh pair each round; each workload's prompts are its own, so no cache reset is needed
            entry = run_workloads(Target(url, None, []), model, args, ctx["traces"], say)
        except Exception as exc:  # noqa: BLE001 - reported in the JSON
            entry["error"] = _error(COLOCATED, exc, say)
    entry["wall_s"] = round(time.monotonic() - t0, 1)
    return entry


def bench_policies(
    model: str, args: argparse.Namespace, serve_args: Sequence[str], log_dir: Path, say: Say
) -> dict[str, Any]:
    """Every round (module docstring); the phase's JSON, `acceptance` included."""
    started = time.monotonic()
    ctx: dict[str, Any] = {"say": say, "router_flags": router_flags(), "calibration": None, "traces": None}
    if args.policies_rates:
        ctx["traces"] = make_traces(args, args.policies_rates)
    previous = os.environ.get("VLLM_SERVER_DEV_MODE")
    os.environ["VLLM_SERVER_DEV_MODE"] = "1"  # P's and D's /reset_prefix_cache
    rounds: list[dict[str, Any]] = []
    try:
        for index in range(args.policies_repeats):
            policies = list(args.policies_list) if index % 2 == 0 else list(reversed(args.policies_list))
            rnd: dict[str, Any] = {}
            for part in ("pd", COLOCATED) if index % 2 == 0 else (COLOCATED, "pd"):
                ctx["log_dir"] = log_dir / f"policies-{index}"
                say(f"policies round {index + 1}/{args.policies_repeats}: {part}")
                if part == "pd":
                    rnd.update(run_pd_block(policies, model, args, serve_args, ctx))
                else:
                    if ctx["traces"] is None:  # P and D failed before the capacity probe
                        ctx["traces"] = make_traces(args, FALLBACK_RATES)
                    rnd[COLOCATED] = run_colocated(model, args, serve_args, ctx)
            rounds.append(rnd)
    finally:
        if previous is None:
            os.environ.pop("VLLM_SERVER_DEV_MODE", None)
        else:
            os.environ["VLLM_SERVER_DEV_MODE"] = previous
    return {
        "what": "Router path policies on one 1P1D pair (one Router per policy) vs colocated, same cores",
        "policies": list(args.policies_list),
        "router_path_policy_flag": "--path-policy" in ctx["router_flags"],
        "repeats": args.policies_repeats,
        "closed_loop": {
            "lengths": list(LENGTHS),
            "concurrency": list(CONCURRENCY),
            "requests_per_point": args.closed_requests,
            "counted": "each point sends requests_per_point + concurrency prompts; the first <concurrency> "
            "(the loop filling up) are not counted",
        },
        "rates": "given (--policies-rates)" if args.policies_rates else ctx["calibration"] or "fallback",
        "traces": {
            name: {"rate_rps": round(rate, 3), "requests": len(trace), "span_s": round(trace[-1].at_s, 1)}
            for name, (rate, trace) in (ctx["traces"] or {}).items()
        },
        "bursty": {
            "burst_size": BURST_SIZE,
            "shared_tokens": SHARED_TOKENS,
            "unique_tokens": UNIQUE_TOKENS,
            "gap_s": BURST_GAP_S,
            "bursts": args.policies_bursts,
        },  # fmt: skip
        "output_tokens": args.output_tokens,
        "slo": {"ttft_ms": args.slo_ttft_ms, "tpot_ms": args.slo_tpot_ms},
        "summary": summarize(rounds),
        "path_totals": path_totals(rounds),
        "acceptance": acceptance(rounds),
        "goodput_by_ttft_slo": judge_sweep(rounds),
        "rounds": rounds,
        "logs": str(log_dir),
        "wall_s": round(time.monotonic() - started, 1),
    }
