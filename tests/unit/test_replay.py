"""Frames bind sender, session, sequence and receiver; replays are refused.

A captured Pong no longer keeps a dead peer alive, a captured TransferRequest is not accepted twice,
stale and misdirected frames are refused, and P refuses a repeated claim in both transfer modes."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from pd_connector import messages as proto
from pd_connector.compat import version_problem
from pd_connector.keys import frame_key
from pd_connector.metadata import SendJob
from pd_connector.transfer.channel import Channel
from pd_connector.transfer.frames import FrameOpener, FrameRefused, FrameSealer
from pd_connector.transfer.liveness import Lost, PeerWatch
from pd_connector.transfer.states import RoomState
from pd_connector.transfer.stats import TransferStats
from tests.support.layer_streams import chunk, layer_mode, run_step
from tests.support.loopback import HOST, free_port, push_raw, wait_for
from tests.support.transfer_rig import BLOCK_SIZE, Rig, recv_job

TOKEN = b"replay-test-token-0123456789abcdef"
KEY = frame_key(TOKEN)
ME, PEER = "tcp://127.0.0.1:7001", "tcp://127.0.0.1:7002"


# ------------------------------------------------------------------ the envelope, pure


def test_a_frame_is_accepted_once_and_in_order() -> None:
    sealer, opener = FrameSealer(KEY, PEER), FrameOpener(KEY, ME)
    first, second = sealer.seal(ME, b"one"), sealer.seal(ME, b"two")
    assert opener.open(second).seq == 2
    for old in (second, first):  # a repeat, and an older number of the same session
        with pytest.raises(FrameRefused) as err:
            opener.open(old)
        assert err.value.reason == "replay"
    assert FrameOpener(KEY, ME).open(first).payload == b"one"  # another receiver's memory is its own


def test_a_frame_for_another_receiver_is_refused() -> None:
    frame = FrameSealer(KEY, PEER).seal("tcp://127.0.0.1:7003", b"x")
    with pytest.raises(FrameRefused, match="addressed to tcp://127.0.0.1:7003") as err:
        FrameOpener(KEY, ME).open(frame)
    assert err.value.reason == "misdirected"
    assert FrameOpener(KEY, "tcp://[::1]:9").open(FrameSealer(KEY, PEER).seal("tcp://[0::1]:9", b"y")).payload == b"y"


def test_stale_frames_are_refused() -> None:
    now = time.time()
    for skew in (-61.0, 61.0):
        frame = FrameSealer(KEY, PEER, clock=lambda s=skew: now + s).seal(ME, b"x")
        with pytest.raises(FrameRefused, match="accepted: within 60 s") as err:
            FrameOpener(KEY, ME).open(frame)
        assert err.value.reason == "stale"


def test_sessions_are_forgotten_only_when_their_frames_are_stale() -> None:
    clock = [1_700_000_000.0]
    opener = FrameOpener(KEY, ME, clock=lambda: clock[0], max_age_s=10, kept=2)
    sealers = [FrameSealer(KEY, PEER, clock=lambda: clock[0]) for _ in range(3)]
    frames = [s.seal(ME, b"x") for s in sealers]
    for frame in frames:
        opener.open(frame)
    assert opener.sessions == 2  # the oldest was dropped for room: the floor refuses its old frames
    with pytest.raises(FrameRefused, match="older than the sessions"):
        opener.open(frames[0])
    clock[0] += 21
    assert opener.open(sealers[1].seal(ME, b"later")).payload == b"later" and opener.sessions == 1


def test_wrong_key_wrong_version_and_short_frames() -> None:
    frame = FrameSealer(frame_key(b"another-token-0123456789"), PEER).seal(ME, b"x")
    for bad, reason in ((frame, "mac"), (b"short", "short"), (b"\x00" * 200, "mac")):
        with pytest.raises(FrameRefused) as err:
            FrameOpener(KEY, ME).open(bad)
        assert err.value.reason == reason
    hello = proto.PeerHello("d", b"", ME, 0, 1, 16, "float16", 2, [])
    problem = version_problem(hello)
    assert problem is not None and f"version {proto.WIRE_VERSION}" in problem and "1 or older" in problem
    assert (
        version_problem(proto.PeerHello("d", b"", ME, 0, 1, 16, "float16", 2, [], wire_version=proto.WIRE_VERSION))
        is None
    )


# ------------------------------------------------------------------ a channel under replay


class Ear:
    """A Channel with a token that records messages and watches one peer's liveness."""

    def __init__(self, watched: str | None = None, timeout_s: float = 1.0) -> None:
        self.messages: list[proto.Message] = []
        self.lost: list[Lost] = []
        self.stats = TransferStats("test")
        self.watched = watched
        self.channel = Channel(HOST, self.stats, self.messages.append, self._tick, TOKEN, PeerWatch(timeout_s))
        self.channel.start()

    def _tick(self, now: float) -> None:
        if self.watched is not None:
            self.lost += self.channel.beat(now, {self.watched})


@pytest.fixture
def ears() -> Iterator[list[Ear]]:
    made: list[Ear] = []
    yield made
    for ear in made:
        ear.channel.close()


def test_a_replayed_transfer_request_is_refused(ears: list[Ear]) -> None:
    ear = Ear()
    ears.append(ear)
    d = FrameSealer(KEY, PEER)  # D's session: what it put on the wire once
    captured = d.seal(ear.channel.endpoint, proto.encode(proto.TransferRequest(9, "r-9", "d0", [1, 2], 0)))
    push_raw(ear.channel.endpoint, captured)
    wait_for(lambda: len(ear.messages) == 1, 5, what="the request")
    push_raw(ear.channel.endpoint, captured, captured)
    wait_for(lambda: ear.stats.snapshot().auth_refused == 2, 5, what="both replays refused")
    later = d.seal(ear.channel.endpoint, proto.encode(proto.TransferCancel(9, "r-9", "d0")))
    push_raw(ear.channel.endpoint, later)  # the session goes on: its next number is accepted
    wait_for(lambda: len(ear.messages) == 2, 5, what="the cancel")
    assert isinstance(ear.messages[0], proto.TransferRequest) and isinstance(ear.messages[1], proto.TransferCancel)


def test_a_captured_pong_does_not_keep_a_dead_peer_alive(ears: list[Ear]) -> None:
    dead = f"tcp://{HOST}:{free_port()}"  # nothing listens: this peer is gone
    ear = Ear(watched=dead, timeout_s=1.0)
    ears.append(ear)
    pong = FrameSealer(KEY, dead).seal(ear.channel.endpoint, proto.encode(proto.Pong(about=dead)))
    push_raw(ear.channel.endpoint, pong)  # its last genuine Pong, captured on the way
    started = time.monotonic()
    while not ear.lost and time.monotonic() - started < 3:
        push_raw(ear.channel.endpoint, pong)  # replayed over and over
        time.sleep(0.1)
    assert [lost.endpoint for lost in ear.lost] == [dead] and time.monotonic() - started < 2.0
    assert ear.stats.snapshot().auth_refused >= 5


def test_a_live_peer_cannot_answer_for_a_dead_one(ears: list[Ear]) -> None:
    dead = f"tcp://{HOST}:{free_port()}"
    ear = Ear(watched=dead, timeout_s=1.0)
    ears.append(ear)
    liar = FrameSealer(KEY, PEER)  # a key holder, alive, vouching for another endpoint
    started = time.monotonic()
    while not ear.lost and time.monotonic() - started < 3:
        push_raw(ear.channel.endpoint, liar.seal(ear.channel.endpoint, proto.encode(proto.Pong(about=dead))))
        time.sleep(0.1)
    assert [lost.endpoint for lost in ear.lost] == [dead]
    assert ear.stats.snapshot().bad_frames >= 5


# ------------------------------------------------------------------ repeated claims on P


def _waiting_request(p, room: int) -> proto.TransferRequest:
    with p.mgr.prefill._lock:
        return p.mgr.prefill._rooms[room].waiting[0].req


def test_request_mode_refuses_a_repeated_claim(rig: Rig) -> None:
    p = rig.make("prefill", seed=31)
    d = rig.make("decode")
    d.mgr.add_recvs([recv_job(rig, "d-req", 601, [3, 4])])
    wait_for(lambda: p.room_state(601) is RoomState.AWAITING_PREFILL, what="P to hold D's request")
    req = _waiting_request(p, 601)
    p.mgr.prefill.on_transfer_request(req)  # the same claim again, before the prefill finished
    with p.mgr.prefill._lock:
        assert len(p.mgr.prefill._rooms[601].waiting) == 1
    # Two samples: the room stays READY after the first claim was served.
    p.mgr.add_sends([SendJob("p-req", 601, [1, 2], 2 * BLOCK_SIZE, samples=2)])
    d.wait_recv("d-req")
    assert d.failed == {}
    wait_for(lambda: p.stats().transfers_ok == 1, what="the push")
    assert p.room_state(601) is RoomState.READY
    p.mgr.prefill.on_transfer_request(req)  # and once it was submitted
    time.sleep(0.3)
    assert p.stats().transfers_ok == 1 and p.stats().bad_frames == 2
    with p.mgr.prefill._lock:
        assert p.mgr.prefill._rooms[601].submitted == 1


def test_layer_mode_refuses_a_repeated_claim(rig: Rig) -> None:
    p, streams = layer_mode(rig, seed=32)
    d = rig.make("decode")
    src, dst = [0, 1], [5, 6]
    d.mgr.add_recvs([recv_job(rig, "d-req", 602, dst)])
    wait_for(lambda: p.room_state(602) is RoomState.AWAITING_PREFILL, what="P to hold D's request")
    req = _waiting_request(p, 602)
    p.mgr.prefill.on_transfer_request(req)  # waiting already
    run_step(streams, [chunk(602, src, 0, 2, final=True)])
    d.wait_recv("d-req")
    assert d.failed == {}
    p.mgr.prefill.on_transfer_request(req)  # taken by the stream already
    time.sleep(0.3)
    assert p.stats().bad_frames == 2 and d.failed == {}
    with p.mgr.prefill._lock:
        assert p.mgr.prefill._rooms[602].submitted == 1
