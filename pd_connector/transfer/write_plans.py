"""P side, pure: the write plan of one request (which bytes go to which D blocks: ``push_entries``,
``write_room``), how many D requests a room expects, and whether a decode peer fits this rank at all
(``peer_problem``, ``version_problem``: checked on its hello, before any plan is made)."""

from __future__ import annotations

from collections.abc import Sequence

from pd_connector import protocol as proto
from pd_connector.compat import KVFacts, kv_mismatch
from pd_connector.kv_groups import (
    BlockTableError,
    check_peer_groups,
    group_entries,
    group_pairs,
    recv_groups,
    send_groups,
)
from pd_connector.layout import LayoutError, Region
from pd_connector.metadata import SendJob
from pd_connector.tp_mapping import (
    MappingError,
    check_head_regions,
    expected_requests,
    needs_head_split,
    plan_decode_rank,
    slices_from,
    tp_transfer_entries,
)
from pd_connector.transfer.context import RankContext, RankSpec
from pd_connector.transfer.nhd_reshuffle import WriteFn, staged_work

Entries = tuple[list[int], list[int], list[int]]


class BlockRangeError(LayoutError):
    """D asks for more blocks than the room holds (its prompt differs from P's)."""


def version_problem(hello: proto.PeerHello) -> str | None:
    """Why a decode peer speaks another ZMQ wire version than this rank (naming both); None if it does not."""
    if hello.wire_version == proto.WIRE_VERSION:
        return None
    theirs = hello.wire_version or "1 or older (no version in its PeerHello)"
    return (
        f"incompatible decode instance {hello.peer_id}: it speaks PDConnector wire version {theirs}, "
        f"this prefill rank speaks version {proto.WIRE_VERSION}; run the same PDConnector release on P and D"
    )


def peer_problem(spec: RankSpec, regions: Sequence[Region], hello: proto.PeerHello) -> str | None:
    """Why KV of this P rank cannot go to the decode rank that sent ``hello``; None if it can."""
    try:
        ours = KVFacts(spec.block_size, spec.kv_dtype, spec.num_layers)
        theirs = KVFacts(hello.block_size, hello.kv_dtype, hello.num_layers)
        problem = kv_mismatch("this prefill instance", ours, f"decode instance {hello.peer_id}", theirs)
        if problem is not None:
            raise LayoutError(problem)
        if (hello.total_kv_heads, hello.use_mla) != (spec.total_kv_heads, spec.use_mla):
            raise LayoutError(
                f"model mismatch: prefill has {spec.total_kv_heads} KV heads (MLA {spec.use_mla}), "
                f"decode {hello.total_kv_heads} (MLA {hello.use_mla})"
            )
        check_head_regions(regions, [Region(*r) for r in hello.regions], spec.local_kv_heads, hello.local_kv_heads)
        check_peer_groups(spec.region_groups, hello.region_groups, len(regions))
        plan = plan_decode_rank(spec.heads, spec.tp_size, hello.tp_size, hello.tp_rank, is_mla=spec.use_mla)
        head_major = spec.heads_outermost and hello.heads_outermost
        staged = spec.token_major and hello.token_major  # transfer.nhd_reshuffle
        split = needs_head_split(plan, spec.local_kv_heads, hello.local_kv_heads)
        if split and not head_major and staged and len(set(spec.region_groups)) > 1:
            raise MappingError(
                f"prefill TP {spec.tp_size} / decode TP {hello.tp_size} on token-major (NHD) KV is reshuffled for "
                "one KV cache group only, this model has several; use equal TP sizes or "
                "--disable-hybrid-kv-cache-manager"
            )
        if split and not (head_major or staged):
            raise MappingError(
                f"prefill TP {spec.tp_size} / decode TP {hello.tp_size} split KV heads inside a block, "
                "but the KV layout keeps heads inside tokens (NHD) and is not reshuffled on both sides "
                "(staging_bytes 0, decode.tp_size set to prefill's TP size, or a layout other than "
                "[blocks, block_size, heads, dim]); use equal TP sizes"
            )
    except LayoutError as exc:
        return f"incompatible decode instance {hello.peer_id}: {exc}"
    return None


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
