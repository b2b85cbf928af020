"""Rooms the Router gives up are freed on P at once, and requests that would share a room are refused.

Real ``python -m proxy`` processes in front of the fake backends: a decoder that cannot be reached
after P's first token is replaced by another for the same room (P prefills once); with no attempt
left, the room P holds is released through another decoder at once (not after room_timeout_s).
"""

from __future__ import annotations

import json
from typing import Any

from tests.support.router_rig import (
    Backends,
    RouterFactory,
    assert_openai_error,
    http_client,
    new_rid,
    record,
    records,
    request_body,
    sse_events,
    wait_until,
)

ON = "--first-token-from-prefill"
#: An even room: decoders[room % 2] is the first decoder, the one nothing listens on.
ROOM = 1000


def _stream(url: str, rid: str, **extra: Any) -> tuple[int, list[str]]:
    body = request_body("/v1/completions", stream=True, bootstrap_room=ROOM, **extra)
    with http_client() as client:
        response = client.post(f"{url}/v1/completions", json=body, headers={"X-Request-Id": rid})
    return response.status_code, sse_events(response.content)


def test_unreachable_decoder_after_the_first_token_is_replaced_for_the_same_room(
    backends: Backends, fresh_router: RouterFactory
) -> None:
    router = fresh_router(backends.ok_p, (backends.down, backends.ok_d), ON, "--health-interval", "0")
    rid = new_rid("room-other-d")
    status, events = _stream(router.url, rid)
    assert status == 200 and events[-1] == "[DONE]", events
    assert not any("error" in json.loads(e) for e in events[:-1]), events
    p_body = record(backends.ok_p, rid)["body"]  # P prefilled once
    d_body = record(backends.ok_d, rid)["body"]
    assert d_body["kv_transfer_params"]["bootstrap_room"] == p_body["kv_transfer_params"]["bootstrap_room"] == ROOM
    assert d_body["stream"] is True and d_body["kv_transfer_params"]["prefilled_tokens"] == 2
    assert "unreachable after the first token" in router.proc.log_text()


def test_with_no_attempt_left_the_room_is_released_through_another_decoder_at_once(
    backends: Backends, fresh_router: RouterFactory
) -> None:
    router = fresh_router(
        backends.ok_p, (backends.down, backends.ok_d), ON, "--health-interval", "0", "--max-retries", "1"
    )
    rid = new_rid("room-release")
    status, events = _stream(router.url, rid)
    assert status == 200  # token 1 went out; the stream then ends with an error event
    assert "error" in json.loads(events[-1] if events[-1] != "[DONE]" else events[-2])
    (release,) = wait_until(lambda: records(backends.ok_d, rid), timeout=5)
    body = release["body"]
    assert body["max_tokens"] == 1 and body["stream"] is False
    assert body["kv_transfer_params"]["bootstrap_room"] == ROOM
    assert record(backends.ok_p, rid)["body"]["kv_transfer_params"]["bootstrap_room"] == ROOM
    assert "releasing prefiller" in router.proc.log_text()


def test_a_batch_of_prompts_and_an_impossible_dp_rank_are_400s(
    backends: Backends, router_factory: RouterFactory
) -> None:
    router = router_factory(backends.ok_p, backends.ok_d, "--prefiller-dp-ranks", "0")
    url = f"{router.url}/v1/completions"
    with http_client() as client:
        batch = client.post(url, json=request_body("/v1/completions", prompt=["one", "two"]))
        assert "batch of 2 prompts" in assert_openai_error(batch, 400, "invalid_request_error", "prompt")["message"]
        rank = client.post(url, json=request_body("/v1/completions", kv_transfer_params={"prefill_dp_rank": 3}))
        where = "kv_transfer_params.prefill_dp_rank"
        assert (
            "no prefiller has that DP rank" in assert_openai_error(rank, 400, "invalid_request_error", where)["message"]
        )
        fine = client.post(url, json=request_body("/v1/completions", kv_transfer_params={"prefill_dp_rank": 0}))
        assert fine.status_code == 200, fine.text
