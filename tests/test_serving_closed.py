"""benchmarks/serving_closed.py: the closed loop's pacing, its summary and its judgement (no vLLM)."""

from __future__ import annotations

import asyncio
import json
import time

import httpx

from benchmarks.serving_closed import LIMIT, closed_loop, judge, point_summary, prompts_for
from benchmarks.serving_trace import Result


def test_prompts_have_the_exact_length_and_differ() -> None:
    prompts = prompts_for(64, 5, 0)
    assert all(len(p) == 64 for p in prompts)
    assert len({tuple(p) for p in prompts}) == 5
    assert prompts_for(64, 5, 0) == prompts


def _streaming(first_after_s: float, rest_s: float, log: list[tuple[str, float]]) -> httpx.MockTransport:
    """A server whose first token comes after `first_after_s` and the stream's end `rest_s` later."""

    async def handler(request: httpx.Request) -> httpx.Response:
        prompt = json.loads(request.content)["prompt"]

        async def body():  # noqa: ANN202 - async generator
            log.append(("start", prompt[0], time.perf_counter()))
            await asyncio.sleep(first_after_s)
            yield b'data: {"choices": [{"text": "a"}]}\n\n'
            await asyncio.sleep(rest_s)
            yield b'data: {"choices": [{"text": "b"}]}\n\n'
            log.append(("end", prompt[0], time.perf_counter()))
            yield b"data: [DONE]\n\n"

        return httpx.Response(200, content=body())

    return httpx.MockTransport(handler)


def test_next_request_leaves_at_the_first_token_not_at_the_end() -> None:
    log: list = []
    prompts = [[i] for i in range(4)]
    results = asyncio.run(closed_loop("http://x", "m", prompts, 1, 2, transport=_streaming(0.05, 0.3, log)))
    starts = [t for kind, _, t in log if kind == "start"]
    ends = {p: t for kind, p, t in log if kind == "end"}
    assert len(starts) == 4 and all(not r.error for r in results)
    # request 1 starts ~50 ms after request 0, long before request 0's stream ended (350 ms)
    assert starts[1] - starts[0] < 0.2 and starts[1] < ends[0]
    assert all(0.04 < r.ttft_s < 0.2 for r in results)
    assert [r.output_tokens for r in results] == [2, 2, 2, 2]


def test_concurrency_keeps_that_many_first_tokens_pending() -> None:
    log: list = []
    prompts = [[i] for i in range(8)]
    asyncio.run(closed_loop("http://x", "m", prompts, 4, 2, transport=_streaming(0.1, 0.0, log)))
    starts = sorted(t for kind, _, t in log if kind == "start")
    assert starts[3] - starts[0] < 0.05  # four at once
    assert starts[4] - starts[0] > 0.08  # the fifth waits for a first token


def test_summary_skips_the_fill_up_and_counts_failures() -> None:
    results = [Result(64, ttft_s=t) for t in (1.0, 0.01, 0.02, 0.03)] + [Result(64, error="HTTP 500")]
    point = point_summary(results, 1)
    assert point["counted"] == 3 and point["failed"] == 1
    assert point["ttft_ms"]["p50"] == 20.0


def test_judge_takes_the_median_of_the_rounds_ratios() -> None:
    def system(p50: float) -> dict:
        return {"points": {"64x1": {"ttft_ms": {"p50": p50}}}}

    rounds = [
        {"pd_layer": system(50.0), "colocated": system(40.0)},
        {"pd_layer": system(44.0), "colocated": system(40.0)},
        {"pd_layer": system(42.0), "colocated": system(40.0)},
    ]
    out = judge(rounds, "pd_layer")
    assert out["points"]["64x1"]["rounds"] == [1.25, 1.1, 1.05]
    assert out["points"]["64x1"]["ratio"] == 1.1 and out["limit"] == LIMIT
    assert out["all_pass"] is True
    rounds[1]["pd_layer"] = system(48.0)
    assert judge(rounds, "pd_layer")["all_pass"] is False
    assert judge([{"pd_layer": system(1.0), "colocated": {"error": "x"}}], "pd_layer")["all_pass"] is False


def test_each_round_runs_every_variant_alone_and_alternates_the_order(tmp_path) -> None:
    """bench_closed_loop: variants start one at a time, the order flips every round, and pd is judged
    against each baseline that ran (colocated: both cores; colocated_p: one instance on P's cores)."""
    from benchmarks import serving_closed

    started: list[str] = []
    p50 = {"pd": 100.0, "colocated": 50.0, "colocated_p": 95.0}

    def starter(system: str):
        def start(group, model, serve_args, cpus, timeout) -> str:  # noqa: ANN001 - the starters' signature
            started.append(system)
            return f"http://{system}"

        return start

    def fake_points(url: str, model: str, **kwargs) -> dict:  # noqa: ANN003
        return {"64x1": {"ttft_ms": {"p50": p50[url.removeprefix("http://")]}}}

    variants = [("pd_request", "pd", "request"), ("colocated", "colocated", None), ("colocated_p", "colocated_p", None)]
    modes: list[str] = []
    original = serving_closed.run_points, serving_closed.warm
    serving_closed.run_points, serving_closed.warm = fake_points, lambda *a, **k: None
    try:
        out = serving_closed.bench_closed_loop(
            "m", variants=variants, starters={s: starter(s) for _, s, _ in variants}, set_mode=modes.append,
            serve_args=[], cpus=("0", "1"), start_timeout=1.0, requests=1, repeats=2, max_tokens=1, seed=0,
            log_dir=tmp_path, say=lambda _: None,
        )  # fmt: skip
    finally:
        serving_closed.run_points, serving_closed.warm = original
    assert started == ["pd", "colocated", "colocated_p", "colocated_p", "colocated", "pd"]
    assert modes == ["request", "request"]
    assert out["vs_colocated"]["pd_request"]["points"]["64x1"]["ratio"] == 2.0
    assert out["vs_colocated"]["pd_request"]["all_pass"] is False
    assert out["vs_colocated_p"]["pd_request"]["points"]["64x1"]["ratio"] == 1.053
    assert out["vs_colocated_p"]["pd_request"]["all_pass"] is True


def test_closed_verdict_names_the_points_over_the_limit() -> None:
    from benchmarks.serving import closed_verdict

    judged = {
        "limit": LIMIT,
        "all_pass": False,
        "points": {"64x1": {"ratio": 0.9, "pass": True}, "64x4": {"ratio": 1.9, "pass": False}},
    }
    verdict = closed_verdict("request", judged)
    assert verdict == {"transfer_mode": "request", "limit": LIMIT, "max": 1.9, "over_limit": ["64x4"], "pass": False}
    assert closed_verdict("request", {})["pass"] is None
