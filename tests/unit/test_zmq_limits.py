"""ZMQ hardening: frame size cap, MAC checked before any decoding, peer text escaped in
logs, timers and heartbeats on time under a flood of refused frames, endpoints validated, and a room
that always closes even when D cannot be told.

Real Channels on loopback (real ZMQ sockets, threads and clocks); the room test uses the transfer rig.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Iterator
from typing import Any

import msgspec
import pytest
import zmq

from pd_connector import auth
from pd_connector import messages as proto
from pd_connector.keys import frame_key
from pd_connector.metadata import SendJob
from pd_connector.transfer import channel as channel_module
from pd_connector.transfer.channel import Channel
from pd_connector.transfer.frames import FrameSealer
from pd_connector.transfer.liveness import PeerState, PeerWatch
from pd_connector.transfer.stats import TransferStats
from pd_connector.transfer.wire_checks import (
    MAX_FRAME_BYTES,
    BadEndpoint,
    check_endpoint,
    escaped,
    message_problem,
)
from tests.support.loopback import HOST, push_raw, wait_for
from tests.support.transfer_rig import BLOCK_SIZE, Rig, recv_job

TOKEN = b"zmq-limits-test-token-0123456789"


class Ear:
    """A Channel with its messages and ticks recorded; ``busy``: the peers it has pending work with."""

    def __init__(self, token: bytes | None = TOKEN, timeout_s: float = 5.0) -> None:
        self.messages: list[proto.Message] = []
        self.ticks: list[float] = []
        self.lost: list[tuple[str, float]] = []
        self.busy: set[str] = set()
        self.stats = TransferStats("t")
        self.channel = Channel(HOST, self.stats, self.messages.append, self._tick, token, PeerWatch(timeout_s))

    def _tick(self, now: float) -> None:
        self.ticks.append(now)
        self.lost += [(x.endpoint, now) for x in self.channel.beat(now, self.busy)]

    def close(self) -> None:
        self.channel.close()


@pytest.fixture
def ears() -> Iterator[list[Ear]]:
    made: list[Ear] = []
    yield made
    for ear in made:
        ear.close()


def _ear(ears: list[Ear], **kw: Any) -> Ear:
    ear = Ear(**kw)
    ears.append(ear)
    ear.channel.start()
    return ear


CANCEL = proto.TransferCancel(room=5, request_id="r-1", peer_id="10.0.0.2:7000/dp0/tp0")


# ------------------------------------------------------------------ frame size


def test_every_socket_caps_the_frame_size_and_the_largest_message_fits(ears: list[Ear]) -> None:
    ear = _ear(ears)
    ear.channel.send(ear.channel.endpoint, CANCEL)  # makes a PUSH socket
    socks = [ear.channel._pull, *ear.channel._push.values()]
    assert len(socks) == 2
    assert {s.getsockopt(zmq.MAXMSGSIZE) for s in socks} == {MAX_FRAME_BYTES + auth.MAC_BYTES}
    # A TransferRequest for a 16M-token prompt (2^20 block ids, in two KV cache groups) fits.
    ids = list(range(2**31 - 2**20, 2**31))
    big = proto.TransferRequest(
        room=2**62, request_id="x" * 200, peer_id="p" * 200, dst_block_ids=ids, start_block=0, endpoint=ear.channel.endpoint,
        dst_groups=[ids, ids],
    )  # fmt: skip
    assert len(proto.encode(big)) < MAX_FRAME_BYTES


def test_a_frame_over_the_cap_never_reaches_the_rank(ears: list[Ear], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(channel_module, "MAX_FRAME_BYTES", 4096)
    ear = _ear(ears, token=None)
    push_raw(ear.channel.endpoint, proto.encode(msgspec.structs.replace(CANCEL, request_id="x" * 8000)))
    push_raw(ear.channel.endpoint, proto.encode(CANCEL))  # a fresh connection with a small frame
    wait_for(lambda: ear.messages, 5, what="the small frame")
    time.sleep(0.2)
    assert ear.messages == [CANCEL]  # the big one was dropped by ZMQ, unread
    assert ear.stats.snapshot().bad_frames == 0


# ------------------------------------------------------- MAC before decoding


def test_a_refused_frame_is_never_decoded(
    ears: list[Ear], monkeypatch: pytest.MonkeyPatch, pd_logs: pytest.LogCaptureFixture
) -> None:
    decoded: list[bytes] = []
    real = proto.decode
    monkeypatch.setattr(proto, "decode", lambda frame: decoded.append(frame) or real(frame))
    ear = _ear(ears)
    payload = proto.encode(CANCEL)
    wrong = FrameSealer(frame_key(b"wrong-token-0123456789abcdef"), "tcp://127.0.0.1:1")
    push_raw(ear.channel.endpoint, payload, wrong.seal(ear.channel.endpoint, payload), b"x" * 10)
    wait_for(lambda: ear.stats.snapshot().auth_refused == 3, 5, what="three refused frames")
    assert decoded == [] and ear.messages == []
    assert "not decoded" in pd_logs.text and "r-1" not in pd_logs.text  # not even for the log line
    push_raw(
        ear.channel.endpoint, FrameSealer(frame_key(TOKEN), "tcp://127.0.0.1:1").seal(ear.channel.endpoint, payload)
    )
    wait_for(lambda: ear.messages == [CANCEL], 5, what="the signed frame")
    assert decoded == [payload]  # decoded once, after its MAC matched


# ------------------------------------------------------------ text in logs


def test_identifiers_with_control_characters_are_refused_and_escaped(
    ears: list[Ear], pd_logs: pytest.LogCaptureFixture
) -> None:
    ear = _ear(ears, token=None)
    forged = "p1\nERROR 01-01 00:00:00 [pd_connector.prefill_side] room=1 req=x: forged"
    hello = proto.PeerHello(
        peer_id=forged, transfer_descriptor=b"d", endpoint="tcp://127.0.0.1:5000", tp_rank=0, tp_size=1,
        block_size=16, kv_dtype="float16", num_layers=2, regions=[],
    )  # fmt: skip
    bad_tag = msgspec.msgpack.encode({"type": "evil\nERROR forged too", "room": 1})
    done = proto.TransferDone(
        room=1, request_id="r-1", tp_rank=0, status=proto.DoneStatus.INTERNAL_ERROR, error="a\nb\x1b[2J"
    )
    push_raw(
        ear.channel.endpoint,
        proto.encode(hello),
        proto.encode(msgspec.structs.replace(CANCEL, request_id="r\r\u2028x")),
        proto.encode(msgspec.structs.replace(hello, peer_id="ok", endpoint="tcp://127.0.0.1")),  # no port
        bad_tag,
        proto.encode(done),
    )
    wait_for(lambda: ear.messages, 5, what="the TransferDone")
    wait_for(lambda: ear.stats.snapshot().bad_frames == 4, 5, what="four dropped frames")
    assert ear.messages == [msgspec.structs.replace(done, error="a\\nb\\x1b[2J")]  # free text: escaped, kept
    lines = pd_logs.text.splitlines()
    assert not any(line.startswith("ERROR 01-01") or line.startswith("ERROR forged") for line in lines)
    assert "p1\\nERROR 01-01" in pd_logs.text and "evil\\nERROR forged too" in pd_logs.text


def test_message_checks_and_escaping() -> None:
    assert escaped("a\tb\n\x00\u2029") == "a\tb\\n\\x00\\u2029"
    assert message_problem(CANCEL) is None
    assert message_problem(proto.Ping(about="tcp://[::1]:5", reply_to="tcp://h:0")) is not None  # port 0
    assert (
        message_problem(proto.TransferRequest(room=1, request_id="r", peer_id="p", dst_block_ids=[], start_block=0))
        is None
    )


# ------------------------------------------------------------------ flood


def test_heartbeats_and_expiry_stay_on_time_under_a_flood_of_refused_frames(ears: list[Ear]) -> None:
    """A watches B (peer timeout 1 s, a ping every 0.2 s) while strangers flood A with unsigned frames:
    A's timers tick every ~50 ms, B stays alive for 3 s of flood, and once B stops answering A declares
    it lost after 1 s, not later."""
    a, b = _ear(ears, timeout_s=1.0), _ear(ears, timeout_s=1.0)
    stop = threading.Event()
    sent = [0]

    def flood() -> None:
        ctx = zmq.Context()
        socks = [ctx.socket(zmq.PUSH) for _ in range(4)]
        for s in socks:
            s.setsockopt(zmq.LINGER, 0)
            s.setsockopt(zmq.SNDHWM, 100_000)
            s.connect(a.channel.endpoint)
        junk = proto.encode(CANCEL)  # unsigned: refused by the MAC check
        while not stop.is_set():
            for s in socks:
                try:
                    s.send(junk, zmq.NOBLOCK)
                    sent[0] += 1
                except zmq.Again:
                    time.sleep(0.001)
        for s in socks:
            s.close()
        ctx.term()

    flooder = threading.Thread(target=flood, daemon=True)
    flooder.start()
    try:
        wait_for(lambda: a.stats.snapshot().auth_refused > 1000, 10, what="the flood to arrive")
        a.busy = {b.channel.endpoint}
        t0 = time.monotonic()
        time.sleep(3.0)
        assert a.lost == [] and a.channel.heartbeats.watch.state(b.channel.endpoint) is PeerState.WATCHED
        window = [t for t in a.ticks if t >= t0]
        gaps = [y - x for x, y in zip(window, window[1:], strict=False)]
        assert len(window) > 20 and max(gaps) < 0.5, f"{len(window)} ticks, longest gap {max(gaps):.2f} s"
        b.channel.stop()  # B goes silent
        t_silent = time.monotonic()
        wait_for(lambda: a.lost, 5, what="B declared lost")
        late = a.lost[0][1] - t_silent
        assert 0.7 <= late <= 1.6, f"B declared lost {late:.2f} s after it went silent (peer timeout 1 s)"
        refused = a.stats.snapshot().auth_refused
        assert refused > 5000, f"only {refused} frames refused: not a flood"
    finally:
        stop.set()
        flooder.join(5)


# -------------------------------------------------------------- endpoints


@pytest.mark.parametrize(
    "endpoint",
    ["tcp://127.0.0.1:5000", "tcp://[::1]:1", "tcp://[fe80::1]:65535", "tcp://node-3.example.com:80"],
)
def test_valid_endpoints(endpoint: str) -> None:
    assert check_endpoint(endpoint) == endpoint


@pytest.mark.parametrize(
    "endpoint",
    ["127.0.0.1:5000", "tcp://127.0.0.1", "tcp://127.0.0.1:0", "tcp://127.0.0.1:70000", "tcp://h:1\n", "ipc:///x",
     "tcp://h:1/x", "tcp://:5", "tcp://a b:5", ""],
)  # fmt: skip
def test_invalid_endpoints_are_refused_before_a_socket_is_made(ears: list[Ear], endpoint: str) -> None:
    with pytest.raises(BadEndpoint, match="invalid ZMQ endpoint .*expected tcp://"):
        check_endpoint(endpoint)
    ear = ears[0] if ears else _ear(ears)
    with pytest.raises(BadEndpoint):
        ear.channel.send(endpoint, CANCEL)
    assert ear.channel._push == {}


def test_a_room_closes_even_when_its_answer_cannot_be_sent(rig: Rig, monkeypatch: pytest.MonkeyPatch) -> None:
    """P's answer to D raises (the endpoint turned out unusable): the room is still closed and its KV freed."""
    p = rig.make("prefill")
    d = rig.make("decode", kv_wait_timeout_s=2.0)
    prefill = p.mgr.prefill
    assert prefill is not None
    real_send = prefill._ctx.send

    def send(endpoint: str, msg: proto.Message) -> None:
        if isinstance(msg, proto.TransferDone) and msg.ok:  # the push's answer; the cancel's goes through
            raise BadEndpoint(f"invalid ZMQ endpoint '{endpoint}'")
        real_send(endpoint, msg)

    monkeypatch.setattr(prefill, "_ctx", dataclasses.replace(prefill._ctx, send=send))
    p.mgr.add_sends([SendJob("p-1", 7201, [1, 2], 2 * BLOCK_SIZE)])
    d.mgr.add_recvs([recv_job(rig, "d-1", 7201, [3, 4])])
    p.wait_sent("p-1", timeout=10)  # the room closed: P's blocks go back to vLLM
    assert p.room_state(7201) is None
    d.wait_recv("d-1", timeout=20)  # D never heard: its load fails at kv_wait_timeout_s
    assert d.failed == {"d-1": [3, 4]}
