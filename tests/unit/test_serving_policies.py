"""The path-policy benchmark phase's pure parts: metric scraping, judging, aggregation, traces (no servers)."""

from __future__ import annotations

import pytest

from benchmarks.serving_policies import policy_args
from benchmarks.serving_policies_report import (
    SWEEP_TTFT_SLOS_MS,
    acceptance,
    by_path,
    counts_delta,
    judge_closed,
    judge_traces,
    path_counts,
    path_totals,
    summarize,
)
from benchmarks.serving_policies_workloads import bursty_trace, closed_point, rates_from_capacity, trace_size
from benchmarks.serving_trace import Result

METRICS = """\
# HELP pd_router_path_total Requests per prefill path and why it was chosen.
# TYPE pd_router_path_total counter
pd_router_path_total{path="pd",reason="policy"} 7.0
pd_router_path_total{reason="short_uncached",path="local"} 3
pd_router_requests_total{path="pd"} 99
pd_router_path_created{path="pd",reason="policy"} 1.7e9
"""


def lat(ttft_p50: float, tpot_p99: float, **extra: object) -> dict[str, object]:
    return {
        "ttft_ms": {"p50": ttft_p50, "p99": ttft_p50 * 2},
        "tpot_ms": {"p50": tpot_p99 / 2, "p99": tpot_p99},
        **extra,
    }


def test_path_counts_reads_only_the_path_counter_whatever_the_label_order() -> None:
    assert path_counts(METRICS) == {"pd/policy": 7.0, "local/short_uncached": 3.0}
    assert path_counts("") == {}


def test_counts_delta_keeps_what_moved_and_by_path_sums_reasons() -> None:
    before = {"pd/policy": 7.0, "local/short_uncached": 3.0}
    after = {"pd/policy": 12.0, "local/short_uncached": 3.0, "local/tpot": 2.0}
    delta = counts_delta(before, after)
    assert delta == {"local/tpot": 2, "pd/policy": 5}
    assert by_path({**delta, "local/x": 1}) == {"local": 3, "pd": 5}


def closed_round(adaptive: tuple[float, float], colocated: float, always_pd_tpot: float) -> dict[str, dict]:
    return {
        "adaptive": {"closed": {"64x1": lat(*adaptive, paths={"pd/a": 3, "local/b": 1})}},
        "always-pd": {"closed": {"64x1": lat(50.0, always_pd_tpot, paths={"pd/a": 4})}},
        "colocated": {"closed": {"64x1": lat(colocated, 10.0)}},
    }


def test_closed_loop_judges_the_median_of_per_round_ratios() -> None:
    rounds = [closed_round((110.0, 12.0), 100.0, 10.0), closed_round((130.0, 13.0), 100.0, 10.0)]
    judged = judge_closed(rounds)
    ttft = judged["closed_loop_ttft_p50_adaptive_vs_colocated"]
    assert ttft["points"]["64x1"]["rounds"] == [1.1, 1.3]
    assert ttft["points"]["64x1"]["ratio"] == 1.2
    assert ttft["pass"] is False and ttft["worst"] == 1.2
    tpot = judged["closed_loop_tpot_p99_adaptive_vs_always_pd"]
    assert tpot["points"]["64x1"]["ratio"] == 1.25
    assert tpot["pass"] is True


def test_closed_loop_without_colocated_is_undecided_not_passed() -> None:
    rnd = closed_round((100.0, 10.0), 100.0, 10.0)
    rnd["colocated"] = {"error": "ProcessFailed: colocated-a exited"}
    judged = judge_closed([rnd])["closed_loop_ttft_p50_adaptive_vs_colocated"]
    assert judged["points"]["64x1"]["ratio"] is None
    assert judged["pass"] is None


def trace_round(goodput: dict[str, float]) -> dict[str, dict]:
    return {
        name: {"traces": {"poisson": {"goodput_rps": g, "slo_attained": min(1.0, g), **lat(1.0, 1.0)}}}
        for name, g in goodput.items()
    }


STATIC = {"always-pd": 0.5, "always-local": 0.3, "threshold": 0.5, "non-cached": 0.4}


def test_traces_compare_adaptive_with_the_best_static_policy_mean_over_rounds() -> None:
    rounds = [trace_round({"adaptive": 0.5, **STATIC}), trace_round({"adaptive": 0.7, **STATIC})]
    judged = judge_traces(rounds)
    row = judged["trace_goodput_adaptive_vs_best_static"]["traces"]["poisson"]
    assert row["goodput_rps"]["adaptive"] == 0.6
    assert row["slo_attained"]["adaptive"] == 0.6 and row["slo_attained"]["always-local"] == 0.3
    assert row["best_static"] == "always-pd"
    assert row["ratio"] == 1.2 and row["pass"] is True
    gain = judged["trace_goodput_gain_somewhere"]
    assert gain["best"] == 1.2 and gain["pass"] is True and gain["where"] == []  # no sweep in these rounds


def test_traces_are_judged_at_every_swept_ttft_slo_too() -> None:
    rounds = [trace_round({"adaptive": 0.5, **STATIC})]
    for name, g in {"adaptive": 0.5, **STATIC}.items():
        sweep = {str(slo): g for slo in SWEEP_TTFT_SLOS_MS}
        if name == "adaptive":
            sweep["250"] = 0.6  # 1.2x the best static at the tightest SLO
            sweep["3000"] = 0.45  # under it at the loosest
        rounds[0][name]["traces"]["poisson"]["goodput_by_ttft_slo_ms"] = sweep
    judged = judge_traces(rounds)
    at_least, gain = judged["trace_goodput_adaptive_vs_best_static"], judged["trace_goodput_gain_somewhere"]
    assert at_least["swept"]["poisson @ 250 ms"] == 1.2 and at_least["swept"]["poisson @ 3000 ms"] == 0.9
    assert at_least["pass"] is False and at_least["worst"] == 0.9
    assert gain["pass"] is True and gain["where"] == ["poisson @ 250 ms"]


def test_traces_adaptive_below_the_best_static_fails_and_no_gain() -> None:
    judged = judge_traces([trace_round({"adaptive": 0.45, **STATIC})])
    assert judged["trace_goodput_adaptive_vs_best_static"]["pass"] is False
    assert judged["trace_goodput_adaptive_vs_best_static"]["worst"] == 0.9
    assert judged["trace_goodput_gain_somewhere"]["pass"] is False


def test_traces_where_no_static_policy_met_the_slos() -> None:
    zero = dict.fromkeys(STATIC, 0.0)
    judged = judge_traces([trace_round({"adaptive": 0.2, **zero})])
    row = judged["trace_goodput_adaptive_vs_best_static"]["traces"]["poisson"]
    assert row["ratio"] is None and row["pass"] is True
    assert judged["trace_goodput_gain_somewhere"]["pass"] is True
    judged = judge_traces([trace_round({"adaptive": 0.0, **zero})])
    assert judged["trace_goodput_adaptive_vs_best_static"]["pass"] is True
    assert judged["trace_goodput_gain_somewhere"]["pass"] is False


def test_traces_with_a_failed_static_policy_are_undecided() -> None:
    rnd = trace_round({"adaptive": 0.9, **STATIC})
    rnd["threshold"] = {"error": "ValueError: no --path-policy"}
    judged = judge_traces([rnd])
    row = judged["trace_goodput_adaptive_vs_best_static"]["traces"]["poisson"]
    assert row["pass"] is None and "threshold" in row["reason"]
    assert judged["trace_goodput_gain_somewhere"]["pass"] is None


def test_acceptance_all_pass_needs_every_criterion() -> None:
    good = closed_round((100.0, 10.0), 100.0, 10.0)
    for name, entry in trace_round({"adaptive": 0.6, **STATIC}).items():
        good.setdefault(name, {}).update(entry)
    assert acceptance([good])["all_pass"] is True
    slow = closed_round((100.0, 20.0), 100.0, 10.0)
    for name, entry in trace_round({"adaptive": 0.6, **STATIC}).items():
        slow.setdefault(name, {}).update(entry)
    verdict = acceptance([slow])
    assert verdict["closed_loop_tpot_p99_adaptive_vs_always_pd"]["pass"] is False
    assert verdict["trace_goodput_gain_somewhere"]["pass"] is True
    assert verdict["all_pass"] is False


def test_summarize_takes_medians_means_and_sums_paths() -> None:
    rounds = [closed_round((100.0, 10.0), 90.0, 10.0), closed_round((120.0, 14.0), 90.0, 10.0)]
    rounds[0]["adaptive"]["traces"] = {"bursty": {"goodput_rps": 0.4, "failed": 1, **lat(300.0, 20.0)}}
    rounds[1]["adaptive"]["traces"] = {"bursty": {"goodput_rps": 0.6, "failed": 0, **lat(500.0, 30.0)}}
    summary = summarize(rounds)
    closed = summary["adaptive"]["closed 64x1"]
    assert closed["ttft_ms_p50"] == 110.0 and closed["tpot_ms_p99"] == 12.0
    assert closed["paths"] == {"local/b": 2, "pd/a": 6} and closed["by_path"] == {"local": 2, "pd": 6}
    bursty = summary["adaptive"]["bursty"]
    assert bursty["goodput_rps"] == 0.5 and bursty["failed"] == 1 and bursty["ttft_ms_p50"] == 400.0
    assert "paths" not in summary["colocated"]["closed 64x1"]
    assert path_totals(rounds) == {"adaptive": {"local": 2, "pd": 6}, "always-pd": {"pd": 8}}


def test_bursty_trace_shares_a_prefix_within_each_burst_and_reuses_it_later() -> None:
    trace = bursty_trace(4, seed=3, output_tokens=8, size=3, shared=20, unique=5, gap_s=2.0)
    assert [r.at_s for r in trace] == [0.0] * 3 + [2.0] * 3 + [4.0] * 3 + [6.0] * 3
    assert all(len(r.prompt) == 25 and r.max_tokens == 8 for r in trace)
    first, second, third = trace[0:3], trace[3:6], trace[6:9]
    assert len({tuple(r.prompt[:20]) for r in first}) == 1
    assert first[0].prompt[:20] != second[0].prompt[:20]
    assert third[0].prompt[:20] == first[0].prompt[:20]
    assert len({tuple(r.prompt[20:]) for r in first}) == 3
    assert bursty_trace(4, seed=3, output_tokens=8, size=3, shared=20, unique=5) == bursty_trace(
        4, seed=3, output_tokens=8, size=3, shared=20, unique=5
    )


def test_closed_point_skips_the_fill_and_derives_tpot() -> None:
    results = [
        Result(prompt_tokens=64, ttft_s=9.0, e2e_s=9.5, output_tokens=6),
        Result(prompt_tokens=64, ttft_s=0.1, e2e_s=0.4, output_tokens=4),
        Result(prompt_tokens=64, ttft_s=0.2, e2e_s=0.8, output_tokens=4),
        Result(prompt_tokens=64, error="HTTP 503"),
    ]
    point = closed_point(results, skip=1)
    assert point["counted"] == 2 and point["failed"] == 1 and point["errors"] == ["HTTP 503"]
    assert point["ttft_ms"] == {"p50": 100.0, "p99": 200.0}
    assert point["tpot_ms"] == {"p50": 100.0, "p99": 200.0}


def test_policy_args_follow_the_router_flags() -> None:
    flags = {"--path-policy", "--tpot-slo-ms"}
    assert policy_args("adaptive", flags, 50.0) == ["--path-policy", "adaptive", "--tpot-slo-ms", "50"]
    assert policy_args("threshold", flags, 50.0) == ["--path-policy", "threshold"]
    assert policy_args("always-pd", set(), 50.0) == []
    with pytest.raises(ValueError, match="no --path-policy"):
        policy_args("always-local", set(), 50.0)


def test_trace_size_and_rates_from_capacity() -> None:
    assert trace_size(0.5, 16, span_s=10.0) == 16  # the least count wins at a low rate
    assert trace_size(4.5, 16, span_s=10.0) == 48  # 10 s of arrivals at 4.5/s, rounded up to whole rounds of 4 buckets
    assert trace_size(1.0, 5, span_s=1.0) == 8
    assert rates_from_capacity(5.0) == [1.25, 4.5]
    assert rates_from_capacity(0.1) == [0.05, 0.09]


def test_goodput_sweep_scores_each_ttft_slo_and_judges_adaptive_against_the_best_static() -> None:
    from benchmarks.serving_policies_report import SWEEP_TTFT_SLOS_MS, goodput_sweep, judge_sweep
    from benchmarks.serving_trace import Result

    results = [Result(10, ttft_s=t, tpot_s=0.01) for t in (0.2, 0.4, 0.9, 2.5)] + [Result(10, error="x")]
    sweep = goodput_sweep(results, 2.0, 50.0)
    assert sweep == {"250": 0.5, "500": 1.0, "1000": 1.5, "2000": 1.5, "3000": 2.0}
    assert goodput_sweep([Result(10, ttft_s=0.1, tpot_s=0.2)], 1.0, 50.0)["3000"] == 0.0  # TPOT over its SLO
    rnd = {
        "adaptive": {"traces": {"t": {"goodput_by_ttft_slo_ms": {str(s): 2.0 for s in SWEEP_TTFT_SLOS_MS}}}},
        "always-pd": {"traces": {"t": {"goodput_by_ttft_slo_ms": {str(s): 1.0 for s in SWEEP_TTFT_SLOS_MS}}}},
    }
    judged = judge_sweep([rnd])["t"]["500"]
    assert judged["best_static"] == "always-pd" and judged["adaptive_vs_best_static"] == 2.0
