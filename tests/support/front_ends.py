"""Helpers of the e2e tests that put other PD routers (vllm-router, sglang-router) in front of P and D.

The vllm-router binary, samples of an instance's Prometheus /metrics, PDConnector's bypass counter,
and waiting until a freshly started router routes (it registers its workers in the background).
"""

from __future__ import annotations

import re
import shutil
import sys
import time
from pathlib import Path

import httpx

from tests.support.serving import complete

PUSHES = "vllm:pd_kv_pushes_total"
BYPASSED = "vllm:pd_requests_without_transfer_total"
#: Reasons of BYPASSED that mean PD was not used (D's prefix_cached / window_recompute are expected).
MISROUTED = ("no_kv_transfer_params", "malformed_kv_transfer_params", "no_transfer_asked", "wrong_role")


def vllm_router_binary() -> str | None:
    """The ``vllm-router`` of this interpreter's environment, else the one on PATH, else None."""
    local = Path(sys.executable).parent / "vllm-router"
    return str(local) if local.is_file() else shutil.which("vllm-router")


def metric(url: str, name: str, **labels: str) -> float:
    """Sum of ``name``'s samples on ``url``'s /metrics whose labels include ``labels``."""
    text = httpx.get(f"{url}/metrics", timeout=10, trust_env=False).text
    total = 0.0
    for m in re.finditer(rf"^{re.escape(name)}(\{{[^}}]*\}})?\s+(\S+)$", text, re.M):
        if all(f'{k}="{v}"' in (m.group(1) or "") for k, v in labels.items()):
            total += float(m.group(2))
    return total


def misrouted(url: str) -> float:
    """Requests ``url`` served without a KV transfer for a reason that means PD was not used."""
    return sum(metric(url, BYPASSED, reason=r) for r in MISROUTED)


def wait_metric(url: str, name: str, at_least: float, timeout: float = 20.0, **labels: str) -> float:
    """Poll ``name`` on ``url`` until it reaches ``at_least`` or ``timeout`` passes; returns the last value."""
    deadline = time.monotonic() + timeout
    value = metric(url, name, **labels)
    while value < at_least and time.monotonic() < deadline:
        time.sleep(0.5)
        value = metric(url, name, **labels)
    return value


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
