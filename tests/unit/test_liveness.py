"""transfer.liveness: the PeerWatch state machine on a fake clock, Heartbeats' frames, P's pure helpers,
the peer_timeout_s key and D's scheduler telling P about requests that ended before their load."""

from __future__ import annotations

from typing import Any

import pytest
from vllm.v1.request import RequestStatus

from pd_connector import messages as proto
from pd_connector.config import ConfigError, parse_config
from pd_connector.metadata import SendJob
from pd_connector.scheduler import PDScheduler
from pd_connector.transfer.liveness import (
    Heartbeats,
    PeerState,
    PeerWatch,
    claims_toward,
    decode_peers_waited_on,
)
from pd_connector.transfer.rooms import ClaimKey, Room, WaitingRequest
from pd_connector.transfer.states import RoomState
from tests.support.fake_scheduler import D_PARAMS, FakeBlocks, FakeRequest, meta

A, B = "tcp://10.0.0.1:5000", "tcp://[::1]:6000"


# ------------------------------------------------------------------ PeerWatch


def test_no_work_means_no_pings_and_no_state() -> None:
    watch = PeerWatch(5.0)
    beat = watch.tick(0.0, [])
    assert beat.ping == [] and beat.lost == []
    watch.heard(A, 1.0)  # a peer nobody waits on is not remembered
    assert watch.state(A) is PeerState.IDLE


def test_a_busy_peer_is_pinged_at_once_then_every_interval() -> None:
    watch = PeerWatch(5.0)  # interval 1 s
    assert watch.interval_s == 1.0
    assert watch.tick(0.0, [A]).ping == [A]
    assert watch.state(A) is PeerState.WATCHED
    assert watch.tick(0.5, [A]).ping == []
    assert watch.tick(1.0, [A]).ping == [A]
    assert watch.tick(1.2, {A, B}).ping == [B]  # B's work just started: pinged at once


def test_a_peer_that_answers_stays_watched_forever() -> None:
    watch = PeerWatch(2.0)
    lost = []
    for step in range(200):  # 20 s of 0.1 s ticks, answered every 0.5 s
        now = step * 0.1
        if step % 5 == 0:
            watch.heard(A, now)
        lost += watch.tick(now, [A]).lost
    assert lost == [] and watch.state(A) is PeerState.WATCHED


def test_a_silent_peer_is_lost_once_after_the_timeout() -> None:
    watch = PeerWatch(2.0)
    watch.tick(10.0, [A])
    watch.heard(A, 11.0)
    assert watch.tick(12.9, [A]).lost == []  # heard 1.9 s ago
    beat = watch.tick(13.0, [A])
    assert [(x.endpoint, x.silent_s) for x in beat.lost] == [(A, 2.0)]
    assert watch.state(A) is PeerState.LOST
    # Still busy on the next tick (new work toward it): a fresh window, not a second report at once.
    assert watch.tick(13.1, [A]).lost == []
    assert watch.state(A) is PeerState.WATCHED
    assert [x.endpoint for x in watch.tick(15.1, [A]).lost] == [A]


def test_the_window_starts_when_the_work_starts() -> None:
    watch = PeerWatch(2.0)
    watch.heard(A, 0.0)  # not watched yet: ignored
    watch.tick(100.0, [A])
    assert watch.tick(101.9, [A]).lost == []
    assert len(watch.tick(102.0, [A]).lost) == 1


def test_a_peer_without_work_left_is_forgotten_and_never_reported() -> None:
    watch = PeerWatch(2.0)
    watch.tick(0.0, [A, B])
    watch.tick(1.0, [B])  # A's work ended
    assert watch.state(A) is PeerState.IDLE
    beat = watch.tick(5.0, [B])
    assert [x.endpoint for x in beat.lost] == [B]
    watch.heard(B, 6.0)  # heard again after being lost: no longer LOST
    assert watch.state(B) is PeerState.IDLE


@pytest.mark.parametrize("bad", [0.0, -1.0])
def test_peer_watch_refuses_a_timeout_that_is_not_positive(bad: float) -> None:
    with pytest.raises(ValueError, match="peer timeout"):
        PeerWatch(bad)


# ------------------------------------------------------------------ Heartbeats


class Wire:
    def __init__(self) -> None:
        self.sent: list[tuple[str, proto.Message]] = []

    def send(self, endpoint: str, msg: proto.Message) -> None:
        self.sent.append((endpoint, msg))


def test_heartbeats_ping_due_peers_and_answer_pings() -> None:
    wire = Wire()
    beats = Heartbeats(PeerWatch(5.0), "tcp://127.0.0.1:7000", wire.send)
    assert beats.tick(0.0, {A}) == []
    assert wire.sent == [(A, proto.Ping(about=A, reply_to="tcp://127.0.0.1:7000"))]
    wire.sent.clear()
    beats.on_ping(proto.Ping(about="tcp://127.0.0.1:7000", reply_to=B), 1.0)
    assert wire.sent == [(B, proto.Pong(about="tcp://127.0.0.1:7000"))]
    beats.on_pong(proto.Pong(about=A), 4.0)
    assert beats.tick(8.0, {A}) == []  # heard at 4.0: 4 s < 5 s
    assert [x.endpoint for x in beats.tick(9.0, {A})] == [A]


@pytest.mark.parametrize("reply_to", ["", "ipc:///tmp/x", "tcp://host", "tcp://a b:1", "tcp://h:1/x"])
def test_a_ping_with_a_malformed_reply_endpoint_is_dropped(reply_to: str) -> None:
    wire = Wire()
    Heartbeats(PeerWatch(5.0), A, wire.send).on_ping(proto.Ping(about=A, reply_to=reply_to), 0.0)
    assert wire.sent == []


def test_ping_and_pong_round_trip_on_the_wire() -> None:
    for msg in (proto.Ping(about=A, reply_to=B), proto.Pong(about=B)):
        assert proto.decode(proto.encode(msg)) == msg


# ------------------------------------------------------------------ P side, pure


def _hello(peer_id: str, endpoint: str) -> proto.PeerHello:
    return proto.PeerHello(peer_id, b"", endpoint, 0, 1, 16, "float16", 2, [])


def _req(room: int, rid: str, peer_id: str, endpoint: str = "") -> proto.TransferRequest:
    return proto.TransferRequest(room, rid, peer_id, [1], 0, endpoint)


def test_prefill_watches_the_decode_ranks_of_waiting_requests_and_running_writes() -> None:
    peers = {"d1": _hello("d1", A), "d2": _hello("d2", B)}
    waiting = Room(1, RoomState.AWAITING_PREFILL, waiting=[WaitingRequest(_req(1, "r1", "d1"), 9.0)])
    unknown = Room(2, RoomState.AWAITING_PREFILL, waiting=[WaitingRequest(_req(2, "r2", "d9", "tcp://h:1"), 9.0)])
    job = SendJob("p3", 3, [0], 16)
    writing = Room(3, RoomState.READY, job, submitted=1, submitted_ids={ClaimKey("r3", "d2")})
    done = Room(4, RoomState.READY, job, submitted=1, finished=1, submitted_ids={ClaimKey("r4", "d2")})
    rooms = [waiting, unknown, writing, done]
    assert decode_peers_waited_on(rooms, peers) == {A, B, "tcp://h:1"}
    assert decode_peers_waited_on([done], peers) == set()
    assert claims_toward(A, rooms, peers) == [proto.TransferCancel(1, "r1", "d1")]
    assert claims_toward(B, rooms, peers) == [proto.TransferCancel(3, "r3", "d2")]
    assert claims_toward("tcp://h:1", rooms, peers) == [proto.TransferCancel(2, "r2", "d9")]


# ------------------------------------------------------------------ config


def test_peer_timeout_s_defaults_to_5_and_is_validated() -> None:
    assert parse_config("kv_consumer", {}).peer_timeout_s == 5.0
    assert parse_config("kv_producer", {"peer_timeout_s": "2.5"}).peer_timeout_s == 2.5
    for bad in (0, -1, 0.1, 1e9, "nan"):
        with pytest.raises(ConfigError, match="peer_timeout_s"):
            parse_config("kv_consumer", {"peer_timeout_s": bad})
    with pytest.raises(ConfigError, match="peer_timeout_s must be a number"):
        parse_config("kv_consumer", {"peer_timeout_s": "soon"})


# ------------------------------------------------------------------ D's scheduler: abandoned rooms


def _dsched() -> PDScheduler:
    return PDScheduler(parse_config("kv_consumer", {}), block_size=16)


def _finish(s: PDScheduler, req: Any, status: RequestStatus = RequestStatus.FINISHED_ABORTED) -> None:
    req.status = status
    delay, answer = s.request_finished(req, [])
    assert not delay and (answer is None or set(answer) == {"pd_kv"})  # a finished one: its KV account


def test_decode_request_aborted_before_its_load_tells_prefill() -> None:
    s = _dsched()
    queued = FakeRequest("q", dict(D_PARAMS), 100)
    s.get_num_new_matched_tokens(queued, 0)  # considered, never allocated (D was full)
    _finish(s, queued)
    (job,) = meta(s).abandoned
    assert (job.req_id, job.room, job.bootstrap_addr, job.prefill_dp_rank) == ("q", 77, "10.1.2.3:18800", 1)
    assert job.dst_block_ids == []
    assert meta(s).abandoned == []  # handed over once


def test_decode_request_whose_load_was_asked_for_abandons_nothing() -> None:
    s = _dsched()
    loaded = FakeRequest("l", dict(D_PARAMS), 100)
    s.get_num_new_matched_tokens(loaded, 0)
    s.update_state_after_alloc(loaded, FakeBlocks(list(range(7))), 100)
    assert len(meta(s).recvs) == 1
    _finish(s, loaded, RequestStatus.FINISHED_STOPPED)
    local = FakeRequest("x", None, 10)
    _finish(s, local)
    assert meta(s).abandoned == []


def test_prefill_scheduler_abandons_nothing() -> None:
    s = PDScheduler(parse_config("kv_producer", {}), block_size=16)
    _finish(s, FakeRequest("p", {"do_remote_decode": True, "bootstrap_room": 5}, 100))
    assert meta(s).abandoned == []
