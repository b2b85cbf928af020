"""Plan a PD deployment: ``python -m launch.plan [--trace FILE.jsonl | --generate bursty ...]``.

Replays a request trace (format: ``launch.plan_trace``) through the simulator
(``launch.plan_sim``) for every topology up to ``--max-instances`` instances (``xPyD`` and
``n`` colocated) and every path policy, and prints one JSON object on stdout: per topology
and policy the predicted TTFT and TPOT p50 / p99, the share of requests meeting both SLOs
(``attainment``) and goodput (those requests per second of the run), then the
recommendation: the least instance count whose attainment reaches ``--attainment``, the
highest goodput among those.

Step and push times come from ``--calibration FILE.json``::

    {"step": {"a": 34, "b": 0.14, "c": 0.00013, "d": 11, "e": 0.4, "f": 0},
     "p": {...}, "d": {...}, "c": {...},            # optional per-role overrides of "step"
     "transfer": {"bytes_per_token": 3072, "push_bytes_per_s": 5e8, "fixed_ms": 5}}

(``StepModel`` / ``TransferModel`` dumps, ``proxy.planning.step_model``). Without it the
defaults are a rough fit for this repository's 2-core CPU CI machine and benchmark model, and
the output says so. ``--plot FILE.png`` draws the table (needs matplotlib).

Policies: ``always-pd``, ``always-local``, ``threshold`` (NVIDIA Dynamo's conditional
disaggregation: prefill on D when the uncached part is under ``--threshold-tokens`` and under
``--threshold-ratio`` of the prompt), ``non-cached`` (llm-d's prefix-based PD decider:
disaggregate when the non-cached tokens exceed ``--non-cached-tokens``), ``adaptive`` (the
lowest predicted TTFT within the TPOT SLO, ``proxy.planning.predict``).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from typing import Any

from launch.plan_sim import InstanceConfig, Models, Policy, PolicyConfig, RunResult, Simulator
from launch.plan_trace import TraceKind, TraceRequest, generate, read_trace, write_trace
from proxy.planning.step_model import calibration_models

DEFAULTS_NOTE = (
    "no --calibration: step and push times are rough defaults for this repository's 2-core CPU "
    "machine serving the benchmark model; calibrate for real hardware"
)


@dataclass(frozen=True)
class Topology:
    p: int = 0
    d: int = 0
    c: int = 0

    @property
    def instances(self) -> int:
        return self.p + self.d + self.c

    @property
    def name(self) -> str:
        return f"{self.c}C" if self.c else f"{self.p}P{self.d}D"


def topologies(max_instances: int) -> list[Topology]:
    out = [Topology(c=n) for n in range(1, max_instances + 1)]
    out += [Topology(p=x, d=n - x) for n in range(2, max_instances + 1) for x in range(1, n)]
    return sorted(out, key=lambda t: (t.instances, t.c == 0, t.p))


def load_models(path: str | None) -> Models:
    if path is None:
        return Models()
    with open(path) as f:
        data: dict[str, Any] = json.load(f)
    roles, transfer = calibration_models(data, f"--calibration {path}")
    return Models(roles["p"], roles["d"], roles["c"], transfer)


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    pos = q / 100.0 * (len(ordered) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return round(ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo), 2)


def summarize(topo: Topology, policy: Policy, result: RunResult, requests: int) -> dict[str, Any]:
    return {
        "topology": topo.name,
        "p": topo.p,
        "d": topo.d,
        "c": topo.c,
        "instances": topo.instances,
        "policy": "colocated" if topo.c else policy.value,
        "ttft_ms": {"p50": percentile(result.ttft_ms, 50), "p99": percentile(result.ttft_ms, 99)},
        "tpot_ms": {"p50": percentile(result.tpot_ms, 50), "p99": percentile(result.tpot_ms, 99)},
        "attainment": round(result.good / max(1, requests), 4),
        "goodput_rps": round(result.good / result.span_s, 4),
        "paths": result.paths,
    }


@dataclass(frozen=True)
class Job:
    topo: Topology
    policy: Policy
    trace: tuple[TraceRequest, ...]
    models: Models
    instance: InstanceConfig
    policy_cfg: PolicyConfig
    slo_ttft_ms: float
    slo_tpot_ms: float
    closed_loop: int = 0


def run_job(job: Job) -> dict[str, Any]:
    t = job.topo
    sim = Simulator(
        p=t.p, d=t.d, c=t.c, policy=job.policy, models=job.models, instance=job.instance, policy_cfg=job.policy_cfg
    )
    return summarize(
        t, job.policy, sim.run(job.trace, job.slo_ttft_ms, job.slo_tpot_ms, job.closed_loop), len(job.trace)
    )


def recommend(rows: list[dict[str, Any]], attainment: float) -> dict[str, Any] | None:
    meeting = [r for r in rows if r["attainment"] >= attainment]
    if not meeting:
        return None
    least = min(r["instances"] for r in meeting)
    best = max((r for r in meeting if r["instances"] == least), key=lambda r: (r["goodput_rps"], -r["ttft_ms"]["p99"]))
    return {
        "topology": best["topology"],
        "policy": best["policy"],
        "instances": least,
        "attainment": best["attainment"],
    }


def plot(rows: list[dict[str, Any]], path: str) -> str:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed: no plot (pip install matplotlib)"
    labels = [f"{r['topology']}\n{r['policy']}" for r in rows]
    xs = range(len(rows))
    fig, axes = plt.subplots(3, 1, figsize=(max(8, len(rows) * 0.5), 10), sharex=True)
    for ax, key, unit in ((axes[0], "ttft_ms", "TTFT ms"), (axes[1], "tpot_ms", "TPOT ms")):
        ax.plot(xs, [r[key]["p50"] or 0 for r in rows], "o", label="p50")
        ax.plot(xs, [r[key]["p99"] or 0 for r in rows], "x", label="p99")
        ax.set_yscale("log")
        ax.set_ylabel(unit)
        ax.legend()
    axes[2].bar(xs, [r["attainment"] for r in rows])
    axes[2].set_ylabel("SLO attainment")
    axes[2].set_xticks(list(xs), labels, rotation=90, fontsize=7)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return f"plot written to {path}"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m launch.plan", description=__doc__.split("\n")[0])
    src = ap.add_mutually_exclusive_group()
    src.add_argument("--trace", help="JSONL trace (launch.plan_trace format)")
    src.add_argument("--generate", choices=[k.value for k in TraceKind], default="bursty")
    ap.add_argument("--requests", type=int, default=1000, help="generated trace: number of requests")
    ap.add_argument("--rate", type=float, default=1.0, help="generated trace: requests per second")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--write-trace", help="also write the trace used here to this JSONL file")
    ap.add_argument(
        "--closed-loop",
        type=int,
        default=0,
        metavar="N",
        help="ignore arrival times: N requests in flight, the next one sent at each first token",
    )
    ap.add_argument("--calibration", help="JSON with StepModel / TransferModel dumps (see the module doc)")
    ap.add_argument("--max-instances", type=int, default=4)
    ap.add_argument("--policies", default=",".join(p.value for p in Policy), help="comma-separated")
    ap.add_argument("--slo-ttft-ms", type=float, default=3000.0)
    ap.add_argument("--slo-tpot-ms", type=float, default=50.0)
    ap.add_argument("--attainment", type=float, default=0.9, help="share of requests that must meet both SLOs")
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--max-num-seqs", type=int, default=128)
    ap.add_argument("--threshold-tokens", type=int, default=2048)
    ap.add_argument("--threshold-ratio", type=float, default=0.7)
    ap.add_argument("--non-cached-tokens", type=int, default=512)
    ap.add_argument("--jobs", type=int, default=2, help="worker processes")
    ap.add_argument("--plot", help="write a PNG of the results here")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.monotonic()
    if args.max_instances < 1:
        raise SystemExit(f"--max-instances {args.max_instances}: must be at least 1")
    try:
        policies = [Policy(v.strip()) for v in args.policies.split(",") if v.strip()]
    except ValueError as exc:
        raise SystemExit(f"--policies {args.policies!r}: {exc} (known: {', '.join(p.value for p in Policy)})") from None
    if args.trace:
        trace = read_trace(args.trace)
        source: dict[str, Any] = {"file": args.trace}
    else:
        trace = generate(TraceKind(args.generate), args.requests, args.rate, seed=args.seed)
        source = {"generated": args.generate, "rate_rps": args.rate, "seed": args.seed}
    if not trace:
        raise SystemExit(f"--trace {args.trace}: no requests")
    if args.write_trace:
        write_trace(args.write_trace, trace)
    models = load_models(args.calibration)
    inst = InstanceConfig(budget=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs)
    pcfg = PolicyConfig(args.threshold_tokens, args.threshold_ratio, args.non_cached_tokens, args.slo_tpot_ms)
    frozen = tuple(trace)
    jobs = [
        Job(t, pol, frozen, models, inst, pcfg, args.slo_ttft_ms, args.slo_tpot_ms, args.closed_loop)
        for t in topologies(args.max_instances)
        for pol in (policies if not t.c else [Policy.ALWAYS_LOCAL])
    ]
    if args.jobs > 1 and len(jobs) > 1:
        with ProcessPoolExecutor(max_workers=args.jobs) as pool:
            rows = list(pool.map(run_job, jobs, chunksize=1))
    else:
        rows = [run_job(j) for j in jobs]
    out: dict[str, Any] = {
        "trace": {
            **source,
            "requests": len(trace),
            "span_s": round(trace[-1].arrival_s - trace[0].arrival_s, 3),
            "closed_loop": args.closed_loop or None,
        },
        "models": {
            "p": models.p.to_dict(),
            "d": models.d.to_dict(),
            "c": models.c.to_dict(),
            "transfer": models.transfer.to_dict(),
            "source": args.calibration or DEFAULTS_NOTE,
        },
        "slo": {"ttft_ms": args.slo_ttft_ms, "tpot_ms": args.slo_tpot_ms, "attainment": args.attainment},
        "results": rows,
        "recommendation": recommend(rows, args.attainment),
    }
    if args.plot:
        out["plot"] = plot(rows, args.plot)
    out["wall_s"] = round(time.monotonic() - started, 2)
    json.dump(out, sys.stdout, indent=1)
    sys.stdout.write("\n")
    if out["recommendation"] is None:
        print(
            f"no topology up to {args.max_instances} instances meets the SLOs for {args.attainment:.0%} of requests",
            file=sys.stderr,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
