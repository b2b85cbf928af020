"""vLLM's real v1 Scheduler with PDConnector, built through KVConnectorFactory from a real VllmConfig,
and the steps that drive it: the workers are simulated by the ModelRunnerOutput each step hands it."""

from __future__ import annotations

import dataclasses
import inspect
from pathlib import Path
from typing import Any

import torch
from vllm.config import CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig, SchedulerConfig, VllmConfig
from vllm.sampling_params import SamplingParams
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

import pd_connector
from pd_connector.connector import PDConnector
from pd_connector.kv_params import DecodeParams
from pd_connector.metadata import PDConnectorMetadata

BLOCK = 16
NUM_BLOCKS = 64
PROMPT = list(range(5, 5 + 3 * BLOCK + 4))  # 3 full blocks and a partial one
FAILED_BY_ID = "failed_recving" in {f.name for f in dataclasses.fields(KVConnectorOutput)}  # vLLM >= 0.32


def make_scheduler(
    model: Path,
    role: str,
    policy: str = "fail",
    groups: list[KVCacheGroupSpec] | None = None,
    prefix_caching: bool = False,
    **extra: Any,
) -> Scheduler:
    """A real Scheduler with PDConnector; ``groups``: its KV cache groups (default one full-attention group)."""
    pd_connector.register()
    model_config = ModelConfig(model=str(model), dtype="float32", max_model_len=1024, seed=0)
    kwargs: dict[str, Any] = {
        "max_num_seqs": 8,
        "max_num_batched_tokens": 1024,
        "max_model_len": 1024,
        "enable_chunked_prefill": True,
    }
    if "is_encoder_decoder" in inspect.signature(SchedulerConfig).parameters:
        kwargs["is_encoder_decoder"] = False
    config = VllmConfig(
        model_config=model_config,
        cache_config=CacheConfig(block_size=BLOCK, enable_prefix_caching=prefix_caching),
        scheduler_config=SchedulerConfig(**kwargs),
        kv_transfer_config=KVTransferConfig(
            kv_connector="PDConnector",
            kv_role=role,
            kv_connector_extra_config={"bootstrap_port": 18800, **extra},
            kv_load_failure_policy=policy,
        ),
        device_config=DeviceConfig("cpu"),
    )
    config.cache_config.num_gpu_blocks = NUM_BLOCKS
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=8, dtype=torch.float32)
    groups = groups or [KVCacheGroupSpec(["layer.0"], spec)]
    kv_cache_config = KVCacheConfig(num_blocks=NUM_BLOCKS, kv_cache_tensors=[], kv_cache_groups=groups)
    sched = Scheduler(
        vllm_config=config,
        kv_cache_config=kv_cache_config,
        structured_output_manager=StructuredOutputManager(config),
        block_size=BLOCK,
        log_stats=True,
    )
    assert isinstance(sched.connector, PDConnector)
    return sched


def request(rid: str, params: dict[str, Any], max_tokens: int = 4, prompt: list[int] | None = None) -> Request:
    sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0, extra_args={"kv_transfer_params": params})
    req = Request(rid, list(PROMPT if prompt is None else prompt), sampling, None)
    if getattr(req, "kv_transfer_params", None) is None:
        req.kv_transfer_params = params
    return req


def runner_output(scheduled: Any, kv: KVConnectorOutput | None = None, token: int = 7) -> ModelRunnerOutput:
    rids = list(scheduled.num_scheduled_tokens)
    return ModelRunnerOutput(
        req_ids=rids,
        req_id_to_index={r: i for i, r in enumerate(rids)},
        sampled_token_ids=[[token] for _ in rids],
        logprobs=None,
        prompt_logprobs_dict={},
        pooler_output=[],
        kv_connector_output=kv,
    )


def step(sched: Scheduler, kv: KVConnectorOutput | None = None) -> tuple[Any, PDConnectorMetadata, Any]:
    out = sched.schedule()
    meta = out.kv_connector_metadata
    assert isinstance(meta, PDConnectorMetadata)
    engine_out = sched.update_from_output(out, runner_output(out, kv))
    return out, meta, engine_out


def failed_load(rid: str, blocks: list[int]) -> KVConnectorOutput:
    if FAILED_BY_ID:
        return KVConnectorOutput(finished_recving={rid}, failed_recving={rid})
    return KVConnectorOutput(finished_recving={rid}, invalid_block_ids=set(blocks))


D_PARAMS = DecodeParams(room=99, bootstrap_host="127.0.0.1", bootstrap_port=18800, prefill_dp_rank=0).to_json()
