"""Worker side of PDConnector (one per TP rank, in vLLM's worker process).

It owns this rank's transfer backend (``transfer.registry``, Mooncake by default) and
KVTransferManager (ZMQ), registers P ranks with
the bootstrap server (the leader, dp 0 / tp 0, also hosts that server) and
turns each step's metadata into transfer work. A D with ``migration`` pushes KV too (its aborted
requests' migrate rooms, pd_connector.scheduling.migration): its ranks join a bootstrap server of their own as P's do.
A kv_both instance runs both sides on every rank (a PrefillSide and a DecodeSide, its leader hosting its
bootstrap server at ``bootstrap_port``); each request's kv_transfer_params decide which one it uses.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch

from pd_connector.ascend.settings import apply_transport_env
from pd_connector.auth import token_of
from pd_connector.bootstrap.client import register_rank
from pd_connector.bootstrap.placement import advertised_bootstrap_host
from pd_connector.bootstrap.rooms_api import RankRooms
from pd_connector.bootstrap.server import BootstrapServer, BootstrapState
from pd_connector.compat import kv_dtype_name, model_fingerprint
from pd_connector.config import DisaggConfig
from pd_connector.d2rh.host_kv import D2RHWorker, HostKV, pool_blocks
from pd_connector.idle_wait import IdleWait
from pd_connector.kv_params import host_port
from pd_connector.layouts.kv_groups import region_groups
from pd_connector.layouts.pp import PipelineError, own_stage_problem, region_layers_of, stage_range
from pd_connector.layouts.regions import regions_of_kv_caches
from pd_connector.layouts.tp import MappingError, is_head_major, local_heads
from pd_connector.messages import RegisterRank
from pd_connector.metadata import PDConnectorMetadata
from pd_connector.rank_checks import backend_config, prepare_rank
from pd_connector.transfer.backend import TransferBackend
from pd_connector.transfer.context import user_kv_port
from pd_connector.transfer.device_sync import for_kv_caches
from pd_connector.transfer.layerwise import LayerStreams, enable_layer_push
from pd_connector.transfer.manager import KVTransferManager, RankSpec
from pd_connector.transfer.registry import create_backend
from pd_connector.transfer.staging import nhd_reshuffle

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

logger = logging.getLogger(__name__)


def _prepare_cpu_device() -> None:
    """On CPU, ask the kernel for AMX tiles before any attention kernel runs.

    A cold decode worker whose first step attends over KV loaded from P died
    with SIGILL otherwise (docs/design.md, device ordering).
    """
    cpu = getattr(torch._C, "_cpu", None)
    if cpu is None:
        return
    try:
        if cpu._is_amx_tile_supported():
            cpu._init_amx()
    except AttributeError:
        pass


def _tp_rank_and_size() -> tuple[int, int]:
    from vllm.distributed.parallel_state import (
        get_tensor_model_parallel_rank,
        get_tensor_model_parallel_world_size,
    )

    return get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size()


def _pp_rank_and_size() -> tuple[int, int]:
    """This worker's pipeline stage and the stage count (0, 1 without an initialized PP group)."""
    try:
        from vllm.distributed.parallel_state import get_pp_group

        group = get_pp_group()
        return int(group.rank_in_group), int(group.world_size)
    except (ImportError, AssertionError, AttributeError):
        return 0, 1


def _stage_layers(cfg: DisaggConfig, kv_caches: dict[str, Any], pp_rank: int, pp_size: int) -> tuple[int, int]:
    """P: this stage's layers [first, end) ((0, 0) with PP 1); D must run one stage (layouts.pp)."""
    if pp_size <= 1:
        return 0, 0
    if cfg.is_decode:  # D, and kv_both (pd_connector.refusals refuses its PP first)
        raise ValueError(
            f"PDConnector: this {cfg.mode} instance runs --pipeline-parallel-size {pp_size}, but decode runs one "
            "pipeline stage (as vLLM-Ascend's, whose kv_connector_extra_config.decode.pp_size must be 1); only the "
            "prefill deployment may be pipeline parallel"
        )
    try:
        first, end = stage_range(kv_caches, pp_rank)
    except PipelineError as exc:
        raise ValueError(f"PDConnector: {exc}") from None
    problem = own_stage_problem(cfg.mode, cfg.prefill, pp_rank, pp_size, first)
    if problem is not None:
        raise ValueError(f"PDConnector: {problem}")
    return first, end


def _heads_outermost(kv_caches: dict[str, Any], num_blocks: int, local: int) -> bool:
    """Whether a run of KV heads is one byte range per block in every KV tensor (needed for mixed TP)."""
    try:
        return all(
            is_head_major(t.shape, num_blocks, local, strides=t.stride())
            for value in kv_caches.values()
            for t in (value if isinstance(value, (list, tuple)) else [value])
        )
    except MappingError as exc:
        logger.warning("cannot tell the KV head layout (%s); mixed prefill/decode TP sizes will be refused", exc)
        return False


class PDWorker:
    def __init__(self, cfg: DisaggConfig, vllm_config: VllmConfig, kv_cache_config: KVCacheConfig | None) -> None:
        self.cfg = cfg
        self.vllm_config = vllm_config
        self.kv_cache_config = kv_cache_config
        self.block_size = vllm_config.cache_config.block_size
        par = vllm_config.parallel_config
        # vLLM runs dense-model DP ranks as independent engines (rank 0 of size 1); the
        # original rank survives as data_parallel_index. extra_config can set both.
        vllm_dp_rank = getattr(par, "data_parallel_index", par.data_parallel_rank)
        self.dp_rank = cfg.dp_rank if cfg.dp_rank >= 0 else vllm_dp_rank
        self.dp_size = cfg.dp_size if cfg.dp_size >= 0 else par.data_parallel_size
        if self.dp_rank >= self.dp_size:
            raise ValueError(
                f"PDConnector: this engine is data-parallel rank {self.dp_rank} but vLLM reports DP size "
                f"{self.dp_size} (vLLM runs dense-model DP ranks as independent engines); set "
                "kv_connector_extra_config.dp_size to the deployment's DP size"
            )
        self.backend: TransferBackend | None = None
        self.manager: KVTransferManager | None = None
        self.bootstrap: BootstrapServer | None = None
        self._failed_blocks: set[int] = set()
        # P: no pause in idle steps while busy (back-to-back requests; pd_connector.idle_wait)
        self._idle = IdleWait(no_wait_when_busy=cfg.is_prefill and not cfg.is_decode)
        self.layers: LayerStreams | None = None  # P, transfer_mode "layer"
        self.stage_layers = (0, 0)  # P with PP > 1: this stage's layers [first, end) (layouts.pp)
        self.d2rh: D2RHWorker | None = None  # D, D2RH mode: the host KV pool (pd_connector.d2rh.host_kv)
        if torch.accelerator.current_accelerator() is None:
            _prepare_cpu_device()

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        tp_rank, tp_size = _tp_rank_and_size()
        pp_rank, pp_size = _pp_rank_and_size()
        self.stage_layers = _stage_layers(self.cfg, kv_caches, pp_rank, pp_size)
        num_blocks = self._num_blocks(kv_caches)
        regions = regions_of_kv_caches(kv_caches, num_blocks)
        first = next(iter(kv_caches.values()))
        first = first[0] if isinstance(first, (list, tuple)) else first
        logger.info(
            "PDConnector %s rank dp=%d tp=%d/%d pp=%d/%d: %d layers%s, KV tensor %s %s, %d blocks, %d regions of %d bytes/block",
            self.cfg.mode,
            self.dp_rank,
            tp_rank,
            tp_size,
            pp_rank,
            pp_size,
            len(kv_caches),
            f" [{self.stage_layers[0]}, {self.stage_layers[1]})" if pp_size > 1 else "",
            tuple(first.shape),
            first.dtype,
            num_blocks,
            len(regions),
            regions[0].block_bytes if regions else 0,
        )
        model = self.vllm_config.model_config
        use_mla = bool(getattr(model, "use_mla", False))
        total_heads = 1 if use_mla else model.get_total_num_kv_heads()
        local = len(local_heads(total_heads, tp_size, tp_rank))
        heads_outermost = _heads_outermost(kv_caches, num_blocks, local)
        host = None  # D2RH: P writes into the host pool's regions, not the device's (host_kv)
        if self.cfg.d2rh and self.cfg.is_decode:
            host = HostKV(kv_caches, regions, num_blocks, pool_blocks(self.cfg, num_blocks))
        reshuffle = None if host is not None else nhd_reshuffle(  # P: its staging buffer (transfer.staging)
            self.cfg, kv_caches, num_blocks, self.block_size, local,
            use_mla=use_mla, heads_outermost=heads_outermost, tp_size=tp_size,
        )  # fmt: skip
        staging = reshuffle.registered_ranges if reshuffle is not None else host.ranges if host is not None else []
        dp_size = self.vllm_config.parallel_config.data_parallel_size
        ranges = prepare_rank(self.cfg, kv_caches, tp_size, dp_size, staging)  # KV's ranges + staging's
        apply_transport_env(self.cfg)  # ascend: vLLM-Ascend's QoS and transfer timeout, before the engine starts
        self.backend = create_backend(backend_config(self.cfg, pp_size))  # ascend, PP > 1: the NPU as device_name
        self.backend.register(ranges)
        spec = RankSpec(
            tp_rank=tp_rank,
            tp_size=tp_size,
            dp_rank=self.dp_rank,
            dp_size=self.dp_size,
            block_size=self.block_size,
            kv_dtype=kv_dtype_name(self.vllm_config),
            num_layers=len(kv_caches),
            total_kv_heads=total_heads,
            local_kv_heads=local,
            use_mla=use_mla,
            heads_outermost=heads_outermost,
            token_major=reshuffle is not None,
            model=model_fingerprint(self.vllm_config),
            num_blocks=host.host_blocks if host else num_blocks,  # peers write only inside these (write_guard)
            kv_device=first.device.type,  # transfer.checksum reads host KV only
            region_groups=region_groups(kv_caches, self.kv_cache_config, num_blocks),  # hybrid KV cache manager
            pp_rank=pp_rank,
            pp_size=pp_size,
            region_layers=region_layers_of(kv_caches, num_blocks),  # a P stage's regions pair with D's by layer
            kv_port=user_kv_port(self.vllm_config.kv_transfer_config),  # ZMQ port kv_port + rank offset, or random
        )
        otlp = getattr(self.vllm_config.observability_config, "otlp_traces_endpoint", None)
        device = for_kv_caches(kv_caches)  # transfer threads bind it; pushes wait for its events
        self.manager = KVTransferManager(
            self.cfg, spec, host.regions if host else regions, self.backend, otlp, reshuffle=reshuffle, device=device
        )
        if host is not None:
            self.d2rh = D2RHWorker(host, self.manager.stats, self.manager.pool.submit, device)
        if self.cfg.is_prefill and self.cfg.transfer_mode == "layer":
            self.layers = enable_layer_push(self.manager.prefill, spec, reshuffle is not None, kv_caches, num_blocks)
        if self.cfg.pushes_kv:  # P, kv_both, and D with migration (at D's own bootstrap_port)
            self._join_prefill_deployment(spec)

    def _num_blocks(self, kv_caches: dict[str, Any]) -> int:
        if self.kv_cache_config is not None and getattr(self.kv_cache_config, "num_blocks", 0):
            return int(self.kv_cache_config.num_blocks)
        num_gpu_blocks = self.vllm_config.cache_config.num_gpu_blocks
        if num_gpu_blocks:
            return int(num_gpu_blocks)
        raise RuntimeError("PDConnector cannot tell the number of KV blocks of this worker")

    def _join_prefill_deployment(self, spec: RankSpec) -> None:
        assert self.manager is not None
        if spec.dp_rank == 0 and spec.tp_rank == 0 and spec.pp_rank == 0 and self.cfg.start_bootstrap_server:
            state = BootstrapState(attn_tp_size=spec.tp_size, attn_dp_size=spec.dp_size, pp_size=spec.pp_size)
            self.bootstrap = BootstrapServer(
                state,
                self.cfg.local_ip,
                self.cfg.bootstrap_port,
                token_of(self.cfg),
                ssl_certfile=self.cfg.bootstrap_ssl_certfile,
                ssl_keyfile=self.cfg.bootstrap_ssl_keyfile,
                rooms=RankRooms(state, self.manager.prefill, self.manager.channel.send, self.manager.endpoint)
                if self.manager.prefill is not None
                else None,
            )
            self.bootstrap.start()
        register_rank(
            host_port(advertised_bootstrap_host(self.cfg, spec.dp_rank), self.cfg.bootstrap_port),
            RegisterRank(
                attn_tp_size=spec.tp_size,
                attn_tp_rank=spec.tp_rank,
                attn_dp_size=spec.dp_size,
                attn_dp_rank=spec.dp_rank,
                rank_ip=self.cfg.local_ip,
                rank_port=self.manager.rank_port,
                block_size=spec.block_size,
                kv_cache_dtype=spec.kv_dtype,
                num_layers=spec.num_layers,
                model=spec.model,
                pp_size=spec.pp_size,
                pp_rank=spec.pp_rank,
                first_layer=self.stage_layers[0],
                end_layer=self.stage_layers[1],
                batch_stall_s=self.cfg.backend_options.batch_stall_s,  # what bounds this rank's writes:
                peer_timeout_s=self.cfg.peer_timeout_s,  # D holds a stopped load's blocks by them (transfer.loads)
            ),
            retries=self.cfg.register_retries,
            interval_s=self.cfg.register_interval_s,
            timeout_s=self.cfg.http_timeout_s,
            token=token_of(self.cfg),
            ca_certs=self.cfg.bootstrap_ssl_ca_certs,
        )

    def start_step(self, meta: PDConnectorMetadata) -> None:
        if self.manager is None:
            return
        if meta.sends:
            self.manager.add_sends(meta.sends)
        if meta.dropped_rooms:
            self.manager.drop_rooms(meta.dropped_rooms)
        if meta.recvs:
            self.manager.add_recvs(meta.recvs)
        if meta.host_stages:  # D2RH: loads into host blocks
            self.manager.add_recvs(meta.host_stages)
        if meta.host_loads and self.d2rh is not None:
            self.d2rh.run_loads(meta.host_loads)
        if meta.abandoned and self.manager.decode is not None:
            self.manager.decode.abandon(meta.abandoned)
        if meta.scheduled:
            self.manager.mark_scheduled(meta.scheduled)
        wait = self._idle.seconds(meta.idle)
        if wait > 0:
            self.manager.wait_for_progress(wait)

    def get_finished(self, finished_req_ids: set[str] | None = None) -> tuple[set[str], set[str], set[str]]:
        """(finished_sending, finished_recving, failed_recving); failed blocks kept for load errors.

        ``finished_req_ids``: requests vLLM finished since the last step; on D, those still loading
        were aborted, and their loads are cancelled (P frees the room at once).
        """
        if self.manager is None:
            return set(), set(), set()
        if finished_req_ids and self.manager.decode is not None:
            self.manager.decode.cancel(finished_req_ids)
        sending, recving, failed = self.manager.take_finished()
        if self.d2rh is not None:  # D2RH: those were loads into host blocks; vLLM hears of host -> device copies
            self.d2rh.staging_ended(recving, failed)
            _, recving, failed = self.d2rh.outbox.take()
        for blocks in failed.values():
            self._failed_blocks.update(blocks)
        return sending, recving, set(failed)

    def build_worker_meta(self) -> Any:
        """D2RH: staging outcomes and host copies done since the last step (pd_connector.d2rh.scheduler), else None."""
        return self.d2rh.take_meta() if self.d2rh is not None else None

    def take_stats(self) -> dict | None:
        """This rank's transfer stats since the previous call (pd_connector.metrics), None if nothing."""
        return self.manager.take_stats() if self.manager is not None else None

    def take_failed_blocks(self) -> set[int]:
        blocks, self._failed_blocks = self._failed_blocks, set()
        return blocks

    def save_kv_layer(self, layer_name: str, meta: PDConnectorMetadata) -> None:
        """P, layer mode, forward thread: ``layer_name``'s KV writes are queued on the device; write its new
        blocks once they ran (LayerStreams records the device marker now, its writer waits for it)."""
        if self.layers is not None and meta.layer_chunks:
            self.layers.on_layer(meta.layer_chunks, meta, layer_name)

    def wait_for_save(self, meta: PDConnectorMetadata) -> None:
        """P, layer mode: the forward is queued; layers vLLM did not report follow a marker recorded now."""
        if self.layers is not None and meta.layer_chunks:
            self.layers.on_forward_end(meta.layer_chunks, meta)

    def shutdown(self) -> None:
        if self.layers is not None:
            self.layers.close()
            self.layers = None
        if self.manager is not None:
            self.manager.close()
            self.manager = None
        if self.backend is not None:
            self.backend.close()
            self.backend = None
        if self.bootstrap is not None:
            self.bootstrap.stop()
            self.bootstrap = None
