"""D side of moving a decoder's requests with their KV (the Router's drain, docs/router.md and docs/design.md).

A D request the Router may move carries ``migrate_room`` (kv_params.DecodeParams). With
``kv_connector_extra_config.migration`` on, when vLLM aborts such a request (the Router closed its
stream), D keeps its KV as room ``migrate_room`` for ``migrate_hold_s``: the scheduler files a
``SendJob`` as P does for a finished prefill, and the rank's ``PrefillSide`` pushes the blocks the
decoder that takes the stream over asks for, or frees them once the hold expired. Either way the
request then shows up in ``finished_sending`` and vLLM frees its blocks.

vLLM's side (checked on 0.32 and 0.23, ``v1/core/sched/scheduler.py``): an abort runs
``finish_requests(..., FINISHED_ABORTED)`` -> ``_free_request`` -> ``_connector_finished``, which calls
the connector's ``request_finished`` (``request_finished_all_groups`` with HMA) on every role, a
kv_consumer's included; a ``(True, params)`` answer keeps the request in ``scheduler.requests`` and its
blocks allocated until a worker output names it in ``finished_sending`` (``_update_from_kv_xfer_finished``
then frees them). ``request.num_computed_tokens`` there counts every token whose KV the engine computed
or has scheduled: prompt + generated - 1 once the step that sampled the last token was processed (that
token's KV is computed by the next forward); with async scheduling it also counts the tokens of a step
still in flight (0.32 tracks them in ``num_in_flight_tokens``), whose forward writes their KV before
the SendJob reaches the worker (the worker's ``add_sends`` records a device marker behind it). The
block ids vLLM passes: 0.32 those covering ``num_computed_tokens``
(``get_block_ids_for_computed_tokens``); 0.23 all the request's blocks, so a single group is trimmed
to the computed tokens here.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from pd_connector.config import DisaggConfig
from pd_connector.kv_params import DecodeParams, PrefillParams
from pd_connector.metadata import PDConnectorMetadata, SendJob
from pd_connector.scheduling.extension import Finish, Params, SchedulerExtension

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = logging.getLogger(__name__)


class MigrationHolds:
    """D with ``migration``: the aborted requests whose KV is held as their migrate room (scheduler side)."""

    def __init__(self, cfg: DisaggConfig, block_size: int) -> None:
        self.cfg = cfg
        self.block_size = block_size
        self._rooms: dict[int, str] = {}  # migrate room -> the request holding it
        self._room_of: dict[str, int] = {}

    def hold(
        self,
        request: Request,
        params: PrefillParams | DecodeParams | None,
        groups: list[list[int]],
        kv_pending: bool,
    ) -> SendJob | None:
        """The SendJob that holds ``request``'s KV as its migrate room, or None when it is freed as usual.

        Held: an ABORTED request with a ``migrate_room`` whose KV is in its blocks (``kv_pending``: its load
        from P was never asked for, still runs, or it was not scheduled since it landed) and computed tokens.
        """
        if not isinstance(params, DecodeParams) or params.migrate_room is None:
            return None
        from vllm.v1.request import RequestStatus

        rid, room = request.request_id, params.migrate_room
        computed = int(getattr(request, "num_computed_tokens", 0) or 0)
        if request.status is not RequestStatus.FINISHED_ABORTED or kv_pending or computed <= 0 or not any(groups):
            return None
        holder = self._rooms.get(room)
        if holder is not None:  # a room is one request's KV: never held twice
            logger.error("room=%d req=%s: migrate room is held by req=%s; freeing this KV", room, rid, holder)
            return None
        if len(groups) == 1:  # vLLM 0.23 passes every block, those past the computed tokens included
            groups = [groups[0][: -(-computed // self.block_size)]]
        self._rooms[room] = rid
        self._room_of[rid] = room
        logger.info(
            "room=%d req=%s: aborted; holding its KV (%d tokens, %d blocks) as its migrate room for at most %g s",
            room,
            rid,
            computed,
            len(groups[0]),
            self.cfg.migrate_hold_s,
        )
        return SendJob(
            rid,
            room,
            groups[0],
            computed,
            prefill_done_at=time.time(),
            trace_headers=getattr(request, "trace_headers", None),
            group_block_ids=groups if len(groups) > 1 else [],
            hold_s=self.cfg.migrate_hold_s,
        )

    def released(self, rid: str) -> None:
        """``rid`` showed up in finished_sending: its room was pushed or expired, its blocks are freed."""
        room = self._room_of.pop(rid, None)
        if room is not None and self._rooms.get(room) == rid:
            del self._rooms[room]

    def holding(self) -> bool:
        return bool(self._room_of)


class MigrationExtension(SchedulerExtension):
    """Chosen on D with ``kv_connector_extra_config.migration``: holds aborted requests' KV (``MigrationHolds``)."""

    def __init__(self, cfg: DisaggConfig, block_size: int) -> None:
        self.holds = MigrationHolds(cfg, block_size)
        self._sends: list[SendJob] = []

    def finished(
        self, request: Request, params: Params, groups: list[list[int]], kv_pending: bool, answer: Finish
    ) -> Finish | None:
        """An aborted request with a migrate room keeps its blocks (True) until the worker reports it in
        finished_sending (its room pushed to the decoder taking the stream over, or its hold expired)."""
        held = self.holds.hold(request, params, groups, kv_pending)
        if held is None:
            return None
        self._sends.append(held)
        return True, None

    def output(self, output: KVConnectorOutput) -> None:
        for rid in output.finished_sending or ():
            self.holds.released(rid)

    def meta(self, scheduler_output: SchedulerOutput, meta: PDConnectorMetadata) -> None:
        meta.sends.extend(self._sends)
        self._sends = []

    def busy(self) -> bool:
        return bool(self._sends) or self.holds.holding()
