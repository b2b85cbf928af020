"""KV-cache memory as transferable regions, and block id lists as runs of consecutive blocks.

A *region* is one (layer, K/V or MLA part) slab of KV memory seen block by
block: `base + i * block_stride` is where block i starts and `block_bytes` of
it belong to that block. Regions are derived from the tensors' real shapes and
strides, so every layout in DESIGN §5 is handled by the same code:

- vLLM CPU attention: one tensor per layer, blocks outermost -> 1 region/layer;
- vLLM-Ascend: a tuple per layer, k and v `[num_blocks, block_size, heads, dim]`
  (MLA: latent and rope; sparse attention: more parts) -> 1 region per part;
- CUDA FlashAttention: `[2, num_blocks, block_size, heads, dim]` -> K and V regions.
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


def _block_dim(shape: Sequence[int], num_blocks: int) -> int:
    for dim, size in enumerate(shape):
        if size == num_blocks:
            return dim
    raise LayoutError(f"no dimension of size num_blocks={num_blocks} in KV tensor of shape {tuple(shape)}")


def regions_of_tensor(tensor: Any, num_blocks: int) -> list[Region]:
    """Regions of one KV tensor: one per index of the dims outside the block dim."""
    shape, strides = tuple(tensor.shape), tuple(tensor.stride())
    item = tensor.element_size()
    bdim = _block_dim(shape, num_blocks)
    inner_shape, inner_strides = shape[bdim + 1 :], strides[bdim + 1 :]
    # The part of a block that lies inside one region must be one dense run of bytes.
    expected = 1
    for size, stride in sorted(zip(inner_shape, inner_strides, strict=True), key=lambda p: p[1]):
        if size != 1 and stride != expected:
            raise LayoutError(f"KV tensor shape {shape} strides {strides}: the per-block part is not contiguous")
        expected *= size
    block_bytes = expected * item
    block_stride = strides[bdim] * item
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


def memory_ranges(kv_caches: Mapping[str, Any]) -> list[tuple[int, int]]:
    """Distinct (addr, length) ranges that hold the KV caches, overlapping ones merged."""
    spans = []
    for value in kv_caches.values():
        for part in value if isinstance(value, (list, tuple)) else [value]:
            storage = part.untyped_storage()
            spans.append((storage.data_ptr(), storage.nbytes()))
    spans.sort()
    merged: list[tuple[int, int]] = []
    for addr, length in spans:
        if merged and addr <= merged[-1][0] + merged[-1][1]:
            start, old = merged[-1]
            merged[-1] = (start, max(old, addr + length - start))
        else:
            merged.append((addr, length))
    return merged


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
