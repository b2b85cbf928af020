"""D's per-request KV accounting inside vLLM's real v1 Scheduler (both vLLM lines CI covers): what a
finished request's ``kv_transfer_params.pd_kv`` says after a healthy load, a first-token continuation, a
failed load vLLM recomputes, a local request, and a repeated prompt that hits D's prefix cache."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.outputs import KVConnectorOutput
from vllm.v1.request import Request

from pd_connector.accounting import ACCOUNT_KEY
from pd_connector.kv_params import DecodeParams
from tests.support.real_scheduler import BLOCK, D_PARAMS, PROMPT, failed_load, make_scheduler, request, step

#: One block of the test scheduler's single layer: K and V, 16 tokens x 1 head x 8 floats.
BLOCK_BYTES = 2 * BLOCK * 1 * 8 * 4


@pytest.fixture(scope="module")
def model(tiny_model: Path) -> Path:
    return tiny_model


def _run(sched: Scheduler, rid: str, kv: dict[int, KVConnectorOutput] | None = None, steps: int = 12) -> Any:
    """Step until ``rid`` finishes (``kv``: the workers' output at step i); its final kv_transfer_params."""
    for i in range(steps):
        _, _, engine_out = step(sched, (kv or {}).get(i))
        for outputs in engine_out.values():
            for out in outputs.outputs:
                if out.request_id == rid and out.finish_reason is not None:
                    return out.kv_transfer_params
    raise AssertionError(f"{rid} did not finish in {steps} steps")


def _account(params: Any) -> dict[str, Any]:
    assert isinstance(params, dict) and isinstance(params.get(ACCOUNT_KEY), dict), params
    return params[ACCOUNT_KEY]


def test_healthy_load_is_all_pushed(model: Path) -> None:
    sched = make_scheduler(model, "kv_consumer")
    sched.add_request(request("d-1", dict(D_PARAMS)))
    account = _account(_run(sched, "d-1", {1: KVConnectorOutput(finished_recving={"d-1"})}))
    assert account["pushed_tokens"] == len(PROMPT)  # the last token vLLM reruns came from P too
    assert (account["prefix_hit_tokens"], account["recomputed_tokens"], account["recompute_reason"]) == (0, 0, "none")
    assert account["kv_bytes"] == 4 * BLOCK_BYTES  # 3 full blocks and a partial one
    assert account["transfer_ms"] is not None and account["transfer_ms"] >= 0


def test_first_token_continuation_computes_the_appended_token(model: Path) -> None:
    sched = make_scheduler(model, "kv_consumer")
    params = DecodeParams(99, "127.0.0.1", 18800, 0, prefilled_tokens=len(PROMPT)).to_json()
    sched.add_request(request("d-c", params, prompt=[*PROMPT, 4242]))
    account = _account(_run(sched, "d-c", {1: KVConnectorOutput(finished_recving={"d-c"})}))
    assert (account["pushed_tokens"], account["recomputed_tokens"]) == (len(PROMPT), 1)
    assert account["recompute_reason"] == "prefilled_part"


def test_failed_load_recomputed_names_its_reason(model: Path) -> None:
    sched = make_scheduler(model, "kv_consumer", policy="recompute")
    sched.add_request(request("d-f", dict(D_PARAMS)))
    _, meta, _ = step(sched)
    (job,) = meta.recvs
    account = _account(_run(sched, "d-f", {0: failed_load("d-f", job.dst_block_ids)}))
    assert account["pushed_tokens"] == 0 and account["recomputed_tokens"] == len(PROMPT)
    assert account["recompute_reason"] == "load_failed" and account["kv_bytes"] == 0


def test_local_request_is_recomputed_for_want_of_params(model: Path) -> None:
    sched = make_scheduler(model, "kv_consumer")
    sched.add_request(request("d-l", {}))
    account = _account(_run(sched, "d-l"))
    assert (account["pushed_tokens"], account["recomputed_tokens"]) == (0, len(PROMPT))
    assert account["recompute_reason"] == "no_kv_transfer_params" and account["transfer_ms"] is None


def _hashed(rid: str, params: dict[str, Any]) -> Request:
    """A request whose blocks vLLM's prefix cache can find (block hashes)."""
    sampling = SamplingParams(max_tokens=4, temperature=0.0, extra_args={"kv_transfer_params": params})
    req = Request(rid, list(PROMPT), sampling, None, block_hasher=get_request_block_hasher(BLOCK, sha256))
    if getattr(req, "kv_transfer_params", None) is None:
        req.kv_transfer_params = params
    return req


def test_repeated_prompt_hits_the_prefix_cache_and_loads_the_rest(model: Path) -> None:
    sched = make_scheduler(model, "kv_consumer", prefix_caching=True)
    init_none_hash(sha256)
    sched.add_request(_hashed("d-a", dict(D_PARAMS)))
    _account(_run(sched, "d-a", {1: KVConnectorOutput(finished_recving={"d-a"})}))
    sched.add_request(_hashed("d-b", DecodeParams(100, "127.0.0.1", 18800, 0).to_json()))
    account = _account(_run(sched, "d-b", {1: KVConnectorOutput(finished_recving={"d-b"})}))
    hit = (len(PROMPT) - 1) // BLOCK * BLOCK  # whole blocks, never the last token
    assert (account["prefix_hit_tokens"], account["pushed_tokens"]) == (hit, len(PROMPT) - hit)
    assert account["recomputed_tokens"] == 0 and account["kv_bytes"] == BLOCK_BYTES
