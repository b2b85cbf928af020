"""Which scheduler extensions an engine runs: chosen here, once, by role and config.

======================  ====  ======================================================================
extension               role  chosen when
======================  ====  ======================================================================
DecodeFirstExtension    D     always (a request is D first when it names vLLM-Ascend's metaserver)
D2RHExtension           D     ``kv_connector_extra_config.d2rh``
DecodeStateExtension    D     the model has recurrent-state KV cache groups
MigrationExtension      D     ``kv_connector_extra_config.migration``
PrefillStateExtension   P     the model has recurrent-state KV cache groups
LayerChunksExtension    P     ``transfer_mode`` "layer"
DpRoomsExtension        P     the deployment has several DP ranks (``dp_size``, else vLLM's)
======================  ====  ======================================================================

A kv_both instance (``config.Mode.BOTH``) is both roles: it runs D's extensions and P's. Each of them
acts only on requests whose kv_transfer_params make them its side's (D first on DecodeParams naming a
metaserver); those that would act on every request (D2RH, migration, layer mode, recurrent state, DP
rooms) are refused with kv_both at start-up (``config``, ``refusals.both_problem``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

from pd_connector.ascend.metaserver import DecodeFirst
from pd_connector.bootstrap.dp_rooms import dp_rooms_for
from pd_connector.config import ConfigError, DisaggConfig
from pd_connector.scheduling.decode_first import DecodeFirstExtension
from pd_connector.scheduling.dp_rooms import DpRoomsExtension
from pd_connector.scheduling.extension import SchedulerExtension
from pd_connector.scheduling.layer_mode import LayerChunksExtension
from pd_connector.scheduling.migration import MigrationExtension
from pd_connector.scheduling.state_groups import DecodeStateExtension, PrefillStateExtension

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig


def extensions_for(
    cfg: DisaggConfig,
    block_size: int,
    *,
    dp_rank: int = 0,
    state_groups: Mapping[int, int] | None = None,
    vllm_config: VllmConfig | None = None,
    kv_cache_config: KVCacheConfig | None = None,
    kv_groups: int = 1,
) -> list[SchedulerExtension]:
    """The extensions of this engine's ``PDScheduler``, in the order its hooks run them.

    ``state_groups``: the recurrent-state KV cache groups -> their tokens per block; ``vllm_config`` and
    ``kv_cache_config``: the engine's (D2RH sizes its host pool from them, P reads its DP size from
    them); ``kv_groups``: how many KV cache groups the model has.
    """
    states = dict(state_groups or {})
    chosen: list[SchedulerExtension] = []
    if cfg.is_decode:
        chosen.append(DecodeFirstExtension(DecodeFirst(cfg)))
        if cfg.d2rh:
            chosen.append(_d2rh(cfg, block_size, vllm_config, kv_cache_config, kv_groups))
        if states:
            chosen.append(DecodeStateExtension(states))
        if cfg.migration:
            chosen.append(MigrationExtension(cfg, block_size))
    if cfg.is_prefill:
        if states:
            chosen.append(PrefillStateExtension())
        if cfg.transfer_mode == "layer":
            chosen.append(LayerChunksExtension(block_size))
        parallel = vllm_config.parallel_config if vllm_config is not None else None
        registrar = dp_rooms_for(cfg, parallel, dp_rank)
        if registrar is not None:
            chosen.append(DpRoomsExtension(registrar))
    return chosen


def _d2rh(
    cfg: DisaggConfig,
    block_size: int,
    vllm_config: VllmConfig | None,
    kv_cache_config: KVCacheConfig | None,
    kv_groups: int,
) -> SchedulerExtension:
    if vllm_config is None:
        raise ConfigError(
            "kv_connector_extra_config.d2rh: the host KV pool is sized from the engine's KV cache, and no "
            "vllm_config was given to extensions_for"
        )
    from pd_connector.d2rh.host_kv import d2rh_scheduler  # imports torch: only where D2RH runs
    from pd_connector.scheduling.d2rh import D2RHExtension

    return D2RHExtension(d2rh_scheduler(cfg, vllm_config, kv_cache_config, block_size, kv_groups))
