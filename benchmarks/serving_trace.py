"""The request trace of `benchmarks/serving.py`, its streaming client, and the per-run statistics.

One trace per rate: `count` requests with Poisson arrivals (exponential gaps scaled to a mean of exactly 1/rate),
prompts given as token ids (exact lengths with any tokenizer) whose lengths are stratified over
the prompt-length buckets (`bucket_edges`, e.g. 64-500, 500-1000, 1000-1500, 1500-2000: each
round of `len(buckets)` requests has one prompt of each bucket, in a shuffled order, its length
uniform in the bucket), so every bucket gets the same number of requests, and a fixed number of
output tokens each (`ignore_eos`). The statistics are given overall and per bucket. The same seed gives every system the same
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
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx

from launch.sse import asse_lines

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

    @property
    def offered_s(self) -> float:
        """The span the load was offered over: requests / rate (the measured duration when unpaced).

        Goodput divides by it, not by ``duration_s`` (first send to last answer): goodput is the offered
        rate times the share of requests meeting the SLOs, so two systems that both meet them for every
        request of a trace have the same goodput, whatever the last answer's decode took.
        """
        return len(self.results) / self.rate if self.rate > 0 and self.results else self.duration_s

    def summary(self, slo_ttft_s: float, slo_tpot_s: float, edges: Sequence[int] = ()) -> dict[str, Any]:
        """Overall statistics, plus `buckets` (label -> requests, TTFT and TPOT p50/p99) when `edges` are given."""
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
            "goodput_rps": round(len(good) / self.offered_s, 3),
            "slo_attained": round(len(good) / len(self.results), 3) if self.results else None,
            "duration_s": round(self.duration_s, 2),
            "buckets": bucket_stats(self.results, edges) if edges else {},
            # Per request, in trace order (the same prompts in every system: paired ratios).
            "requests_ttft_ms": [None if r.error else ms(r.ttft_s) for r in self.results],
            "requests_bucket": [label_of(r.prompt_tokens, edges) for r in self.results] if edges else [],
        }


def check_edges(edges: Sequence[int]) -> list[int]:
    """Bucket edges as given, or ValueError naming them: at least 2, positive, strictly increasing."""
    edges = list(edges)
    if len(edges) < 2 or edges[0] < 1 or any(b <= a for a, b in zip(edges, edges[1:], strict=False)):
        raise ValueError(f"bucket edges must be >= 2 positive, strictly increasing token counts, got {edges}")
    return edges


def bucket_labels(edges: Sequence[int]) -> list[str]:
    """'lo-hi' per bucket: [lo, hi) tokens, the last one [lo, hi]."""
    return [f"{lo}-{hi}" for lo, hi in zip(edges, edges[1:], strict=False)]


def bucket_of(prompt_tokens: int, edges: Sequence[int]) -> int | None:
    """Index of the bucket holding `prompt_tokens` ([lo, hi), the last [lo, hi]); None outside every bucket."""
    if prompt_tokens == edges[-1]:
        return len(edges) - 2
    return next((i for i in range(len(edges) - 1) if edges[i] <= prompt_tokens < edges[i + 1]), None)


def label_of(prompt_tokens: int, edges: Sequence[int]) -> str | None:
    """The label of the bucket holding `prompt_tokens`; None outside every bucket."""
    index = bucket_of(prompt_tokens, edges)
    return None if index is None else bucket_labels(edges)[index]


def bucket_stats(results: Sequence[Result], edges: Sequence[int]) -> dict[str, dict[str, Any]]:
    """Per bucket label: how many requests (and failed), TTFT and TPOT p50/p99 of the ones that answered."""
    out: dict[str, dict[str, Any]] = {}
    for index, label in enumerate(bucket_labels(edges)):
        mine = [r for r in results if bucket_of(r.prompt_tokens, edges) == index]
        ok = [r for r in mine if not r.error]
        ttft = [r.ttft_s for r in ok]
        tpot = [r.tpot_s for r in ok if not math.isnan(r.tpot_s)]
        out[label] = {
            "requests": len(mine),
            "failed": len(mine) - len(ok),
            "ttft_ms": {"p50": ms(percentile(ttft, 0.5)), "p99": ms(percentile(ttft, 0.99))},
            "tpot_ms": {"p50": ms(percentile(tpot, 0.5)), "p99": ms(percentile(tpot, 0.99))},
        }
    return out


def percentile(values: Sequence[float], q: float) -> float:
    """The q-quantile (nearest rank); NaN for no values."""
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def ms(seconds: float) -> float | None:
    return None if math.isnan(seconds) else round(seconds * 1e3, 1)


def make_trace(rate: float, count: int, seed: int, edges: Sequence[int], output_tokens: int) -> list[TraceRequest]:
    """`count` requests, Poisson arrivals at `rate`/s, prompt lengths stratified over the buckets of `edges`.

    The exponential gaps are scaled so that their mean is exactly 1/rate: a short trace (16
    requests) otherwise often runs at twice or half its nominal rate.
    """
    check_edges(edges)
    rng = random.Random(f"{seed}:{rate}")
    prompts = []
    order: list[int] = []
    for _ in range(count):
        if not order:
            order = list(range(len(edges) - 1))
            rng.shuffle(order)
        index = order.pop()
        last = index == len(edges) - 2
        length = rng.randint(edges[index], edges[index + 1] if last else edges[index + 1] - 1)
        prompts.append([rng.choice(PROMPT_TOKEN_IDS) for _ in range(length)])
    gaps = [rng.expovariate(rate) for _ in range(count - 1)]
    scale = (len(gaps) / rate) / sum(gaps) if gaps else 1.0
    trace, at = [], 0.0
    for i, prompt in enumerate(prompts):
        trace.append(TraceRequest(at_s=at, prompt=prompt, max_tokens=output_tokens))
        at += gaps[i] * scale if i < len(gaps) else 0.0
    return trace


class StreamError(Exception):
    """A completion stream's error event (its text, cut to 200 characters, is the message)."""


async def data_events(resp: httpx.Response) -> AsyncIterator[dict[str, Any]]:
    """The JSON events of a completion stream, ``[DONE]`` and non-data lines left out.

    Raises :class:`StreamError` at an error event.
    """
    async for line in asse_lines(resp):
        if not line.startswith("data:") or line.endswith("[DONE]"):
            continue
        event = json.loads(line[5:])
        if "error" in event:
            raise StreamError(f"stream error: {str(event['error'])[:200]}")
        yield event


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
            async for event in data_events(resp):
                if event.get("choices"):
                    last = time.perf_counter()
                    first = last if math.isnan(first) else first
                    events += 1
                if event.get("usage"):
                    result.output_tokens = int(event["usage"].get("completion_tokens") or 0)
    except StreamError as exc:
        result.error = str(exc)
        return result
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
