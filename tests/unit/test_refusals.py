"""Start-up refusals (pd_connector.refusals) against vLLM's real config and KV cache spec classes, on both
vLLM lines: recurrent-state models outside the hybrid case PDConnector moves (pd_connector.layouts.state_groups),
context parallel, micro-batching with layer mode; what kv_port and engine_id do; and the ascend
transport's device name with PP > 1 (rank_checks.backend_config)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from vllm.config import KVTransferConfig, ParallelConfig
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
)

from pd_connector.config import ConfigError, parse_config
from pd_connector.connector import PDConnector
from pd_connector.layouts.state_groups import MIN_VLLM, vllm_version
from pd_connector.rank_checks import backend_config
from pd_connector.refusals import (
    UnsupportedSetupError,
    context_parallel_problem,
    note_kv_transfer_fields,
    refuse_unsupported,
)
from pd_connector.transfer.mooncake import MooncakeOptions
from tests.support.real_scheduler import make_scheduler

BLOCK = 16


def attention(block: int = BLOCK) -> FullAttentionSpec:
    return FullAttentionSpec(block_size=block, num_kv_heads=2, head_size=32, dtype=torch.float32)


def gdn_state(block: int = BLOCK, **kwargs: object) -> MambaSpec:
    """A gated-delta-net layer's state as vLLM 0.32 gives a tiny Qwen3-Next (conv state, recurrent state)."""
    return MambaSpec(
        block_size=block,
        shapes=((3, 512), (2, 128, 128)),
        dtypes=(torch.bfloat16, torch.float32),
        mamba_type=MambaAttentionBackendEnum.GDN_ATTN,
        **kwargs,  # type: ignore[arg-type]
    )


def qwen3_next_groups(**state: object) -> list[KVCacheGroupSpec]:
    """The two groups vLLM gives a 4-layer Qwen3-Next (layers 0, 2 linear attention; 1, 3 full).

    ``state``: MambaSpec fields (the default ``mamba_cache_mode`` is 'none', prefix caching off)."""
    return [
        KVCacheGroupSpec(["model.layers.0.linear_attn", "model.layers.2.linear_attn"], gdn_state(**state)),
        KVCacheGroupSpec(["model.layers.1.self_attn.attn", "model.layers.3.self_attn.attn"], attention()),
    ]


SUPPORTED_LINE = vllm_version() >= MIN_VLLM


def kv_config(groups: list[KVCacheGroupSpec]) -> KVCacheConfig:
    return KVCacheConfig(num_blocks=64, kv_cache_tensors=[], kv_cache_groups=groups)


def stand_in(parallel: ParallelConfig | None = None, **model: object) -> SimpleNamespace:
    """A vllm_config with vLLM's real ParallelConfig and a stand-in model config."""
    return SimpleNamespace(parallel_config=parallel or ParallelConfig(), model_config=SimpleNamespace(**model))


# ------------------------------------------------------------ recurrent state (Mamba / GDN)


@pytest.mark.skipif(not SUPPORTED_LINE, reason="PDConnector moves recurrent state on vLLM >= 0.32 only")
def test_real_scheduler_takes_a_gated_delta_net_hybrid_without_prefix_caching(tiny_model: Path) -> None:
    """vLLM >= 0.32, state in one block per request (mamba_cache_mode 'none'), TP 1, request mode: served."""
    sched = make_scheduler(tiny_model, "kv_producer", groups=qwen3_next_groups())
    assert isinstance(sched.connector, PDConnector)


def test_real_scheduler_refuses_a_hybrid_whose_state_follows_prefix_caching(tiny_model: Path) -> None:
    """mamba_cache_mode 'align' (prefix caching on): refused naming the layer kinds, the mode and the fix."""
    with pytest.raises(UnsupportedSetupError) as err:
        make_scheduler(tiny_model, "kv_producer", groups=qwen3_next_groups(mamba_cache_mode="align"))
    text = str(err.value)
    assert "MambaSpec (GDN_ATTN): 2 layers (model.layers.0.linear_attn, model.layers.2.linear_attn)" in text
    assert "FullAttentionSpec: 2 layers" in text
    assert "mamba_cache_mode ['align']" in text and "--no-enable-prefix-caching" in text
    assert "serve this model colocated" in text
    assert isinstance(err.value, ConfigError)


@pytest.mark.parametrize(
    ("extra", "parallel", "state", "named"),
    [
        ({"transfer_mode": "layer"}, {}, {}, "transfer_mode 'layer'"),
        ({"d2rh": True}, {}, {}, "d2rh"),
        ({"migration": True, "bootstrap_port": 18900}, {}, {}, "migration"),
        ({}, {"tensor_parallel_size": 2}, {}, "--tensor-parallel-size 2"),
        ({}, {"pipeline_parallel_size": 2}, {}, "--pipeline-parallel-size 2"),
        ({}, {}, {"num_speculative_blocks": 2}, "speculative decoding (2 speculative state blocks)"),
    ],
)
def test_hybrid_outside_the_supported_case_is_refused_naming_what_differs(
    extra: dict[str, object], parallel: dict[str, int], state: dict[str, object], named: str
) -> None:
    cfg = parse_config("kv_consumer", extra)
    config = stand_in(ParallelConfig(**parallel), architectures=["Qwen3NextForCausalLM"])
    with pytest.raises(UnsupportedSetupError) as err:
        refuse_unsupported(cfg, config, kv_config(qwen3_next_groups(**state)))
    text = str(err.value)
    assert f"this instance: {named}" in text or f", {named}" in text, text
    assert text.startswith("PDConnector cannot serve this decode instance: Qwen3NextForCausalLM has layers")


@pytest.mark.parametrize("role", [KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER])
def test_every_side_refuses_a_mamba2_model(role: KVConnectorRole) -> None:
    """A plain Mamba2 model (one MambaSpec group) is refused by the scheduler side and every worker."""
    mamba2 = MambaSpec(block_size=512, shapes=((3, 288), (8, 32, 16)), dtypes=(torch.float32, torch.float32))
    groups = [KVCacheGroupSpec(["backbone.layers.0.mixer", "backbone.layers.1.mixer"], mamba2)]
    config = stand_in(architectures=["Mamba2ForCausalLM"])
    config.kv_transfer_config = KVTransferConfig(kv_connector="PDConnector", kv_role="kv_consumer")
    with pytest.raises(UnsupportedSetupError, match=r"decode instance: Mamba2ForCausalLM has layers .*MAMBA2") as err:
        PDConnector(config, role, kv_config(groups))  # type: ignore[arg-type]
    assert "the model has no attention layers (attention-free)" in str(err.value)


def test_attention_groups_pass() -> None:
    """Full, sliding-window and MLA attention groups are KV PDConnector moves: nothing is refused."""
    sliding = SlidingWindowSpec(block_size=BLOCK, num_kv_heads=2, head_size=32, dtype=torch.float32, sliding_window=64)
    mla = MLAAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=576, dtype=torch.float32)
    groups = [KVCacheGroupSpec(["a"], attention()), KVCacheGroupSpec(["b"], sliding), KVCacheGroupSpec(["c"], mla)]
    refuse_unsupported(parse_config("kv_producer", {}), stand_in(is_hybrid=False), kv_config(groups))


def test_model_flags_refuse_when_the_groups_are_unknown() -> None:
    """No KV cache config: vLLM's own model flags (is_hybrid, is_attention_free) decide."""
    cfg = parse_config("kv_producer", {})
    with pytest.raises(UnsupportedSetupError, match="JambaForCausalLM is a model vLLM reports as is_hybrid"):
        refuse_unsupported(cfg, stand_in(architectures=["JambaForCausalLM"], is_hybrid=True), None)
    refuse_unsupported(cfg, stand_in(is_hybrid=False, is_attention_free=False), None)


# ------------------------------------------------------------ context parallel, micro-batching


@pytest.mark.parametrize(
    ("kwargs", "named"),
    [
        ({"tensor_parallel_size": 2, "decode_context_parallel_size": 2}, "--decode-context-parallel-size (-dcp) is 2"),
        ({"prefill_context_parallel_size": 2}, "--prefill-context-parallel-size (-pcp) is 2"),
    ],
)
def test_context_parallel_is_refused_naming_the_setting(kwargs: dict[str, int], named: str) -> None:
    parallel = ParallelConfig(**kwargs)  # type: ignore[arg-type]
    for role in ("kv_producer", "kv_consumer"):
        with pytest.raises(UnsupportedSetupError) as err:
            refuse_unsupported(parse_config(role, {}), stand_in(parallel), None)
        assert named in str(err.value) and "vLLM-Ascend's" in str(err.value)
    assert context_parallel_problem(ParallelConfig()) is None


@pytest.mark.parametrize(
    ("kwargs", "named"), [({"enable_dbo": True}, "--enable-dbo"), ({"ubatch_size": 2}, "--ubatch-size 2")]
)
def test_micro_batching_is_refused_with_layer_mode_only(kwargs: dict[str, object], named: str) -> None:
    parallel = ParallelConfig(**kwargs)  # type: ignore[arg-type]
    layer = parse_config("kv_producer", {"transfer_mode": "layer"})
    with pytest.raises(UnsupportedSetupError, match=f"{named}.* with kv_connector_extra_config.transfer_mode 'layer'"):
        refuse_unsupported(layer, stand_in(parallel), None)
    refuse_unsupported(parse_config("kv_producer", {}), stand_in(parallel), None)  # request mode: fine
    refuse_unsupported(parse_config("kv_consumer", {}), stand_in(parallel), None)


# ------------------------------------------------------------ kv_port, engine_id


def test_kv_port_and_engine_id_are_explained(pd_logs: pytest.LogCaptureFixture) -> None:
    cfg = parse_config("kv_producer", {"bootstrap_port": 18800})
    kv = KVTransferConfig(kv_connector="PDConnector", kv_role="kv_producer", kv_port=36000, engine_id="p-node-0")
    port_line, id_line = note_kv_transfer_fields(cfg, kv)
    assert "kv_transfer_config.kv_port 36000: each rank binds its ZMQ side channel" in port_line
    assert "kv_port + dp_rank * tp_size * pp_size + pp_rank * tp_size + tp_rank" in port_line
    assert "bootstrap_host:bootstrap_port (127.0.0.1:18800)" in port_line
    assert "engine_id p-node-0 only names this prefill instance in PDConnector's start-up log" in id_line
    assert port_line in pd_logs.text and id_line in pd_logs.text
    default = KVTransferConfig(kv_connector="PDConnector", kv_role="kv_producer")  # vLLM's kv_port, a random id
    default_lines = [line for line in note_kv_transfer_fields(cfg, default) if "kv_port" in line]
    assert len(default_lines) == 1 and "vLLM's default (14579): each rank binds a random free" in default_lines[0]
    parallel = SimpleNamespace(tensor_parallel_size=2, pipeline_parallel_size=1, data_parallel_rank=1)
    (ranged, _) = note_kv_transfer_fields(cfg, kv, parallel)
    assert "data-parallel rank 1 binds ports 36002-36003" in ranged


# ------------------------------------------------------------ ascend transport's device name


def test_ascend_engine_takes_the_npu_as_device_name_with_pp() -> None:
    """vLLM-Ascend 0.23: device_name = str(torch.npu.current_device()) if PP > 1 else none."""
    ascend = parse_config("kv_producer", {"protocol": "ascend"})
    opened = backend_config(ascend, pp_size=2, current_device=lambda: 3)
    assert isinstance(opened.backend_options, MooncakeOptions)
    assert opened.backend_options.device_name == "3"
    assert opened.backend_options.protocol == "ascend" and opened.room_timeout_s == ascend.room_timeout_s
    assert backend_config(ascend, pp_size=1, current_device=lambda: 3) is ascend  # PP 1: no device name
    given = parse_config("kv_producer", {"protocol": "ascend", "device_name": "7"})
    assert backend_config(given, pp_size=2, current_device=lambda: 3) is given  # a given one is kept
    rdma = parse_config("kv_producer", {"protocol": "rdma", "device_name": "mlx5_0"})
    assert backend_config(rdma, pp_size=2, current_device=lambda: 3) is rdma  # the NIC of rdma
