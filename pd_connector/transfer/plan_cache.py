"""P side: write plans compiled once per (decode peer, layout) and reused for every request.

What a push writes depends on two things: the *layout* pair (P's regions and D's, the head slices
this P rank sends to that D rank, which KV cache group each region belongs to), fixed for as long as
both ranks run, and the request's block ids. ``compile_plan`` turns the first into byte *rows*, one
per (region pair, head slice): where block 0 of the row starts on each side, the block strides, the
bytes per block, and whether a run of consecutive blocks is one contiguous piece on both sides
(``dense``). ``plan_entries`` turns a request's block pairs into entries with array arithmetic: a
dense row gives one entry per run of blocks consecutive on both sides, any other row one per block.

Adjacent rows are fused when compiled: row i+1 starting, on both sides, where row i's bytes of the
same block end (equal strides) — the regions of consecutive layers (or K and V) laid out block by
block next to each other — becomes one row; when its bytes fill the stride on both sides, whole runs
of blocks of all those layers become one entry. (D's write guard merges the same regions, so such an
entry is inside D's registered KV.) Layouts without such neighbours give the same entries, in the
same order, as ``layouts.tp.tp_transfer_entries`` per KV cache group.

``PlanCache`` keeps compiled plans per (peer, spread), each checked against the very hello, region
table and rank spec it was built from (a peer that says hello again gets a new plan), at most
``PLAN_CACHE_SIZE`` of them, least recently used dropped first.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from pd_connector.layouts.kv_groups import GroupError
from pd_connector.layouts.regions import Region
from pd_connector.layouts.tp import HeadSlice, head_entries

__all__ = ["PLAN_CACHE_SIZE", "CompiledPlan", "PlanCache", "Rows", "compile_plan", "plan_entries", "run_arrays"]

#: Compiled plans kept per P rank at most (one per decode rank and spread it pushes to).
PLAN_CACHE_SIZE = 256

Entries = tuple[list[int], list[int], list[int]]


@dataclass(frozen=True)
class Rows:
    """One KV cache group's rows (arrays of equal length, in region then slice order)."""

    src: np.ndarray  # address of block 0's bytes on P
    dst: np.ndarray  # address of block 0's bytes on D
    src_stride: np.ndarray
    dst_stride: np.ndarray
    length: np.ndarray  # bytes per block
    dense: np.ndarray  # bool: a run of consecutive blocks is one piece on both sides

    def __len__(self) -> int:
        return len(self.src)


@dataclass(frozen=True)
class CompiledPlan:
    """The rows of every KV cache group (None: no region of this rank is in that group)."""

    groups: tuple[Rows | None, ...]
    #: Rows before fusing adjacent ones (a fused row counts all the rows it replaced).
    unfused_rows: int


def _row_tuples(
    src: Sequence[Region],
    dst: Sequence[Region],
    slices: Sequence[HeadSlice],
    src_heads: int,
    dst_heads: int,
    indices: Sequence[int],
) -> list[tuple[int, int, int, int, int, bool]]:
    """(src, dst, src stride, dst stride, length, dense) per (region pair, slice), as ``head_entries`` writes them."""
    rows = []
    for i in indices:
        s, d = src[i], dst[i]
        head_entries(s, d, slices, src_heads, dst_heads, (), region_index=i)  # its checks, MappingError
        hb = s.block_bytes // src_heads
        contiguous = s.blocks_contiguous and d.blocks_contiguous
        for sl in slices:
            whole = sl.num_heads == src_heads == dst_heads
            rows.append(
                (
                    s.base + sl.src_head * hb,
                    d.base + sl.dst_head * hb,
                    s.block_stride,
                    d.block_stride,
                    sl.num_heads * hb,
                    whole and contiguous,
                )
            )
    return rows


def _fuse(rows: list[tuple[int, int, int, int, int, bool]]) -> list[tuple[int, int, int, int, int, bool]]:
    """Consecutive rows whose bytes of a block continue each other on both sides, as one row."""
    out: list[tuple[int, int, int, int, int, bool]] = []
    for row in rows:
        if out:
            s, d, ss, ds, n, _ = out[-1]
            s2, d2, ss2, ds2, n2, _ = row
            if ss2 == ss and ds2 == ds and s2 == s + n and d2 == d + n and n + n2 <= min(ss, ds):
                fused = n + n2
                out[-1] = (s, d, ss, ds, fused, fused == ss == ds)
                continue
        out.append(row)
    return out


def compile_plan(
    owners: Sequence[int],
    src_regions: Sequence[Region],
    dst_regions: Sequence[Region],
    slices: Sequence[HeadSlice],
    src_heads: int,
    dst_heads: int,
    num_groups: int,
) -> CompiledPlan:
    """The rows of every group ``0 .. num_groups - 1``; GroupError / MappingError when the layouts do not
    pair up (the checks and messages of ``group_entries`` and ``head_entries``)."""
    if len(owners) != len(src_regions):
        raise GroupError(f"{len(owners)} region groups for {len(src_regions)} KV regions")
    if len(src_regions) != len(dst_regions):
        raise GroupError(f"KV region count differs: prefill has {len(src_regions)}, decode has {len(dst_regions)}")
    groups: list[Rows | None] = []
    unfused = 0
    for g in range(num_groups):
        indices = [i for i, owner in enumerate(owners) if owner == g]
        raw = _row_tuples(src_regions, dst_regions, slices, src_heads, dst_heads, indices)
        unfused += len(raw)
        rows = _fuse(raw)
        if not rows:
            groups.append(None)
            continue
        cols = list(zip(*rows, strict=True))
        groups.append(
            Rows(*(np.array(c, dtype=np.int64) for c in cols[:5]), dense=np.array(cols[5], dtype=bool))  # type: ignore[misc]
        )
    return CompiledPlan(tuple(groups), unfused)


def run_arrays(src_ids: Sequence[int], dst_ids: Sequence[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(src starts, dst starts, counts) of the runs of block ids consecutive on both sides (``block_runs``)."""
    s = np.asarray(src_ids, dtype=np.int64)
    d = np.asarray(dst_ids, dtype=np.int64)
    if len(s) != len(d):
        raise GroupError(f"{len(s)} source blocks for {len(d)} destination blocks")
    if not len(s):
        empty = np.zeros(0, dtype=np.int64)
        return empty, empty, empty
    breaks = (np.diff(s) != 1) | (np.diff(d) != 1)
    starts = np.flatnonzero(np.concatenate(([True], breaks)))
    counts = np.diff(np.append(starts, len(s)))
    return s[starts], d[starts], counts


def _segment(rows: Rows, lo: int, hi: int, runs: tuple[np.ndarray, ...], blocks: tuple[np.ndarray, ...]) -> tuple:
    """Entries of rows lo..hi-1, which are all dense or all not: row by row, each over runs or blocks."""
    sl = slice(lo, hi)
    src, dst, ss, ds, n = rows.src[sl], rows.dst[sl], rows.src_stride[sl], rows.dst_stride[sl], rows.length[sl]
    if rows.dense[lo]:
        s0, d0, count = runs
        length = n[:, None] * count[None, :]
    else:
        s0, d0 = blocks
        length = np.broadcast_to(n[:, None], (hi - lo, len(s0)))
    return (
        (src[:, None] + s0[None, :] * ss[:, None]).ravel(),
        (dst[:, None] + d0[None, :] * ds[:, None]).ravel(),
        length.ravel(),
    )


def plan_entries(plan: CompiledPlan, pairs: Sequence[tuple[Sequence[int], Sequence[int]]]) -> Entries:
    """(src, dst, lengths) of a request: every group's (P blocks, D blocks) over that group's rows."""
    parts: list[tuple] = []
    for g, (s_ids, d_ids) in enumerate(pairs):
        rows = plan.groups[g] if g < len(plan.groups) else None  # a group without regions here writes nothing
        if rows is None or not len(s_ids):
            continue
        blocks = (np.asarray(s_ids, dtype=np.int64), np.asarray(d_ids, dtype=np.int64))
        runs = run_arrays(*blocks)
        edges = np.flatnonzero(np.diff(rows.dense.astype(np.int8))) + 1
        bounds = [0, *edges.tolist(), len(rows)]
        parts += [_segment(rows, lo, hi, runs, blocks) for lo, hi in zip(bounds, bounds[1:], strict=False)]
    if not parts:
        return [], [], []
    return tuple(np.concatenate([p[k] for p in parts]).tolist() for k in range(3))  # type: ignore[return-value]


@dataclass(frozen=True)
class _Cached:
    peer: object
    regions: object
    spec: object
    plan: CompiledPlan


class PlanCache:
    """Compiled plans of one P rank by (peer id, spread), each valid for the objects it was built from."""

    def __init__(self, size: int = PLAN_CACHE_SIZE) -> None:
        if size < 1:
            raise ValueError(f"plan cache size must be >= 1, got {size}")
        self._size = size
        self._lock = threading.Lock()
        self._plans: OrderedDict[tuple[str, int], _Cached] = OrderedDict()
        self.compiled = 0  # plans built (misses)

    def get(self, key: tuple[str, int], peer: object, regions: object, spec: object) -> CompiledPlan | None:
        with self._lock:
            hit = self._plans.get(key)
            if hit is None or hit.peer is not peer or hit.regions is not regions or hit.spec is not spec:
                return None
            self._plans.move_to_end(key)
            return hit.plan

    def put(self, key: tuple[str, int], peer: object, regions: object, spec: object, plan: CompiledPlan) -> None:
        with self._lock:
            self.compiled += 1
            self._plans[key] = _Cached(peer, regions, spec, plan)
            self._plans.move_to_end(key)
            while len(self._plans) > self._size:
                self._plans.popitem(last=False)

    def __len__(self) -> int:
        with self._lock:
            return len(self._plans)
