"""transfer.write_guard: P writes only inside the KV blocks a decode rank registered.

Pure checks of the guard on real region tables (vLLM CPU layout, interleaved K/V, head slices),
then on real managers (in-process and Mooncake TCP): a request for a block past D's cache is
refused before any byte moves, and D refuses to ask for blocks outside its own cache.
"""

from __future__ import annotations

import logging

import msgspec
import pytest
import torch

from pd_connector import messages as proto
from pd_connector.layouts.regions import LayoutError, Region, regions_of_kv_caches
from pd_connector.metadata import SendJob
from pd_connector.transfer.write_guard import WriteGuard, WriteTargetError, check_own_blocks, request_blocks
from tests.support.transfer_rig import BOTH_BACKENDS, NUM_BLOCKS, Rig, recv_job, snapshot

NB = 8


def cpu_layout_regions() -> list[Region]:
    """vLLM CPU: [num_blocks, heads, block_size, 2*head_dim] per layer: one dense region per layer."""
    kv = {f"l{i}": torch.zeros(NB, 2, 4, 8, dtype=torch.float16) for i in range(3)}
    return regions_of_kv_caches(kv, NB)


def interleaved_regions() -> list[Region]:
    """K and V views of one [num_blocks, 3, heads, block_size, head_dim] buffer (parts 0 and 2; part 1 is
    not KV): regions interleaved block by block. (K and V right next to each other are one region to the
    guard, ``regions.fuse_adjacent``: tests/unit/test_plan_cache.py.)"""
    buf = torch.zeros(NB, 3, 2, 4, 8, dtype=torch.float16)
    regions = regions_of_kv_caches({"l0": (buf[:, 0], buf[:, 2])}, NB)
    assert len(regions) == 2 and not regions[0].blocks_contiguous
    return regions


def every_block(regions: list[Region], blocks: range) -> tuple[list[int], list[int]]:
    dst = [r.base + b * r.block_stride for r in regions for b in blocks]
    return dst, [r.block_bytes for r in regions for _ in blocks]


@pytest.mark.parametrize("layout", [cpu_layout_regions, interleaved_regions])
def test_every_block_and_part_of_a_block_is_allowed(layout) -> None:
    regions = layout()
    guard = WriteGuard(regions, NB, "d0")
    guard.check(*every_block(regions, range(NB)))
    # Head slices: the second half of each block (one head of two).
    dst = [r.base + b * r.block_stride + r.block_bytes // 2 for r in regions for b in range(NB)]
    guard.check(dst, [r.block_bytes // 2 for r in regions for _ in range(NB)])
    guard.check([], [])


def test_a_run_of_blocks_is_one_entry_only_where_blocks_are_dense() -> None:
    dense = cpu_layout_regions()[1]
    WriteGuard([dense], NB, "d0").check([dense.base + 2 * dense.block_stride], [5 * dense.block_bytes])
    k, v = interleaved_regions()
    with pytest.raises(WriteTargetError):  # two K blocks in one entry would write the bytes between them
        WriteGuard([k, v], NB, "d0").check([k.base], [2 * k.block_bytes])


@pytest.mark.parametrize(
    ("where", "what"),
    [
        (lambda r: (r.base + NB * r.block_stride, r.block_bytes), "the block after the last"),
        (lambda r: (r.base + (NB - 1) * r.block_stride, 2 * r.block_bytes), "a run past the last block"),
        (lambda r: (r.base - 64, 64), "below the first region"),
        (lambda r: (r.base, 0), "an empty entry"),
        (lambda r: (r.base, -8), "a negative length"),
    ],
)
def test_writes_outside_the_registered_blocks_are_refused(where, what) -> None:
    regions = cpu_layout_regions()
    last = max(regions, key=lambda r: r.base)
    dst, lengths = every_block(regions, range(NB))
    addr, length = where(last)
    with pytest.raises(WriteTargetError, match=r"outside the KV blocks decode d7 registered") as exc:
        WriteGuard(regions, NB, "d7").check([*dst, addr], [*lengths, length])
    assert f"entry {len(dst)} of {len(dst) + 1}" in str(exc.value), what


def test_interleaved_regions_refuse_the_other_regions_bytes_only_when_outside_all() -> None:
    k, v = interleaved_regions()
    guard = WriteGuard([k, v], NB, "d0")
    guard.check([v.base + 3 * v.block_stride], [v.block_bytes])  # V's block 3 sits between K's 3 and 4
    with pytest.raises(WriteTargetError):  # straddles K's block 3 and the bytes after it
        guard.check([k.base + 3 * k.block_stride + 8], [k.block_bytes])
    with pytest.raises(WriteTargetError):  # V's block NB: past the tensor
        guard.check([v.base + NB * v.block_stride], [v.block_bytes])


def test_an_unknown_block_count_bounds_nothing_but_keeps_the_block_shape() -> None:
    k, v = interleaved_regions()
    guard = WriteGuard([k, v], 0, "old-d")
    guard.check([v.base + 100 * v.block_stride], [v.block_bytes])
    with pytest.raises(WriteTargetError):
        guard.check([k.base + 100 * k.block_stride + 8], [k.block_bytes])


def test_block_ids_are_checked_against_the_peer_and_own_cache() -> None:
    guard = WriteGuard(cpu_layout_regions(), NB, "d3")
    guard.check_blocks([0, NB - 1])
    with pytest.raises(WriteTargetError, match=rf"decode d3's block id {NB} is past its {NB} KV blocks"):
        guard.check_blocks([1, NB])
    with pytest.raises(WriteTargetError, match="block id -1 is negative"):
        guard.check_blocks([-1])
    WriteGuard(cpu_layout_regions(), 0, "old-d").check_blocks([10**6])
    check_own_blocks([0, NB - 1], NB)
    with pytest.raises(LayoutError, match=rf"refusing to ask prefill for this load: decode block id {NB + 5}"):
        check_own_blocks([2, NB + 5], NB)


def test_request_blocks_include_every_group() -> None:
    req = proto.TransferRequest(1, "r", "p", [3, 4], 0, dst_groups=[[3, 4], [0, 9]])
    assert request_blocks(req) == [3, 4, 3, 4, 0, 9]


def test_messages_without_the_new_fields_still_decode() -> None:
    """A PeerHello / TransferRequest / TransferDone of a peer that predates num_blocks, want_checksum, nbytes."""

    class OldHello(msgspec.Struct, tag="hello"):
        peer_id: str
        transfer_descriptor: bytes
        endpoint: str
        tp_rank: int
        tp_size: int
        block_size: int
        kv_dtype: str
        num_layers: int
        regions: list[tuple[int, int, int]]

    class OldDone(msgspec.Struct, tag="done"):
        room: int
        request_id: str
        tp_rank: int
        status: int

    hello = proto.decode(msgspec.msgpack.encode(OldHello("d", b"x", "tcp://h:1", 0, 1, 16, "float16", 2, [(1, 2, 2)])))
    assert isinstance(hello, proto.PeerHello) and hello.num_blocks == 0
    done = proto.decode(msgspec.msgpack.encode(OldDone(5, "r", 0, 0)))
    assert isinstance(done, proto.TransferDone) and (done.nbytes, done.checksum) == (-1, None)
    assert not proto.TransferRequest(1, "r", "p", [], 0).want_checksum


# ------------------------------------------------------------ real managers


@BOTH_BACKENDS
def test_prefill_refuses_a_block_past_the_decode_cache_and_writes_nothing(rig: Rig, pd_logs) -> None:
    p = rig.make("prefill", seed=4)
    d = rig.make("decode")
    src = [1, 2, 3]
    p.mgr.add_sends([SendJob("p-ok", 401, src, 3 * 16)])
    d.mgr.add_recvs([recv_job(rig, "d-ok", 401, [4, 5, 6])])  # a real load first: D's hello reaches P
    d.wait_recv("d-ok")
    p.wait_sent("p-ok")
    assert d.failed == {}
    before = snapshot(d.kv)
    p.mgr.add_sends([SendJob("p-bad", 402, src, 3 * 16)])
    # What a broken or hostile decode could send: block ids past its cache (bypassing D's own check).
    bad = proto.TransferRequest(402, "d-bad", d.mgr.peer_id, [7, NUM_BLOCKS + 2, 8], 0, endpoint=d.mgr.endpoint)
    d.mgr.channel.send(p.mgr.endpoint, bad)
    p.wait_sent("p-bad")  # the room is freed: its only request was answered
    assert p.stats().transfers_failed == 1
    for name in d.kv:
        assert torch.equal(d.kv[name].view(torch.int16), before[name].view(torch.int16)), "a byte was written"
    lines = [r.getMessage() for r in pd_logs.records if r.levelno >= logging.ERROR]
    assert any(
        "room=402 req=p-bad" in line
        and d.mgr.peer_id in line
        and "BAD_REQUEST" in line
        and f"block id {NUM_BLOCKS + 2} is past its {NUM_BLOCKS} KV blocks" in line
        for line in lines
    ), lines


def test_decode_refuses_to_ask_for_blocks_outside_its_cache(rig: Rig, pd_logs) -> None:
    p = rig.make("prefill", seed=5)
    d = rig.make("decode")
    p.mgr.add_sends([SendJob("p-req", 403, [1, 2], 2 * 16)])
    d.mgr.add_recvs([recv_job(rig, "d-req", 403, [3, NUM_BLOCKS])])
    d.wait_recv("d-req")
    assert d.failed == {"d-req": [3, NUM_BLOCKS]}
    assert p.stats().transfers_ok == p.stats().transfers_failed == 0  # P was never asked
    assert any(
        "room=403 req=d-req" in r.getMessage() and f"decode block id {NUM_BLOCKS} is past" in r.getMessage()
        for r in pd_logs.records
    )
