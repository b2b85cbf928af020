"""benchmarks/serving.py's parts that need no vLLM: the trace, the client and its statistics, the
front ends (round robin; vLLM-Mooncake bodies), the ratios and the plot."""

from __future__ import annotations

import asyncio
import math
import sys
from pathlib import Path

import pytest

from benchmarks import serving
from benchmarks.serving_proxy import mooncake_bodies
from benchmarks.serving_systems import mooncake_patches
from benchmarks.serving_trace import Result, RunStats, make_trace, percentile, run_trace
from launch.processes import ProcessGroup, free_ports, wait_http_ok

REPO = Path(__file__).resolve().parent.parent


def test_trace_is_seeded_poisson_with_prompt_lengths_in_range() -> None:
    trace = make_trace(2.0, 200, seed=3, min_prompt=64, max_prompt=2000, output_tokens=32)
    assert trace == make_trace(2.0, 200, seed=3, min_prompt=64, max_prompt=2000, output_tokens=32)
    assert trace != make_trace(1.0, 200, seed=3, min_prompt=64, max_prompt=2000, output_tokens=32)
    assert all(64 <= len(r.prompt) <= 2000 and r.max_tokens == 32 for r in trace)
    gaps = [b.at_s - a.at_s for a, b in zip(trace, trace[1:], strict=False)]
    assert trace[0].at_s == 0.0 and all(g >= 0 for g in gaps)
    assert 0.35 < sum(gaps) / len(gaps) < 0.65  # mean gap 1/rate


def test_summary_percentiles_goodput_and_failures() -> None:
    assert percentile([3.0, 1.0, 2.0], 0.5) == 2.0
    assert math.isnan(percentile([], 0.5))
    results = [Result(10, ttft_s=0.1 * i, tpot_s=0.01, e2e_s=1.0, output_tokens=8) for i in range(1, 11)]
    results.append(Result(10, error="HTTP 500: x"))
    summary = RunStats(rate=1.0, duration_s=10.0, results=results).summary(slo_ttft_s=0.5, slo_tpot_s=0.05)
    assert summary["failed"] == 1 and summary["errors"] == ["HTTP 500: x"]
    assert summary["ttft_ms"] == {"p50": 500.0, "p99": 1000.0}
    assert summary["goodput_rps"] == 0.5  # 5 of 10 met the TTFT SLO, in 10 s
    assert summary["throughput_rps"] == 1.0 and summary["throughput_output_tok_s"] == 8.0


def test_mooncake_bodies_follow_vllm_mooncake_connector_params() -> None:
    body = {"model": "m", "prompt": [5, 6], "max_tokens": 9, "stream": True, "stream_options": {"include_usage": True}}
    prefill, decode = mooncake_bodies(body, "engine-p", "http://127.0.0.1:1234")
    assert prefill["max_tokens"] == 1 and prefill["stream"] is False and "stream_options" not in prefill
    tid = prefill["kv_transfer_params"]["transfer_id"]
    assert prefill["kv_transfer_params"] == {"do_remote_decode": True, "do_remote_prefill": False, "transfer_id": tid}
    assert decode["kv_transfer_params"] == {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_engine_id": "engine-p",
        "remote_bootstrap_addr": "http://127.0.0.1:1234",
        "transfer_id": tid,
    }
    assert decode["max_tokens"] == 9 and decode["stream"] is True
    assert mooncake_patches() and all(isinstance(p, str) for p in mooncake_patches())


def test_client_through_the_round_robin_front_end(tmp_path: Path) -> None:
    a, b, front = free_ports(3)
    with ProcessGroup(tmp_path) as group:
        backend = [sys.executable, str(REPO / "benchmarks" / "router.py"), "--serve-backend", str(a), str(b)]
        backend_proc = group.start("backend", backend)
        wait_http_ok(f"http://127.0.0.1:{a}/health", 30, backend_proc)
        proxy = [sys.executable, str(REPO / "benchmarks" / "serving_proxy.py"), "--port", str(front), "rr"]
        proc = group.start("front", [*proxy, f"http://127.0.0.1:{a}", f"http://127.0.0.1:{b}"])
        wait_http_ok(f"http://127.0.0.1:{front}/health", 30, proc)
        trace = make_trace(20.0, 10, seed=0, min_prompt=4, max_prompt=8, output_tokens=4)
        stats = asyncio.run(run_trace(f"http://127.0.0.1:{front}", "bench", trace, 20.0))
    assert [r.error for r in stats.results] == [""] * 10
    # The fake backend streams 4 token events, then a final one with usage.completion_tokens 4.
    assert all(r.output_tokens == 4 and r.ttft_s > 0 and r.tpot_s >= 0 for r in stats.results)


def test_ratios_and_plot(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")

    def run(rate: float, tput: float, ttft: float) -> dict:
        lat = {"p50": ttft, "p99": 2 * ttft}
        return {"rate_rps": rate, "throughput_rps": tput, "goodput_rps": tput, "throughput_output_tok_s": 10 * tput,
                "ttft_ms": lat, "tpot_ms": {"p50": 10.0, "p99": None}}  # fmt: skip

    ours = {"runs": [run(1.0, 2.0, 100.0), run(2.0, 4.0, 200.0)]}
    theirs = {"runs": [run(1.0, 1.0, 200.0), run(2.0, 1.0, 400.0)]}
    rows = serving.ratios(ours, theirs)
    assert rows[1]["throughput_rps"] == 4.0 and rows[1]["ttft_ms_p50"] == 0.5 and rows[0]["tpot_ms_p99"] is None
    assert "error" in serving.ratios(ours, {"error": "x", "runs": []})
    path = tmp_path / "plot.png"
    assert serving.plot({"pd": ours, "colocated": theirs, "broken": {"error": "x"}}, path, (1000.0, 100.0)) == str(path)
    assert path.stat().st_size > 1000
