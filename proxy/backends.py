"""Backend registry: which prefill/decode instance serves a request, and their health."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

import httpx

from proxy.config import Backend, RouterConfig


@dataclass(frozen=True)
class BackendPool:
    """The prefill and decode instances behind the Router."""

    prefillers: tuple[Backend, ...]
    decoders: tuple[Backend, ...]

    @classmethod
    def from_config(cls, config: RouterConfig) -> BackendPool:
        """Build the pool from a validated configuration."""
        if not config.prefillers or not config.decoders:
            raise ValueError("the Router needs at least one prefiller and one decoder")
        return cls(config.prefillers, config.decoders)

    def select(self, room: int) -> tuple[Backend, Backend]:
        """Return ``(P, D)`` for a bootstrap room: ``P = prefillers[room % nP]``, ``D = decoders[room % nD]``.

        The rule is deterministic, so a client retrying with the same room reaches the same pair.
        """
        return self.prefillers[room % len(self.prefillers)], self.decoders[room % len(self.decoders)]


async def probe(client: httpx.AsyncClient, backend: Backend, timeout: float) -> dict[str, Any]:
    """Call ``GET /health`` on one backend; return a JSON-ready status record (never raises)."""
    record: dict[str, Any] = {
        "host": backend.host,
        "port": backend.port,
        "url": backend.base_url,
        "healthy": False,
        "status_code": None,
        "error": None,
    }
    if backend.bootstrap_port is not None:
        record["bootstrap_port"] = backend.bootstrap_port
    try:
        async with asyncio.timeout(timeout):
            response = await client.get(f"{backend.base_url}/health", timeout=timeout)
    except (httpx.HTTPError, TimeoutError) as exc:
        record["error"] = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        return record
    record["status_code"] = response.status_code
    record["healthy"] = response.is_success
    if not response.is_success:
        record["error"] = f"HTTP {response.status_code}"
    return record


async def pool_health(client: httpx.AsyncClient, pool: BackendPool, timeout: float) -> tuple[bool, dict[str, Any]]:
    """Probe every backend at once. Healthy means at least one prefiller and one decoder answer 2xx."""
    records = await asyncio.gather(*(probe(client, b, timeout) for b in (*pool.prefillers, *pool.decoders)))
    prefill = list(records[: len(pool.prefillers)])
    decode = list(records[len(pool.prefillers) :])
    healthy = any(r["healthy"] for r in prefill) and any(r["healthy"] for r in decode)
    body = {"status": "healthy" if healthy else "unhealthy", "prefillers": prefill, "decoders": decode}
    return healthy, body
