"""What a draining instance still holds, read from its ``/metrics`` (:mod:`proxy.admin.drain`'s last step).

Once the Router has nothing in flight on a drained instance, its Prometheus ``/metrics`` is read
until the gauges of :func:`held_metric_names` sum to 0: running and waiting requests, KV loads waiting,
rooms whose KV no decoder loaded yet (and, on a decoder with ``migration``, KV held for a move).
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING

from prometheus_client.parser import text_string_to_metric_families

from proxy.upstream.calls import Failure, fetch

if TYPE_CHECKING:
    from proxy.router_state import Router
    from proxy.upstream.pool import BackendState

#: How often the instance's ``/metrics`` is read once the Router has nothing in flight there.
METRICS_POLL_S = 0.25
#: What an instance still holds, by role: metric names whose sum must reach 0.
HELD_METRICS: dict[str, tuple[str, ...]] = {
    "decode": (
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:pd_kv_loads_waiting",
        "vllm:pd_kv_rooms_held",  # KV held for a move by KV, until pushed or expired
    ),
    "prefill": ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:pd_kv_rooms_held"),
}
#: What one side of a kv_both instance holds while its other side keeps serving (that side's
#: requests are in the instance's running and waiting gauges too): a prefiller's rooms not loaded
#: yet, a decoder's KV loads waiting.
HELD_METRICS_ONE_SIDE: dict[str, tuple[str, ...]] = {
    "decode": ("vllm:pd_kv_loads_waiting",),
    "prefill": ("vllm:pd_kv_rooms_held",),
}
#: A decoder's KV pushed to others (a move by KV), bytes (the counter's sample name).
SENT_BYTES = "vllm:pd_kv_sent_bytes_total"


def held_metric_names(router: Router, state: BackendState) -> tuple[str, ...]:
    """The metrics whose sum must reach 0 once ``state`` (draining) holds nothing: its role's, or
    only its own side's when it is one side of a kv_both instance whose other side is active."""
    backend = state.backend
    other = "decode" if backend.role == "prefill" else "prefill"
    if backend.both and router.pool.find(other, backend.host, backend.port) is not None:
        return HELD_METRICS_ONE_SIDE[backend.role]
    return HELD_METRICS[backend.role]


def held_counts(text: str, names: tuple[str, ...]) -> dict[str, float]:
    """The sums of ``names``' samples in Prometheus ``text`` (names absent there are left out)."""
    wanted = set(names)
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in wanted:
                out[sample.name] = out.get(sample.name, 0.0) + sample.value
    return out


async def instance_metrics(router: Router, state: BackendState, deadline: float) -> str | None:
    """The instance's ``/metrics`` text (None: not answered)."""
    config = router.config
    headers = {"Authorization": config.backend_authorization} if config.backend_authorization else None
    left = deadline - time.monotonic()
    reply = await fetch(router.http, state, "GET", "/metrics", max(0.5, min(5.0, left)), None, headers)
    if isinstance(reply, Failure) or reply.status != 200:
        return None
    return reply.body.decode("utf-8", "replace")


async def sent_bytes(router: Router, state: BackendState, deadline: float) -> float | None:
    """The KV bytes the instance has pushed so far (None: no such metric, or no answer)."""
    text = await instance_metrics(router, state, deadline)
    return None if text is None else held_counts(text, (SENT_BYTES,)).get(SENT_BYTES)


async def wait_empty(router: Router, state: BackendState, deadline: float) -> dict[str, float] | None:
    """Read the instance's ``/metrics`` until it holds nothing (or the deadline); its last
    counts, None when it has no such metrics (not vLLM, or not answering)."""
    names = held_metric_names(router, state)
    while True:
        text = await instance_metrics(router, state, deadline)
        if text is None:
            return None
        held = held_counts(text, names)
        if not held:
            return None
        if not any(v > 0 for v in held.values()) or time.monotonic() + METRICS_POLL_S > deadline:
            return held
        await asyncio.sleep(METRICS_POLL_S)
