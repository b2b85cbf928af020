"""P side, pure: the write plan of one request (which bytes go to which D blocks: ``push_entries``,
``write_room``) and how many D requests a room expects. Whether a decode peer fits this rank at all is
``compat.peer_problem`` / ``compat.version_problem``, checked on its hello before any plan is made."""

from __future__ import annotations

from collections.abc import Sequence

from pd_connector import messages as proto
from pd_connector.layouts.kv_groups import BlockTableError, group_pairs, recv_groups, send_groups
from pd_connector.layouts.regions import LayoutError, Region
from pd_connector.layouts.tp import HeadSlice, expected_requests, plan_decode_rank, slices_from
from pd_connector.metadata import SendJob
from pd_connector.transfer.context import RankContext, RankSpec
from pd_connector.transfer.nhd_reshuffle import WriteFn, staged_work
from pd_connector.transfer.plan_cache import CompiledPlan, PlanCache, compile_plan, plan_entries

Entries = tuple[list[int], list[int], list[int]]


class BlockRangeError(LayoutError):
    """D asks for more blocks than the room holds (its prompt differs from P's)."""


def expected_requests_from(spec: RankSpec, room: int, peer: proto.PeerHello | None) -> int:
    """How many ranks of the peer's decode instance will ask this P rank for ``room`` (>= 1)."""
    if peer is None:
        return 1
    try:
        return expected_requests(
            spec.heads, spec.tp_size, peer.tp_size, spec.tp_rank, is_mla=spec.use_mla, spread=room % spec.tp_size
        )
    except LayoutError:
        return 1


def check_block_range(job: SendJob, req: proto.TransferRequest) -> int:
    """End (exclusive) of the room's blocks ``req`` asks for; BlockRangeError if the room lacks them."""
    end = req.start_block + len(req.dst_block_ids)
    if req.start_block < 0 or end > len(job.block_ids):
        raise BlockRangeError(
            f"decode asks for blocks {req.start_block}..{end - 1} but prefill holds "
            f"{len(job.block_ids)} blocks ({job.num_tokens} tokens): prompts differ?"
        )
    return end


def push_entries(
    spec: RankSpec,
    regions: Sequence[Region],
    peer: proto.PeerHello,
    job: SendJob,
    req: proto.TransferRequest,
    plans: PlanCache | None = None,
) -> Entries | None:
    """(src, dst, lengths) to write for ``req``; None when this rank only frees the room.

    The layout part of the plan comes from ``plans`` (compiled once per peer and spread, ``plan_cache``);
    without a cache it is compiled for this request alone.

    Raises BlockRangeError when D asks for blocks the room does not have, LayoutError when the
    layouts do not pair up.
    """
    if not req.dst_block_ids:
        return None
    check_block_range(job, req)  # group 0 (the single list); each group's range is checked by group_pairs
    spread = job.room % spec.tp_size
    plan = plan_decode_rank(spec.heads, spec.tp_size, peer.tp_size, peer.tp_rank, is_mla=spec.use_mla, spread=spread)
    slices = slices_from(plan, spec.tp_rank)
    if not slices:  # no D rank reads from this one
        return None
    try:  # every KV cache group's blocks over that group's regions; D's null blocks are skipped
        pairs = group_pairs(send_groups(job), recv_groups(req), req.start_block)
    except BlockTableError as exc:
        raise BlockRangeError(str(exc)) from None
    return plan_entries(compiled_plan(spec, regions, peer, slices, spread, plans), pairs)


def compiled_plan(
    spec: RankSpec,
    regions: Sequence[Region],
    peer: proto.PeerHello,
    slices: Sequence[HeadSlice],
    spread: int,
    plans: PlanCache | None = None,
) -> CompiledPlan:
    """The byte rows of this rank's pushes to ``peer`` (``plan_cache``): from ``plans`` when it holds the
    plan of this very hello, region table and spec, else compiled (and kept there)."""
    key = (peer.peer_id, spread)
    plan = plans.get(key, peer, regions, spec) if plans is not None else None
    if plan is not None:
        return plan
    owners = spec.region_groups or (0,) * len(regions)
    plan = compile_plan(
        owners,
        regions,
        [Region(*r) for r in peer.regions],
        slices,
        spec.local_kv_heads,
        peer.local_kv_heads,
        max(owners, default=0) + 1,
    )
    if plans is not None:
        plans.put(key, peer, regions, spec, plan)
    return plan


def write_room(
    spec: RankSpec,
    ctx: RankContext,
    peer: proto.PeerHello,
    job: SendJob,
    req: proto.TransferRequest,
    write: WriteFn,
    plans: PlanCache | None = None,
) -> tuple[int, int]:
    """Write the blocks ``req`` asks for with ``write``; (bytes, entries), (0, 0) when this rank only frees the room.

    Token-major KV whose plan splits heads goes through ``ctx.reshuffle`` (nhd_reshuffle), everything
    else through ``push_entries`` (its layout part from ``plans``).
    """
    if ctx.reshuffle is not None and req.dst_block_ids:
        check_block_range(job, req)
        staged = staged_work(spec, peer, job, req.start_block, req.dst_block_ids)
        if staged is not None:
            slices, pairs = staged
            return ctx.reshuffle.push(ctx.regions, [Region(*r) for r in peer.regions], slices, pairs, write)
    plan = push_entries(spec, ctx.regions, peer, job, req, plans)
    if plan is None:
        return 0, 0
    write(*plan)
    return sum(plan[2]), len(plan[2])
