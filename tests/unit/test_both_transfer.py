"""Two kv_both KVTransferManagers, each with its own bootstrap server, push KV to each other at once:
real ZMQ, real bootstrap servers, the in-process backend (the rig's engines: tests/support/transfer_rig.py)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from pd_connector.bootstrap.client import register_rank
from pd_connector.bootstrap.server import BootstrapServer
from pd_connector.config import parse_config
from pd_connector.layouts.regions import regions_of_kv_caches
from pd_connector.messages import RegisterRank
from pd_connector.metadata import RecvJob, SendJob
from pd_connector.transfer.backend import TransferBackend
from pd_connector.transfer.manager import KVTransferManager, RankSpec
from tests.support.loopback import HOST
from tests.support.transfer_rig import (
    BLOCK_SIZE,
    DTYPE,
    HEADS,
    LAYERS,
    NUM_BLOCKS,
    Engines,
    Side,
    snapshot,
    start_bootstrap,
)


def _both_side(server: BootstrapServer, engine: TransferBackend, kv: dict[str, torch.Tensor]) -> Side:
    """A kv_both rank: both sides on one manager, registered with its own bootstrap server."""
    cfg = parse_config("kv_both", {"local_ip": HOST, "bootstrap_port": server.port, "backend": "inproc"})
    spec = RankSpec(
        tp_rank=0, tp_size=1, dp_rank=0, dp_size=1, block_size=BLOCK_SIZE, kv_dtype=DTYPE, num_layers=LAYERS,
        num_blocks=NUM_BLOCKS,
    )  # fmt: skip
    mgr = KVTransferManager(cfg, spec, regions_of_kv_caches(kv, NUM_BLOCKS), engine)
    assert mgr.prefill is not None and mgr.decode is not None
    info = RegisterRank(1, 0, 1, 0, HOST, mgr.rank_port, BLOCK_SIZE, DTYPE, num_layers=LAYERS)
    assert register_rank(f"{HOST}:{server.port}", info, retries=3, interval_s=0.05, timeout_s=5)
    return Side(mgr, kv)


@pytest.fixture
def pair(engines: Engines) -> Iterator[tuple[Side, Side]]:
    servers = [start_bootstrap(), start_bootstrap()]
    a_kv, b_kv = engines.p_kv, engines.d_kv[HEADS]
    for seed, kv in ((1, a_kv), (2, b_kv)):
        g = torch.Generator().manual_seed(seed)
        for t in kv.values():
            t.copy_(torch.randint(-2000, 2000, t.shape, generator=g))
    sides = [_both_side(servers[0], engines.p, a_kv), _both_side(servers[1], engines.d, b_kv)]
    try:
        yield sides[0], sides[1]
    finally:
        for side in sides:
            side.mgr.close()
            side.mgr.pool.shutdown(wait=True)
        for server in servers:
            server.stop()


def _recv(req_id: str, room: int, prefiller: Side, dst: list[int]) -> RecvJob:
    port = prefiller.mgr.cfg.bootstrap_port
    return RecvJob(req_id, room, HOST, port, None, dst, 0, BLOCK_SIZE * len(dst))


def test_two_both_ranks_push_to_each_other_at_once(pair: tuple[Side, Side]) -> None:
    a, b = pair
    a_before, b_before = snapshot(a.kv), snapshot(b.kv)
    # a prefills room 11 for b; b prefills room 22 for a; both loads are asked for before either push.
    b.mgr.add_recvs([_recv("b-loads", 11, a, [4, 5])])
    a.mgr.add_recvs([_recv("a-loads", 22, b, [12, 13])])
    a.mgr.add_sends([SendJob("a-prefills", 11, [0, 1], 2 * BLOCK_SIZE)])
    b.mgr.add_sends([SendJob("b-prefills", 22, [8, 9], 2 * BLOCK_SIZE)])
    a.wait_sent("a-prefills")
    b.wait_sent("b-prefills")
    a.wait_recv("a-loads")
    b.wait_recv("b-loads")
    assert a.failed == {} and b.failed == {}
    for name in a.kv:
        assert torch.equal(b.kv[name][[4, 5]], a_before[name][[0, 1]])  # a -> b
        assert torch.equal(a.kv[name][[12, 13]], b_before[name][[8, 9]])  # b -> a
    for side in (a, b):
        stats = side.stats()
        assert stats.transfers_ok == 1 and stats.recvs_ok == 1  # each was P once and D once
