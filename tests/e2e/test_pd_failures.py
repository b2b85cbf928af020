"""Failure basics with real processes: lost D, lost P, malformed params, dead prefiller behind the Router.

Runs against the session's P/D stack, whose timeouts are short
(tests/e2e/conftest.py: P room_timeout_s, D kv_wait_timeout_s).
"""

from __future__ import annotations

import random
import time

import httpx
import pytest

from launch.processes import ProcessGroup, free_port, router_cmd, wait_http_ok
from tests.support.serving import (
    D_KV_WAIT_TIMEOUT_S,
    P_ROOM_TIMEOUT_S,
    complete,
    count_in_log,
    prompt_of_length,
    wait_kv_free,
)

pytestmark = pytest.mark.e2e


def _post(url: str, body: dict, timeout: float = 120) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", json=body, timeout=timeout, trust_env=False)


def test_room_without_decode_is_freed_on_prefill(pd_stack) -> None:
    """P finishes a prefill for a room no D ever asks for: it frees the blocks after room_timeout_s."""
    room = random.getrandbits(63)
    body = {
        "model": pd_stack.model,
        "prompt": prompt_of_length(150),
        "max_tokens": 1,
        "temperature": 0,
        "ignore_eos": True,
        "kv_transfer_params": {"do_remote_decode": True, "bootstrap_room": room},
    }
    resp = _post(pd_stack.prefill_url, body)
    assert resp.status_code == 200, resp.text
    assert resp.json()["kv_transfer_params"]["bootstrap_room"] == room
    t0 = time.monotonic()
    assert wait_kv_free(pd_stack.prefill_url, timeout=P_ROOM_TIMEOUT_S + 30) == 0.0
    held = time.monotonic() - t0
    assert held <= P_ROOM_TIMEOUT_S + 30
    assert count_in_log(pd_stack.prefill.log_path, rf"room={room} .*no decode asked") == 1


def test_decode_without_prefill_does_not_wait_forever(pd_stack) -> None:
    """D is told to expect KV for a room P never computes: after kv_wait_timeout_s the request
    fails (vLLM's default kv_load_failure_policy "fail") with an error status, and D keeps serving."""
    room = random.getrandbits(63)
    body = {
        "model": pd_stack.model,
        "prompt": prompt_of_length(70),
        "max_tokens": 4,
        "temperature": 0,
        "kv_transfer_params": {
            "do_remote_prefill": True,
            "bootstrap_room": room,
            "bootstrap_host": "127.0.0.1",
            "bootstrap_port": pd_stack.bootstrap_port,
        },
    }
    t0 = time.monotonic()
    resp = _post(pd_stack.decode_url, body, timeout=D_KV_WAIT_TIMEOUT_S + 60)
    elapsed = time.monotonic() - t0
    assert resp.status_code == 502, f"expected the named error, got {resp.status_code}: {resp.text[:300]}"
    assert resp.json()["error"]["message"] == (  # pd_connector.api_server.load_errors, not vLLM's bare 500
        f"room {room}: prefill at 127.0.0.1:{pd_stack.bootstrap_port} holds no KV for this room "
        "(never prefilled, or already released)"
    )
    assert D_KV_WAIT_TIMEOUT_S - 1 <= elapsed <= D_KV_WAIT_TIMEOUT_S + 30
    assert count_in_log(pd_stack.decode.log_path, rf"room={room} .*KV load failed") == 1
    assert wait_kv_free(pd_stack.decode_url) == 0.0
    # Both servers still serve PD requests.
    assert complete(pd_stack.router_url, pd_stack.model, "still alive?", stream=False)["token_ids"]


@pytest.mark.parametrize(
    "params, field",
    [
        ({"do_remote_prefill": True, "bootstrap_room": 1, "bootstrap_port": 1234}, "bootstrap_host"),
        (
            {"do_remote_prefill": True, "bootstrap_room": "x", "bootstrap_host": "h", "bootstrap_port": 1},
            "bootstrap_room",
        ),
        ({"do_remote_decode": True, "bootstrap_room": -5}, "bootstrap_room"),
        ({"do_remote_decode": True, "do_remote_prefill": True, "bootstrap_room": 1}, "exclusive"),
        ({"do_remote_decode": "yes", "bootstrap_room": 1}, "do_remote_decode"),
        (["not", "an", "object"], "kv_transfer_params"),
    ],
)
def test_malformed_kv_transfer_params_get_400(pd_stack, params, field) -> None:
    for url in (pd_stack.prefill_url, pd_stack.decode_url):
        body = {"model": pd_stack.model, "prompt": "hello", "max_tokens": 2, "kv_transfer_params": params}
        resp = _post(url, body, timeout=30)
        assert resp.status_code == 400, f"{url}: {resp.status_code} {resp.text[:300]}"
        assert field in resp.json()["error"]["message"]
    # The servers keep serving.
    assert complete(pd_stack.router_url, pd_stack.model, "after bad input", stream=False)["token_ids"]


def test_router_with_dead_prefiller_answers_5xx_and_frees_decode(pd_stack, tmp_path) -> None:
    """A Router whose prefiller is down: the client gets a JSON 5xx quickly, never a hang or an
    empty 200, and the decode instance (which got the request too) ends up holding no KV."""
    dead_port = free_port()
    port = free_port()
    with ProcessGroup(tmp_path) as group:
        cmd = router_cmd(
            port, [("127.0.0.1", dead_port, pd_stack.bootstrap_port)], [("127.0.0.1", pd_stack.decode_port)]
        )
        router = group.start("router-dead-p", cmd)
        url = f"http://127.0.0.1:{port}"
        wait_http_ok(f"{url}/v1/models", 60, router)
        for stream in (False, True):
            body = {"model": pd_stack.model, "prompt": prompt_of_length(90), "max_tokens": 4, "stream": stream}
            t0 = time.monotonic()
            resp = _post(url, body, timeout=60)
            assert time.monotonic() - t0 < 30
            assert resp.status_code >= 500, resp.text[:300]
            assert resp.json()["error"]["message"], resp.text
    assert wait_kv_free(pd_stack.decode_url, timeout=D_KV_WAIT_TIMEOUT_S + 30) == 0.0
