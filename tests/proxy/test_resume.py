"""Resuming a stream its decoder cut after it started (proxy/strategies/resume.py), with real Router and fake
backend processes, and the stream tracker's rules (proxy/strategies/resume_body.py) as pure code.

The fake ``die_mid_stream`` decoder sends tok0..tok2 and drops the connection; ``resume_d`` continues
a prompt ending in the fake's own generated ids (1000 + i) at the next token, up to tok7.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from proxy.request.attempt import Call
from proxy.request.failure_policy import resume_refusal
from proxy.strategies.resume_body import StreamTracker, resumable, resume_call
from tests.support.metrics import metric
from tests.support.router_rig import (
    HOST,
    Backends,
    Router,
    RouterFactory,
    http_client,
    new_rid,
    records,
    request_body,
    sse_events,
    wait_until,
)

OFF = "--no-first-token-from-prefill"  # the rig's default too
ON = "--first-token-from-prefill"
TOKENS = [f"tok{i} " for i in range(8)]


def _stream(router: Router, rid: str, **extra: Any) -> list[str]:
    body = request_body("/v1/completions", stream=True, bootstrap_room=0, **extra)
    with http_client() as client:
        response = client.post(f"{router.url}/v1/completions", json=body, headers={"X-Request-Id": rid})
    assert response.status_code == 200
    return sse_events(response.content)


def _texts(events: list[str]) -> list[str]:
    return [c["text"] for e in events if e != "[DONE]" for c in json.loads(e).get("choices") or ()]


def test_cut_stream_resumes_on_the_other_decoder(backends: Backends, router_factory: RouterFactory) -> None:
    router = router_factory(backends.ok_p, (backends.die_mid_stream, backends.resume_d), OFF)
    before = metric(router.url, "pd_router_resumes_total")
    rid = new_rid("resume")
    events = _stream(router, rid, stream_options={"include_usage": True})
    assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
    assert not any("error" in json.loads(e) for e in events[:-1])
    assert "".join(_texts(events)) == "".join(TOKENS)
    payloads = [json.loads(e) for e in events[:-1]]
    assert {p["id"] for p in payloads} == {f"cmpl-{rid}"}
    assert payloads[-1]["usage"] == {"prompt_tokens": 2, "completion_tokens": 8, "total_tokens": 10}
    for payload in payloads:  # the Router's token ids never reach a client that did not ask
        for choice in payload["choices"]:
            assert choice.get("token_ids") is None and choice.get("prompt_token_ids") is None
    (resumed,) = records(backends.resume_d, rid)
    assert resumed["body"]["prompt"] == [ord("H"), ord("i"), 1000, 1001, 1002]
    assert resumed["body"]["max_tokens"] == 5 and resumed["body"]["return_token_ids"] is True
    assert metric(router.url, "pd_router_resumes_total") == before + 1
    assert metric(router.url, "pd_router_resume_replayed_tokens_total") >= 3
    log = router.proc.log_text()
    (line,) = [x for x in log.splitlines() if f"rid={rid} " in x and " status=200 " in x]
    assert f" moved={HOST}:{backends.die_mid_stream}>{HOST}:{backends.resume_d} " in line
    assert " d_cut +" in line and " resumed +" in line  # the phase trace: where the stream moved
    assert f"rid={rid} " in log and "resumed on" in log


def test_client_asking_token_ids_keeps_them(backends: Backends, router_factory: RouterFactory) -> None:
    router = router_factory(backends.ok_p, (backends.die_mid_stream, backends.resume_d), OFF)
    events = _stream(router, new_rid("resume-ids"), return_token_ids=True)
    assert events[-1] == "[DONE]"
    ids = [t for e in events[:-1] for c in json.loads(e)["choices"] for t in c.get("token_ids") or ()]
    assert ids == [1000 + i for i in range(8)]
    prompts = [
        c["prompt_token_ids"] for e in events[:-1] for c in json.loads(e)["choices"] if c.get("prompt_token_ids")
    ]
    assert prompts == [[ord("H"), ord("i")]]  # once, the client's own prompt


def test_first_token_path_stream_resumes(backends: Backends, router_factory: RouterFactory) -> None:
    router = router_factory(backends.ok_p, (backends.die_mid_stream, backends.resume_d), ON)
    rid = new_rid("resume-ft")
    events = _stream(router, rid)
    assert events[-1] == "[DONE]" and not any("error" in json.loads(e) for e in events[:-1])
    assert "".join(_texts(events)) == "Hello" + "".join(TOKENS)
    (resumed,) = records(backends.resume_d, rid)
    # P's token 1 (id 101) and tok0..tok2 replayed; 8 - 1 - 3 left.
    assert resumed["body"]["prompt"] == [ord("H"), ord("i"), 101, 1000, 1001, 1002]
    assert resumed["body"]["max_tokens"] == 4


def test_no_decoder_left_ends_with_the_error_event(backends: Backends, router_factory: RouterFactory) -> None:
    router = router_factory(backends.ok_p, (backends.die_mid_stream, backends.die_mid_stream2), OFF)
    rid = new_rid("resume-none")
    events = _stream(router, rid)
    assert "[DONE]" not in events
    assert json.loads(events[-1])["error"]["type"] == "decode_failed"
    # The second decoder, asked to go on after tok2, dies before its first chunk: no decoder is left.
    assert "".join(_texts(events[:-1])) == "".join(TOKENS[:3])
    assert len(records(backends.die_mid_stream2, rid)) == 1


def test_resume_off_keeps_the_error_event(backends: Backends, router_factory: RouterFactory) -> None:
    router = router_factory(backends.ok_p, (backends.die_mid_stream, backends.resume_d), OFF, "--resume-attempts", "0")
    rid = new_rid("resume-off")
    events = _stream(router, rid)
    assert "[DONE]" not in events and json.loads(events[-1])["error"]["code"] == 502
    assert records(backends.resume_d, rid) == []
    # The request's line says the stream ended with an error, though its status was the 200 sent first.
    line = wait_until(
        lambda: next((x for x in router.proc.log_text().splitlines() if f"rid={rid} " in x and " POST " in x), None), 10
    )
    assert "status=200" in line and "outcome=stream_error:" in line, line


# --- pure rules -------------------------------------------------------------------------------


def _call(**body: Any) -> Call:
    return Call("/v1/completions", "r", {"prompt": "Hi", "max_tokens": 10, "stream": True, **body}, True, 2, {})


def _ev(payload: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


def _tok(text: str, tid: int, first: bool = False, finish: str | None = None) -> bytes:
    choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish, "stop_reason": None}
    choice |= {"prompt_token_ids": [1, 2] if first else None, "token_ids": [tid]}
    return _ev({"id": "cmpl-a", "object": "text_completion", "created": 5, "model": "m", "choices": [choice]})


def test_tracker_records_ids_strips_them_and_waits_for_whole_events() -> None:
    tracker = StreamTracker(_call())
    raw = _tok("a", 7, first=True) + _tok("b", 8)
    out = tracker.feed(raw[:20]) + tracker.feed(raw[20:])
    assert b'token_ids":[' not in out and out.count(b"\n\n") == 2
    assert [json.loads(e)["choices"][0]["text"] for e in sse_events(out)] == ["a", "b"]
    assert tracker.prompt_ids == [1, 2] and tracker.generated == [7, 8] and tracker.committed == 2
    # A token whose text is held back (part of a character) is not replayed: it is generated again.
    tracker.feed(_tok("", 9))
    call = resume_call(tracker)
    assert call is not None and call.body["prompt"] == [1, 2, 7, 8] and call.body["max_tokens"] == 8
    assert call.replayed == 2 and call.tokens == 4


def test_tracker_stops_at_an_error_event_and_ends_a_finished_answer() -> None:
    tracker = StreamTracker(_call(stream_options={"include_usage": True}))
    out = tracker.feed(_tok("a", 7, first=True) + b'data: {"error": {"message": "boom"}}\n\n' + b"data: [DONE]\n\n")
    assert tracker.error is not None and "boom" in tracker.error
    assert b"error" not in out and b"[DONE]" not in out
    finished = StreamTracker(_call(stream_options={"include_usage": True}))
    finished.feed(_tok("a", 7, first=True) + _tok("b", 8, finish="length"))
    assert finished.finished
    usage = json.loads(sse_events(finished.closing_events())[0])["usage"]
    assert usage == {"prompt_tokens": 2, "completion_tokens": 2, "total_tokens": 4}


def test_resumed_leg_reads_as_the_first() -> None:
    first = StreamTracker(_call())
    first.feed(_tok("a", 7, first=True))
    call = resume_call(first)
    assert call is not None
    leg = StreamTracker(call, identity=first.identity)
    usage = {"prompt_tokens": 3, "completion_tokens": 9, "total_tokens": 12}
    out = leg.feed(
        _ev({"id": "cmpl-b", "created": 9, "model": "m", "choices": [{"text": "c", "prompt_token_ids": [1, 2, 7]}]})
        + _ev({"id": "cmpl-b", "created": 9, "model": "m", "choices": [], "usage": usage})
    )
    events = [json.loads(e) for e in sse_events(out)]
    assert {(e["id"], e["created"]) for e in events} == {("cmpl-a", 5)}
    assert events[0]["choices"][0]["prompt_token_ids"] is None
    assert events[1]["usage"] == {"prompt_tokens": 2, "completion_tokens": 10, "total_tokens": 12}


def _ids(out: bytes) -> list[int]:
    return [t for e in sse_events(out) for c in json.loads(e)["choices"] for t in c.get("token_ids") or []]


def test_held_back_ids_reach_a_client_asking_for_them_once() -> None:
    """Ids of tokens whose text was held at the cut went out with their events; the resumed leg
    generates those tokens again (their text is new to the client) but does not send their ids twice,
    across a second cut too."""
    first = StreamTracker(_call(return_token_ids=True))
    got = _ids(first.feed(_tok("a", 7, first=True) + _tok("", 8) + _tok("\ufffd", 9)))
    assert got == [7, 8, 9] and first.committed == 1
    call = resume_call(first)
    assert call is not None and call.body["prompt"] == [1, 2, 7]
    second = StreamTracker(call, identity=first.identity, ids_ahead=first.ids_sent_beyond_committed())
    prompt = {"prompt_token_ids": [1, 2, 7]}
    # The new decoder generates 8 again, then cuts before 9's text is whole.
    got += _ids(second.feed(_ev({"id": "x", "choices": [{"text": "", "token_ids": [8], **prompt}]})))
    assert got == [7, 8, 9] and second.ids_ahead == 1
    call = resume_call(second)
    assert call is not None and call.body["prompt"] == [1, 2, 7]
    third = StreamTracker(call, identity=first.identity, ids_ahead=second.ids_sent_beyond_committed())
    got += _ids(third.feed(_ev({"id": "y", "choices": [{"text": "bc", "token_ids": [8, 9, 10], **prompt}]})))
    assert got == [7, 8, 9, 10]
    # A client that did not ask for ids has none to skip.
    assert StreamTracker(_call(), ids_ahead=3).ids_ahead == 0


@pytest.mark.parametrize(
    ("body", "ok"),
    [({}, True), ({"n": 2}, False), ({"stop": ["x"]}, False), ({"echo": True}, False), ({"stream": False}, False)],
)
def test_which_streams_are_resumable(body: dict[str, Any], ok: bool) -> None:
    call = _call(**body)
    if body.get("stream") is False:
        call = Call(call.endpoint, call.rid, call.body, False, 2, {})
    assert resumable(call, 2) is ok
    assert not resumable(_call(), 0)


def test_resume_policy_bounds_attempts() -> None:
    from proxy.upstream.calls import FailureKind

    class _F:
        kind = FailureKind.DISCONNECT
        unresponsive = False

    failure: Any = _F()
    assert resume_refusal(failure, 0, 2) is None
    assert resume_refusal(failure, 2, 2) is not None
    assert resume_refusal(failure, 0, 0) is not None
    failure.kind = FailureKind.TIMEOUT
    assert resume_refusal(failure, 0, 2) is not None
