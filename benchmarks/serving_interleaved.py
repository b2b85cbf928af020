"""Low-load TTFT, interleaved: every system up at once, each prompt sent to each, one request at a time.

At the serving trace's lowest rate the requests rarely overlap, so TTFT there is each system's
own service time; but the systems run there minutes apart, and this machine's speed drifts
by about 10% over minutes (single 2,000-token prefills of one prompt took 3.0 to 3.6 s). Here
`pd`, `colocated` and `vllm_mooncake` are up together (each one's P, or instance a, on the P
cores, its D, or instance b, on the D cores), and each prompt goes to every system in turn, the
order rotating from prompt to prompt, with a pause after each answer (vLLM's workers spin for
about a second after their last engine message). Drift then hits every system alike, and each
prompt gives one ratio ours/theirs per other system.

`serving.py --interleaved N` runs it with N prompts per bucket (the JSON's `interleaved_low_load`,
one `summarize` per other system under `vs`); `acceptance` (serving_report) judges the low-load
TTFT criteria on it when it ran.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import Any

import httpx

from benchmarks.serving_report import pair_medians, ttft_pairs
from benchmarks.serving_trace import Result, TraceRequest, bucket_labels, label_of, ms, send_one

#: Seconds between two requests (vLLM's CPU workers spin about 1 s after their last message).
PAUSE_S = 1.5


async def run_interleaved(
    urls: dict[str, str],
    model: str,
    prompts: Sequence[TraceRequest],
    pause_s: float = PAUSE_S,
    on_done: Callable[[int], None] | None = None,
    transport: httpx.AsyncBaseTransport | None = None,
) -> dict[str, list[Result]]:
    """Each prompt to every system of ``urls`` in turn (the order rotating by one per prompt), one
    request in flight at a time; the results per system, in prompt order."""
    names = list(urls)
    out: dict[str, list[Result]] = {name: [] for name in names}
    timeout = httpx.Timeout(600.0, connect=10.0)
    async with httpx.AsyncClient(timeout=timeout, trust_env=False, transport=transport) as client:
        await asyncio.sleep(pause_s)  # the last warm-up's workers stop spinning first
        for index, req in enumerate(prompts):
            shift = index % len(names)
            for name in names[shift:] + names[:shift]:
                out[name].append(await send_one(client, urls[name], model, req))
                await asyncio.sleep(pause_s)
            if on_done is not None:
                on_done(index + 1)
    return out


def summarize(ours: Sequence[Result], theirs: Sequence[Result], edges: Sequence[int]) -> dict[str, Any]:
    """Per prompt ours/theirs TTFT; medians overall and per bucket; how often ours was faster."""
    ours_ms = [None if r.error else ms(r.ttft_s) for r in ours]
    theirs_ms = [None if r.error else ms(r.ttft_s) for r in theirs]
    pairs = ttft_pairs(ours_ms, theirs_ms, [label_of(r.prompt_tokens, edges) for r in ours])
    median, per_bucket = pair_medians(pairs, bucket_labels(edges))
    ratios = [r for _, r in pairs]
    return {
        "prompts": len(ours),
        "pairs": len(pairs),
        "failed": {"ours": sum(1 for r in ours if r.error), "theirs": sum(1 for r in theirs if r.error)},
        "errors": sorted({r.error for r in [*ours, *theirs] if r.error})[:3],
        "ttft_ratio_median": median,
        "ttft_ratio_per_bucket": per_bucket,
        "ours_faster_share": round(sum(1 for r in ratios if r < 1.0) / len(ratios), 3) if ratios else None,
        "ttft_ms": {"ours": ours_ms, "theirs": theirs_ms},
        "prompt_tokens": [r.prompt_tokens for r in ours],
    }
