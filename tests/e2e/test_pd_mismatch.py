"""P and D started with different block sizes: the client gets a clear error, nothing hangs, nothing is held.

The session stack's prefiller serves with --block-size 32. Two more decode instances point
at its bootstrap server with --block-size 64:
- one with PDConnector's HTTP middleware (the way `launch` starts every instance): its API
  server reads P's route and answers HTTP 409 naming both block sizes, before the engine
  sees the request; a Router in front of P and this D passes that answer to the client;
- one without the middleware: the connector's own handshake check fails the KV load, and
  vLLM (kv_load_failure_policy "fail") answers the request with an error at once, long
  before the KV wait timeout.
"""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest

from launch.processes import ProcessGroup, free_ports, router_cmd, vllm_env, vllm_serve_cmd, wait_all_healthy
from tests.support.serving import (
    D_KV_WAIT_TIMEOUT_S,
    P_ROOM_TIMEOUT_S,
    START_TIMEOUT_S,
    count_in_log,
    prompt_of_length,
    wait_kv_free,
)

pytestmark = pytest.mark.e2e

#: Well under the decode side's KV wait: the mismatch is found at the handshake, not by a timeout.
FAST_S = D_KV_WAIT_TIMEOUT_S - 5


def _body(model: str, stream: bool = False, **extra: object) -> dict:
    body = {"model": model, "prompt": prompt_of_length(100, salt=7), "max_tokens": 4, "temperature": 0, **extra}
    if stream:
        body["stream"] = True
    return body


def test_block_size_mismatch_is_a_clear_error(pd_stack, tmp_path: Path) -> None:
    host, model = pd_stack.host, pd_stack.model
    d_port, d_raw_port, router_port = free_ports(3)
    common = {"kv_role": "kv_consumer", "bootstrap_port": pd_stack.bootstrap_port}
    extra_config = {"kv_wait_timeout_s": D_KV_WAIT_TIMEOUT_S}
    with ProcessGroup(tmp_path) as group:
        decode = group.start(
            "decode-block64",
            vllm_serve_cmd(model, d_port, **common, extra_config=extra_config, extra_args=["--block-size", "64"]),
            env=vllm_env("1"),
        )
        decode_raw = group.start(
            "decode-block64-no-middleware",
            vllm_serve_cmd(
                model, d_raw_port, **common, extra_config=extra_config, extra_args=["--block-size", "64"],
                validate_kv_params=False,
            ),
            env=vllm_env("0"),
        )  # fmt: skip
        router = group.start(
            "router-block64",
            router_cmd(router_port, [(host, pd_stack.prefill_port, pd_stack.bootstrap_port)], [(host, d_port)]),
        )
        wait_all_healthy(
            [(f"http://{host}:{d_port}/health", decode), (f"http://{host}:{d_raw_port}/health", decode_raw)],
            START_TIMEOUT_S,
            watch=[router],
        )
        wait_all_healthy([(f"http://{host}:{router_port}/health", router)], 60)

        # Through the Router, streaming and not: HTTP 409 naming both block sizes, fast.
        with httpx.Client(timeout=120, trust_env=False) as client:
            for stream in (False, True):
                t0 = time.monotonic()
                response = client.post(f"http://{host}:{router_port}/v1/completions", json=_body(model, stream))
                elapsed = time.monotonic() - t0
                assert response.status_code == 409, response.text
                error = response.json()["error"]
                assert error["type"] == "kv_transfer_incompatible"
                message = error["message"]
                assert "block size mismatch" in message and "32" in message and "64" in message, message
                assert elapsed < FAST_S, f"the error took {elapsed:.1f} s"

            # Without the middleware the connector refuses at the handshake; vLLM fails the request.
            params = {
                "do_remote_prefill": True,
                "bootstrap_room": 424242,
                "bootstrap_host": host,
                "bootstrap_port": pd_stack.bootstrap_port,
            }
            t0 = time.monotonic()
            response = client.post(
                f"http://{host}:{d_raw_port}/v1/completions", json=_body(model, kv_transfer_params=params)
            )
            elapsed = time.monotonic() - t0
            assert response.status_code >= 500, response.text
            assert elapsed < FAST_S, f"the failed load took {elapsed:.1f} s"
            assert count_in_log(decode_raw.log_path, r"room=424242 .*block size mismatch") >= 1

            # Both decode instances keep serving requests that need no transfer.
            for port in (d_port, d_raw_port):
                ok = client.post(f"http://{host}:{port}/v1/completions", json=_body(model))
                assert ok.status_code == 200, ok.text

        # Nothing is held: not on either D, and not on P (whose prefilled KV nobody fetched).
        for port in (d_port, d_raw_port):
            assert wait_kv_free(f"http://{host}:{port}") == 0.0
        assert wait_kv_free(pd_stack.prefill_url, timeout=P_ROOM_TIMEOUT_S + 30) == 0.0
