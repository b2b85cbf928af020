"""``benchmarks/plan_accuracy.py``: the planner replays a path-policy run's closed-loop points and compares."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import plan_accuracy
from launch.plan_sim import Models
from proxy.planning.step_model import StepModel

LENGTHS, LEVELS, REQUESTS, OUTPUT = [64, 1024, 1900], [1, 4], 8, 16


def _report(model: StepModel, scale: float = 1.0) -> dict:
    """A run whose measured points are the simulator's own (times ``scale``)."""
    models = Models(p=model, d=model, c=model)
    summary: dict = {}
    for system in plan_accuracy.SYSTEMS:
        rows = summary.setdefault(system, {})
        for length in LENGTHS:
            for level in LEVELS:
                got = plan_accuracy.simulate(models, system, length, level, REQUESTS, OUTPUT)
                rows[f"closed {length}x{level}"] = {k: round(v * scale, 1) for k, v in got.items()}
    closed = {"lengths": LENGTHS, "concurrency": LEVELS, "requests_per_point": REQUESTS}
    return {"closed_loop": closed, "summary": summary, "output_tokens": OUTPUT}


def test_a_calibrated_planner_matches_its_own_run_and_a_wrong_one_does_not(tmp_path: Path) -> None:
    model = StepModel(a=3.0, b=0.15, c=2e-5, d=4.0, e=0.2)
    calibration = tmp_path / "calibration.json"
    calibration.write_text(json.dumps({"step": model.to_dict()}))
    models = plan_accuracy.load_models(str(calibration))
    good = plan_accuracy.check(_report(model), models, 0.2)
    assert good["all_within"], good["within"]
    assert len(good["points"]) == 2 * len(LENGTHS) * len(LEVELS)
    slow = plan_accuracy.check(_report(model, scale=1.5), models, 0.2)
    assert not slow["all_within"]


def test_fitting_from_the_run_judges_only_the_other_points(tmp_path: Path) -> None:
    result = tmp_path / "run.json"
    result.write_text(json.dumps({"path_policies": _report(StepModel(a=3.0, b=0.15, c=2e-5, d=4.0, e=0.2))}))
    assert plan_accuracy.main([str(result)]) == 0
    out = plan_accuracy.check(json.loads(result.read_text())["path_policies"], None, 0.2)
    unjudged = [r["point"] for r in out["points"] if not r["judged"]]
    assert unjudged == [f"{n}x1" for n in LENGTHS] * 2
    assert out["step"]["b"] > 0


def test_the_fit_puts_part_of_the_fixed_cost_outside_the_engine_and_a_push_cost_on_p() -> None:
    report = _report(StepModel(a=20.0, b=0.15, c=2e-5, d=4.0, e=0.2))
    before = plan_accuracy.fit_from_run(report["summary"], LENGTHS, OUTPUT).transfer.sender_ms_per_token
    for length, extra in zip(LENGTHS, (1.0, 11.0, 20.0), strict=True):  # 1P1D's TTFT grows ~0.01 ms a token
        report["summary"]["always-pd"][f"closed {length}x1"]["ttft_ms_p50"] += extra
    models = plan_accuracy.fit_from_run(report["summary"], LENGTHS, OUTPUT)
    assert models.overhead_ms > 0 and models.p.a + models.overhead_ms > models.p.d
    assert models.overhead_ms == pytest.approx(
        (models.p.a + models.overhead_ms - models.p.d) * plan_accuracy.OVERHEAD_SHARE
    )
    assert models.transfer.sender_ms_per_token - before == pytest.approx(0.0103, rel=0.05)
