"""benchmarks/serving.py's parts that need no vLLM: the trace, the client and its statistics (overall and
per prompt-length bucket), the front ends (round robin; vLLM-Mooncake bodies), the ratios, the
acceptance criteria and the plot."""

from __future__ import annotations

import asyncio
import json
import math
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest

from benchmarks import serving
from benchmarks.serving_closed import stream_one
from benchmarks.serving_interleaved import run_interleaved, summarize
from benchmarks.serving_proxy import mooncake_bodies
from benchmarks.serving_report import acceptance, ratios
from benchmarks.serving_systems import mooncake_patches
from benchmarks.serving_trace import (
    Result,
    RunStats,
    TraceRequest,
    bucket_labels,
    bucket_of,
    check_edges,
    make_trace,
    percentile,
    run_trace,
    send_one,
)
from launch.processes import ProcessGroup, free_ports, wait_http_ok

REPO = Path(__file__).resolve().parent.parent
EDGES = [64, 500, 1000, 1500, 2000]


def test_trace_is_seeded_poisson_with_prompt_lengths_stratified_over_the_buckets() -> None:
    trace = make_trace(2.0, 200, seed=3, edges=EDGES, output_tokens=32)
    assert trace == make_trace(2.0, 200, seed=3, edges=EDGES, output_tokens=32)
    assert trace != make_trace(1.0, 200, seed=3, edges=EDGES, output_tokens=32)
    assert all(64 <= len(r.prompt) <= 2000 and r.max_tokens == 32 for r in trace)
    gaps = [b.at_s - a.at_s for a, b in zip(trace, trace[1:], strict=False)]
    assert trace[0].at_s == 0.0 and all(g >= 0 for g in gaps)
    assert abs(sum(gaps) / len(gaps) - 0.5) < 1e-9 and min(gaps) < 0.25 < 1.0 < max(gaps)  # exponential, mean 1/rate
    # Every round of 4 requests holds one prompt of each bucket.
    for start in range(0, 200, 4):
        assert sorted(bucket_of(len(r.prompt), EDGES) for r in trace[start : start + 4]) == [0, 1, 2, 3]
    first_rounds = [[bucket_of(len(r.prompt), EDGES) for r in trace[i : i + 4]] for i in range(0, 40, 4)]
    assert len({tuple(r) for r in first_rounds}) > 1  # shuffled, not always in the same order


def test_buckets_edges_and_membership() -> None:
    assert bucket_labels(EDGES) == ["64-500", "500-1000", "1000-1500", "1500-2000"]
    assert [bucket_of(n, EDGES) for n in (64, 499, 500, 1499, 1500, 2000)] == [0, 0, 1, 2, 3, 3]
    assert bucket_of(63, EDGES) is None and bucket_of(2001, EDGES) is None
    for bad in ([64], [0, 10], [64, 500, 500], [100, 50]):
        with pytest.raises(ValueError, match=str(bad[0])):
            check_edges(bad)


def test_request_count_gives_every_bucket_its_minimum_in_whole_rounds() -> None:
    assert serving.request_count(0.2, 20.0, buckets=4, min_per_bucket=4) == 16
    assert serving.request_count(0.6, 20.0, buckets=4, min_per_bucket=2) == 12
    assert serving.request_count(1.0, 21.0, buckets=4, min_per_bucket=1) == 24  # 21 rounded up to whole rounds
    args = serving.parse_args(["--quick"])
    assert args.rates == [0.25, 0.5] and args.min_per_bucket == 1 and args.bucket_edges == EDGES
    args = serving.parse_args([])
    assert args.rates == [0.1, 0.3, 0.6] and (args.slo_ttft_ms, args.slo_tpot_ms) == (3000.0, 50.0)
    assert [len(t) for t in serving.traces(args).values()] == [12, 12, 12] and args.min_per_bucket == 3
    with pytest.raises(SystemExit):
        serving.parse_args(["--bucket-edges", "500", "64"])


def test_bucket_statistics_in_the_summary() -> None:
    results = [Result(100, ttft_s=0.1, tpot_s=0.01, output_tokens=8), Result(200, ttft_s=0.3, tpot_s=0.02)]
    results += [Result(1800, ttft_s=2.0, tpot_s=0.03), Result(1900, error="HTTP 500: x")]
    buckets = RunStats(rate=1.0, duration_s=4.0, results=results).summary(3.0, 0.05, EDGES)["buckets"]
    assert list(buckets) == bucket_labels(EDGES)
    assert buckets["64-500"] == {
        "requests": 2,
        "failed": 0,
        "ttft_ms": {"p50": 100.0, "p99": 300.0},
        "tpot_ms": {"p50": 10.0, "p99": 20.0},
    }
    assert buckets["500-1000"]["requests"] == 0 and buckets["500-1000"]["ttft_ms"]["p50"] is None
    assert buckets["1500-2000"]["requests"] == 2 and buckets["1500-2000"]["failed"] == 1
    assert buckets["1500-2000"]["ttft_ms"]["p50"] == 2000.0
    summary = RunStats(rate=1.0, duration_s=4.0, results=results).summary(3.0, 0.05, EDGES)
    assert summary["requests_ttft_ms"] == [100.0, 300.0, 2000.0, None]  # trace order; a failure is None
    assert summary["requests_bucket"] == ["64-500", "64-500", "1500-2000", "1500-2000"]


def test_summary_percentiles_goodput_and_failures() -> None:
    assert percentile([3.0, 1.0, 2.0], 0.5) == 2.0
    assert math.isnan(percentile([], 0.5))
    results = [Result(10, ttft_s=0.1 * i, tpot_s=0.01, e2e_s=1.0, output_tokens=8) for i in range(1, 11)]
    results.append(Result(10, error="HTTP 500: x"))
    summary = RunStats(rate=1.0, duration_s=10.0, results=results).summary(slo_ttft_s=0.5, slo_tpot_s=0.05)
    assert summary["failed"] == 1 and summary["errors"] == ["HTTP 500: x"]
    assert summary["ttft_ms"] == {"p50": 500.0, "p99": 1000.0}
    assert summary["goodput_rps"] == round(5 / 11, 3)  # 5 of the 11 offered at 1/s (11 s) met the TTFT SLO
    later = RunStats(rate=1.0, duration_s=30.0, results=results).summary(slo_ttft_s=0.5, slo_tpot_s=0.05)
    assert later["goodput_rps"] == summary["goodput_rps"]  # the last answer's time does not count
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
        trace = make_trace(20.0, 10, seed=0, edges=[4, 8], output_tokens=4)
        stats = asyncio.run(run_trace(f"http://127.0.0.1:{front}", "bench", trace, 20.0))
    assert [r.error for r in stats.results] == [""] * 10
    # The fake backend streams 4 token events, then a final one with usage.completion_tokens 4.
    assert all(r.output_tokens == 4 and r.ttft_s > 0 and r.tpot_s >= 0 for r in stats.results)


def test_ratios_and_plot(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")

    def run(rate: float, tput: float, ttft: float) -> dict:
        lat = {"p50": ttft, "p99": 2 * ttft}
        bucket = {"requests": 1, "failed": 0, "ttft_ms": lat, "tpot_ms": {"p50": 10.0, "p99": None}}
        return {"rate_rps": rate, "throughput_rps": tput, "goodput_rps": tput, "throughput_output_tok_s": 10 * tput,
                "ttft_ms": lat, "tpot_ms": {"p50": 10.0, "p99": None}, "buckets": {"64-500": bucket}}  # fmt: skip

    ours = {"runs": [run(1.0, 2.0, 100.0), run(2.0, 4.0, 200.0)]}
    theirs = {"runs": [run(1.0, 1.0, 200.0), run(2.0, 1.0, 400.0)]}
    rows = ratios(ours, theirs)
    assert rows[1]["throughput_rps"] == 4.0 and rows[1]["ttft_ms_p50"] == 0.5 and rows[0]["tpot_ms_p99"] is None
    assert "error" in ratios(ours, {"error": "x", "runs": []})
    assert rows[0]["buckets"] == {
        "64-500": {"ttft_ms_p50": 0.5, "ttft_ms_p99": 0.5, "tpot_ms_p50": 1.0, "tpot_ms_p99": None}
    }
    path = tmp_path / "plot.png"
    assert serving.plot({"pd": ours, "colocated": theirs, "broken": {"error": "x"}}, path, (1000.0, 100.0)) == str(path)
    assert path.stat().st_size > 1000


def _run(rate: float, ttft_per_bucket: list[float], tpot_p99: float) -> dict:
    """A summary of one rate: overall TTFT p50 = the mean of the buckets' (enough for the ratio math)."""
    buckets = {
        label: {"requests": 4, "failed": 0, "ttft_ms": {"p50": t, "p99": 2 * t}, "tpot_ms": {"p50": 10.0, "p99": 20.0}}
        for label, t in zip(bucket_labels(EDGES), ttft_per_bucket, strict=True)
    }
    ttft = sum(ttft_per_bucket) / len(ttft_per_bucket)
    return {
        "rate_rps": rate,
        "ttft_ms": {"p50": ttft, "p99": 2 * ttft},
        "tpot_ms": {"p50": 10.0, "p99": tpot_p99},
        "buckets": buckets,
        # one request per bucket, in trace order
        "requests_ttft_ms": list(ttft_per_bucket),
        "requests_bucket": bucket_labels(EDGES),
    }


def test_acceptance_uses_the_lowest_rate_for_ttft_and_the_highest_for_tpot() -> None:
    systems = {
        # runs out of rate order on purpose: the lowest and highest rate are found by rate.
        "pd": {"runs": [_run(0.6, [900, 900, 900, 900], 30.0), _run(0.2, [120, 600, 1100, 1500], 99.0)]},
        "colocated": {"runs": [_run(0.2, [100, 500, 1000, 1500], 1.0), _run(0.6, [1, 1, 1, 1], 40.0)]},
        "vllm_mooncake": {"runs": [_run(0.2, [200, 700, 1000, 1400], 1.0), _run(0.6, [1, 1, 1, 1], 1.0)]},
    }
    result = acceptance(systems)
    coloc = result["ttft_p50_ratio_vs_colocated_max_low_rate"]
    assert coloc["per_bucket"] == {"64-500": 1.2, "500-1000": 1.2, "1000-1500": 1.1, "1500-2000": 1.0}
    assert coloc["value"] == 1.2 and coloc["pass"] is True and coloc["rate_rps"] == 0.2
    tpot = result["tpot_p99_ours_vs_colocated_at_highest_rate"]
    assert (tpot["value"], tpot["ours_ms"], tpot["colocated_ms"], tpot["pass"]) == (0.75, 30.0, 40.0, True)
    mc = result["ttft_p50_ratio_vs_vllm_mooncake"]
    assert (
        mc["trace"]["overall"] == round(830 / 825, 3) and mc["source"] == "trace"
    )  # the ratio of the p50s: 830 vs 825 ms, reported
    # paired, per request: 120/200, 600/700, 1100/1000, 1500/1400 -> median of 0.857 and 1.071
    assert mc["paired_per_bucket"] == {"64-500": 0.6, "500-1000": 0.857, "1000-1500": 1.1, "1500-2000": 1.071}
    assert mc["value"] == round((600 / 700 + 1500 / 1400) / 2, 3) and mc["pass"] is True
    assert mc["max_over_buckets"] == 1.1 and mc["pass_every_bucket"] is False
    assert result["all_pass"] is False
    # 1.3 passes (<=), a TPOT ratio of exactly 1.0 does not (<).
    systems["pd"]["runs"][1] = _run(0.2, [130, 500, 1000, 1400], 99.0)
    systems["pd"]["runs"][0] = _run(0.6, [1, 1, 1, 1], 40.0)
    result = acceptance(systems)
    assert result["ttft_p50_ratio_vs_colocated_max_low_rate"]["value"] == 1.3
    assert result["ttft_p50_ratio_vs_colocated_max_low_rate"]["pass"] is True
    assert result["tpot_p99_ours_vs_colocated_at_highest_rate"]["pass"] is False
    assert result["ttft_p50_ratio_vs_vllm_mooncake"]["pass"] is True  # pairs 0.65, 0.71, 1.0, 1.0
    assert result["ttft_p50_ratio_vs_vllm_mooncake"]["pass_every_bucket"] is True  # 1.0 at most (1000 vs 1000)
    # The paired median fails even where the p50s' ratio passes: ours slower on 3 of 4 requests.
    systems["pd"]["runs"][1] = _run(0.2, [100, 710, 1010, 1410], 99.0)
    systems["vllm_mooncake"]["runs"][0] = _run(0.2, [1000, 700, 1000, 1400], 1.0)
    mc = acceptance(systems)["ttft_p50_ratio_vs_vllm_mooncake"]
    assert (
        mc["trace"]["overall"] < 1.0
        and mc["pass"] is False
        and mc["value"] == round((1410 / 1400 + 1010 / 1000) / 2, 3)
    )
    # A failed request on either side is left out of the pairs; a bucket without a pair is named.
    systems["pd"]["runs"][1]["requests_ttft_ms"][0] = None
    mc = acceptance(systems)["ttft_p50_ratio_vs_vllm_mooncake"]
    assert mc["paired_per_bucket"]["64-500"] is None and mc["pass_every_bucket"] is None
    assert "64-500" in mc["bucket_reason"]


def test_acceptance_all_pass_and_missing_numbers() -> None:
    systems = {
        "pd": {"runs": [_run(0.2, [100, 500, 900, 1400], 10.0), _run(0.6, [1, 1, 1, 1], 30.0)]},
        "colocated": {"runs": [_run(0.2, [100, 500, 1000, 1500], 1.0), _run(0.6, [1, 1, 1, 1], 40.0)]},
        "vllm_mooncake": {"runs": [_run(0.2, [200, 700, 1000, 1400], 1.0), _run(0.6, [1, 1, 1, 1], 1.0)]},
    }
    assert acceptance(systems)["all_pass"] is True
    systems["vllm_mooncake"] = {"error": "RuntimeError: boom", "runs": []}
    result = acceptance(systems)
    mc = result["ttft_p50_ratio_vs_vllm_mooncake"]
    assert mc["pass"] is None and "boom" in mc["reason"] and result["all_pass"] is False
    assert result["ttft_p50_ratio_vs_colocated_max_low_rate"]["pass"] is True
    # An empty bucket (no TTFT) leaves the colocated criterion unjudged, and says which bucket.
    systems["colocated"]["runs"][0]["buckets"]["64-500"]["ttft_ms"]["p50"] = None
    coloc = acceptance(systems)["ttft_p50_ratio_vs_colocated_max_low_rate"]
    assert coloc["pass"] is None and "64-500" in coloc["reason"]
    assert acceptance({})["tpot_p99_ours_vs_colocated_at_highest_rate"]["reason"] == "pd was not run"


def test_client_splits_events_at_newlines_only() -> None:
    """Generated text may hold U+2028 / U+0085 unescaped (valid JSON): one event, not three; chunks
    may also end inside a multi-byte character."""
    events = [{"choices": [{"text": f"a\u2028b\x85c{i}"}]} for i in range(3)]
    events.append({"choices": [], "usage": {"completion_tokens": 3}})
    body = "".join(f"data: {json.dumps(e, ensure_ascii=False)}\n\n" for e in events) + "data: [DONE]\n\n"
    raw = body.encode()
    chunks = [raw[i : i + 7] for i in range(0, len(raw), 7)]  # 7 bytes: splits the 3-byte U+2028

    async def stream() -> AsyncIterator[bytes]:
        for chunk in chunks:
            yield chunk

    transport = httpx.MockTransport(lambda request: httpx.Response(200, content=stream()))

    async def go() -> Result:
        async with httpx.AsyncClient(transport=transport) as client:
            return await send_one(client, "http://bench", "m", TraceRequest(0.0, [5, 6, 7], 3))

    result = asyncio.run(go())
    assert result.error == "" and result.output_tokens == 3 and result.ttft_s > 0 and result.tpot_s >= 0


def test_both_clients_stop_at_an_error_event() -> None:
    """An error event mid-stream ends the request as failed, naming the error, in the trace client
    and in the closed-loop one (both read events through serving_trace.data_events)."""
    events = [{"choices": [{"text": "a"}]}, {"error": {"type": "decode_failed", "code": 502}}]
    body = "".join(f"data: {json.dumps(e)}\n\n" for e in events).encode()
    transport = httpx.MockTransport(lambda request: httpx.Response(200, content=body))

    async def go() -> tuple[Result, Result]:
        async with httpx.AsyncClient(transport=transport) as client:
            traced = await send_one(client, "http://bench", "m", TraceRequest(0.0, [5, 6, 7], 3))
            closed = await stream_one(client, "http://bench", "m", [5, 6, 7], 3, asyncio.Event())
        return traced, closed

    for result in asyncio.run(go()):
        assert result.error.startswith("stream error: ") and "decode_failed" in result.error, result.error


def test_interleaved_pairs_alternate_the_order_and_judge_the_mooncake_criterion() -> None:
    """Each prompt goes to both systems, one request at a time, the first one alternating; the
    per-prompt ratios' median then decides ours/vLLM-Mooncake (source: interleaved)."""
    seen: list[tuple[str, int]] = []
    delay = {"ours.test": 0.02, "theirs.test": 0.04}  # ours answers faster

    async def answer(request: httpx.Request) -> httpx.Response:
        seen.append((request.url.host, len(json.loads(request.content)["prompt"])))
        await asyncio.sleep(delay[request.url.host])
        event = {"choices": [{"text": "x"}]}
        return httpx.Response(200, content=f"data: {json.dumps(event)}\n\ndata: [DONE]\n\n".encode())

    prompts = [TraceRequest(0.0, [5] * n, 2) for n in (100, 600, 1200, 1600)]
    urls = {"pd": "http://ours.test", "vllm_mooncake": "http://theirs.test"}
    results = asyncio.run(run_interleaved(urls, "m", prompts, 0.0, transport=httpx.MockTransport(answer)))
    hosts = [host for host, _ in seen]
    assert hosts == ["ours.test", "theirs.test", "theirs.test", "ours.test"] * 2
    assert [n for _, n in seen] == [100, 100, 600, 600, 1200, 1200, 1600, 1600]
    summary = summarize(results["pd"], results["vllm_mooncake"], EDGES)
    assert summary["pairs"] == 4 and summary["ours_faster_share"] == 1.0
    assert summary["ttft_ratio_median"] < 1.0 and all(v < 1.0 for v in summary["ttft_ratio_per_bucket"].values())
    assert summary["prompt_tokens"] == [100, 600, 1200, 1600] and len(summary["ttft_ms"]["theirs"]) == 4

    systems = {
        "pd": {"runs": [_run(0.2, [100, 500, 900, 1600], 10.0), _run(0.6, [1, 1, 1, 1], 30.0)]},
        "colocated": {"runs": [_run(0.2, [100, 500, 1000, 1500], 1.0), _run(0.6, [1, 1, 1, 1], 40.0)]},
        "vllm_mooncake": {"runs": [_run(0.2, [200, 700, 1000, 1400], 1.0), _run(0.6, [1, 1, 1, 1], 1.0)]},
    }
    assert acceptance(systems)["ttft_p50_ratio_vs_vllm_mooncake"]["pass_every_bucket"] is False  # trace: 1600/1400
    mc = acceptance(systems, {"vs": {"vllm_mooncake": summary}})["ttft_p50_ratio_vs_vllm_mooncake"]
    assert mc["source"] == "interleaved" and mc["pass"] is True and mc["pass_every_bucket"] is True
    assert mc["value"] == summary["ttft_ratio_median"] and mc["pairs"] == 4
    assert mc["trace"]["paired_per_bucket"]["1500-2000"] == round(1600 / 1400, 3)  # still reported
    # A failed interleaved run leaves the trace's pairs to judge, and a failed prompt drops its pair.
    assert acceptance(systems, {"error": "boom"})["ttft_p50_ratio_vs_vllm_mooncake"]["source"] == "trace"
    results["pd"][0].error = "HTTP 500: x"
    summary = summarize(results["pd"], results["vllm_mooncake"], EDGES)
    assert summary["pairs"] == 3 and summary["ttft_ratio_per_bucket"]["64-500"] is None
    assert summary["failed"] == {"ours": 1, "theirs": 0} and summary["errors"] == ["HTTP 500: x"]
    mc = acceptance(systems, {"vs": {"vllm_mooncake": summary}})["ttft_p50_ratio_vs_vllm_mooncake"]
    assert mc["pass_every_bucket"] is None and "64-500" in mc["bucket_reason"]


def test_interleaved_pairs_judge_the_colocated_criterion_and_the_trace_stays_beside_it() -> None:
    """Three systems: the rotation gives each one the first place in turn; the colocated criterion
    is each bucket's median of per-prompt ratios from the interleaved run, its trace value kept."""
    seen: list[str] = []
    delay = {"ours.test": 0.03, "coloc.test": 0.02, "mc.test": 0.04}  # ours 1.5x colocated: fails <= 1.3

    async def answer(request: httpx.Request) -> httpx.Response:
        seen.append(request.url.host)
        await asyncio.sleep(delay[request.url.host])
        event = {"choices": [{"text": "x"}]}
        return httpx.Response(200, content=f"data: {json.dumps(event)}\n\ndata: [DONE]\n\n".encode())

    prompts = [TraceRequest(0.0, [5] * n, 2) for n in (100, 600, 1200, 1600)]
    urls = {"pd": "http://ours.test", "colocated": "http://coloc.test", "vllm_mooncake": "http://mc.test"}
    results = asyncio.run(run_interleaved(urls, "m", prompts, 0.0, transport=httpx.MockTransport(answer)))
    assert seen[:6] == ["ours.test", "coloc.test", "mc.test", "coloc.test", "mc.test", "ours.test"]
    run = {"vs": {o: summarize(results["pd"], results[o], EDGES) for o in ("colocated", "vllm_mooncake")}}
    systems = {
        "pd": {"runs": [_run(0.2, [100, 500, 1000, 1500], 10.0), _run(0.6, [1, 1, 1, 1], 30.0)]},
        "colocated": {"runs": [_run(0.2, [100, 500, 1000, 1500], 1.0), _run(0.6, [1, 1, 1, 1], 40.0)]},
        "vllm_mooncake": {"runs": [_run(0.2, [200, 700, 1000, 1400], 1.0), _run(0.6, [1, 1, 1, 1], 1.0)]},
    }
    trace_only = acceptance(systems)["ttft_p50_ratio_vs_colocated_max_low_rate"]
    assert trace_only["source"] == "trace" and trace_only["pass"] is True and trace_only["value"] == 1.0
    coloc = acceptance(systems, run)["ttft_p50_ratio_vs_colocated_max_low_rate"]
    assert coloc["source"] == "interleaved" and coloc["pass"] is False and coloc["pairs"] == 4
    assert coloc["value"] == max(coloc["per_bucket"].values()) and coloc["value"] > 1.3
    assert coloc["trace"]["max_over_buckets"] == 1.0 and coloc["trace"]["per_bucket"]["64-500"] == 1.0
    # A bucket without a pair leaves the criterion undecided, saying which bucket.
    run["vs"]["colocated"]["ttft_ratio_per_bucket"]["64-500"] = None
    coloc = acceptance(systems, run)["ttft_p50_ratio_vs_colocated_max_low_rate"]
    assert coloc["pass"] is None and "64-500" in coloc["reason"]
    assert acceptance(systems, run)["ttft_p50_ratio_vs_vllm_mooncake"]["source"] == "interleaved"
