"""proxy.strategies.first_token_body: eligibility, the P and D bodies, P's answer, the usage rewrite."""

from __future__ import annotations

import json

import pytest

from proxy.strategies.first_token_body import (
    ContinuationFix,
    DropRepeatedFirst,
    continuation_body,
    final_events,
    first_chunk,
    ineligible_reason,
    is_whole_answer,
    parse_first_token,
    prefill_first_body,
)

BASE = {"model": "m", "prompt": "Hello", "max_tokens": 8, "stream": True}


def _answer(**choice: object) -> bytes:
    base = {"index": 0, "text": "A", "finish_reason": "length", "prompt_token_ids": [1, 2, 3], "token_ids": [7]}
    return json.dumps({"id": "cmpl-x", "created": 5, "model": "m", "choices": [{**base, **choice}]}).encode()


def test_eligible_basics() -> None:
    assert ineligible_reason("/v1/completions", BASE) is None
    assert ineligible_reason("/v1/completions", {**BASE, "prompt": [1, 2, 3]}) is None
    assert ineligible_reason("/v1/completions", {**BASE, "temperature": 0, "seed": 1}) is None
    assert ineligible_reason("/v1/completions", {**BASE, "best_of": 1, "echo": False}) is None


@pytest.mark.parametrize(
    ("extra", "reason"),
    [
        ({"stream": False}, "not streamed"),
        ({"prompt": ["a", "b"]}, "not a single prompt"),
        ({"prompt": [[1, 2]]}, "not a single prompt"),
        ({"n": 2}, "n > 1"),
        ({"logprobs": 0}, "logprobs"),
        ({"echo": True}, "echo"),
        ({"best_of": 2}, "best_of"),
        ({"stop": "x"}, "stop strings"),
        ({"frequency_penalty": 0.1}, "frequency/presence penalty"),
        ({"seed": 1}, "seeded sampling"),
        ({"response_format": {"type": "json_object"}}, "response_format"),
        ({"stream_options": {"continuous_usage_stats": True}}, "continuous_usage_stats"),
        ({"max_tokens": 0}, "max_tokens < 1"),
    ],
)
def test_ineligible(extra: dict, reason: str) -> None:
    assert ineligible_reason("/v1/completions", {**BASE, **extra}) == reason


def test_chat_is_ineligible() -> None:
    assert ineligible_reason("/v1/chat/completions", BASE) == "not /v1/completions"


def test_prefill_body_keeps_eos_meaning() -> None:
    body = prefill_first_body(
        {**BASE, "min_tokens": 4, "stream_options": {"include_usage": True}, "bootstrap_room": 3}, 9
    )
    assert body["max_tokens"] == 1 and body["min_tokens"] == 1 and body["return_token_ids"] is True
    assert body["stream"] is False and "stream_options" not in body and "bootstrap_room" not in body
    assert "ignore_eos" not in body
    assert body["kv_transfer_params"]["bootstrap_room"] == 9


def test_parse_and_continue() -> None:
    first = parse_first_token(_answer())
    assert first is not None and first.token_id == 7 and first.prompt_token_ids == [1, 2, 3]
    cont = continuation_body({**BASE, "min_tokens": 2, "truncate_prompt_tokens": 2, "kv_transfer_params": {}}, first)
    assert cont["prompt"] == [1, 2, 3, 7] and cont["max_tokens"] == 7 and cont["min_tokens"] == 1
    assert "truncate_prompt_tokens" not in cont and "kv_transfer_params" not in cont
    assert continuation_body({**BASE, "max_tokens": None}, first)["max_tokens"] is None
    assert not is_whole_answer(first, BASE)
    assert is_whole_answer(first, {**BASE, "max_tokens": 1})
    stopped = parse_first_token(_answer(finish_reason="stop", stop_reason=2))
    assert stopped is not None and is_whole_answer(stopped, BASE)
    chunk = json.loads(first_chunk(stopped, final=True)[len(b"data: ") :])
    assert chunk["choices"][0]["finish_reason"] == "stop" and chunk["choices"][0]["stop_reason"] == 2


@pytest.mark.parametrize(
    "content",
    [
        b"not json",
        b"{}",
        _answer(token_ids=None),
        _answer(token_ids=[1, 2]),
        _answer(prompt_token_ids=[]),
        _answer(prompt_token_ids=["a"]),
        b'{"choices": []}',
    ],
)
def test_parse_rejects_answers_without_ids(content: bytes) -> None:
    assert parse_first_token(content) is None


def test_final_events() -> None:
    first = parse_first_token(_answer())
    assert first is not None
    assert final_events(first, usage=False) == b"data: [DONE]\n\n"


def test_usage_fix() -> None:
    fix = ContinuationFix(True)
    plain = b'data: {"choices":[{"text":"a"}]}\n\n'
    assert fix(plain) is plain
    chunk = (
        b'data: {"choices":[],"usage":{"prompt_tokens":4,"completion_tokens":3,"total_tokens":7}}\n\ndata: [DONE]\n\n'
    )
    out = fix(chunk)
    usage = json.loads(out.split(b"\n\n")[0][len(b"data: ") :])["usage"]
    assert usage == {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}
    assert out.endswith(b"data: [DONE]\n\n")
    assert ContinuationFix(False)(chunk) is chunk


def test_prompt_ids_of_d_are_dropped() -> None:
    fix = ContinuationFix(False, token_ids=True)
    chunk = b'data: {"choices":[{"index":0,"text":"b","prompt_token_ids":[1,2,3,7],"token_ids":[8]}]}\n\n'
    choice = json.loads(fix(chunk)[len(b"data: ") : -2])["choices"][0]
    assert choice["prompt_token_ids"] is None and choice["token_ids"] == [8]
    later = b'data: {"choices":[{"index":0,"text":"c","prompt_token_ids":null,"token_ids":[9]}]}\n\n'
    assert fix(later) is later


def test_first_chunk_with_token_ids() -> None:
    first = parse_first_token(_answer())
    assert first is not None
    choice = json.loads(first_chunk(first, final=False, token_ids=True)[len(b"data: ") :])["choices"][0]
    assert choice["prompt_token_ids"] == [1, 2, 3] and choice["token_ids"] == [7]
    assert "token_ids" not in json.loads(first_chunk(first, final=False)[len(b"data: ") :])["choices"][0]


def test_partial_character_text() -> None:
    from proxy.strategies.first_token_body import text_may_be_partial

    assert text_may_be_partial("") and text_may_be_partial("a\ufffd")
    assert not text_may_be_partial("é") and not text_may_be_partial(" the")
    assert not text_may_be_partial("\ufffdab\ufffdc")  # U+FFFD inside: final bytes, D can continue


def _text_event(text: str, finish: str | None = None) -> bytes:
    choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
    return b"data: " + json.dumps({"id": "cmpl-x", "choices": [choice]}).encode() + b"\n\n"


def test_drop_repeated_first_drops_only_an_empty_unfinished_first_event() -> None:
    drop = DropRepeatedFirst()
    first, second = _text_event(""), _text_event("Hi")
    # The first event split over reads: held back until whole, then dropped; the rest unchanged.
    assert drop(first[:10]) == b""
    assert drop(first[10:] + second[:5]) == second[:5]
    assert drop(second[5:]) == second[5:]
    assert drop(_text_event("")) == _text_event("")  # only the first event is looked at


@pytest.mark.parametrize("event", [_text_event("x"), _text_event("", "stop"), b": comment\n\n", b"data: {bad\n\n"])
def test_drop_repeated_first_passes_any_other_first_event(event: bytes) -> None:
    assert DropRepeatedFirst()(event + b"data: [DONE]\n\n") == event + b"data: [DONE]\n\n"
