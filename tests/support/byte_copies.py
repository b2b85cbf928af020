"""Apply transfer entries as plain memcpys on CPU tensors and count how often each byte was written."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
import torch

from pd_connector.layouts.regions import Region
from pd_connector.layouts.tp import HeadSlice, tp_transfer_entries

#: Equal TP: each block moves whole (one "head" per block on both sides).
WHOLE_BLOCKS = [HeadSlice(p_rank=0, src_head=0, dst_head=0, num_heads=1)]


def whole_block_writes(
    src: list[Region], dst: list[Region], runs: list[tuple[int, int, int]]
) -> tuple[list[int], list[int], list[int]]:
    return tp_transfer_entries(src, dst, WHOLE_BLOCKS, 1, 1, runs)


def storages_of(kv: dict[str, object]) -> list[torch.Tensor]:
    """One uint8 view per distinct storage, for counting writes and detecting stray bytes."""
    seen: dict[int, torch.Tensor] = {}
    for value in kv.values():
        for part in value if isinstance(value, tuple) else [value]:
            assert isinstance(part, torch.Tensor)
            st = part.untyped_storage()
            seen.setdefault(st.data_ptr(), torch.tensor([], dtype=torch.uint8).set_(st))
    return list(seen.values())


def apply_writes(entries: tuple[list[int], list[int], list[int]], dst_storages: list[torch.Tensor]) -> list[np.ndarray]:
    """memcpy every entry; return per-storage counts of how often each destination byte was written."""
    counts = [np.zeros(s.numel(), dtype=np.int32) for s in dst_storages]
    for s_addr, d_addr, length in zip(*entries, strict=True):
        assert length > 0
        for st, cnt in zip(dst_storages, counts, strict=True):
            base = st.data_ptr()
            if base <= d_addr and d_addr + length <= base + st.numel():
                cnt[d_addr - base : d_addr - base + length] += 1
                break
        else:
            pytest.fail(f"entry writes outside the destination KV memory: 0x{d_addr:x}+{length}")
        ctypes.memmove(d_addr, s_addr, length)
    return counts
