"""Rebalancing benchmark: p99 TPOT and throughput with ``--rebalance on`` vs off, in one run.

Real ``vllm serve`` instances of a random Llama (``--shape``, default ``reference``: hidden 512, 6
layers, so a decoder's step time grows with its batch; ``launch/tiny_model.py``): one prefiller and two
decoders started with the connector's ``migration`` (each its own bootstrap server, known to the Router
by ``--decoder-bootstrap-ports``: their streams move by KV), started once. Two Routers in front of them,
one with ``--rebalance off`` and one with ``--rebalance on``, each warmed up by one pass (not counted);
rounds go to them in the order on, off, off, on (repeated: ``ORDER``), the same requests in every round.

The load is skewed by prefix affinity: two prompt families (a long shared prefix each, a short
unique tail per request), ``--skew`` of the requests (default 0.7) of family A. Each family sticks to
one decoder: the Routers run ``--routing room --trust-client-room`` and the client gives family A even
rooms (decoder 0) and family B odd rooms (decoder 1), as a prefix-affine decoder choice would place
them (``--routing cache-aware`` chooses P by prefix but D by load, so it would not skew the decoders).
``--concurrency`` clients (closed loop) send ``--requests`` streamed completions per round,
``--max-tokens`` tokens each (``ignore_eos``). Both Routers run ``--path-policy always-pd`` by default
(``--path-policy``): a stream D prefilled itself (the ``local`` path, which ``adaptive`` picks often
here, the family prefixes being cached on each decoder) cannot move by KV, so ``adaptive`` measures how
much of the load is movable as much as the rebalancer.

Placement on a 2-core machine: three instances cannot each have a core. By default P shares core 0
with decoder 0, the one family A (70%) loads (``--d-cpus 0 1``): that decoder is overloaded (skew and a
shared core), the other has room. With ``--d-cpus 1 0`` the busy decoder has a core to itself and the
light one shares P's: on this machine that evens them out (the skew alone does not overload a core at
24 clients), and the rebalancer should hold still (``--min-gain``).

TPOT of a request: (last token event - first token event) / (completion tokens - 1), from the
client's side. ``--tpot-ms auto`` (default) sets the rebalancer's target from a calibration round
(off, not counted, before the first): the ITL both decoders would have with the streams spread by
their speed, from their TPOT p50 there (``balanced_itl_ms``; a user sets their own TPOT objective).

Printed JSON (one object): per round its mode, TPOT p50/p99 (all, and per family), throughput
(completion tokens / round wall time), requests, failed, the on-Router's moves in the round, and its
three slowest requests (family, room, first token's time into the round, TPOT);
``summary``: per mode, pooled over its rounds, and the ratios on / off.

    flock /tmp/pdc-e2e.lock .venv/bin/python benchmarks/rebalance.py            # the measurement
    flock /tmp/pdc-e2e.lock .venv/bin/python benchmarks/rebalance.py --smoke    # does it run (short)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from benchmarks.serving_trace import ms, percentile  # noqa: E402
from launch.commands import EAGER_ENV  # noqa: E402
from launch.processes import (  # noqa: E402
    LOOPBACK,
    ProcessGroup,
    free_ports,
    router_cmd,
    vllm_env,
    vllm_serve_cmd,
    wait_all_healthy,
    wait_http_ok,
)
from launch.sse import asse_lines  # noqa: E402
from launch.tiny_model import make_tiny_model  # noqa: E402

#: Model shapes (``launch.tiny_model.make_tiny_model``): "tiny" decodes in about the same time at any batch
#: size on a CPU core (the step is vLLM's fixed cost), "reference" (the serving benchmarks' shape) spends
#: most of a step in the model, so a decoder's step time grows with its batch as on a real accelerator.
SHAPES: dict[str, dict[str, int]] = {
    "tiny": {},
    "reference": {"num_layers": 6, "hidden_size": 512, "num_heads": 8, "num_kv_heads": 2},
    "large": {"num_layers": 8, "hidden_size": 1024, "num_heads": 16, "num_kv_heads": 4},
}
MODEL_DIRS = {
    "tiny": REPO_ROOT / "models" / "tiny-llama",
    "reference": REPO_ROOT / "models" / "bench-llama-h512-l6",
    "large": REPO_ROOT / "models" / "bench-llama-h1024-l8",
}
WORDS = "alpha beta gamma delta kappa lambda sigma omega river stone cloud ember maple quartz".split()
MOVES = re.compile(r"^pd_router_rebalance_moves_total\{([^}]*)\}\s+(\S+)$", re.MULTILINE)
REQUEST_TIMEOUT_S = 300.0


def say(message: str) -> None:
    print(f"[rebalance-bench {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


# -- the deployment: 1 prefiller, 2 decoders with migration, 2 Routers --------------------------------


@dataclass
class Stack:
    """P's (HTTP, bootstrap) ports and each decoder's (HTTP, own bootstrap) ports."""

    prefiller: tuple[int, int]
    decoders: list[tuple[int, int]]


def start_stack(group: ProcessGroup, model: str, p_cpus: str, d_cpus: tuple[str, str], timeout: float) -> Stack:
    p, bp, d0, b0, d1, b1 = free_ports(6)
    targets = [
        (
            f"http://{LOOPBACK}:{p}/health",
            group.start(
                "prefill", vllm_serve_cmd(model, p, kv_role="kv_producer", bootstrap_port=bp), env=vllm_env(p_cpus)
            ),
        )
    ]
    for name, port, bootstrap, cpus in (("decode0", d0, b0, d_cpus[0]), ("decode1", d1, b1, d_cpus[1])):
        cmd = vllm_serve_cmd(
            model, port, kv_role="kv_consumer", bootstrap_port=bootstrap, extra_config={"migration": True}
        )
        targets.append((f"http://{LOOPBACK}:{port}/health", group.start(name, cmd, env=vllm_env(cpus))))
    say(f"starting P :{p} (cpu {p_cpus}), D0 :{d0} (cpu {d_cpus[0]}), D1 :{d1} (cpu {d_cpus[1]}), both with migration")
    wait_all_healthy(targets, timeout)
    return Stack((p, bp), [(d0, b0), (d1, b1)])


def start_router(group: ProcessGroup, stack: Stack, name: str, rebalance: list[str], path_policy: str) -> str:
    port = free_ports(1)[0]
    p, bp = stack.prefiller
    cmd = router_cmd(port, [(LOOPBACK, p, bp)], [(LOOPBACK, d) for d, _ in stack.decoders])
    cmd += [
        "--routing",
        "room",
        "--trust-client-room",
        "--log-level",
        os.environ.get("REBALANCE_BENCH_ROUTER_LOG", "WARNING"),
    ]
    cmd += ["--path-policy", path_policy]
    cmd += ["--decoder-bootstrap-ports", *(str(b) for _, b in stack.decoders), *rebalance]
    process = group.start(name, cmd)
    url = f"http://{LOOPBACK}:{port}"
    wait_http_ok(f"{url}/health", 60, process)
    say(f"{name} on {url}: {' '.join(rebalance)}")
    return url


# -- the load ---------------------------------------------------------------------------------------


@dataclass
class Result:
    family: str
    room: int = 0
    tokens: int = 0
    tpot_s: float | None = None
    error: str | None = None
    #: When its first token came (monotonic s), to say where in the round the slowest ones ran.
    first_at: float | None = None


def prompts(seed: int, count: int, skew: float, prefix_chars: int) -> list[tuple[str, str]]:
    """``count`` (family, prompt): family A with probability ``skew``; a shared prefix per family."""
    rng = random.Random(seed)

    def words(n_chars: int, head: str) -> str:
        out = head
        while len(out) < n_chars:
            out += " " + rng.choice(WORDS)
        return out[:n_chars]

    prefix = {f: words(prefix_chars, f"Family {f} context:") for f in ("A", "B")}
    out = []
    for i in range(count):
        family = "A" if rng.random() < skew else "B"
        out.append((family, f"{prefix[family]} Request {i}: {words(40, '')}"))
    return out


async def one_request(
    client: httpx.AsyncClient, url: str, model: str, family: str, prompt: str, room: int, max_tokens: int
) -> Result:
    result = Result(family, room)
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
        "bootstrap_room": room,
    }
    first = last = None
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                return result
            async for line in asse_lines(response):
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[len("data: ") :])
                if "error" in event:
                    result.error = f"error event: {event['error']}"
                    return result
                if event.get("usage"):
                    result.tokens = int(event["usage"].get("completion_tokens") or 0)
                if event.get("choices"):
                    last = time.monotonic()
                    first = first or last
    except (httpx.HTTPError, ValueError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
        return result
    if first is not None and last is not None and result.tokens > 1:
        result.tpot_s = (last - first) / (result.tokens - 1)
        result.first_at = first
    return result


async def run_round(
    url: str, model: str, work: list[tuple[str, str]], concurrency: int, max_tokens: int, room_base: int
) -> tuple[list[Result], float]:
    """Closed loop: ``concurrency`` clients take the next request until none is left."""
    queue = list(enumerate(work))
    results: list[Result] = []

    async def client_loop(client: httpx.AsyncClient) -> None:
        while queue:
            i, (family, prompt) = queue.pop(0)
            room = room_base + 2 * i + (0 if family == "A" else 1)  # A: decoder 0, B: decoder 1 (room rule)
            results.append(await one_request(client, url, model, family, prompt, room, max_tokens))

    start = time.monotonic()
    timeout = httpx.Timeout(REQUEST_TIMEOUT_S, connect=10.0)
    async with httpx.AsyncClient(timeout=timeout, trust_env=False) as client:
        await asyncio.gather(*(client_loop(client) for _ in range(concurrency)))
    for result in results:
        if result.first_at is not None:
            result.first_at -= start  # from the round's start
    return results, time.monotonic() - start


def moves(url: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=10, trust_env=False).text
    return sum(float(value) for _labels, value in MOVES.findall(text))


@dataclass
class Pooled:
    results: list[Result] = field(default_factory=list)
    seconds: float = 0.0
    moves: float = 0.0

    def summary(self) -> dict[str, Any]:
        return stats(self.results, self.seconds) | {"moves": self.moves}


def stats(results: list[Result], seconds: float) -> dict[str, Any]:
    ok = [r for r in results if r.error is None]
    out: dict[str, Any] = {
        "requests": len(results),
        "failed": len(results) - len(ok),
        "throughput_tok_s": round(sum(r.tokens for r in ok) / seconds, 2) if seconds > 0 else None,
    }
    for name, group in (
        ("all", ok),
        ("A", [r for r in ok if r.family == "A"]),
        ("B", [r for r in ok if r.family == "B"]),
    ):
        tpots = [r.tpot_s for r in group if r.tpot_s is not None]
        out[f"tpot_ms_p50_{name}"] = ms(percentile(tpots, 0.5))
        out[f"tpot_ms_p99_{name}"] = ms(percentile(tpots, 0.99))
    slowest = sorted((r for r in ok if r.tpot_s is not None), key=lambda r: -(r.tpot_s or 0.0))[:3]
    #: The three slowest: family, room (the Router's log names the moved ones), first token (s into the round), TPOT.
    out["slowest"] = [[r.family, r.room, round(r.first_at or 0.0, 2), ms(r.tpot_s)] for r in slowest]
    errors = [r.error for r in results if r.error]
    if errors:
        out["errors"] = errors[:5]
    return out


#: Rounds in the order on, off, off, on (repeated): each mode as often first and last, so neither is
#: favoured by what the machine does over the run.
ORDER = ("on", "off", "off", "on")


def balanced_itl_ms(itl_a: float | None, itl_b: float | None, skew: float) -> float:
    """The ITL both decoders would have with the streams spread by their speed: each decoder's cost per
    stream from an unbalanced round (ITL / its share of the streams, ``skew`` on A), and as many
    streams on each as keeps their ITLs equal: 1 / (skew / ITL_A + (1 - skew) / ITL_B)."""
    if not itl_a or not itl_b:
        return round(itl_a or itl_b or 100.0, 1)
    return round(1.0 / (skew / itl_a + (1.0 - skew) / itl_b), 1)


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a is not None and b else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="reference", help="model shape (default: reference)")
    parser.add_argument("--model", type=Path, help="model dir (default: the shape's, built if missing)")
    parser.add_argument("--rounds", type=int, default=8, help="rounds, on / off / off / on ... (default: 8)")
    parser.add_argument("--requests", type=int, default=96, help="requests per round (default: 96)")
    parser.add_argument("--concurrency", type=int, default=24, help="clients at once (default: 24)")
    parser.add_argument("--max-tokens", type=int, default=128, help="tokens per answer (default: 128)")
    parser.add_argument("--prefix-chars", type=int, default=600, help="shared prefix per family (default: 600)")
    parser.add_argument("--skew", type=float, default=0.7, help="share of family A, decoder 0 (default: 0.7)")
    parser.add_argument("--tpot-ms", default="auto", help="--rebalance-tpot-ms, or auto (default: auto)")
    parser.add_argument("--max-moves-per-s", type=float, default=4.0, help="--rebalance-max-moves-per-s (default: 4)")
    parser.add_argument("--interval-s", type=float, default=0.2, help="--rebalance-interval-s (default: 0.2)")
    parser.add_argument("--d-cpus", nargs=2, default=["0", "1"], help="cores of D0 and D1 (default: 0 1)")
    parser.add_argument("--min-gain", type=float, default=0.1, help="--rebalance-min-gain (default: 0.1)")
    # P spread over both cores ("0-1") starves the decoder on core 0 (its TPOT p50 was 17x the other's).
    parser.add_argument("--p-cpus", default="0", help="cores of P (default: 0)")
    # A stream D prefilled itself (the local path) carries no migrate room: it cannot move by KV.
    parser.add_argument(
        "--path-policy",
        default="always-pd",
        help="both Routers' --path-policy (default: always-pd, every stream movable)",
    )
    parser.add_argument("--by-replay", action="store_true", help="--rebalance-by-replay on the on-Router")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--start-timeout", type=float, default=300.0)
    parser.add_argument("--log-dir", type=Path, help="where the processes' logs go (default: a temporary folder)")
    parser.add_argument("--eager", action="store_true", help="vLLM with --enforce-eager (no compile warm-up)")
    parser.add_argument("--smoke", action="store_true", help="2 rounds of 8 requests, 4 clients, 160 tokens, --eager")
    args = parser.parse_args()
    if args.smoke:
        args.rounds, args.requests, args.concurrency, args.max_tokens, args.eager = 2, 8, 4, 160, True
    if args.eager:
        os.environ[EAGER_ENV] = "1"  # launch.commands.vllm_serve_cmd adds --enforce-eager
    if args.rounds < 2 or args.rounds % 2:
        parser.error(f"--rounds must be even and at least 2 (as many on as off), got {args.rounds}")

    model = str(make_tiny_model(args.model or MODEL_DIRS[args.shape], **SHAPES[args.shape]))
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="rebalance-bench-"))
    say(f"logs in {log_dir}")
    work = prompts(args.seed, args.requests, args.skew, args.prefix_chars)
    pooled = {"off": Pooled(), "on": Pooled()}
    rounds: list[dict[str, Any]] = []
    started = time.monotonic()
    tpot_ms: float | None = None if args.tpot_ms == "auto" else float(args.tpot_ms)
    with ProcessGroup(log_dir, report=say) as group:
        stack = start_stack(group, model, args.p_cpus, (args.d_cpus[0], args.d_cpus[1]), args.start_timeout)
        urls = {"off": start_router(group, stack, "router-off", ["--rebalance", "off"], args.path_policy)}
        warm = prompts(args.seed + 1, args.concurrency, args.skew, args.prefix_chars)  # not counted
        asyncio.run(run_round(urls["off"], model, warm, args.concurrency, args.max_tokens, 0))
        # A calibration round (off, not counted) sets the automatic target.
        results, seconds = asyncio.run(
            run_round(urls["off"], model, work, args.concurrency, args.max_tokens, 900_000_000)
        )
        calibration = {"rebalance": "off", "seconds": round(seconds, 2), **stats(results, seconds)}
        say(f"calibration round (not counted): {json.dumps(calibration)}")
        if tpot_ms is None:
            tpot_ms = balanced_itl_ms(calibration["tpot_ms_p50_A"], calibration["tpot_ms_p50_B"], args.skew)
        flags = ["--rebalance", "on", "--rebalance-tpot-ms", str(tpot_ms)]
        flags += ["--rebalance-max-moves-per-s", str(args.max_moves_per_s), "--rebalance-min-tokens-left", "8"]
        flags += ["--rebalance-interval-s", str(args.interval_s), "--rebalance-min-gain", str(args.min_gain)]
        flags += ["--rebalance-by-replay"] if args.by_replay else []
        urls["on"] = start_router(group, stack, "router-on", flags, args.path_policy)
        asyncio.run(run_round(urls["on"], model, warm, args.concurrency, args.max_tokens, 800_000_000))  # not counted
        for index in range(args.rounds):
            mode = ORDER[index % len(ORDER)]
            before = moves(urls[mode])
            results, seconds = asyncio.run(
                run_round(urls[mode], model, work, args.concurrency, args.max_tokens, 1_000_000 * (index + 1))
            )
            moved = moves(urls[mode]) - before
            record = {"round": index, "rebalance": mode, "seconds": round(seconds, 2), **stats(results, seconds)}
            record["moves"] = moved
            rounds.append(record)
            pool = pooled[mode]
            pool.results += results
            pool.seconds += seconds
            pool.moves += moved
            say(f"round {index} ({mode}): {json.dumps(record)}")
    summary = {mode: p.summary() for mode, p in pooled.items()}
    off, on = summary["off"], summary["on"]
    report = {
        "calibration": calibration,
        "rounds": rounds,
        "summary": summary,
        "on_vs_off": {
            "tpot_ms_p99_all": _ratio(on["tpot_ms_p99_all"], off["tpot_ms_p99_all"]),
            "tpot_ms_p99_A": _ratio(on["tpot_ms_p99_A"], off["tpot_ms_p99_A"]),
            "throughput_tok_s": _ratio(on["throughput_tok_s"], off["throughput_tok_s"]),
        },
        "config": {
            "shape": args.shape,
            "model": model,
            "requests": args.requests,
            "concurrency": args.concurrency,
            "max_tokens": args.max_tokens,
            "skew": args.skew,
            "prefix_chars": args.prefix_chars,
            "rebalance_tpot_ms": tpot_ms,
            "max_moves_per_s": args.max_moves_per_s,
            "interval_s": args.interval_s,
            "min_gain": args.min_gain,
            "path_policy": args.path_policy,
            "by_replay": args.by_replay,
            "cpus": {"P": args.p_cpus, "D0": args.d_cpus[0], "D1": args.d_cpus[1]},
            "smoke": args.smoke,
            "eager": args.eager,
        },
        "wall_s": round(time.monotonic() - started, 1),
    }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
