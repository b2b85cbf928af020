"""benchmarks/scale.py at its tiny size (--quick): the JSON's shape, positive numbers, the plot."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.scale import main, slope

STEPS = ("register", "route_lookup", "route_lookup_at_once", "handshake_cold", "handshake_warm")


def test_slope_reads_growth() -> None:
    xs = [1, 4, 16, 64]
    assert slope(xs, [3.0] * 4) == 0.0
    assert slope(xs, [2.0 * x for x in xs]) == 1.0
    assert slope(xs, [x * x for x in xs]) == 2.0
    assert slope([1], [1.0]) is None


def test_quick_run_json_and_plot(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """In this process (vLLM, which the prefill side imports, is loaded once); the Router and backends
    are subprocesses, the prefill side a fork of this process."""
    assert main(["--quick", "--out-dir", str(tmp_path)]) == 0
    report = json.loads(capsys.readouterr().out)
    (json_file,) = tmp_path.glob("*-scale.json")
    assert json.loads(json_file.read_text()) == report
    assert next(tmp_path.glob("*-scale.png")).stat().st_size > 10_000
    assert set(report["control"]) == {"p_sweep", "d_sweep"}
    for row in report["control"]["p_sweep"] + report["control"]["d_sweep"]:
        for step in STEPS:
            numbers = row[step]
            assert numbers["count"] > 0 and numbers["wall_s"] > 0, (step, numbers)
            assert 0 < numbers["p50_ms"] <= numbers["p99_ms"], (step, numbers)
            assert numbers["prefill_cpu_ms_per_call"] >= 0 and numbers["bootstrap_cpu_ms_per_call"] >= 0
        assert row["register"]["bootstrap_cpu_ms_per_call"] > 0
    assert [r["backends_per_role"] for r in report["router"]] == [1, 2]
    for row in report["router"]:
        for phase in ("one_stream", "saturation"):
            assert row[phase]["failed"] == 0 and row[phase]["requests"] > 0
            assert row[phase]["rps"] > 0 and row[phase]["router_cpu_ms_per_request"] > 0
    assert report["exponents"] and all(v is None or isinstance(v, float) for v in report["exponents"].values())
    assert isinstance(report["all_at_most_linear"], bool) and report["limits"]["router_rps_per_core"] > 0
