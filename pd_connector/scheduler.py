"""Scheduler side of PDConnector (runs in vLLM's EngineCore process; no I/O).

It decides, per request, what moves: D asks vLLM to hold the uncomputed prompt
tokens for an async load; P keeps a finished prefill's blocks (delay free)
until its worker reports the push done. Everything it decides reaches the
workers as `PDConnectorMetadata`, once per engine step.

Optional features (D2RH, migration, layer mode, recurrent state, DP-rank rooms, D first) are
extensions (pd_connector.scheduling.extension), chosen by role and config in
``scheduling.selection.extensions_for``: each hook below runs the core logic, then the extensions.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, TypeVar

from pd_connector.accounting import ACCOUNT_KEY, KVAccounts
from pd_connector.bootstrap.placement import advertised_bootstrap_host
from pd_connector.bypass import BypassCounter, BypassReason, reason_for
from pd_connector.config import DisaggConfig
from pd_connector.kv_params import DecodeParams, PrefillParams, decode_handoff, prefill_refused
from pd_connector.layouts.kv_groups import decode_group_blocks
from pd_connector.metadata import PDConnectorMetadata, RecvJob, SendJob
from pd_connector.scheduling.decisions import no_load_reason, params_of, prefilled_tokens
from pd_connector.scheduling.extension import Finish, Match, Params, Plan, SchedulerExtension, overrides, room_release
from pd_connector.scheduling.selection import extensions_for

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = logging.getLogger(__name__)

E = TypeVar("E", bound=SchedulerExtension)


class PDScheduler:
    """``extensions``: the optional features this engine runs, in hook order; by default those
    ``extensions_for`` chooses from ``cfg`` alone (the connector passes the engine's).
    ``group_block_bytes`` (bytes of one block per KV cache group on one rank) and ``kv_ranks`` (D's TP
    ranks) size the ``kv_bytes`` of D's per-request KV accounting (pd_connector.accounting)."""

    def __init__(
        self,
        cfg: DisaggConfig,
        block_size: int,
        dp_rank: int = 0,
        sliding_windows: Sequence[int] = (),
        extensions: Sequence[SchedulerExtension] | None = None,
        group_block_bytes: Sequence[int] = (),
        kv_ranks: int = 1,
    ) -> None:
        self.cfg = cfg
        self.block_size = block_size  # the attention KV cache groups' (a recurrent-state group has its own)
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
        self._parsed: dict[str, Params] = {}
        # Requests served without a transfer (logged and counted: pd_connector.bypass).
        self.bypassed = BypassCounter("prefill" if cfg.is_prefill else "decode")
        # D: where each request's prompt KV came from, returned with its finished output.
        self.accounts = KVAccounts(block_size, group_block_bytes, kv_ranks)
        if extensions is None:
            extensions = extensions_for(cfg, block_size, dp_rank=dp_rank)
        self.extensions = list(extensions)
        self._on_arrival = [e for e in self.extensions if overrides(e, "arrived")]
        for extension in self.extensions:
            extension.attach(self)

    def extension(self, kind: type[E]) -> E | None:
        """This scheduler's extension of type ``kind``, or None when it runs none."""
        return next((e for e in self.extensions if isinstance(e, kind)), None)

    def room_holder(self, room: int) -> str | None:
        """P: the request whose finished prefill holds ``room``'s KV, or None when the room is free."""
        return self._live_rooms.get(room)

    def _params(self, request: Request) -> Params:
        rid = request.request_id
        if rid not in self._parsed:
            own = next((p for e in self.extensions if (p := e.params(request)) is not None), None)
            self._parsed[rid] = own or params_of(request)
        return self._parsed[rid]

    def on_new_request(self, request: Request) -> None:
        """vLLM's scheduler added the request (``Scheduler.add_request``, vLLM 0.23 and 0.32), before it is
        ever scheduled: nothing is allocated or computed for it yet. Only extensions act here (P with
        several DP ranks registers the room; P of a recurrent-state model drops the last prompt token)."""
        if not self._on_arrival:
            return
        params = self._params(request)
        for extension in self._on_arrival:
            extension.arrived(request, params)

    def _covered(self, request: Request, params: DecodeParams) -> int | None:
        """D: prompt tokens whose KV (and state) P holds; None when this prompt is prefilled here."""
        tokens: int | None = prefilled_tokens(request, params)
        for extension in self.extensions:
            tokens = extension.prefilled(request, params, tokens)
        return tokens

    # -------------------------------------------------------------- decode side

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        """vLLM asks about a waiting request (maybe every step until it is scheduled); no block is
        allocated for it yet, ``num_computed_tokens`` is its local prefix cache hit.

        D, a request with P's KV: the prompt tokens past the local hit, loaded async (vLLM parks it in
        WAITING_FOR_REMOTE_KVS); (0, False) when nothing is loaded (P is told to free the room), and
        on P or for a local request. An extension that owns the request answers first.
        """
        rid = request.request_id
        if self.cfg.is_decode:  # a later lookup (vLLM recomputing after a failed load) replaces it
            self.accounts.local_hit(rid, num_computed_tokens)
        for extension in self.extensions:
            if (owned := extension.match(request, num_computed_tokens)) is not None:
                return self._matched(rid, owned)
        if not self.cfg.is_decode or rid in self._recv_planned:
            return 0, False
        params = self._params(request)
        if not isinstance(params, DecodeParams):
            return 0, False
        self._local_hits[rid] = num_computed_tokens
        covered = self._covered(request, params)
        reason = no_load_reason(request, params, covered, num_computed_tokens, self.sliding_windows, self.block_size)
        if reason is not None or covered is None:  # (covered None always has its reason)
            self.bypassed.record(rid, reason or BypassReason.STATE_RECOMPUTE)
            self.accounts.bypassed(rid, reason or BypassReason.STATE_RECOMPUTE)
            return self._free_without_load(rid, params)
        for extension in self.extensions:
            if (taken := extension.take_load(request, params, num_computed_tokens, covered)) is not None:
                return self._matched(rid, taken)
        return covered - num_computed_tokens, True

    def _matched(self, rid: str, match: Match) -> tuple[int | None, bool]:
        """An extension's answer; once it decided the room, the core plans no load of its own."""
        if match.plan is not Plan.UNDECIDED:
            self._decided(rid, match.plan)
        return match.tokens, match.load_async

    def _decided(self, rid: str, plan: Plan) -> None:
        """D decided what P does with ``rid``'s room: the extensions are told (D first posts on PUSH)."""
        self._recv_planned.add(rid)
        self._local_hits.pop(rid, None)
        for extension in self.extensions:
            extension.decided(rid, plan)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        """vLLM allocated blocks for the request: for the load's ``num_external_tokens`` (then again for
        more blocks once the load is done), or for computing it; nothing is written into them yet.

        D, first call: records which of the new blocks P must fill (one list per KV cache group).
        """
        rid = request.request_id
        params = self._params(request)
        owned = False
        for extension in self.extensions:
            owned = extension.alloc(request, params, blocks, num_external_tokens) or owned
        if owned:  # the extension loads it (D2RH: host -> device copy)
            if num_external_tokens > 0:
                self._awaiting_kv.add(rid)
                self._account_load(rid, blocks, num_external_tokens)
            return
        if not self.cfg.is_decode or rid in self._recv_planned or not isinstance(params, DecodeParams):
            if self.cfg.is_decode and num_external_tokens > 0:  # an extension's load (D first, layer mode)
                self._account_load(rid, blocks, num_external_tokens)
            return
        local = self._local_hits.pop(rid, 0)
        start_block = local // self.block_size
        covered = self._covered(request, params) or 0
        groups: list[list[int]] = []
        if num_external_tokens > 0:  # one block table per KV cache group (hybrid KV cache manager)
            tables = blocks.get_block_ids()
            groups = decode_group_blocks(tables, start_block, -(-covered // self.block_size))
            for extension in self.extensions:
                groups = extension.load_blocks(request, params, tables, groups, covered, start_block)
            self.accounts.load(rid, num_external_tokens, groups)
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
        self._decided(rid, Plan.PUSH if num_external_tokens > 0 else Plan.FREE)
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

    def _account_load(self, rid: str, blocks: KVCacheBlocks, tokens: int) -> None:
        """D: an extension's load of ``tokens`` tokens past the local hit, for the request's KV accounting."""
        start = self.accounts.hit_of(rid) // self.block_size
        end = -(-(self.accounts.hit_of(rid) + tokens) // self.block_size)
        self.accounts.load(rid, tokens, decode_group_blocks(blocks.get_block_ids(), start, end))

    def _free_without_load(self, rid: str, params: DecodeParams) -> tuple[int, bool]:
        """D loads nothing for ``rid`` (vLLM must not see a finished_recving): P is told to free the room."""
        self._decided(rid, Plan.FREE)
        self._abandoned.append(room_release(rid, params))
        return 0, False

    # ------------------------------------------------------------- prefill side

    def request_finished(self, request: Request, block_ids: list[int] | tuple[list[int], ...]) -> Finish:
        """vLLM calls this once per finished request on both roles (0.32 and 0.23 alike), ABORTED ones on a
        kv_consumer included, before it frees the request's blocks; the forward of its last step is done
        (with async scheduling, one more step may still be in flight). ``block_ids``: the request's blocks
        (one group), or one list per KV cache group (hybrid, ``request_finished_all_groups``).

        (True, ...) keeps the blocks until a worker reports the request in finished_sending. P: a prefill
        that finished normally is handed over (its answer tells D where); D with migration holds an
        aborted request's KV (``request.num_computed_tokens`` is then prompt + generated - 1, plus a step
        still in flight with async scheduling: pd_connector.scheduling.migration).
        """
        groups = [list(g) for g in block_ids] if isinstance(block_ids, tuple) else [list(block_ids)]
        rid = request.request_id
        params = self._parsed.pop(rid) if rid in self._parsed else params_of(request)
        # D: KV not (yet) in the request's blocks: never asked for, loading, or landed but not run since.
        kv_pending = rid not in self._recv_planned or rid in self._awaiting_kv or rid in self._kv_ready
        if self.cfg.is_decode and isinstance(params, DecodeParams) and rid not in self._recv_planned:
            # aborted while it queued: P may hold the room for it; its worker tells P to free it
            logger.info("room=%d req=%s: finished before its KV was asked for; prefill will be told", params.room, rid)
            self._abandoned.append(room_release(rid, params))
        self._local_hits.pop(rid, None)
        self._recv_planned.discard(rid)
        self._awaiting_kv.discard(rid)
        self._kv_ready.discard(rid)
        # kv_both: a request is P's or D's by its params
        as_prefill = self.cfg.is_prefill and not (self.cfg.is_both and isinstance(params, DecodeParams))
        bypass = reason_for(as_prefill, getattr(request, "kv_transfer_params", None), params)
        if bypass is not None:
            self.bypassed.record(rid, bypass)
            self.accounts.bypassed(rid, bypass)
        answer = self._hand_over(request, params, groups)
        for extension in self.extensions:
            answer = extension.finished(request, params, groups, kv_pending, answer) or answer
        return self._with_account(request, params, answer)

    def _with_account(self, request: Request, params: Params, answer: Finish) -> Finish:
        """D: a request that finished normally answers its KV account (``kv_transfer_params.pd_kv``)."""
        rid = request.request_id
        if not self.cfg.is_decode or isinstance(params, PrefillParams) or not _finished_normally(request):
            self.accounts.forget(rid)
            return answer
        account = self.accounts.finish(rid, request.num_prompt_tokens, isinstance(params, DecodeParams))
        logger.debug("req=%s KV account: %s", rid, account)
        delay, out = answer
        return delay, {**(out or {}), ACCOUNT_KEY: account.to_json()}

    def _hand_over(self, request: Request, params: Params, groups: list[list[int]]) -> Finish:
        """P: a prefill that finished normally keeps its blocks for D; its answer tells D where they are."""
        if not self.cfg.is_prefill or not isinstance(params, PrefillParams):
            return False, None
        rid = request.request_id
        if not _finished_normally(request) or not any(groups):
            logger.warning(
                "room=%d req=%s: prefill ended as %s; no KV to hand over", params.room, rid, request.status.name
            )
            self._dropped.append(params.room)
            return False, None
        holder = self._live_rooms.get(params.room)
        if holder is not None and holder != rid:  # a room is one prompt's KV: never filed twice
            error = f"bootstrap_room {params.room} is in use by request {holder}"
            logger.error("room=%d req=%s: %s; refusing this prefill, its KV is freed", params.room, rid, error)
            return False, prefill_refused(params.room, error)
        self._live_rooms[params.room] = rid
        self._room_of[rid] = params.room
        job = SendJob(
            rid,
            params.room,
            groups[0],
            request.num_prompt_tokens,
            getattr(request, "arrival_time", None),
            time.time(),
            getattr(request, "trace_headers", None),
            params.samples,
            groups if len(groups) > 1 else [],
        )
        self._sends.append(job)
        self._holding.add(rid)
        return True, decode_handoff(params.room, self._bootstrap_host, self.cfg.bootstrap_port, self.dp_rank)

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        """vLLM hands over the workers' aggregated results of a step (after their get_finished): pushes
        done on P (their blocks are freed by vLLM now), loads done on D (their KV is in device memory)."""
        for rid in output.finished_sending or ():
            self._holding.discard(rid)
            room = self._room_of.pop(rid, None)
            if room is not None and self._live_rooms.get(room) == rid:
                del self._live_rooms[room]
        for rid in output.finished_recving or ():
            self.accounts.load_finished(rid)
            if rid in self._awaiting_kv:
                self._awaiting_kv.discard(rid)
                self._kv_ready.add(rid)
        for rid in getattr(output, "failed_recving", None) or ():  # vLLM >= 0.32: failed loads by id
            self.accounts.load_failed(rid)
        if invalid := getattr(output, "invalid_block_ids", None):  # vLLM 0.23: by block
            self.accounts.blocks_failed(set(invalid))
        for extension in self.extensions:
            extension.output(output)

    def has_pending_push_work(self) -> bool:
        """Polled by vLLM's engine loop: True keeps it stepping while blocks are held for a push."""
        return bool(self._holding or self._sends) or any(e.busy() for e in self.extensions)

    # -------------------------------------------------------------------- both

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> PDConnectorMetadata:
        """vLLM calls this at the end of every ``schedule()``, before the step's forward is queued on the
        device: this step's work for the workers (they read it in start_load_kv)."""
        meta = PDConnectorMetadata(
            sends=self._sends,
            dropped_rooms=self._dropped,
            recvs=self._recvs,
            abandoned=self._abandoned,
            idle=getattr(scheduler_output, "total_num_scheduled_tokens", 1) == 0,
            scheduled=self._first_scheduled(scheduler_output),
        )
        self._sends, self._dropped, self._recvs, self._abandoned = [], [], [], []
        for new in getattr(scheduler_output, "scheduled_new_reqs", None) or ():  # KV in place at its first step
            self.accounts.scheduled(new.req_id, new.num_computed_tokens)
        for extension in self.extensions:
            extension.meta(scheduler_output, meta)
        return meta

    def _first_scheduled(self, scheduler_output: SchedulerOutput) -> dict[str, float]:
        """D: requests whose KV arrived and that this step schedules (their first token's step)."""
        if not self._kv_ready:
            return {}
        now = time.time()
        scheduled = getattr(scheduler_output, "num_scheduled_tokens", None) or {}
        first = {rid: now for rid in self._kv_ready if rid in scheduled}
        self._kv_ready.difference_update(first)
        return first


def _finished_normally(request: Request) -> bool:
    """The request stopped or reached its length (not aborted, not failed)."""
    return request.status.name in ("FINISHED_STOPPED", "FINISHED_LENGTH_CAPPED", "FINISHED_REPETITION")
