"""P side, pure: the write plan of one request (which bytes go to which D blocks: ``push_entries``,
``write_room``) and how many D requests a room expects. Whether a decode peer fits this rank at all is
``compat.peer_problem`` / ``compat.version_problem``, checked on its hello before any plan is made."""

from __future__ import annotations

from collections.abc import Sequence

from pd_connector import messages as proto
from pd_connector.layouts.kv_groups import (
    BlockTableError,
    group_entries,
    group_pairs,
    recv_groups,
    send_groups,
)
from pd_connector.layouts.regions import LayoutError, Region
from pd_connector.layouts.tp import (
    expected_requests,
    plan_decode_rank,
    slices_from,
    tp_transfer_entries,
)
from pd_connector.metadata import SendJob
from pd_connector.transfer.context import RankContext, RankSpec
from pd_connector.transfer.nhd_reshuffle import WriteFn, staged_work

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
    spec: RankSpec, regions: Sequence[Region], peer: proto.PeerHello, job: SendJob, req: proto.TransferRequest
) -> Entries | None:
    """(src, dst, lengths) to write for ``req``; None when this rank only frees the room.

    Raises BlockRangeError when D asks for blocks the room does not have, LayoutError when the
    layouts do not pair up.
    """
    if not req.dst_block_ids:
        return None
    check_block_range(job, req)  # group 0 (the single list); each group's range is checked by group_pairs
    plan = plan_decode_rank(
        spec.heads, spec.tp_size, peer.tp_size, peer.tp_rank, is_mla=spec.use_mla, spread=job.room % spec.tp_size
    )
    slices = slices_from(plan, spec.tp_rank)
    if not slices:  # no D rank reads from this one
        return None
    try:  # every KV cache group's blocks over that group's regions; D's null blocks are skipped
        pairs = group_pairs(send_groups(job), recv_groups(req), req.start_block)
    except BlockTableError as exc:
        raise BlockRangeError(str(exc)) from None
    peer_regions = [Region(*r) for r in peer.regions]
    owners = spec.region_groups or (0,) * len(regions)
    local, remote = spec.local_kv_heads, peer.local_kv_heads
    return group_entries(
        owners, regions, peer_regions, pairs, lambda s, d, runs: tp_transfer_entries(s, d, slices, local, remote, runs)
    )


def write_room(
    spec: RankSpec, ctx: RankContext, peer: proto.PeerHello, job: SendJob, req: proto.TransferRequest, write: WriteFn
) -> tuple[int, int]:
    """Write the blocks ``req`` asks for with ``write``; (bytes, entries), (0, 0) when this rank only frees the room.

    Token-major KV whose plan splits heads goes through ``ctx.reshuffle`` (nhd_reshuffle), everything
    else through ``push_entries``.
    """
    if ctx.reshuffle is not None and req.dst_block_ids:
        check_block_range(job, req)
        staged = staged_work(spec, peer, job, req.start_block, req.dst_block_ids)
        if staged is not None:
            slices, pairs = staged
            return ctx.reshuffle.push(ctx.regions, [Region(*r) for r in peer.regions], slices, pairs, write)
    plan = push_entries(spec, ctx.regions, peer, job, req)
    if plan is None:
        return 0, 0
    write(*plan)
    return sum(plan[2]), len(plan[2])
