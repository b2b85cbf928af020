"""Moving a decoder's request with its KV, connector side: the ``migration`` config, the
``migrate_room`` parameter, the D scheduler's hold of an aborted request (pd_connector.scheduling.migration), and a
real push from a "source decoder" manager (kv_consumer with migration) to a target decoder over the
transfer-manager rig (tests/support/transfer_rig.py: real ZMQ and bootstrap server on loopback, the
in-process backend)."""

from __future__ import annotations

import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from vllm.v1.outputs import KVConnectorOutput
from vllm.v1.request import RequestStatus

import pd_connector.worker as worker_mod
from pd_connector.bootstrap.client import register_rank
from pd_connector.config import ConfigError, parse_config
from pd_connector.kv_params import MIGRATE_ROOM, DecodeParams, KVParamsError, parse_kv_params
from pd_connector.layouts.regions import regions_of_kv_caches
from pd_connector.messages import RegisterRank
from pd_connector.metadata import PDConnectorMetadata, SendJob
from pd_connector.scheduler import PDScheduler
from pd_connector.transfer.manager import KVTransferManager, RankSpec
from pd_connector.transfer.states import RoomState
from pd_connector.worker import PDWorker
from tests.support.fake_scheduler import BS, D_PARAMS, FakeBlocks, FakeRequest, meta
from tests.support.loopback import HOST, free_port, wait_for
from tests.support.real_scheduler import BLOCK, PROMPT, make_scheduler, request, step
from tests.support.real_scheduler import NUM_BLOCKS as SCHED_BLOCKS
from tests.support.transfer_rig import (
    BLOCK_SIZE,
    BOTH_BACKENDS,
    DTYPE,
    HEADS,
    LAYERS,
    NUM_BLOCKS,
    Rig,
    Side,
    make_kv,
    recv_job,
    snapshot,
)

MIGRATE = 4242
M_PARAMS = {**D_PARAMS, MIGRATE_ROOM: MIGRATE}

# ------------------------------------------------------------------ config and parameters


def test_migration_config_defaults_and_keys() -> None:
    plain = parse_config("kv_consumer", {})
    assert not plain.migration and plain.migrate_hold_s == 10.0 and not plain.pushes_kv
    cfg = parse_config("kv_consumer", {"migration": "true", "migrate_hold_s": "2.5", "bootstrap_port": 18900})
    assert cfg.migration and cfg.migrate_hold_s == 2.5 and cfg.pushes_kv and cfg.bootstrap_port == 18900
    assert parse_config("kv_producer", {}).pushes_kv


@pytest.mark.parametrize(
    ("role", "extra", "message"),
    [
        ("kv_producer", {"migration": True}, r"migration is a decode \(kv_role kv_consumer\) option"),
        ("kv_consumer", {"migration": True, "bootstrap_port": 18900, "d2rh": True}, "migration with d2rh is not"),
        ("kv_consumer", {"migration": True, "bootstrap_port": 18900, "d2rh_zmq_port": 38100}, "with d2rh"),
        ("kv_consumer", {"migration": True}, "migration needs bootstrap_port set"),
        ("kv_consumer", {"migrate_hold_s": 0}, "migrate_hold_s must be > 0"),
        ("kv_consumer", {"migrate_hold_s": "soon"}, "migrate_hold_s must be a number"),
        ("kv_consumer", {"migration": "maybe"}, "migration must be a boolean"),
    ],
)
def test_migration_config_refusals(role: str, extra: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_config(role, extra)


def test_migrate_room_round_trips() -> None:
    params = DecodeParams(7, "10.0.0.2", 18800, 0, prefilled_tokens=40, migrate_room=2**63 - 1)
    wire = params.to_json()
    assert wire[MIGRATE_ROOM] == 2**63 - 1
    assert parse_kv_params(wire) == params
    plain = DecodeParams(7, "10.0.0.2", 18800, None)
    assert MIGRATE_ROOM not in plain.to_json() and parse_kv_params(plain.to_json()) == plain
    assert parse_kv_params({**D_PARAMS, MIGRATE_ROOM: "12"}) == DecodeParams(77, "10.1.2.3", 18800, 1, None, 12)
    for bad in (-1, 2**63, "x", True):
        with pytest.raises(KVParamsError, match=MIGRATE_ROOM):
            parse_kv_params({**D_PARAMS, MIGRATE_ROOM: bad})


# ------------------------------------------------------------------ the scheduler's hold


def _msched(hold_s: float = 3.0, migration: bool = True) -> PDScheduler:
    cfg = parse_config("kv_consumer", {"migration": migration, "migrate_hold_s": hold_s, "bootstrap_port": 18900})
    return PDScheduler(cfg, block_size=BS)


def _decoded(sched: PDScheduler, rid: str, params: Any, prompt: int = 40, computed: int = 47) -> FakeRequest:
    """A D request whose KV P pushed (loaded) and that then decoded: ``computed`` tokens have KV."""
    req = FakeRequest(rid, dict(params), prompt)
    assert sched.get_num_new_matched_tokens(req, 0) == (prompt, True)
    sched.update_state_after_alloc(req, FakeBlocks([10, 11, 12]), prompt)
    assert len(meta(sched).recvs) == 1
    sched.update_connector_output(KVConnectorOutput(finished_recving={rid}))
    sched.build_connector_meta(SimpleNamespace(num_scheduled_tokens={rid: 1}, total_num_scheduled_tokens=1))  # type: ignore[arg-type]
    req.num_computed_tokens = computed  # type: ignore[attr-defined]
    req.status = RequestStatus.RUNNING
    return req


def test_aborted_request_with_migrate_room_is_held(pd_logs: pytest.LogCaptureFixture) -> None:
    sched = _msched(hold_s=3.0)
    req = _decoded(sched, "d-1", M_PARAMS)
    req.status = RequestStatus.FINISHED_ABORTED
    assert sched.request_finished(req, [10, 11, 12, 13]) == (True, None)  # 13: allocated past the computed tokens
    sends = meta(sched).sends
    assert sends == [SendJob("d-1", MIGRATE, [10, 11, 12], 47, hold_s=3.0)]
    assert sends[0].hold_seconds(120.0) == 3.0 and SendJob("p", 1, [1], 1).hold_seconds(120.0) == 120.0
    assert sched.has_pending_push_work()
    assert f"room={MIGRATE} req=d-1: aborted; holding its KV (47 tokens, 3 blocks)" in pd_logs.text
    sched.update_connector_output(KVConnectorOutput(finished_sending={"d-1"}))
    assert not sched.has_pending_push_work()
    # The room is free again: another aborted request may hold it.
    again = _decoded(sched, "d-2", M_PARAMS)
    again.status = RequestStatus.FINISHED_ABORTED
    assert sched.request_finished(again, ([10, 11, 12],)) == (True, None)
    assert meta(sched).sends[0].room == MIGRATE


def test_a_held_migrate_room_is_not_held_twice(pd_logs: pytest.LogCaptureFixture) -> None:
    sched = _msched()
    first, second = _decoded(sched, "d-1", M_PARAMS), _decoded(sched, "d-2", M_PARAMS)
    first.status = second.status = RequestStatus.FINISHED_ABORTED
    assert sched.request_finished(first, [10, 11, 12]) == (True, None)
    assert sched.request_finished(second, [20, 21, 22]) == (False, None)
    assert [job.req_id for job in meta(sched).sends] == ["d-1"]
    assert "migrate room is held by req=d-1" in pd_logs.text


def test_hybrid_groups_are_held_with_every_group() -> None:
    sched = _msched()
    req = _decoded(sched, "d-1", M_PARAMS)
    req.status = RequestStatus.FINISHED_ABORTED
    assert sched.request_finished(req, ([10, 11, 12], [0, 5, 6])) == (True, None)
    (job,) = meta(sched).sends
    assert job.block_ids == [10, 11, 12] and job.group_block_ids == [[10, 11, 12], [0, 5, 6]]


@pytest.mark.parametrize(
    ("status", "params", "migration"),
    [
        (RequestStatus.FINISHED_STOPPED, M_PARAMS, True),  # finished normally: the client got it all
        (RequestStatus.FINISHED_LENGTH_CAPPED, M_PARAMS, True),
        (RequestStatus.FINISHED_ABORTED, D_PARAMS, True),  # no migrate_room: not movable
        (RequestStatus.FINISHED_ABORTED, M_PARAMS, False),  # migration off: the parameter is ignored
    ],
)
def test_other_finishes_are_not_held(status: RequestStatus, params: dict[str, Any], migration: bool) -> None:
    sched = _msched(migration=migration)
    req = _decoded(sched, "d-1", params)
    req.status = status
    delay, answer = sched.request_finished(req, [10, 11, 12])
    assert not delay and (answer is None or set(answer) == {"pd_kv"})  # a finished one: its KV account
    assert meta(sched).sends == [] and not sched.has_pending_push_work()


def test_aborted_while_its_kv_is_still_coming_is_not_held() -> None:
    sched = _msched()
    loading = FakeRequest("d-load", dict(M_PARAMS), 40, RequestStatus.FINISHED_ABORTED)
    assert sched.get_num_new_matched_tokens(loading, 0) == (40, True)
    sched.update_state_after_alloc(loading, FakeBlocks([10, 11, 12]), 40)
    loading.num_computed_tokens = 0  # type: ignore[attr-defined]
    assert sched.request_finished(loading, [10, 11, 12]) == (False, None)
    # Landed but aborted before a step ran it: vLLM frees it as an unscheduled request.
    landed = FakeRequest("d-landed", dict(M_PARAMS), 40, RequestStatus.FINISHED_ABORTED)
    assert sched.get_num_new_matched_tokens(landed, 0) == (40, True)
    sched.update_state_after_alloc(landed, FakeBlocks([20, 21, 22]), 40)
    sched.update_connector_output(KVConnectorOutput(finished_recving={"d-landed"}))
    landed.num_computed_tokens = 39  # type: ignore[attr-defined]
    assert sched.request_finished(landed, [20, 21, 22]) == (False, None)
    # Aborted while it queued (its load never asked for): P is told to free the room, nothing held.
    queued = FakeRequest("d-queued", dict(M_PARAMS), 40, RequestStatus.FINISHED_ABORTED)
    assert sched.request_finished(queued, []) == (False, None)
    m = meta(sched)
    assert m.sends == [] and [job.req_id for job in m.abandoned] == ["d-queued"]
    assert not sched.has_pending_push_work()


# ------------------------------------------------------------------ a real push, source D -> target D


def _source_decoder(rig: Rig, seed: int, **extra: Any) -> Side:
    """A decode manager with migration that pushes: the rig's P backend and KV (random from ``seed``),
    registered on the rig's bootstrap server as the target's "prefill" (kept in rig.sides: closed after)."""
    extra.setdefault("room_timeout_s", 30.0)
    values = {"local_ip": HOST, "backend": rig.engines.name, "bootstrap_port": rig.bport, "http_timeout_s": 2.0}
    cfg = parse_config("kv_consumer", {**values, "migration": True, **extra})
    kv = rig.engines.p_kv
    g = torch.Generator().manual_seed(seed)
    for t in kv.values():
        t.copy_(torch.randint(-2000, 2000, t.shape, generator=g))
    spec = RankSpec(
        tp_rank=0, tp_size=1, dp_rank=0, dp_size=1, block_size=BLOCK_SIZE, kv_dtype=DTYPE, num_layers=LAYERS,
        num_blocks=NUM_BLOCKS,
    )  # fmt: skip
    mgr = KVTransferManager(cfg, spec, regions_of_kv_caches(kv, NUM_BLOCKS), rig.engines.p)
    side = rig.sides["prefill"] = Side(mgr, kv)
    assert mgr.prefill is not None and mgr.decode is not None  # it loads from P and pushes what it held
    info = RegisterRank(1, 0, 1, 0, HOST, mgr.rank_port, BLOCK_SIZE, DTYPE, num_layers=LAYERS)
    assert register_rank(f"{HOST}:{rig.bport}", info, retries=3, interval_s=0.05, timeout_s=5)
    return side


def _held_job(sched: PDScheduler, rid: str, blocks: list[int], computed: int) -> list[SendJob]:
    """The source scheduler's hold of ``rid`` (aborted after decoding), as its worker receives it."""
    req = _decoded(sched, rid, M_PARAMS, prompt=40, computed=computed)
    req.status = RequestStatus.FINISHED_ABORTED
    assert sched.request_finished(req, blocks) == (True, None)
    m = sched.build_connector_meta(SimpleNamespace(total_num_scheduled_tokens=0))  # type: ignore[arg-type]
    assert isinstance(m, PDConnectorMetadata) and len(m.sends) == 1
    return m.sends


@BOTH_BACKENDS
def test_source_decoder_pushes_a_held_room_to_a_target_decoder(rig: Rig) -> None:
    src = _source_decoder(rig, seed=11, migrate_hold_s=30.0)
    target = rig.make("decode")
    before = snapshot(target.kv)
    sched = PDScheduler(src.mgr.cfg, block_size=BLOCK_SIZE)
    held = [3, 7, 8, 1]  # 60 tokens computed (prompt 40 + 21 generated - 1)
    src.mgr.add_sends(_held_job(sched, "src-1", held, computed=60))
    assert src.room_state(MIGRATE) is RoomState.READY
    stats = src.mgr.take_stats()  # D reports the rooms it holds too (vllm:pd_kv_rooms_held)
    assert stats is not None and list(stats["gauges"]["rooms_held"].values()) == [1]
    # The target resumes with the 57 tokens the client got: prefilled_tokens 56 -> 4 blocks from block 0;
    # a shorter resume asks for fewer blocks than the room holds.
    dst = [12, 2, 5, 9]
    target.mgr.add_recvs([recv_job(rig, "t-1", MIGRATE, dst, num_tokens=56, dp_rank=0)])
    target.wait_recv("t-1")
    src.wait_sent("src-1")
    assert target.failed == {}
    for name in src.kv:
        assert torch.equal(target.kv[name][dst].view(torch.int16), src.kv[name][held].view(torch.int16)), name
        others = [b for b in range(NUM_BLOCKS) if b not in dst]
        assert torch.equal(target.kv[name][others].view(torch.int16), before[name][others].view(torch.int16))
    assert src.stats().transfers_ok == 1
    assert src.stats().bytes_sent == len(held) * LAYERS * src.mgr.regions[0].block_bytes
    assert src.mgr.prefill is not None and src.mgr.prefill.rooms_held() == 0
    sched.update_connector_output(KVConnectorOutput(finished_sending=src.sending))
    assert not sched.has_pending_push_work()
    assert src.idle() and target.idle()


def test_source_decoder_push_of_fewer_blocks_than_held(rig: Rig) -> None:
    src = _source_decoder(rig, seed=12)
    target = rig.make("decode")
    sched = PDScheduler(src.mgr.cfg, block_size=BLOCK_SIZE)
    held = [4, 5, 6, 10]
    src.mgr.add_sends(_held_job(sched, "src-2", held, computed=62))
    dst = [0, 1]  # the client got fewer tokens than D generated: 2 blocks
    target.mgr.add_recvs([recv_job(rig, "t-2", MIGRATE, dst, num_tokens=30, dp_rank=0)])
    target.wait_recv("t-2")
    src.wait_sent("src-2")
    assert target.failed == {}
    for name in src.kv:
        assert torch.equal(target.kv[name][dst].view(torch.int16), src.kv[name][held[:2]].view(torch.int16))
    assert src.stats().bytes_sent == 2 * LAYERS * src.mgr.regions[0].block_bytes


def test_unclaimed_migrate_room_expires_after_migrate_hold_s(rig: Rig, pd_logs: pytest.LogCaptureFixture) -> None:
    src = _source_decoder(rig, seed=13, migrate_hold_s=0.5, room_timeout_s=60.0)
    sched = PDScheduler(src.mgr.cfg, block_size=BLOCK_SIZE)
    t0 = time.monotonic()
    src.mgr.add_sends(_held_job(sched, "src-3", [2, 3, 4], computed=45))
    assert src.mgr.prefill is not None and src.mgr.prefill.rooms_held() == 1
    src.wait_sent("src-3", timeout=10.0)
    assert 0.45 <= time.monotonic() - t0 < 10  # migrate_hold_s, not room_timeout_s
    assert src.stats().rooms_expired == 1 and src.stats().bytes_sent == 0
    assert f"room={MIGRATE} req=src-3: no decode asked for this KV within 0.5 s" in pd_logs.text
    wait_for(src.idle, timeout=5, what="the expired room to leave the table")
    sched.update_connector_output(KVConnectorOutput(finished_sending={"src-3"}))
    assert not sched.has_pending_push_work()
    # A target asking after that is told the room's own hold, not room_timeout_s.
    target = rig.make("decode")
    target.mgr.add_recvs([recv_job(rig, "t-3", MIGRATE, [0, 1], num_tokens=45, dp_rank=0)])
    target.wait_recv("t-3")
    assert "t-3" in target.failed
    assert "prefill freed the KV after waiting 0.5 s for decode" in pd_logs.text


# ------------------------------------------------------------------ inside vLLM's real scheduler


def test_real_scheduler_keeps_an_aborted_requests_blocks_until_finished_sending(tiny_model: Path) -> None:
    """vLLM (either line) calls request_finished for a kv_consumer's ABORTED request and keeps its blocks
    while PDConnector holds them; num_computed_tokens is prompt + generated - 1 there."""
    sched = make_scheduler(tiny_model, "kv_consumer", migration=True, migrate_hold_s=2.0, bootstrap_port=18900)
    params = DecodeParams(99, "127.0.0.1", 18800, 0, migrate_room=MIGRATE).to_json()
    sched.add_request(request("d-m", params, max_tokens=32))
    step(sched)  # load asked for
    step(sched, KVConnectorOutput(finished_recving={"d-m"}))
    for _ in range(5):  # the last prompt token's step, then decode steps: 5 tokens sampled
        step(sched)
    req = sched.requests["d-m"]
    generated = len(req.output_token_ids)
    assert generated == 5 and req.num_computed_tokens == len(PROMPT) + generated - 1
    sched.finish_requests("d-m", RequestStatus.FINISHED_ABORTED)  # the Router closed the stream
    _, meta_, _ = step(sched)
    (job,) = meta_.sends
    assert (job.room, job.num_tokens, job.hold_s) == (MIGRATE, len(PROMPT) + 4, 2.0)
    assert len(job.block_ids) == -(-job.num_tokens // BLOCK)
    used = SCHED_BLOCKS - 1 - sched.kv_cache_manager.block_pool.get_num_free_blocks()
    assert used >= len(job.block_ids) and "d-m" in sched.requests
    step(sched)
    assert SCHED_BLOCKS - 1 - sched.kv_cache_manager.block_pool.get_num_free_blocks() == used  # still held
    step(sched, KVConnectorOutput(finished_sending={"d-m"}))
    assert sched.kv_cache_manager.block_pool.get_num_free_blocks() == SCHED_BLOCKS - 1 and "d-m" not in sched.requests
    assert not sched.connector.has_pending_push_work()


# ------------------------------------------------------------------ the worker


def test_migration_decoder_worker_hosts_its_bootstrap_server_and_takes_sends(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(worker_mod, "_tp_rank_and_size", lambda: (0, 1))
    port = free_port()
    extra = {"backend": "inproc", "local_ip": HOST, "migration": True, "bootstrap_port": port, "migrate_hold_s": 30}
    cfg = parse_config("kv_consumer", extra)
    model = SimpleNamespace(use_mla=False, get_total_num_kv_heads=lambda: HEADS, dtype="float16")
    vllm_config = SimpleNamespace(
        model_config=model,
        cache_config=SimpleNamespace(block_size=BLOCK_SIZE, cache_dtype="auto", num_gpu_blocks=NUM_BLOCKS),
        parallel_config=SimpleNamespace(data_parallel_index=0, data_parallel_rank=0, data_parallel_size=1),
        observability_config=SimpleNamespace(otlp_traces_endpoint=None),
        kv_transfer_config=SimpleNamespace(kv_port=14579),  # vLLM's default: a random ZMQ port
    )
    worker = PDWorker(cfg, vllm_config, None)  # type: ignore[arg-type]
    try:
        worker.register_kv_caches(make_kv())
        assert worker.bootstrap is not None and worker.bootstrap.port == port
        assert worker.bootstrap.state.is_ready  # this rank registered at D's own server
        assert worker.manager is not None and worker.manager.prefill is not None and worker.manager.decode is not None
        worker.start_step(PDConnectorMetadata(sends=[SendJob("d-1", MIGRATE, [1, 2], 20, hold_s=30.0)]))
        assert worker.manager.prefill.rooms_held() == 1
    finally:
        worker.shutdown()
