"""Reading an instance's or a Router's Prometheus ``/metrics`` in the e2e and Router tests."""

from __future__ import annotations

import re
import time

import httpx


def metric(url: str, name: str, **labels: str) -> float:
    """Sum of every sample of ``name`` on ``url``'s /metrics whose labels include ``labels``."""
    text = httpx.get(f"{url}/metrics", timeout=10, trust_env=False).text
    total = 0.0
    for m in re.finditer(rf"^{re.escape(name)}(?:\{{(.*?)\}})?\s+(\S+)$", text, re.M):
        have = dict(re.findall(r'(\w+)="([^"]*)"', m[1] or ""))
        if all(have.get(k) == v for k, v in labels.items()):
            total += float(m[2])
    return total


def wait_metric(url: str, name: str, at_least: float, timeout: float = 20.0, **labels: str) -> float:
    """Poll ``name`` until it reaches ``at_least`` or ``timeout`` passes; returns the last value read."""
    deadline = time.monotonic() + timeout
    while (value := metric(url, name, **labels)) < at_least and time.monotonic() < deadline:
        time.sleep(0.25)
    return value
