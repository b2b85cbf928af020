"""Write targets checked: P writes only into the bytes a D rank registered as its KV cache.

D's ``PeerHello`` names its regions (``layout.Region``: base, block stride, block bytes) and how
many blocks each holds (``num_blocks``). Before every write batch P checks, for every entry
``(dst, length)``, that the bytes lie inside the blocks of one of those regions, and before a push
that every destination block id is below D's block count. A violation is a ``WriteTargetError``
(a ``BlockRangeError``: D is told ``BAD_REQUEST``) and nothing of that push is written.

D checks its own side before it asks: the block ids of a load are inside its cache.

A region's bytes are ``[base + i*stride, base + i*stride + block_bytes)`` for block ``i`` in
``[0, num_blocks)``; with ``stride == block_bytes`` they are one run, so an entry may span several
blocks (a run of consecutive blocks is one entry); otherwise an entry stays inside one block (it
may be part of it: a head slice, a P block part on token-major KV). ``num_blocks`` 0 (a D that does
not say) keeps the block structure check but no upper bound.

Everything here is pure: addresses are numbers, nothing is read or written.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import numpy as np

from pd_connector import messages as proto
from pd_connector.layouts.regions import LayoutError, Region, fuse_adjacent
from pd_connector.transfer.checksum import RunningChecksum, reader_for
from pd_connector.transfer.context import RankSpec
from pd_connector.transfer.write_plans import BlockRangeError

__all__ = ["WriteGuard", "WriteTargetError", "check_own_blocks", "guard_push", "request_blocks"]

logger = logging.getLogger(__name__)

#: Stand-in block count of a region whose D did not say (no upper bound).
_UNBOUNDED = 1 << 62


class WriteTargetError(BlockRangeError):
    """A write outside the memory the decode rank registered, or a block id past its cache."""


def _blocks_problem(block_ids: Sequence[int], num_blocks: int, whose: str) -> str | None:
    if not block_ids:
        return None
    ids = np.asarray(block_ids, dtype=np.int64)
    low, high = int(ids.min()), int(ids.max())
    if low < 0:
        return f"{whose} block id {low} is negative"
    if num_blocks > 0 and high >= num_blocks:
        return f"{whose} block id {high} is past its {num_blocks} KV blocks"
    return None


def check_own_blocks(block_ids: Sequence[int], num_blocks: int) -> None:
    """D, before it asks P: the load's blocks are inside this rank's cache (LayoutError if not)."""
    problem = _blocks_problem(block_ids, num_blocks, "decode")
    if problem is not None:
        raise LayoutError(f"refusing to ask prefill for this load: {problem}")


class WriteGuard:
    """The byte ranges one decode rank registered, to check P's writes against (thread-safe, immutable)."""

    def __init__(self, regions: Sequence[Region], num_blocks: int, peer: str) -> None:
        self.peer = peer
        self.num_blocks = num_blocks
        ordered = fuse_adjacent(regions)  # sorted by base; P's plans write fused regions as one piece
        self._base = np.array([r.base for r in ordered], dtype=np.int64)
        self._stride = np.array([max(r.block_stride, 1) for r in ordered], dtype=np.int64)
        self._bytes = np.array([r.block_bytes for r in ordered], dtype=np.int64)
        self._count = np.int64(num_blocks if num_blocks > 0 else _UNBOUNDED)
        self._contiguous = self._stride <= self._bytes

    @classmethod
    def of(cls, hello: proto.PeerHello) -> WriteGuard:
        return cls([Region(*r) for r in hello.regions], hello.num_blocks, hello.peer_id)

    def check_blocks(self, block_ids: Sequence[int]) -> None:
        """Every destination block id is a block of the peer's cache (WriteTargetError if not)."""
        problem = _blocks_problem(block_ids, self.num_blocks, f"decode {self.peer}'s")
        if problem is not None:
            raise WriteTargetError(f"refusing to write: {problem}")

    def check(self, dst: Sequence[int], lengths: Sequence[int]) -> None:
        """Every ``[dst[i], dst[i] + lengths[i])`` lies inside one region's blocks (WriteTargetError if not)."""
        if not len(dst):
            return
        addr = np.asarray(dst, dtype=np.int64)
        size = np.asarray(lengths, dtype=np.int64)
        if len(addr) != len(size):
            raise WriteTargetError(f"{len(addr)} write addresses for {len(size)} lengths")
        if len(self._base) == 0:
            raise WriteTargetError(f"refusing to write: decode {self.peer} registered no KV regions")
        # Fast path: the region with the largest base at or below the address (non-interleaved layouts).
        nearest = np.clip(np.searchsorted(self._base, addr, side="right") - 1, 0, len(self._base) - 1)
        ok = self._fits(addr, size, nearest) & (size > 0)
        if not ok.all():
            # Interleaved regions (a block of each region in turn): try every region for what is left.
            rest = np.flatnonzero(~ok)
            for index in range(len(self._base)):
                fits = self._fits(addr[rest], size[rest], np.full(len(rest), index)) & (size[rest] > 0)
                ok[rest[fits]] = True
                rest = rest[~fits]
                if not len(rest):
                    break
        if not ok.all():
            bad = int(np.flatnonzero(~ok)[0])
            raise WriteTargetError(
                f"refusing to write {int(size[bad])} bytes at {int(addr[bad]):#x} (entry {bad} of {len(addr)}): "
                f"outside the KV blocks decode {self.peer} registered ({len(self._base)} regions of "
                f"{self.num_blocks or 'unknown'} blocks)"
            )

    def _fits(self, addr: np.ndarray, size: np.ndarray, index: np.ndarray) -> np.ndarray:
        base, stride, nbytes = self._base[index], self._stride[index], self._bytes[index]
        offset = addr - base
        block, within = np.divmod(np.maximum(offset, 0), stride)
        in_block = (within + size <= nbytes) & (block < self._count)
        # A run of whole consecutive blocks (dense regions): it must end inside the last block.
        end_block = (offset + size - 1) // stride
        in_run = self._contiguous[index] & (end_block < self._count)
        return (offset >= 0) & (in_block | in_run)


def request_blocks(req: proto.TransferRequest) -> list[int]:
    """Every destination block id of a request (its single list and, with KV cache groups, theirs)."""
    groups = getattr(req, "dst_groups", None) or []
    return list(req.dst_block_ids) + [b for group in groups for b in group]


def guard_push(
    peer: proto.PeerHello, req: proto.TransferRequest, spec: RankSpec
) -> tuple[WriteGuard, RunningChecksum | None]:
    """P, before a push: the guard its writes go through (block ids checked now: WriteTargetError), and
    the checksum to add them to when D asked for one (None when not asked, or P cannot read its KV)."""
    guard = WriteGuard.of(peer)
    guard.check_blocks(request_blocks(req))
    if not req.want_checksum:
        return guard, None
    reader = reader_for(spec.kv_device)
    if reader is None:
        logger.warning(
            "room=%d req=%s: decode %s asked for a KV checksum (verify_kv) but this rank cannot read %s KV memory",
            req.room, req.request_id, peer.peer_id, spec.kv_device,
        )  # fmt: skip
        return guard, None
    return guard, RunningChecksum(reader)
