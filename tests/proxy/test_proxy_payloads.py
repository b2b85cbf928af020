"""Unit tests of the bodies the Router builds for P and D (no processes)."""

from __future__ import annotations

import random
from typing import Any

import pytest

from proxy.errors import RouterError
from proxy.request.payloads import check_prefill_dp_rank, decode_body, prefill_body, resolve_room, validate_body
from proxy.router_config import Backend

PREFILLER = Backend("prefill", "10.0.0.7", 8100, 18800)


def test_prefill_body_is_one_token_no_stream() -> None:
    client = {
        "model": "m",
        "messages": [{"role": "user", "content": "hi"}],
        "stream": True,
        "stream_options": {"include_usage": True},
        "max_tokens": 64,
        "max_completion_tokens": 64,
        "min_tokens": 8,
        "bootstrap_room": 5,
        "temperature": 0.3,
    }
    body = prefill_body(client, 5)
    assert body == {
        "model": "m",
        "messages": [{"role": "user", "content": "hi"}],
        "stream": False,
        "max_tokens": 1,
        "max_completion_tokens": 1,
        "ignore_eos": True,
        "temperature": 0.3,
        "kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False, "bootstrap_room": 5},
    }
    assert client["stream"] is True and client["max_tokens"] == 64  # the client's body is not modified


def test_prefill_body_adds_max_completion_tokens_only_if_given() -> None:
    assert "max_completion_tokens" not in prefill_body({"prompt": "x"}, 1)


def test_decode_body_keeps_the_request_and_adds_kv_params() -> None:
    client = {"prompt": "x", "max_tokens": 9, "stream": True, "bootstrap_room": 3, "kv_transfer_params": {"a": 1}}
    body = decode_body(client, 3, PREFILLER)
    assert body == {
        "prompt": "x",
        "max_tokens": 9,
        "stream": True,
        "kv_transfer_params": {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "bootstrap_room": 3,
            "bootstrap_host": "10.0.0.7",
            "bootstrap_port": 18800,
        },
    }


def test_decode_body_names_the_dp_rank_and_bootstrap_host_when_known() -> None:
    prefiller = Backend("prefill", "10.0.0.8", 8101, 18800, bootstrap_host="10.0.0.7", dp_rank=1)
    params = decode_body({"prompt": "x"}, 5, prefiller)["kv_transfer_params"]
    assert params["bootstrap_host"] == "10.0.0.7"
    assert params["bootstrap_port"] == 18800
    assert params["prefill_dp_rank"] == 1
    # Without a DP rank, D asks the bootstrap server (vLLM internal DP picks the engine itself).
    assert "prefill_dp_rank" not in decode_body({"prompt": "x"}, 5, PREFILLER)["kv_transfer_params"]


@pytest.mark.parametrize(
    ("body", "room"),
    [
        ({"bootstrap_room": 0}, 0),
        ({"bootstrap_room": 2**63 - 1}, 2**63 - 1),
        ({"kv_transfer_params": {"bootstrap_room": 42}}, 42),
        ({"bootstrap_room": 7, "kv_transfer_params": {"bootstrap_room": 7}}, 7),
    ],
)
def test_client_room(body: dict[str, Any], room: int) -> None:
    assert resolve_room(body) == room


def test_random_room_is_63_bits() -> None:
    rng = random.Random(1)
    rooms = {resolve_room({"prompt": "x"}, rng) for _ in range(200)}
    assert len(rooms) == 200
    assert all(0 <= r < 2**63 for r in rooms)


@pytest.mark.parametrize(
    "body",
    [
        {"bootstrap_room": -1},
        {"bootstrap_room": 2**63},
        {"bootstrap_room": "1"},
        {"bootstrap_room": 1.0},
        {"bootstrap_room": False},
        {"kv_transfer_params": {"bootstrap_room": [1]}},
        {"kv_transfer_params": "room=1"},
        {"bootstrap_room": 1, "kv_transfer_params": {"bootstrap_room": 2}},
    ],
)
def test_bad_room_is_400(body: dict[str, Any]) -> None:
    with pytest.raises(RouterError) as info:
        resolve_room(body)
    assert info.value.status == 400
    assert info.value.error_type == "invalid_request_error"


@pytest.mark.parametrize("prompt", ["one", ["one"], [1, 2, 3], [[1, 2, 3]]])
def test_one_prompt_passes(prompt: Any) -> None:
    validate_body({"prompt": prompt}, "/v1/completions")


@pytest.mark.parametrize("prompt", [["one", "two"], [[1, 2], [3]]])
def test_a_batch_of_prompts_is_a_400_naming_prompt(prompt: Any) -> None:
    """Each prompt of a batch would share the request's one bootstrap room: refused."""
    with pytest.raises(RouterError) as caught:
        validate_body({"prompt": prompt}, "/v1/completions")
    assert (caught.value.status, caught.value.param) == (400, "prompt")
    assert "batch of 2 prompts" in caught.value.message


@pytest.mark.parametrize(
    ("rank", "configured", "message"),
    [
        (-1, [None], "an integer >= 0"),
        ("0", [None], "an integer >= 0"),
        (True, [0, 1], "an integer >= 0"),
        (2, [0, 1], "no prefiller has that DP rank (configured: [0, 1])"),
    ],
)
def test_an_impossible_prefill_dp_rank_is_a_400_naming_it(rank: Any, configured: list[Any], message: str) -> None:
    with pytest.raises(RouterError) as caught:
        check_prefill_dp_rank({"kv_transfer_params": {"prefill_dp_rank": rank}}, configured)
    assert (caught.value.status, caught.value.param) == (400, "kv_transfer_params.prefill_dp_rank")
    assert message in caught.value.message


def test_a_possible_prefill_dp_rank_passes() -> None:
    check_prefill_dp_rank({"kv_transfer_params": {"prefill_dp_rank": 1}}, [0, 1])
    check_prefill_dp_rank({"kv_transfer_params": {"prefill_dp_rank": 5}}, [None])  # ranks unknown to the Router
    check_prefill_dp_rank({"prompt": "x"}, [0])
