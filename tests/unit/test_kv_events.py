"""vLLM's KV cache events (``--kv-events-config``) on P and D with PDConnector: the blocks D received
from P are announced like computed ones (``BlockStored`` once the load finished), and so are the
blocks P prefilled, so a KV-event-aware router (vllm-router ``kv_aware``, ``--pd-kv-events``) sees
both. PDConnector adds no events of its own: vLLM caches a loaded request's blocks itself. Once P's
push is done and the blocks are freed, nothing is announced removed: they stay in P's prefix cache, so
the router keeps sending that prefix to P (tests/e2e/test_kv_event_routing.py, with vllm-router).

Driven through vLLM's real v1 Scheduler (tests/support/real_scheduler) with prefix caching and the
block pool's events on; the published batches are captured at the scheduler's publisher.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.outputs import KVConnectorOutput
from vllm.v1.request import Request

from pd_connector.kv_params import PrefillParams
from tests.support.real_scheduler import BLOCK, D_PARAMS, PROMPT, make_scheduler, step


@pytest.fixture(scope="module")
def model(tiny_model: Path) -> Path:
    return tiny_model


def _events(model: Path, role: str, params: dict[str, Any]) -> list[Any]:
    """The events published while one request with ``params`` runs to its end (P: its push done too)."""
    sched = make_scheduler(model, role, prefix_caching=True)
    sched.kv_cache_manager.block_pool.enable_kv_cache_events = True
    events: list[Any] = []
    sched.kv_event_publisher.publish = lambda batch: events.extend(batch.events)
    init_none_hash(sha256)
    sampling = SamplingParams(max_tokens=2, temperature=0.0, extra_args={"kv_transfer_params": params})
    req = Request("r", list(PROMPT), sampling, None, block_hasher=get_request_block_hasher(BLOCK, sha256))
    if getattr(req, "kv_transfer_params", None) is None:
        req.kv_transfer_params = params
    sched.add_request(req)
    step(sched)
    if role == "kv_consumer":
        step(sched, KVConnectorOutput(finished_recving={"r"}))  # P's KV landed
    for _ in range(4):
        step(sched)
    if role == "kv_producer":
        step(sched, KVConnectorOutput(finished_sending={"r"}))  # D has the KV: P frees the blocks
        pool = sched.kv_cache_manager.block_pool
        assert pool.get_num_free_blocks() == pool.num_gpu_blocks - 1  # all but vLLM's null block
    return events


def _stored_blocks(events: list[Any]) -> int:
    return sum(len(e.block_hashes) for e in events if type(e).__name__ == "BlockStored")


@pytest.mark.parametrize("role", ["kv_consumer", "kv_producer"])
def test_prompt_blocks_are_announced(model: Path, role: str) -> None:
    params = dict(D_PARAMS) if role == "kv_consumer" else PrefillParams(3).to_json()
    events = _events(model, role, params)
    assert _stored_blocks(events) == len(PROMPT) // BLOCK  # every full prompt block
    assert not [e for e in events if type(e).__name__ != "BlockStored"]  # freed, still cached: none removed
