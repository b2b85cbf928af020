"""Scheduler side of PDConnector (runs in vLLM's EngineCore process; no I/O).

It decides, per request, what moves: D asks vLLM to hold the uncomputed prompt
tokens for an async load; P keeps a finished prefill's blocks (delay free)
until its worker reports the push done. Everything it decides reaches the
workers as `PDConnectorMetadata`, once per engine step.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from pd_connector.ascend.metaserver import DecodeFirst
from pd_connector.bootstrap.dp_rooms import DpRoomRegistrar
from pd_connector.bootstrap.placement import advertised_bootstrap_host
from pd_connector.bypass import BypassCounter, BypassReason, reason_for
from pd_connector.config import DisaggConfig
from pd_connector.d2rh.scheduler import D2RHScheduler, D2RHState
from pd_connector.kv_params import (
    DecodeParams,
    KVParamsError,
    PrefillParams,
    decode_handoff,
    new_room,
    parse_kv_params,
    prefill_refused,
)
from pd_connector.layouts.kv_groups import decode_group_blocks, replay_needs_freed_block
from pd_connector.layouts.state_groups import (
    PREFILL_WITHOUT_LAST_TOKEN,
    fill_state_groups,
    prefilled_for_state,
    truncate_for_prefill,
)
from pd_connector.metadata import HostLoad, PDConnectorMetadata, RecvJob, SendJob
from pd_connector.scheduling.layer_chunks import ChunkPlanner
from pd_connector.scheduling.migration import MigrationHolds

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = logging.getLogger(__name__)


def _params_of(request: Request) -> PrefillParams | DecodeParams | None:
    """Parsed kv_transfer_params; malformed ones are logged and ignored (served locally).

    A P request that names no room (P-then-D proxies) gets a fresh one here; P's answer tells D.
    """
    try:
        params = parse_kv_params(request.kv_transfer_params, room_optional=True)
    except KVParamsError as exc:
        logger.error("req=%s: ignoring malformed kv_transfer_params: %s", request.request_id, exc)
        return None
    if isinstance(params, PrefillParams) and params.room is None:
        params = PrefillParams(room=new_room(), samples=params.samples)
        logger.info(
            "room=%d req=%s: the request named no bootstrap_room; prefill picked one", params.room, request.request_id
        )
    return params


def _prefilled_tokens(request: Request, params: DecodeParams) -> int:
    """Prompt tokens of a D request whose KV P holds: all, or ``prefilled_tokens`` when the Router
    appended P's first token to the prompt (never more than the prompt)."""
    if params.prefilled_tokens is None:
        return request.num_prompt_tokens
    return min(params.prefilled_tokens, request.num_prompt_tokens)


class PDScheduler:
    def __init__(
        self,
        cfg: DisaggConfig,
        block_size: int,
        dp_rank: int = 0,
        sliding_windows: Sequence[int] = (),
        state_groups: Mapping[int, int] | None = None,
    ) -> None:
        self.cfg = cfg
        self.block_size = block_size
        # Hybrid models: the KV cache groups that hold a recurrent state -> their tokens per block
        # (pd_connector.layouts.state_groups); ``block_size`` is then the attention groups'.
        self.state_groups = dict(state_groups or {})
        self._truncated: set[str] = set()  # P: requests prefilled without their last prompt token
        # D, hybrid KV cache manager: the groups' sliding windows (kv_groups.replay_needs_freed_block).
        self.sliding_windows = list(sliding_windows)
        # P: what its answer tells D (P-then-D proxies pass it on): bootstrap server and DP rank.
        self.dp_rank = dp_rank
        self._bootstrap_host = advertised_bootstrap_host(cfg, dp_rank)
        # D: local (block-aligned) prefix hit seen by get_num_new_matched_tokens.
        self._local_hits: dict[str, int] = {}
        self._recv_planned: set[str] = set()
        self._recvs: list[RecvJob] = []
        self._abandoned: list[RecvJob] = []  # D: finished before their load was asked for
        # D, phase traces: loads in flight, and loads done whose first scheduling is still to come.
        self._awaiting_kv: set[str] = set()
        self._kv_ready: set[str] = set()
        # P: rooms to hand over / drop, and requests whose blocks we hold.
        self._sends: list[SendJob] = []
        self._dropped: list[int] = []
        self._holding: set[str] = set()
        # P: rooms whose KV is held (room -> request), so a second request with a live room is refused.
        self._live_rooms: dict[int, str] = {}
        self._room_of: dict[str, int] = {}
        self._parsed: dict[str, PrefillParams | DecodeParams | None] = {}
        # P, transfer_mode "layer": which blocks each step completes (the worker streams their layers).
        self._chunks = ChunkPlanner(block_size) if cfg.is_prefill and cfg.transfer_mode == "layer" else None
        # Requests served without a transfer (logged and counted: pd_connector.bypass).
        self.bypassed = BypassCounter("prefill" if cfg.is_prefill else "decode")
        # D: requests of vLLM-Ascend's layer-wise proxy (D first; D posts to its metaserver off this thread).
        self._d_first = DecodeFirst(cfg) if cfg.is_decode else None
        # D, D2RH mode: KV staged in the host pool first (pd_connector.d2rh.scheduler; set by the connector).
        self.d2rh: D2RHScheduler | None = None
        # D with migration: aborted requests' KV held as their migrate rooms (pd_connector.scheduling.migration).
        self._migration = MigrationHolds(cfg, block_size) if cfg.is_decode and cfg.migration else None
        # P with several DP ranks: each request's room registered with this rank on arrival (bootstrap.dp_rooms).
        self.dp_rooms: DpRoomRegistrar | None = None

    def _params(self, request: Request) -> PrefillParams | DecodeParams | None:
        rid = request.request_id
        if rid not in self._parsed:
            first = self._d_first.params_of(request) if self._d_first is not None else None
            self._parsed[rid] = first or _params_of(request)
        return self._parsed[rid]

    def on_new_request(self, request: Request) -> None:
        """P with several DP ranks: the bootstrap server learns at once that this rank serves the room.
        P of a recurrent-state model: the request is prefilled without its last prompt token (state_groups)."""
        if self.dp_rooms is None and not (self.state_groups and self.cfg.is_prefill):
            return
        params = self._params(request)
        if self.dp_rooms is not None and isinstance(params, PrefillParams):
            if params.room is not None:
                self.dp_rooms.seen(params.room, request.request_id)
        rid = request.request_id
        if (
            self.state_groups
            and self.cfg.is_prefill
            and isinstance(params, PrefillParams)
            and rid not in self._truncated
        ):
            if truncate_for_prefill(request):
                self._truncated.add(rid)
                logger.info(
                    "room=%s req=%s: recurrent-state model: prefilling %d of %d prompt tokens, decode computes the last",
                    params.room,
                    rid,
                    request.num_prompt_tokens,
                    request.num_prompt_tokens + 1,
                )

    def _covered(self, request: Request, params: DecodeParams) -> int | None:
        """D: prompt tokens whose KV (and state) P holds; None when this prompt is prefilled here."""
        if self.state_groups:
            return prefilled_for_state(request.num_prompt_tokens, params.prefilled_tokens)
        return _prefilled_tokens(request, params)

    # -------------------------------------------------------------- decode side

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        if self.d2rh is not None and self.d2rh.knows(request.request_id):  # None: host copy not ready yet
            return self._d2rh_planned(request.request_id, self.d2rh.poll(request, num_computed_tokens))
        if not self.cfg.is_decode or request.request_id in self._recv_planned:
            return 0, False
        params = self._params(request)
        if not isinstance(params, DecodeParams):
            return 0, False
        self._local_hits[request.request_id] = num_computed_tokens
        covered = self._covered(request, params)
        if covered is None:  # recurrent state: a one-token prompt, or P's first token appended
            logger.info(
                "room=%d req=%s: recurrent-state model, %d prompt tokens%s: prefilled here; prefill told to free "
                "the room",
                params.room,
                request.request_id,
                request.num_prompt_tokens,
                " with prefill's first token appended" if params.prefilled_tokens is not None else "",
            )
            self.bypassed.record(request.request_id, BypassReason.STATE_RECOMPUTE)
            return self._free_without_load(request.request_id, params)
        missing = covered - num_computed_tokens
        if missing <= 0:
            # D's own prefix cache holds all P prefilled (a continuation of the first-token path can
            # end on a block boundary): no load, vLLM must not see finished_recving; P frees the room.
            logger.info(
                "room=%d req=%s: all %d prefilled tokens are in D's prefix cache; prefill told to free the room",
                params.room,
                request.request_id,
                covered,
            )
            self.bypassed.record(request.request_id, BypassReason.PREFIX_CACHED)
            return self._free_without_load(request.request_id, params)
        # Only a load of the whole prompt makes vLLM recompute its last token (which a window may
        # not reach); with P's first token appended, D computes that token itself.
        window = None
        if covered == request.num_prompt_tokens:
            window = replay_needs_freed_block(covered, self.sliding_windows, self.block_size)
        if window is not None:  # no load (vLLM must not see finished_recving): P is told to free the room
            logger.info(
                "room=%d req=%s: %d prompt tokens end where the %d-token window opens a block: vLLM's recompute "
                "of the last token would read a freed block, so this prompt is prefilled here",
                params.room,
                request.request_id,
                request.num_prompt_tokens,
                window,
            )
            self.bypassed.record(request.request_id, BypassReason.WINDOW_RECOMPUTE)
            return self._free_without_load(request.request_id, params)
        if self.d2rh is not None:
            answer = self.d2rh.begin(request, params, num_computed_tokens, covered)
            return self._d2rh_planned(request.request_id, answer)
        return missing, True

    def _d2rh_planned(self, rid: str, answer: tuple[int | None, bool]) -> tuple[int | None, bool]:
        """D2RH: once P was asked or told (anything but waiting for pool room), the room is planned."""
        assert self.d2rh is not None
        state = self.d2rh.state(rid)
        if state is not D2RHState.WAITING_POOL:
            self._recv_planned.add(rid)
            self._local_hits.pop(rid, None)
            if self._d_first is not None and state is D2RHState.STAGING:  # D first: now the proxy may ask P
                self._d_first.allocated(rid)
            elif self._d_first is not None:
                self._d_first.forget(rid)
        return answer

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        rid = request.request_id
        if self._chunks is not None and isinstance(prefill := self._params(request), PrefillParams):
            if prefill.room is not None and prefill.room not in self._live_rooms:  # a live room's is refused
                self._chunks.track(rid, prefill.room, request.num_prompt_tokens)
        if self.d2rh is not None and self.d2rh.knows(rid):  # host -> device copy (pd_connector.d2rh.scheduler)
            self.d2rh.allocated(rid, list(blocks.get_block_ids()[0]), num_external_tokens)
            if num_external_tokens > 0:
                self._awaiting_kv.add(rid)
            return
        if not self.cfg.is_decode or rid in self._recv_planned:
            return
        params = self._params(request)
        if not isinstance(params, DecodeParams):
            return
        self._recv_planned.add(rid)
        local = self._local_hits.pop(rid, 0)
        start_block = local // self.block_size
        covered = self._covered(request, params) or 0
        num_blocks = -(-covered // self.block_size)
        groups: list[list[int]] = []
        if num_external_tokens > 0:  # one block table per KV cache group (hybrid KV cache manager)
            tables = blocks.get_block_ids()
            groups = decode_group_blocks(tables, start_block, num_blocks)
            missing_state = fill_state_groups(groups, tables, self.state_groups, covered, start_block)
            if missing_state:  # vLLM gave no block where the state goes: nothing of it can be loaded
                logger.error(
                    "room=%d req=%s: recurrent-state KV cache groups %s hold no block for the state after %d "
                    "tokens: %s",
                    params.room,
                    rid,
                    missing_state,
                    covered,
                    [list(tables[g]) for g in missing_state],
                )
        # else the whole prompt was a local hit: P only has to free the room
        dst = groups[0] if groups else []
        self._recvs.append(
            RecvJob(
                req_id=rid,
                room=params.room,
                bootstrap_host=params.bootstrap_host,
                bootstrap_port=params.bootstrap_port,
                prefill_dp_rank=params.prefill_dp_rank,
                dst_block_ids=dst,
                start_block=start_block,
                num_tokens=covered,
                arrival_time=getattr(request, "arrival_time", None),
                admitted_at=time.time(),
                trace_headers=getattr(request, "trace_headers", None),
                dst_group_block_ids=groups if len(groups) > 1 else [],
            )
        )
        self._awaiting_kv.add(rid)
        if self._d_first is not None:  # D first: the proxy asks a prefill once D posts (off this thread)
            if num_external_tokens > 0:
                self._d_first.allocated(rid)
            else:
                self._d_first.forget(rid)
        logger.info(
            "room=%d req=%s: loading %d prompt tokens (%d blocks from block %d, %d KV cache groups) from prefill %s",
            params.room,
            rid,
            num_external_tokens,
            len(dst),
            start_block,
            max(1, len(groups)),
            params.bootstrap_addr,
        )

    def _abandon(self, rid: str, params: DecodeParams) -> None:
        """D: the request ended before its load was asked for; its worker tells P to free the room."""
        logger.info("room=%d req=%s: finished before its KV was asked for; prefill will be told", params.room, rid)
        self._abandoned.append(self._room_release(rid, params))

    def _free_without_load(self, rid: str, params: DecodeParams) -> tuple[int, bool]:
        """D loads nothing for ``rid`` (vLLM must not see a finished_recving): P is told to free the room."""
        self._recv_planned.add(rid)
        self._local_hits.pop(rid, None)
        if self._d_first is not None:
            self._d_first.forget(rid)
        self._abandoned.append(self._room_release(rid, params))
        return 0, False

    @staticmethod
    def _room_release(rid: str, params: DecodeParams) -> RecvJob:
        """D: a job whose worker only tells P to free the room (TransferCancel), no load."""
        return RecvJob(rid, params.room, params.bootstrap_host, params.bootstrap_port, params.prefill_dp_rank, [], 0, 0)

    # ------------------------------------------------------------- prefill side

    def request_finished(
        self, request: Request, block_ids: list[int] | tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        """``block_ids``: the request's blocks (one group), or one list per KV cache group (hybrid).

        vLLM (0.32 and 0.23 alike) calls this for every finished request on both roles, ABORTED ones on a
        kv_consumer included; (True, ...) keeps the blocks until a worker reports the request in
        finished_sending. D with migration holds an aborted request's KV here: ``request.num_computed_tokens``
        is then prompt + generated - 1 (plus a step still in flight with async scheduling; pd_connector.scheduling.migration).
        """
        groups = [list(g) for g in block_ids] if isinstance(block_ids, tuple) else [list(block_ids)]
        rid = request.request_id
        params = self._parsed.pop(rid) if rid in self._parsed else _params_of(request)
        truncated = rid in self._truncated  # P: prefilled without its last prompt token (state_groups)
        self._truncated.discard(rid)
        if self._chunks is not None:
            self._chunks.forget(rid)
        if self.d2rh is not None:
            self.d2rh.finished(rid)
        # D: KV not (yet) in the request's blocks: never asked for, loading, or landed but not run since.
        kv_pending = rid not in self._recv_planned or rid in self._awaiting_kv or rid in self._kv_ready
        if self.cfg.is_decode and isinstance(params, DecodeParams) and rid not in self._recv_planned:
            self._abandon(rid, params)  # aborted while it queued: P may hold the room for it
        self._local_hits.pop(rid, None)
        if self._d_first is not None:
            self._d_first.forget(rid)
        self._recv_planned.discard(rid)
        self._awaiting_kv.discard(rid)
        self._kv_ready.discard(rid)
        bypass = reason_for(self.cfg.is_prefill, getattr(request, "kv_transfer_params", None), params)
        if bypass is not None:
            self.bypassed.record(rid, bypass)
        if self._migration is not None and (held := self._migration.hold(request, params, groups, kv_pending)):
            self._sends.append(held)  # vLLM keeps the blocks until the worker reports it in finished_sending
            return True, None
        if not self.cfg.is_prefill or not isinstance(params, PrefillParams):
            return False, None
        from vllm.v1.request import RequestStatus

        finished_normally = request.status in (
            RequestStatus.FINISHED_LENGTH_CAPPED,
            RequestStatus.FINISHED_STOPPED,
        ) or (request.status.name == "FINISHED_REPETITION")
        if finished_normally and any(groups):
            holder = self._live_rooms.get(params.room)
            if holder is not None and holder != rid:  # a room is one prompt's KV: never filed twice
                error = f"bootstrap_room {params.room} is in use by request {holder}"
                logger.error("room=%d req=%s: %s; refusing this prefill, its KV is freed", params.room, rid, error)
                return False, prefill_refused(params.room, error)
            self._live_rooms[params.room] = rid
            self._room_of[rid] = params.room
            headers = getattr(request, "trace_headers", None)
            job = SendJob(
                rid,
                params.room,
                groups[0],
                request.num_prompt_tokens,
                getattr(request, "arrival_time", None),
                time.time(),
                headers,
                params.samples,
                groups if len(groups) > 1 else [],
            )
            self._sends.append(job)
            self._holding.add(rid)
            answer = decode_handoff(params.room, self._bootstrap_host, self.cfg.bootstrap_port, self.dp_rank)
            if truncated:  # its sampled token is not the answer's first (state_groups)
                answer[PREFILL_WITHOUT_LAST_TOKEN] = True
            return True, answer
        logger.warning("room=%d req=%s: prefill ended as %s; no KV to hand over", params.room, rid, request.status.name)
        self._dropped.append(params.room)
        return False, None

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        if self.d2rh is not None:
            self.d2rh.worker_output(getattr(output, "kv_connector_worker_meta", None))
        for rid in output.finished_sending or ():
            self._holding.discard(rid)
            if self._migration is not None:
                self._migration.released(rid)
            room = self._room_of.pop(rid, None)
            if room is not None and self._live_rooms.get(room) == rid:
                del self._live_rooms[room]
        for rid in output.finished_recving or ():
            if rid in self._awaiting_kv:
                self._awaiting_kv.discard(rid)
                self._kv_ready.add(rid)

    def has_pending_push_work(self) -> bool:
        return bool(self._holding or self._sends) or (self._migration is not None and self._migration.holding())

    # -------------------------------------------------------------------- both

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> PDConnectorMetadata:
        stages, loads = self._d2rh_step()
        meta = PDConnectorMetadata(
            sends=self._sends,
            dropped_rooms=self._dropped,
            recvs=self._recvs,
            abandoned=self._abandoned,
            idle=getattr(scheduler_output, "total_num_scheduled_tokens", 1) == 0,
            scheduled=self._first_scheduled(scheduler_output),
            layer_chunks=self._chunks.plan(scheduler_output) if self._chunks is not None else [],
            host_stages=stages,
            host_loads=loads,
        )
        self._sends, self._dropped, self._recvs, self._abandoned = [], [], [], []
        return meta

    def _d2rh_step(self) -> tuple[list[RecvJob], list[HostLoad]]:
        """D2RH: this step's staging jobs and host loads; rooms it needs nothing from are released."""
        if self.d2rh is None:
            return [], []
        stages, loads, releases = self.d2rh.take_step()
        self._abandoned.extend(self._room_release(rid, params) for rid, params in releases)
        return stages, loads

    def _first_scheduled(self, scheduler_output: SchedulerOutput) -> dict[str, float]:
        """D: requests whose KV arrived and that this step schedules (their first token's step)."""
        if not self._kv_ready:
            return {}
        now = time.time()
        scheduled = getattr(scheduler_output, "num_scheduled_tokens", None) or {}
        first = {rid: now for rid in self._kv_ready if rid in scheduled}
        self._kv_ready.difference_update(first)
        return first
