"""The request trace of `benchmarks/serving.py`, its streaming client, and the per-run statistics.

One trace per rate: `count` requests with Poisson arrivals (exponential gaps, mean 1/rate),
prompts of uniformly drawn lengths given as token ids (exact lengths with any tokenizer), and a
fixed number of output tokens each (`ignore_eos`). The same seed gives every system the same
trace. The client (asyncio + httpx, one connection pool, no proxies) sends each request at its
arrival time as a streaming `/v1/completions` with `stream_options.include_usage`, and times the
first event carrying a choice (TTFT) and the last one (TPOT = (last - first) / (tokens - 1)).
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx

#: Token ids a prompt is drawn from (the tiny model's byte tokens; 0-2 are its special tokens).
PROMPT_TOKEN_IDS = range(3, 259)


@dataclass(frozen=True)
class TraceRequest:
    """One request of a trace: when it is sent (s after the start), its prompt and output length."""

    at_s: float
    prompt: list[int]
    max_tokens: int


@dataclass
class Result:
    """What one request measured (times in s; `error` set when it failed)."""

    prompt_tokens: int
    ttft_s: float = math.nan
    tpot_s: float = math.nan
    e2e_s: float = math.nan
    output_tokens: int = 0
    error: str = ""


@dataclass
class RunStats:
    """One system at one rate."""

    rate: float
    duration_s: float
    results: list[Result] = field(default_factory=list)

    def summary(self, slo_ttft_s: float, slo_tpot_s: float) -> dict[str, Any]:
        ok = [r for r in self.results if not r.error]
        ttft = [r.ttft_s for r in ok]
        tpot = [r.tpot_s for r in ok if not math.isnan(r.tpot_s)]
        good = [r for r in ok if r.ttft_s <= slo_ttft_s and (math.isnan(r.tpot_s) or r.tpot_s <= slo_tpot_s)]
        errors = sorted({r.error for r in self.results if r.error})
        return {
            "rate_rps": self.rate,
            "requests": len(self.results),
            "failed": len(self.results) - len(ok),
            "errors": errors[:3],
            "ttft_ms": {"p50": ms(percentile(ttft, 0.5)), "p99": ms(percentile(ttft, 0.99))},
            "tpot_ms": {"p50": ms(percentile(tpot, 0.5)), "p99": ms(percentile(tpot, 0.99))},
            "throughput_rps": round(len(ok) / self.duration_s, 3),
            "throughput_output_tok_s": round(sum(r.output_tokens for r in ok) / self.duration_s, 1),
            "goodput_rps": round(len(good) / self.duration_s, 3),
            "slo_attained": round(len(good) / len(self.results), 3) if self.results else None,
            "duration_s": round(self.duration_s, 2),
        }


def percentile(values: Sequence[float], q: float) -> float:
    """The q-quantile (nearest rank); NaN for no values."""
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def ms(seconds: float) -> float | None:
    return None if math.isnan(seconds) else round(seconds * 1e3, 1)


def make_trace(
    rate: float, count: int, seed: int, min_prompt: int, max_prompt: int, output_tokens: int
) -> list[TraceRequest]:
    """`count` requests, Poisson arrivals at `rate`/s, prompt lengths uniform in [min, max]."""
    rng = random.Random(f"{seed}:{rate}")
    at = 0.0
    trace = []
    for _ in range(count):
        length = rng.randint(min_prompt, max_prompt)
        prompt = [rng.choice(PROMPT_TOKEN_IDS) for _ in range(length)]
        trace.append(TraceRequest(at_s=at, prompt=prompt, max_tokens=output_tokens))
        at += rng.expovariate(rate)
    return trace


async def send_one(client: httpx.AsyncClient, url: str, model: str, req: TraceRequest) -> Result:
    """Stream one completion; time its first and last choice events."""
    body = {
        "model": model,
        "prompt": req.prompt,
        "max_tokens": req.max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    result = Result(prompt_tokens=len(req.prompt))
    t0 = time.perf_counter()
    first = last = math.nan
    events = 0
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body) as resp:
            if resp.status_code != 200:
                text = (await resp.aread()).decode("utf-8", errors="replace")
                result.error = f"HTTP {resp.status_code}: {text[:200]}"
                return result
            async for line in resp.aiter_lines():
                if not line.startswith("data:") or line.endswith("[DONE]"):
                    continue
                event = json.loads(line[5:])
                if "error" in event:
                    result.error = f"stream error: {str(event['error'])[:200]}"
                    return result
                if event.get("choices"):
                    last = time.perf_counter()
                    first = last if math.isnan(first) else first
                    events += 1
                if event.get("usage"):
                    result.output_tokens = int(event["usage"].get("completion_tokens") or 0)
    except (httpx.HTTPError, OSError, ValueError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"[:200]
        return result
    result.output_tokens = result.output_tokens or events
    if math.isnan(first):
        result.error = "no token in the stream"
        return result
    result.ttft_s = first - t0
    result.e2e_s = last - t0
    if result.output_tokens > 1:
        result.tpot_s = (last - first) / (result.output_tokens - 1)
    return result


async def run_trace(
    url: str, model: str, trace: Sequence[TraceRequest], rate: float, on_done: Callable[[int], None] | None = None
) -> RunStats:
    """Send every request of `trace` at its arrival time; wait for all; duration = first send to last answer."""
    limits = httpx.Limits(max_connections=1024, max_keepalive_connections=1024)
    timeout = httpx.Timeout(600.0, connect=10.0)
    async with httpx.AsyncClient(limits=limits, timeout=timeout, trust_env=False) as client:
        start = time.perf_counter()
        done = 0

        async def timed(req: TraceRequest) -> Result:
            nonlocal done
            await asyncio.sleep(max(0.0, start + req.at_s - time.perf_counter()))
            result = await send_one(client, url, model, req)
            done += 1
            if on_done is not None:
                on_done(done)
            return result

        results = await asyncio.gather(*(timed(r) for r in trace))
        duration = time.perf_counter() - start
    return RunStats(rate=rate, duration_s=duration, results=list(results))
