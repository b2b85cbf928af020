"""Mixed TP on vLLM-Ascend's token-major KV: KV managers of P and D ranks in this process, real ZMQ and
a real bootstrap server; ``run_mixed_tp_case`` moves one request's KV and checks it byte for byte.

Used by tests/unit/test_nhd_mixed_tp.py (Mooncake TCP) and tests/unit/test_staging_buffer.py (in-process)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pd_connector.bootstrap.client import register_rank
from pd_connector.bootstrap.server import BootstrapServer, BootstrapState
from pd_connector.config import parse_config
from pd_connector.layouts.regions import memory_ranges, regions_of_kv_caches
from pd_connector.layouts.tp import local_heads, plan_decode_rank, slices_from
from pd_connector.messages import RegisterRank
from pd_connector.metadata import RecvJob, SendJob
from pd_connector.transfer.backend import TransferBackend
from pd_connector.transfer.manager import KVTransferManager, RankSpec
from pd_connector.transfer.registry import create_backend
from pd_connector.transfer.staging import nhd_reshuffle
from tests.support.ascend_kv import ascend_tensor
from tests.support.loopback import HOST, free_port, wait_for

NB, BS, HD, LAYERS = 10, 16, 8, 2
DTYPE = torch.float16
HB = HD * 2  # bytes of one head of one token
STAGING = 3 * BS * HB + 100  # three one-head block slices: P gathers in several batches
SRC_BLOCKS, DST_BLOCKS = [1, 2, 3, 7, 8], [6, 7, 0, 2, 3]


class CountingBackend:
    """A real backend that also records every entry it is asked to write."""

    def __init__(self, inner: TransferBackend) -> None:
        self.inner = inner
        self.lengths: list[int] = []

    @property
    def descriptor(self) -> bytes:
        return self.inner.descriptor

    def register(self, ranges: list[tuple[int, int]]) -> None:
        self.inner.register(ranges)

    def write(self, peer, src, dst, lengths, max_batch, still_wanted=None) -> None:  # noqa: ANN001
        self.lengths += list(lengths)
        self.inner.write(peer, src, dst, lengths, max_batch, still_wanted)

    def close(self) -> None:
        self.inner.close()


@dataclass
class Engines:
    """Mooncake TCP backends shared by the cases (destroying one takes about a second)."""

    p: list[CountingBackend] = field(default_factory=list)
    d: list[CountingBackend] = field(default_factory=list)
    keep: list[object] = field(default_factory=list)  # registered KV stays alive until the end

    def get(self, side: str, n: int) -> list[CountingBackend]:
        pool = self.p if side == "p" else self.d
        role = "kv_producer" if side == "p" else "kv_consumer"
        while len(pool) < n:
            cfg = parse_config(role, {"local_ip": HOST, "backend": "mooncake", "protocol": "tcp"})
            pool.append(CountingBackend(create_backend(cfg)))
        for b in pool:
            b.lengths.clear()
        return pool[:n]


def rank_kv(heads: list[int], model: list[tuple[torch.Tensor, torch.Tensor]] | None) -> dict[str, tuple]:
    """A rank's KV holding ``heads`` of the model's KV (zeros when ``model`` is None)."""
    kv = {}
    for i in range(LAYERS):
        pair = []
        for part in range(2):
            t = ascend_tensor((NB, BS, len(heads), HD), DTYPE)
            if model is not None:
                t.copy_(model[i][part][:, :, heads])
            pair.append(t)
        kv[f"model.layers.{i}.self_attn.attn"] = tuple(pair)
    return kv


def manager(
    side: str, rank: int, tp: int, total: int, backend: CountingBackend, kv: dict, engines: Engines, bport: int
):
    role = "kv_producer" if side == "p" else "kv_consumer"
    extra = {"local_ip": HOST, "bootstrap_port": bport, "http_timeout_s": 2.0, "staging_bytes": STAGING}
    extra["verify_kv"] = True  # D checks the checksums its P ranks report (transfer.checksum): they add up
    cfg = parse_config(role, {**extra, "kv_wait_timeout_s": 30.0, "room_timeout_s": 30.0})
    local = len(local_heads(total, tp, rank))
    engines.keep.append(kv)
    # As the worker does at KV registration: P's staging buffer is registered with the KV, in one call.
    reshuffle = nhd_reshuffle(cfg, kv, NB, BS, local, use_mla=False, heads_outermost=local == 1, tp_size=tp)
    assert reshuffle is not None and bool(reshuffle.registered_ranges) == (side == "p")
    backend.register(memory_ranges(kv) + reshuffle.registered_ranges)
    spec = RankSpec(
        tp_rank=rank, tp_size=tp, dp_rank=0, dp_size=1, block_size=BS, kv_dtype="float16", num_layers=LAYERS,
        total_kv_heads=total, local_kv_heads=local, heads_outermost=local == 1, token_major=True,
    )  # fmt: skip
    engines.keep.append(reshuffle)
    return KVTransferManager(cfg, spec, regions_of_kv_caches(kv, NB), backend, reshuffle=reshuffle)


def run_mixed_tp_case(engines: Engines, p_tp: int, d_tp: int, heads: int) -> None:
    """One mixed-TP transfer of a model with ``heads`` KV heads from ``p_tp`` P ranks to ``d_tp`` D ranks,
    checked byte for byte, with P's entries counted (whole head slices of blocks)."""
    g = torch.Generator().manual_seed(p_tp * 100 + d_tp * 10 + heads)
    model = [
        tuple(torch.randint(-3000, 3000, (NB, BS, heads, HD), generator=g).to(DTYPE) for _ in range(2))
        for _ in range(LAYERS)
    ]
    server = BootstrapServer(BootstrapState(attn_tp_size=p_tp, attn_dp_size=1), HOST, free_port())
    server.start()
    managers: list[KVTransferManager] = []
    try:
        p_backends, d_backends = engines.get("p", p_tp), engines.get("d", d_tp)
        p_kvs = [rank_kv(local_heads(heads, p_tp, r), model) for r in range(p_tp)]
        d_kvs = [rank_kv(local_heads(heads, d_tp, r), None) for r in range(d_tp)]
        for t in (t for kv in d_kvs for pair in kv.values() for t in pair):
            t.fill_(-7.0)
        ps = [manager("p", r, p_tp, heads, p_backends[r], p_kvs[r], engines, server.port) for r in range(p_tp)]
        ds = [manager("d", r, d_tp, heads, d_backends[r], d_kvs[r], engines, server.port) for r in range(d_tp)]
        managers = ps + ds
        for r, m in enumerate(ps):
            info = RegisterRank(p_tp, r, 1, 0, HOST, m.rank_port, BS, "float16", num_layers=LAYERS)
            assert register_rank(f"{HOST}:{server.port}", info, retries=3, interval_s=0.05, timeout_s=5)
        room = 4000 + p_tp * 10 + d_tp
        for m in ps:
            m.add_sends([SendJob("p-req", room, list(SRC_BLOCKS), len(SRC_BLOCKS) * BS)])
        job = RecvJob("d-req", room, HOST, server.port, None, list(DST_BLOCKS), 0, len(DST_BLOCKS) * BS)
        for m in ds:
            m.add_recvs([job])
        for m in ds:
            got: dict[str, set] = {"recv": set(), "failed": set()}

            def done(m: KVTransferManager = m, got: dict = got) -> bool:
                _, recving, failed = m.take_finished()
                got["recv"] |= recving
                got["failed"] |= set(failed)
                return "d-req" in got["recv"]

            wait_for(done, 20, what="D rank received")
            assert not got["failed"], "the load failed (see the log)"
        # P frees the room once every D rank it serves was written (also where one P rank serves several
        # D ranks, which share the request id: claims are counted per request and D rank).
        for m in ps:
            sent: set[str] = set()
            wait_for(lambda m=m, sent=sent: sent.update(m.take_finished()[0]) or "p-req" in sent, 10, what="P freed")
        # Byte-exact: each D rank's blocks hold its heads of the model's source blocks; others untouched.
        for r, kv in enumerate(d_kvs):
            mine = local_heads(heads, d_tp, r)
            for i, (k, v) in enumerate(kv.values()):
                for part, t in enumerate((k, v)):
                    want = model[i][part][SRC_BLOCKS][:, :, mine]
                    assert torch.equal(t[DST_BLOCKS].view(torch.int16), want.view(torch.int16)), (r, i, part)
                    others = [b for b in range(NB) if b not in DST_BLOCKS]
                    assert bool((t[others] == -7.0).all()), (r, i, part)
        # Entries: whole head slices of blocks, as many as the plan's slices times blocks times regions.
        regions = 2 * LAYERS
        for p_rank, backend in enumerate(p_backends):
            expected = 0
            for d_rank in range(d_tp):
                plan = plan_decode_rank(heads, p_tp, d_tp, d_rank, is_mla=False, spread=room % p_tp)
                expected += len(slices_from(plan, p_rank)) * len(SRC_BLOCKS) * regions
            assert len(backend.lengths) == expected, (p_rank, backend.lengths)
            assert all(n >= BS * HB and n % (BS * HB) == 0 for n in backend.lengths), backend.lengths
    finally:
        for m in managers:
            m.close()
            m.pool.shutdown(wait=True)
        server.stop()
