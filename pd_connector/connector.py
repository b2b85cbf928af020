"""PDConnector: vLLM KVConnectorBase_V1 entry point; dispatches to the role object.

vLLM builds this class twice per instance: once with role SCHEDULER in the
EngineCore process (-> `PDScheduler`, pure bookkeeping) and once with role
WORKER per rank (-> `PDWorker`, sockets and transfers).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
)

from pd_connector.accounting import group_block_bytes
from pd_connector.bootstrap.placement import dp_rank_of
from pd_connector.config import parse_config
from pd_connector.layouts.kv_groups import check_group_block_sizes, group_block_sizes, recurrent_groups, sliding_windows
from pd_connector.metadata import PDConnectorMetadata
from pd_connector.metrics import PDKVConnectorStats, PDPromMetrics
from pd_connector.refusals import note_kv_transfer_fields, refuse_unsupported
from pd_connector.scheduler import PDScheduler
from pd_connector.scheduling.selection import extensions_for
from pd_connector.worker import PDWorker

try:  # vLLM >= 0.32 reports failed receives by request id.
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults
except ImportError:  # vLLM-Ascend 0.23 line: failed loads go through invalid block ids.
    KVConnectorTransferResults = None  # type: ignore[assignment,misc]

# SupportsHMA on every line: vLLM keeps its hybrid KV cache manager on (sliding-window, compressed-cache
# models). vLLM >= 0.32 fails a load with several KV cache groups by request id; vLLM 0.23 only by block,
# through a scheduler method that reads one group's table, which pd_connector.vllm_lines.hma_023 replaces
# (installed by the scheduler side below, for hybrid models only).
HMA_BASES: tuple[type, ...] = (SupportsHMA,)

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = logging.getLogger(__name__)


def _fail_loads_by_block_in_every_group() -> None:
    """vLLM 0.23 with several KV cache groups: make its failed-load path read every group (vllm_lines.hma_023)."""
    from pd_connector.config import ConfigError
    from pd_connector.vllm_lines.hma_023 import install

    if not install():
        raise ConfigError(
            "this vLLM reports failed KV loads by block through a scheduler method PDConnector does not know, "
            "and the model has several KV cache groups (hybrid): start vLLM with --disable-hybrid-kv-cache-manager"
        )


class PDConnector(KVConnectorBase_V1, *HMA_BASES):  # type: ignore[misc]
    """Prefill/decode disaggregation: P pushes the prompt KV into D's blocks over Mooncake.

    ``SupportsHMA`` (see HMA_BASES): vLLM keeps its hybrid KV cache manager on
    (sliding-window + full-attention models); every KV cache group's blocks move (pd_connector.layouts.kv_groups),
    a recurrent-state group's one state block included (pd_connector.layouts.state_groups).
    """

    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig | None = None,
    ) -> None:
        super().__init__(vllm_config, role, kv_cache_config)  # type: ignore[arg-type]
        kv = vllm_config.kv_transfer_config
        assert kv is not None
        self.cfg = parse_config(kv.kv_role, kv.kv_connector_extra_config)
        # Recurrent-state (Mamba / GDN) models beyond the supported hybrid case (pd_connector.layouts.state_groups),
        # context parallel, micro-batching with layer mode: refused.
        refuse_unsupported(self.cfg, vllm_config, kv_cache_config)
        self._scheduler: PDScheduler | None = None
        self._worker: PDWorker | None = None
        if role == KVConnectorRole.SCHEDULER:
            dp_rank = dp_rank_of(self.cfg, vllm_config.parallel_config)
            sizes = group_block_sizes(kv_cache_config, vllm_config.cache_config.block_size)
            if len(sizes) > 1 and KVConnectorTransferResults is None:
                _fail_loads_by_block_in_every_group()
            # A recurrent-state group has a block size of its own (pd_connector.layouts.state_groups).
            states = {g: sizes[g] for g in recurrent_groups(kv_cache_config)}
            block_size = check_group_block_sizes([s for g, s in enumerate(sizes) if g not in states])
            # The optional features (D2RH, migration, layer mode, recurrent state, DP-rank rooms, D first),
            # chosen by role and config in one place (pd_connector.scheduling.selection).
            extensions = extensions_for(
                self.cfg,
                block_size,
                dp_rank=dp_rank,
                state_groups=states,
                vllm_config=vllm_config,
                kv_cache_config=kv_cache_config,
                kv_groups=len(sizes),
            )
            windows = sliding_windows(kv_cache_config)
            self._scheduler = PDScheduler(
                self.cfg,
                block_size,
                dp_rank,
                windows,
                extensions,
                group_block_bytes=group_block_bytes(kv_cache_config),
                kv_ranks=vllm_config.parallel_config.tensor_parallel_size,
            )
            note_kv_transfer_fields(self.cfg, kv, vllm_config.parallel_config)  # vLLM-Ascend's carry kv_port, engine_id
        else:
            self._worker = PDWorker(self.cfg, vllm_config, kv_cache_config)
        logger.info("PDConnector %s side up as %s (engine_id %s)", role.name.lower(), self.cfg.mode, kv.engine_id)

    # ================================================================ worker side

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        """Called once per worker after vLLM allocated the KV cache.

        Derives this rank's region table from the tensors, registers the memory
        with Mooncake, opens the ZMQ socket and, on P, joins the bootstrap
        server (the leader rank starts it first).
        """
        assert self._worker is not None
        self._worker.register_kv_caches(kv_caches)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        """Called every engine step, around the forward pass, with this step's metadata bound.

        Hands the step's work to the transfer manager: P rooms whose prefill
        finished (push when D asks, once a device event recorded now on the forward's
        stream completed), dropped rooms, and D requests whose KV should be fetched.
        Never blocks: the transfers run on background threads bound to the rank's device.
        """
        assert self._worker is not None
        meta = self._get_connector_metadata()
        assert isinstance(meta, PDConnectorMetadata)
        self._worker.start_step(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Called before each attention layer; loads are async between steps, so nothing to wait for."""

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        """Called on the forward's thread after each attention layer of a forward pass.

        By then the layer's KV-cache write has been *queued* on the device's current stream; on an
        NPU/GPU it may not have run yet (on CPU it has). P with transfer_mode "layer": records a
        device event on that stream now and queues the write of the layer's newly completed blocks
        to D, which the writer thread starts only once that event completed (pd_connector.transfer.device_sync,
        transfer.layerwise); otherwise nothing (P pushes whole requests after the prefill).
        """
        if self._worker is not None and self._worker.layers is not None and self.has_connector_metadata():
            meta = self._get_connector_metadata()
            assert isinstance(meta, PDConnectorMetadata)
            self._worker.save_kv_layer(layer_name, meta)

    def wait_for_save(self) -> None:
        """Called at the end of every forward pass (and of steps without one), metadata still bound.

        The forward's kernels are queued on the device, not necessarily done. Writes stay async
        (reported via TransferDone / get_finished); in layer mode, layers whose save_kv_layer did not
        come are queued now, behind a device event recorded here. Request mode's pushes wait for an
        event recorded when the finished prefill's SendJob reaches the worker (start_load_kv).
        """
        if self._worker is not None and self._worker.layers is not None and self.has_connector_metadata():
            meta = self._get_connector_metadata()
            assert isinstance(meta, PDConnectorMetadata)
            self._worker.wait_for_save(meta)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """Called every step after the forward pass.

        Returns (requests whose KV push finished on P, so vLLM may free their
        blocks; requests whose KV arrived on D, or failed to, so vLLM may
        schedule them: their received bytes, and any NHD permutation of them, are
        in device memory by then).
        """
        assert self._worker is not None
        sending, recving, _failed = self._worker.get_finished(finished_req_ids)
        return sending or None, recving or None

    if KVConnectorTransferResults is not None:

        def get_transfer_results(self, finished_req_ids: set[str]) -> Any:
            """Called every step (vLLM >= 0.32) instead of get_finished: adds the failed loads by id.

            vLLM then recomputes or fails them per kv_load_failure_policy.
            """
            assert self._worker is not None
            sending, recving, failed = self._worker.get_finished(finished_req_ids)
            self._worker.take_failed_blocks()  # reported by id here, not by block
            return KVConnectorTransferResults(finished_sending=sending, finished_recving=recving, failed_recving=failed)

    def build_connector_worker_meta(self) -> Any:
        """Called every step after get_finished: D2RH staging outcomes and host copies done, for the scheduler."""
        return self._worker.build_worker_meta() if self._worker is not None else None

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Called every step after get_finished: D blocks whose load failed (older vLLM)."""
        assert self._worker is not None
        return self._worker.take_failed_blocks()

    def get_kv_connector_stats(self) -> PDKVConnectorStats | None:
        """Called every engine step on each worker (after get_finished), and on the scheduler (vLLM 0.32).

        Returns this rank's transfer stats since the previous call (None if nothing happened);
        vLLM aggregates the workers' objects and sends the dict to the frontend's metrics.
        The scheduler side reports the requests it served without a transfer, and D's per-request KV
        accounting (tokens by source, recomputes by reason: pd_connector.accounting).
        """
        if self._scheduler is not None:  # requests served without a transfer (pd_connector.bypass)
            data: dict[str, Any] = {}
            if bypassed := self._scheduler.bypassed.take():
                data["bypassed"] = bypassed
            if accounted := self._scheduler.accounts.take():
                data.update(accounted)
            return PDKVConnectorStats(data=data) if data else None
        data = self._worker.take_stats() if self._worker is not None else None
        return PDKVConnectorStats(data=data) if data is not None else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> PDKVConnectorStats | None:
        """Called in the frontend (and by MultiConnector) to rebuild the stats object from its dict."""
        return PDKVConnectorStats(data=data) if data is not None else PDKVConnectorStats()

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> PDPromMetrics:
        """Called once by the frontend's Prometheus logger: registers PDConnector's metrics."""
        return PDPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        """Called when the engine shuts down: closes sockets, Mooncake and the bootstrap server."""
        if self._worker is not None:
            self._worker.shutdown()

    # ============================================================= scheduler side

    def on_new_request(self, request: Request) -> None:
        """Called by vLLM's scheduler when it adds a request (``Scheduler.add_request``, vLLM 0.23 and 0.32),
        before it is ever scheduled.

        On P with several DP ranks, the request's room is registered with this rank on the bootstrap
        server (off this thread: bootstrap.dp_rooms), so a D told no prefill_dp_rank finds it at once.
        On P of a recurrent-state hybrid, the request loses its last prompt token (pd_connector.layouts.state_groups):
        D computes that token from P's state.
        """
        assert self._scheduler is not None
        self._scheduler.on_new_request(request)

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        """Called when the scheduler considers a waiting request (maybe several times).

        On D, a request with `do_remote_prefill` gets all prompt tokens past the
        local prefix hit as an async external load, so vLLM parks it in
        WAITING_FOR_REMOTE_KVS. Otherwise (and on P): (0, False).
        """
        assert self._scheduler is not None
        return self._scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        """Called after vLLM allocated blocks for the request.

        On D, records which of the new blocks P must fill (first call only).
        """
        assert self._scheduler is not None
        self._scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        """Called at the end of every schedule(): the work the workers pick up this step."""
        assert self._scheduler is not None
        return self._scheduler.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        """Called with the workers' aggregated results: forget pushes that finished."""
        assert self._scheduler is not None
        self._scheduler.update_connector_output(connector_output)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """Called once when a request finishes, before its blocks are freed.

        On P, a prefill with `do_remote_decode` that finished normally keeps its
        blocks (True) until the push is done; an aborted one drops its room. On D with
        `migration`, an aborted request carrying `migrate_room` keeps its blocks the same way
        (what vLLM guarantees there, on 0.32 and 0.23: PDScheduler.request_finished).
        On D, a request that finished normally answers its KV account under `pd_kv`
        (pd_connector.accounting): vLLM puts the returned dict in the request's final output
        (`RequestOutput.kv_transfer_params`), whence the API server's middleware moves it to `usage`.
        """
        assert self._scheduler is not None
        return self._scheduler.request_finished(request, block_ids)

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        """Called instead of request_finished (vLLM's SupportsHMA) once a request finished, before
        its blocks are freed, with one block list per KV cache group (sliding-window groups hold the
        null block 0 where blocks fell out of the window).

        On P, as request_finished: a finished prefill keeps every group's blocks until the push is done.
        """
        assert self._scheduler is not None
        return self._scheduler.request_finished(request, tuple(block_ids))

    def has_pending_push_work(self) -> bool:
        """Polled by the engine loop: keep stepping while P holds blocks for a push."""
        return self._scheduler is not None and self._scheduler.has_pending_push_work()
