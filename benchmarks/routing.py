"""Routing benchmark: ``room`` vs ``least-loaded`` vs ``cache-aware`` on a multi-turn chat trace, in one run.

Real ``vllm serve`` instances of the tiny model (``launch/tiny_model.py``): two prefillers (P1 on
core 0, P2 on ``--p2-cpus``, default core 0) and one decoder (core 1), PDConnector between them,
started once. Then ``--rounds`` rounds (default 3; each starts with the next policy): for every
policy in turn the Router is started with ``--routing POLICY``, both P's prefix caches are reset
(``POST /reset_prefix_cache``, vLLM's dev endpoint: P runs with ``VLLM_SERVER_DEV_MODE=1``), and
the round's trace runs (the same texts for every policy of a round):

``--conversations`` chats (default 8) at once, each ``--turns`` turns (default 4) one after the
other; every conversation has its own system prompt, and each turn resends the whole history
(system prompt, the earlier questions and the model's streamed answers) plus a new question, so
a turn's prompt extends the previous turn's. Answers are streamed (``--max-tokens`` tokens,
``ignore_eos``); TTFT is the time to the first streamed event carrying a choice.

Each P's KV cache is ``--p-blocks`` blocks of 32 tokens (default 224: 7,168 tokens, a little more
than the full history of 4 of the trace's 8 conversations, about 1,750 tokens each at their last
turn; so a P holds about half of the trace's history, as a production P's cache holds a fraction
of its traffic's); ``--p-blocks 0`` leaves vLLM's size (1 GiB: everything fits). With no cache
pressure a random P still finds the previous turn half of the time (and older turns often), so
room's hit rate is then about two thirds of cache-aware's (measured: 0.46 vs 0.68), not half.

Printed JSON (one object): per policy, pooled over its rounds, ``prefix_hit_rate`` (P's own
counters summed over both P: ``vllm:prefix_cache_hits`` / ``vllm:prefix_cache_queries``, in
tokens), ``ttft_ms_p50`` / ``ttft_ms_p99``, ``requests`` and ``failed``, P's queried tokens per
prefiller;
``cache_aware_vs_room``: the ratios of hit rate and TTFT p50 (cache-aware / room); ``targets_met``:
hit rate at least 2x room's, TTFT p50 lower, no failures.

    flock /tmp/e2e.lock .venv/bin/python benchmarks/routing.py     # about 2-3 minutes on 2 cores
"""

from __future__ import annotations

import argparse
import asyncio
import json
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

POLICIES = ("room", "least-loaded", "cache-aware")
DEFAULT_MODEL_DIR = REPO_ROOT / "models" / "tiny-llama"
_COUNTER = re.compile(r"^vllm:prefix_cache_(queries|hits)(?:_total)?(?:\{[^}]*\})?\s+(\S+)$", re.MULTILINE)
WORDS = "alpha beta gamma delta kappa lambda sigma omega river stone cloud ember maple quartz".split()


def say(message: str) -> None:
    print(f"[routing-bench {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


# -- the deployment: 2 prefillers, 1 decoder --------------------------------------------------------


@dataclass
class Stack:
    """Where the 2P1D deployment answers: P's (HTTP port, bootstrap port) and D's port."""

    prefillers: list[tuple[int, int]]
    decoder: int

    @property
    def p_urls(self) -> list[str]:
        return [f"http://{LOOPBACK}:{port}" for port, _ in self.prefillers]


def start_2p1d(group: ProcessGroup, model: str, p_cpus: tuple[str, str], p_blocks: int, timeout: float) -> Stack:
    """Start P1, P2 (kv_producer, each its own bootstrap server) and D (kv_consumer, core 1); wait for all."""
    p1, b1, p2, b2, d = free_ports(5)
    p_args = ["--num-gpu-blocks-override", str(p_blocks)] if p_blocks else []
    targets = []
    for name, port, bootstrap, cpus in (("prefill1", p1, b1, p_cpus[0]), ("prefill2", p2, b2, p_cpus[1])):
        cmd = vllm_serve_cmd(model, port, kv_role="kv_producer", bootstrap_port=bootstrap, extra_args=p_args)
        env = dict(vllm_env(cpus), VLLM_SERVER_DEV_MODE="1")
        targets.append((f"http://{LOOPBACK}:{port}/health", group.start(name, cmd, env=env)))
    decode = group.start(
        "decode", vllm_serve_cmd(model, d, kv_role="kv_consumer", bootstrap_port=b1), env=vllm_env("1")
    )
    targets.append((f"http://{LOOPBACK}:{d}/health", decode))
    say(f"starting P1 :{p1} (cpus {p_cpus[0]}), P2 :{p2} (cpus {p_cpus[1]}), D :{d} (cpu 1)")
    wait_all_healthy(targets, timeout)
    return Stack([(p1, b1), (p2, b2)], d)


def prefix_counters(client: httpx.Client, url: str) -> dict[str, float]:
    """P's prefix-cache counters (tokens), summed over label sets: {"queries": ..., "hits": ...}."""
    totals = {"queries": 0.0, "hits": 0.0}
    for kind, value in _COUNTER.findall(client.get(f"{url}/metrics").text):
        totals[kind] += float(value)
    return totals


def reset_prefix_caches(client: httpx.Client, urls: list[str], timeout: float = 30.0) -> None:
    """Reset every P's prefix cache; vLLM refuses while blocks are held, so retry until it succeeds."""
    deadline = time.monotonic() + timeout
    for url in urls:
        while True:
            response = client.post(f"{url}/reset_prefix_cache")
            if response.status_code == 200 and response.json().get("success", True) is not False:
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"{url} did not reset its prefix cache: HTTP {response.status_code} {response.text}")
            time.sleep(0.5)


# -- the trace ---------------------------------------------------------------------------------------


@dataclass
class TraceStats:
    ttft_s: list[float] = field(default_factory=list)
    failed: int = 0
    errors: list[str] = field(default_factory=list)


def conversation_texts(
    seed: int, conversations: int, turns: int, system_chars: int, user_chars: int
) -> list[list[str]]:
    """Per conversation: its system prompt, then one question per turn (the same for every policy)."""
    rng = random.Random(seed)

    def text(prefix: str, chars: int) -> str:
        out = prefix
        while len(out) < chars:
            out += " " + rng.choice(WORDS)
        return out[:chars]

    return [
        [text(f"You are assistant {c} of {conversations}.", system_chars)]
        + [text(f"Question {t + 1}:", user_chars) for t in range(turns)]
        for c in range(conversations)
    ]


async def _turn(client: httpx.AsyncClient, url: str, body: dict[str, Any], stats: TraceStats) -> str:
    """One streamed chat request; returns the answer's text."""
    start = time.monotonic()
    first: float | None = None
    parts: list[str] = []
    async with client.stream("POST", url, json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"HTTP {response.status_code}: {(await response.aread())[:200]!r}")
        async for line in asse_lines(response):
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[len("data: ") :])
            if "error" in event:
                raise RuntimeError(f"error event: {event['error']}")
            for choice in event.get("choices") or ():
                if first is None:
                    first = time.monotonic()
                parts.append((choice.get("delta") or {}).get("content") or "")
    if first is None:
        raise RuntimeError("the stream carried no choice")
    stats.ttft_s.append(first - start)
    return "".join(parts)


async def run_trace(router_url: str, model: str, texts: list[list[str]], max_tokens: int) -> TraceStats:
    """Every conversation at once, each one turn after the other."""
    stats = TraceStats()
    url = f"{router_url}/v1/chat/completions"

    async def conversation(client: httpx.AsyncClient, system: str, questions: list[str]) -> None:
        messages = [{"role": "system", "content": system}]
        for question in questions:
            messages.append({"role": "user", "content": question})
            body = {"model": model, "messages": messages, "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
            try:
                answer = await _turn(client, url, body, stats)
            except (httpx.HTTPError, RuntimeError, ValueError) as exc:
                stats.failed += 1
                stats.errors.append(f"{type(exc).__name__}: {exc}")
                answer = ""
            messages.append({"role": "assistant", "content": answer})

    limits = httpx.Limits(max_connections=len(texts) * 2)
    async with httpx.AsyncClient(timeout=120.0, trust_env=False, limits=limits) as client:
        await asyncio.gather(*(conversation(client, t[0], t[1:]) for t in texts))
    return stats


# -- one policy -----------------------------------------------------------------------------------


@dataclass
class PolicyRuns:
    """One policy's runs, pooled: P's counter deltas per prefiller, every TTFT, failures."""

    queries: list[float] = field(default_factory=lambda: [0.0, 0.0])
    hits: list[float] = field(default_factory=lambda: [0.0, 0.0])
    trace: TraceStats = field(default_factory=TraceStats)
    seconds: float = 0.0

    def summary(self) -> dict[str, Any]:
        queries, hits, trace = sum(self.queries), sum(self.hits), self.trace
        out: dict[str, Any] = {
            "prefix_hit_rate": round(hits / queries, 4) if queries else None,
            "prefix_hit_tokens": int(hits),
            "prefix_query_tokens": int(queries),
            "query_tokens_per_prefiller": [int(q) for q in self.queries],
            "ttft_ms_p50": ms(percentile(trace.ttft_s, 0.5)),
            "ttft_ms_p99": ms(percentile(trace.ttft_s, 0.99)),
            "requests": len(trace.ttft_s) + trace.failed,
            "failed": trace.failed,
            "trace_s": round(self.seconds, 1),
        }
        if trace.errors:
            out["errors"] = trace.errors[:3]
        return out


def run_policy(
    group: ProcessGroup,
    stack: Stack,
    policy: str,
    model: str,
    texts: list[list[str]],
    runs: PolicyRuns,
    max_tokens: int,
) -> None:
    """Start a Router with ``--routing policy``, reset P's prefix caches, run the trace, add to ``runs``."""
    (port,) = free_ports(1)
    prefill = [(LOOPBACK, p, b) for p, b in stack.prefillers]
    cmd = [*router_cmd(port, prefill, [(LOOPBACK, stack.decoder)]), "--routing", policy, "--log-level", "WARNING"]
    router = group.start(f"router-{policy}", cmd)
    router_url = f"http://{LOOPBACK}:{port}"
    try:
        wait_http_ok(f"{router_url}/healthcheck", 60.0, router)
        with httpx.Client(timeout=30.0, trust_env=False) as client:
            reset_prefix_caches(client, stack.p_urls)
            before = [prefix_counters(client, url) for url in stack.p_urls]
            t0 = time.monotonic()
            trace = asyncio.run(run_trace(router_url, model, texts, max_tokens))
            runs.seconds += time.monotonic() - t0
            after = [prefix_counters(client, url) for url in stack.p_urls]
    finally:
        group.stop(router)
    queries = [a["queries"] - b["queries"] for a, b in zip(after, before, strict=True)]
    hits = [a["hits"] - b["hits"] for a, b in zip(after, before, strict=True)]
    runs.queries = [total + q for total, q in zip(runs.queries, queries, strict=True)]
    runs.hits = [total + h for total, h in zip(runs.hits, hits, strict=True)]
    runs.trace.ttft_s += trace.ttft_s
    runs.trace.failed += trace.failed
    runs.trace.errors += trace.errors
    hit_rate = sum(hits) / max(1.0, sum(queries))
    say(f"{policy}: hit rate {hit_rate:.3f}, TTFT p50 {ms(percentile(trace.ttft_s, 0.5))} ms, failed {trace.failed}")


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a is not None and b else None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--conversations", type=int, default=8, help="chats run at once (default: 8)")
    parser.add_argument("--turns", type=int, default=4, help="turns per chat (default: 4)")
    parser.add_argument("--system-chars", type=int, default=800, help="system prompt per chat (default: 800)")
    parser.add_argument("--user-chars", type=int, default=200, help="question per turn (default: 200)")
    parser.add_argument("--max-tokens", type=int, default=8, help="answer tokens per turn (default: 8)")
    parser.add_argument("--p-blocks", type=int, default=224, help="KV blocks per P, 0 = vLLM's size (default: 224)")
    parser.add_argument("--p2-cpus", default="0", help="core(s) of P2; P1 is on 0, D on 1 (default: 0)")
    parser.add_argument("--policies", nargs="+", choices=POLICIES, default=list(POLICIES))
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL_DIR, help="model dir (built if missing)")
    parser.add_argument("--rounds", type=int, default=3, help="runs per policy, order rotating (default: 3)")
    parser.add_argument("--seed", type=int, default=0, help="of round 0's texts; round r uses seed + r")
    parser.add_argument("--start-timeout", type=float, default=300.0)
    parser.add_argument("--log-dir", type=Path, help="where the processes' logs go (default: a temporary folder)")
    args = parser.parse_args()

    model = str(make_tiny_model(args.model))
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="routing-bench-"))
    say(f"logs in {log_dir}")
    runs = {policy: PolicyRuns() for policy in args.policies}
    with ProcessGroup(log_dir, report=say) as group:
        stack = start_2p1d(group, model, ("0", args.p2_cpus), args.p_blocks, args.start_timeout)
        for round_ in range(args.rounds):
            texts = conversation_texts(
                args.seed + round_, args.conversations, args.turns, args.system_chars, args.user_chars
            )
            shift = round_ % len(args.policies)  # each round starts with the next policy
            for policy in args.policies[shift:] + args.policies[:shift]:
                run_policy(group, stack, policy, model, texts, runs[policy], args.max_tokens)
    results = {policy: r.summary() for policy, r in runs.items()}
    report: dict[str, Any] = {"policies": results}
    room, cache = results.get("room"), results.get("cache-aware")
    if room and cache:
        hit_ratio = _ratio(cache["prefix_hit_rate"], room["prefix_hit_rate"])
        ttft_ratio = _ratio(cache["ttft_ms_p50"], room["ttft_ms_p50"])
        report["cache_aware_vs_room"] = {"prefix_hit_rate": hit_ratio, "ttft_ms_p50": ttft_ratio}
        report["targets_met"] = {
            "prefix_hit_rate>=2x_room": hit_ratio is not None and hit_ratio >= 2.0,
            "ttft_p50_lower_than_room": ttft_ratio is not None and ttft_ratio < 1.0,
            "zero_failed": all(r["failed"] == 0 for r in results.values()),
        }
    report["trace"] = {
        "conversations": args.conversations,
        "turns": args.turns,
        "system_chars": args.system_chars,
        "user_chars": args.user_chars,
        "max_tokens": args.max_tokens,
        "p_blocks": args.p_blocks,
        "rounds": args.rounds,
        "cpus": {"P1": "0", "P2": args.p2_cpus, "D": "1"},
    }
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
