"""The prefill instance restarts under a running decode instance and Router: service resumes promptly.

A restarted P has new rank endpoints (ZMQ and Mooncake ports are picked at start) behind the same
HTTP and bootstrap ports. D must not keep using the old endpoints from its route cache: the first
request after the restart must succeed well within D's KV wait, token-identical to a colocated run.
"""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest

from launch.processes import ProcessGroup, free_ports, vllm_env, vllm_serve_cmd, wait_all_healthy
from tests.e2e.helpers import (
    PROMPT_LENGTHS,
    START_TIMEOUT_S,
    assert_matches_reference,
    start_router_when_healthy,
    wait_kv_free,
)

pytestmark = pytest.mark.e2e

HOST = "127.0.0.1"
KV_WAIT_S = 60.0
SAMPLE = [i for i, n in enumerate(PROMPT_LENGTHS) if n in (33, 129)]


def _wait_router_sees_prefill_healthy(url: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        health = httpx.get(f"{url}/health", timeout=10, trust_env=False).json()
        if all(p["healthy"] for p in health["prefillers"]):
            return
        time.sleep(0.5)
    raise AssertionError(f"the Router still sees the prefiller as unhealthy: {health}")


def test_decode_follows_a_restarted_prefill(reference: dict, tiny_model: Path, tmp_path: Path) -> None:
    p_port, bootstrap_port, d_port, router_port = free_ports(4)
    p_cmd = vllm_serve_cmd(tiny_model, p_port, kv_role="kv_producer", bootstrap_port=bootstrap_port)
    d_cmd = vllm_serve_cmd(
        tiny_model, d_port, kv_role="kv_consumer", bootstrap_port=bootstrap_port,
        extra_config={"kv_wait_timeout_s": KV_WAIT_S},
    )  # fmt: skip
    p_health = f"http://{HOST}:{p_port}/health"
    with ProcessGroup(tmp_path) as group:
        prefill = group.start("prefill-1", p_cmd, env=vllm_env("0"))
        decode = group.start("decode", d_cmd, env=vllm_env("1"))
        url = start_router_when_healthy(
            group, router_port, [(HOST, p_port, bootstrap_port)], [(HOST, d_port)],
            [(p_health, prefill), (f"http://{HOST}:{d_port}/health", decode)],
        )  # fmt: skip
        assert_matches_reference(url, str(tiny_model), reference, SAMPLE, "before the restart")

        group.stop(prefill)
        prefill = group.start("prefill-2", p_cmd, env=vllm_env("0"))
        wait_all_healthy([(p_health, prefill)], START_TIMEOUT_S)
        _wait_router_sees_prefill_healthy(url)
        t0 = time.monotonic()
        assert_matches_reference(url, str(tiny_model), reference, SAMPLE, "after the restart")
        took = time.monotonic() - t0
        assert took < KV_WAIT_S / 2, f"{2 * len(SAMPLE)} requests after the restart took {took:.0f} s"
        assert wait_kv_free(f"http://{HOST}:{p_port}") == 0.0
        assert wait_kv_free(f"http://{HOST}:{d_port}") == 0.0
