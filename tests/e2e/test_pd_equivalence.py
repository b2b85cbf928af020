"""P + D + Router give token-identical greedy outputs to one colocated vLLM, and free all KV.

Real processes only: a colocated `vllm serve` (reference, stopped before the P/D
stack starts, so the two never compete for this machine's two cores), then P and
D `vllm serve` with PDConnector, the bootstrap server in P, Mooncake TCP, and the
Router.
"""

from __future__ import annotations

import httpx
import pytest

from tests.support.serving import (
    CHAT_PROMPTS,
    PROMPT_LENGTHS,
    chat,
    complete,
    count_in_log,
    kv_usage,
    prompts,
    wait_kv_free,
)

pytestmark = [pytest.mark.e2e, pytest.mark.both_lines]


#: D's log line for a continuation whose prefilled tokens are all in D's prefix cache.
CACHED_ON_D = r"prefilled tokens are in D's prefix cache"


@pytest.mark.parametrize("stream", [False, True], ids=["nonstream", "stream"])
def test_equivalence_completions(reference: dict, pd_stack, stream: bool) -> None:
    model = pd_stack.model
    pushed_before = count_in_log(pd_stack.prefill.log_path, r"pushed \d+ blocks")
    cached_before = count_in_log(pd_stack.decode.log_path, CACHED_ON_D)
    mismatches = []
    for i, prompt in enumerate(prompts()):
        got = complete(pd_stack.router_url, model, prompt, stream=stream)
        want = reference["completions"][stream][i]
        assert len(got["token_ids"]) > 0
        if got["token_ids"] != want["token_ids"] or got["text"] != want["text"]:
            mismatches.append((PROMPT_LENGTHS[i], want["token_ids"], got["token_ids"]))
    assert not mismatches, (
        f"PD output differs from colocated for prompt lengths {[m[0] for m in mismatches]}: {mismatches}"
    )
    # Every request went Router -> P -> KV push -> D, but for a streamed one (the first-token path)
    # whose prefilled tokens D's own prefix cache already held (block-aligned prompts, cached by the
    # unstreamed run): D then only tells P to free the room.
    pushed = count_in_log(pd_stack.prefill.log_path, r"pushed \d+ blocks") - pushed_before
    cached = count_in_log(pd_stack.decode.log_path, CACHED_ON_D) - cached_before
    assert pushed + cached >= len(PROMPT_LENGTHS), (
        f"only {pushed} KV pushes logged by P ({cached} prompts in D's cache) for {len(PROMPT_LENGTHS)} requests"
    )


@pytest.mark.parametrize("stream", [False, True], ids=["nonstream", "stream"])
def test_equivalence_chat(reference: dict, pd_stack, stream: bool) -> None:
    for i, content in enumerate(CHAT_PROMPTS):
        assert chat(pd_stack.router_url, pd_stack.model, content, stream=stream) == reference["chat"][stream][i]


def test_equivalence_no_kv_left(reference: dict, pd_stack) -> None:
    """After the equivalence runs neither P nor D holds a KV block (vLLM's own gauge)."""
    complete(pd_stack.router_url, pd_stack.model, prompts()[-1], stream=False)
    assert wait_kv_free(pd_stack.prefill_url) == 0.0, f"P still holds KV: {kv_usage(pd_stack.prefill_url)}"
    assert wait_kv_free(pd_stack.decode_url) == 0.0, f"D still holds KV: {kv_usage(pd_stack.decode_url)}"


def test_detokenize_marks_a_character_cut_short(pd_stack) -> None:
    """What the Router's resume asks of vLLM (proxy/request/held_tail.py): ``/detokenize`` of ids ending
    inside a character ends in U+FFFD; with the character's last byte it is the character."""
    url, model = pd_stack.decode_url, pd_stack.model
    answer = httpx.post(
        f"{url}/tokenize",
        json={"model": model, "prompt": "中", "add_special_tokens": False},
        timeout=30,
        trust_env=False,
    )
    assert answer.status_code == 200, answer.text
    ids = answer.json()["tokens"]
    assert len(ids) > 1, ids  # a byte-level tokenizer: the character spans several ids

    def text(tokens: list[int]) -> str:
        reply = httpx.post(f"{url}/detokenize", json={"model": model, "tokens": tokens}, timeout=30, trust_env=False)
        assert reply.status_code == 200, reply.text
        return reply.json()["prompt"]

    assert text(ids[:-1]).endswith("\ufffd")
    assert text(ids) == "中"
