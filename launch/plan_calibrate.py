"""Measure an instance's step times: ``python -m launch.plan_calibrate --url URL --model M [--out FILE.json]``.

A short calibration (about a minute on a small model) against one running ``vllm serve`` (a
colocated instance, or a decoder: an ordinary request is served by PDConnector's instances as by
any other): the time of a whole prefill alone at several prompt lengths (a one-token completion,
median of ``--repeats``), and the inter-token latency of ``b`` streams decoding at once for several
batch sizes. :class:`proxy.planning.step_model.StepModel` is fitted to them and written as the
calibration JSON that ``python -m launch.plan --calibration`` and the Router's ``--path-model`` read
(``{"step": {...}, "transfer": {...}}``; the push model stays at its defaults unless
``--push-bytes-per-s`` is given, e.g. from ``benchmarks/transfer.py``). The prompts are random
token ids (from ``TOKEN_IDS``), unique per request, so no prefix cache helps.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from typing import Any

import httpx

from launch.sse import asse_lines
from proxy.planning.step_model import DecodeSample, PrefillSample, StepModel, TransferModel

LENGTHS = (64, 256, 512, 1024, 1900)
BATCHES = (1, 2, 4, 8)
DECODE_TOKENS = 48


#: Token ids the prompts are drawn from: valid in any vocabulary of 259 ids or more (byte-level ones included).
TOKEN_IDS = range(3, 259)


def _prompt(rng: random.Random, length: int) -> list[int]:
    return [rng.choice(TOKEN_IDS) for _ in range(length)]


async def _prefill_ms(client: httpx.AsyncClient, url: str, model: str, prompt: list[int]) -> float:
    body = {"model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0}
    start = time.perf_counter()
    response = await client.post(f"{url}/v1/completions", json=body)
    response.raise_for_status()
    return (time.perf_counter() - start) * 1000


async def _stream_itl_ms(client: httpx.AsyncClient, url: str, model: str, prompt: list[int]) -> float:
    """Mean gap between a stream's token events after the first."""
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": DECODE_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    times: list[float] = []
    async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in asse_lines(response):
            if line.startswith("data: ") and line != "data: [DONE]":
                times.append(time.perf_counter())
    if len(times) < 3:
        raise RuntimeError(f"{url}: a {DECODE_TOKENS}-token stream gave {len(times)} events")
    return (times[-1] - times[1]) * 1000 / (len(times) - 2)


async def calibrate(url: str, model: str, repeats: int = 3, seed: int = 0) -> tuple[StepModel, dict[str, Any]]:
    """The fitted model and the raw measurements."""
    rng = random.Random(seed)
    prefill: list[PrefillSample] = []
    decode: list[DecodeSample] = []
    raw: dict[str, Any] = {"prefill_ms": {}, "itl_ms": {}}
    async with httpx.AsyncClient(timeout=300, trust_env=False) as client:
        await _prefill_ms(client, url, model, _prompt(rng, 32))  # warm-up
        for length in LENGTHS:
            times = [await _prefill_ms(client, url, model, _prompt(rng, length)) for _ in range(repeats)]
            ms = statistics.median(times)
            raw["prefill_ms"][length] = round(ms, 2)
            prefill.append(PrefillSample(length, ms))
            print(f"prefill {length:5d} tokens: {ms:8.1f} ms", file=sys.stderr, flush=True)
        for batch in BATCHES:
            gaps = await asyncio.gather(*(_stream_itl_ms(client, url, model, _prompt(rng, 16)) for _ in range(batch)))
            ms = statistics.median(gaps)
            raw["itl_ms"][batch] = round(ms, 2)
            decode.append(DecodeSample(batch, ms))
            print(f"decode batch {batch:3d}: {ms:8.2f} ms/token", file=sys.stderr, flush=True)
    return StepModel().fit(prefill, decode), raw


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", required=True, help="the instance, e.g. http://127.0.0.1:8100")
    parser.add_argument("--model", required=True, help="the served model name")
    parser.add_argument("--repeats", type=int, default=3, help="prefills per length (median; default: 3)")
    parser.add_argument("--push-bytes-per-s", type=float, help="measured KV push throughput (default: the model's)")
    parser.add_argument("--bytes-per-token", type=int, help="KV bytes per token of the model's layout")
    parser.add_argument("--out", help="write the calibration JSON here too")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error(f"--repeats {args.repeats}: must be at least 1")
    model, raw = asyncio.run(calibrate(args.url.rstrip("/"), args.model, args.repeats))
    transfer = TransferModel()
    if args.push_bytes_per_s:
        transfer.push_bytes_per_s = args.push_bytes_per_s
    if args.bytes_per_token:
        transfer.bytes_per_token = args.bytes_per_token
    out = {"step": model.to_dict(), "transfer": transfer.to_dict()}
    text = json.dumps(out, indent=2)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as handle:
            handle.write(text + "\n")
    print(json.dumps({**out, "measured": raw}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
