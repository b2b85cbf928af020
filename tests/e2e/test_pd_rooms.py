"""Rooms and n > 1 with real processes.

- ``n=2`` and ``n=3`` seeded sampled completions through the Router equal a colocated vLLM's,
  sample by sample: P prefills once (the Router sends it no ``n``), every sample on D loads the
  room's KV, and neither side holds KV afterwards.
- Two requests with the same client room (``--trust-client-room``): one served, one refused at
  once; a second P request with a live room is refused by P itself; nothing held afterwards.
"""

from __future__ import annotations

import random
import threading
from typing import Any

import httpx
import pytest

from launch.processes import ProcessGroup, free_port
from launch.sse import sse_lines
from tests.support.serving import (
    P_ROOM_TIMEOUT_S,
    SAMPLES,
    count_in_log,
    kv_usage,
    prompt_of_length,
    sampled,
    start_router_when_healthy,
    wait_kv_free,
)

pytestmark = pytest.mark.e2e


@pytest.mark.parametrize("n", SAMPLES)
def test_n_seeded_samples_equal_colocated_and_nothing_is_held(reference: dict, pd_stack: Any, n: int) -> None:
    pushed = count_in_log(pd_stack.prefill.log_path, r"pushed \d+ blocks")
    got = sampled(pd_stack.router_url, pd_stack.model, n)
    want = reference["samples"][n]
    assert len(set(map(tuple, want))) > 1, "the reference samples should differ (seeded sampling)"
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert g == w, f"n={n}: sample {i} differs from the colocated vLLM's"
    # One prefill on P, its KV pushed once per sample.
    assert count_in_log(pd_stack.prefill.log_path, r"pushed \d+ blocks") - pushed == n
    assert wait_kv_free(pd_stack.prefill_url, timeout=10) == 0.0, f"P holds KV: {kv_usage(pd_stack.prefill_url)}"
    assert wait_kv_free(pd_stack.decode_url, timeout=10) == 0.0, f"D holds KV: {kv_usage(pd_stack.decode_url)}"


def test_same_client_room_twice_one_served_one_refused_nothing_held(
    pd_stack: Any, tmp_path_factory: pytest.TempPathFactory
) -> None:
    host = pd_stack.host
    room = random.getrandbits(63)
    with ProcessGroup(tmp_path_factory.mktemp("trusting-router")) as group:
        url = start_router_when_healthy(
            group, free_port(), [(host, pd_stack.prefill_port, pd_stack.bootstrap_port)],
            [(host, pd_stack.decode_port)], [], name="router-trusting",
        )  # fmt: skip
        body = {
            "model": pd_stack.model, "prompt": prompt_of_length(90), "max_tokens": 150, "ignore_eos": True,
            "temperature": 0, "stream": True, "bootstrap_room": room,
        }  # fmt: skip
        first: dict[str, Any] = {}
        started = threading.Event()

        def stream() -> None:
            with httpx.Client(timeout=120, trust_env=False) as client:
                with client.stream("POST", f"{url}/v1/completions", json=body) as resp:
                    first["status"] = resp.status_code
                    lines = []
                    for line in sse_lines(resp):
                        started.set()
                        lines.append(line)
                    first["lines"] = lines
            started.set()

        thread = threading.Thread(target=stream)
        thread.start()
        assert started.wait(60)
        second = httpx.post(f"{url}/v1/completions", json={**body, "stream": False}, timeout=60, trust_env=False)
        thread.join(120)
        events = [line for line in first["lines"] if line]  # SSE events end with an empty line
        assert first["status"] == 200 and events[-1] == "data: [DONE]", first
        assert second.status_code == 409, second.text
        assert second.json()["error"]["type"] == "room_in_use" and str(room) in second.text
    # P itself: a second prefill of a room whose KV it holds is refused (its KV freed at once).
    p_body = {
        "model": pd_stack.model, "prompt": prompt_of_length(60), "max_tokens": 1, "ignore_eos": True,
        "kv_transfer_params": {"do_remote_decode": True, "bootstrap_room": room + 1 if room + 1 < 2**63 else 1},
    }  # fmt: skip
    answers = [httpx.post(f"{pd_stack.prefill_url}/v1/completions", json=p_body, timeout=60, trust_env=False)]
    answers.append(httpx.post(f"{pd_stack.prefill_url}/v1/completions", json=p_body, timeout=60, trust_env=False))
    params = [a.json()["kv_transfer_params"] for a in answers]
    assert params[0]["prefill_done"] is True
    assert params[1]["prefill_done"] is False and "in use" in params[1]["prefill_error"]
    # The held room expires after room_timeout_s (no D asks); nothing else is held.
    assert wait_kv_free(pd_stack.prefill_url, timeout=P_ROOM_TIMEOUT_S + 20) == 0.0
    assert wait_kv_free(pd_stack.decode_url, timeout=10) == 0.0
