"""KV-cache memory as transferable regions, and block id lists as runs of consecutive blocks.

A *region* is one (layer, K/V or MLA part) slab of KV memory seen block by
block: `base + i * block_stride` is where block i starts and `block_bytes` of
it belong to that block. Regions are derived from the tensors' real shapes and
strides, so every layout in docs/design.md is handled by the same code:

- vLLM CPU attention: one tensor per layer, blocks outermost -> 1 region/layer;
- vLLM-Ascend: a tuple per layer, k and v `[num_blocks, block_size, heads, dim]`
  (MLA: latent and rope; sparse attention: more parts) -> 1 region per part;
- CUDA FlashAttention: `[2, num_blocks, block_size, heads, dim]` -> K and V regions.

Regions laid out block by block next to each other (block i of one ends where block i of the next
starts, as in a layout that keeps every layer of a block together) describe one larger piece per
block: `fuse_adjacent` merges them, and P's write plans (`transfer.plan_cache`) write them as one entry.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any


class LayoutError(ValueError):
    """KV tensors whose layout cannot be described as regions, or mismatched peers."""


@dataclass(frozen=True)
class Region:
    base: int
    block_stride: int
    block_bytes: int

    def as_tuple(self) -> tuple[int, int, int]:
        return (self.base, self.block_stride, self.block_bytes)

    @property
    def blocks_contiguous(self) -> bool:
        return self.block_stride == self.block_bytes


def block_dim(shape: Sequence[int], num_blocks: int) -> tuple[int, int]:
    """(block dimension, kernel blocks per block) of a KV tensor of ``shape``.

    The block dimension is the first one of size ``num_blocks`` (never the last: that is the
    head size). vLLM-Ascend's model runner may split each block into ``k`` kernel blocks, making
    the first dimension ``num_blocks * k``: then it is dimension 0 with ``k`` kernel blocks each.
    """
    shape = tuple(shape)
    for dim, size in enumerate(shape[:-1]):
        if size == num_blocks:
            return dim, 1
    if num_blocks > 0 and len(shape) > 1 and shape[0] > num_blocks and shape[0] % num_blocks == 0:
        return 0, shape[0] // num_blocks
    raise LayoutError(
        f"no dimension of size num_blocks={num_blocks} (or a first dimension of num_blocks * kernel blocks) "
        f"in KV tensor of shape {shape}"
    )


def regions_of_tensor(tensor: Any, num_blocks: int) -> list[Region]:
    """Regions of one KV tensor: one per index of the dims outside the block dim.

    With kernel blocks (first dimension ``num_blocks * k``) block ``i`` is kernel blocks
    ``i*k .. i*k+k-1``, which must lie back to back (they do in vLLM-Ascend's dense tensors).
    """
    shape, strides = tuple(tensor.shape), tuple(tensor.stride())
    item = tensor.element_size()
    bdim, scale = block_dim(shape, num_blocks)
    inner_shape, inner_strides = shape[bdim + 1 :], strides[bdim + 1 :]
    # The part of a block that lies inside one region must be one dense run of bytes.
    expected = 1
    for size, stride in sorted(zip(inner_shape, inner_strides, strict=True), key=lambda p: p[1]):
        if size != 1 and stride != expected:
            raise LayoutError(f"KV tensor shape {shape} strides {strides}: the per-block part is not contiguous")
        expected *= size
    block_bytes = expected * item
    block_stride = strides[bdim] * item
    if scale > 1:
        if block_stride != block_bytes:
            raise LayoutError(
                f"KV tensor shape {shape} strides {strides}: the {scale} kernel blocks of a block are not contiguous"
            )
        block_bytes *= scale
        block_stride *= scale
    base = tensor.data_ptr()
    outer = [range(n) for n in shape[:bdim]]
    regions = []
    for idx in itertools.product(*outer):
        offset = sum(i * s for i, s in zip(idx, strides[:bdim], strict=True)) * item
        regions.append(Region(base + offset, block_stride, block_bytes))
    return regions


def regions_of_kv_caches(kv_caches: Mapping[str, Any], num_blocks: int) -> list[Region]:
    """Region table of a worker's KV caches, in layer order (dict order), then part order."""
    regions: list[Region] = []
    for name, value in kv_caches.items():
        parts = value if isinstance(value, (list, tuple)) else [value]
        if not parts:
            raise LayoutError(f"layer {name} has no KV tensors")
        for part in parts:
            regions.extend(regions_of_tensor(part, num_blocks))
    return regions


def tensor_span(tensor: Any) -> tuple[int, int]:
    """(data_ptr, bytes from it to its last element's end): the tensor's own bytes, not its storage's."""
    if tensor.numel() == 0:
        return tensor.data_ptr(), 0
    last = sum((size - 1) * stride for size, stride in zip(tensor.shape, tensor.stride(), strict=True))
    return tensor.data_ptr(), (last + 1) * tensor.element_size()


def memory_ranges(kv_caches: Mapping[str, Any]) -> list[tuple[int, int]]:
    """(addr, length) ranges to register: each KV tensor's own bytes, overlapping or adjacent ones merged.

    Never the whole ``untyped_storage()`` around a tensor: vLLM-Ascend hands out a 2 MiB-aligned
    slice of a larger buffer, and only the slice is KV (as its own connector registers it).
    """
    spans = []
    for value in kv_caches.values():
        for part in value if isinstance(value, (list, tuple)) else [value]:
            addr, length = tensor_span(part)
            if length:
                spans.append((addr, length))
    spans.sort()
    merged: list[tuple[int, int]] = []
    for addr, length in spans:
        if merged and addr <= merged[-1][0] + merged[-1][1]:
            start, old = merged[-1]
            merged[-1] = (start, max(old, addr + length - start))
        else:
            merged.append((addr, length))
    return merged


def fuse_adjacent(regions: Sequence[Region]) -> list[Region]:
    """The regions by base, those laid out block by block next to each other fused: a region whose block i
    starts where the previous one's block i ends (same stride) joins it, as the regions of consecutive
    layers do in a layout that keeps all layers of a block together. The bytes covered stay the same."""
    fused: list[Region] = []
    for r in sorted(regions, key=lambda r: (r.base, r.block_stride)):
        if fused:
            last = fused[-1]
            joined = last.block_bytes + r.block_bytes
            if (
                r.block_stride == last.block_stride
                and r.base == last.base + last.block_bytes
                and joined <= r.block_stride
            ):
                fused[-1] = Region(last.base, last.block_stride, joined)
                continue
        fused.append(r)
    return fused


def block_runs(src_blocks: Sequence[int], dst_blocks: Sequence[int]) -> list[tuple[int, int, int]]:
    """Pair src/dst block ids into runs (src_start, dst_start, count) consecutive on both sides."""
    if len(src_blocks) != len(dst_blocks):
        raise LayoutError(f"{len(src_blocks)} source blocks for {len(dst_blocks)} destination blocks")
    runs: list[tuple[int, int, int]] = []
    for s, d in zip(src_blocks, dst_blocks, strict=True):
        if runs:
            s0, d0, n = runs[-1]
            if s == s0 + n and d == d0 + n:
                runs[-1] = (s0, d0, n + 1)
                continue
        runs.append((s, d, 1))
    return runs
