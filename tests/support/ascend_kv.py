"""KV caches laid out as vLLM-Ascend allocates them (int8 buffers, 2 MiB extra, 2 MiB-aligned slices)."""

from __future__ import annotations

import torch

MIB2 = 2 << 20


def ascend_tensor(shape: tuple[int, ...], dtype: torch.dtype, fill: int = 0) -> torch.Tensor:
    """One K or V buffer as vLLM-Ascend allocates it: int8, 2 MiB extra, a 2 MiB-aligned slice."""
    numel = 1
    for n in shape:
        numel *= n
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    raw = torch.zeros(nbytes + MIB2, dtype=torch.int8)
    offset = (-raw.data_ptr()) % MIB2
    aligned = raw[offset : offset + nbytes]
    assert aligned.data_ptr() % MIB2 == 0
    out = aligned.view(dtype).view(shape)
    if fill:
        out.copy_(torch.randint(-1000, 1000, shape, generator=torch.Generator().manual_seed(fill)))
    return out


def ascend_kv(
    layers: int,
    nb: int = 12,
    kernel: int = 1,
    heads: int = 4,
    seed: int = 0,
    dtype: torch.dtype = torch.float16,
    block_size: int = 16,
    head_dim: int = 8,
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """One (K, V) pair per layer, each ``[nb * kernel, block_size // kernel, heads, head_dim]``;
    ``seed`` > 0 fills them with seeded values, ``kernel`` splits each block in kernel blocks."""
    shape = (nb * kernel, block_size // kernel, heads, head_dim)
    return {
        f"model.layers.{i}.self_attn.attn": (
            ascend_tensor(shape, dtype, seed and seed + 2 * i),
            ascend_tensor(shape, dtype, seed and seed + 2 * i + 1),
        )
        for i in range(layers)
    }
