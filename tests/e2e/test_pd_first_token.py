"""The Router's first-token path on the session stack (real vLLM P and D, PDConnector, Mooncake TCP).

Streamed ``/v1/completions`` get P's own first token, then D's continuation (P's prompt ids plus
that token, ``prefilled_tokens``). Token identity with colocated vLLM is checked for every test
prompt by ``test_pd_equivalence.py`` (its streamed half takes this path); here: who answered
(the Router's ``first=`` log field), the usage figures, and a one-token request, answered by P
alone, whose KV P frees at once through the Router's release request.
"""

from __future__ import annotations

import json
import random
import re
import time
import uuid
from pathlib import Path
from typing import Any

import httpx
import pytest
from tokenizers import Tokenizer

from tests.support.serving import P_ROOM_TIMEOUT_S, kv_usage, prompt_of_length, wait_kv_free

pytestmark = pytest.mark.e2e


def _post(url: str, body: dict[str, Any], rid: str) -> tuple[list[dict[str, Any]], dict[str, Any] | None]:
    """(the stream's events, or [], the JSON answer, or None)."""
    with httpx.Client(timeout=120, trust_env=False) as client:
        response = client.post(f"{url}/v1/completions", json=body, headers={"X-Request-Id": rid})
    assert response.status_code == 200, response.text[:500]
    if not body.get("stream"):
        return [], response.json()
    events = [line[len("data: ") :] for line in response.text.split("\n\n") if line.startswith("data: ")]
    assert events[-1] == "[DONE]", events[-3:]
    return [json.loads(e) for e in events[:-1]], None


def _router_line(pd_stack: Any, rid: str) -> str:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        for line in pd_stack.router.log_path.read_text(errors="replace").splitlines():
            if f"rid={rid} " in line and " status=" in line:
                return line
        time.sleep(0.1)
    raise AssertionError(f"no Router log line for {rid}")


def test_streamed_answer_starts_with_p_token_and_counts_usage_like_one_instance(pd_stack: Any) -> None:
    model, url = pd_stack.model, pd_stack.router_url
    prompt = prompt_of_length(70, salt=11)
    base = {"model": model, "prompt": prompt, "max_tokens": 9, "temperature": 0, "ignore_eos": True}
    rid = f"first-{uuid.uuid4().hex[:8]}"
    events, _ = _post(url, {**base, "stream": True, "stream_options": {"include_usage": True}}, rid)
    assert re.search(r"first=P\b", _router_line(pd_stack, rid)), "the first token did not come from P"
    rid_plain = f"plain-{uuid.uuid4().hex[:8]}"
    _, answer = _post(url, base, rid_plain)
    assert answer is not None
    assert re.search(r"first=D\b", _router_line(pd_stack, rid_plain))  # unstreamed: the two-instance path
    text = "".join(c["text"] for e in events for c in e.get("choices", []))
    assert text == answer["choices"][0]["text"]
    keys = ("prompt_tokens", "completion_tokens", "total_tokens")
    usage = {k: events[-1]["usage"][k] for k in keys}
    assert usage == {k: answer["usage"][k] for k in keys}, (usage, answer["usage"])  # token 1: generated
    assert usage["completion_tokens"] == 9


def test_token_one_without_text_streams_the_same_text_as_the_two_instance_path(pd_stack: Any) -> None:
    """A token 1 that is the first bytes of a character (frequent with the tiny byte-level model):
    P's empty chunk first, then D's answer to the client's request (``first=P-empty``); the text
    matches the unstreamed two-instance answer (itself checked against colocated vLLM)."""
    model, url = pd_stack.model, pd_stack.router_url
    paths = []
    for salt in range(21, 29):
        base = {"model": model, "prompt": prompt_of_length(80, salt=salt), "max_tokens": 6, "temperature": 0}
        rid = f"empty-{uuid.uuid4().hex[:8]}"
        events, _ = _post(url, {**base, "stream": True, "stream_options": {"include_usage": True}}, rid)
        line = _router_line(pd_stack, rid)
        paths.append(re.search(r"first=(\S+)", line).group(1))  # type: ignore[union-attr]
        _, answer = _post(url, base, f"plain-{uuid.uuid4().hex[:8]}")
        assert answer is not None
        text = "".join(c["text"] for e in events for c in e.get("choices", []))
        assert text == answer["choices"][0]["text"], (salt, paths[-1])
        assert events[-1]["usage"]["completion_tokens"] == answer["usage"]["completion_tokens"]
        choices = [c for e in events for c in e.get("choices", [])]
        assert len(choices) == answer["usage"]["completion_tokens"], choices  # one chunk a token: none twice
    assert "P-empty" in paths, paths


def test_random_byte_prompts_stream_the_same_text_as_the_two_instance_path(pd_stack: Any) -> None:
    """Prompts of random byte tokens that end inside a character (as the serving benchmark's are):
    vLLM may then re-emit the prompt's bytes with token 1 (U+FFFD inside its text, continued on D)
    or hold token 1 back (``P-empty``); either way the streamed text is the two-instance answer's."""
    model, url = pd_stack.model, pd_stack.router_url
    tokenizer = Tokenizer.from_file(str(Path(model) / "tokenizer.json"))
    rng = random.Random(5)
    prompts: list[list[int]] = []
    while len(prompts) < 8:
        prompt = [rng.randrange(3, 259) for _ in range(60)]
        if tokenizer.decode(prompt).endswith("\ufffd"):
            prompts.append(prompt)
    seen = []
    for prompt in prompts:
        base = {"model": model, "prompt": prompt, "max_tokens": 5, "temperature": 0}
        rid = f"bytes-{uuid.uuid4().hex[:8]}"
        events, _ = _post(url, {**base, "stream": True}, rid)
        _, answer = _post(url, base, f"plain-{uuid.uuid4().hex[:8]}")
        assert answer is not None
        chunks = [c["text"] for e in events for c in e.get("choices", [])]
        first = re.search(r"first=(\S+)", _router_line(pd_stack, rid)).group(1)  # type: ignore[union-attr]
        seen.append((first, "\ufffd" in chunks[0]))
        assert "".join(chunks) == answer["choices"][0]["text"], seen[-1]
        assert len(chunks) == answer["usage"]["completion_tokens"], (seen[-1], chunks)
    assert all(path in ("P", "P-empty") for path, _ in seen), seen


def test_one_token_request_is_p_alone_and_frees_p_kv(pd_stack: Any) -> None:
    model, url = pd_stack.model, pd_stack.router_url
    assert wait_kv_free(pd_stack.prefill_url) == 0.0
    body = {"model": model, "prompt": prompt_of_length(90, salt=12), "max_tokens": 1, "temperature": 0, "stream": True}
    rid = f"one-{uuid.uuid4().hex[:8]}"
    events, _ = _post(url, body, rid)
    assert [c["finish_reason"] for e in events for c in e["choices"]] == ["length"]
    assert re.search(r"first=P\b", _router_line(pd_stack, rid))
    t0 = time.monotonic()
    usage = wait_kv_free(pd_stack.prefill_url, timeout=P_ROOM_TIMEOUT_S / 2)
    freed = time.monotonic() - t0
    assert usage == 0.0, f"P still holds KV {freed:.1f} s after the answer: {kv_usage(pd_stack.prefill_url)}"
    assert freed < P_ROOM_TIMEOUT_S / 2  # released by the Router's one-token D request, not expired
    assert wait_kv_free(pd_stack.decode_url) == 0.0
