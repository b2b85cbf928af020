"""D2RH mode (pd_connector.d2rh.scheduler) inside vLLM's real v1 Scheduler, on both vLLM lines CI covers.

The workers are simulated by the ModelRunnerOutput each step hands the scheduler: the staging
outcome and the host copies done come back as PDConnector's worker metadata (D2RHWorkerMeta),
vLLM's own channel from workers to the scheduler side.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.outputs import KVConnectorOutput
from vllm.v1.request import Request, RequestStatus

from pd_connector.ascend import metaserver as ms
from pd_connector.config import ConfigError, parse_config
from pd_connector.d2rh.host_kv import d2rh_scheduler
from pd_connector.d2rh.host_pool import HostPool
from pd_connector.d2rh.scheduler import D2RHScheduler, D2RHState, D2RHWorkerMeta
from pd_connector.kv_params import DecodeParams
from pd_connector.scheduler import PDScheduler
from pd_connector.scheduling.d2rh import D2RHExtension
from pd_connector.scheduling.decode_first import DecodeFirstExtension
from tests.support.fake_scheduler import FakeRequest, meta
from tests.support.real_scheduler import BLOCK, FAILED_BY_ID, NUM_BLOCKS, PROMPT, make_scheduler, step

init_none_hash(sha256)
HASHER = get_request_block_hasher(BLOCK, sha256)


@pytest.fixture(scope="module")
def model(tiny_model: Path) -> Path:
    return tiny_model


def d2rh_request(rid: str, room: int, prompt: list[int] | None = None) -> Request:
    params = DecodeParams(room, "127.0.0.1", 18800, 0).to_json()
    sampling = SamplingParams(max_tokens=4, temperature=0.0, extra_args={"kv_transfer_params": params})
    req = Request(rid, list(PROMPT if prompt is None else prompt), sampling, None, block_hasher=HASHER)
    if getattr(req, "kv_transfer_params", None) is None:
        req.kv_transfer_params = params
    return req


def staged(rid: str, failed: bool = False) -> KVConnectorOutput:
    return KVConnectorOutput(kv_connector_worker_meta=D2RHWorkerMeta(staged={rid: [1, int(failed)]}))


def loaded(rid: str) -> KVConnectorOutput:
    return KVConnectorOutput(finished_recving={rid}, kv_connector_worker_meta=D2RHWorkerMeta(loaded={rid: 1}))


def used_blocks(sched: Any) -> int:
    """Device blocks in use (vLLM's pool counts its null block as used)."""
    return NUM_BLOCKS - 1 - sched.kv_cache_manager.block_pool.get_num_free_blocks()


def d2rh_of(sched: Any) -> Any:
    extension = sched.connector._scheduler.extension(D2RHExtension)
    assert extension is not None  # the connector chose it: d2rh on a decode instance
    return extension.d2rh


def test_no_device_block_until_the_host_copy_is_ready(model: Path) -> None:
    sched = make_scheduler(model, "kv_consumer", d2rh=True)
    sched.add_request(d2rh_request("d-1", 7))
    out, meta, _ = step(sched)
    (job,) = meta.host_stages
    assert not meta.recvs and not meta.host_loads
    assert (job.room, job.start_block, job.dst_block_ids) == (7, 0, [0, 1, 2, 3])  # host block ids
    assert "d-1" not in out.num_scheduled_tokens
    assert sched.requests["d-1"].status == RequestStatus.WAITING
    assert used_blocks(sched) == 0  # the transfer is in flight; D holds no device block of it
    for _ in range(3):
        out, meta, _ = step(sched)  # still staging: asked again, still nothing held
        assert "d-1" not in out.num_scheduled_tokens and not meta.host_stages and used_blocks(sched) == 0
    step(sched, staged("d-1"))
    out, meta, _ = step(sched)
    (load,) = meta.host_loads
    assert load.host_block_ids == [0, 1, 2, 3] and len(load.dst_block_ids) == 4 and not load.failed
    assert sched.requests["d-1"].status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert used_blocks(sched) == 4
    step(sched, loaded("d-1"))
    out, _, _ = step(sched)
    assert out.num_scheduled_tokens.get("d-1") == 1  # the last prompt token, then decoding
    pool = d2rh_of(sched).pool
    assert (pool.pinned, pool.cached) == (0, 3)  # 3 full blocks cached by hash; the partial one freed


def test_a_repeat_loads_from_the_host_pool_without_asking_prefill(model: Path) -> None:
    sched = make_scheduler(model, "kv_consumer", d2rh=True)
    sched.add_request(d2rh_request("d-1", 7))
    step(sched)
    step(sched, staged("d-1"))
    step(sched)
    step(sched, loaded("d-1"))
    sched.add_request(d2rh_request("d-2", 8))  # same prompt, another room
    out, meta, _ = step(sched)
    assert not meta.host_stages and not meta.recvs  # P is not asked for a block
    assert [(j.req_id, j.room, j.dst_block_ids) for j in meta.abandoned] == [("d-2", 8, [])]  # P frees the room
    (load,) = meta.host_loads
    assert load.hit_blocks == 3 and len(load.host_block_ids) == 3
    step(sched, loaded("d-2"))
    out, _, _ = step(sched)
    assert out.num_scheduled_tokens.get("d-2") == len(PROMPT) - 3 * BLOCK  # the partial block, computed on D
    assert d2rh_of(sched).pool.pinned == 0


def test_abort_while_staging_frees_host_blocks_only_when_the_staging_ended(model: Path) -> None:
    sched = make_scheduler(model, "kv_consumer", d2rh=True)
    sched.add_request(d2rh_request("d-1", 7))
    step(sched)
    sched.finish_requests("d-1", RequestStatus.FINISHED_ABORTED)
    out, meta, _ = step(sched)
    assert not meta.abandoned  # P was asked already: the worker's cancel tells it
    d2rh = d2rh_of(sched)
    assert d2rh.state("d-1") is D2RHState.ORPHANED and d2rh.pool.pinned == 4  # P may still write there
    step(sched, staged("d-1", failed=True))  # the cancelled load ended: every P rank stopped
    assert d2rh.state("d-1") is None and (d2rh.pool.pinned, d2rh.pool.cached, d2rh.pool.used) == (0, 0, 0)


def test_a_failed_staging_reaches_vllm_as_a_failed_load(model: Path) -> None:
    sched = make_scheduler(model, "kv_consumer", policy="fail", d2rh=True)
    sched.add_request(d2rh_request("d-1", 7))
    step(sched)
    step(sched, staged("d-1", failed=True))
    assert d2rh_of(sched).pool.used == 0  # nothing cached from a failed staging
    _, meta, _ = step(sched)
    (load,) = meta.host_loads
    assert load.failed and not load.host_block_ids
    if FAILED_BY_ID:
        kv = KVConnectorOutput(finished_recving={"d-1"}, failed_recving={"d-1"})
    else:
        kv = KVConnectorOutput(finished_recving={"d-1"}, invalid_block_ids=set(load.dst_block_ids))
    step(sched, kv)
    out, _, _ = step(sched)
    assert "d-1" not in out.num_scheduled_tokens and "d-1" not in sched.requests  # ended (policy fail)


def test_a_full_pool_makes_requests_wait_holding_nothing_then_evicts_lru(model: Path) -> None:
    sched = make_scheduler(model, "kv_consumer", d2rh=True, host_pool_blocks=4)
    other = [p + 1000 for p in PROMPT]
    sched.add_request(d2rh_request("d-1", 7))
    sched.add_request(d2rh_request("d-2", 8, prompt=other))
    out, meta, _ = step(sched)
    assert [j.req_id for j in meta.host_stages] == ["d-1"]
    assert d2rh_of(sched).state("d-2") is D2RHState.WAITING_POOL and used_blocks(sched) == 0
    step(sched, staged("d-1"))
    step(sched)
    _, meta, _ = step(sched, loaded("d-1"))  # d-1's 3 full blocks stay cached, evictable
    stages = meta.host_stages
    if not stages:
        _, meta, _ = step(sched)
        stages = meta.host_stages
    assert [j.req_id for j in stages] == ["d-2"]  # took the free block and evicted d-1's cached ones
    assert d2rh_of(sched).pool.evictions == 3


def test_a_prompt_larger_than_the_pool_is_computed_on_decode(model: Path) -> None:
    sched = make_scheduler(model, "kv_consumer", d2rh=True, host_pool_blocks=2)
    sched.add_request(d2rh_request("d-1", 7))
    out, meta, _ = step(sched)
    assert not meta.host_stages and [j.room for j in meta.abandoned] == [7]
    assert out.num_scheduled_tokens.get("d-1") == len(PROMPT)


def test_worker_meta_aggregates_over_ranks() -> None:
    a = D2RHWorkerMeta(staged={"r": [1, 0]}, loaded={"x": 1})
    b = D2RHWorkerMeta(staged={"r": [1, 1]}, loaded={"x": 1, "y": 1})
    a.aggregate(b)
    assert a.staged == {"r": [2, 1]} and a.loaded == {"x": 2, "y": 1}
    assert not D2RHWorkerMeta()


def test_d2rh_keys_accept_vllm_ascend_names() -> None:
    seed = {"d2rh_zmq_port": 38100, "d2rh_scheduler_ready_port": 38200}  # vLLM-Ascend's D2RH decode config
    cfg = parse_config("kv_consumer", seed)
    assert (
        cfg.d2rh and cfg.host_pool_blocks == 0 and (cfg.d2rh_zmq_port, cfg.d2rh_scheduler_ready_port) == (38100, 38200)
    )
    assert not parse_config("kv_consumer", {**seed, "d2rh": False}).d2rh
    assert not parse_config("kv_consumer", {}).d2rh
    assert parse_config("kv_consumer", {"d2rh": True, "host_pool_blocks": 512}).host_pool_blocks == 512
    for bad in ({"d2rh_zmq_port": 0}, {"d2rh_scheduler_ready_port": 70000}, {"host_pool_blocks": -1}):
        with pytest.raises(ConfigError, match=next(iter(bad))):
            parse_config("kv_consumer", bad)


def test_hybrid_models_are_refused_in_d2rh_mode(model: Path) -> None:
    with pytest.raises(ConfigError, match="one KV cache group"):
        d2rh_scheduler(parse_config("kv_consumer", {"d2rh": True}), None, None, BLOCK, 2)  # type: ignore[arg-type]


def test_d_first_posts_to_the_metaserver_once_its_staging_is_planned() -> None:
    """vLLM-Ascend's layer-wise proxy in front of a D2RH decoder: D posts when its host blocks are planned."""
    proxy = "http://127.0.0.1:8000/v1/metaserver"
    posts: list[ms.Post] = []
    cfg = parse_config("kv_consumer", {"d2rh": True})
    first = ms.DecodeFirst(cfg, SimpleNamespace(submit=posts.append))  # type: ignore[arg-type]
    d2rh = D2RHExtension(D2RHScheduler(HostPool(8), 16, 1, 30.0))
    sched = PDScheduler(cfg, block_size=16, extensions=[DecodeFirstExtension(first), d2rh])
    params = {"do_remote_decode": False, "do_remote_prefill": True, "metaserver": proxy}
    req = FakeRequest("cmpl-u-0-0123abcd", params, 40)
    assert sched.get_num_new_matched_tokens(req, 0) == (None, False)  # type: ignore[arg-type]
    (post,) = posts
    (job,) = meta(sched).host_stages
    assert post.room == job.room and job.dst_block_ids == [0, 1, 2]
    assert sched.get_num_new_matched_tokens(req, 0) == (None, False)  # type: ignore[arg-type]
    assert len(posts) == 1
