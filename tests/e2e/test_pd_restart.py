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

from launch.processes import ProcessGroup, start_pd_stack, vllm_env, wait_all_healthy
from proxy.access.admin_token import admin_headers
from tests.support.serving import (
    PROMPT_LENGTHS,
    START_TIMEOUT_S,
    assert_matches_reference,
    wait_kv_free,
)

pytestmark = pytest.mark.e2e

KV_WAIT_S = 60.0
SAMPLE = [i for i, n in enumerate(PROMPT_LENGTHS) if n in (33, 129)]


def _wait_router_sees_prefill_healthy(url: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        # Every backend's record is the admin's (the token the Router generated, by its port).
        headers = admin_headers(int(url.rsplit(":", 1)[1]))
        health = httpx.get(f"{url}/health", headers=headers, timeout=10, trust_env=False).json()
        if all(p["healthy"] for p in health["prefillers"]):
            return
        time.sleep(0.5)
    raise AssertionError(f"the Router still sees the prefiller as unhealthy: {health}")


def test_decode_follows_a_restarted_prefill(reference: dict, tiny_model: Path, tmp_path: Path) -> None:
    with ProcessGroup(tmp_path) as group:
        stack = start_pd_stack(
            group, tiny_model, extra_d_config={"kv_wait_timeout_s": KV_WAIT_S}, timeout=START_TIMEOUT_S
        )
        url = stack.router_url
        assert_matches_reference(url, str(tiny_model), reference, SAMPLE, "before the restart")

        group.stop(stack.prefill)
        prefill = group.start("prefill-2", stack.prefill.cmd, env=vllm_env("0"))
        wait_all_healthy([(f"{stack.prefill_url}/health", prefill)], START_TIMEOUT_S)
        _wait_router_sees_prefill_healthy(url)
        t0 = time.monotonic()
        assert_matches_reference(url, str(tiny_model), reference, SAMPLE, "after the restart")
        took = time.monotonic() - t0
        assert took < KV_WAIT_S / 2, f"{2 * len(SAMPLE)} requests after the restart took {took:.0f} s"
        assert wait_kv_free(stack.prefill_url) == 0.0
        assert wait_kv_free(stack.decode_url) == 0.0
