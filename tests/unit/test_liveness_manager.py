"""Liveness and abandoned rooms between a real prefill and decode KVTransferManager (real ZMQ, real
bootstrap server, in-process backend): a silent peer fails its work within peer_timeout_s, a live
one never does, and a D request that ended before asking makes P free the room at once.

A peer "goes silent" by stopping its channel's listener: it answers no Ping from then on, exactly
what a frozen or vanished process looks like from the other side.
"""

from __future__ import annotations

import time

import pytest

from pd_connector.metadata import SendJob
from pd_connector.transfer import decode_side as decode_side_module
from pd_connector.transfer.liveness import PeerState
from pd_connector.transfer.states import RoomState
from tests.support.loopback import wait_for
from tests.support.transfer_rig import BLOCK_SIZE, Rig, recv_job

PEER_TIMEOUT_S = 1.0
LOST_WAIT_S = 0.3
TOKEN = "liveness-test-token-0123456789"


def _send_job(req_id: str, room: int, blocks: list[int]) -> SendJob:
    return SendJob(req_id, room, blocks, BLOCK_SIZE * len(blocks))


@pytest.mark.parametrize("token", [False, True], ids=["no-token", "token"])
def test_live_peers_with_pending_work_are_never_lost(rig: Rig, token: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """D waits 3 x peer_timeout_s for a slow prefill: both ranks ping each other meanwhile (signed
    frames with a token), nothing is declared lost, and the KV lands once the prefill comes."""
    extra = {"peer_timeout_s": PEER_TIMEOUT_S}
    if token:
        monkeypatch.setenv("PD_TOKEN_LIVENESS", TOKEN)
        extra["auth_token_env"] = "PD_TOKEN_LIVENESS"
    p = rig.make("prefill", **extra)
    d = rig.make("decode", **extra)
    d.mgr.add_recvs([recv_job(rig, "d-1", 501, [3, 4])])
    wait_for(lambda: p.room_state(501) is RoomState.AWAITING_PREFILL, 10, what="D's request waits on P")
    time.sleep(3 * PEER_TIMEOUT_S)
    assert p.mgr.channel.heartbeats.watch.state(d.mgr.endpoint) is PeerState.WATCHED
    assert d.mgr.channel.heartbeats.watch.state(p.mgr.endpoint) is PeerState.WATCHED
    p.mgr.add_sends([_send_job("p-1", 501, [1, 2])])
    d.wait_recv("d-1")
    p.wait_sent("p-1")
    assert d.failed == {} and d.stats().auth_refused == p.stats().auth_refused == 0
    # No work left: nobody is watched, nothing is pinged.
    wait_for(lambda: p.mgr.channel.heartbeats.watch.state(d.mgr.endpoint) is PeerState.IDLE, 2, what="P idle")
    wait_for(lambda: d.mgr.channel.heartbeats.watch.state(p.mgr.endpoint) is PeerState.IDLE, 2, what="D idle")


def test_a_silent_prefill_fails_decode_loads_within_peer_timeout(
    rig: Rig, pd_logs: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The loads fail once P is silent for peer_timeout_s; their blocks go back to vLLM after the lost wait
    (loads.lost_wait_s, short here: a silent P may still be writing, tests/unit/test_lost_peer_wait.py)."""
    monkeypatch.setattr(decode_side_module, "lost_wait_s", lambda cfg, timing=None: LOST_WAIT_S)
    p = rig.make("prefill", peer_timeout_s=PEER_TIMEOUT_S)
    d = rig.make("decode", peer_timeout_s=PEER_TIMEOUT_S)  # kv_wait_timeout_s 30
    d.mgr.add_recvs([recv_job(rig, "d-1", 502, [3]), recv_job(rig, "d-2", 503, [5, 6])])
    wait_for(lambda: p.room_state(503) is RoomState.AWAITING_PREFILL, 10, what="D's requests wait on P")
    p.mgr.channel.stop()  # P's listener ends: no more Pongs
    t0 = time.monotonic()
    wait_for(lambda: d.poll() or {"d-1", "d-2"} <= set(d.failed), 10 * PEER_TIMEOUT_S, what="loads failed")
    elapsed = time.monotonic() - t0
    assert PEER_TIMEOUT_S * 0.5 <= elapsed <= PEER_TIMEOUT_S + LOST_WAIT_S + 1.5, elapsed
    assert d.failed == {"d-1": [3], "d-2": [5, 6]}
    assert d.stats().recvs_failed == 2
    assert d.mgr.stats.take_interval()["failures"]["peer_lost"] == 2  # type: ignore[index]
    assert "silent for" in pd_logs.text and "KV load failed" in pd_logs.text
    assert d.idle()


def test_a_silent_decode_frees_its_rooms_on_prefill(rig: Rig, pd_logs: pytest.LogCaptureFixture) -> None:
    """D asked, then went silent before P's prefill finished: P drops D's request (no KV is written
    into a dead rank) and frees the prefill's KV the moment it comes, instead of after room_timeout_s."""
    p = rig.make("prefill", peer_timeout_s=PEER_TIMEOUT_S)  # room_timeout_s 30
    d = rig.make("decode", peer_timeout_s=PEER_TIMEOUT_S)
    d.mgr.add_recvs([recv_job(rig, "d-1", 504, [3, 4])])
    wait_for(lambda: p.room_state(504) is RoomState.AWAITING_PREFILL, 10, what="D's request waits on P")
    d.mgr.channel.stop()
    t0 = time.monotonic()
    wait_for(lambda: p.room_state(504) is None, 10 * PEER_TIMEOUT_S, what="P dropped the silent D's request")
    assert time.monotonic() - t0 <= PEER_TIMEOUT_S + 1.5
    p.mgr.add_sends([_send_job("p-1", 504, [1, 2])])
    p.wait_sent("p-1", timeout=1.0)
    assert p.idle() and p.mgr.stats.snapshot().transfers_ok == 0
    assert "decode rank" in pd_logs.text and "silent for" in pd_logs.text


def test_a_request_that_ended_before_asking_frees_the_room_at_once(rig: Rig) -> None:
    """D's vLLM finished the request while it queued (client gone): D tells P, which frees the KV it held."""
    p = rig.make("prefill")  # room_timeout_s 30
    d = rig.make("decode")
    p.mgr.add_sends([_send_job("p-1", 505, [1, 2, 3])])
    assert p.room_state(505) is RoomState.READY
    t0 = time.monotonic()
    assert d.mgr.decode is not None
    d.mgr.decode.abandon([recv_job(rig, "d-1", 505, [])])
    p.wait_sent("p-1", timeout=5.0)
    assert time.monotonic() - t0 < 1.0
    assert p.idle() and p.mgr.stats.snapshot().transfers_ok == 0
    assert d.idle() and d.recving == set()  # vLLM is not told about a request it already finished


def test_an_abandoned_room_before_its_prefill_is_freed_when_the_prefill_comes(rig: Rig) -> None:
    p = rig.make("prefill")
    d = rig.make("decode")
    assert d.mgr.decode is not None
    d.mgr.decode.abandon([recv_job(rig, "d-1", 506, [])])
    wait_for(lambda: 506 in p.mgr.prefill._early_cancels, 5, what="P remembered the cancel")  # type: ignore[union-attr]
    p.mgr.add_sends([_send_job("p-1", 506, [4])])
    p.wait_sent("p-1", timeout=1.0)
    assert p.idle()
