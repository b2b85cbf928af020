"""How close the planner's predictions are to measured serving: ``python benchmarks/plan_accuracy.py RESULT.json``.

``RESULT.json`` is the path-policy phase's output (``benchmarks/serving.py --policies-only``): its
closed-loop points measured TTFT and TPOT p50 for 1P1D (``always-pd``) and two colocated instances
(``colocated``) at each prompt length and concurrency. This script replays each point through the
planner's simulator (``launch.plan_sim``: the same step-time and push model the Router decides with)
and prints, per point and system, predicted / measured p50 and whether it is within ``--tolerance``
(20%).

The step-time model comes from ``--calibration FILE.json`` (``python -m launch.plan_calibrate``), or,
by default, from the run itself: the concurrency-1 points (colocated: a prefill alone per prompt
length and a decode at batch one; 1P1D's TPOT over colocated's: the KV hand-over's gap) fit the
prefill, decode and push terms, and only the concurrency-4 points are judged (``judged: false`` on
the points the fit used). One JSON object on stdout.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from launch.plan import load_models, percentile  # noqa: E402
from launch.plan_sim import Models, Policy, Simulator  # noqa: E402
from launch.plan_trace import TraceRequest  # noqa: E402
from proxy.planning.step_model import PrefillSample, StepModel, TransferModel, solve_least_squares  # noqa: E402

SYSTEMS = {"always-pd": (1, 1, 0), "colocated": (0, 0, 2)}
#: The share of a prefill's fixed cost over a decode step's that the fit puts outside the engine
#: (``Models.overhead_ms``; see ``fit_from_run``).
OVERHEAD_SHARE = 0.5


def _point(summary: dict[str, Any], system: str, length: int, concurrency: int) -> dict[str, Any] | None:
    return (summary.get(system) or {}).get(f"closed {length}x{concurrency}")


def fit_from_run(summary: dict[str, Any], lengths: list[int], output: int) -> Models:
    """A step model from the colocated concurrency-1 points: TTFT p50 = a prefill alone, TPOT p50 = a
    decode step at batch one (the batch term keeps the default's ratio); the push model from 1P1D's
    concurrency-1 TPOTs (:func:`fit_transfer`)."""
    samples = []
    for length in lengths:
        point = _point(summary, "colocated", length, 1)
        if point and point.get("ttft_ms_p50"):
            samples.append(PrefillSample(length, float(point["ttft_ms_p50"])))
    model = StepModel(quadratic=len(samples) >= 3)
    model.fit(samples)
    tpots = [p["tpot_ms_p50"] for n in lengths if (p := _point(summary, "colocated", n, 1)) and p.get("tpot_ms_p50")]
    if tpots:
        default = StepModel()
        step = sorted(tpots)[len(tpots) // 2]
        model.e = default.e * step / (default.d + default.e)
        model.d = step - model.e
    # A client's TTFT alone has a fixed part ``a``: the engine step's own (about a decode step's, ``d``)
    # and the request's way through the front end and the API server, which runs beside the other
    # requests' engine steps. The part over ``d`` is both; with nothing here to tell them apart, half
    # of it is taken as time outside the engine (OVERHEAD_SHARE).
    overhead = max(0.0, model.a - model.d) * OVERHEAD_SHARE
    model.a -= overhead
    return Models(p=model, d=model, c=model, transfer=fit_transfer(summary, lengths, output), overhead_ms=overhead)


def _pd_over_colocated_line(
    summary: dict[str, Any], lengths: list[int], metric: str, scale: float
) -> tuple[float, float] | None:
    """Intercept and slope over the prompt length of (1P1D's ``metric`` - colocated's) x ``scale`` at
    concurrency 1; None with fewer than two lengths measured by both."""
    points = []
    for length in lengths:
        pd, colocated = _point(summary, "always-pd", length, 1), _point(summary, "colocated", length, 1)
        if pd and colocated and pd.get(metric) and colocated.get(metric):
            points.append((float(length), (pd[metric] - colocated[metric]) * scale))
    if len(points) < 2:
        return None
    intercept, slope = solve_least_squares([[1.0, x] for x, _ in points], [y for _, y in points], [1.0] * len(points))
    return intercept, slope


def fit_transfer(summary: dict[str, Any], lengths: list[int], output: int) -> TransferModel:
    """The KV hand-over's cost from the concurrency-1 points: 1P1D's TPOT over colocated's, times the
    tokens after the first, is the gap between P's token 1 and D's token 2 (push, D's admission and
    first step); a line over the prompt lengths gives its fixed part and its per-token part."""
    transfer = TransferModel()
    gap = _pd_over_colocated_line(summary, lengths, "tpot_ms_p50", max(1, output - 1))
    if gap is not None:
        fixed, per_token = gap
        transfer.fixed_ms = max(0.0, fixed)
        if per_token > 0:
            transfer.push_bytes_per_s = transfer.bytes_per_token * 1e3 / per_token
    # P's own time per pushed token: at concurrency 1 the next request arrives with P's first token and
    # its prefill runs beside the previous push on P's core, so 1P1D's TTFT over colocated's grows with
    # the prompt by that much (the slope; the intercept is the two front ends' difference).
    extra = _pd_over_colocated_line(summary, lengths, "ttft_ms_p50", 1)
    if extra is not None:
        transfer.sender_ms_per_token = max(0.0, extra[1])
    return transfer


def simulate(
    models: Models, system: str, length: int, concurrency: int, requests: int, output: int
) -> dict[str, float]:
    p, d, c = SYSTEMS[system]
    sim = Simulator(p=p, d=d, c=c, policy=Policy.ALWAYS_PD, models=models)
    trace = [TraceRequest(0.0, length, output) for _ in range(requests + concurrency)]
    result = sim.run(trace, 1e9, 1e9, concurrency)
    # the benchmark does not count the first <concurrency> requests (the loop filling up)
    ttft = result.ttft_ms[concurrency:] or result.ttft_ms
    tpot = result.tpot_ms[concurrency:] or result.tpot_ms
    return {"ttft_ms_p50": percentile(ttft, 50) or 0.0, "tpot_ms_p50": percentile(tpot, 50) or 0.0}


def check(report: dict[str, Any], models: Models | None, tolerance: float) -> dict[str, Any]:
    closed = report["closed_loop"]
    lengths, levels = list(closed["lengths"]), list(closed["concurrency"])
    summary = report["summary"]
    fitted = models is None
    models = fit_from_run(summary, lengths, report["output_tokens"]) if models is None else models
    rows = []
    for system in SYSTEMS:
        for length in lengths:
            for concurrency in levels:
                measured = _point(summary, system, length, concurrency)
                if not measured:
                    continue
                predicted = simulate(
                    models, system, length, concurrency, int(closed["requests_per_point"]), report["output_tokens"]
                )
                row: dict[str, Any] = {"system": system, "point": f"{length}x{concurrency}"}
                row["judged"] = not (fitted and concurrency == 1)
                for metric in ("ttft_ms_p50", "tpot_ms_p50"):
                    got = measured.get(metric)
                    ratio = predicted[metric] / got if got else None
                    row[metric] = {
                        "predicted": round(predicted[metric], 1),
                        "measured": got,
                        "ratio": round(ratio, 3) if ratio is not None else None,
                        "within": ratio is not None and abs(ratio - 1) <= tolerance,
                    }
                rows.append(row)
    judged = [r for r in rows if r["judged"]]
    return {
        "model": "fitted from the run's concurrency-1 points" if fitted else "--calibration",
        "step": models.p.to_dict(),
        "transfer": models.transfer.to_dict(),
        "tolerance": tolerance,
        "points": rows,
        "within": {
            metric: f"{sum(r[metric]['within'] for r in judged)}/{len(judged)}"
            for metric in ("ttft_ms_p50", "tpot_ms_p50")
        },
        "all_within": all(r[m]["within"] for r in judged for m in ("ttft_ms_p50", "tpot_ms_p50")),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "result", type=Path, help="the path-policy phase's JSON (benchmarks/serving.py --policies-only)"
    )
    parser.add_argument("--calibration", help="step and push times (python -m launch.plan_calibrate --out)")
    parser.add_argument("--tolerance", type=float, default=0.2, help="judged |predicted / measured - 1| (default: 0.2)")
    args = parser.parse_args(argv)
    report = json.loads(args.result.read_text())
    report = report.get("path_policies", report)  # serving.py nests the phase under "path_policies"
    models = load_models(args.calibration) if args.calibration else None
    print(json.dumps(check(report, models, args.tolerance), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
