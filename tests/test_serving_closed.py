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
