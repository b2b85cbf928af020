"""Resuming a streamed chat completion (proxy/strategies/resume_chat.py), seeded sampling, and the reasons a
cut stream is not resumed, with real Router and fake backend processes, and the chat tracker's rules as
pure code.

The fake ``die_mid_stream`` decoder sends tok0..tok2 (chat chunks on /v1/chat/completions, with the
prompt's ids at the top of its first chunk and each chunk's ``token_ids`` when asked
``return_token_ids``, as vLLM) and drops the connection; ``resume_d`` continues a prompt ending in
the fake's own generated ids (1000 + i) at the next token, up to tok7.
"""

from __future__ import annotations

import json
from typing import Any

from proxy.request.attempt import Call
from proxy.strategies.resume_body import (
    StreamTracker,
    reseed,
    resumable,
    resume_call,
    resume_ineligible_reason,
    why_not_resumed,
)
from tests.support.fake_backend import MAX_MODEL_LEN
from tests.support.router_rig import (
    Backends,
    Router,
    RouterFactory,
    http_client,
    new_rid,
    records,
    request_body,
    sse_events,
)

CHAT = "/v1/chat/completions"
OFF = "--no-first-token-from-prefill"
TOKENS = [f"tok{i} " for i in range(8)]
HI = [ord("H"), ord("i")]  # the fake's ids of the chat prompt "Hi"


def _post(router: Router, path: str, rid: str, body: dict[str, Any]) -> list[str]:
    body = {"bootstrap_room": 0, **body}  # room 0: the first decoder (the one that dies)
    with http_client() as client:
        response = client.post(f"{router.url}{path}", json=body, headers={"X-Request-Id": rid})
    assert response.status_code == 200
    return sse_events(response.content)


def _chat(router: Router, rid: str, **extra: Any) -> list[dict[str, Any]]:
    events = _post(router, CHAT, rid, request_body(CHAT, stream=True, **extra))
    assert events[-1] == "[DONE]" and events.count("[DONE]") == 1, events[-3:]
    return [json.loads(e) for e in events[:-1]]


def _content(chunks: list[dict[str, Any]]) -> str:
    return "".join(c["delta"].get("content") or "" for p in chunks for c in p["choices"])


def test_cut_chat_stream_goes_on_as_chat_chunks(backends: Backends, fresh_router: RouterFactory) -> None:
    router = fresh_router(backends.ok_p, (backends.die_mid_stream, backends.resume_d), OFF)
    rid = new_rid("resume-chat")
    chunks = _chat(router, rid, stream_options={"include_usage": True})
    assert not any("error" in p for p in chunks)
    assert _content(chunks) == "".join(TOKENS)
    assert {(p["id"], p["object"], p["model"]) for p in chunks} == {
        (f"cmpl-{rid}", "chat.completion.chunk", "fake-model")
    }
    roles = [c["delta"].get("role") for p in chunks for c in p["choices"]]
    assert roles[0] == "assistant" and not any(roles[1:])  # the role once: the first leg's
    finishes = [c["finish_reason"] for p in chunks for c in p["choices"] if c["finish_reason"]]
    assert finishes == ["length"]
    assert chunks[-1]["choices"] == []
    assert chunks[-1]["usage"] == {"prompt_tokens": 2, "completion_tokens": 8, "total_tokens": 10}
    for payload in chunks:  # the Router's token ids never reach a client that did not ask
        assert payload.get("prompt_token_ids") is None
        assert all(c.get("token_ids") is None for c in payload["choices"])
    (first,) = records(backends.die_mid_stream, rid)
    assert first["path"] == CHAT and first["body"]["return_token_ids"] is True
    (resumed,) = records(backends.resume_d, rid)
    assert resumed["path"] == "/v1/completions"
    body = resumed["body"]
    assert body["prompt"] == [*HI, 1000, 1001, 1002] and body["max_tokens"] == 5 and body["stream"] is True
    assert "messages" not in body and body["stream_options"] == {"include_usage": True}
    log = router.proc.log_text()
    assert f"rid={rid} " in log and "resumed on" in log


def test_chat_without_a_budget_gets_the_context_left(backends: Backends, fresh_router: RouterFactory) -> None:
    router = fresh_router(backends.ok_p, (backends.die_mid_stream, backends.resume_d), OFF)
    rid = new_rid("resume-chat-len")
    body = {"model": "fake-model", "messages": [{"role": "user", "content": "Hi"}], "stream": True}
    events = _post(router, CHAT, rid, body)
    assert events[-1] == "[DONE]"
    assert _content([json.loads(e) for e in events[:-1]]) == "".join(TOKENS)
    (resumed,) = records(backends.resume_d, rid)
    assert resumed["body"]["max_tokens"] == MAX_MODEL_LEN - 5  # /v1/models' max_model_len less the leg's prompt


def test_chat_client_asking_token_ids_gets_them_once(backends: Backends, fresh_router: RouterFactory) -> None:
    router = fresh_router(backends.ok_p, (backends.die_mid_stream, backends.resume_d), OFF)
    chunks = _chat(router, new_rid("resume-chat-ids"), return_token_ids=True)
    ids = [t for p in chunks for c in p["choices"] for t in c.get("token_ids") or ()]
    assert ids == [1000 + i for i in range(8)]
    assert [p["prompt_token_ids"] for p in chunks if p.get("prompt_token_ids")] == [HI]


def test_chat_with_tools_is_not_resumed_and_says_why(backends: Backends, fresh_router: RouterFactory) -> None:
    router = fresh_router(backends.ok_p, (backends.die_mid_stream,), OFF)
    rid = new_rid("resume-chat-tools")
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    events = _post(router, CHAT, rid, request_body(CHAT, stream=True, tools=[tool]))
    assert "[DONE]" not in events and json.loads(events[-1])["error"]["type"] == "decode_failed"
    assert len(records(backends.die_mid_stream, rid)) == 1
    lines = [x for x in router.proc.log_text().splitlines() if f"rid={rid} " in x and "not resumable" in x]
    assert lines and lines[0].endswith("stream cut, not resumable: tools"), lines


def test_n_and_logprobs_streams_are_not_resumed_and_say_why(backends: Backends, fresh_router: RouterFactory) -> None:
    router = fresh_router(backends.ok_p, (backends.die_mid_stream,), OFF)
    for extra, reason in (({"n": 2}, "n > 1"), ({"logprobs": 1}, "logprobs")):
        rid = new_rid("resume-why")
        events = _post(router, "/v1/completions", rid, request_body("/v1/completions", stream=True, **extra))
        assert "[DONE]" not in events and "error" in json.loads(events[-1])
        assert len(records(backends.die_mid_stream, rid)) == 1
        lines = [x for x in router.proc.log_text().splitlines() if f"rid={rid} " in x and "not resumable" in x]
        assert lines and lines[0].endswith(f"stream cut, not resumable: {reason}"), lines


def test_seeded_sampled_stream_resumes_with_a_seed_of_its_own(backends: Backends, fresh_router: RouterFactory) -> None:
    router = fresh_router(backends.ok_p, (backends.die_mid_stream, backends.resume_d), OFF)
    rid = new_rid("resume-seed")
    body = request_body("/v1/completions", stream=True, seed=7, temperature=0.8)
    events = _post(router, "/v1/completions", rid, body)
    assert events[-1] == "[DONE]"
    (resumed,) = records(backends.resume_d, rid)
    assert resumed["body"]["seed"] == reseed(7, 3) != 7
    assert resumed["body"]["temperature"] == 0.8


# --- pure rules -------------------------------------------------------------------------------


def _call(**body: Any) -> Call:
    base = {"model": "m", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 10, "stream": True}
    return Call(CHAT, "r", {**base, **body}, True, 2, {})


def _ev(payload: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(payload, separators=(",", ":"), ensure_ascii=False).encode() + b"\n\n"


def _chunk(delta: dict[str, Any], ids: list[int] | None, finish: str | None = None) -> bytes:
    """A chunk as vLLM's chat stream writes it with ``return_token_ids``."""
    choice: dict[str, Any] = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
    if ids is not None:
        choice["token_ids"] = ids
    return _ev({"id": "chatcmpl-a", "object": "chat.completion.chunk", "created": 5, "model": "m", "choices": [choice]})


ROLE = _ev(
    {
        "id": "chatcmpl-a",
        "object": "chat.completion.chunk",
        "created": 5,
        "model": "m",
        "choices": [
            {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
        ],
        "prompt_token_ids": [1, 2, 3],
    }
)


def test_chat_tracker_reads_vllm_chunks_and_builds_a_completions_leg() -> None:
    tracker = StreamTracker(_call(seed=3, temperature=0.5, top_k=4, tools=None, stream_options={"include_usage": True}))
    out = tracker.feed(
        ROLE + _chunk({"content": "a"}, [7]) + _chunk({"content": "é"}, [8]) + _chunk({"content": ""}, [9])
    )
    assert tracker.chat and not tracker.reshape
    assert tracker.prompt_ids == [1, 2, 3] and tracker.generated == [7, 8, 9] and tracker.committed == 2
    events = [json.loads(e) for e in sse_events(out)]
    assert events[0]["prompt_token_ids"] is None and events[0]["choices"][0]["delta"]["role"] == "assistant"
    assert [c.get("token_ids") for e in events[1:] for c in e["choices"]] == [None, None, None]
    call = resume_call(tracker)
    assert call is not None and call.endpoint == "/v1/completions" and call.replayed == 2
    assert call.body == {
        "model": "m",
        "stream": True,
        "stream_options": {"include_usage": True},
        "temperature": 0.5,
        "top_k": 4,
        "seed": reseed(3, 2),
        "prompt": [1, 2, 3, 7, 8],
        "max_tokens": 8,
    }


def test_completions_leg_reads_as_chat_chunks() -> None:
    first = StreamTracker(_call(stream_options={"include_usage": True}))
    first.feed(ROLE + _chunk({"content": "a"}, [7]))
    call = resume_call(first)
    assert call is not None
    leg = StreamTracker(call, identity=first.identity, chat=first.chat, seed=first.seed)
    assert leg.reshape
    text = {"index": 0, "text": "b", "logprobs": None, "finish_reason": None, "stop_reason": None}
    usage = {"prompt_tokens": 4, "completion_tokens": 2, "total_tokens": 6}
    out = leg.feed(
        _ev(
            {
                "id": "cmpl-x",
                "object": "text_completion",
                "created": 9,
                "model": "m",
                "choices": [{**text, "prompt_token_ids": [1, 2, 3, 7], "token_ids": [8]}],
            }
        )
        + _ev(
            {
                "id": "cmpl-x",
                "object": "text_completion",
                "created": 9,
                "model": "m",
                "choices": [{**text, "text": "", "finish_reason": "length", "token_ids": []}],
            }
        )
        + _ev({"id": "cmpl-x", "object": "text_completion", "created": 9, "model": "m", "choices": [], "usage": usage})
    )
    events = [json.loads(e) for e in sse_events(out)]
    assert {(e["id"], e["object"], e["created"]) for e in events} == {("chatcmpl-a", "chat.completion.chunk", 5)}
    assert events[0]["choices"] == [
        {"index": 0, "delta": {"content": "b"}, "logprobs": None, "finish_reason": None, "token_ids": None}
    ]
    assert events[1]["choices"][0]["finish_reason"] == "length" and "stop_reason" in events[1]["choices"][0]
    assert events[2]["choices"] == [] and events[2]["usage"] == {
        "prompt_tokens": 3,
        "completion_tokens": 3,
        "total_tokens": 6,
    }
    assert leg.finished and leg.committed == 1


def test_parser_output_stops_resume() -> None:
    for delta, reason in (
        ({"reasoning": "hm"}, "reasoning parser"),
        ({"tool_calls": [{"index": 0}]}, "tool calls"),
        ({}, "a parser held a chunk's text"),
    ):
        tracker = StreamTracker(_call())
        tracker.feed(ROLE + _chunk({"content": "a"}, [7]) + _chunk(delta, [8]))
        assert resume_call(tracker) is None and why_not_resumed(tracker) == reason
    hidden = StreamTracker(_call())
    hidden.feed(ROLE + _chunk({"content": "a"}, None))
    assert resume_call(hidden) is None and "no token ids" in why_not_resumed(hidden)


def test_finished_chat_stream_is_closed_as_chat() -> None:
    tracker = StreamTracker(_call(stream_options={"include_usage": True}))
    tracker.feed(ROLE + _chunk({"content": "a"}, [7]) + _chunk({}, [], finish="stop"))
    assert tracker.finished
    closing = json.loads(sse_events(tracker.closing_events())[0])
    assert closing["object"] == "chat.completion.chunk" and closing["id"] == "chatcmpl-a"
    assert closing["usage"] == {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}


def test_which_chat_streams_are_resumable() -> None:
    assert resumable(_call(), 2) and resumable(_call(seed=1, temperature=1.0), 2)
    tool = {"type": "function", "function": {"name": "f"}}
    for body, reason in (
        ({"tools": [tool]}, "tools"),
        ({"n": 2}, "n > 1"),
        ({"logprobs": True}, "logprobs"),
        ({"stop": ["x"]}, "stop strings"),
        ({"response_format": {"type": "json_object"}}, "response_format"),
        ({"max_completion_tokens": 0}, "max_completion_tokens < 1"),
    ):
        assert resume_ineligible_reason(CHAT, {**_call().body, **body}) == reason
        assert not resumable(_call(**body), 2)
    assert resume_ineligible_reason("/v1/completions", {"prompt": "x", "stream": True, "seed": 1}) is None
    assert resume_ineligible_reason("/v1/embeddings", {"stream": True}) == "not /v1/completions or /v1/chat/completions"


def test_chat_budget_prefers_max_completion_tokens() -> None:
    tracker = StreamTracker(_call(max_completion_tokens=6, max_tokens=100))
    tracker.feed(ROLE + _chunk({"content": "a"}, [7]))
    call = resume_call(tracker)
    assert call is not None and call.body["max_tokens"] == 5
    unbounded = StreamTracker(Call(CHAT, "r", {"messages": [], "stream": True}, True, 2, {}))
    unbounded.feed(ROLE + _chunk({"content": "a"}, [7]))
    call = resume_call(unbounded)
    assert call is not None and call.body["max_tokens"] is None  # resume_stream reads max_model_len
