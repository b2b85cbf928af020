"""Rank and head mapping between prefill (P) and decode (D) tensor-parallel layouts.

P and D may run different TP sizes. Every worker rank holds a slice of the
model's KV heads, distributed the way vLLM does it (``QKVParallelLinear``) for
``H`` total KV heads over ``T`` ranks:

- ``T <= H``: rank ``r`` holds global heads ``[r*H/T, (r+1)*H/T)`` (``H % T == 0``);
- ``T > H``: heads are replicated, each rank holds one head, rank ``r`` holds
  head ``r // (T // H)`` (``T % H == 0``).

MLA keeps one latent KV per token that is replicated on every rank: it is
handled as ``H = 1`` (every rank holds "head" 0), so exactly one P rank sends
each D rank its whole blocks.

A D rank's *plan* (:func:`plan_decode_rank`) lists, as :class:`HeadSlice` entries,
which P rank sends which run of its local heads to which D-local head index.
When several P ranks hold a head (P replicated), the choice spreads the load:
the ``j``-th of ``n`` D ranks that need the head takes P replica
``j % m`` (``n >= m`` replicas) or ``j * m // n`` (``n < m``), rotated by the
optional ``spread`` (for instance ``room % p_tp`` to also spread over rooms;
both sides must pass the same value). The number of D ranks a P rank serves
then differs by at most one between the P ranks holding the same head.

Some P ranks may hold no head that any D rank takes from them (P replicated
beyond what D needs, e.g. MLA with ``d_tp < p_tp``). They still hold the
room's blocks, so a D rank must tell them to let go: :func:`decode_contacts`
adds each such *idle* P rank to exactly one D rank's contact list (that D rank
sends it a ``TransferRequest`` with no destination blocks) and
:func:`expected_requests` tells a P rank how many D ranks of one D instance
will contact it per room (always >= 1).

Bytes: a KV *region* (``layout.Region``) is one (layer, K/V part) slab seen
block by block. Inside a block, a run of consecutive heads is one contiguous
byte range only when heads are the outermost per-block dimension ("head
major": vLLM CPU ``[num_blocks, heads, block_size, 2*head_dim]``, CUDA HND
``[2, num_blocks, heads, block_size, head_dim]``). vLLM-Ascend's
``[num_blocks, block_size, heads, head_dim]`` (NHD) puts heads inside tokens: a
head slice there would be one transfer per token, so a plan that splits heads
goes through ``transfer.nhd_reshuffle`` instead (heads regrouped with torch ops in
a staging buffer, one byte range per block and slice) or, without it, is refused
at the handshake (:func:`is_head_major`). Plans that copy whole blocks
(equal TP, MLA, both sides down to one replicated head) work with any layout.

Everything here is pure: no I/O, no tensors touched.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from pd_connector.layouts.regions import LayoutError, Region, block_dim

__all__ = [
    "HeadSlice",
    "MappingError",
    "check_head_regions",
    "decode_contacts",
    "expected_requests",
    "head_entries",
    "is_head_major",
    "local_heads",
    "needs_head_split",
    "plan_decode_rank",
    "senders_for",
    "slices_from",
    "tp_transfer_entries",
]


class MappingError(LayoutError):
    """TP sizes, head counts or KV layouts that cannot be mapped between P and D.

    A ``LayoutError`` (hence a ``ValueError``), so code that already reports
    layout mismatches reports these too.
    """


@dataclass(frozen=True)
class HeadSlice:
    """Copy ``num_heads`` consecutive local heads of P rank ``p_rank``.

    They start at P-local head index ``src_head`` and land at D-local head index
    ``dst_head`` (indices count heads inside one rank's block, not global ids).
    """

    p_rank: int
    src_head: int
    dst_head: int
    num_heads: int


# ------------------------------------------------------------------ head layout


def _check_tp(total_kv_heads: int, tp_size: int, side: str = "") -> None:
    label = f"{side} TP size" if side else "TP size"
    if total_kv_heads < 1:
        raise MappingError(f"total KV heads must be >= 1, got {total_kv_heads}")
    if tp_size < 1:
        raise MappingError(f"{label} must be >= 1, got {tp_size}")
    if tp_size <= total_kv_heads:
        if total_kv_heads % tp_size:
            raise MappingError(
                f"{total_kv_heads} KV heads cannot be split evenly over {label} {tp_size} "
                f"({total_kv_heads} % {tp_size} != 0)"
            )
    elif tp_size % total_kv_heads:
        raise MappingError(
            f"{label} {tp_size} is larger than the {total_kv_heads} KV heads but not a multiple of it: "
            f"heads cannot be replicated evenly ({tp_size} % {total_kv_heads} != 0)"
        )


def _check_rank(tp_size: int, rank: int, side: str = "") -> None:
    if not 0 <= rank < tp_size:
        label = f"{side} rank" if side else "rank"
        raise MappingError(f"{label} {rank} is out of range for TP size {tp_size}")


def local_heads(total_kv_heads: int, tp_size: int, rank: int) -> list[int]:
    """Global KV head ids held by TP rank ``rank``, in local order (vLLM's distribution)."""
    _check_tp(total_kv_heads, tp_size)
    _check_rank(tp_size, rank)
    if tp_size <= total_kv_heads:
        per_rank = total_kv_heads // tp_size
        return list(range(rank * per_rank, (rank + 1) * per_rank))
    return [rank // (tp_size // total_kv_heads)]


def _holders(total_kv_heads: int, tp_size: int, head: int) -> tuple[list[int], int]:
    """(ranks holding global head ``head``, its local index on each of them)."""
    if tp_size <= total_kv_heads:
        per_rank = total_kv_heads // tp_size
        return [head // per_rank], head % per_rank
    replicas = tp_size // total_kv_heads
    return list(range(head * replicas, (head + 1) * replicas)), 0


def _pick(consumer: int, consumers: int, producers: int, spread: int) -> int:
    """Which of ``producers`` replicas the ``consumer``-th of ``consumers`` takes (balanced)."""
    base = consumer % producers if consumers >= producers else consumer * producers // consumers
    return (base + spread) % producers


def plan_decode_rank(
    total_kv_heads: int,
    p_tp: int,
    d_tp: int,
    d_rank: int,
    *,
    is_mla: bool,
    spread: int = 0,
) -> list[HeadSlice]:
    """The slices D rank ``d_rank`` receives, covering each of its local heads exactly once.

    Consecutive heads from the same P rank are merged into one slice; slices
    are ordered by ``dst_head``. For MLA (``total_kv_heads`` is ignored) it is
    one ``HeadSlice(p_rank, 0, 0, 1)``. ``spread`` rotates the choice among
    replicated P ranks; P and D must use the same value.
    """
    heads = 1 if is_mla else total_kv_heads
    _check_tp(heads, p_tp, "prefill")
    _check_tp(heads, d_tp, "decode")
    _check_rank(d_tp, d_rank, "decode")
    d_replicas = max(1, d_tp // heads)  # D ranks that hold each head
    consumer = d_rank % d_replicas
    slices: list[HeadSlice] = []
    for dst, head in enumerate(local_heads(heads, d_tp, d_rank)):
        ranks, src = _holders(heads, p_tp, head)
        p_rank = ranks[_pick(consumer, d_replicas, len(ranks), spread)]
        if slices:
            last = slices[-1]
            if (
                last.p_rank == p_rank
                and last.src_head + last.num_heads == src
                and last.dst_head + last.num_heads == dst
            ):
                slices[-1] = HeadSlice(p_rank, last.src_head, last.dst_head, last.num_heads + 1)
                continue
        slices.append(HeadSlice(p_rank, src, dst, 1))
    return slices


def slices_from(slices: Iterable[HeadSlice], p_rank: int) -> list[HeadSlice]:
    """The part of a D rank's plan that P rank ``p_rank`` sends (may be empty)."""
    return [s for s in slices if s.p_rank == p_rank]


def senders_for(total_kv_heads: int, p_tp: int, d_tp: int, *, is_mla: bool, spread: int = 0) -> dict[int, list[int]]:
    """For every P rank (all keys present), the D ranks it writes KV to, ascending."""
    targets: dict[int, list[int]] = {p: [] for p in range(p_tp)}
    for d_rank in range(d_tp):
        plan = plan_decode_rank(total_kv_heads, p_tp, d_tp, d_rank, is_mla=is_mla, spread=spread)
        for p_rank in sorted({s.p_rank for s in plan}):
            targets[p_rank].append(d_rank)
    return targets


def _idle_owners(total_kv_heads: int, p_tp: int, d_tp: int, *, is_mla: bool, spread: int) -> dict[int, int]:
    """Idle P rank -> the D rank that releases it (the i-th idle one goes to D rank i % d_tp)."""
    senders = senders_for(total_kv_heads, p_tp, d_tp, is_mla=is_mla, spread=spread)
    idle = [p for p, targets in senders.items() if not targets]
    return {p: i % d_tp for i, p in enumerate(idle)}


def decode_contacts(
    total_kv_heads: int, p_tp: int, d_tp: int, d_rank: int, *, is_mla: bool, spread: int = 0
) -> list[int]:
    """P ranks D rank ``d_rank`` sends each room's ``TransferRequest`` to, ascending.

    Those in its plan, plus the idle P ranks (no D rank takes KV from them)
    assigned to it: it sends them a request with no destination blocks so they
    free the room. D waits for a ``TransferDone`` from every one of them.
    """
    plan = plan_decode_rank(total_kv_heads, p_tp, d_tp, d_rank, is_mla=is_mla, spread=spread)
    idle = _idle_owners(total_kv_heads, p_tp, d_tp, is_mla=is_mla, spread=spread)
    return sorted({s.p_rank for s in plan} | {p for p, owner in idle.items() if owner == d_rank})


def expected_requests(total_kv_heads: int, p_tp: int, d_tp: int, p_rank: int, *, is_mla: bool, spread: int = 0) -> int:
    """How many ranks of one D instance (TP ``d_tp``) contact P rank ``p_rank`` per room (>= 1).

    P keeps a room's blocks until it has answered that many requests.
    """
    _check_rank(p_tp, p_rank, "prefill")
    targets = senders_for(total_kv_heads, p_tp, d_tp, is_mla=is_mla, spread=spread)[p_rank]
    return max(1, len(targets))


def needs_head_split(slices: Iterable[HeadSlice], src_local_heads: int, dst_local_heads: int) -> bool:
    """True if some slice copies only part of a block (so both layouts must be head major)."""
    return any(not (s.num_heads == src_local_heads == dst_local_heads) for s in slices)


# ------------------------------------------------------------- byte layout


def is_head_major(
    shape: Sequence[int],
    num_blocks: int,
    local_heads: int,
    *,
    strides: Sequence[int] | None = None,
    heads_dim: int | None = None,
) -> bool:
    """Whether heads are the outermost per-block dimension of a KV tensor.

    The block dimension is the first of size ``num_blocks`` (as in
    ``layout.regions_of_tensor``); the per-block dimensions follow it. The heads
    dimension is ``heads_dim`` if given, else the one per-block dimension of size
    ``local_heads`` other than the last (the last one is always head_dim or
    2*head_dim in vLLM's layouts). Heads are outermost when that dimension has
    the largest stride among the per-block dimensions of size > 1 (``strides``
    in elements, default: a contiguous tensor), i.e. one head of a block is one
    contiguous byte range. With one local head every layout qualifies.

    Raises MappingError when the heads dimension cannot be told apart (say
    ``block_size == local_heads``): pass ``heads_dim`` then.
    """
    shape = tuple(shape)
    if strides is None:
        acc, rev = 1, []
        for size in reversed(shape):
            rev.append(acc)
            acc *= size
        strides = tuple(reversed(rev))
    strides = tuple(strides)
    if len(strides) != len(shape):
        raise MappingError(f"KV tensor shape {shape} and strides {strides} differ in rank")
    if local_heads < 1:
        raise MappingError(f"local KV heads must be >= 1, got {local_heads}")
    if local_heads == 1:
        return True
    try:
        bdim, kernel_blocks = block_dim(shape, num_blocks)
    except LayoutError as exc:
        raise MappingError(str(exc)) from None
    if kernel_blocks > 1:
        return False  # a head of one block lies in each of its kernel blocks: several byte ranges
    inner = range(bdim + 1, len(shape))
    if heads_dim is not None:
        if heads_dim < 0:
            heads_dim += len(shape)
        if heads_dim not in inner or shape[heads_dim] != local_heads:
            raise MappingError(
                f"heads_dim={heads_dim} of KV tensor shape {shape} is not a per-block dimension of size {local_heads}"
            )
    else:
        candidates = [d for d in inner if d != len(shape) - 1 and shape[d] == local_heads]
        if not candidates:
            raise MappingError(f"KV tensor shape {shape} has no per-block dimension of size local_heads={local_heads}")
        if len(candidates) > 1:
            raise MappingError(
                f"KV tensor shape {shape}: dimensions {candidates} all have size local_heads={local_heads}; "
                "cannot tell which one holds the heads (pass heads_dim)"
            )
        heads_dim = candidates[0]
    return all(strides[heads_dim] > strides[d] for d in inner if d != heads_dim and shape[d] > 1)


def _head_bytes(region: Region, heads: int, side: str, index: int | None) -> int:
    where = f"{side} KV region" + (f" {index}" if index is not None else "")
    if heads < 1:
        raise MappingError(f"{where}: local KV heads must be >= 1, got {heads}")
    if region.block_bytes % heads:
        raise MappingError(f"{where}: {region.block_bytes} bytes per block do not split into {heads} heads")
    return region.block_bytes // heads


def check_head_regions(
    src: Sequence[Region], dst: Sequence[Region], src_local_heads: int, dst_local_heads: int
) -> None:
    """Raise MappingError unless P and D regions pair up with equal bytes per head."""
    if len(src) != len(dst):
        raise MappingError(f"KV region count differs: prefill has {len(src)}, decode has {len(dst)}")
    for i, (s, d) in enumerate(zip(src, dst, strict=True)):
        sb = _head_bytes(s, src_local_heads, "prefill", i)
        db = _head_bytes(d, dst_local_heads, "decode", i)
        if sb != db:
            raise MappingError(
                f"KV region {i}: prefill has {sb} bytes per head ({s.block_bytes} / {src_local_heads} heads), "
                f"decode {db} ({d.block_bytes} / {dst_local_heads} heads): block size, head size or dtype differ"
            )


def head_entries(
    src_region: Region,
    dst_region: Region,
    slices: Sequence[HeadSlice],
    src_local_heads: int,
    dst_local_heads: int,
    runs: Iterable[tuple[int, int, int]],
    *,
    region_index: int | None = None,
) -> tuple[list[int], list[int], list[int]]:
    """Backend write entries (src_addrs, dst_addrs, lengths) for one region pair.

    ``slices`` are the ones this P rank sends to one D rank; ``runs`` are
    ``(src_start_block, dst_start_block, count)`` from ``layout.block_runs``.
    Heads must be outermost within a block on both sides (or every slice copies
    whole blocks). A slice covering all heads on both sides copies whole
    blocks: one entry per run when blocks are dense on both sides; otherwise one
    entry per block and slice.
    """
    src_hb = _head_bytes(src_region, src_local_heads, "prefill", region_index)
    dst_hb = _head_bytes(dst_region, dst_local_heads, "decode", region_index)
    where = f"KV region {region_index}" if region_index is not None else "KV region"
    if src_hb != dst_hb:
        raise MappingError(
            f"{where}: prefill has {src_hb} bytes per head ({src_region.block_bytes} / {src_local_heads} heads), "
            f"decode {dst_hb} ({dst_region.block_bytes} / {dst_local_heads} heads): block size, head size or dtype differ"
        )
    if len({s.p_rank for s in slices}) > 1:
        raise MappingError(f"head_entries got slices of several prefill ranks: {sorted({s.p_rank for s in slices})}")
    for s in slices:
        if s.num_heads < 1 or s.src_head < 0 or s.dst_head < 0:
            raise MappingError(f"invalid head slice {s}")
        if s.src_head + s.num_heads > src_local_heads or s.dst_head + s.num_heads > dst_local_heads:
            raise MappingError(
                f"head slice {s} is out of range for {src_local_heads} prefill / {dst_local_heads} decode local heads"
            )
    runs = list(runs)
    src_addrs: list[int] = []
    dst_addrs: list[int] = []
    lengths: list[int] = []
    s_stride, d_stride = src_region.block_stride, dst_region.block_stride
    dense = src_region.blocks_contiguous and dst_region.blocks_contiguous
    for s in slices:
        length = s.num_heads * src_hb
        src_off = src_region.base + s.src_head * src_hb
        dst_off = dst_region.base + s.dst_head * dst_hb
        whole = s.num_heads == src_local_heads == dst_local_heads
        for s0, d0, n in runs:
            if whole and dense:
                src_addrs.append(src_off + s0 * s_stride)
                dst_addrs.append(dst_off + d0 * d_stride)
                lengths.append(n * length)
                continue
            for k in range(n):
                src_addrs.append(src_off + (s0 + k) * s_stride)
                dst_addrs.append(dst_off + (d0 + k) * d_stride)
                lengths.append(length)
    return src_addrs, dst_addrs, lengths


def tp_transfer_entries(
    src: Sequence[Region],
    dst: Sequence[Region],
    slices: Sequence[HeadSlice],
    src_local_heads: int,
    dst_local_heads: int,
    runs: Iterable[tuple[int, int, int]],
) -> tuple[list[int], list[int], list[int]]:
    """:func:`head_entries` over every region pair (P's table against D's), concatenated."""
    if len(src) != len(dst):
        raise MappingError(f"KV region count differs: prefill has {len(src)}, decode has {len(dst)}")
    runs = list(runs)
    src_addrs: list[int] = []
    dst_addrs: list[int] = []
    lengths: list[int] = []
    for i, (s, d) in enumerate(zip(src, dst, strict=True)):
        a, b, c = head_entries(s, d, slices, src_local_heads, dst_local_heads, runs, region_index=i)
        src_addrs += a
        dst_addrs += b
        lengths += c
    return src_addrs, dst_addrs, lengths
