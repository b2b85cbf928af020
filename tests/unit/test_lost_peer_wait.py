"""A lost P rank is told to stop and waited for; a load's wait comes from the P ranks it asked.

Liveness declares a P rank lost when its frames stop reaching D. That P may be alive, its answers cut,
its writes still landing: D sends it a ``TransferCancel`` anyway and keeps the load's blocks until it
answers or for ``loads.lost_wait_s``. On the transfer rig (tests/support/transfer_rig.py: real ZMQ,
bootstrap server, managers), every frame of P's to D is dropped while P's write runs: no byte lands
after D hands the blocks back, and with D releasing at the loss (the old behaviour) one does. P's
advertised bounds (``RegisterRank.batch_stall_s`` / ``peer_timeout_s``, passed on in the route's
``RankInfo``) set the wait of a load that asked it, whatever D's own transport.
"""

from __future__ import annotations

import time

import msgspec
import pytest

from pd_connector import messages as proto
from pd_connector.bootstrap.client import register_rank
from pd_connector.config import DisaggConfig, parse_config
from pd_connector.messages import DoneStatus, RankInfo, RegisterRank
from pd_connector.metadata import RecvJob
from pd_connector.trace import TraceBook
from pd_connector.transfer import decode_side as decode_side_module
from pd_connector.transfer import loads
from pd_connector.transfer.context import RankContext, RankSpec
from pd_connector.transfer.decode_side import DecodeSide
from pd_connector.transfer.loads import Load, PeerTiming, lost_wait_s, own_timing, stop_wait_s, timing_of
from pd_connector.transfer.mooncake import stall_for
from pd_connector.transfer.outbox import Outbox
from pd_connector.transfer.states import LoadState
from pd_connector.transfer.stats import TransferStats
from tests.support.loopback import HOST, wait_for
from tests.support.slow_transport import Landings, late_landings, register_slow_backend, start_slow_push
from tests.support.transfer_rig import BLOCK_SIZE, DTYPE, LAYERS, Rig, Side, recv_job

# ------------------------------------------------------------ P advertises what bounds its writes


def _ascend_p_cfg(monkeypatch: pytest.MonkeyPatch) -> DisaggConfig:
    monkeypatch.setenv("ASCEND_TRANSFER_TIMEOUT", "120000")
    cfg = parse_config("kv_producer", {"use_ascend_direct": True})
    monkeypatch.delenv("ASCEND_TRANSFER_TIMEOUT")
    return cfg


def _tcp_d_cfg() -> DisaggConfig:
    cfg = parse_config("kv_consumer", {"protocol": "tcp"})
    assert cfg.backend_options.batch_stall_s == stall_for("tcp", {}) == 30.0  # D: Mooncake TCP's defaults
    return cfg


def test_a_load_waits_by_the_bounds_of_the_p_ranks_it_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    p_cfg, d_cfg = _ascend_p_cfg(monkeypatch), _tcp_d_cfg()
    assert p_cfg.backend_options.batch_stall_s == 120.0
    told = RankInfo(HOST, 1, p_cfg.backend_options.batch_stall_s, p_cfg.peer_timeout_s)
    timing = timing_of(d_cfg, [told])
    assert stop_wait_s(d_cfg, timing) >= 2 * 120.0 + d_cfg.peer_timeout_s
    assert lost_wait_s(d_cfg, timing) >= 2 * 120.0 + d_cfg.peer_timeout_s
    assert stop_wait_s(d_cfg) == 67.0  # D's own transport alone would have allowed this much
    # The largest among the ranks asked; a rank that told nothing (an older release) counts as D's own.
    quick = RankInfo(HOST, 2, 2.0, 0.5)
    assert timing_of(d_cfg, [quick, told]) == PeerTiming(120.0, 5.0)
    assert timing_of(d_cfg, [quick, RankInfo(HOST, 3)]) == own_timing(d_cfg) == PeerTiming(30.0, 5.0)
    assert timing_of(d_cfg, [RankInfo(HOST, 4, float("nan"), -1.0)]) == own_timing(d_cfg)  # nonsense: not told
    assert timing_of(d_cfg, [quick]) == PeerTiming(2.0, 0.5)  # a P rank with a local copy: a short wait


def test_the_bounds_travel_backward_compatibly() -> None:
    """An older P's registration and an older server's route decode (0: not told); an older D reads a
    newer route (msgspec ignores the fields it does not know)."""
    old_register = b'{"attn_tp_size":1,"attn_tp_rank":0,"attn_dp_size":1,"attn_dp_rank":0,"rank_ip":"h",'
    old_register += b'"rank_port":1,"block_size":16,"kv_cache_dtype":"float16"}'
    reg = msgspec.json.decode(old_register, type=RegisterRank)
    assert (reg.batch_stall_s, reg.peer_timeout_s) == (0.0, 0.0)
    assert msgspec.json.decode(b'{"rank_ip":"h","rank_port":1}', type=RankInfo) == RankInfo("h", 1)

    class OldRankInfo(msgspec.Struct):
        rank_ip: str
        rank_port: int

    new = msgspec.json.encode(RankInfo("h", 1, 120.0, 5.0))
    assert msgspec.json.decode(new, type=OldRankInfo) == OldRankInfo("h", 1)


@pytest.mark.parametrize("backend_name", ["inproc"])  # D: the default backend's options, Mooncake TCP's
def test_the_route_carries_each_ranks_bounds_to_d(
    rig: Rig, monkeypatch: pytest.MonkeyPatch, pd_logs: pytest.LogCaptureFixture
) -> None:
    """P registers (as the worker does) with HIXL's 120 s bound; D runs Mooncake TCP's defaults: D's load
    on that P gets P's bound, and once stopped it keeps the blocks at least 2 x 120 s + peer_timeout_s."""
    p_cfg = _ascend_p_cfg(monkeypatch)
    p = rig.make("prefill", register=False)
    info = RegisterRank(
        1, 0, 1, 0, HOST, p.mgr.rank_port, BLOCK_SIZE, DTYPE, num_layers=LAYERS,
        batch_stall_s=p_cfg.backend_options.batch_stall_s, peer_timeout_s=p_cfg.peer_timeout_s,
    )  # fmt: skip
    assert register_rank(f"{HOST}:{rig.bport}", info, retries=3, interval_s=0.05, timeout_s=5)
    d = rig.make("decode")
    assert d.mgr.cfg.backend_options.batch_stall_s == 30.0 and stop_wait_s(d.mgr.cfg) == 67.0
    decode = d.mgr.decode
    assert decode is not None
    d.mgr.add_recvs([recv_job(rig, "d-1", 7401, [1, 3])])  # P holds the request: no prefill yet
    wait_for(lambda: decode._loads["d-1"].state is LoadState.AWAITING_KV, 10, what="D to ask P")
    load = decode._loads["d-1"]
    assert load.timing == PeerTiming(120.0, p_cfg.peer_timeout_s)
    monkeypatch.setattr(d.mgr.channel, "_on_frame", lambda frame: None)  # P's answer to the cancel is lost
    t_cancel = time.monotonic()
    decode.cancel(["d-1"])
    assert load.state is LoadState.CANCELLING
    assert load.deadline - t_cancel >= 2 * 120.0 + d.mgr.cfg.peer_timeout_s
    assert load.wait_s == 2 * 120.0 + p_cfg.peer_timeout_s + loads.STOP_MARGIN_S


# ------------------------------------------------------------ DecodeSide's books with two P ranks

A, B = "tcp://127.0.0.1:5001", "tcp://127.0.0.1:5002"


def _decode_with_load() -> tuple[DecodeSide, Outbox, list[tuple[str, proto.Message]]]:
    cfg = parse_config("kv_consumer", {"local_ip": "127.0.0.1"})
    spec = RankSpec(tp_rank=0, tp_size=1, dp_rank=0, dp_size=1, block_size=16, kv_dtype="float16", num_layers=2)
    sent: list[tuple[str, proto.Message]] = []
    outbox = Outbox()
    ctx = RankContext(
        cfg, spec, [], lambda ep, msg: sent.append((ep, msg)), lambda fn, *a: fn(*a), TransferStats("t"), outbox,
        TraceBook("decode", enabled=False),
    )  # fmt: skip
    side = DecodeSide(ctx, b"d", "d-peer", "tcp://127.0.0.1:6000")
    job = RecvJob("d-1", 9, "127.0.0.1", 1, None, [3, 4], 0, 32)
    timing = PeerTiming(10.0, 5.0)  # as the P ranks advertised
    load = Load(job, time.monotonic() + 60, LoadState.AWAITING_KV, [A, B], {A: 0, B: 1}, p_tp=2, timing=timing)
    side._loads["d-1"] = load
    return side, outbox, sent


def _done(tp_rank: int, status: DoneStatus) -> proto.TransferDone:
    nbytes = 64 if status is DoneStatus.OK else -1
    return proto.TransferDone(room=9, request_id="d-1", tp_rank=tp_rank, status=status, nbytes=nbytes)


def test_a_lost_rank_is_cancelled_and_held_until_it_answers() -> None:
    side, outbox, sent = _decode_with_load()
    side.on_done(_done(1, DoneStatus.OK))  # rank 1 finished its write
    side.peer_lost(A, 5.0)
    assert [(ep, type(m).__name__) for ep, m in sent] == [(A, "TransferCancel")]
    assert outbox.take() == (set(), set(), {})  # rank 0 may still be writing
    load = side._loads["d-1"]
    assert load.state is LoadState.CANCELLING and load.lost == {0}
    assert load.wait_s == lost_wait_s(side._cfg, PeerTiming(10.0, 5.0)) == 2 * 10.0 + 5.0 + loads.STOP_MARGIN_S
    assert side.peers_waited_on() == set()  # not watched again for this load: it was already declared lost
    side.peer_lost(A, 5.0)  # declared lost again (other work toward it): still held, no second cancel
    assert len(sent) == 1 and outbox.take() == (set(), set(), {})
    side.on_done(_done(0, DoneStatus.CANCELLED))  # its answer got through after all: the wait ends
    assert outbox.take() == (set(), {"d-1"}, {"d-1": [3, 4]})
    assert side.loads_waiting() == 0


def test_a_lost_rank_that_never_answers_is_held_for_the_lost_wait(pd_logs: pytest.LogCaptureFixture) -> None:
    side, outbox, sent = _decode_with_load()
    t_lost = time.monotonic()
    side.peer_lost(B, 5.0)  # rank 1 lost while rank 0 still writes: both are told to stop
    assert {ep for ep, _ in sent} == {A, B}
    assert side.peers_waited_on() == {A}
    side.on_done(_done(0, DoneStatus.CANCELLED))  # rank 0 stopped; rank 1 may still write
    side.expire(t_lost + lost_wait_s(side._cfg, PeerTiming(10.0, 5.0)) - 0.5)
    assert outbox.take() == (set(), set(), {})
    side.expire(t_lost + lost_wait_s(side._cfg, PeerTiming(10.0, 5.0)) + 0.5)
    assert outbox.take()[2] == {"d-1": [3, 4]}
    assert "silent for 5.0 s (peer_timeout_s 5); prefill did not answer within 27 s" in pd_logs.text


def test_a_rank_lost_while_the_load_stops_keeps_the_wait_it_had() -> None:
    """The load was already stopping (cancelled): the lost rank was told then, the wait from then covers it."""
    side, outbox, sent = _decode_with_load()
    side.cancel(["d-1"])
    deadline = side._loads["d-1"].deadline
    side.peer_lost(A, 5.0)
    side.on_done(_done(1, DoneStatus.CANCELLED))
    assert outbox.take() == (set(), set(), {}) and side._loads["d-1"].deadline == deadline
    assert [type(m).__name__ for _, m in sent] == ["TransferCancel", "TransferCancel"]  # one per rank, at the cancel


# ------------------------------------------------------------ on the rig: P's frames to D cut mid-write

PEER_TIMEOUT_S = 0.5
BATCH_S = 0.4  # each one-entry batch of P's lasts this long
STALL_S = 0.6  # the slow transport's bound on one batch (> BATCH_S): lost wait 2 x 0.6 + 0.5 + 0.2 = 1.9 s
NAME = "slow-lost"
P_BLOCKS, D_BLOCKS = [2, 4, 6, 8], [1, 3, 5, 7]  # 8 one-entry batches: 3.2 s of writing


LANDINGS = Landings(BATCH_S)
register_slow_backend(NAME, STALL_S, LANDINGS)


@pytest.fixture
def backend_name() -> str:
    return NAME


@pytest.fixture
def landings() -> Landings:
    return LANDINGS.reset()


def _cut_pair(rig: Rig, monkeypatch: pytest.MonkeyPatch, room: int) -> tuple[Side, Side, dict[str, float]]:
    """P pushes 8 batches of BATCH_S; once the first started, every frame of P's to D is dropped (D's to
    P still arrive): D's liveness declares P lost while P writes. Returns P, D and D's hand-back times
    (``d.heal()`` lets P's frames through again)."""
    p, d, handed = start_slow_push(rig, monkeypatch, room, (P_BLOCKS, D_BLOCKS), PEER_TIMEOUT_S)
    assert LANDINGS.started.wait(10)
    channel, on_frame = d.mgr.channel, d.mgr.channel._on_frame
    monkeypatch.setattr(channel, "_on_frame", lambda frame: None)  # P -> D cut: no Pong, Ping, answer
    monkeypatch.setattr(d, "heal", lambda: setattr(channel, "_on_frame", on_frame), raising=False)
    return p, d, handed


def test_no_byte_lands_after_a_lost_p_ranks_load_is_released(
    rig: Rig, monkeypatch: pytest.MonkeyPatch, landings: Landings, pd_logs: pytest.LogCaptureFixture
) -> None:
    p, d, handed = _cut_pair(rig, monkeypatch, 7402)
    d.wait_recv("d-1", timeout=20)
    p.wait_sent("p-1", timeout=20)  # P's push ended: every write it made has landed
    assert d.failed == {"d-1": D_BLOCKS}
    assert landings.at, "the slow push wrote nothing: the test proves nothing"
    assert late_landings(landings, d, handed["d-1"]) == []
    assert len(landings.at) < 2 * len(P_BLOCKS)  # P got D's cancel and stopped between batches
    assert "KV load failed: prefill rank" in pd_logs.text and "prefill did not answer within 1.9 s" in pd_logs.text


def test_releasing_at_the_loss_would_let_a_byte_land_after(
    rig: Rig, monkeypatch: pytest.MonkeyPatch, landings: Landings
) -> None:
    """The same cut with D counting the lost rank as stopped at once (no wait): the batch P has in flight
    lands after D handed the blocks back. This is what the test above guards against."""
    monkeypatch.setattr(decode_side_module, "lost_wait_s", lambda cfg, timing=None: 0.0)
    p, d, handed = _cut_pair(rig, monkeypatch, 7403)
    d.wait_recv("d-1", timeout=20)
    p.wait_sent("p-1", timeout=20)
    late = late_landings(landings, d, handed["d-1"])
    assert late and {block for _, block in late} <= set(D_BLOCKS)


def test_a_lost_p_ranks_late_answer_ends_the_wait(
    rig: Rig, monkeypatch: pytest.MonkeyPatch, landings: Landings, pd_logs: pytest.LogCaptureFixture
) -> None:
    """P's batch is held while D declares P lost; then P's frames get through again and P, having got
    D's cancel, answers once its batch landed: D releases on that answer, well before the lost wait."""
    monkeypatch.setattr(decode_side_module, "lost_wait_s", lambda cfg, timing=None: 600.0)
    landings.gate.clear()
    p, d, handed = _cut_pair(rig, monkeypatch, 7404)
    decode = d.mgr.decode
    assert decode is not None
    wait_for(lambda: decode._loads["d-1"].lost, 10, what="D to declare P lost")
    assert decode._loads["d-1"].wait_s == 600.0
    d.heal()  # type: ignore[attr-defined]  # P's frames reach D again
    landings.gate.set()
    d.wait_recv("d-1", timeout=20)  # far sooner than the 600 s wait: P's answer ended it
    p.wait_sent("p-1", timeout=20)
    assert late_landings(landings, d, handed["d-1"]) == []
    assert len(landings.at) == 1  # the batch in flight at the cancel, no other
    assert "prefill answered" in pd_logs.text
