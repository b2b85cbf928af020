"""tp_mapping: P/D head plans over a TP-size matrix, and a byte-level transfer simulation on CPU tensors."""

from __future__ import annotations

import ctypes
import itertools
import random
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import pytest
import torch

from pd_connector.layouts.regions import LayoutError, Region, block_runs, regions_of_kv_caches
from pd_connector.layouts.tp import (
    HeadSlice,
    MappingError,
    check_head_regions,
    decode_contacts,
    expected_requests,
    head_entries,
    is_head_major,
    local_heads,
    needs_head_split,
    plan_decode_rank,
    senders_for,
    slices_from,
    tp_transfer_entries,
)

TPS = (1, 2, 4, 8, 16)
MATRIX = list(itertools.product(TPS, TPS))


# ------------------------------------------------------------------ head plans


def test_local_heads_follow_vllm() -> None:
    assert local_heads(8, 1, 0) == list(range(8))
    assert local_heads(8, 2, 1) == [4, 5, 6, 7]
    assert local_heads(8, 8, 3) == [3]
    assert [local_heads(8, 16, r) for r in range(16)] == [[r // 2] for r in range(16)]
    assert [local_heads(2, 8, r) for r in range(8)] == [[r // 4] for r in range(8)]
    assert local_heads(1, 4, 3) == [0]


def _check_plan(heads: int, p_tp: int, d_tp: int, *, is_mla: bool, spread: int = 0) -> None:
    h = 1 if is_mla else heads
    for d_rank in range(d_tp):
        plan = plan_decode_rank(heads, p_tp, d_tp, d_rank, is_mla=is_mla, spread=spread)
        d_heads = local_heads(h, d_tp, d_rank)
        covered: list[int] = []
        for s in plan:
            assert s.num_heads >= 1
            p_heads = local_heads(h, p_tp, s.p_rank)
            for k in range(s.num_heads):
                # the P rank holds the very global head that lands at this D-local index
                assert p_heads[s.src_head + k] == d_heads[s.dst_head + k]
                covered.append(s.dst_head + k)
        assert sorted(covered) == list(range(len(d_heads))), (p_tp, d_tp, d_rank, plan)
        assert [s.dst_head for s in plan] == sorted(s.dst_head for s in plan)
        for a, b in itertools.pairwise(plan):  # merged: no two neighbours could be one slice
            assert not (
                a.p_rank == b.p_rank
                and a.src_head + a.num_heads == b.src_head
                and a.dst_head + a.num_heads == b.dst_head
            )
        if is_mla:
            assert len(plan) == 1 and plan[0].src_head == plan[0].dst_head == 0 and plan[0].num_heads == 1


def _check_load(heads: int, p_tp: int, d_tp: int, *, is_mla: bool, spread: int = 0) -> None:
    """P ranks holding the same head serve numbers of D ranks that differ by at most one."""
    h = 1 if is_mla else heads
    senders = senders_for(heads, p_tp, d_tp, is_mla=is_mla, spread=spread)
    assert sorted(senders) == list(range(p_tp))
    by_head: dict[tuple[int, ...], list[int]] = {}
    for p in range(p_tp):
        by_head.setdefault(tuple(local_heads(h, p_tp, p)), []).append(len(senders[p]))
    for loads in by_head.values():
        assert max(loads) - min(loads) <= 1, (p_tp, d_tp, senders)
    # senders_for is the transpose of the plans
    pairs = {(p, d) for p, ds in senders.items() for d in ds}
    planned = {
        (s.p_rank, d) for d in range(d_tp) for s in plan_decode_rank(heads, p_tp, d_tp, d, is_mla=is_mla, spread=spread)
    }
    assert pairs == planned


def _check_contacts(heads: int, p_tp: int, d_tp: int, *, is_mla: bool, spread: int = 0) -> None:
    """Every P rank hears from expected_requests() D ranks per room, at least one."""
    heard = Counter()
    for d in range(d_tp):
        contacts = decode_contacts(heads, p_tp, d_tp, d, is_mla=is_mla, spread=spread)
        plan = plan_decode_rank(heads, p_tp, d_tp, d, is_mla=is_mla, spread=spread)
        assert {s.p_rank for s in plan} <= set(contacts)
        assert contacts == sorted(set(contacts))
        heard.update(contacts)
    for p in range(p_tp):
        expected = expected_requests(heads, p_tp, d_tp, p, is_mla=is_mla, spread=spread)
        assert expected >= 1
        assert heard[p] == expected, (p_tp, d_tp, p)


@pytest.mark.parametrize(("heads", "tps"), [(8, TPS), (16, TPS), (4, TPS), (1, (1, 2, 4)), (32, TPS)])
def test_gqa_mha_plans_cover_each_local_head_once(heads: int, tps: Sequence[int]) -> None:
    for p_tp, d_tp in itertools.product(tps, tps):
        for spread in (0, 1, 3):
            _check_plan(heads, p_tp, d_tp, is_mla=False, spread=spread)
            _check_load(heads, p_tp, d_tp, is_mla=False, spread=spread)
            _check_contacts(heads, p_tp, d_tp, is_mla=False, spread=spread)


@pytest.mark.parametrize(("p_tp", "d_tp"), MATRIX)
def test_mla_one_sender_per_decode_rank_balanced(p_tp: int, d_tp: int) -> None:
    for spread in range(p_tp):
        _check_plan(576, p_tp, d_tp, is_mla=True, spread=spread)
        _check_load(576, p_tp, d_tp, is_mla=True, spread=spread)
        _check_contacts(576, p_tp, d_tp, is_mla=True, spread=spread)
        loads = [len(ds) for ds in senders_for(576, p_tp, d_tp, is_mla=True, spread=spread).values()]
        assert sum(loads) == d_tp
        assert max(loads) - min(loads) <= 1
    # spread rotates the choice: over p_tp rooms every P rank sends equally often
    per_p = Counter(
        plan_decode_rank(0, p_tp, d_tp, d, is_mla=True, spread=room)[0].p_rank
        for room in range(p_tp)
        for d in range(d_tp)
    )
    assert set(per_p.values()) == {d_tp}


def test_plan_examples() -> None:
    # D has fewer ranks: D rank 0 gathers 4 P ranks' heads
    assert plan_decode_rank(8, 4, 1, 0, is_mla=False) == [HeadSlice(p, 0, 2 * p, 2) for p in range(4)]
    # D has more ranks: each D rank takes half of one P rank's heads
    assert plan_decode_rank(8, 2, 4, 3, is_mla=False) == [HeadSlice(1, 2, 0, 2)]
    # equal TP: the same rank, whole blocks
    assert plan_decode_rank(8, 4, 4, 2, is_mla=False) == [HeadSlice(2, 0, 0, 2)]
    # both replicated (H=8 over 16 and 8): one head each side
    assert plan_decode_rank(8, 16, 8, 5, is_mla=False) == [HeadSlice(10, 0, 0, 1)]
    assert plan_decode_rank(8, 16, 8, 5, is_mla=False, spread=1) == [HeadSlice(11, 0, 0, 1)]
    # MLA: d % p_tp when D is larger, spread out when smaller
    assert [plan_decode_rank(0, 2, 4, d, is_mla=True)[0].p_rank for d in range(4)] == [0, 1, 0, 1]
    assert [plan_decode_rank(0, 8, 2, d, is_mla=True)[0].p_rank for d in range(2)] == [0, 4]
    # idle P ranks (MLA, d_tp < p_tp) are released by exactly one D rank each
    assert senders_for(0, 4, 2, is_mla=True) == {0: [0], 1: [], 2: [1], 3: []}
    assert [decode_contacts(0, 4, 2, d, is_mla=True) for d in range(2)] == [[0, 1], [2, 3]]
    assert [expected_requests(0, 4, 2, p, is_mla=True) for p in range(4)] == [1, 1, 1, 1]
    assert [expected_requests(8, 2, 8, p, is_mla=False) for p in range(2)] == [4, 4]


def test_needs_head_split() -> None:
    def split(h: int, p: int, d: int, d_rank: int = 0) -> bool:
        plan = plan_decode_rank(h, p, d, d_rank, is_mla=False)
        return needs_head_split(plan, len(local_heads(h, p, 0)), len(local_heads(h, d, 0)))

    assert not split(8, 4, 4)
    assert split(8, 2, 4)
    assert split(8, 8, 2)
    assert not split(8, 16, 8)  # one replicated head on each side: whole blocks
    assert not split(8, 8, 16)
    assert split(8, 16, 4)


def test_errors_are_clear() -> None:
    with pytest.raises(MappingError, match="8 KV heads cannot be split evenly over TP size 3"):
        local_heads(8, 3, 0)
    with pytest.raises(MappingError, match="TP size 6 is larger than the 4 KV heads but not a multiple"):
        local_heads(4, 6, 0)
    with pytest.raises(MappingError, match="rank 2 is out of range for TP size 2"):
        local_heads(8, 2, 2)
    with pytest.raises(MappingError, match="total KV heads must be >= 1"):
        local_heads(0, 1, 0)
    with pytest.raises(MappingError, match="prefill TP size 3"):
        plan_decode_rank(8, 3, 2, 0, is_mla=False)
    with pytest.raises(MappingError, match="decode TP size 12"):
        plan_decode_rank(8, 2, 12, 0, is_mla=False)
    with pytest.raises(MappingError, match="decode rank 4 is out of range"):
        plan_decode_rank(8, 2, 4, 4, is_mla=False)
    with pytest.raises(MappingError, match="prefill rank 9"):
        expected_requests(8, 4, 4, 9, is_mla=False)
    assert issubclass(MappingError, LayoutError) and issubclass(MappingError, ValueError)


def test_head_bytes_mismatch_and_bad_slices() -> None:
    one = [HeadSlice(0, 0, 0, 1)]
    with pytest.raises(MappingError, match="prefill has 32 bytes per head .* decode 48"):
        head_entries(Region(0, 64, 64), Region(0, 96, 96), one, 2, 2, [(0, 0, 1)])
    with pytest.raises(MappingError, match="100 bytes per block do not split into 3 heads"):
        head_entries(Region(0, 100, 100), Region(0, 100, 100), one, 3, 3, [(0, 0, 1)])
    with pytest.raises(MappingError, match="out of range"):
        head_entries(Region(0, 64, 64), Region(0, 32, 32), [HeadSlice(0, 1, 0, 2)], 2, 1, [(0, 0, 1)])
    with pytest.raises(MappingError, match="several prefill ranks"):
        head_entries(Region(0, 64, 64), Region(0, 64, 64), [HeadSlice(0, 0, 0, 1), HeadSlice(1, 0, 1, 1)], 2, 2, [])
    with pytest.raises(MappingError, match="region count differs"):
        tp_transfer_entries([Region(0, 64, 64)], [], one, 2, 1, [(0, 0, 1)])
    with pytest.raises(MappingError, match="KV region 1: prefill has 32 bytes per head"):
        check_head_regions([Region(0, 64, 64)] * 2, [Region(0, 32, 32), Region(0, 16, 16)], 2, 1)
    check_head_regions([Region(0, 64, 64)] * 2, [Region(0, 32, 32)] * 2, 2, 1)


def whole_block_entries(
    src: Sequence[Region], dst: Sequence[Region], runs: Sequence[tuple[int, int, int]]
) -> tuple[list[int], list[int], list[int]]:
    """Reference: whole blocks per region, one entry per run where both sides are dense, else per block."""
    src_addrs: list[int] = []
    dst_addrs: list[int] = []
    lengths: list[int] = []
    for s, d in zip(src, dst, strict=True):
        dense = s.blocks_contiguous and d.blocks_contiguous
        for s0, d0, n in runs:
            for k in [0] if dense else range(n):
                src_addrs.append(s.base + (s0 + k) * s.block_stride)
                dst_addrs.append(d.base + (d0 + k) * d.block_stride)
                lengths.append((n if dense else 1) * s.block_bytes)
    return src_addrs, dst_addrs, lengths


def test_equal_tp_entries_match_whole_block_entries() -> None:
    src = [Region(1 << 20, 256, 256), Region(2 << 20, 512, 256)]
    dst = [Region(3 << 20, 256, 256), Region(4 << 20, 256, 256)]
    runs = block_runs([3, 4, 5, 9, 1], [7, 8, 9, 2, 3])
    plan = plan_decode_rank(8, 2, 2, 1, is_mla=False)
    assert tp_transfer_entries(src, dst, plan, 4, 4, runs) == whole_block_entries(src, dst, runs)


def test_partial_heads_one_entry_per_block_and_slice() -> None:
    src, dst = Region(1000, 64, 64), Region(5000, 32, 32)  # P: 4 heads x 16 B, D: 2 heads x 16 B
    slices = [HeadSlice(0, 2, 0, 2)]
    entries = head_entries(src, dst, slices, 4, 2, block_runs([0, 1, 2], [5, 6, 7]))
    assert entries == ([1032, 1096, 1160], [5160, 5192, 5224], [32, 32, 32])
    # D gathers from P: a P rank's whole block lands inside D's bigger block
    entries = head_entries(Region(1000, 32, 32), Region(5000, 64, 64), [HeadSlice(0, 0, 2, 2)], 2, 4, [(0, 3, 2)])
    assert entries == ([1000, 1032], [5224, 5288], [32, 32])


# ------------------------------------------------------------- layout checks

NB, BS, HD = 6, 4, 8


def test_is_head_major_layouts() -> None:
    assert is_head_major((NB, 2, BS, 2 * HD), NB, 2)  # vLLM CPU
    assert is_head_major((2, NB, 2, BS, HD), NB, 2)  # CUDA HND
    assert not is_head_major((NB, BS, 2, HD), NB, 2)  # vLLM-Ascend NHD
    assert not is_head_major((2, NB, BS, 2, HD), NB, 2)  # CUDA FlashAttention NHD
    assert is_head_major((NB, BS, 1, 512), NB, 1)  # MLA / one head: any layout
    # head_dim equal to the head count is not mistaken for heads (last dim)
    assert is_head_major((NB, 16, BS, 16), NB, 16)
    # logical HND over a physical NHD allocation (stride order): decided by strides
    t = torch.zeros(NB, BS, 2, HD).permute(0, 2, 1, 3)
    assert tuple(t.shape) == (NB, 2, BS, HD)
    assert not is_head_major(t.shape, NB, 2, strides=t.stride())
    assert is_head_major(t.contiguous().shape, NB, 2, strides=t.contiguous().stride())
    # ambiguous block_size == heads: refuses to guess, unless told
    with pytest.raises(MappingError, match="cannot tell which one holds the heads"):
        is_head_major((NB, 4, 4, HD), NB, 4)
    assert is_head_major((NB, 4, 4, HD), NB, 4, heads_dim=1)
    assert not is_head_major((NB, 4, 4, HD), NB, 4, heads_dim=2)
    with pytest.raises(MappingError, match="no per-block dimension of size local_heads=3"):
        is_head_major((NB, 4, BS, HD), NB, 3)
    with pytest.raises(MappingError, match="no dimension of size num_blocks"):
        is_head_major((5, 4, BS, HD), NB, 4)


# ------------------------------------------------------- byte-level simulation

ITEM = 4  # int32


@dataclass(frozen=True)
class KVLayout:
    """How a rank's KV tensors look: owners (contiguous), vLLM's view of them, a (block, head) selector."""

    name: str
    make: Callable[[int, int], list[torch.Tensor]]  # (local_heads, num_blocks) -> owners of one layer
    view: Callable[[list[torch.Tensor]], object]  # owners -> kv_caches value of one layer
    sel: Callable[[torch.Tensor, int, int], torch.Tensor]  # (owner, block, local head) -> view


def _i32(*shape: int) -> torch.Tensor:
    return torch.full(shape, -1, dtype=torch.int32)


CPU = KVLayout("cpu", lambda h, n: [_i32(n, h, BS, 2 * HD)], lambda o: o[0], lambda t, b, h: t[b, h])
HND = KVLayout("hnd", lambda h, n: [_i32(2, n, h, BS, HD)], lambda o: o[0], lambda t, b, h: t[:, b, h])
# blocks not dense: vLLM sees [n, h] of an [n, h+1] allocation (block_stride > block_bytes)
PADDED = KVLayout("padded", lambda h, n: [_i32(n, h + 1, BS, 2 * HD)], lambda o: o[0][:, :-1], lambda t, b, h: t[b, h])
MLA_CPU = KVLayout("mla-cpu", lambda h, n: [_i32(n, BS, 12)], lambda o: o[0], lambda t, b, h: t[b])
MLA_ASCEND = KVLayout(
    "mla-ascend",
    lambda h, n: [_i32(n, BS, 1, 12), _i32(n, BS, 1, 4)],
    lambda o: tuple(o),
    lambda t, b, h: t[b, :, h],
)


class Rank:
    """One worker rank's KV memory for a few layers."""

    def __init__(self, layout: KVLayout, heads: int, tp: int, rank: int, nb: int, layers: int, fill: bool) -> None:
        self.layout = layout
        self.heads = local_heads(heads, tp, rank)
        self.owners = [layout.make(len(self.heads), nb) for _ in range(layers)]
        kv = {f"layer.{i}": layout.view(o) for i, o in enumerate(self.owners)}
        self.regions = regions_of_kv_caches(kv, nb)
        self.flat = [t for layer in self.owners for t in layer]
        if fill:
            for li, layer in enumerate(self.owners):
                for part, t in enumerate(layer):
                    for b in range(nb):
                        for j, g in enumerate(self.heads):
                            view = layout.sel(t, b, j)
                            base = (((li * 4 + part) * 64 + g) * 1024 + b) * 256
                            assert view.numel() < 256
                            view.copy_(torch.arange(base, base + view.numel(), dtype=torch.int32).view(view.shape))

    def owner_at(self, addr: int, length: int) -> int:
        for i, t in enumerate(self.flat):
            if t.data_ptr() <= addr and addr + length <= t.data_ptr() + t.nbytes:
                return i
        raise AssertionError(f"range {addr:#x}+{length} is outside this rank's KV tensors")


def _blocks(rng: random.Random, nb: int, n: int) -> list[int]:
    """n distinct block ids: a consecutive stretch then random ones (so runs coalesce sometimes)."""
    k = rng.randint(1, n)
    start = rng.randrange(nb - k + 1)
    ids = list(range(start, start + k))
    rest = [b for b in range(nb) if b not in ids]
    return ids + rng.sample(rest, n - k)


def simulate(layout: KVLayout, heads: int, p_tp: int, d_tp: int, *, is_mla: bool, seed: int, spread: int = 0) -> None:
    """Build every P rank's entries for every D rank, memmove them, check each D byte."""
    h = 1 if is_mla else heads
    nb_p, nb_d, layers = 10, 12, 2
    rng = random.Random(seed)
    prefill = [Rank(layout, h, p_tp, p, nb_p, layers, fill=True) for p in range(p_tp)]
    for d_rank in range(d_tp):
        dec = Rank(layout, h, d_tp, d_rank, nb_d, layers, fill=False)
        n = rng.randint(1, nb_p)
        src_blocks, dst_blocks = _blocks(rng, nb_p, n), _blocks(rng, nb_d, n)
        runs = block_runs(src_blocks, dst_blocks)
        plan = plan_decode_rank(heads, p_tp, d_tp, d_rank, is_mla=is_mla, spread=spread)
        counts = [np.zeros(t.nbytes, dtype=np.int32) for t in dec.flat]
        for p_rank in sorted({s.p_rank for s in plan}):
            src_rank = prefill[p_rank]
            slices = slices_from(plan, p_rank)
            check_head_regions(src_rank.regions, dec.regions, len(src_rank.heads), len(dec.heads))
            src, dst, lengths = tp_transfer_entries(
                src_rank.regions, dec.regions, slices, len(src_rank.heads), len(dec.heads), runs
            )
            # never per token: at most one entry per (region, slice, block)
            assert len(lengths) <= len(dec.regions) * len(slices) * n
            for s_addr, d_addr, length in zip(src, dst, lengths, strict=True):
                assert length > 0
                src_rank.owner_at(s_addr, length)  # reads only the sending P rank's memory
                i = dec.owner_at(d_addr, length)
                off = d_addr - dec.flat[i].data_ptr()
                counts[i][off : off + length] += 1
                ctypes.memmove(d_addr, s_addr, length)
        # expected destination: every requested block's heads from a P rank holding them, all else untouched
        for i, (got, cnt) in enumerate(zip(dec.flat, counts, strict=True)):
            want, mark = _i32(*got.shape), torch.zeros(got.shape, dtype=torch.int32)
            li, part = divmod(i, len(dec.owners[0]))
            for sb, db in zip(src_blocks, dst_blocks, strict=True):
                for j, g in enumerate(dec.heads):
                    ref = next(r for r in prefill if g in r.heads)
                    layout.sel(want, db, j).copy_(layout.sel(ref.owners[li][part], sb, ref.heads.index(g)))
                    layout.sel(mark, db, j).fill_(1)
            assert torch.equal(got, want), (layout.name, p_tp, d_tp, d_rank, i)
            assert np.array_equal(cnt, np.repeat(mark.numpy().ravel(), ITEM)), (layout.name, p_tp, d_tp, d_rank, i)


@pytest.mark.parametrize(("p_tp", "d_tp"), MATRIX)
def test_bytes_gqa8_cpu_layout(p_tp: int, d_tp: int) -> None:
    simulate(CPU, 8, p_tp, d_tp, is_mla=False, seed=p_tp * 100 + d_tp)


@pytest.mark.parametrize(("p_tp", "d_tp"), MATRIX)
def test_bytes_gqa8_cuda_hnd_layout(p_tp: int, d_tp: int) -> None:
    simulate(HND, 8, p_tp, d_tp, is_mla=False, seed=7 + p_tp * 100 + d_tp, spread=1)


@pytest.mark.parametrize(("p_tp", "d_tp"), [(1, 4), (4, 1), (2, 8), (8, 2), (4, 4), (16, 4)])
def test_bytes_non_dense_blocks(p_tp: int, d_tp: int) -> None:
    simulate(PADDED, 8, p_tp, d_tp, is_mla=False, seed=3)


@pytest.mark.parametrize(("p_tp", "d_tp"), [(1, 16), (16, 1), (2, 4), (4, 2), (8, 8), (16, 16)])
def test_bytes_mha16(p_tp: int, d_tp: int) -> None:
    simulate(CPU, 16, p_tp, d_tp, is_mla=False, seed=11)


@pytest.mark.parametrize("layout", [MLA_CPU, MLA_ASCEND], ids=lambda x: x.name)
@pytest.mark.parametrize(("p_tp", "d_tp"), [(1, 1), (1, 4), (4, 1), (2, 8), (8, 2), (4, 4), (16, 2)])
def test_bytes_mla(layout: KVLayout, p_tp: int, d_tp: int) -> None:
    simulate(layout, 0, p_tp, d_tp, is_mla=True, seed=5, spread=p_tp - 1)


def test_mla_whole_blocks_coalesce() -> None:
    p = Rank(MLA_ASCEND, 1, 4, 1, 8, 1, fill=False)
    d = Rank(MLA_ASCEND, 1, 2, 0, 8, 1, fill=False)
    plan = plan_decode_rank(0, 4, 2, 0, is_mla=True)
    runs = block_runs([0, 1, 2, 5], [3, 4, 5, 0])
    entries = tp_transfer_entries(p.regions, d.regions, plan, 1, 1, runs)
    assert entries == whole_block_entries(p.regions, d.regions, runs)
    assert len(entries[2]) == 2 * len(runs)  # latent + rope, one entry per run
