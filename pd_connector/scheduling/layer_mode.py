"""P, transfer_mode "layer": the scheduler's part of streaming a prefill's layers to D (``layer_chunks``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from pd_connector.kv_params import PrefillParams
from pd_connector.scheduling.extension import Finish, Params, SchedulerCore, SchedulerExtension
from pd_connector.scheduling.layer_chunks import ChunkPlanner

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

    from pd_connector.metadata import PDConnectorMetadata


class LayerChunksExtension(SchedulerExtension):
    """Chosen on P with transfer_mode "layer": this step's ``LayerChunk``s go to the workers with the metadata."""

    def __init__(self, block_size: int) -> None:
        self.planner = ChunkPlanner(block_size)
        self._core: SchedulerCore | None = None

    def attach(self, core: SchedulerCore) -> None:
        self._core = core

    def alloc(self, request: Request, params: Params, blocks: KVCacheBlocks, num_external_tokens: int) -> bool:
        """A prefill for D streams its layers into its room, unless the room's KV is held for another
        request (that prefill is refused when it finishes)."""
        if isinstance(params, PrefillParams) and params.room is not None:
            if self._core is None or self._core.room_holder(params.room) is None:
                self.planner.track(request.request_id, params.room, request.num_prompt_tokens)
        return False

    def finished(
        self, request: Request, params: Params, groups: list[list[int]], kv_pending: bool, answer: Finish
    ) -> Finish | None:
        self.planner.forget(request.request_id)
        return None

    def meta(self, scheduler_output: SchedulerOutput, meta: PDConnectorMetadata) -> None:
        meta.layer_chunks.extend(self.planner.plan(scheduler_output))
