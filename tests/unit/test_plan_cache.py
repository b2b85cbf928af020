"""transfer.plan_cache: write plans compiled once per (peer, layout), their entries, fused rows, the cache.

The compiled plan must write exactly what ``layouts.tp.tp_transfer_entries`` per KV cache group wrote
(same entries, same order) on every layout without adjacent regions: random region tables (dense and
interleaved), TP pairs with and without head splits, several groups, fragmented block ids. Where
regions lie next to each other block by block (every layer of a block together), adjacent rows fuse:
fewer entries, the same bytes landing in the same places, inside what D's write guard allows.
"""

from __future__ import annotations

import ctypes
import random

import numpy as np
import pytest
import torch

from pd_connector import messages as proto
from pd_connector.layouts.kv_groups import group_entries, group_pairs
from pd_connector.layouts.regions import Region, block_runs, fuse_adjacent, regions_of_kv_caches
from pd_connector.layouts.tp import MappingError, plan_decode_rank, slices_from, tp_transfer_entries
from pd_connector.metadata import SendJob
from pd_connector.transfer.context import RankSpec
from pd_connector.transfer.plan_cache import PlanCache, compile_plan, plan_entries, run_arrays
from pd_connector.transfer.write_guard import WriteGuard, WriteTargetError
from pd_connector.transfer.write_plans import push_entries


def old_entries(owners, src, dst, slices, sh, dh, pairs):
    return group_entries(owners, src, dst, pairs, lambda s, d, runs: tp_transfer_entries(s, d, slices, sh, dh, runs))


def random_regions(rng: random.Random, count: int, heads: int, dense: bool, base: int) -> list[Region]:
    head_bytes = rng.choice([16, 64, 256])
    block = heads * head_bytes
    stride = block if dense else block * rng.choice([2, 3])
    return [Region(base + i * (1 << 24), stride, block) for i in range(count)]


def random_ids(rng: random.Random, n: int) -> list[int]:
    ids, cur = [], rng.randrange(1, 8)
    while len(ids) < n:
        ids.extend(range(cur, cur + rng.randrange(1, 6)))
        cur = ids[-1] + rng.randrange(2, 5)
    return ids[:n]


@pytest.mark.parametrize("seed", range(40))
def test_compiled_entries_equal_the_per_request_entries(seed: int) -> None:
    rng = random.Random(seed)
    heads, p_tp, d_tp = rng.choice([(4, 1, 1), (8, 2, 4), (8, 4, 2), (4, 2, 2), (2, 1, 2), (8, 1, 4)])
    mla = rng.random() < 0.15
    heads = 1 if mla else heads
    d_rank = rng.randrange(d_tp)
    plan_of_d = plan_decode_rank(heads, p_tp, d_tp, d_rank, is_mla=mla, spread=seed % p_tp)
    p_rank = rng.choice(sorted({s.p_rank for s in plan_of_d}))  # a P rank this D rank reads from
    slices = slices_from(plan_of_d, p_rank)
    sh = 1 if mla else heads // p_tp
    dh = 1 if mla else max(heads // d_tp, 1)
    hb = rng.choice([16, 64])
    nregions = rng.randrange(1, 7)
    groups = rng.choice([1, 1, 2, 3])
    owners = tuple(rng.randrange(groups) for _ in range(nregions)) if groups > 1 else (0,) * nregions
    src = [Region(0x10000000 + i * (1 << 22), sh * hb * rng.choice([1, 1, 2]), sh * hb) for i in range(nregions)]
    dst = [Region(0x90000000 + i * (1 << 22), dh * hb * rng.choice([1, 1, 3]), dh * hb) for i in range(nregions)]
    pairs = []
    for _ in range(groups):
        n = rng.randrange(0, 40)
        pairs.append((random_ids(rng, n), random_ids(rng, n)))
    plan = compile_plan(owners, src, dst, slices, sh, dh, max(owners) + 1)
    assert plan_entries(plan, pairs) == old_entries(owners, src, dst, slices, sh, dh, pairs)


def test_layout_mismatches_are_refused_as_before() -> None:
    one = slices_from(plan_decode_rank(2, 1, 1, 0, is_mla=False), 0)
    with pytest.raises(MappingError, match="bytes per head"):
        compile_plan((0,), [Region(0, 64, 64)], [Region(0, 96, 96)], one, 2, 2, 1)
    with pytest.raises(ValueError, match="region count differs"):
        compile_plan((0,), [Region(0, 64, 64)], [], one, 2, 2, 1)


def test_runs_are_those_of_block_runs() -> None:
    src, dst = [3, 4, 5, 9, 1, 2], [7, 8, 9, 2, 3, 5]
    s0, d0, n = run_arrays(src, dst)
    assert list(zip(s0.tolist(), d0.tolist(), n.tolist(), strict=True)) == block_runs(src, dst)
    assert [len(a) for a in run_arrays([], [])] == [0, 0, 0]


# ------------------------------------------------------------ adjacent regions


def layers_per_block(num_blocks: int, layers: int, gap: int = 0) -> tuple[torch.Tensor, list[Region]]:
    """One buffer [num_blocks, layers (+ gap), 64] bytes: every layer of a block together."""
    buf = torch.zeros(num_blocks, layers + gap, 64, dtype=torch.uint8)
    kv = {f"l{i}": buf[:, i] for i in range(layers)}
    return buf, regions_of_kv_caches(kv, num_blocks)


def copy(entries: tuple[list[int], list[int], list[int]]) -> None:
    for s, d, n in zip(*entries, strict=True):
        ctypes.memmove(d, s, n)


@pytest.mark.parametrize("gap", [0, 1])
def test_regions_next_to_each_other_block_by_block_are_written_as_one_piece(gap: int) -> None:
    nb, layers = 16, 4
    p_buf, p_regions = layers_per_block(nb, layers, gap)
    d_buf, d_regions = layers_per_block(nb, layers, gap)
    ref_buf, _ = layers_per_block(nb, layers, gap)
    p_buf.copy_(torch.randint(0, 255, p_buf.shape, dtype=torch.uint8))
    ref_regions = [
        Region(r.base - d_buf.data_ptr() + ref_buf.data_ptr(), r.block_stride, r.block_bytes) for r in d_regions
    ]
    slices = slices_from(plan_decode_rank(1, 1, 1, 0, is_mla=False), 0)
    pairs = [([1, 2, 3, 7, 8], [4, 5, 6, 10, 12])]
    owners = (0,) * layers
    plan = compile_plan(owners, p_regions, d_regions, slices, 1, 1, 1)
    fused = plan_entries(plan, pairs)
    unfused = old_entries(owners, p_regions, ref_regions, slices, 1, 1, pairs)
    if gap:  # the layers of a block leave a gap before the next block: one entry per block, all layers in it
        assert fused[2] == [layers * 64] * 5
    else:  # layers fill the block stride: one entry per run of blocks, all layers
        assert fused[2] == [3 * layers * 64, layers * 64, layers * 64]
    assert len(unfused[0]) == layers * 5 and sum(fused[2]) == sum(unfused[2])
    WriteGuard(d_regions, nb, "d0").check(fused[1], fused[2])  # inside D's registered blocks
    copy(fused)
    copy(unfused)
    assert torch.equal(d_buf, ref_buf) and int(d_buf.sum()) > 0


def test_fused_guard_regions_cover_the_same_bytes_and_no_more() -> None:
    nb = 8
    _, regions = layers_per_block(nb, 3, gap=1)
    (fused,) = fuse_adjacent(regions)
    assert (fused.base, fused.block_stride, fused.block_bytes) == (regions[0].base, 4 * 64, 3 * 64)
    guard = WriteGuard(regions, nb, "d0")
    guard.check([regions[0].base + 2 * fused.block_stride], [3 * 64])
    with pytest.raises(WriteTargetError):  # into the gap after the three layers of block 2
        guard.check([regions[0].base + 2 * fused.block_stride], [3 * 64 + 1])
    dense = fuse_adjacent([Region(0, 64, 64), Region(64, 64, 64)])  # overlapping dense regions: not fused
    assert len(dense) == 2


# ------------------------------------------------------------ the cache


def hello(peer_id: str, regions: list[Region], heads: int = 2) -> proto.PeerHello:
    return proto.PeerHello(
        peer_id, b"d", "tcp://d:1", 0, 1, 16, "float16", len(regions), [r.as_tuple() for r in regions],
        total_kv_heads=heads, local_kv_heads=heads, num_blocks=64,
    )  # fmt: skip


def test_plans_are_compiled_once_per_peer_and_rebuilt_for_a_new_hello() -> None:
    spec = RankSpec(0, 1, 0, 1, 16, "float16", 2, total_kv_heads=2, local_kv_heads=2)
    regions = [Region(0x1000_0000, 512, 512), Region(0x2000_0000, 512, 512)]
    d_regions = [Region(0x5000_0000, 512, 512), Region(0x6000_0000, 512, 512)]
    job = SendJob("p-1", 7, list(range(1, 11)), 160)
    req = proto.TransferRequest(7, "d-req", "d0", list(range(20, 30)), 0)
    plans = PlanCache(size=2)
    peer = hello("d0", d_regions)
    first = push_entries(spec, regions, peer, job, req, plans)
    assert first == push_entries(spec, regions, peer, job, req)  # uncached: the same entries
    push_entries(spec, regions, peer, job, req, plans)
    assert plans.compiled == 1 and len(plans) == 1
    moved = hello("d0", [Region(0x7000_0000, 512, 512), Region(0x8000_0000, 512, 512)])  # D restarted
    second = push_entries(spec, regions, moved, job, req, plans)
    assert plans.compiled == 2 and second is not None and first is not None and second[1] != first[1]
    for i in range(5):  # bounded: the least recently used plans go
        push_entries(spec, regions, hello(f"d{i + 1}", d_regions), job, req, plans)
    assert len(plans) == 2 and plans.compiled == 7
    with pytest.raises(ValueError, match="size"):
        PlanCache(size=0)


def test_entries_are_plain_ints() -> None:
    plan = compile_plan(
        (0,),
        [Region(4096, 64, 64)],
        [Region(8192, 64, 64)],
        slices_from(plan_decode_rank(1, 1, 1, 0, is_mla=False), 0),
        1,
        1,
        1,
    )
    src, dst, lengths = plan_entries(plan, [([1, 2], [3, 4])])
    assert (src, dst, lengths) == ([4096 + 64], [8192 + 192], [128])
    assert all(type(x) is int for x in src + dst + lengths) and not isinstance(src, np.ndarray)
    assert plan_entries(plan, [([], [])]) == ([], [], [])
    assert group_pairs([[1, 2]], [[3, 4]], 0) == [([1, 2], [3, 4])]


def test_k_and_v_next_to_each_other_are_one_region_to_the_guard_and_one_entry_per_run() -> None:
    """K and V views of one [num_blocks, 2, ...] buffer (FlashInfer's layout): K's block i ends where V's starts."""
    nb = 8
    p_buf = torch.randint(0, 100, (nb, 2, 2, 4, 8)).to(torch.float16)
    d_buf = torch.zeros_like(p_buf)
    p_regions = regions_of_kv_caches({"l0": (p_buf[:, 0], p_buf[:, 1])}, nb)
    d_regions = regions_of_kv_caches({"l0": (d_buf[:, 0], d_buf[:, 1])}, nb)
    assert len(fuse_adjacent(d_regions)) == 1 and fuse_adjacent(d_regions)[0].blocks_contiguous
    slices = slices_from(plan_decode_rank(2, 1, 1, 0, is_mla=False), 0)
    plan = compile_plan((0, 0), p_regions, d_regions, slices, 2, 2, 1)
    entries = plan_entries(plan, [([1, 2, 3], [4, 5, 6])])
    assert entries[2] == [3 * 2 * p_regions[0].block_bytes]  # K and V of three blocks: one entry
    WriteGuard(d_regions, nb, "d0").check(entries[1], entries[2])
    copy(entries)
    assert torch.equal(d_buf[4:7], p_buf[1:4]) and not d_buf[:4].any() and not d_buf[7:].any()
