"""Device ordering for mixed TP on token-major (NHD) KV: P's staging gather and D's permute.

P and D ranks are KVTransferManagers in this process (real ZMQ and bootstrap, the in-process
backend), their KV allocated as vLLM-Ascend does (test_ascend_dropin.ascend_tensor); each rank has
its own simulated asynchronous device (tests/support/sim_device.py), whose index is its TP rank. The
forward's KV writes are queued on the P ranks' devices, which stay busy until the test lets them
run. P1 -> D2: P gathers head slices into its staging buffer; P2 -> D1: D permutes what its two P
ranks wrote. With each rank's device seam D gets the forward's KV byte for byte, and every device
call of a transfer thread runs with the rank's own device bound (P rank 1 on device 1, not 0);
with the no-op seam (the old ordering) D gets the KV P held before the forward.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
import torch

from pd_connector.bootstrap.client import register_rank
from pd_connector.bootstrap.server import BootstrapServer, BootstrapState
from pd_connector.config import parse_config
from pd_connector.layouts.regions import memory_ranges, regions_of_kv_caches
from pd_connector.layouts.tp import local_heads
from pd_connector.messages import RegisterRank
from pd_connector.metadata import RecvJob, SendJob
from pd_connector.transfer.device_sync import NO_DEVICE, DeviceSync
from pd_connector.transfer.manager import KVTransferManager, RankSpec
from pd_connector.transfer.nhd_reshuffle import NhdReshuffle, token_major_views
from pd_connector.transfer.staging import aligned_buffer
from tests.support.ascend_kv import ascend_tensor
from tests.support.inproc_backend import InprocBackend
from tests.support.loopback import HOST, free_port, wait_for
from tests.support.sim_device import SimDevice

NB, BS, HD, LAYERS, HEADS = 8, 16, 8, 2, 4
STAGING = 2 * BS * 2 * HD * 2 + 64  # two blocks of a two-head slice: P gathers in several batches
SRC, DST = [1, 2, 5, 6], [7, 0, 3, 4]
BUSY_S = 0.3

Model = list[tuple[torch.Tensor, torch.Tensor]]  # per layer (k, v): [NB, BS, HEADS, HD]


def model_kv(seed: int, low: int) -> Model:
    g = torch.Generator().manual_seed(seed)
    return [
        tuple(torch.randint(low, low + 2000, (NB, BS, HEADS, HD), generator=g).to(torch.float16) for _ in range(2))  # type: ignore[misc]
        for _ in range(LAYERS)
    ]


def rank_kv(heads: list[int], model: Model | None) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    kv = {}
    for i in range(LAYERS):
        parts = [ascend_tensor((NB, BS, len(heads), HD), torch.float16) for _ in range(2)]
        for part, t in enumerate(parts):
            t.copy_(model[i][part][:, :, heads]) if model is not None else t.fill_(-7.0)
        kv[f"model.layers.{i}.self_attn.attn"] = (parts[0], parts[1])
    return kv


class Rank:
    """One rank: its KV, backend, simulated device and manager."""

    def __init__(self, side: str, rank: int, tp: int, model: Model | None, bport: int, seam: bool) -> None:
        self.heads = local_heads(HEADS, tp, rank)
        self.kv = rank_kv(self.heads, model)
        self.sim = SimDevice(index=rank, running=side == "d")
        device: DeviceSync = self.sim if seam else NO_DEVICE
        views = token_major_views(self.kv, NB, BS, len(self.heads))
        assert views is not None
        staging = aligned_buffer(STAGING, torch.device("cpu")) if side == "p" else None
        reshuffle = NhdReshuffle(views, STAGING, staging)
        self.backend = InprocBackend()
        self.backend.register(memory_ranges(self.kv) + reshuffle.registered_ranges)
        role = "kv_producer" if side == "p" else "kv_consumer"
        extra = {"local_ip": HOST, "bootstrap_port": bport, "http_timeout_s": 2.0, "staging_bytes": STAGING}
        cfg = parse_config(role, {**extra, "backend": "inproc", "kv_wait_timeout_s": 30.0, "room_timeout_s": 30.0})
        spec = RankSpec(
            tp_rank=rank, tp_size=tp, dp_rank=0, dp_size=1, block_size=BS, kv_dtype="float16", num_layers=LAYERS,
            total_kv_heads=HEADS, local_kv_heads=len(self.heads), heads_outermost=len(self.heads) == 1,
            token_major=True, num_blocks=NB,
        )  # fmt: skip
        regions = regions_of_kv_caches(self.kv, NB)
        self.mgr = KVTransferManager(cfg, spec, regions, self.backend, reshuffle=reshuffle, device=device)

    def close(self) -> None:
        self.sim.resume()
        self.mgr.close()
        self.mgr.pool.shutdown(wait=True)
        self.backend.close()
        self.sim.close()


class Deployment:
    """The ranks and the bootstrap server of one test; ``close`` stops them all."""

    def __init__(self) -> None:
        self.ranks: list[Rank] = []
        self.servers: list[BootstrapServer] = []

    def server(self, p_tp: int) -> BootstrapServer:
        s = BootstrapServer(BootstrapState(attn_tp_size=p_tp, attn_dp_size=1), HOST, free_port())
        s.start()
        self.servers.append(s)
        return s

    def close(self) -> None:
        for r in self.ranks:
            r.close()
        for s in self.servers:
            s.stop()


@pytest.fixture
def deployment() -> Iterator[Deployment]:
    made = Deployment()
    try:
        yield made
    finally:
        made.close()


def run(dep: Deployment, p_tp: int, d_tp: int, seam: bool) -> tuple[Model, Model, list[Rank]]:
    """Push one room through busy P devices: (P's KV before the forward, the forward's KV, D ranks)."""
    server = dep.server(p_tp)
    ranks = dep.ranks
    old, fresh = model_kv(p_tp * 10 + d_tp, -3000), model_kv(p_tp * 10 + d_tp + 1, 3000)
    ps = [Rank("p", r, p_tp, old, server.port, seam) for r in range(p_tp)]
    ranks.extend(ps)
    ds = [Rank("d", r, d_tp, None, server.port, seam) for r in range(d_tp)]
    ranks.extend(ds)
    for r, p in enumerate(ps):
        info = RegisterRank(p_tp, r, 1, 0, HOST, p.mgr.rank_port, BS, "float16", num_layers=LAYERS)
        assert register_rank(f"{HOST}:{server.port}", info, retries=3, interval_s=0.05, timeout_s=5)
    room = 900 + p_tp * 10 + d_tp
    for p in ps:  # the forward: every layer's KV write queued on the rank's (busy) device
        for i, (k, v) in enumerate(p.kv.values()):
            for part, t in enumerate((k, v)):
                p.sim.write_blocks(t, SRC, fresh[i][part][SRC][:, :, p.heads])
        p.mgr.add_sends([SendJob("p-req", room, list(SRC), len(SRC) * BS)])
    job = RecvJob("d-req", room, HOST, server.port, None, list(DST), 0, len(DST) * BS)
    for d in ds:
        d.mgr.add_recvs([job])
    received: dict[int, set[str]] = {i: set() for i in range(d_tp)}

    def poll(i: int) -> bool:
        _, recving, failed = ds[i].mgr.take_finished()
        assert not failed, "a load failed (see the log)"
        received[i] |= recving
        return "d-req" in received[i]

    if seam:
        time.sleep(BUSY_S)
        assert not any(poll(i) for i in range(d_tp)), "KV reached D while P's devices had not written it"
        for p in ps:
            p.sim.resume()
    for i in range(d_tp):
        wait_for(lambda i=i: poll(i), 20, what=f"D rank {i} received")
    return old, fresh, ds


def d_blocks(d: Rank) -> list[torch.Tensor]:
    return [t[DST].contiguous().view(torch.int16) for pair in d.kv.values() for t in pair]


def model_blocks(model: Model, heads: list[int]) -> list[torch.Tensor]:
    return [t[SRC][:, :, heads].contiguous().view(torch.int16) for pair in model for t in pair]


CASES = [(1, 2), (2, 1)]


@pytest.mark.parametrize(("p_tp", "d_tp"), CASES, ids=["P1D2-staging", "P2D1-permute"])
def test_mixed_tp_nhd_with_the_device_seam_is_byte_exact(deployment: Deployment, p_tp: int, d_tp: int) -> None:
    _, fresh, ds = run(deployment, p_tp, d_tp, seam=True)
    ranks = deployment.ranks
    for d in ds:
        for got, want in zip(d_blocks(d), model_blocks(fresh, d.heads), strict=True):
            assert torch.equal(got, want), d.heads
    for r in ranks:  # every device call of a transfer thread ran on the rank's own device
        calls = [t for t in r.sim.touches if t.what != "bind" and t.thread.startswith("pd-")]
        assert all(t.device == r.sim.index for t in calls), (r.sim.index, calls)
    ps = ranks[:p_tp]
    assert all(any(t.what == "event_wait" for t in p.sim.touches) for p in ps), "every P push waited"
    if p_tp == 1:  # P's staging gather synchronised P's device
        assert any(t.what == "synchronize" and t.thread.startswith("pd-xfer") for t in ps[0].sim.touches)
    else:  # D's permute synchronised D's device before vLLM could see the blocks
        assert any(t.what == "synchronize" and t.thread.startswith("pd-xfer") for t in ds[0].sim.touches)
        assert any(t.device == 1 for t in ps[1].sim.touches if t.what == "event_wait"), "P rank 1 on device 1"


@pytest.mark.parametrize(("p_tp", "d_tp"), CASES, ids=["P1D2-staging", "P2D1-permute"])
def test_mixed_tp_nhd_without_the_device_seam_gets_stale_kv(deployment: Deployment, p_tp: int, d_tp: int) -> None:
    old, fresh, ds = run(deployment, p_tp, d_tp, seam=False)
    for d in ds:
        for got, stale, want in zip(d_blocks(d), model_blocks(old, d.heads), model_blocks(fresh, d.heads), strict=True):
            assert torch.equal(got, stale) and not torch.equal(got, want), d.heads
