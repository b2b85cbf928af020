"""D2RH mode (vLLM-Ascend's ``MooncakeD2RHConnectorV1``): the scheduler's part (pd_connector.d2rh.scheduler).

A D request's prompt KV lands in D's host KV pool first; vLLM hears ``None`` (ask again) until it is
there, and only then allocates device blocks for a host -> device copy. So this extension owns a
request from the moment D would load it from P (``take_load``) until the request is gone.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pd_connector.d2rh.scheduler import D2RHScheduler, D2RHState
from pd_connector.kv_params import DecodeParams
from pd_connector.scheduling.extension import Finish, Match, Params, Plan, SchedulerExtension, room_release

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

    from pd_connector.metadata import PDConnectorMetadata


class D2RHExtension(SchedulerExtension):
    """Chosen on D with ``kv_connector_extra_config.d2rh`` (pd_connector.d2rh.host_kv.d2rh_scheduler)."""

    def __init__(self, d2rh: D2RHScheduler) -> None:
        self.d2rh = d2rh

    def match(self, request: Request, num_computed_tokens: int) -> Match | None:
        """A request staged (or waiting for pool room): ``None`` until its KV is in the host pool."""
        if not self.d2rh.knows(request.request_id):
            return None
        return self._match(request.request_id, self.d2rh.poll(request, num_computed_tokens))

    def take_load(self, request: Request, params: DecodeParams, num_computed_tokens: int, covered: int) -> Match:
        """Every load from P goes through the host pool (its cached blocks are not asked of P again)."""
        return self._match(request.request_id, self.d2rh.begin(request, params, num_computed_tokens, covered))

    def _match(self, rid: str, answer: tuple[int | None, bool]) -> Match:
        """Once P was asked (STAGING) or told to free the room (anything but WAITING_POOL), the room is decided."""
        state = self.d2rh.state(rid)
        if state is D2RHState.WAITING_POOL:
            plan = Plan.UNDECIDED
        elif state is D2RHState.STAGING:
            plan = Plan.PUSH
        else:
            plan = Plan.FREE
        return Match(answer[0], answer[1], plan)

    def alloc(self, request: Request, params: Params, blocks: KVCacheBlocks, num_external_tokens: int) -> bool:
        """Device blocks for a request whose KV is in the host pool: its host -> device copy is planned."""
        rid = request.request_id
        if not self.d2rh.knows(rid):
            return False
        self.d2rh.allocated(rid, list(blocks.get_block_ids()[0]), num_external_tokens)
        return True

    def finished(
        self, request: Request, params: Params, groups: list[list[int]], kv_pending: bool, answer: Finish
    ) -> Finish | None:
        self.d2rh.finished(request.request_id)
        return None

    def output(self, output: KVConnectorOutput) -> None:
        """The workers' staging outcomes and host copies done (``D2RHWorkerMeta``)."""
        self.d2rh.worker_output(getattr(output, "kv_connector_worker_meta", None))

    def meta(self, scheduler_output: SchedulerOutput, meta: PDConnectorMetadata) -> None:
        """This step's staging jobs and host loads; rooms D needs nothing from are released."""
        stages, loads, releases = self.d2rh.take_step()
        meta.host_stages.extend(stages)
        meta.host_loads.extend(loads)
        meta.abandoned.extend(room_release(rid, params) for rid, params in releases)
