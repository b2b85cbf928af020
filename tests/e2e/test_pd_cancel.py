"""Never silent, never stuck: a client that leaves frees P's room at once; a KV load that cannot be served
ends with an error naming the room.

On the session's P/D stack (tests/e2e/conftest.py), with one more Router (no vLLM) whose decoder is a fake
that never answers and never asks P for KV, so the client can leave at points the real decoder would pass
too fast:

- before P answered (D never asked), after P answered (P holds the room; D never asked), and mid-stream
  through the session's Router: each time P's KV goes back to none (``vllm:kv_cache_usage_perc``, and
  ``vllm:pd_kv_rooms_held``) well before its ``room_timeout_s``: the Router told P's bootstrap server
  (``POST /bootstrap/release_room``);
- a request straight to D naming a room P released: HTTP 502 naming the room and the release, at once,
  never vLLM's bare "Internal server error" (one naming a room P never prefilled: test_pd_failures).
"""

from __future__ import annotations

import json
import re
import socket
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from launch.processes import ProcessGroup, free_port, wait_all_healthy
from pd_connector.bootstrap.client import release_room
from tests.support.serving import (
    D_KV_WAIT_TIMEOUT_S,
    P_ROOM_TIMEOUT_S,
    prompt_of_length,
    start_router_when_healthy,
    wait_kv_free,
)

pytestmark = [pytest.mark.e2e, pytest.mark.both_lines]

FAKE_BACKEND = Path(__file__).parents[1] / "support" / "fake_backend.py"
#: P's KV must be free well before room_timeout_s would have freed it.
FREED_WITHIN_S = P_ROOM_TIMEOUT_S / 2
_ROOMS_HELD = re.compile(r"^vllm:pd_kv_rooms_held\{[^}]*\}\s+([0-9.eE+-]+)$", re.M)


def _rooms_held(url: str) -> float | None:
    """P's ``vllm:pd_kv_rooms_held`` (None before its first sample)."""
    values = [float(v) for v in _ROOMS_HELD.findall(httpx.get(f"{url}/metrics", timeout=10, trust_env=False).text)]
    return sum(values) if values else None


def _wait(predicate: Any, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.2)
    return bool(predicate())


def _assert_p_freed(pd_stack: Any) -> None:
    assert wait_kv_free(pd_stack.prefill_url, timeout=FREED_WITHIN_S) == 0.0
    assert _wait(lambda: _rooms_held(pd_stack.prefill_url) in (None, 0.0), FREED_WITHIN_S)


@pytest.fixture(scope="module")
def hanging_d_router(pd_stack: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A Router in front of the stack's P and a decoder that never answers (nor asks P for KV)."""
    with ProcessGroup(tmp_path_factory.mktemp("cancel-logs")) as group:
        d_port, router_port = free_port(), free_port()
        fake = group.start("hanging-d", [sys.executable, str(FAKE_BACKEND), "--port", str(d_port), "--mode", "hang"])
        wait_all_healthy([(f"http://{pd_stack.host}:{d_port}/health", fake)], 30)
        yield start_router_when_healthy(
            group,
            router_port,
            [(pd_stack.host, pd_stack.prefill_port, pd_stack.bootstrap_port)],
            [(pd_stack.host, d_port)],
            [],
            ["--health-interval", "0", "--no-first-token-from-prefill"],
            name="router-hanging-d",
        )


def _body(pd_stack: Any, prompt_len: int, room: int, max_tokens: int = 64) -> dict:
    return {
        "model": pd_stack.model,
        "prompt": prompt_of_length(prompt_len, salt=room % 97),
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "temperature": 0,
        "stream": True,
        "kv_transfer_params": {"bootstrap_room": room},
    }


def _send_and_leave(url: str, body: dict, leave: Any, timeout: float = 60) -> bool:
    """POST ``body`` on a raw connection and close it once ``leave()`` holds or the answer's first bytes
    came (mid-stream); whether ``leave()`` held."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    data = json.dumps(body).encode()
    head = f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
    with socket.create_connection((host, int(port)), timeout=timeout) as sock:
        sock.sendall(f"{head}Content-Length: {len(data)}\r\n\r\n".encode() + data)
        sock.settimeout(0.1)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if leave():
                return True
            try:
                if sock.recv(65536):
                    return False  # the answer began: the client leaves mid-stream
            except TimeoutError:
                continue
    return False


def test_a_client_that_leaves_frees_ps_room_at_once(pd_stack: Any, hanging_d_router: str) -> None:
    assert wait_kv_free(pd_stack.prefill_url, timeout=P_ROOM_TIMEOUT_S + 30) == 0.0  # the baseline
    # 1. Before P answered, D never asked: the client leaves while P prefills.
    t0 = time.monotonic()
    assert _send_and_leave(hanging_d_router, _body(pd_stack, 900, 3_001, 1), lambda: time.monotonic() - t0 > 0.3)
    _assert_p_freed(pd_stack)
    # 2. After P answered: P holds the room (vllm:pd_kv_rooms_held), D never asked; then the client leaves.
    held = lambda: (_rooms_held(pd_stack.prefill_url) or 0.0) >= 1  # noqa: E731
    assert _send_and_leave(hanging_d_router, _body(pd_stack, 300, 3_002), held), "P never held the room"
    _assert_p_freed(pd_stack)
    # 3. Mid-stream, through the session's Router: D loaded the KV and streams; the client leaves.
    assert not _send_and_leave(pd_stack.router_url, _body(pd_stack, 200, 3_003, 400), lambda: False)
    _assert_p_freed(pd_stack)
    assert wait_kv_free(pd_stack.decode_url, timeout=30) == 0.0


def _straight_to_d(pd_stack: Any, room: int) -> httpx.Response:
    params = {
        "do_remote_prefill": True,
        "bootstrap_room": room,
        "bootstrap_host": pd_stack.host,
        "bootstrap_port": pd_stack.bootstrap_port,
    }
    body = {"model": pd_stack.model, "prompt": prompt_of_length(40), "max_tokens": 4, "kv_transfer_params": params}
    with httpx.Client(timeout=D_KV_WAIT_TIMEOUT_S + 60, trust_env=False) as client:
        return client.post(f"{pd_stack.decode_url}/v1/completions", json=body)


def test_a_kv_load_that_cannot_be_served_names_the_room(pd_stack: Any) -> None:
    addr = f"{pd_stack.host}:{pd_stack.bootstrap_port}"
    release_room(addr, 4_001, "client disconnected (test)", 10.0)
    t0 = time.monotonic()
    released = _straight_to_d(pd_stack, 4_001)
    released_s = time.monotonic() - t0
    assert released.status_code == 502, released.text
    error = released.json()["error"]
    assert error["type"] == "kv_transfer_load_failed"
    assert error["message"].startswith(f"room 4001: prefill at {addr} no longer holds KV for this room")
    assert "client disconnected (test)" in error["message"]
    assert released_s < D_KV_WAIT_TIMEOUT_S  # P refused at once: D did not wait out its kv_wait_timeout_s
    assert wait_kv_free(pd_stack.decode_url, timeout=30) == 0.0
