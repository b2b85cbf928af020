"""The Router in front of real P and D (the session's P/D stack), driven by the ``openai`` client.

Streaming and not, completions and chat: answers arrive whole, usage fields are intact, the
streamed text equals the non-streamed one (greedy), ``X-Request-Id`` comes back, backend 4xx
errors reach the client as such, the Router's metrics count the requests, and no KV is left
held on P or D afterwards.
"""

from __future__ import annotations

import time
import uuid

import httpx
import openai
import pytest

from tests.support.serving import P_ROOM_TIMEOUT_S, prompt_of_length, wait_kv_free

pytestmark = pytest.mark.e2e

MAX_TOKENS = 16


@pytest.fixture(scope="module")
def client(pd_stack) -> openai.OpenAI:
    http = httpx.Client(trust_env=False, timeout=120)
    yield openai.OpenAI(base_url=f"{pd_stack.router_url}/v1", api_key="unused", max_retries=0, http_client=http)
    http.close()


def _metric(url: str, name: str, **labels: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{url}/metrics", timeout=10, trust_env=False).text
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items())
    )


def _wait_metric(url: str, name: str, expected: float, timeout: float = 10.0, **labels: str) -> float:
    """The metric's value once it reaches ``expected`` (the Router records a stream after its last byte)."""
    deadline = time.monotonic() + timeout
    value = _metric(url, name, **labels)
    while value < expected and time.monotonic() < deadline:
        time.sleep(0.05)
        value = _metric(url, name, **labels)
    return value


def test_models_come_from_a_decoder(client: openai.OpenAI, pd_stack) -> None:
    assert [m.id for m in client.models.list().data] == [pd_stack.model]


def test_completions_streaming_and_not(client: openai.OpenAI, pd_stack) -> None:
    prompt = prompt_of_length(70, salt=3)
    rid = f"e2e-{uuid.uuid4().hex[:8]}"
    raw = client.completions.with_raw_response.create(
        model=pd_stack.model,
        prompt=prompt,
        max_tokens=MAX_TOKENS,
        temperature=0,
        extra_body={"ignore_eos": True},
        extra_headers={"X-Request-Id": rid},
    )
    assert raw.headers["x-request-id"] == rid
    whole = raw.parse()
    text = whole.choices[0].text
    assert text and whole.choices[0].finish_reason == "length"
    usage = whole.usage
    assert usage.completion_tokens == MAX_TOKENS
    assert usage.prompt_tokens >= len(prompt)
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens

    stream = client.completions.create(
        model=pd_stack.model,
        prompt=prompt,
        max_tokens=MAX_TOKENS,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    chunks = list(stream)
    streamed = "".join(c.choices[0].text for c in chunks if c.choices)
    assert streamed == text
    assert chunks[-1].usage is not None
    assert _counts(chunks[-1].usage) == _counts(usage)


def _counts(usage: object) -> dict:
    """A usage's token counts (``pd_kv``, the request's own KV account, differs between two calls)."""
    dumped = usage.model_dump()  # type: ignore[attr-defined]
    return {k: v for k, v in dumped.items() if k != "pd_kv"}


def test_chat_streaming_and_not(client: openai.OpenAI, pd_stack) -> None:
    messages = [{"role": "user", "content": prompt_of_length(90, salt=5)}]
    whole = client.chat.completions.create(
        model=pd_stack.model, messages=messages, max_tokens=MAX_TOKENS, temperature=0, extra_body={"ignore_eos": True}
    )
    text = whole.choices[0].message.content
    assert text and whole.usage.completion_tokens == MAX_TOKENS
    stream = client.chat.completions.create(
        model=pd_stack.model,
        messages=messages,
        max_tokens=MAX_TOKENS,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert _counts(chunks[-1].usage) == _counts(whole.usage)
    # The second call found the first one's prompt in D's prefix cache: its KV account says so.
    kv = chunks[-1].usage.model_dump()["pd_kv"]
    assert kv["pushed_tokens"] + kv["prefix_hit_tokens"] + kv["recomputed_tokens"] == whole.usage.prompt_tokens


def test_backend_400_reaches_the_client(client: openai.OpenAI, pd_stack) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=pd_stack.model, prompt="hello", max_tokens=-5)
    assert info.value.status_code == 400
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=pd_stack.model, prompt="hello", max_tokens="five")  # type: ignore[arg-type]
    assert info.value.response.json()["error"]["param"] == "max_tokens"
    # The Router keeps serving.
    assert client.completions.create(model=pd_stack.model, prompt="again", max_tokens=2).choices[0].text is not None


def test_metrics_count_requests_and_no_kv_is_left(client: openai.OpenAI, pd_stack) -> None:
    url = pd_stack.router_url
    before = _metric(url, "pd_router_requests_total", endpoint="/v1/chat/completions", status="200")
    ttfb_before = _metric(url, "pd_router_time_to_first_byte_seconds_count", endpoint="/v1/chat/completions")
    for stream in (False, True):
        response = client.chat.completions.create(
            model=pd_stack.model, messages=[{"role": "user", "content": "hi"}], max_tokens=4, stream=stream
        )
        if stream:
            list(response)
    total = _wait_metric(url, "pd_router_requests_total", before + 2, endpoint="/v1/chat/completions", status="200")
    assert total == before + 2
    ttfb = _wait_metric(
        url, "pd_router_time_to_first_byte_seconds_count", ttfb_before + 2, endpoint="/v1/chat/completions"
    )
    assert ttfb == ttfb_before + 2
    assert (
        _metric(
            url, "pd_router_backend_requests_total", role="prefill", backend=f"{pd_stack.host}:{pd_stack.prefill_port}"
        )
        >= 2
    )
    assert _metric(url, "pd_router_backend_healthy", role="decode") == 1
    assert wait_kv_free(pd_stack.decode_url) == 0.0
    assert wait_kv_free(pd_stack.prefill_url, timeout=P_ROOM_TIMEOUT_S + 30) == 0.0
