"""layout: KV tensors -> regions and block runs; whole-block write entries (tp_mapping) checked byte by byte on CPU."""

from __future__ import annotations

import random
from collections.abc import Callable

import numpy as np
import pytest
import torch

from pd_connector.layouts.regions import (
    LayoutError,
    Region,
    block_runs,
    memory_ranges,
    regions_of_kv_caches,
    regions_of_tensor,
)
from pd_connector.layouts.tp import check_head_regions
from tests.support.byte_copies import apply_writes, storages_of, whole_block_writes

NB, BS, HEADS, HD = 12, 4, 2, 8
F16 = torch.float16
ITEM = 2


def test_vllm_cpu_layout_one_region_per_layer() -> None:
    kv = {f"layer.{i}": torch.zeros(NB, HEADS, BS, 2 * HD, dtype=F16) for i in range(3)}
    regions = regions_of_kv_caches(kv, NB)
    assert len(regions) == 3
    block = HEADS * BS * 2 * HD * ITEM
    for region, t in zip(regions, kv.values(), strict=True):
        assert region == Region(t.data_ptr(), block, block)
        assert region.blocks_contiguous
        assert region.as_tuple() == (t.data_ptr(), block, block)


def test_ascend_tuple_layout_one_region_per_part() -> None:
    kv = {
        f"layer.{i}": (torch.zeros(NB, BS, HEADS, HD, dtype=F16), torch.zeros(NB, BS, HEADS, HD, dtype=F16))
        for i in range(2)
    }
    regions = regions_of_kv_caches(kv, NB)
    assert len(regions) == 4
    block = BS * HEADS * HD * ITEM
    expected = [t.data_ptr() for pair in kv.values() for t in pair]
    assert [r.base for r in regions] == expected
    assert all(r.block_stride == block and r.block_bytes == block for r in regions)


def test_ascend_mla_layout_latent_and_rope() -> None:
    latent = torch.zeros(NB, BS, 1, 512, dtype=torch.bfloat16)
    rope = torch.zeros(NB, BS, 1, 64, dtype=torch.bfloat16)
    regions = regions_of_kv_caches({"layer.0": (latent, rope)}, NB)
    assert regions == [
        Region(latent.data_ptr(), BS * 512 * 2, BS * 512 * 2),
        Region(rope.data_ptr(), BS * 64 * 2, BS * 64 * 2),
    ]


def test_cuda_flash_attention_layout_two_regions() -> None:
    t = torch.zeros(2, NB, BS, HEADS, HD, dtype=F16)
    regions = regions_of_tensor(t, NB)
    block = BS * HEADS * HD * ITEM
    assert regions == [
        Region(t.data_ptr(), block, block),
        Region(t.data_ptr() + NB * block, block, block),
    ]
    # The same via the per-layer mapping (one tensor per layer).
    assert regions_of_kv_caches({"l0": t}, NB) == regions


def test_strided_blocks_region() -> None:
    # FlashInfer-like [nb, 2, bs, heads, dim] split into k / v views: blocks are not adjacent.
    kv = torch.zeros(NB, 2, BS, HEADS, HD, dtype=F16)
    k, v = kv[:, 0], kv[:, 1]
    block = BS * HEADS * HD * ITEM
    assert regions_of_kv_caches({"l0": (k, v)}, NB) == [
        Region(kv.data_ptr(), 2 * block, block),
        Region(kv.data_ptr() + block, 2 * block, block),
    ]
    assert not regions_of_tensor(k, NB)[0].blocks_contiguous


@pytest.mark.parametrize(
    "make",
    [
        lambda: torch.zeros(NB, HEADS, BS, 2 * HD, dtype=F16)[:, :, :, :HD],  # K half of the CPU layout
        lambda: torch.zeros(NB, BS, HEADS, HD, dtype=F16)[:, :, :, 1:],
        lambda: torch.zeros(NB, BS, 2 * HEADS, HD, dtype=F16)[:, :, ::2],
    ],
)
def test_non_contiguous_block_part_raises(make: Callable[[], torch.Tensor]) -> None:
    with pytest.raises(LayoutError, match="not contiguous"):
        regions_of_tensor(make(), NB)


def test_permuted_dense_block_part_is_accepted() -> None:
    # A permutation inside the block keeps its bytes one dense run: one region, no error.
    t = torch.zeros(NB, BS, HEADS, HD, dtype=F16).transpose(1, 2)
    assert regions_of_tensor(t, NB) == [Region(t.data_ptr(), BS * HEADS * HD * ITEM, BS * HEADS * HD * ITEM)]


def test_no_block_dimension_raises() -> None:
    with pytest.raises(LayoutError, match="num_blocks"):
        regions_of_tensor(torch.zeros(3, 5, 7), NB)


def test_empty_layer_raises() -> None:
    with pytest.raises(LayoutError, match="layer.0"):
        regions_of_kv_caches({"layer.0": ()}, NB)


# ------------------------------------------------------------- memory ranges


def test_memory_ranges_merges_views_of_one_storage() -> None:
    t = torch.zeros(2, NB, BS, HEADS, HD, dtype=F16)
    kv = {"l0": (t[0], t[1]), "l1": t}
    assert memory_ranges(kv) == [(t.data_ptr(), t.untyped_storage().nbytes())]


def test_memory_ranges_slice_is_only_its_own_bytes() -> None:
    # vLLM-Ascend drop-in: a slice registers its own bytes, not the storage around it.
    big = torch.zeros(NB * 2, HEADS, BS, 2 * HD, dtype=F16)
    part = big[NB:]
    assert memory_ranges({"l0": part}) == [(part.data_ptr(), part.nbytes)]
    assert part.data_ptr() != big.data_ptr()


def test_memory_ranges_separate_tensors() -> None:
    tensors = [torch.zeros(NB, HEADS, BS, 2 * HD, dtype=F16) for _ in range(3)]
    ranges = memory_ranges({f"l{i}": t for i, t in enumerate(tensors)})
    # Sorted, non-overlapping, and every tensor lies inside one range.
    for (a0, n0), (a1, _) in zip(ranges, ranges[1:], strict=False):
        assert a0 + n0 < a1
    for t in tensors:
        assert any(a <= t.data_ptr() and t.data_ptr() + t.nbytes <= a + n for a, n in ranges)
    assert sum(n for _, n in ranges) == sum(t.nbytes for t in tensors)


# ------------------------------------------------------------ runs and entries


def test_block_runs_coalesce() -> None:
    assert block_runs([], []) == []
    assert block_runs([0, 1, 2, 3], [5, 6, 7, 8]) == [(0, 5, 4)]
    assert block_runs([0, 1, 2, 7, 8], [5, 6, 9, 10, 11]) == [(0, 5, 2), (2, 9, 1), (7, 10, 2)]
    assert block_runs([3, 2, 1], [1, 2, 3]) == [(3, 1, 1), (2, 2, 1), (1, 3, 1)]
    with pytest.raises(LayoutError):
        block_runs([1, 2], [1])


def test_dense_run_is_one_entry_per_region() -> None:
    src = [Region(10_000, 64, 64), Region(50_000, 64, 64)]
    dst = [Region(90_000, 64, 64), Region(20_000, 64, 64)]
    runs = block_runs(list(range(3, 11)), list(range(100, 108)))
    assert runs == [(3, 100, 8)]
    s, d, n = whole_block_writes(src, dst, runs)
    assert s == [10_000 + 3 * 64, 50_000 + 3 * 64]
    assert d == [90_000 + 100 * 64, 20_000 + 100 * 64]
    assert n == [8 * 64, 8 * 64]


def test_strided_run_is_one_entry_per_block() -> None:
    src = [Region(10_000, 128, 64)]
    dst = [Region(90_000, 64, 64)]
    s, d, n = whole_block_writes(src, dst, [(2, 7, 3)])
    assert s == [10_000 + 2 * 128, 10_000 + 3 * 128, 10_000 + 4 * 128]
    assert d == [90_000 + 7 * 64, 90_000 + 8 * 64, 90_000 + 9 * 64]
    assert n == [64, 64, 64]


# ---------------------------------------------------- byte-level simulation


def _cpu_layout(nb: int, seed: int) -> dict[str, object]:
    g = torch.Generator().manual_seed(seed)
    return {f"l{i}": torch.randint(-1000, 1000, (nb, HEADS, BS, 2 * HD), generator=g).to(F16) for i in range(2)}


def _ascend_layout(nb: int, seed: int) -> dict[str, object]:
    g = torch.Generator().manual_seed(seed)
    return {
        f"l{i}": tuple(torch.randint(-1000, 1000, (nb, BS, HEADS, HD), generator=g).to(F16) for _ in range(2))
        for i in range(2)
    }


def _mla_layout(nb: int, seed: int) -> dict[str, object]:
    g = torch.Generator().manual_seed(seed)
    return {
        f"l{i}": (
            torch.randint(-1000, 1000, (nb, BS, 1, 512), generator=g).to(torch.bfloat16),
            torch.randint(-1000, 1000, (nb, BS, 1, 64), generator=g).to(torch.bfloat16),
        )
        for i in range(2)
    }


def _fa_layout(nb: int, seed: int) -> dict[str, object]:
    g = torch.Generator().manual_seed(seed)
    return {f"l{i}": torch.randint(-1000, 1000, (2, nb, BS, HEADS, HD), generator=g).to(F16) for i in range(2)}


def _strided_layout(nb: int, seed: int) -> dict[str, object]:
    g = torch.Generator().manual_seed(seed)
    out: dict[str, object] = {}
    for i in range(2):
        kv = torch.randint(-1000, 1000, (nb, 2, BS, HEADS, HD), generator=g).to(F16)
        out[f"l{i}"] = (kv[:, 0], kv[:, 1])
    return out


LAYOUTS = {
    "vllm_cpu": (_cpu_layout, 0),
    "ascend_kv": (_ascend_layout, 1),
    "ascend_mla": (_mla_layout, 1),
    "cuda_fa": (_fa_layout, 1),
    "strided": (_strided_layout, 1),
}


def _block_views(kv: dict[str, object]) -> list[tuple[torch.Tensor, int]]:
    """(tensor, block dim) per region-carrying tensor, in region order."""
    views = []
    for value in kv.values():
        for part in value if isinstance(value, tuple) else [value]:
            assert isinstance(part, torch.Tensor)
            if part.dim() == 5 and part.shape[0] == 2:  # FlashAttention: [2, nb, ...]
                views.extend([(part[0], 0), (part[1], 0)])
            else:
                views.append((part, 0))
    return views


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("seed", range(6))
def test_simulated_transfer_is_byte_exact(layout: str, seed: int) -> None:
    make, _ = LAYOUTS[layout]
    rng = random.Random(seed)
    nb_src, nb_dst = 24, 20
    src_kv, dst_kv = make(nb_src, 100 + seed), make(nb_dst, 200 + seed)
    src_regions = regions_of_kv_caches(src_kv, nb_src)
    dst_regions = regions_of_kv_caches(dst_kv, nb_dst)
    check_head_regions(src_regions, dst_regions, 1, 1)

    count = rng.randint(1, nb_dst)
    if seed % 2:  # mostly consecutive ids, as a fresh allocator hands out
        s0, d0 = rng.randint(0, nb_src - count), rng.randint(0, nb_dst - count)
        src_ids, dst_ids = list(range(s0, s0 + count)), list(range(d0, d0 + count))
        if count > 3:
            dst_ids[count // 2 :] = [i for i in range(nb_dst) if i not in dst_ids[: count // 2]][: count - count // 2]
    else:
        src_ids = rng.sample(range(nb_src), count)
        dst_ids = rng.sample(range(nb_dst), count)

    runs = block_runs(src_ids, dst_ids)
    assert sum(n for _, _, n in runs) == count
    entries = whole_block_writes(src_regions, dst_regions, runs)
    dense = all(r.blocks_contiguous for r in src_regions + dst_regions)
    assert len(entries[0]) == (len(runs) if dense else count) * len(src_regions)

    dst_storages = storages_of(dst_kv)
    before = [s.clone() for s in dst_storages]
    counts = apply_writes(entries, dst_storages)

    # Every destination block now equals its source block ...
    src_views, dst_views = _block_views(src_kv), _block_views(dst_kv)
    assert len(src_views) == len(dst_views) == len(src_regions)
    for (sv, _), (dv, _) in zip(src_views, dst_views, strict=True):
        for s, d in zip(src_ids, dst_ids, strict=True):
            assert torch.equal(dv[d], sv[s]), f"{layout}: dst block {d} != src block {s}"
    # ... each of its bytes was written exactly once, and no other byte was touched.
    for st, old, cnt in zip(dst_storages, before, counts, strict=True):
        expected = np.zeros_like(cnt)
        for region in dst_regions:
            for d in dst_ids:
                off = region.base + d * region.block_stride - st.data_ptr()
                if 0 <= off < st.numel():
                    expected[off : off + region.block_bytes] += 1
        np.testing.assert_array_equal(cnt, expected)
        untouched = torch.from_numpy(expected == 0)
        assert torch.equal(st[untouched], old[untouched])


def test_simulated_transfer_between_different_layouts() -> None:
    """Dense source, strided destination with the same bytes per block: per-block entries, exact bytes."""
    src_kv, dst_kv = _ascend_layout(10, 1), _strided_layout(10, 2)
    src_regions, dst_regions = regions_of_kv_caches(src_kv, 10), regions_of_kv_caches(dst_kv, 10)
    src_ids, dst_ids = [0, 1, 2, 5], [4, 5, 6, 0]
    runs = block_runs(src_ids, dst_ids)
    assert runs == [(0, 4, 3), (5, 0, 1)]
    entries = whole_block_writes(src_regions, dst_regions, runs)
    assert len(entries[0]) == 4 * len(src_regions)
    dst_storages = storages_of(dst_kv)
    counts = apply_writes(entries, dst_storages)
    assert sum(int(c.sum()) for c in counts) == 4 * sum(r.block_bytes for r in dst_regions)
    for (sv, _), (dv, _) in zip(_block_views(src_kv), _block_views(dst_kv), strict=True):
        for s, d in zip(src_ids, dst_ids, strict=True):
            assert torch.equal(dv[d], sv[s])
