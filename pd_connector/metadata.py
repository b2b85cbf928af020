"""Scheduler -> worker messages of one engine step (KVConnectorMetadata)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from pd_connector.kv_params import host_port
from pd_connector.scheduling.layer_chunks import LayerChunk
from pd_connector.vllm_lines.bases import KVConnectorMetadata


@dataclass(frozen=True)
class SendJob:
    """P: request `req_id` (room) finished prefill; its KV sits in `block_ids`. D with migration: an aborted
    request's KV held as its migrate room (pd_connector.scheduling.migration)."""

    req_id: str
    room: int
    block_ids: list[int]
    num_tokens: int
    # Phase trace only (pd_connector.trace; not compared): wall-clock arrival / prefill-done times, trace context.
    arrival_time: float | None = field(default=None, compare=False)
    prefill_done_at: float | None = field(default=None, compare=False)
    trace_headers: Mapping[str, str] | None = field(default=None, compare=False)
    # Decode requests (D's n samples) that load this room; each is served once.
    samples: int = 1
    # Hybrid KV cache manager (pd_connector.layouts.kv_groups): every group's block table (block_ids is group 0); empty: one group.
    group_block_ids: list[list[int]] = field(default_factory=list)
    # How long the room waits for a decode to ask (None: room_timeout_s); D's migrate rooms: migrate_hold_s.
    hold_s: float | None = None

    def hold_seconds(self, default: float) -> float:
        """How long this room's KV is held unclaimed: its own ``hold_s``, else ``default`` (room_timeout_s)."""
        return self.hold_s if self.hold_s is not None else default


@dataclass(frozen=True)
class RecvJob:
    """D: fetch the prompt KV of room into dst_block_ids (P block index start_block on)."""

    req_id: str
    room: int
    bootstrap_host: str
    bootstrap_port: int
    prefill_dp_rank: int | None
    dst_block_ids: list[int]
    start_block: int
    num_tokens: int
    # Phase trace only (pd_connector.trace; not compared): wall-clock arrival / admission times, trace context.
    arrival_time: float | None = field(default=None, compare=False)
    admitted_at: float | None = field(default=None, compare=False)
    trace_headers: Mapping[str, str] | None = field(default=None, compare=False)
    # Hybrid KV cache manager (pd_connector.layouts.kv_groups): every group's blocks (dst_block_ids is group 0); empty: one group.
    dst_group_block_ids: list[list[int]] = field(default_factory=list)

    @property
    def bootstrap_addr(self) -> str:
        return host_port(self.bootstrap_host, self.bootstrap_port)


@dataclass(frozen=True)
class HostLoad:
    """D2RH (pd_connector.d2rh.scheduler): copy host blocks into the request's device blocks (pairwise); ``failed``: the
    staging failed, report the load failed. ``hit_blocks``: of them, blocks that were host-pool hits."""

    req_id: str
    host_block_ids: list[int]
    dst_block_ids: list[int]
    failed: bool = False
    hit_blocks: int = 0


@dataclass
class PDConnectorMetadata(KVConnectorMetadata):
    sends: list[SendJob] = field(default_factory=list)
    # P: rooms whose request ended without KV to hand over (aborted, error).
    dropped_rooms: list[int] = field(default_factory=list)
    recvs: list[RecvJob] = field(default_factory=list)
    # D: requests vLLM finished before their load was asked for (no blocks: P is only told to free the room).
    abandoned: list[RecvJob] = field(default_factory=list)
    # Nothing to compute this step: the engine only polls for transfers. The worker then
    # waits briefly for transfer progress instead of letting the engine loop spin a core.
    idle: bool = False
    # D: requests scheduled for the first time after their KV arrived -> when (wall clock).
    scheduled: dict[str, float] = field(default_factory=dict)
    # P, transfer_mode "layer": which blocks of which rooms this step's forward completes (layer_chunks).
    layer_chunks: list[LayerChunk] = field(default_factory=list)
    # D2RH: loads into host blocks (dst ids are host block ids) and host -> device copies (pd_connector.d2rh.scheduler).
    host_stages: list[RecvJob] = field(default_factory=list)
    host_loads: list[HostLoad] = field(default_factory=list)
