"""Control plane and Router at deployment size, by simulation: latency and CPU per request against size.

Real servers and real code paths, fake ranks and backends (``scale_control.py``, ``scale_router.py``):

- the bootstrap server with 1 to 64 P ranks registering, route lookups, and 4 to 256 D ranks
  handshaking with the P ranks all at once (signed calls and frames throughout);
- the Router with 1 to 64 fake backends per role, at one stream and at saturation.

Two control-plane series share the largest P deployment: P ranks swept with ``--d-fixed`` D ranks,
and D ranks swept with the largest P deployment. For every measured quantity the JSON gives its
growth exponent: the least-squares slope of log(value) against log(size), so 0 is flat, 1 linear,
2 quadratic; ``judged`` lists the per-request quantities (latency, CPU per call) and each step's wall
time for everything at once, and ``all_at_most_linear`` is true when every judged exponent is at
most ``LINEAR_MAX`` (1 plus a margin for noise on this shared machine).

Prints one JSON object; with ``--out-dir`` also writes ``<date>-scale.json`` and ``<date>-scale.png``
there. Run: ``python benchmarks/scale.py --out-dir benchmarks/results`` (about 3 minutes on 2 cores);
``--quick`` runs a tiny size set (seconds; the unit test uses it).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import sys
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from benchmarks.scale_control import PrefillHost, measure_size  # noqa: E402

#: The largest growth exponent judged "at most linear" (1 plus room for noise).
LINEAR_MAX = 1.15

#: (series, step, metric, size axis) -> judged; the size axis is "p_ranks" or "d_ranks".
CONTROL_JUDGED = [
    ("p_sweep", "register", "p50_ms", "p_ranks"),
    ("p_sweep", "register", "wall_s", "p_ranks"),
    ("p_sweep", "register", "bootstrap_cpu_ms_per_call", "p_ranks"),
    ("p_sweep", "route_lookup", "p50_ms", "p_ranks"),
    ("p_sweep", "route_lookup", "bootstrap_cpu_ms_per_call", "p_ranks"),
    ("p_sweep", "handshake_cold", "p50_ms", "p_ranks"),
    ("p_sweep", "handshake_cold", "prefill_cpu_ms_per_call", "p_ranks"),
    ("d_sweep", "route_lookup_at_once", "wall_s", "d_ranks"),
    ("d_sweep", "route_lookup_at_once", "bootstrap_cpu_ms_per_call", "d_ranks"),
    ("d_sweep", "handshake_cold", "wall_s", "d_ranks"),
    ("d_sweep", "handshake_cold", "p50_ms", "d_ranks"),
    ("d_sweep", "handshake_cold", "prefill_cpu_ms_per_call", "d_ranks"),
    ("d_sweep", "handshake_warm", "wall_s", "d_ranks"),
    ("d_sweep", "handshake_warm", "p50_ms", "d_ranks"),
    ("d_sweep", "handshake_warm", "prefill_cpu_ms_per_call", "d_ranks"),
]
ROUTER_JUDGED = [
    ("one_stream", "p50_ms"),
    ("one_stream", "router_cpu_ms_per_request"),
    ("saturation", "p50_ms"),
    ("saturation", "router_cpu_ms_per_request"),
]


def slope(xs: list[float], ys: list[float]) -> float | None:
    """Least-squares slope of log(y) on log(x) over the points with y > 0 (None with fewer than two)."""
    pts = [(math.log(x), math.log(y)) for x, y in zip(xs, ys, strict=True) if x > 0 and y is not None and y > 0]
    if len({x for x, _ in pts}) < 2:
        return None
    mx = sum(x for x, _ in pts) / len(pts)
    my = sum(y for _, y in pts) / len(pts)
    return round(sum((x - mx) * (y - my) for x, y in pts) / sum((x - mx) ** 2 for x, _ in pts), 3)


def control_exponents(series: dict[str, list[dict[str, Any]]]) -> dict[str, float | None]:
    out = {}
    for name, step, metric, axis in CONTROL_JUDGED:
        rows = series[name]
        out[f"{name}.{step}.{metric}"] = slope([r[axis] for r in rows], [r[step][metric] for r in rows])
    return out


def router_exponents(rows: list[dict[str, Any]]) -> dict[str, float | None]:
    xs = [r["backends_per_role"] for r in rows]
    out = {f"router.{phase}.{metric}": slope(xs, [r[phase][metric] for r in rows]) for phase, metric in ROUTER_JUDGED}
    # Throughput should not fall with more backends: the exponent of 1/rps is judged like a cost.
    out["router.saturation.inverse_rps"] = slope(
        xs, [1 / r["saturation"]["rps"] for r in rows if r["saturation"]["rps"]]
    )
    return out


def limits(control: dict[str, list[dict[str, Any]]], router: list[dict[str, Any]]) -> dict[str, Any]:
    """The headline figures at the largest size measured (what README's "Limits at scale" quotes)."""
    top = control["d_sweep"][-1]
    per_core = lambda ms: round(1000 / ms) if ms else None  # noqa: E731 - calls one core serves per second
    wide = router[-1]
    return {
        "p_ranks": top["p_ranks"],
        "d_ranks": top["d_ranks"],
        "register_at_once_p50_ms": top["register"]["p50_ms"],
        "register_at_once_wall_s": top["register"]["wall_s"],
        "bootstrap_registrations_per_core_s": per_core(top["register"]["bootstrap_cpu_ms_per_call"]),
        "route_bytes": top["route_lookup"]["route_bytes"],
        "route_lookup_p50_ms": top["route_lookup"]["p50_ms"],
        "bootstrap_route_lookups_per_core_s": per_core(top["route_lookup_at_once"]["bootstrap_cpu_ms_per_call"]),
        "all_d_handshake_cold_wall_s": top["handshake_cold"]["wall_s"],
        "all_d_handshake_cold_p50_p99_ms": [top["handshake_cold"]["p50_ms"], top["handshake_cold"]["p99_ms"]],
        "all_d_handshake_warm_wall_s": top["handshake_warm"]["wall_s"],
        "prefill_cpu_ms_per_cold_handshake": top["handshake_cold"]["prefill_cpu_ms_per_call"],
        "prefill_cpu_ms_per_warm_handshake": top["handshake_warm"]["prefill_cpu_ms_per_call"],
        "router_backends_per_role": wide["backends_per_role"],
        "router_rps_at_saturation": max(r["saturation"]["rps"] for r in router),
        "router_cpu_ms_per_request": wide["saturation"]["router_cpu_ms_per_request"],
        "router_rps_per_core": per_core(wide["saturation"]["router_cpu_ms_per_request"]),
        "router_one_stream_p50_ms": wide["one_stream"]["p50_ms"],
    }


def plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(12, 9))
    panels = [
        (axes[0][0], "p_sweep", "p_ranks", [("register", "p50_ms"), ("route_lookup", "p50_ms"), ("handshake_cold", "p50_ms")],
         f"P ranks swept (D = {report['d_fixed']}): latency p50 (ms)"),
        (axes[0][1], "d_sweep", "d_ranks",
         [("route_lookup_at_once", "p50_ms"), ("handshake_cold", "p50_ms"), ("handshake_warm", "p50_ms"),
          ("handshake_cold", "wall_s")],
         f"D ranks swept (P = {report['p_max']}), all at once: p50 (ms), wall (s)"),
        (axes[1][0], "d_sweep", "d_ranks",
         [("route_lookup_at_once", "bootstrap_cpu_ms_per_call"), ("handshake_cold", "prefill_cpu_ms_per_call"),
          ("handshake_warm", "prefill_cpu_ms_per_call")],
         "D ranks swept: prefill-side CPU per call (ms)"),
    ]  # fmt: skip
    for ax, name, axis, lines, title in panels:
        rows = report["control"][name]
        for step, metric in lines:
            ax.plot([r[axis] for r in rows], [r[step][metric] for r in rows], "o-", label=f"{step} {metric}")
        ax.set(xscale="log", yscale="log", xlabel=axis, title=title)
        ax.legend(fontsize=8)
    ax = axes[1][1]
    rows = report["router"]
    xs = [r["backends_per_role"] for r in rows]
    for phase, metric in [("one_stream", "p50_ms"), ("one_stream", "router_cpu_ms_per_request"),
                          ("saturation", "router_cpu_ms_per_request")]:  # fmt: skip
        ax.plot(xs, [r[phase][metric] for r in rows], "o-", label=f"{phase} {metric}")
    ax.plot(xs, [r["saturation"]["rps"] / 1000 for r in rows], "s--", label="saturation krps")
    ax.set(xscale="log", yscale="log", xlabel="backends per role", title="Router: per request (ms), krps")
    ax.legend(fontsize=8)
    for ax in axes.flat:
        ax.grid(True, which="both", alpha=0.3)
    fig.suptitle(f"PDConnector at scale (simulated ranks/backends), {report['date']}, {report['cpus']} CPUs")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--p-ranks", type=int, nargs="+", default=[1, 4, 16, 64], help="P sizes (default: 1 4 16 64)")
    parser.add_argument(
        "--d-ranks", type=int, nargs="+", default=[4, 16, 64, 256], help="D sizes (default: 4 16 64 256)"
    )
    parser.add_argument("--d-fixed", type=int, default=64, help="D ranks while P is swept (default: 64)")
    parser.add_argument("--backends", type=int, nargs="+", default=[1, 4, 16, 64], help="Router backends per role")
    parser.add_argument("--concurrency", type=int, default=64, help="Router saturation streams (default: 64)")
    parser.add_argument("--duration", type=float, default=3.0, help="seconds of the saturation phase (default: 3)")
    parser.add_argument("--routing", default="room", help="the Router's --routing (default: room)")
    parser.add_argument("--quick", action="store_true", help="tiny sizes and short phases (a smoke test)")
    parser.add_argument("--out-dir", type=Path, help="write <date>-scale.json and <date>-scale.png there")
    parser.add_argument("--no-plot", action="store_true", help="no PNG (with --out-dir)")
    args = parser.parse_args(argv)
    if args.quick:
        args.p_ranks, args.d_ranks, args.d_fixed, args.backends = [1, 2], [2, 4], 2, [1, 2]
        args.concurrency, args.duration = 4, 0.3
    say = lambda text: print(text, file=sys.stderr, flush=True)  # noqa: E731
    import logging

    import pd_connector  # noqa: F401 - its log handler, then quieter: one INFO line per rank and call is noise here

    quiet, level = logging.getLogger("pd_connector"), logging.getLogger("pd_connector").level
    quiet.setLevel(logging.WARNING)
    try:
        return _run(args, say)
    finally:
        quiet.setLevel(level)


def _run(args: argparse.Namespace, say: Any) -> int:
    load_before = os.getloadavg()[0]  # other work on the machine: the numbers are only as quiet as it was
    p_max = max(args.p_ranks)
    done: dict[tuple[int, int], dict[str, Any]] = {}

    def size(p: int, d: int) -> dict[str, Any]:
        if (p, d) not in done:
            say(f"control plane: {p} P ranks x {d} D ranks")
            done[(p, d)] = measure_size(
                host, p, d, **({"lookups": 5, "min_calls": 4, "idle_s": 0.2} if args.quick else {})
            )
            say("  " + json.dumps({k: v for k, v in done[(p, d)].items() if isinstance(v, dict)})[:600])
        return done[(p, d)]

    host = PrefillHost()  # the prefill side's process, forked before this one starts any thread
    try:
        control = {
            "p_sweep": [size(p, args.d_fixed) for p in sorted(args.p_ranks)],
            "d_sweep": [size(p_max, d) for d in sorted(args.d_ranks)],
        }
    finally:
        host.close()
    from benchmarks.scale_router import measure_router

    router = []
    for n in sorted(args.backends):
        say(f"router: {n} backends per role")
        router.append(measure_router(n, args.concurrency, args.duration, args.routing, None))
        say("  " + json.dumps(router[-1]))
    exponents = {**control_exponents(control), **router_exponents(router)}
    judged = {k: v for k, v in exponents.items() if v is not None}
    report = {
        "date": datetime.date.today().isoformat(),
        "cpus": os.cpu_count(),
        "load_avg_1m_before_after": [round(load_before, 2), round(os.getloadavg()[0], 2)],
        "p_max": p_max,
        "d_fixed": args.d_fixed,
        "routing": args.routing,
        "linear_max": LINEAR_MAX,
        "exponents": exponents,
        "above_linear": sorted(k for k, v in judged.items() if v > LINEAR_MAX),
        "all_at_most_linear": all(v <= LINEAR_MAX for v in judged.values()),
        "limits": limits(control, router),
        "control": control,
        "router": router,
    }
    text = json.dumps(report, indent=2)
    print(text)
    if args.out_dir:
        args.out_dir.mkdir(parents=True, exist_ok=True)
        stem = args.out_dir / f"{report['date']}-scale"
        stem.with_suffix(".json").write_text(text + "\n")
        if not args.no_plot:
            plot(report, stem.with_suffix(".png"))
        say(f"wrote {stem}.json" + ("" if args.no_plot else f" and {stem}.png"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
