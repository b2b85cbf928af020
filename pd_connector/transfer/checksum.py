"""verify_kv: a checksum of the KV bytes P wrote, recomputed by D over what landed.

The checksum of a set of written bytes is a sum mod 2**64 over every byte of a pseudo-random odd
weight of the *destination* address it was written to times the byte (see ``digest``). So it does not depend on how the
bytes were cut into entries or batches, nor on their order, and the checksums of several P ranks
that each wrote a part of D's blocks add up to the checksum of the whole: P sums what it wrote
(reading its source bytes, per batch, while they are still in place: a staging buffer is reused),
D adds its P ranks' numbers and compares them with its own sum over the blocks of the load.

It also names the bytes: every D load fills all the bytes of its blocks in every region
(``load_ranges``); ``load_problem`` checks the byte counts P reports (always) and the checksum
(with ``verify_kv``).

The memory is read through a ``MemoryReader`` (the seam): ``HostMemoryReader`` wraps host memory
(CPU KV, as vLLM-CPU keeps it) as a torch tensor without copying; an NPU build passes a reader
that returns a device tensor over the range (or a host copy of it): ``digest`` uses torch integer
ops only, so it runs wherever the tensor is.
"""

from __future__ import annotations

import ctypes
import sys
from collections.abc import Iterable, Sequence
from typing import Protocol

import torch

from pd_connector.layouts.kv_groups import NULL_BLOCK, recv_groups
from pd_connector.layouts.regions import Region
from pd_connector.metadata import RecvJob
from pd_connector.transfer.context import RankContext

__all__ = [
    "MASK64",
    "HostMemoryReader",
    "MemoryReader",
    "RunningChecksum",
    "combine",
    "digest",
    "load_problem",
    "landed_problem",
    "load_ranges",
    "reader_for",
]

MASK64 = (1 << 64) - 1
#: Words hashed per torch call (bounds the temporaries).
CHUNK_WORDS = 1 << 18
WORD = 8

#: One in every byte lane of a word: the "+ 1" of every byte.
_ONES = 0x0101010101010101
# splitmix64's finalizer constants, as signed int64 (torch has no uint64 arithmetic).
_M1 = 0xBF58476D1CE4E5B9 - (1 << 64)
_M2 = 0x94D049BB133111EB - (1 << 64)


class MemoryReader(Protocol):
    """Reads ``length`` bytes at ``addr`` of this process's (or device's) memory as a uint8 tensor."""

    def read(self, addr: int, length: int) -> torch.Tensor: ...


class HostMemoryReader:
    """Host memory (CPU KV): a zero-copy uint8 tensor over the bytes."""

    def read(self, addr: int, length: int) -> torch.Tensor:
        if length <= 0:
            return torch.empty(0, dtype=torch.uint8)
        buf = (ctypes.c_uint8 * length).from_address(addr)
        return torch.frombuffer(buf, dtype=torch.uint8)


def reader_for(kv_device: str) -> MemoryReader | None:
    """The reader of KV memory on ``kv_device`` (a torch device type); None where none is written yet.

    An NPU/GPU build returns one that copies the range to the host (or wraps it as a device tensor).
    """
    return HostMemoryReader() if kv_device == "cpu" else None


def _shr(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 values (torch's ``>>`` keeps the sign)."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def _weights(first_word: int, count: int, device: torch.device) -> torch.Tensor:
    """Odd pseudo-random int64 weight of each 8-byte word address ``first_word + 8*i`` (splitmix64)."""
    x = torch.arange(count, dtype=torch.int64, device=device) * WORD + first_word
    x = (x ^ _shr(x, 30)) * _M1
    x = (x ^ _shr(x, 27)) * _M2
    return (x ^ _shr(x, 31)) | 1


def _weight(word: int) -> int:
    """``_weights`` of one word, in Python ints."""
    x = word & MASK64
    x = ((x ^ (x >> 30)) * (_M1 & MASK64)) & MASK64
    x = ((x ^ (x >> 27)) * (_M2 & MASK64)) & MASK64
    return (x ^ (x >> 31)) | 1


def digest(data: torch.Tensor, dst_addr: int) -> int:
    """Checksum of ``data`` (uint8, 1-D) written at destination address ``dst_addr`` (mod 2**64).

    Byte ``v`` at address ``a`` adds ``weight(a & ~7) * ((v + 1) << 8 * (a & 7))``: a whole aligned
    word adds ``weight(word address) * (word + 0x0101..01)`` (little endian), one torch multiply per
    8 bytes, and a word cut between two ranges adds up to the same. The ``+ 1`` makes the sum depend
    on which addresses were covered, so zeroed memory does not sum to 0.
    """
    n = data.numel()
    total = 0
    head = min((-dst_addr) % WORD, n)
    body = (n - head) // WORD
    edges = list(range(head)) + list(range(head + body * WORD, n))
    if edges:
        values = data[edges].tolist() if len(edges) < n else data.tolist()
        for i, v in zip(edges, values, strict=True):
            a = dst_addr + i
            total += _weight(a & ~(WORD - 1)) * ((v + 1) << (8 * (a & (WORD - 1))))
    for first in range(0, body, CHUNK_WORDS):
        count = min(CHUNK_WORDS, body - first)
        part = data[head + first * WORD : head + (first + count) * WORD]
        try:
            words = part.view(torch.int64)
        except RuntimeError:  # source not 8-byte aligned like the destination
            words = part.clone().view(torch.int64)
        if sys.byteorder != "little":
            raise RuntimeError("verify_kv checksums assume a little-endian host")
        weights = _weights(dst_addr + head + first * WORD, count, part.device)
        total += int((weights * (words + _ONES)).sum().item())
    return total & MASK64


def combine(values: Iterable[int]) -> int:
    """The checksum of the union of disjoint byte sets, from theirs."""
    return sum(values) & MASK64


class RunningChecksum:
    """P: the checksum of everything one push wrote, added to batch by batch."""

    def __init__(self, reader: MemoryReader | None = None) -> None:
        self._reader = reader or HostMemoryReader()
        self.value = 0

    def add(self, src: Sequence[int], dst: Sequence[int], lengths: Sequence[int]) -> None:
        """Bytes at src[i] (this process) that went to dst[i] (the peer), lengths[i] of them."""
        for s, d, n in zip(src, dst, lengths, strict=True):
            self.value = (self.value + digest(self._reader.read(s, n), d)) & MASK64


def load_ranges(
    regions: Sequence[Region], dst_groups: Sequence[Sequence[int]], groups_of_regions: Sequence[int] = ()
) -> list[tuple[int, int]]:
    """(addr, length) of every byte a load fills on D: each real block of a region's KV cache group.

    ``dst_groups``: the load's blocks per group (one list without the hybrid manager);
    ``groups_of_regions``: each region's group (empty: one group, every listed block is written, as P
    writes them). With groups, the null block (a sliding window's dropped blocks) is never written.
    """
    owners = tuple(groups_of_regions) or (0,) * len(regions)
    skip = NULL_BLOCK if groups_of_regions else None
    return [
        (r.base + b * r.block_stride, r.block_bytes)
        for r, g in zip(regions, owners, strict=True)
        if g < len(dst_groups)
        for b in dst_groups[g]
        if b != skip
    ]


def load_problem(
    ranges: Sequence[tuple[int, int]],
    reports: Sequence[tuple[int, int, int | None]],
    reader: MemoryReader | None,
) -> str | None:
    """Why a load whose P ranks all said OK cannot count as done; None when it can.

    ``reports``: (P tp rank, bytes it wrote, its checksum or None) per P rank asked. The bytes must
    add up to the load's; with a ``reader`` (verify_kv) the checksums must add up to D's own over
    ``ranges``.
    """
    expected = sum(length for _, length in ranges)
    if any(nbytes < 0 for _, nbytes, _ in reports):
        ranks = [tp for tp, nbytes, _ in reports if nbytes < 0]
        return f"prefill rank(s) tp={ranks} reported the KV in place without saying how many bytes they wrote"
    written = sum(nbytes for _, nbytes, _ in reports)
    if written != expected:
        per_rank = ", ".join(f"tp={tp}: {nbytes}" for tp, nbytes, _ in reports)
        return f"prefill wrote {written} bytes ({per_rank}) but the load's blocks hold {expected}"
    if reader is None:
        return None
    missing = [tp for tp, nbytes, checksum in reports if checksum is None and nbytes > 0]
    if missing:
        return f"verify_kv: prefill rank(s) tp={missing} sent no checksum of what they wrote"
    theirs = combine(checksum or 0 for _, _, checksum in reports)
    ours = combine(digest(reader.read(addr, length), addr) for addr, length in ranges)
    if theirs != ours:
        return (
            f"verify_kv: checksum mismatch over {expected} bytes: prefill says {theirs:#018x}, "
            f"the received blocks hold {ours:#018x}"
        )
    return None


def merge_ranges(ranges: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    """Sorted ranges with touching ones joined (fewer, longer reads)."""
    merged: list[tuple[int, int]] = []
    for addr, length in sorted(ranges):
        if merged and addr == merged[-1][0] + merged[-1][1]:
            merged[-1] = (merged[-1][0], merged[-1][1] + length)
        else:
            merged.append((addr, length))
    return merged


def landed_problem(ctx: RankContext, job: RecvJob, reports: dict[int, tuple[int, int | None]]) -> str | None:
    """D, once every P rank asked said OK: why the load cannot count as done (None: it can).

    ``reports``: P tp rank -> (bytes written, checksum) from its TransferDone.
    """
    ranges = merge_ranges(load_ranges(ctx.regions, recv_groups(job), ctx.spec.region_groups))
    reader = None
    if ctx.cfg.verify_kv:
        reader = reader_for(ctx.spec.kv_device)
        if reader is None:
            return f"verify_kv: this rank cannot read its {ctx.spec.kv_device} KV memory to check it"
    return load_problem(ranges, [(tp, n, c) for tp, (n, c) in sorted(reports.items())], reader)
