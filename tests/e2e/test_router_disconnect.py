"""A client that goes away: the Router closes both backend requests, vLLM aborts them, no KV stays held.

Runs against the session's P/D stack (tests/e2e/conftest.py). The generations here are long
(``LONG_GENERATION`` tokens, ``ignore_eos``); that D's KV is freed while its counters show the
request neither finished (``vllm:request_success_total``) nor produced all its tokens
(``vllm:generation_tokens_total``) means vLLM aborted it.
"""

from __future__ import annotations

import time

import httpx
import pytest

from launch.sse import sse_lines
from tests.support.serving import P_ROOM_TIMEOUT_S, prompt_of_length, wait_kv_free

pytestmark = [pytest.mark.e2e, pytest.mark.both_lines]

#: Tokens: many seconds of decoding for the tiny model on this CPU. Prompt + this stay within the served
#: --max-model-len 2048: vLLM 0.23 refuses a request whose prompt plus max_tokens exceeds it (HTTP 400),
#: where vLLM 0.32 accepts it.
LONG_GENERATION = 800


def _counter(url: str, name: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{url}/metrics", timeout=10, trust_env=False).text
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == name
    )


def _decode_counters(url: str) -> tuple[float, float]:
    """(requests D finished, tokens D generated) so far."""
    return _counter(url, "vllm:request_success_total"), _counter(url, "vllm:generation_tokens_total")


def _assert_aborted(url: str, before: tuple[float, float]) -> None:
    finished, generated = _decode_counters(url)
    assert finished == before[0], "the request ran to its end instead of being aborted"
    assert generated - before[1] < LONG_GENERATION


def _router_count(url: str, status: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{url}/metrics", timeout=10, trust_env=False).text
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "pd_router_requests_total" and sample.labels.get("status") == status
    )


def _body(pd_stack, prompt_len: int, stream: bool) -> dict:
    return {
        "model": pd_stack.model,
        "prompt": prompt_of_length(prompt_len, salt=11),
        "max_tokens": LONG_GENERATION,
        "ignore_eos": True,
        "temperature": 0,
        "stream": stream,
    }


def test_disconnect_mid_stream_aborts_decode_and_frees_kv(pd_stack) -> None:
    before = _decode_counters(pd_stack.decode_url)
    gone_before = _router_count(pd_stack.router_url, "499")
    with httpx.Client(timeout=120, trust_env=False) as client:
        with client.stream("POST", f"{pd_stack.router_url}/v1/completions", json=_body(pd_stack, 100, True)) as resp:
            assert resp.status_code == 200
            events = 0
            for line in sse_lines(resp):
                if line.startswith("data: "):
                    events += 1
                if events >= 3:
                    break
    # Leaving the block closed the connection mid-stream.
    t0 = time.monotonic()
    assert wait_kv_free(pd_stack.decode_url, timeout=30) == 0.0
    assert time.monotonic() - t0 < 30
    _assert_aborted(pd_stack.decode_url, before)
    assert wait_kv_free(pd_stack.prefill_url, timeout=P_ROOM_TIMEOUT_S + 30) == 0.0
    assert _router_count(pd_stack.router_url, "499") == gone_before + 1


def test_disconnect_before_the_answer_aborts_both_and_frees_kv(pd_stack) -> None:
    """A non-streaming client gives up while its request is still being prefilled or decoded."""
    before = _decode_counters(pd_stack.decode_url)
    with httpx.Client(timeout=httpx.Timeout(120, read=1.0), trust_env=False) as client:
        with pytest.raises(httpx.ReadTimeout):
            client.post(f"{pd_stack.router_url}/v1/completions", json=_body(pd_stack, 1200, False))
    assert wait_kv_free(pd_stack.decode_url, timeout=30) == 0.0
    _assert_aborted(pd_stack.decode_url, before)
    assert wait_kv_free(pd_stack.prefill_url, timeout=P_ROOM_TIMEOUT_S + 30) == 0.0
    # Both still serve.
    with httpx.Client(timeout=120, trust_env=False) as client:
        body = {"model": pd_stack.model, "prompt": "still serving", "max_tokens": 4}
        assert client.post(f"{pd_stack.router_url}/v1/completions", json=body).status_code == 200
