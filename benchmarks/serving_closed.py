"""Closed-loop TTFT: the next request as soon as the previous one's first token arrived.

PD through the Router can trail colocated vLLM when requests come back to back while it is at
par with pauses between them (`serving_interleaved.py`'s low-load run). This phase measures the
back-to-back case: `concurrency` clients, each sending its next prompt the moment
its previous request's first token arrived (that stream goes on in the background), at each
prompt length of `LENGTHS` and each concurrency of `CONCURRENCY`. Every system is started alone
(its own `ProcessGroup`, nothing else of the benchmark up) on the same cores, in the order given;
`serving.py` runs pd (each transfer mode asked), colocated and colocated_p back to back,
`--closed-loop-repeats` times, so the machine's drift hits each round alike.

`judge`: per (length, concurrency), pd / a baseline's TTFT p50 (the median over the repeats of each
round's ratio of p50s); passes at <= `LIMIT`. Two baselines:

- `colocated`: two plain instances, one on P's cores and one on D's (the same hardware as PD). At
  concurrency 4 PD gives prefill one core where these give it two: a prefill-bound closed loop then
  runs ~2x slower on PD whatever PD does (in 1P1D the decoder's cores never prefill);
- `colocated_p`: one plain instance on P's cores (the prefill capacity PD gives its prompts):
  pd / colocated_p is what PD adds (Router hop, handshake, KV push on P's cores, P's extra steps).

Variants run in the given order in even rounds and reversed in odd ones (drift hits both alike).
"""

from __future__ import annotations

import asyncio
import math
import random
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import httpx

from benchmarks.serving_report import ratio
from benchmarks.serving_trace import PROMPT_TOKEN_IDS, Result, StreamError, data_events, ms, percentile

LENGTHS = (64, 1024, 1900)
CONCURRENCY = (1, 4)
LIMIT = 1.15
#: The baselines pd is judged against (variant labels; see the module's docstring).
BASELINES = ("colocated", "colocated_p")


def prompts_for(length: int, count: int, seed: int) -> list[list[int]]:
    """`count` random prompts of exactly `length` tokens (unique: no prefix-cache hits)."""
    rng = random.Random(f"closed:{seed}:{length}")
    return [[rng.choice(PROMPT_TOKEN_IDS) for _ in range(length)] for _ in range(count)]


async def stream_one(
    client: httpx.AsyncClient, url: str, model: str, prompt: list[int], max_tokens: int, first: asyncio.Event
) -> Result:
    """Stream one completion; `first` is set at its first token (or when it ends without one)."""
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    result = Result(prompt_tokens=len(prompt))
    t0 = time.perf_counter()
    last = math.nan
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body) as resp:
            if resp.status_code != 200:
                result.error = f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}"
                return result
            async for event in data_events(resp):
                if event.get("choices"):
                    last = time.perf_counter()
                    if not first.is_set():
                        result.ttft_s = last - t0
                        first.set()
                    result.output_tokens += 1
    except StreamError as exc:
        result.error = str(exc)
        return result
    except (httpx.HTTPError, OSError, ValueError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"[:200]
        return result
    finally:
        first.set()
    if math.isnan(result.ttft_s):
        result.error = "no token in the stream"
    result.e2e_s = last - t0
    return result


async def closed_loop(
    url: str,
    model: str,
    prompts: Sequence[list[int]],
    concurrency: int,
    max_tokens: int,
    transport: httpx.AsyncBaseTransport | None = None,
) -> list[Result]:
    """`concurrency` clients share `prompts` (in order); each sends its next one as soon as its
    previous request's first token came. Returns every result, in prompt order."""
    limits = httpx.Limits(max_connections=256, max_keepalive_connections=256)
    timeout = httpx.Timeout(600.0, connect=10.0)
    queue = list(enumerate(prompts))
    tasks: dict[int, asyncio.Task[Result]] = {}
    async with httpx.AsyncClient(limits=limits, timeout=timeout, trust_env=False, transport=transport) as client:

        async def client_loop() -> None:
            while queue:
                index, prompt = queue.pop(0)
                first = asyncio.Event()
                tasks[index] = asyncio.create_task(stream_one(client, url, model, prompt, max_tokens, first))
                await first.wait()

        await asyncio.gather(*(client_loop() for _ in range(concurrency)))
        await asyncio.gather(*tasks.values())
    return [tasks[i].result() for i in range(len(prompts))]


def point_summary(results: Sequence[Result], skip: int) -> dict[str, Any]:
    """TTFT p50/p90 of the results after the first `skip` (the loop filling up)."""
    kept = [r for r in results[skip:] if not r.error]
    ttfts = sorted(r.ttft_s for r in kept)
    return {
        "requests": len(results),
        "counted": len(kept),
        "failed": sum(1 for r in results if r.error),
        "errors": sorted({r.error for r in results if r.error})[:3],
        "ttft_ms": {"p50": ms(percentile(ttfts, 0.5)), "p90": ms(percentile(ttfts, 0.9))},
        "ttft_ms_all": [ms(r.ttft_s) if not r.error else None for r in results],
    }


def run_points(
    url: str,
    model: str,
    *,
    requests: int,
    max_tokens: int,
    seed: int,
    lengths: Sequence[int] = LENGTHS,
    concurrency: Sequence[int] = CONCURRENCY,
    say: Callable[[str], None] = print,
) -> dict[str, dict[str, Any]]:
    """Every (length, concurrency) point against one system: `requests` + concurrency prompts
    (the first `concurrency` are not counted); keys "<length>x<concurrency>"."""
    out = {}
    for length in lengths:
        for conc in concurrency:
            prompts = prompts_for(length, requests + conc, seed * 1000 + conc)
            results = asyncio.run(closed_loop(url, model, prompts, conc, max_tokens))
            point = out[f"{length}x{conc}"] = point_summary(results, conc)
            say(f"closed loop {length} tokens x{conc}: TTFT p50 {point['ttft_ms']['p50']} ms, failed {point['failed']}")
            time.sleep(1.5)  # the next point starts from a quiet machine (vLLM's workers spin ~1 s)
    return out


def judge(rounds: Sequence[dict[str, dict[str, Any]]], ours: str, theirs: str = "colocated") -> dict[str, Any]:
    """Per point: each round's `ours`/`theirs` TTFT p50 ratio, their median, pass at <= LIMIT."""
    points: dict[str, Any] = {}
    for rnd in rounds:
        mine, other = rnd.get(ours) or {}, rnd.get(theirs) or {}
        for key, point in (mine.get("points") or {}).items():
            row = points.setdefault(key, {"rounds": []})
            base = ((other.get("points") or {}).get(key) or {}).get("ttft_ms", {}).get("p50")
            row["rounds"].append(ratio(point["ttft_ms"]["p50"], base))
    for row in points.values():
        values = [r for r in row["rounds"] if r is not None]
        row["ratio"] = round(statistics.median(values), 3) if values else None
        row["pass"] = None if row["ratio"] is None else row["ratio"] <= LIMIT
    flags = [row["pass"] for row in points.values()]
    return {"ours": ours, "theirs": theirs, "limit": LIMIT, "points": points, "all_pass": bool(flags) and all(flags)}


def warm(url: str, model: str, lengths: Sequence[int], max_tokens: int) -> None:
    """One request per length, one at a time (first-request work, connections)."""
    for length in lengths:
        results = asyncio.run(closed_loop(url, model, prompts_for(length, 1, -1), 1, max_tokens))
        if results[0].error:
            raise RuntimeError(f"warm-up request failed: {results[0].error}")


def bench_closed_loop(
    model: str,
    *,
    variants: Sequence[tuple[str, str, str | None]],
    starters: dict[str, Callable[..., str]],
    set_mode: Callable[[str], None],
    serve_args: Sequence[str],
    cpus: tuple[str, str],
    start_timeout: float,
    requests: int,
    repeats: int,
    max_tokens: int,
    seed: int,
    log_dir: Any,
    say: Callable[[str], None],
    lengths: Sequence[int] = LENGTHS,
    concurrency: Sequence[int] = CONCURRENCY,
) -> dict[str, Any]:
    """`repeats` rounds; in each, every variant (label, system, pd transfer mode or None) alone:
    started, warmed, every point run, stopped (order reversed in odd rounds). Then `judge` per pd
    variant against each baseline variant that ran (`colocated`, `colocated_p`)."""
    from launch.processes import ProcessFailed, ProcessGroup

    rounds: list[dict[str, Any]] = []
    for index in range(repeats):
        rnd: dict[str, Any] = {}
        for label, system, mode in variants if index % 2 == 0 else list(reversed(variants)):
            if mode is not None:
                set_mode(mode)
            entry: dict[str, Any] = {"system": system, "transfer_mode": mode}
            t0 = time.monotonic()
            with ProcessGroup(log_dir / f"closed-{index}-{label}", report=say) as group:
                try:
                    say(f"closed loop round {index + 1}/{repeats}: {label} starting alone")
                    url = starters[system](group, model, serve_args, cpus, start_timeout)
                    entry["startup_s"] = round(time.monotonic() - t0, 1)
                    warm(url, model, lengths, max_tokens)
                    time.sleep(1.5)
                    kwargs = {"lengths": lengths, "concurrency": concurrency, "say": say}
                    run = run_points(url, model, requests=requests, max_tokens=max_tokens, seed=seed, **kwargs)
                    entry["points"] = run
                except Exception as exc:  # noqa: BLE001 - reported in the JSON; the other variants still run
                    entry["error"] = f"{type(exc).__name__}: {exc}"[:2000]
                    say(f"closed loop {label}: failed: {entry['error'][:600]}")
                    if not isinstance(exc, ProcessFailed):
                        import traceback

                        traceback.print_exc()
            rnd[label] = entry
        rounds.append(rnd)
    out: dict[str, Any] = {
        "what": "next request as soon as the previous first token arrived; each system alone on the same cores",
        "lengths": list(lengths),
        "concurrency": list(concurrency),
        "requests_per_point": requests,
        "output_tokens": max_tokens,
        "repeats": repeats,
        "rounds": rounds,
    }
    pd_labels = [label for label, system, _ in variants if system == "pd"]
    for baseline in BASELINES:
        if any(label == baseline for label, _, _ in variants):
            out[f"vs_{baseline}"] = {label: judge(rounds, label, baseline) for label in pd_labels}
    return out
