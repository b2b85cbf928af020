"""Two KV cache groups (vLLM's hybrid KV cache manager, SupportsHMA) between a P and a D rank in this
process: real ZMQ, a real bootstrap server, real Mooncake TCP, KV allocated as vLLM-Ascend allocates it
((k, v) per layer, [num_blocks, block_size, kv_heads, head_dim], 2 MiB-aligned slices).

Layers 0 and 2 are full attention (group 0), 1 and 3 sliding window (group 1); each group has its own
block table, and the sliding group's table starts with vLLM's null block (id 0) for the blocks that
fell out of the window. Two allocations: ``shared`` as vLLM's hybrid allocator does it (one buffer per
layer pair, shared by a full and a sliding layer: the groups' blocks are disjoint ids of one pool) and
``separate`` (one buffer per layer). After the push every D block of a group holds P's block of that
group, byte for byte, in that group's layers only; no other D block changed (the null block neither).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest
import torch
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    SlidingWindowSpec,
)

from pd_connector.bootstrap.client import register_rank
from pd_connector.bootstrap.server import BootstrapServer, BootstrapState
from pd_connector.config import parse_config
from pd_connector.layouts.kv_groups import region_groups
from pd_connector.layouts.regions import memory_ranges, regions_of_kv_caches
from pd_connector.messages import RegisterRank
from pd_connector.metadata import RecvJob, SendJob
from pd_connector.transfer.manager import KVTransferManager, RankSpec
from pd_connector.transfer.registry import create_backend
from tests.support.ascend_kv import ascend_tensor
from tests.support.loopback import HOST, free_port, wait_for
from tests.support.nhd_mixed_tp import CountingBackend

NB, BS, HEADS, HD, LAYERS, WINDOW = 16, 16, 2, 8, 4, 20
DTYPE = torch.float16
NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
FULL, SLIDING = NAMES[0::2], NAMES[1::2]
PROMPT = 4 * BS  # 4 blocks; the window keeps tokens 45.. -> sliding blocks 0 and 1 are null
P_TABLES = ([1, 2, 3, 4], [0, 0, 5, 6])
D_TABLES = ([7, 8, 9, 10], [0, 0, 11, 12])


def kv_cache_config() -> KVCacheConfig:
    """The two groups vLLM's hybrid manager makes of this model (full + sliding window).

    Its kv_cache_tensors (how the buffers are shared) differ between vLLM lines and are not read here.
    """
    full = FullAttentionSpec(block_size=BS, num_kv_heads=HEADS, head_size=HD, dtype=DTYPE)
    sliding = SlidingWindowSpec(block_size=BS, num_kv_heads=HEADS, head_size=HD, dtype=DTYPE, sliding_window=WINDOW)
    groups = [KVCacheGroupSpec(FULL, full), KVCacheGroupSpec(SLIDING, sliding)]
    return KVCacheConfig(num_blocks=NB, kv_cache_tensors=[], kv_cache_groups=groups)


def make_kv(shared: bool, seed: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Per layer (k, v); with ``shared`` a full and a sliding layer use the same two buffers."""
    g = torch.Generator().manual_seed(seed)

    def pair() -> tuple[torch.Tensor, torch.Tensor]:
        out = tuple(ascend_tensor((NB, BS, HEADS, HD), DTYPE) for _ in range(2))
        for t in out:
            t.copy_(torch.randint(-3000, 3000, t.shape, generator=g) if seed else torch.full(t.shape, -7.0))
        return out  # type: ignore[return-value]

    kv: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for f, s in zip(FULL, SLIDING, strict=True):
        kv[f] = pair()
        kv[s] = kv[f] if shared else pair()
    return {name: kv[name] for name in NAMES}  # vLLM's layer order


@dataclass
class Engines:
    """One Mooncake TCP backend per side, shared by the cases (destroying one takes about a second)."""

    backends: dict[str, CountingBackend] = field(default_factory=dict)
    keep: list[object] = field(default_factory=list)  # registered KV stays alive until the end

    def get(self, side: str) -> CountingBackend:
        if side not in self.backends:
            role = "kv_producer" if side == "p" else "kv_consumer"
            cfg = parse_config(role, {"local_ip": HOST, "backend": "mooncake", "protocol": "tcp"})
            self.backends[side] = CountingBackend(create_backend(cfg))
        backend = self.backends[side]
        backend.lengths.clear()
        return backend


@pytest.fixture(scope="module")
def engines() -> Iterator[Engines]:
    e = Engines()
    try:
        yield e
    finally:
        for b in e.backends.values():
            b.close()


@dataclass
class Pair:
    p: KVTransferManager
    d: KVTransferManager
    p_kv: dict
    d_kv: dict
    port: int


@pytest.fixture
def pair_factory(engines: Engines) -> Iterator:
    made: list[tuple[BootstrapServer, list[KVTransferManager]]] = []

    def make(shared: bool, d_grouped: bool = True) -> Pair:
        server = BootstrapServer(BootstrapState(attn_tp_size=1, attn_dp_size=1), HOST, free_port())
        server.start()
        mgrs: list[KVTransferManager] = []
        made.append((server, mgrs))
        kvs = {"p": make_kv(shared, seed=11), "d": make_kv(shared, seed=0)}
        config = kv_cache_config()
        for side in ("p", "d"):
            kv, backend = kvs[side], engines.get(side)
            backend.register(memory_ranges(kv))
            engines.keep.append(kv)
            role = "kv_producer" if side == "p" else "kv_consumer"
            extra = {"local_ip": HOST, "bootstrap_port": server.port, "http_timeout_s": 2.0}
            cfg = parse_config(role, {**extra, "kv_wait_timeout_s": 30.0, "room_timeout_s": 30.0})
            groups = region_groups(kv, config, NB) if side == "p" or d_grouped else ()
            spec = RankSpec(
                tp_rank=0, tp_size=1, dp_rank=0, dp_size=1, block_size=BS, kv_dtype="float16", num_layers=LAYERS,
                total_kv_heads=HEADS, local_kv_heads=HEADS, heads_outermost=False, region_groups=groups,
            )  # fmt: skip
            mgrs.append(KVTransferManager(cfg, spec, regions_of_kv_caches(kv, NB), backend))
        p, d = mgrs
        info = RegisterRank(1, 0, 1, 0, HOST, p.rank_port, BS, "float16", num_layers=LAYERS)
        assert register_rank(f"{HOST}:{server.port}", info, retries=3, interval_s=0.05, timeout_s=5)
        return Pair(p, d, kvs["p"], kvs["d"], server.port)

    try:
        yield make
    finally:
        for server, mgrs in made:
            for m in mgrs:
                m.close()
                m.pool.shutdown(wait=True)
            server.stop()


def send_job(room: int, tables: tuple[list[int], list[int]] = P_TABLES) -> SendJob:
    return SendJob("p-req", room, list(tables[0]), PROMPT, group_block_ids=[list(t) for t in tables])


def recv_job(pair: Pair, room: int, tables: tuple[list[int], ...], start_block: int = 0) -> RecvJob:
    return RecvJob(
        "d-req", room, HOST, pair.port, None, list(tables[0]), start_block, PROMPT,
        dst_group_block_ids=[list(t) for t in tables],
    )  # fmt: skip


def finish(pair: Pair) -> tuple[set[str], dict[str, list[int]]]:
    """Wait until D's load ended and P freed the room; (D received, D failed -> blocks)."""
    got: dict = {"recv": set(), "failed": {}, "sent": set()}

    def d_done() -> bool:
        _, recving, failed = pair.d.take_finished()
        got["recv"] |= recving
        got["failed"].update(failed)
        return "d-req" in got["recv"]

    wait_for(d_done, 20, what="D's load to end")
    wait_for(lambda: got["sent"].update(pair.p.take_finished()[0]) or "p-req" in got["sent"], 10, what="P freed")
    return got["recv"], got["failed"]


def expected_d(pair: Pair, d_before: dict, src: tuple[list[int], ...], dst: tuple[list[int], ...]) -> dict:
    """D's KV as it must be after the push, per D buffer (data_ptr; shared buffers once): per group,
    P's real blocks copied into D's, through that group's layers only."""
    want = {}
    for name, parts in pair.d_kv.items():
        for part in range(2):
            want.setdefault(parts[part].data_ptr(), d_before[name][part].clone())
    for names, s_ids, d_ids in ((FULL, src[0], dst[0]), (SLIDING, src[1], dst[1])):
        for s, d in zip(s_ids, d_ids, strict=True):
            if d == 0:
                continue
            for name in names:
                for part in range(2):
                    want[pair.d_kv[name][part].data_ptr()][d] = pair.p_kv[name][part][s]
    return want


def clone(kv: dict) -> dict:
    return {name: tuple(t.clone() for t in p) for name, p in kv.items()}


@pytest.mark.parametrize("shared", [True, False], ids=["shared-buffers", "separate-buffers"])
@pytest.mark.parametrize("start_block", [0, 1], ids=["no-local-hit", "one-block-local-hit"])
def test_two_kv_cache_groups_move_byte_exact(pair_factory, engines: Engines, shared: bool, start_block: int) -> None:
    pair = pair_factory(shared)
    before = clone(pair.d_kv)
    room = 7100 + 10 * shared + start_block
    dst = tuple(t[start_block:] for t in D_TABLES)
    pair.p.add_sends([send_job(room)])
    pair.d.add_recvs([recv_job(pair, room, dst, start_block)])
    recv, failed = finish(pair)
    assert recv == {"d-req"} and failed == {}
    src = tuple(t[start_block:] for t in P_TABLES)
    want = expected_d(pair, before, src, dst)
    for name in NAMES:
        for part in range(2):
            got = pair.d_kv[name][part]
            exp = want[got.data_ptr()]
            assert torch.equal(got.view(torch.int16), exp.view(torch.int16)), (name, part)
            assert bool((got[0] == -7.0).all()), "the null block was written"
    # Entries: one run per group (full 4 or 3 blocks, sliding 2 blocks), each over its group's 2 layers x (k, v).
    lengths = engines.backends["p"].lengths
    block_bytes = BS * HEADS * HD * 2
    assert len(lengths) == 2 * 2 * 2, lengths
    moved_blocks = len(dst[0]) + sum(1 for b in dst[1] if b)
    assert sum(lengths) == moved_blocks * 2 * 2 * block_bytes
    stats = pair.d.stats.snapshot()
    assert stats.recvs_ok == 1 and stats.bytes_received == moved_blocks * 2 * 2 * block_bytes


def test_a_block_prefill_dropped_out_of_its_window_fails_the_load(pair_factory) -> None:
    pair = pair_factory(shared=False)
    before = clone(pair.d_kv)
    # P's window already dropped block 2 of the sliding group, D's window still needs it.
    pair.p.add_sends([send_job(7200, ([1, 2, 3, 4], [0, 0, 0, 6]))])
    pair.d.add_recvs([recv_job(pair, 7200, D_TABLES)])
    recv, failed = finish(pair)
    assert recv == {"d-req"} and sorted(failed["d-req"]) == [7, 8, 9, 10, 11, 12]  # D's real blocks, no null
    for name in NAMES:
        for part in range(2):
            assert torch.equal(pair.d_kv[name][part], before[name][part]), "nothing may land on a refused request"


def test_decode_without_the_groups_is_refused(pair_factory, pd_logs: pytest.LogCaptureFixture) -> None:
    pair = pair_factory(shared=False, d_grouped=False)  # D started with the hybrid manager off
    pair.p.add_sends([send_job(7300)])
    pair.d.add_recvs([recv_job(pair, 7300, D_TABLES)])
    _, failed = finish(pair)
    assert "d-req" in failed
    assert "KV cache groups differ" in pd_logs.text and "--disable-hybrid-kv-cache-manager" in pd_logs.text
