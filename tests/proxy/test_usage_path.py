"""The Router's part of the KV accounting in ``usage``: ``usage.pd_kv.path`` on D's answers (JSON and the
stream's usage event, D's own account kept), and the first-token path's correction of D's account (token 1
is the client's first completion token, not a prompt token D computed)."""

from __future__ import annotations

import json
from typing import Any

import msgspec

from proxy.server.reply import BodyReply, StreamReply, json_with_path, sse_with_path
from proxy.strategies.first_token_body import ContinuationFix

ACCOUNT = {
    "pushed_tokens": 20,
    "prefix_hit_tokens": 0,
    "recomputed_tokens": 1,
    "recompute_reason": "prefilled_part",
    "kv_bytes": 4096,
    "transfer_ms": 1.5,
}


def _event(payload: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(payload).encode() + b"\n\n"


def test_json_answer_gets_the_path_beside_ds_account() -> None:
    body = json.dumps({"choices": [{"text": "x"}], "usage": {"prompt_tokens": 21, "pd_kv": ACCOUNT}}).encode()
    out = json.loads(json_with_path(body, "delta"))
    assert out["usage"]["pd_kv"] == {**ACCOUNT, "path": "delta"}
    bare = b'{"usage":{"prompt_tokens":3}}'
    assert json_with_path(bare, "local") == bare  # a backend that keeps no account: as it is
    assert json_with_path(b'{"error":{"message":"x"}}', "pd") == b'{"error":{"message":"x"}}'


def test_only_the_usage_event_of_a_stream_is_touched() -> None:
    token = _event({"choices": [{"text": "a"}], "usage": {"prompt_tokens": 3}})  # continuous usage stats
    final = _event({"choices": [], "usage": {"prompt_tokens": 3, "pd_kv": ACCOUNT}})
    out = sse_with_path(token + final + b"data: [DONE]\n\n", "pd")
    events = out.split(b"\n\n")
    assert events[0] + b"\n\n" == token and events[2] == b"data: [DONE]"
    assert msgspec.json.decode(events[1][6:])["usage"]["pd_kv"] == {**ACCOUNT, "path": "pd"}
    assert sse_with_path(token, "pd") is token


def test_body_reply_applies_the_path_when_prepared_only_to_a_200() -> None:
    body = json.dumps({"usage": {"prompt_tokens": 3, "pd_kv": ACCOUNT}}).encode()
    reply = BodyReply(body, 200, {"Content-Type": "application/json"})
    reply.usage_path = lambda: "local"
    reply._before_start()
    assert json.loads(reply.body)["usage"]["pd_kv"] == {**ACCOUNT, "path": "local"}
    failed = BodyReply(body, 500)
    failed.usage_path = lambda: "pd"
    failed._before_start()
    assert failed.body == body


def test_stream_reply_notes_the_usage_event() -> None:
    reply = StreamReply(200)
    reply.usage_path = lambda: "pd"
    final = _event({"choices": [], "usage": {"prompt_tokens": 3, "pd_kv": ACCOUNT}})
    assert msgspec.json.decode(reply._noted(final)[6:].strip())["usage"]["pd_kv"] == {**ACCOUNT, "path": "pd"}
    reply.usage_path = lambda: None
    assert reply._noted(final) is final


def test_first_token_continuation_does_not_count_token_1_as_recomputed() -> None:
    usage = {"prompt_tokens": 21, "completion_tokens": 3, "pd_kv": dict(ACCOUNT)}
    out = ContinuationFix(usage=True)(_event({"choices": [], "usage": usage}))
    fixed = msgspec.json.decode(out[6:].strip())["usage"]
    assert (fixed["prompt_tokens"], fixed["completion_tokens"]) == (20, 4)
    assert fixed["pd_kv"]["recomputed_tokens"] == 0 and fixed["pd_kv"]["recompute_reason"] == "none"
    assert fixed["pd_kv"]["pushed_tokens"] == fixed["prompt_tokens"]
