"""The first-token path (``--first-token-from-prefill``) of a real Router process in front of fake backends.

The fake P answers ``return_token_ids`` like vLLM (the prompt's ids, one id per character of a
text prompt, and token 101 for its one generated token ``Hello``); the fake D streams ``Hello``,
``,``, `` world``, ``!`` whatever its prompt.
"""

from __future__ import annotations

import json
import os
import re
import signal
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tests.support.fake_backend import FIRST_TOKEN_ID, PARTIAL_MARK, TOKENS
from tests.support.router_rig import (
    FAKE_BACKEND,
    Backends,
    Proc,
    Router,
    RouterFactory,
    admin_headers,
    free_port,
    http_client,
    new_rid,
    record,
    records,
    request_body,
    sse_events,
    wait_until,
)

ON = "--first-token-from-prefill"
PROMPT_IDS = [ord(c) for c in "Hi"]


@pytest.fixture(scope="session")
def router_first(backends: Backends, router_factory: RouterFactory) -> Router:
    return router_factory(backends.ok_p, backends.ok_d, ON)


def _stream(router: Router, rid: str, **extra: Any) -> tuple[int, list[str]]:
    body = request_body("/v1/completions", stream=True, **extra)
    with http_client() as client:
        response = client.post(f"{router.url}/v1/completions", json=body, headers={"X-Request-Id": rid})
    return response.status_code, sse_events(response.content)


def _texts(events: list[str]) -> list[str]:
    out = []
    for event in events:
        if event == "[DONE]":
            continue
        choices = json.loads(event)["choices"]
        out.extend(c["text"] for c in choices)
    return out


def test_p_token_first_then_d_continues_from_it(router_first: Router, backends: Backends) -> None:
    rid = new_rid("first")
    status, events = _stream(router_first, rid)
    assert status == 200
    assert events[-1] == "[DONE]"
    # P's token, then D's stream (D's own chunks, its final empty chunk with the finish reason).
    assert _texts(events) == [TOKENS[0], *TOKENS, ""]
    first = json.loads(events[0])
    assert first["id"] == f"cmpl-{rid}" and first["object"] == "text_completion"
    assert first["choices"][0]["finish_reason"] is None
    p_body = record(backends.ok_p, rid)["body"]
    assert p_body["max_tokens"] == 1 and p_body["return_token_ids"] is True and p_body["stream"] is False
    assert p_body["kv_transfer_params"]["do_remote_decode"] is True
    assert "ignore_eos" not in p_body  # token 1 may be EOS: P's answer is then the whole answer
    d_body = record(backends.ok_d, rid)["body"]
    assert d_body["prompt"] == [*PROMPT_IDS, FIRST_TOKEN_ID]
    assert d_body["max_tokens"] == 7
    kv = d_body["kv_transfer_params"]
    assert kv["do_remote_prefill"] is True and kv["prefilled_tokens"] == len(PROMPT_IDS)
    assert kv["bootstrap_room"] == p_body["kv_transfer_params"]["bootstrap_room"]


def test_usage_counts_token_one_as_generated(router_first: Router, backends: Backends) -> None:
    rid = new_rid("first-usage")
    status, events = _stream(router_first, rid, stream_options={"include_usage": True})
    assert status == 200
    usage = json.loads(events[-2])["usage"]
    # The fake D counts 3 prompt tokens and 4 generated; one of its prompt tokens was P's token 1.
    assert usage == {"prompt_tokens": 2, "completion_tokens": 5, "total_tokens": 7}


def test_one_token_request_is_answered_by_p_and_its_kv_released(router_first: Router, backends: Backends) -> None:
    rid = new_rid("first-one")
    status, events = _stream(router_first, rid, max_tokens=1, stream_options={"include_usage": True})
    assert status == 200
    assert _texts(events) == [TOKENS[0]]
    assert json.loads(events[0])["choices"][0]["finish_reason"] == "length"
    assert json.loads(events[1])["usage"]["completion_tokens"] == 1
    assert events[-1] == "[DONE]"
    # The detached release: D loads P's KV for the room, one token, not streamed.
    release = wait_until(lambda: records(backends.ok_d, rid), timeout=10)
    assert len(release) == 1
    body = release[0]["body"]
    assert body["max_tokens"] == 1 and body["stream"] is False
    assert body["kv_transfer_params"]["prefilled_tokens"] == len(PROMPT_IDS)


@pytest.mark.parametrize(
    "extra",
    [{"stop": ["x"]}, {"n": 2}, {"logprobs": 0}, {"echo": True}, {"presence_penalty": 0.5}, {"seed": 3}],
    ids=["stop", "n", "logprobs", "echo", "presence_penalty", "seed"],
)
def test_ineligible_requests_take_the_two_instance_path(router_first: Router, backends: Backends, extra: dict) -> None:
    rid = new_rid("first-not")
    status, events = _stream(router_first, rid, **extra)
    assert status == 200 and events[-1] == "[DONE]"
    assert record(backends.ok_d, rid)["body"]["prompt"] == "Hi"  # the client's own request
    assert "return_token_ids" not in record(backends.ok_p, rid)["body"]


def test_greedy_seed_is_eligible(router_first: Router, backends: Backends) -> None:
    rid = new_rid("first-seed0")
    status, _ = _stream(router_first, rid, seed=3, temperature=0)
    assert status == 200
    assert record(backends.ok_d, rid)["body"]["prompt"] == [*PROMPT_IDS, FIRST_TOKEN_ID]


def test_failed_decoder_retries_the_continuation_on_another_pair(
    backends: Backends, router_factory: RouterFactory
) -> None:
    router = router_factory((backends.ok_p, backends.ok_p2), (backends.fail500, backends.ok_d2), ON)
    rid = new_rid("first-retry")
    status, events = _stream(router, rid, bootstrap_room=0)  # room 0: ok_p + fail500 first
    assert status == 200 and events[-1] == "[DONE]"
    assert _texts(events) == [TOKENS[0], *TOKENS, ""]
    assert record(backends.fail500, rid)["body"]["kv_transfer_params"]["prefilled_tokens"] == 2
    # The retry: P2 prefills prompt + token 1 (a normal P request), D2 loads all of it.
    p2 = record(backends.ok_p2, rid)["body"]
    assert p2["prompt"] == [*PROMPT_IDS, FIRST_TOKEN_ID] and "return_token_ids" not in p2
    d2 = record(backends.ok_d2, rid)["body"]
    assert d2["prompt"] == [*PROMPT_IDS, FIRST_TOKEN_ID] and "prefilled_tokens" not in d2["kv_transfer_params"]
    assert d2["max_tokens"] == 7


def test_chat_and_unstreamed_requests_are_unchanged(router_first: Router, backends: Backends) -> None:
    for path, stream in (("/v1/chat/completions", True), ("/v1/completions", False)):
        rid = new_rid("first-chat")
        with http_client() as client:
            response = client.post(
                f"{router_first.url}{path}", json=request_body(path, stream=stream), headers={"X-Request-Id": rid}
            )
        assert response.status_code == 200
        assert "return_token_ids" not in record(backends.ok_p, rid)["body"]


def test_client_token_ids_come_with_p_token(router_first: Router, backends: Backends) -> None:
    rid = new_rid("first-ids")
    status, events = _stream(router_first, rid, return_token_ids=True)
    assert status == 200
    choice = json.loads(events[0])["choices"][0]
    assert choice["prompt_token_ids"] == PROMPT_IDS and choice["token_ids"] == [FIRST_TOKEN_ID]
    assert record(backends.ok_d, rid)["body"]["return_token_ids"] is True


def test_token_one_without_text_goes_first_and_d_answers_the_request(router_first: Router, backends: Backends) -> None:
    """P's token 1 has no text yet: its empty chunk first, then D serves the client's own request
    from P's KV; D's repeat of that empty chunk is not sent twice."""
    rid = new_rid("first-partial")
    prompt = f"Hi {PARTIAL_MARK}"
    status, events = _stream(router_first, rid, prompt=prompt, stream_options={"include_usage": True})
    assert status == 200 and events[-1] == "[DONE]"
    assert _texts(events) == ["", *TOKENS, ""]
    # D generated the empty token and the four others: its own count goes through unchanged.
    assert json.loads(events[-2])["usage"]["completion_tokens"] == len(TOKENS) + 1
    p_kv = record(backends.ok_p, rid)["body"]["kv_transfer_params"]
    d_body = record(backends.ok_d, rid)["body"]
    assert d_body["prompt"] == prompt and d_body["max_tokens"] == 8
    assert "prefilled_tokens" not in d_body["kv_transfer_params"]
    assert d_body["kv_transfer_params"]["bootstrap_room"] == p_kv["bootstrap_room"]
    line = next(line for line in router_first.proc.log_text().splitlines() if rid in line and "first=" in line)
    assert "first=P-empty" in line


def test_token_one_without_text_and_client_token_ids_waits_for_d(router_first: Router, backends: Backends) -> None:
    rid = new_rid("first-partial-ids")
    status, events = _stream(router_first, rid, prompt=f"Hi {PARTIAL_MARK}", return_token_ids=True)
    assert status == 200
    assert _texts(events) == ["", *TOKENS, ""]  # D's own stream, its empty first chunk included
    assert record(backends.ok_d, rid)["body"]["return_token_ids"] is True


def test_decoder_refusing_the_pair_is_answered_as_http_409_once_known(
    router_factory: RouterFactory, backends: Backends
) -> None:
    """D's 409 kv_transfer_incompatible after P's token 1 went out can only end the stream with an
    error event; the Router remembers the pair, and its next requests get D's 409 as HTTP."""
    router = router_factory(backends.ok_p, backends.incompatible, ON)
    status, events = _stream(router, new_rid("refused-1"))
    assert status == 200 and "kv_transfer_incompatible" in events[-1], events
    for stream in (True, False):
        body = request_body("/v1/completions", stream=stream)
        with http_client() as client:
            response = client.post(f"{router.url}/v1/completions", json=body)
        assert response.status_code == 409, response.text
        assert response.json()["error"]["type"] == "kv_transfer_incompatible"


def test_frozen_prefiller_is_given_up_for_another(
    backends: Backends, fresh_router: RouterFactory, proc_dir: Path
) -> None:
    """A stopped P (its /health silent too) is left after the watch's probe; P2 answers in full."""
    port = free_port()
    args = [sys.executable, str(FAKE_BACKEND), "--port", str(port), "--mode", "ok"]
    frozen = Proc(f"frozen fake {port}", port, args, proc_dir / f"frozen-{port}.log").start()
    try:
        frozen.wait_listening()
        router = fresh_router(
            (port, backends.ok_p2), backends.ok_d, ON, "--health-interval", "0", "--health-timeout", "1"
        )
        assert frozen.popen is not None
        os.kill(frozen.popen.pid, signal.SIGSTOP)
        rid = new_rid("first-frozen")
        t0 = time.monotonic()
        status, events = _stream(router, rid, bootstrap_room=0)  # room 0: the frozen P first
        took = time.monotonic() - t0
        assert status == 200 and _texts(events) == [TOKENS[0], *TOKENS, ""]
        assert took < 6, took  # one watch period (1 s) + one probe (1 s), and the rest
        assert record(backends.ok_p2, rid)["body"]["return_token_ids"] is True
        assert "stopped answering" in router.proc.log_text()
    finally:
        if frozen.popen is not None and frozen.popen.poll() is None:
            os.kill(frozen.popen.pid, signal.SIGCONT)
        frozen.stop()


def test_no_decoder_after_p_answered_is_http_503_on_both_first_token_paths(
    backends: Backends, fresh_router: RouterFactory
) -> None:
    """P answered, but the decoders were all removed: the client gets HTTP 503 naming it, on the
    token path and on the empty-first path alike, and nothing is streamed; the release of P's
    room has no decoder to go through either, which the log says (room_timeout_s frees it)."""
    router = fresh_router(backends.ok_p, backends.ok_d, ON)
    decoder = {"role": "decode", "host": "127.0.0.1", "port": backends.ok_d}
    with http_client() as client:
        assert (
            client.post(f"{router.url}/instances/remove", json=decoder, headers=admin_headers(router)).status_code
            == 200
        )
    for tag, prompt in (("token", "Hi"), ("empty", f"Hi {PARTIAL_MARK}")):
        rid = new_rid(f"first-no-d-{tag}")
        body = request_body("/v1/completions", stream=True, prompt=prompt)
        with http_client() as client:
            response = client.post(f"{router.url}/v1/completions", json=body, headers={"X-Request-Id": rid})
        assert response.status_code == 503, (tag, response.text)
        assert response.json()["error"]["message"] == "no decode instance is available"
        assert record(backends.ok_p, rid)["body"]["return_token_ids"] is True  # P was asked, and answered
        assert records(backends.ok_d, rid) == []
        line = re.compile(rf"rid={rid} room=\S+ no decoder to release P's KV")  # after P's bootstrap call failed
        assert wait_until(lambda line=line: line.search(router.proc.log_text()), timeout=10), tag
