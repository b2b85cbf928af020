"""verify_kv (transfer.checksum): P's checksum of what it wrote against D's of what landed.

The checksum itself (against a byte-by-byte definition: independent of how the bytes are cut and
ordered, additive over P ranks, sensitive to any changed byte), D's byte accounting, and real
managers (in-process and Mooncake TCP): a transfer that lands passes; a P whose writes never land
but which reports them done fails the load with verify_kv (its blocks come back as failed); a
"done" that does not say what was written fails the load even without verify_kv.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

import pytest
import torch
import zmq

from pd_connector import messages as proto
from pd_connector.layouts.regions import Region
from pd_connector.metadata import SendJob
from pd_connector.transfer.checksum import (
    MASK64,
    HostMemoryReader,
    _weight,
    combine,
    digest,
    load_problem,
    load_ranges,
    merge_ranges,
)
from pd_connector.transfer.states import RoomState
from tests.support.loopback import wait_for
from tests.support.transfer_rig import BLOCK_SIZE, BOTH_BACKENDS, LAYERS, Rig, recv_job


def bytewise(data: torch.Tensor, addr: int) -> int:
    """The definition: byte v at address a adds weight(a & ~7) * ((v + 1) << 8 * (a & 7))."""
    terms = (_weight((addr + i) & ~7) * ((v + 1) << (8 * ((addr + i) & 7))) for i, v in enumerate(data.tolist()))
    return sum(terms) & MASK64


def test_digest_is_the_bytewise_sum_however_the_bytes_are_cut() -> None:
    rnd = random.Random(7)
    for _ in range(40):
        n = rnd.randint(0, 300)
        addr = rnd.randint(0, 1 << 44)
        data = torch.randint(0, 256, (n,), dtype=torch.uint8)
        want = bytewise(data, addr)
        assert digest(data, addr) == want, (n, addr)
        cuts = sorted(rnd.sample(range(n + 1), min(3, n + 1)))
        pieces = [(a, b) for a, b in zip([0, *cuts], [*cuts, n], strict=True)]
        rnd.shuffle(pieces)  # any order, any cut
        assert combine(digest(data[a:b], addr + a) for a, b in pieces) == want


def test_digest_reads_unaligned_sources_and_sees_every_byte() -> None:
    buf = torch.randint(0, 256, (4099,), dtype=torch.uint8)
    addr = 0x7F00_0000_1000
    base = digest(buf[3:], addr)  # a source 3 bytes off the destination's alignment
    assert base == bytewise(buf[3:], addr)
    for i in (0, 1, 7, 8, 2000, 4095):
        changed = buf[3:].clone()
        changed[i] ^= 0x80
        assert digest(changed, addr) != base, i
    swapped = buf[3:].clone()
    swapped[[16, 24]] = swapped[[24, 16]]
    if swapped[16] != swapped[24]:
        assert digest(swapped, addr) != base
    assert digest(buf[3:], addr + 8) != base  # the same bytes at another address
    zeros = torch.zeros(4096, dtype=torch.uint8)
    assert digest(zeros, addr) not in (0, digest(zeros[:4088], addr))  # zeroed memory: not 0, and covered bytes count


def test_host_reader_sees_the_tensor_bytes() -> None:
    t = torch.arange(64, dtype=torch.int16)
    got = HostMemoryReader().read(t.data_ptr() + 2, 10)
    assert got.tolist() == list(t.view(torch.uint8)[2:12].tolist())


def test_load_ranges_cover_each_real_block_of_its_group() -> None:
    regions = [Region(1000, 100, 100), Region(5000, 200, 50), Region(9000, 100, 100)]
    assert load_ranges(regions[:1], [[0, 4]]) == [(1000, 100), (1400, 100)]  # one group: every block listed
    # Groups: regions 0 and 2 in group 0, region 1 in group 1; the null block (0) is skipped.
    got = load_ranges(regions, [[2, 0], [0, 5]], (0, 1, 0))
    assert got == [(1200, 100), (6000, 50), (9200, 100)]
    assert merge_ranges([(1400, 100), (1300, 100), (50, 10)]) == [(50, 10), (1300, 200)]


def test_load_problem_checks_bytes_always_and_the_checksum_with_a_reader() -> None:
    data = torch.randint(0, 256, (256,), dtype=torch.uint8)
    addr = data.data_ptr()
    ranges = [(addr, 128), (addr + 128, 128)]
    reader = HostMemoryReader()
    half = [digest(data[:100], addr), digest(data[100:], addr + 100)]  # two P ranks, cut anywhere
    assert load_problem(ranges, [(0, 100, half[0]), (1, 156, half[1])], reader) is None
    assert load_problem(ranges, [(0, 100, None), (1, 156, None)], None) is None  # no verify_kv
    assert "without saying how many bytes" in str(load_problem(ranges, [(0, -1, None)], None))
    assert "prefill wrote 200 bytes (tp=0: 200) but the load's blocks hold 256" in str(
        load_problem(ranges, [(0, 200, None)], None)
    )
    assert "tp=[1] sent no checksum" in str(load_problem(ranges, [(0, 100, half[0]), (1, 156, None)], reader))
    wrong = load_problem(ranges, [(0, 100, half[0]), (1, 156, half[1] ^ 1)], reader)
    assert wrong is not None and "checksum mismatch over 256 bytes" in wrong


# ------------------------------------------------------------ real managers


class LostWrites:
    """A P backend whose writes report success but move nothing (the bytes never land)."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self.calls = 0

    @property
    def descriptor(self) -> bytes:
        return self._inner.descriptor

    def register(self, ranges: Sequence[tuple[int, int]]) -> None:
        self._inner.register(ranges)

    def write(self, peer: bytes, src: Any, dst: Any, lengths: Any, max_batch: int, still_wanted: Any = None) -> None:
        self.calls += 1

    def close(self) -> None:
        self._inner.close()


@BOTH_BACKENDS
def test_a_landed_transfer_passes_verify_kv(rig: Rig) -> None:
    p = rig.make("prefill", seed=11)
    d = rig.make("decode", verify_kv=True)
    src, dst = [1, 2, 3, 9, 10], [4, 5, 6, 12, 13]
    p.mgr.add_sends([SendJob("p-req", 501, src, BLOCK_SIZE * len(src))])
    d.mgr.add_recvs([recv_job(rig, "d-req", 501, dst)])
    d.wait_recv("d-req")
    p.wait_sent("p-req")
    assert d.failed == {} and d.stats().recvs_ok == 1
    for name in p.kv:
        assert torch.equal(d.kv[name][dst].view(torch.int16), p.kv[name][src].view(torch.int16))


@BOTH_BACKENDS
def test_writes_that_never_landed_fail_the_load_with_verify_kv(rig: Rig, pd_logs) -> None:
    p = rig.make("prefill", seed=12)
    d = rig.make("decode", verify_kv=True)
    assert p.mgr.prefill is not None
    lost = p.mgr.prefill._backend = LostWrites(p.mgr.prefill._backend)
    dst = [4, 5, 6]
    p.mgr.add_sends([SendJob("p-req", 502, [1, 2, 3], 3 * BLOCK_SIZE)])
    d.mgr.add_recvs([recv_job(rig, "d-req", 502, dst)])
    d.wait_recv("d-req")
    p.wait_sent("p-req")  # P thinks it pushed (its backend said so) and frees its blocks
    assert lost.calls == 1 and p.stats().transfers_ok == 1
    assert d.failed == {"d-req": dst}  # vLLM gets the blocks as failed: never cached
    expected = len(dst) * LAYERS * d.mgr.regions[0].block_bytes
    assert any(
        "room=502 req=d-req: KV load failed: verify_kv: checksum mismatch" in r.getMessage()
        and f"over {expected} bytes" in r.getMessage()
        for r in pd_logs.records
    )
    assert d.stats().recvs_failed == 1


def test_a_done_that_does_not_say_what_it_wrote_fails_even_without_verify_kv(rig: Rig, pd_logs) -> None:
    """A peer that answers OK for a room P never prefilled (no write, no byte count): D refuses it."""
    p = rig.make("prefill", seed=13)
    d = rig.make("decode")
    assert not d.mgr.cfg.verify_kv
    d.mgr.add_recvs([recv_job(rig, "d-req", 503, [4, 5])])
    wait_for(lambda: p.room_state(503) is RoomState.AWAITING_PREFILL, what="P to hold D's request")
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PUSH)
    try:
        sock.connect(d.mgr.endpoint)
        fake = proto.TransferDone(room=503, request_id="d-req", tp_rank=0, status=proto.DoneStatus.OK)
        sock.send(proto.encode(fake))  # no token: frames are bare payloads
        d.wait_recv("d-req")
    finally:
        sock.close(linger=0)
        ctx.term()
    assert d.failed == {"d-req": [4, 5]}
    assert any(
        "room=503 req=d-req: KV load failed" in r.getMessage() and "without saying how many bytes" in r.getMessage()
        for r in pd_logs.records
    )


@pytest.mark.parametrize("verify", [False, True])
def test_a_decode_that_needs_nothing_accepts_zero_bytes(rig: Rig, verify: bool) -> None:
    p = rig.make("prefill", seed=14)
    d = rig.make("decode", verify_kv=verify)
    p.mgr.add_sends([SendJob("p-req", 504, [1, 2], 2 * BLOCK_SIZE)])
    d.mgr.add_recvs([recv_job(rig, "d-req", 504, [], start_block=2)])  # a full local prefix hit
    d.wait_recv("d-req")
    p.wait_sent("p-req")
    assert d.failed == {}


# ------------------------------------------------------------ vLLM's prefix cache


def test_blocks_of_a_failed_load_never_enter_the_prefix_cache(tiny_model) -> None:
    """Real Scheduler (both vLLM lines), prefix caching on: a failed load (as verify_kv reports one) leaves
    nothing cached, so the same prompt loads every block again; a load that landed is cached."""
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

    from pd_connector.kv_params import DecodeParams
    from tests.support.real_scheduler import BLOCK, failed_load, make_scheduler, request, step

    def params(room: int) -> dict[str, Any]:
        return DecodeParams(room=room, bootstrap_host="127.0.0.1", bootstrap_port=18800, prefill_dp_rank=0).to_json()

    sched = make_scheduler(tiny_model, "kv_consumer", policy="fail", prefix_caching=True)
    init_none_hash(sha256)
    hasher = get_request_block_hasher(BLOCK, sha256)

    def load_of(rid: str, room: int) -> Any:
        req = request(rid, params(room))
        req = Request(rid, list(req.prompt_token_ids or []), req.sampling_params, None, block_hasher=hasher)
        if getattr(req, "kv_transfer_params", None) is None:
            req.kv_transfer_params = params(room)
        sched.add_request(req)
        _, meta, _ = step(sched)
        (job,) = meta.recvs
        return job

    bad = load_of("bad", 1)
    assert (bad.start_block, len(bad.dst_block_ids)) == (0, 4)
    step(sched, failed_load("bad", bad.dst_block_ids))
    step(sched)
    assert "bad" not in sched.requests or sched.requests["bad"].is_finished()
    again = load_of("again", 2)
    assert (again.start_block, len(again.dst_block_ids)) == (0, 4), "the failed load's blocks were cached"
    step(sched, KVConnectorOutput(finished_recving={"again"}))  # this one lands
    step(sched)
    probe = load_of("probe", 3)
    assert probe.start_block == 3, f"a landed load is cached (3 full blocks); got {probe}"


# ------------------------------------------------------------ what P ranks write covers the load


@pytest.mark.parametrize(
    ("heads", "p_tp", "d_tp", "mla"),
    [(4, 1, 1, False), (4, 1, 2, False), (4, 2, 1, False), (4, 4, 2, False), (2, 4, 1, False), (2, 1, 4, False),
     (2, 4, 2, False), (8, 2, 4, False), (1, 2, 1, True), (1, 1, 2, True), (1, 4, 2, True)],
)  # fmt: skip
def test_p_ranks_write_each_byte_of_the_load_once(heads: int, p_tp: int, d_tp: int, mla: bool) -> None:
    """Head-major KV, any TP pairing: the ranges D's P ranks write are disjoint and are exactly the load's
    blocks in every region (what D's byte count and checksum are computed over)."""
    from pd_connector.layouts.tp import decode_contacts, local_heads
    from pd_connector.transfer.context import RankSpec
    from pd_connector.transfer.write_plans import push_entries

    layers, nb, head_bytes = 2, 16, BLOCK_SIZE * 2 * 8 * 2  # [blocks, heads, block_size, 2 * head_dim] fp16

    def regions(side: int, rank: int, local: int) -> list[Region]:
        return [
            Region((side << 40) + (rank << 36) + (layer << 32), local * head_bytes, local * head_bytes)
            for layer in range(layers)
        ]

    def spec(rank: int, tp: int) -> RankSpec:
        local = 1 if mla else len(local_heads(heads, tp, rank))
        return RankSpec(rank, tp, 0, 1, BLOCK_SIZE, "float16", layers, heads, local, mla, num_blocks=nb)

    room, src, dst = 7, [1, 2, 3, 9], [4, 5, 11, 12]
    job = SendJob("p", room, src, len(src) * BLOCK_SIZE)
    for d in range(d_tp):
        d_spec = spec(d, d_tp)
        d_regions = regions(2, d, d_spec.local_kv_heads)
        hello = proto.PeerHello(
            f"d{d}", b"", "tcp://h:1", d, d_tp, BLOCK_SIZE, "float16", layers,
            [r.as_tuple() for r in d_regions], heads, d_spec.local_kv_heads, mla, num_blocks=nb,
        )  # fmt: skip
        req = proto.TransferRequest(room, "r", f"d{d}", dst, 0)
        written: list[tuple[int, int]] = []
        for p in decode_contacts(1 if mla else heads, p_tp, d_tp, d, is_mla=mla, spread=room % p_tp):
            p_spec = spec(p, p_tp)
            plan = push_entries(p_spec, regions(1, p, p_spec.local_kv_heads), hello, job, req)
            if plan is not None:
                written += list(zip(plan[1], plan[2], strict=True))
        assert sum(n for _, n in written) == len(dst) * sum(r.block_bytes for r in d_regions)
        assert merge_ranges(written) == merge_ranges(load_ranges(d_regions, [dst]))
