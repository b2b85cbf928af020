"""Fixed per-request PD overhead: TTFT through the Router (P + D) minus P's own answer time.

Starts a real 1P1D stack (`launch.processes.start_pd_stack`: P's whole process tree on core 0,
D's on core 1, the Router unplaced) of the reference-shape tiny Llama, then sends sequential
requests, alternating, each with a prompt never seen before (no prefix-cache hit):

- `p_alone`: straight to P, streamed, max_tokens 1: P's own time to its first token;
- `pd`: through the Router, streamed, max_tokens 2: the client's time to the first token.

The Router's first-token path streams P's own token 1; where that token has no text yet (the
first bytes of a character) P's empty chunk goes first and D answers from token 1 (``P-empty``);
the JSON splits the PD requests by who sent the first token (the Router's ``first=`` log field:
P, P-empty or D) and gives the overhead of each path.

`overhead_ms` = median PD TTFT - median P-alone TTFT. The PD requests carry an X-Request-Id, so
their phase-trace lines (pd_connector.trace: Router, P and D) are found in the logs and give the
breakdown (`phases_ms`, medians): where between the Router receiving the request and D's first
byte the time went. With `--transfer-mode both` the stack is started once per mode (P and D get
the same `transfer_mode`). One JSON object on stdout, progress on stderr.

    python benchmarks/overhead.py                          # 64 and 2,000 tokens, request mode
    python benchmarks/overhead.py --transfer-mode both --prompt-tokens 2000
"""

from __future__ import annotations

import argparse
import json
import random
import re
import statistics
import string
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import httpx

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from launch.processes import ProcessGroup, start_pd_stack  # noqa: E402
from launch.sse import sse_lines  # noqa: E402
from pd_connector.trace import TraceRecord, parse_trace_line  # noqa: E402

REFERENCE_SHAPE = {"num_layers": 6, "hidden_size": 512, "num_heads": 8, "num_kv_heads": 2}
DEFAULT_MODEL_DIR = REPO_ROOT / "models" / "bench-llama-h512-l6"
SERVE_ARGS = ["--max-model-len", "4096"]
#: Without --compile: no torch.compile (start-up in ~1 min instead of several on 2 busy cores; the
#: overhead is orchestration, and P alone and PD run the same kernels either way).
EAGER_ARGS = ["--enforce-eager"]
#: (name, from (side, phase), to (side, phase)): the breakdown, in a request's order.
SEGMENTS: tuple[tuple[str, tuple[str, str], tuple[str, str]], ...] = (
    ("router_to_p", ("router", "received"), ("prefill", "received")),
    ("p_prefill", ("prefill", "received"), ("prefill", "prefill_done")),
    ("router_to_d", ("router", "received"), ("decode", "received")),
    ("d_admit", ("decode", "received"), ("decode", "admitted")),
    ("d_ask_p", ("decode", "admitted"), ("decode", "asked_p")),
    ("d_request_at_p", ("decode", "asked_p"), ("prefill", "d_asked")),
    ("p_done_to_push", ("prefill", "prefill_done"), ("prefill", "push_started")),
    ("push", ("prefill", "push_started"), ("prefill", "push_done")),
    ("p_done_to_d_kv_ready", ("prefill", "prefill_done"), ("decode", "kv_ready")),
    ("push_done_to_d_kv_ready", ("prefill", "push_done"), ("decode", "kv_ready")),
    ("d_kv_ready_to_scheduled", ("decode", "kv_ready"), ("decode", "scheduled")),
    ("d_scheduled_to_first_byte", ("decode", "scheduled"), ("router", "d_first_byte")),
    ("router_p_answered", ("router", "received"), ("router", "p_answered")),
    ("router_first_byte", ("router", "received"), ("router", "d_first_byte")),
)


def say(message: str) -> None:
    print(f"[overhead {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", help="model directory (default: build the reference-shape tiny Llama)")
    p.add_argument("--prompt-tokens", type=int, nargs="+", default=[64, 2000])
    p.add_argument("--requests", type=int, default=8, help="measured requests per length and path")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--transfer-mode", choices=("request", "layer", "both"), default="request")
    p.add_argument("--p-cpus", default="0")
    p.add_argument("--d-cpus", default="1")
    p.add_argument("--compile", action="store_true", help="let vLLM torch.compile the model (slow start-up)")
    p.add_argument("--log-dir", type=Path, help="process logs (default: a temporary folder)")
    p.add_argument("--start-timeout", type=float, default=300.0)
    return p.parse_args(argv)


def unique_prompt(tokens: int, rng: random.Random) -> str:
    """`tokens` tokens for the byte-level tiny tokenizer (one ASCII char each), never repeated."""
    return "".join(rng.choice(string.ascii_lowercase) for _ in range(tokens))


def stream_ttft(url: str, body: dict, headers: dict[str, str] | None = None) -> float:
    """Seconds from sending a streamed /v1/completions call to its first text chunk."""
    with httpx.Client(timeout=120, trust_env=False) as client:
        t0 = time.perf_counter()
        ttft = None
        with client.stream("POST", f"{url}/v1/completions", json=body, headers=headers or {}) as resp:
            if resp.status_code != 200:
                raise RuntimeError(f"HTTP {resp.status_code} from {url}: {resp.read()[:300]!r}")
            for line in sse_lines(resp):
                if ttft is None and line.startswith("data: ") and '"text"' in line:
                    ttft = time.perf_counter() - t0
    if ttft is None:
        raise RuntimeError(f"no token streamed by {url}")
    return ttft


def first_token_senders(router_log: Path, req_ids: list[str]) -> dict[str, str]:
    """Who sent each request's first token, from the Router's request lines (``first=P`` / ``P-empty`` / ``D``)."""
    wanted = set(req_ids)
    out: dict[str, str] = {}
    for line in router_log.read_text(errors="replace").splitlines():
        match = re.search(r"rid=(\S+) .* first=(P-empty|P|D)\b", line)
        if match and match.group(1) in wanted:
            out[match.group(1)] = match.group(2)
    return out


def traces(paths: dict[str, Path]) -> dict[str, list[TraceRecord]]:
    return {
        side: [r for r in map(parse_trace_line, path.read_text(errors="replace").splitlines()) if r]
        for side, path in paths.items()
    }


def breakdown(records: dict[str, list[TraceRecord]], req_ids: list[str]) -> dict[str, float | None]:
    """Median ms of every segment over the PD requests whose three trace lines were found."""
    by_req = {r.req_id: r for r in records["router"] if r.side == "router"}
    by_room = {side: {r.room: r for r in records[side] if r.side == side} for side in ("prefill", "decode")}
    samples: dict[str, list[float]] = {name: [] for name, _, _ in SEGMENTS}
    for rid in req_ids:
        router = by_req.get(rid)
        if router is None:
            continue
        rec = {
            "router": router,
            "prefill": by_room["prefill"].get(router.room),
            "decode": by_room["decode"].get(router.room),
        }
        for name, (s0, p0), (s1, p1) in SEGMENTS:
            a, b = rec[s0], rec[s1]
            t0, t1 = (a.at(p0) if a else None), (b.at(p1) if b else None)
            if t0 is not None and t1 is not None:
                samples[name].append((t1 - t0) * 1e3)
    return {name: round(statistics.median(v), 2) if v else None for name, v in samples.items()}


def measure(stack: Any, tokens: int, args: argparse.Namespace, rng: random.Random) -> dict[str, Any]:
    def body(max_tokens: int) -> dict:
        return {
            "model": stack.model,
            "prompt": unique_prompt(tokens, rng),
            "max_tokens": max_tokens,
            "temperature": 0,
            "stream": True,
            "ignore_eos": True,
        }

    p_alone, pd, req_ids = [], [], []
    for i in range(args.warmup + args.requests):
        t_p = stream_ttft(stack.prefill_url, body(1))
        rid = f"overhead-{uuid.uuid4().hex}"
        t_pd = stream_ttft(stack.router_url, body(2), {"X-Request-Id": rid})
        if i >= args.warmup:
            p_alone.append(t_p * 1e3)
            pd.append(t_pd * 1e3)
            req_ids.append(rid)
    time.sleep(1.5)  # trace lines are written as each side finishes
    phases = breakdown(traces(stack.log_paths), req_ids)
    p_ms, pd_ms = statistics.median(p_alone), statistics.median(pd)
    sender = first_token_senders(stack.router.log_path, req_ids)
    paths = ("P", "P-empty", "D")
    by_path = {who: [t for t, rid in zip(pd, req_ids, strict=True) if sender.get(rid) == who] for who in paths}

    def overhead(who: str) -> float | None:
        return round(statistics.median(by_path[who]) - p_ms, 2) if by_path[who] else None

    return {
        # The Router's first-token path: P's token 1 (first=P), or P's empty chunk where token 1 is
        # the first bytes of a character (first=P-empty: the tiny model's byte tokens often are),
        # vs D answering from token 1 (first=D: P's answer without token ids).
        "first_token_from_p": len(by_path["P"]),
        "first_token_from_p_empty": len(by_path["P-empty"]),
        "first_token_from_d": len(by_path["D"]),
        "overhead_ms_first_from_p": overhead("P"),
        "overhead_ms_first_from_p_empty": overhead("P-empty"),
        "overhead_ms_first_from_d": overhead("D"),
        "prompt_tokens": tokens,
        "requests": args.requests,
        "p_alone_ttft_ms_median": round(p_ms, 2),
        "pd_ttft_ms_median": round(pd_ms, 2),
        "overhead_ms": round(pd_ms - p_ms, 2),
        "p_alone_ttft_ms": [round(x, 2) for x in p_alone],
        "pd_ttft_ms": [round(x, 2) for x in pd],
        "phases_ms": phases,
    }


def run_mode(mode: str, model: str, args: argparse.Namespace, log_dir: Path) -> dict[str, Any]:
    extra = {} if mode == "request" else {"transfer_mode": mode}
    rng = random.Random(f"{mode}-{time.time()}")
    serve_args = SERVE_ARGS + ([] if args.compile else EAGER_ARGS)
    with ProcessGroup(log_dir / mode) as group:
        say(f"starting the 1P1D stack ({mode} mode), logs in {log_dir / mode}")
        stack = start_pd_stack(
            group,
            model,
            extra_p_config=extra,
            extra_d_config=extra,
            timeout=args.start_timeout,
            p_args=serve_args,
            d_args=serve_args,
            p_cpus=args.p_cpus,
            d_cpus=args.d_cpus,
            on_progress=say,
        )
        out = []
        for tokens in args.prompt_tokens:
            say(f"{mode}: {tokens}-token prompts")
            out.append(measure(stack, tokens, args, rng))
        return {"transfer_mode": mode, "lengths": out}


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.model:
        model = args.model
    else:
        from launch.tiny_model import make_tiny_model

        model = str(make_tiny_model(DEFAULT_MODEL_DIR, **REFERENCE_SHAPE))
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="pd-overhead-"))
    modes = ["request", "layer"] if args.transfer_mode == "both" else [args.transfer_mode]
    result = {
        "model": model,
        "p_cpus": args.p_cpus,
        "d_cpus": args.d_cpus,
        "log_dir": str(log_dir),
        "modes": [run_mode(mode, model, args, log_dir) for mode in modes],
    }
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
