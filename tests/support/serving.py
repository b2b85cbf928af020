"""Shared helpers of the end-to-end tests: prompts, OpenAI calls, KV usage checks."""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import httpx

from launch.processes import LOOPBACK, ManagedProcess, ProcessGroup, router_cmd, wait_all_healthy
from launch.sse import sse_lines
from pd_connector.transfer.mooncake import CALL_TIMEOUT_ENV, CALL_TIMEOUT_FLOOR_S, TCP_PROGRESS_ENV, stall_for

#: Seconds a vLLM instance may take to answer /health (each start-up costs about a minute here).
START_TIMEOUT_S = 300.0
#: Short connector timeouts of the session's P/D stack (tests/e2e/conftest.py), so failure tests finish quickly.
#: P: how long a finished prefill keeps its KV blocks for a D that never asks for them.
P_ROOM_TIMEOUT_S = 20.0
#: D: how long a request waits for its KV from P before the load counts as failed.
D_KV_WAIT_TIMEOUT_S = 15.0
#: Environment of the P instances a test freezes or kills (and of their D): Mooncake's shortest bound on
#: one batch write (MC_TRANSFER_TIMEOUT at its floor; the TCP progress timeout no longer). A P rank
#: advertises the bound when it registers, and D holds a lost P rank's loads for
#: ``pd_connector.transfer.loads.lost_wait_s`` of it (67 s with the defaults), so failover gets shorter.
FAST_TRANSFER_ENV = {CALL_TIMEOUT_ENV: str(CALL_TIMEOUT_FLOOR_S), TCP_PROGRESS_ENV: str(CALL_TIMEOUT_FLOOR_S)}
#: ``batch_stall_s`` of a Mooncake TCP rank started with FAST_TRANSFER_ENV.
FAST_BATCH_STALL_S = stall_for("tcp", FAST_TRANSFER_ENV)

BLOCK_SIZE = 32  # launch.processes serves with --block-size 32
# Prompt lengths in tokens (the tiny model's tokenizer is byte-level: one ASCII char = one token),
# from 1 token to more than 4 KV blocks, around every block boundary.
PROMPT_LENGTHS = [1, 2, 3, 5, 8, 13, 21, 31, 32, 33, 47, 63, 64, 65, 96, 127, 128, 129, 160, 200, 257, 300]
TEXT = (
    "Prefill and decode run on separate vLLM instances; the KV cache moves from P to D over "
    "Mooncake so that each side can use the parallel layout that suits it best. "
)
MAX_TOKENS = 12
CHAT_PROMPTS = ["Hi", "Tell me about prefill/decode disaggregation in one long sentence, please."]


def prompt_of_length(n: int, salt: int = 0) -> str:
    text = (TEXT * (n // len(TEXT) + 2))[salt : salt + n]
    assert len(text) == n
    return text


def prompts() -> list[str]:
    return [prompt_of_length(n, salt=i) for i, n in enumerate(PROMPT_LENGTHS)]


def complete(url: str, model: str, prompt: str, *, stream: bool, max_tokens: int = MAX_TOKENS, **extra) -> dict:
    """One greedy /v1/completions call; returns {"text", "token_ids", "finish_reason"}."""
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "return_token_ids": True,
        "stream": stream,
        **extra,
    }
    with httpx.Client(timeout=120, trust_env=False) as client:
        if not stream:
            resp = client.post(f"{url}/v1/completions", json=body)
            assert resp.status_code == 200, f"HTTP {resp.status_code}: {resp.text[:500]}"
            choice = resp.json()["choices"][0]
            return {"text": choice["text"], "token_ids": choice["token_ids"], "finish_reason": choice["finish_reason"]}
        text, token_ids, finish = [], [], None
        with client.stream("POST", f"{url}/v1/completions", json=body) as resp:
            assert resp.status_code == 200, f"HTTP {resp.status_code}: {resp.read()[:500]!r}"
            done = False
            for line in sse_lines(resp):
                if not line.startswith("data: "):
                    continue
                data = line[len("data: ") :]
                if data == "[DONE]":
                    done = True
                    break
                chunk = json.loads(data)
                assert "error" not in chunk, chunk
                for choice in chunk.get("choices", []):
                    text.append(choice.get("text") or "")
                    token_ids.extend(choice.get("token_ids") or [])
                    finish = choice.get("finish_reason") or finish
            assert done, "stream ended without [DONE]"
        return {"text": "".join(text), "token_ids": token_ids, "finish_reason": finish}


def chat(url: str, model: str, content: str, *, stream: bool, max_tokens: int = MAX_TOKENS) -> str:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": stream,
    }
    with httpx.Client(timeout=120, trust_env=False) as client:
        if not stream:
            resp = client.post(f"{url}/v1/chat/completions", json=body)
            assert resp.status_code == 200, f"HTTP {resp.status_code}: {resp.text[:500]}"
            return resp.json()["choices"][0]["message"]["content"]
        parts = []
        with client.stream("POST", f"{url}/v1/chat/completions", json=body) as resp:
            assert resp.status_code == 200, f"HTTP {resp.status_code}: {resp.read()[:500]!r}"
            for line in sse_lines(resp):
                if line.startswith("data: ") and line != "data: [DONE]":
                    for choice in json.loads(line[6:]).get("choices", []):
                        parts.append(choice.get("delta", {}).get("content") or "")
        return "".join(parts)


_USAGE = re.compile(r"^vllm:kv_cache_usage_perc\{[^}]*\}\s+([0-9.eE+-]+)$", re.M)


def kv_usage(url: str) -> float:
    """vLLM's own KV cache usage gauge (0.0 = no block held by any request)."""
    text = httpx.get(f"{url}/metrics", timeout=10, trust_env=False).text
    values = [float(v) for v in _USAGE.findall(text)]
    assert values, "vllm:kv_cache_usage_perc not found in /metrics"
    return max(values)


def wait_kv_free(url: str, timeout: float = 30.0) -> float:
    """Wait until the server holds no KV block; returns the last usage seen."""
    deadline = time.monotonic() + timeout
    usage = kv_usage(url)
    while usage > 0 and time.monotonic() < deadline:
        time.sleep(0.5)
        usage = kv_usage(url)
    return usage


def count_in_log(path: Path, pattern: str) -> int:
    return len(re.findall(pattern, Path(path).read_text(errors="replace")))


def assert_matches_reference(
    url: str,
    model: str,
    reference: dict,
    indices: list[int],
    what: str,
    room_of: Callable[[int, bool], int] | None = None,
) -> int:
    """Greedy completions of prompts ``indices`` via ``url``, streaming and not, must equal ``reference``'s.

    ``room_of(n, stream)`` gives the n-th prompt's ``bootstrap_room`` (none by default). Returns the
    number of requests made.
    """
    all_prompts = prompts()
    made = 0
    for n, i in enumerate(indices):
        for stream in (False, True):
            extra = {} if room_of is None else {"bootstrap_room": room_of(n, stream)}
            got = complete(url, model, all_prompts[i], stream=stream, **extra)
            want = reference["completions"][stream][i]
            assert got["token_ids"] == want["token_ids"], (
                f"{what}: prompt of {PROMPT_LENGTHS[i]} tokens, stream={stream}, {extra or 'random room'}"
            )
            made += 1
    return made


def start_router_when_healthy(
    group: ProcessGroup,
    router_port: int,
    prefill: list[tuple[str, int, int]],
    decode: list[tuple[str, int]],
    instances: list[tuple[str, ManagedProcess]],
    extra_args: Sequence[str] = (),
    name: str = "router",
) -> str:
    """Start a Router in front of ``prefill``/``decode``, wait until ``instances`` (health URL, process)
    and the Router answer, and return the Router's URL."""
    # The tests steer requests to P ranks with client rooms.
    router = group.start(name, [*router_cmd(router_port, prefill, decode), "--trust-client-room", *extra_args])
    wait_all_healthy(instances, START_TIMEOUT_S, watch=[router])
    url = f"http://{LOOPBACK}:{router_port}"
    wait_all_healthy([(f"{url}/health", router)], 60)
    return url


#: n of the seeded sampled completions compared with colocated vLLM (test_pd_rooms; the session reference).
SAMPLES = (2, 3)
SAMPLE_SEED = 1234
SAMPLE_PROMPT = prompt_of_length(75, salt=3)  # 3 KV blocks, the last one partial


def sampled(url: str, model: str, n: int) -> list[list[int]]:
    body = {
        "model": model,
        "prompt": SAMPLE_PROMPT,
        "max_tokens": 12,
        "temperature": 0.8,
        "seed": SAMPLE_SEED,
        "n": n,
        "return_token_ids": True,
        "ignore_eos": True,
    }
    resp = httpx.post(f"{url}/v1/completions", json=body, timeout=120, trust_env=False)
    assert resp.status_code == 200, resp.text
    choices = sorted(resp.json()["choices"], key=lambda c: c["index"])
    assert [c["index"] for c in choices] == list(range(n))
    return [c["token_ids"] for c in choices]
