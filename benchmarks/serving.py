"""Serving benchmark: PDConnector 1P1D vs colocated vLLM vs vLLM's MooncakeConnector 1P1D, in one run.

The same model (the tiny random Llama of `launch/tiny_model.py`, by default in the issue's
reference shape: hidden 512, 6 layers, 8 heads, 2 KV heads), the same `vllm serve` flags, the
same cores and the same request trace for every system (`serving_systems.py`):

- `pd`: P (whole process tree on core 0) + D (core 1) with PDConnector, behind the Router;
- `colocated`: two plain instances (cores 0 and 1) behind a round-robin front end;
- `vllm_mooncake`: vLLM's in-tree MooncakeConnector (Mooncake TCP) P + D on cores 0 and 1 behind
  a front end that drives it as vLLM's example proxy does, with minimal CPU runtime patches
  (listed in the JSON under `vllm_mooncake.patches`).

The trace (`serving_trace.py`): per rate, Poisson arrivals, max(rate x `--duration`,
`--min-per-bucket` x buckets) requests rounded up to whole rounds of buckets, prompt lengths
stratified over the buckets of `--bucket-edges` (default 64-500, 500-1000, 1000-1500,
1500-2000 tokens; the same count in each), `--output-tokens` tokens each, streamed. Per
system and rate: TTFT and TPOT p50/p99 overall and per bucket, throughput (requests/s and
output tokens/s) and goodput (requests/s that met both SLOs: TTFT <= --slo-ttft-ms, TPOT <=
--slo-tpot-ms). Ratios ours/colocated and ours/vllm_mooncake per rate and bucket, and
`acceptance` (`serving_report.py`): the serving criteria with pass flags. One JSON object on
stdout, progress on stderr, a PNG of TTFT and TPOT against rate and of TTFT p50 per bucket at
the lowest rate (`--png`, needs matplotlib: `pip install -e .[bench]`).

    python benchmarks/serving.py            # 18-20 minutes on 2 cores (start-up 1-3 min per system)
    python benchmarks/serving.py --quick    # ~9 minutes: 2 rates, 1 request per bucket (a smoke run)
    python benchmarks/serving.py --closed-loop-only   # only the closed-loop phase (serving_closed.py): it
                                                      # judges pd against `colocated` and `colocated_p` (one
                                                      # instance on P's cores: PD's own tax)
    python benchmarks/serving.py --policies-only      # only the path-policy phase (serving_policies.py): the
                                                      # Router's five --path-policy choices on one 1P1D pair
                                                      # vs colocated (~25 min; --quick ~5 min)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from benchmarks.serving_closed import bench_closed_loop  # noqa: E402
from benchmarks.serving_interleaved import PAUSE_S, run_interleaved, summarize  # noqa: E402
from benchmarks.serving_policies import bench_policies  # noqa: E402
from benchmarks.serving_policies_workloads import add_arguments as add_policy_arguments  # noqa: E402
from benchmarks.serving_policies_workloads import finish_arguments  # noqa: E402
from benchmarks.serving_report import LATENCY_KEYS, acceptance, ratios  # noqa: E402
from benchmarks.serving_systems import PD_TRANSFER_MODE, STARTERS, SYSTEMS, mooncake_patches  # noqa: E402
from benchmarks.serving_trace import RunStats, TraceRequest, bucket_labels, check_edges, make_trace, run_trace  # noqa: E402
from launch.processes import ProcessFailed, ProcessGroup  # noqa: E402
from pd_connector.config import DisaggConfig  # noqa: E402

REFERENCE_SHAPE = {"num_layers": 6, "hidden_size": 512, "num_heads": 8, "num_kv_heads": 2}
DEFAULT_MODEL_DIR = REPO_ROOT / "models" / "bench-llama-h512-l6"
#: `vllm serve` flags every instance gets, after launch.commands' own (float32, block 32).
SERVE_ARGS = ["--max-model-len", "4096", "--max-num-seqs", "64"]
DEFAULT_EDGES = [64, 500, 1000, 1500, 2000]


def say(message: str) -> None:
    print(f"[serving {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", help="model directory (default: build the reference-shape tiny Llama)")
    p.add_argument("--systems", nargs="+", choices=SYSTEMS, default=list(SYSTEMS))
    p.add_argument(
        "--rates",
        type=float,
        nargs="+",
        help="request rates (req/s); default 0.1 0.3 0.6: the lowest is the low-load point, where one P core queues little (quick: 0.25 0.5)",
    )
    p.add_argument("--duration", type=float, help="seconds of arrivals per rate (default 20; quick 10)")
    p.add_argument("--bucket-edges", type=int, nargs="+", default=DEFAULT_EDGES, help="prompt-length bucket edges")
    p.add_argument(
        "--min-per-bucket", type=int, help="requests per bucket at every rate, at least (default 3; quick 1)"
    )
    p.add_argument("--output-tokens", type=int, default=32)
    p.add_argument("--slo-ttft-ms", type=float, default=3000.0)
    p.add_argument("--slo-tpot-ms", type=float, default=50.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--p-cpus", default="0", help="cores of P (and of colocated instance a)")
    p.add_argument("--d-cpus", default="1", help="cores of D (and of colocated instance b)")
    p.add_argument("--quick", action="store_true", help="2 rates, 10 s each")
    p.add_argument("--png", type=Path, help="where the plot goes (default: <log dir>/serving.png)")
    p.add_argument("--log-dir", type=Path, help="process logs (default: a temporary folder)")
    p.add_argument("--start-timeout", type=float, default=300.0)
    p.add_argument(
        "--interleaved",
        type=int,
        help="prompts per bucket for the interleaved low-load run (serving_interleaved.py): every system up at once, "
        "each prompt sent to each in turn, one request at a time; it judges the low-load TTFT criteria "
        "(default 5; quick 1; 0: skip)",
    )
    p.add_argument(
        "--pd-transfer-mode",
        choices=("layer", "request"),
        default="layer",
        help="PDConnector's transfer_mode for pd (default: layer: P's KV is ready for D as its prefill's forward "
        "ends; request mode hands it over with P's next engine step, which a long prefill of the next request delays)",
    )
    p.add_argument(
        "--closed-loop",
        type=int,
        help="requests per point of the closed-loop phase (serving_closed.py: the next request as soon as the "
        "previous first token came, each system alone; judges pd TTFT <= 1.15x colocated and colocated_p, one "
        "instance on P's cores) (default 16: at concurrency 4 fewer are decided by the loop's start; quick 4; 0: skip)",
    )
    p.add_argument(
        "--closed-loop-repeats",
        type=int,
        default=2,
        help="rounds of the closed-loop phase (pd and both baselines in each)",
    )
    p.add_argument(
        "--closed-loop-modes",
        nargs="+",
        choices=("layer", "request"),
        default=["layer", "request"],
        help="PDConnector transfer modes the closed-loop phase runs pd with (each judged against both baselines)",
    )
    p.add_argument("--closed-loop-only", action="store_true", help="run only the closed-loop phase")
    add_policy_arguments(p)
    args = p.parse_args(argv)
    finish_arguments(args, p)
    if args.closed_loop is None:
        args.closed_loop = 4 if args.quick else 16
    args.rates = args.rates or ([0.25, 0.5] if args.quick else [0.1, 0.3, 0.6])
    args.duration = args.duration or (10.0 if args.quick else 20.0)
    args.min_per_bucket = args.min_per_bucket or (1 if args.quick else 3)
    if args.interleaved is None:
        args.interleaved = 1 if args.quick else 5
    try:
        args.bucket_edges = check_edges(args.bucket_edges)
    except ValueError as exc:
        p.error(str(exc))
    if args.interleaved < 0:
        p.error(f"--interleaved {args.interleaved} must be >= 0")
    if args.min_per_bucket < 1 or args.duration <= 0 or any(r <= 0 for r in args.rates):
        p.error(
            f"--min-per-bucket {args.min_per_bucket}, --duration {args.duration} and --rates {args.rates} must be > 0"
        )
    return args


def build_model(model: str | None) -> str:
    if model:
        return model
    from launch.tiny_model import make_tiny_model

    return str(make_tiny_model(DEFAULT_MODEL_DIR, **REFERENCE_SHAPE))


def request_count(rate: float, duration: float, buckets: int, min_per_bucket: int) -> int:
    """rate x duration requests, at least `min_per_bucket` per bucket, rounded up to whole rounds of buckets."""
    return buckets * max(min_per_bucket, math.ceil(round(rate * duration, 6) / buckets))


def traces(args: argparse.Namespace) -> dict[float, list[TraceRequest]]:
    """Per rate: `request_count` requests, the same for every system."""
    out = {}
    buckets = len(args.bucket_edges) - 1
    for rate in args.rates:
        count = request_count(rate, args.duration, buckets, args.min_per_bucket)
        out[rate] = make_trace(rate, count, args.seed, args.bucket_edges, args.output_tokens)
    return out


async def warm_up(url: str, model: str, args: argparse.Namespace) -> None:
    """A short and a long prompt, one after the other (first-request compilation, connections)."""
    lengths = (args.bucket_edges[0], args.bucket_edges[-1])
    warm = make_trace(1.0, 2, args.seed + 1, [lengths[1], lengths[1] + 1], 4)
    warm = [TraceRequest(0.0, r.prompt[:n], 4) for r, n in zip(warm, lengths, strict=True)]
    for req in warm:
        stats = await run_trace(url, model, [req], 1.0)
        if stats.results[0].error:
            raise RuntimeError(f"warm-up request failed: {stats.results[0].error}")


def bench_system(
    name: str, model: str, args: argparse.Namespace, all_traces: dict[float, list[TraceRequest]], log_dir: Path
) -> dict[str, Any]:
    """Start one system, run every rate's trace against it, stop it; its summary (or its error)."""
    summary: dict[str, Any] = {"runs": []}
    if name == "vllm_mooncake":
        summary["patches"] = mooncake_patches()
    t0 = time.monotonic()
    with ProcessGroup(log_dir / name, report=say) as group:
        try:
            say(f"{name}: starting")
            url = STARTERS[name](group, model, SERVE_ARGS, (args.p_cpus, args.d_cpus), args.start_timeout)
            summary["startup_s"] = round(time.monotonic() - t0, 1)
            say(f"{name}: up after {summary['startup_s']} s at {url}; warming up")
            asyncio.run(warm_up(url, model, args))
            for rate, trace in all_traces.items():
                say(f"{name}: rate {rate}/s, {len(trace)} requests")
                stats: RunStats = asyncio.run(run_trace(url, model, trace, rate))
                run = stats.summary(args.slo_ttft_ms / 1e3, args.slo_tpot_ms / 1e3, args.bucket_edges)
                summary["runs"].append(run)
                say(
                    f"{name}: rate {rate}/s: TTFT p50 {run['ttft_ms']['p50']} ms p99 {run['ttft_ms']['p99']} ms, "
                    f"TPOT p50 {run['tpot_ms']['p50']} ms p99 {run['tpot_ms']['p99']} ms, "
                    f"goodput {run['goodput_rps']}/s, failed {run['failed']}; TTFT p50 per bucket "
                    + ", ".join(f"{k}: {b['ttft_ms']['p50']}" for k, b in run["buckets"].items())
                )
        except Exception as exc:  # noqa: BLE001 - one system's failure is reported, the others still run
            summary["error"] = f"{type(exc).__name__}: {exc}"[:4000]
            say(f"{name}: failed: {summary['error'][:600]}")
            if not isinstance(exc, ProcessFailed):
                traceback.print_exc(file=sys.stderr)
    summary["logs"] = str(log_dir / name)
    return summary


def bench_interleaved(model: str, args: argparse.Namespace, log_dir: Path) -> dict[str, Any]:
    """pd and the other systems up at once, `--interleaved` prompts per bucket sent to each in turn."""
    buckets = len(args.bucket_edges) - 1
    prompts = make_trace(
        min(args.rates), args.interleaved * buckets, args.seed + 2, args.bucket_edges, args.output_tokens
    )
    names = ["pd", *(name for name in args.systems if name != "pd")]
    out: dict[str, Any] = {"systems": names, "pause_s": PAUSE_S, "vs": {}}
    t0 = time.monotonic()
    with ProcessGroup(log_dir / "interleaved", report=say) as group:
        try:
            say(f"interleaved: starting {', '.join(names)} together ({len(prompts)} prompts, each to every one)")
            urls = {
                name: STARTERS[name](group, model, SERVE_ARGS, (args.p_cpus, args.d_cpus), args.start_timeout)
                for name in names
            }
            out["startup_s"] = round(time.monotonic() - t0, 1)
            for url in urls.values():
                asyncio.run(warm_up(url, model, args))
            results = asyncio.run(
                run_interleaved(urls, model, prompts, on_done=lambda n: say(f"interleaved: {n}/{len(prompts)} prompts"))
            )
            for other in names[1:]:
                vs = out["vs"][other] = summarize(results["pd"], results[other], args.bucket_edges)
                say(
                    f"interleaved: ours/{other} TTFT median {vs['ttft_ratio_median']}, per bucket "
                    f"{vs['ttft_ratio_per_bucket']}, ours faster on {vs['ours_faster_share']} of the prompts"
                )
        except Exception as exc:  # noqa: BLE001 - reported in the JSON, the rest of the report stands
            out["error"] = f"{type(exc).__name__}: {exc}"[:4000]
            say(f"interleaved: failed: {out['error'][:600]}")
            if not isinstance(exc, ProcessFailed):
                traceback.print_exc(file=sys.stderr)
    out["logs"] = str(log_dir / "interleaved")
    return out


def bench_closed(model: str, args: argparse.Namespace, log_dir: Path) -> dict[str, Any]:
    """The closed-loop phase (serving_closed.py): per round, pd in each of --closed-loop-modes, then
    colocated and colocated_p, each started alone on the same cores; PD_TRANSFER_MODE is
    --pd-transfer-mode after it."""
    variants = [(f"pd_{mode}", "pd", mode) for mode in args.closed_loop_modes]
    variants += [("colocated", "colocated", None), ("colocated_p", "colocated_p", None)]
    out = bench_closed_loop(
        model, variants=variants, starters=STARTERS, set_mode=lambda mode: PD_TRANSFER_MODE.update(mode=mode),
        serve_args=SERVE_ARGS, cpus=(args.p_cpus, args.d_cpus), start_timeout=args.start_timeout,
        requests=args.closed_loop, repeats=args.closed_loop_repeats, max_tokens=args.output_tokens, seed=args.seed,
        log_dir=log_dir, say=say,
    )  # fmt: skip
    PD_TRANSFER_MODE["mode"] = args.pd_transfer_mode
    return out


def closed_verdict(mode: str, judged: dict[str, Any]) -> dict[str, Any]:
    """One closed-loop acceptance entry: the worst point's ratio and the points over the limit."""
    points = judged.get("points") or {}
    ratios_ = [p["ratio"] for p in points.values() if p["ratio"] is not None]
    return {
        "transfer_mode": mode,
        "limit": judged.get("limit"),
        "max": max(ratios_, default=None),
        "over_limit": sorted(key for key, p in points.items() if p["pass"] is False),
        "pass": judged.get("all_pass"),
    }


def plot(systems: dict[str, dict[str, Any]], path: Path, slo: tuple[float, float]) -> str | None:
    """TTFT and TPOT (p50 solid, p99 dashed) against rate, one line per system, and TTFT p50 per
    prompt-length bucket at the lowest rate, one bar per system; None when it cannot plot."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.2))
    for ax, key, title, limit in zip(axes[:2], LATENCY_KEYS, ("TTFT", "TPOT"), slo, strict=True):
        for name, summary in systems.items():
            runs = summary.get("runs") or []
            if not runs:
                continue
            rates = [r["rate_rps"] for r in runs]
            (line,) = ax.plot(rates, [r[key]["p50"] for r in runs], marker="o", label=f"{name} p50")
            ax.plot(rates, [r[key]["p99"] for r in runs], "x--", color=line.get_color(), label=f"{name} p99")
        ax.axhline(limit, color="grey", linewidth=0.8, linestyle=":", label="SLO")
        ax.set_title(f"{title} vs request rate")
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylabel(f"{title} (ms)")
        ax.set_yscale("log")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    _plot_buckets(axes[2], systems)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return str(path)


def _plot_buckets(ax: Any, systems: dict[str, dict[str, Any]]) -> None:
    """Grouped bars: TTFT p50 per bucket at each system's lowest rate."""
    lowest = {name: min(s["runs"], key=lambda r: r["rate_rps"]) for name, s in systems.items() if s.get("runs")}
    labels = list(next(iter(lowest.values()))["buckets"]) if lowest else []
    width = 0.8 / max(1, len(lowest))
    for i, (name, run) in enumerate(lowest.items()):
        values = [run["buckets"][label]["ttft_ms"]["p50"] or 0.0 for label in labels]
        ax.bar([x + i * width for x in range(len(labels))], values, width, label=f"{name} @ {run['rate_rps']}/s")
    ax.set_xticks([x + width * (len(lowest) - 1) / 2 for x in range(len(labels))], labels)
    ax.set_title("TTFT p50 per prompt length, lowest rate")
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("TTFT p50 (ms)")
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize=7)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="serving-bench-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    say(f"logs in {log_dir}")
    model = build_model(args.model)
    all_traces = traces(args)
    PD_TRANSFER_MODE["mode"] = args.pd_transfer_mode
    started = time.monotonic()
    if args.closed_loop_only or args.policies_only:
        args.systems = []
    if args.policies_only:
        args.closed_loop = args.interleaved = 0
    systems = {name: bench_system(name, model, args, all_traces, log_dir) for name in args.systems}
    report: dict[str, Any] = {
        "model": model,
        "model_shape": REFERENCE_SHAPE if not args.model else None,
        "serve_args": SERVE_ARGS,
        "pd": {"transfer_mode": args.pd_transfer_mode, "router": "first-token path (default flags)"},
        "cpus": {"prefill_or_a": args.p_cpus, "decode_or_b": args.d_cpus},
        "trace": {
            "rates_rps": args.rates,
            "arrivals": "poisson",
            "duration_s_per_rate": args.duration,
            "requests_per_rate": {str(rate): len(t) for rate, t in all_traces.items()},
            "prompt_tokens": [args.bucket_edges[0], args.bucket_edges[-1]],
            "prompt_buckets": bucket_labels(args.bucket_edges),
            "prompt_lengths": "stratified: the same number of requests per bucket, uniform within it",
            "output_tokens": args.output_tokens,
            "stream": True,
            "seed": args.seed,
        },
        "slo": {"ttft_ms": args.slo_ttft_ms, "tpot_ms": args.slo_tpot_ms},
        "systems": systems,
    }
    if "pd" in systems:
        for other, key in (("colocated", "ours_vs_colocated"), ("vllm_mooncake", "ours_vs_vllm_mooncake")):
            if other in systems:
                report[key] = ratios(systems["pd"], systems[other])
    if args.interleaved and "pd" in args.systems and len(args.systems) > 1:
        report["interleaved_low_load"] = bench_interleaved(model, args, log_dir)
    only = args.closed_loop_only or args.policies_only
    report["acceptance"] = {} if only else acceptance(systems, report.get("interleaved_low_load"))
    if args.closed_loop:
        report["closed_loop"] = closed = bench_closed(model, args, log_dir)
        # judged in the connector's default transfer_mode (the phase that chose that default)
        mode = DisaggConfig.transfer_mode
        for baseline, key in (
            ("colocated", "closed_loop_ttft_ratio_vs_colocated"),
            ("colocated_p", "closed_loop_ttft_ratio_vs_colocated_on_p_cores"),
        ):
            judged = closed.get(f"vs_{baseline}", {}).get(f"pd_{mode}") or {}
            report["acceptance"][key] = closed_verdict(mode, judged)
        flags = [c.get("pass") for c in report["acceptance"].values() if isinstance(c, dict)]
        report["acceptance"]["all_pass"] = bool(flags) and all(f is True for f in flags)
    if args.policies or args.policies_only:
        report["path_policies"] = phase = bench_policies(model, args, SERVE_ARGS, log_dir, say)
        if args.policies_only:
            report.pop("trace")  # the phase's own traces are in path_policies
            report["acceptance"] = phase["acceptance"]
        else:
            report["acceptance"]["path_policies"] = phase["acceptance"]
            flags = [c.get("pass", c.get("all_pass")) for c in report["acceptance"].values() if isinstance(c, dict)]
            report["acceptance"]["all_pass"] = bool(flags) and all(f is True for f in flags)
    if "vllm_mooncake" in systems and "error" in systems["vllm_mooncake"]:
        report["vllm_mooncake"] = {"error": systems["vllm_mooncake"]["error"]}
    if systems:
        report["plot"] = plot(systems, args.png or log_dir / "serving.png", (args.slo_ttft_ms, args.slo_tpot_ms))
    report["wall_s"] = round(time.monotonic() - started, 1)
    print(json.dumps(report, indent=2))
    return 0 if all("error" not in s for s in systems.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
