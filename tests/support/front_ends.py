"""Helpers of the e2e tests that put other PD routers (vllm-router, sglang-router) in front of P and D.

The vllm-router binary, PDConnector's bypass counter (read with tests.support.metrics),
and waiting until a freshly started router routes (it registers its workers in the background).
"""

from __future__ import annotations

import shutil
import sys
import time
from pathlib import Path

import httpx

from tests.support.metrics import metric
from tests.support.serving import complete

PUSHES = "vllm:pd_kv_pushes_total"
BYPASSED = "vllm:pd_requests_without_transfer_total"
#: Reasons of BYPASSED that mean PD was not used (D's prefix_cached / window_recompute are expected).
MISROUTED = ("no_kv_transfer_params", "malformed_kv_transfer_params", "no_transfer_asked", "wrong_role")


def vllm_router_binary() -> str | None:
    """The ``vllm-router`` of this interpreter's environment, else the one on PATH, else None."""
    local = Path(sys.executable).parent / "vllm-router"
    return str(local) if local.is_file() else shutil.which("vllm-router")


def misrouted(url: str) -> float:
    """Requests ``url`` served without a KV transfer for a reason that means PD was not used."""
    return sum(metric(url, BYPASSED, reason=r) for r in MISROUTED)


def wait_routable(url: str, model: str, timeout: float = 60.0) -> None:
    """The router answers a completion (its workers are registered in the background)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            complete(url, model, "warm", stream=False, max_tokens=1)
            return
        except (AssertionError, httpx.HTTPError):
            if time.monotonic() > deadline:
                raise
            time.sleep(1.0)
