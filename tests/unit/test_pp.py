"""Pipeline-parallel prefill (pp_stages): P's stages register their layers, D maps its layers to them.

The rig: a bootstrap server of a P deployment with PP 2 (each stage TP 1 or 2), one KVTransferManager
per P rank holding only its stage's layers, and a D manager (TP 1, PP 1) holding every layer, over
real ZMQ and the in-process backend. D's blocks must equal P's byte for byte, layer by layer, and a
load completes only once every stage pushed.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass, field

import msgspec
import pytest
import torch

from pd_connector import messages as proto
from pd_connector.bootstrap.client import register_rank
from pd_connector.bootstrap.server import BootstrapServer, BootstrapState
from pd_connector.config import ConfigError, parse_config
from pd_connector.layouts.pp import (
    PipelineError,
    layer_index,
    localize_hello,
    parse_partition,
    region_layers_of,
    stage_range,
    stages_for,
)
from pd_connector.layouts.regions import memory_ranges, regions_of_kv_caches
from pd_connector.metadata import SendJob
from pd_connector.transfer.backend import TransferBackend
from pd_connector.transfer.manager import KVTransferManager, RankSpec
from pd_connector.transfer.registry import create_backend
from tests.support.loopback import HOST, free_port, wait_for
from tests.support.transfer_rig import BLOCK_SIZE, DTYPE, HEAD_DIM, HEADS, NUM_BLOCKS, Side, recv_job

LAYERS = 6


def _kv(layers: range, heads: int) -> dict[str, torch.Tensor]:
    shape = (NUM_BLOCKS, heads, BLOCK_SIZE, 2 * HEAD_DIM)  # vLLM CPU layout, heads outermost in a block
    return {f"model.layers.{i}.self_attn.attn": torch.zeros(shape, dtype=torch.float16) for i in layers}


# ------------------------------------------------------------------ pure parts


def test_layer_index_and_stage_range() -> None:
    assert layer_index("model.layers.7.self_attn.attn") == 7
    assert layer_index("lm_head") is None
    assert stage_range(_kv(range(2, 6), 1), pp_rank=1) == (2, 6)
    assert region_layers_of(_kv(range(2, 4), 1), NUM_BLOCKS) == (2, 3)
    gap = {**_kv(range(0, 1), 1), **_kv(range(2, 3), 1)}
    with pytest.raises(PipelineError, match=r"layers \[0, 2\], which are not contiguous"):
        stage_range(gap, pp_rank=0)
    with pytest.raises(PipelineError, match="carry no layer index"):
        stage_range({"attn": torch.zeros(1)}, pp_rank=1)


def test_partition_keys_parse_as_vllm_ascend_writes_them() -> None:
    assert parse_partition("prefill", "2,4") == (2, 4)
    assert parse_partition("prefill", [3, 3]) == (3, 3)
    cfg = parse_config("kv_consumer", {"prefill": {"tp_size": 2, "pp_size": 2, "pp_layer_partition": "2,4"}})
    assert cfg.prefill is not None and (cfg.prefill.pp_size, cfg.prefill.pp_layer_partition) == (2, (2, 4))
    assert parse_config("kv_producer", {"decode": {"tp_size": 1, "pp_size": 1}}).decode is not None


@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        ({"prefill": {"pp_layer_partition": "2,x"}}, 'prefill.pp_layer_partition must be layers per stage like "2,4"'),
        ({"prefill": {"pp_layer_partition": "2,0"}}, "every stage holds >= 1 layer"),
        ({"prefill": {"pp_size": 2, "pp_layer_partition": "1,2,3"}}, "names 3 stages (1,2,3) but"),
        ({"decode": {"pp_size": 2}}, "decode.pp_size is 2: PDConnector's decode runs one pipeline stage"),
        ({"decode": {"pp_layer_partition": "2,4"}}, "only prefill's layers are split"),
    ],
)
def test_unsupported_pp_settings_are_refused_by_name(extra: dict, needle: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_config("kv_consumer", extra)
    assert needle in str(info.value)


def test_decode_with_pipeline_stages_is_refused() -> None:
    from pd_connector.worker import _stage_layers

    cfg = parse_config("kv_consumer", {})
    with pytest.raises(ValueError, match="decode instance runs --pipeline-parallel-size 2, but decode runs one"):
        _stage_layers(cfg, _kv(range(0, 3), 1), pp_rank=0, pp_size=2)
    prefill = parse_config("kv_producer", {"prefill": {"pp_size": 2, "pp_layer_partition": "3,3"}})
    with pytest.raises(ValueError, match=r"pp_layer_partition is 3,3: stage 1 would start at layer 3, .* layer 2"):
        _stage_layers(prefill, _kv(range(2, 6), 1), pp_rank=1, pp_size=2)
    assert _stage_layers(prefill, _kv(range(3, 6), 1), pp_rank=1, pp_size=2) == (3, 6)


def _route(stage_layers: list[tuple[int, int]]) -> proto.Route:
    return proto.Route(
        1, 1, 1, BLOCK_SIZE, DTYPE, LAYERS, True, {}, pp_size=len(stage_layers), stage_layers=stage_layers
    )


def test_decode_maps_each_layer_to_the_stage_that_holds_it() -> None:
    assert stages_for(_route([(0, 2), (2, 6)]), range(6), "p:1") == [0, 1]
    assert stages_for(_route([(0, 2), (2, 6)]), [3, 4], "p:1") == [1]
    with pytest.raises(PipelineError, match=r"layer 6 of this decode instance is held by no stage"):
        stages_for(_route([(0, 2), (2, 6)]), range(7), "p:1")
    with pytest.raises(PipelineError, match=r"layer 2 .* held by stages \[0, 1\]"):
        stages_for(_route([(0, 3), (2, 6)]), range(6), "p:1")


def test_prefill_stage_keeps_the_peers_regions_of_its_layers() -> None:
    regions = [(1000 * i, 64, 64) for i in range(LAYERS)]
    hello = proto.PeerHello(
        "d", b"x", "tcp://d:1", 0, 1, BLOCK_SIZE, DTYPE, LAYERS, regions, region_layers=list(range(6))
    )
    narrowed = localize_hello((2, 3, 4, 5), 2, hello)
    assert narrowed.regions == regions[2:] and narrowed.num_layers == 4 and narrowed.region_layers == [2, 3, 4, 5]
    assert localize_hello((0, 1), 1, hello) is hello  # PP 1: regions pair by position as before
    with pytest.raises(PipelineError, match="does not say which layer each of its KV regions holds"):
        localize_hello((2, 3), 2, msgspec.structs.replace(hello, region_layers=[]))
    with pytest.raises(PipelineError, match=r"missing layers \[7\]"):
        localize_hello((5, 6, 7), 2, msgspec.structs.replace(hello, region_layers=[0, 1, 2, 3, 5, 6]))


def test_bootstrap_route_lists_every_stages_layers() -> None:
    state = BootstrapState(attn_tp_size=1, attn_dp_size=1, pp_size=2)

    def rank(pp: int, first: int, end: int) -> proto.RegisterRank:
        return proto.RegisterRank(
            1, 0, 1, 0, HOST, 7000 + pp, BLOCK_SIZE, DTYPE, num_layers=end - first,
            pp_size=2, pp_rank=pp, first_layer=first, end_layer=end,
        )  # fmt: skip

    state.register_rank(rank(1, 2, 6))
    assert not state.route().is_ready
    state.register_rank(rank(0, 0, 2))
    route = state.route()
    assert route.is_ready and route.num_layers == LAYERS and route.stage_layers == [(0, 2), (2, 6)]
    assert route.rank(0, 0, 0, 1) == proto.RankInfo(HOST, 7001) and route.rank(0, 0, 0) == proto.RankInfo(HOST, 7000)
    with pytest.raises(ValueError, match=r"other ranks of stage 1 registered \[2, 6\)"):
        state.register_rank(rank(1, 3, 6))
    with pytest.raises(ValueError, match="must name its layers"):
        state.register_rank(rank(1, 0, 0))
    with pytest.raises(ValueError, match="tp/dp/cp/pp sizes 1/1/1/1"):
        state.register_rank(msgspec.structs.replace(rank(0, 0, 2), pp_size=1))


# ------------------------------------------------------------------ the rig


@dataclass
class PipelineRig:
    server: BootstrapServer
    p_tp: int
    stages: list[list[Side]] = field(default_factory=list)  # [pp][tp]
    backends: list[TransferBackend] = field(default_factory=list)
    d: Side | None = None

    @property
    def bport(self) -> int:  # transfer_rig.recv_job's bootstrap port
        return self.server.port

    def close(self) -> None:
        sides = [s for stage in self.stages for s in stage] + ([self.d] if self.d else [])
        for side in sides:
            side.mgr.close()
            side.mgr.pool.shutdown(wait=True)
        for backend in self.backends:
            backend.close()
        self.server.stop()

    def _backend(self, role: str, kv: dict[str, torch.Tensor]) -> TransferBackend:
        backend = create_backend(parse_config(role, {"backend": "inproc", "local_ip": HOST}))
        backend.register(memory_ranges(kv))
        self.backends.append(backend)
        return backend

    def _extra(self, **extra: object) -> dict[str, object]:
        base = {"local_ip": HOST, "backend": "inproc", "bootstrap_port": self.server.port, "http_timeout_s": 2.0}
        return {**base, "kv_wait_timeout_s": 20.0, "room_timeout_s": 20.0, **extra}

    def add_stage(self, pp: int, layers: range, seed: int) -> None:
        local = HEADS // self.p_tp
        sides = []
        for tp in range(self.p_tp):
            kv = _kv(layers, local)
            g = torch.Generator().manual_seed(seed * 10 + tp)
            for t in kv.values():
                t.copy_(torch.randint(-2000, 2000, t.shape, generator=g))
            spec = RankSpec(
                tp_rank=tp, tp_size=self.p_tp, dp_rank=0, dp_size=1, block_size=BLOCK_SIZE, kv_dtype=DTYPE,
                num_layers=len(layers), total_kv_heads=HEADS, local_kv_heads=local, num_blocks=NUM_BLOCKS,
                pp_rank=pp, pp_size=2, region_layers=region_layers_of(kv, NUM_BLOCKS),
            )  # fmt: skip
            cfg = parse_config("kv_producer", self._extra())
            mgr = KVTransferManager(cfg, spec, regions_of_kv_caches(kv, NUM_BLOCKS), self._backend("kv_producer", kv))
            info = proto.RegisterRank(
                self.p_tp, tp, 1, 0, HOST, mgr.rank_port, BLOCK_SIZE, DTYPE, num_layers=len(layers),
                pp_size=2, pp_rank=pp, first_layer=layers.start, end_layer=layers.stop,
            )  # fmt: skip
            assert register_rank(f"{HOST}:{self.server.port}", info, retries=3, interval_s=0.05, timeout_s=5)
            sides.append(Side(mgr, kv))
        self.stages.append(sides)

    def add_decode(self, tell_layers: bool = True, **extra: object) -> Side:
        kv = _kv(range(LAYERS), HEADS)
        for t in kv.values():
            t.fill_(-7.0)
        layers = region_layers_of(kv, NUM_BLOCKS) if tell_layers else ()
        spec = RankSpec(
            tp_rank=0, tp_size=1, dp_rank=0, dp_size=1, block_size=BLOCK_SIZE, kv_dtype=DTYPE, num_layers=LAYERS,
            total_kv_heads=HEADS, local_kv_heads=HEADS, num_blocks=NUM_BLOCKS, region_layers=layers,
        )  # fmt: skip
        cfg = parse_config("kv_consumer", self._extra(**extra))
        mgr = KVTransferManager(cfg, spec, regions_of_kv_caches(kv, NUM_BLOCKS), self._backend("kv_consumer", kv))
        self.d = Side(mgr, kv)
        return self.d

    def send(self, pp: int, req_id: str, room: int, blocks: list[int]) -> None:
        for side in self.stages[pp]:
            side.mgr.add_sends([SendJob(req_id, room, blocks, len(blocks) * BLOCK_SIZE)])

    def expected(self, layer: int, blocks: list[int]) -> torch.Tensor:
        """What D's blocks of ``layer`` must hold: P's blocks, each head from the P rank that holds it."""
        pp = next(i for i, stage in enumerate(self.stages) if f"model.layers.{layer}.self_attn.attn" in stage[0].kv)
        parts = [side.kv[f"model.layers.{layer}.self_attn.attn"][blocks] for side in self.stages[pp]]
        return torch.cat(parts, dim=1)


@pytest.fixture
def pipeline() -> Iterator[PipelineRig]:
    server = BootstrapServer(BootstrapState(attn_tp_size=1, attn_dp_size=1, pp_size=2), HOST, free_port())
    server.start()
    rig = PipelineRig(server, p_tp=1)
    try:
        yield rig
    finally:
        rig.close()


def _layers(partition: tuple[int, int]) -> list[range]:
    return [range(0, partition[0]), range(partition[0], LAYERS)]


@pytest.mark.parametrize(("p_tp", "partition"), [(1, (2, 4)), (2, (3, 3))], ids=["tp1-2,4", "tp2-3,3"])
def test_each_stage_pushes_its_layers_and_the_load_waits_for_all(
    pipeline: PipelineRig, p_tp: int, partition: tuple[int, int]
) -> None:
    pipeline.p_tp = pipeline.server.state.attn_tp_size = p_tp
    for pp, layers in enumerate(_layers(partition)):
        pipeline.add_stage(pp, layers, seed=pp + 1)
    prefill = {"tp_size": p_tp, "pp_size": 2, "pp_layer_partition": ",".join(map(str, partition))}
    d = pipeline.add_decode(prefill=prefill)
    before = {name: t.clone() for name, t in d.kv.items()}
    src, dst = [1, 2, 3], [9, 4, 5]
    pipeline.send(0, "p-req", 31, src)  # stage 1 has not finished its part of the prefill yet
    d.mgr.add_recvs([recv_job(pipeline, "d-req", 31, dst)])
    for side in pipeline.stages[0]:
        side.wait_sent("p-req")
    d.poll()
    assert "d-req" not in d.recving, "a load must wait for every stage"
    first = f"model.layers.{partition[0]}.self_attn.attn"
    assert torch.equal(d.kv[first].view(torch.int16), before[first].view(torch.int16)), "stage 1 wrote nothing yet"
    pipeline.send(1, "p-req", 31, src)
    d.wait_recv("d-req")
    assert d.failed == {}
    others = [b for b in range(NUM_BLOCKS) if b not in dst]
    for layer in range(LAYERS):
        name = f"model.layers.{layer}.self_attn.attn"
        assert torch.equal(d.kv[name][dst].view(torch.int16), pipeline.expected(layer, src).view(torch.int16)), name
        assert torch.equal(d.kv[name][others].view(torch.int16), before[name][others].view(torch.int16)), name
    for stage in pipeline.stages:
        for side in stage:
            side.wait_sent("p-req")
            assert side.stats().transfers_ok == 1
            wait_for(side.settled, what="prefill rank settled")


def test_wrong_partition_on_decode_fails_the_load_naming_the_key(
    pipeline: PipelineRig, caplog: pytest.LogCaptureFixture
) -> None:
    for pp, layers in enumerate(_layers((2, 4))):
        pipeline.add_stage(pp, layers, seed=pp + 1)
    d = pipeline.add_decode(prefill={"pp_size": 2, "pp_layer_partition": "3,3"})
    with caplog.at_level(logging.ERROR, logger="pd_connector"):
        d.mgr.add_recvs([recv_job(pipeline, "d-req", 32, [4, 5])])
        d.wait_recv("d-req")
    assert d.failed == {"d-req": [4, 5]}
    assert "prefill.pp_layer_partition is 3,3: stage 1 would start at layer 3" in caplog.text
    assert "starts at layer 2" in caplog.text


def test_decode_that_does_not_name_its_layers_is_refused_by_a_stage(
    pipeline: PipelineRig, caplog: pytest.LogCaptureFixture
) -> None:
    for pp, layers in enumerate(_layers((2, 4))):
        pipeline.add_stage(pp, layers, seed=pp + 1)
    d = pipeline.add_decode(tell_layers=False)
    pipeline.send(0, "p-req", 33, [1])
    pipeline.send(1, "p-req", 33, [1])
    with caplog.at_level(logging.ERROR, logger="pd_connector"):
        d.mgr.add_recvs([recv_job(pipeline, "d-req", 33, [4])])
        d.wait_recv("d-req")
    assert d.failed == {"d-req": [4]}
    assert "does not say which layer each of its KV regions holds" in caplog.text
