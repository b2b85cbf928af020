"""A room released on P's bootstrap server (the client's request ended) is freed on every P rank at once,
and a D that asks for it afterwards is refused at once, naming why.

Transfer side on the in-process rig of test_transfer_manager (real ZMQ, real bootstrap server); the
room calls (``bootstrap.rooms_api``) on a second real bootstrap server over the rig's state, called
with the real, signed client."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from pd_connector.bootstrap.client import BootstrapError, release_room, room_status
from pd_connector.bootstrap.rooms_api import RankRooms
from pd_connector.bootstrap.server import BootstrapServer, BootstrapState
from pd_connector.messages import RankInfo
from pd_connector.metadata import SendJob
from pd_connector.transfer.states import RoomState
from tests.support.loopback import HOST, free_port, wait_for
from tests.support.transfer_rig import BLOCK_SIZE, Rig, Side, recv_job
from tests.unit.test_write_after_free import D_BLOCKS, P_BLOCKS, _assert_nothing_landed_after, _slow_pair

TOKEN = b"release-room-test-token-0123456789"


def _rooms_server(rig: Rig, p: Side, token: bytes | None = None) -> BootstrapServer:
    """A bootstrap server over the rig's state whose room calls act on ``p`` (as the leader rank)."""
    prefill = p.mgr.prefill
    assert prefill is not None
    rooms = RankRooms(rig.server.state, prefill, p.mgr.channel.send, p.mgr.endpoint)
    server = BootstrapServer(rig.server.state, HOST, free_port(), token, rooms=rooms)
    server.start()
    return server


@pytest.fixture
def rooms_server(rig: Rig) -> Iterator[tuple[Side, str]]:
    p = rig.make("prefill", seed=21)
    server = _rooms_server(rig, p)
    try:
        yield p, f"{HOST}:{server.port}"
    finally:
        server.stop()


def test_a_held_room_is_freed_at_once_and_a_later_decode_is_refused_naming_why(
    rig: Rig, rooms_server: tuple[Side, str]
) -> None:
    p, addr = rooms_server
    d = rig.make("decode")
    p.mgr.add_sends([SendJob("p-req", 61, [1, 2], 2 * BLOCK_SIZE)])
    assert room_status(addr, 61, 2.0)["state"] == "held"
    answer = release_room(addr, 61, "client disconnected before the answer", 2.0)
    assert answer == {"room": 61, "before": "held", "ranks_told": 1}
    p.wait_sent("p-req", timeout=2)  # vLLM frees P's blocks now, not after room_timeout_s
    assert p.idle()
    status = room_status(addr, 61, 2.0)
    assert status["state"] == "closed" and "client disconnected before the answer" in str(status["detail"])
    t0 = time.monotonic()
    d.mgr.add_recvs([recv_job(rig, "d-req", 61, [4, 5])])
    d.wait_recv("d-req", timeout=3)
    assert d.failed == {"d-req": [4, 5]}
    assert time.monotonic() - t0 < 3  # not the 5 s grace of a closed room, nor kv_wait_timeout_s
    assert d.idle()


def test_a_room_released_before_its_prefill_is_freed_as_the_prefill_ends(rooms_server: tuple[Side, str]) -> None:
    p, addr = rooms_server
    assert room_status(addr, 62, 2.0)["state"] == "unknown"
    assert release_room(addr, 62, "client aborted", 2.0)["before"] == "unknown"
    assert p.idle()
    p.mgr.add_sends([SendJob("p-req", 62, [1], BLOCK_SIZE)])
    p.wait_sent("p-req", timeout=2)
    assert p.idle() and p.room_state(62) is None


def test_a_decode_waiting_for_the_prefill_is_answered_at_once(rig: Rig, rooms_server: tuple[Side, str]) -> None:
    p, addr = rooms_server
    d = rig.make("decode")
    d.mgr.add_recvs([recv_job(rig, "d-req", 63, [4, 5])])
    wait_for(lambda: p.room_state(63) is RoomState.AWAITING_PREFILL, what="P to hold D's request")
    assert room_status(addr, 63, 2.0)["state"] == "awaiting_prefill"
    assert release_room(addr, 63, "client disconnected", 2.0)["before"] == "awaiting_prefill"
    d.wait_recv("d-req", timeout=3)  # refused at once, not after kv_wait_timeout_s (30 s here)
    assert d.failed == {"d-req": [4, 5]}
    p.mgr.add_sends([SendJob("p-req", 63, [1, 2], 2 * BLOCK_SIZE)])
    p.wait_sent("p-req", timeout=2)
    assert p.idle() and d.idle()


def test_every_registered_p_rank_is_told(rig: Rig, engines: Any) -> None:
    """The leader releases its own room and tells the other ranks of the rank table by ZMQ frames."""
    leader = rig.make("prefill", seed=22)
    other = rig.make("decode", migration=True)  # a second rank that holds rooms (D with migration pushes KV)
    assert other.mgr.prefill is not None and leader.mgr.prefill is not None
    state = BootstrapState(attn_tp_size=2, attn_dp_size=1)
    state.rank_table[(0, 0, 0, 0)] = RankInfo(HOST, leader.mgr.rank_port)
    state.rank_table[(0, 0, 1, 0)] = RankInfo(HOST, other.mgr.rank_port)
    rooms = RankRooms(state, leader.mgr.prefill, leader.mgr.channel.send, leader.mgr.endpoint)
    leader.mgr.add_sends([SendJob("p-req", 64, [1], BLOCK_SIZE)])
    other.mgr.add_sends([SendJob("o-req", 64, [2], BLOCK_SIZE)])
    assert rooms.release(64, "client disconnected")["ranks_told"] == 2
    leader.wait_sent("p-req", timeout=2)
    other.wait_sent("o-req", timeout=2)
    assert other.mgr.prefill.room_status(64)[0] == "closed"


def test_room_calls_are_signed_for_this_server_and_refuse_bad_reasons(rig: Rig) -> None:
    p = rig.make("prefill", seed=23)
    server = _rooms_server(rig, p, TOKEN)
    addr = f"{HOST}:{server.port}"
    try:
        with pytest.raises(BootstrapError, match="HTTP 401"):
            release_room(addr, 65, "no token", 2.0)  # unsigned
        with pytest.raises(BootstrapError, match="HTTP 401"):
            room_status(addr, 65, 2.0, token=b"another-deployments-token-0123456")
        assert release_room(addr, 65, "signed", 2.0, token=TOKEN)["room"] == 65
        assert room_status(addr, 65, 2.0, token=TOKEN)["state"] == "closed"
        with pytest.raises(BootstrapError, match="HTTP 400"):
            release_room(addr, 65, "x" * 201, 2.0, token=TOKEN)
        with pytest.raises(BootstrapError, match="HTTP 400"):
            release_room(addr, 65, "line\nbreak", 2.0, token=TOKEN)
    finally:
        server.stop()


def test_without_prefill_ranks_the_room_calls_answer_503() -> None:
    server = BootstrapServer(BootstrapState(attn_tp_size=1, attn_dp_size=1), HOST, free_port())
    server.start()
    try:
        reply = httpx.post(f"http://{HOST}:{server.port}/bootstrap/release_room", json={"room": 1})
        assert reply.status_code == 503 and "holds no rooms" in reply.json()["error"]
        reply = httpx.post(f"http://{HOST}:{server.port}/bootstrap/release_room", json={"room": "x"})
        assert reply.status_code == 400 and "ReleaseRoom" in reply.json()["error"]
    finally:
        server.stop()


def test_a_release_during_a_push_stops_it_between_batches_and_nothing_lands_after_d_let_go(
    rig: Rig, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The room is released while P is inside a 1 s batch and D's request is aborted at once: P starts no
    further batch, D hands its blocks back only after P answered (the batch in flight landed first), and
    P frees the room once that batch returned."""
    p, d, slow, hand = _slow_pair(rig, monkeypatch, 1.0)
    p.mgr.add_sends([SendJob("p-1", 66, P_BLOCKS, BLOCK_SIZE * len(P_BLOCKS))])
    d.mgr.add_recvs([recv_job(rig, "d-1", 66, D_BLOCKS)])
    assert slow.started.wait(10)  # P is inside its first batch
    assert p.mgr.prefill is not None and d.mgr.decode is not None
    assert p.mgr.prefill.release_room(66, "client disconnected mid-push") == "held"
    d.mgr.decode.cancel(["d-1"])  # the client's request is gone on D too
    d.wait_recv("d-1", timeout=20)
    p.wait_sent("p-1", timeout=20)  # the room is freed once the batch in flight returned
    handed_back, failed = hand.at["d-1"]
    assert failed == D_BLOCKS
    _assert_nothing_landed_after(slow, d, handed_back)
    assert len(slow.landed) == 1  # no batch started after the release
    assert p.idle() and d.idle()
