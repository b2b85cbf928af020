"""protocol: the ZMQ message codec."""

from __future__ import annotations

import msgspec
import pytest

from pd_connector import messages as proto
from pd_connector.messages import ProtocolError

# ------------------------------------------------------------------ ZMQ messages

MESSAGES = [
    proto.PeerHello(
        peer_id="127.0.0.1:15000/dp0/tp0",
        transfer_descriptor=b"127.0.0.1:15000",
        endpoint="tcp://127.0.0.1:5555",
        tp_rank=0,
        tp_size=2,
        block_size=16,
        kv_dtype="bfloat16",
        num_layers=2,
        regions=[(0x7F0000001000, 4096, 4096), (2**63, 8192, 4096)],
    ),
    proto.TransferRequest(room=2**63 - 1, request_id="cmpl-1", peer_id="p", dst_block_ids=[3, 4, 9], start_block=1),
    proto.TransferRequest(room=0, request_id="r", peer_id="p", dst_block_ids=[], start_block=0),
    proto.TransferDone(room=5, request_id="r", tp_rank=1, status=proto.DoneStatus.OK),
    proto.TransferDone(
        room=5, request_id="r", tp_rank=1, status=proto.DoneStatus.INCOMPATIBLE, error="block size mismatch"
    ),
    proto.TransferCancel(room=9, request_id="r"),
]


@pytest.mark.parametrize("msg", MESSAGES, ids=lambda m: type(m).__name__)
def test_message_round_trip(msg: proto.Message) -> None:
    frame = proto.encode(msg)
    assert isinstance(frame, bytes)
    back = proto.decode(frame)
    assert type(back) is type(msg)
    assert back == msg


def test_messages_are_tagged_distinctly() -> None:
    tags = {msgspec.msgpack.decode(proto.encode(m))["type"] for m in MESSAGES}
    assert tags == {"hello", "xfer", "done", "cancel"}


@pytest.mark.parametrize(
    "frame",
    [
        b"",
        b"\x00",
        b"\xff\xfe\xfd garbage",
        b"hello world",
        b"\xc1",  # never-used msgpack byte
    ],
)
def test_garbage_frames(frame: bytes) -> None:
    with pytest.raises(ProtocolError):
        proto.decode(frame)


@pytest.mark.parametrize("msg", MESSAGES, ids=lambda m: type(m).__name__)
def test_truncated_frames(msg: proto.Message) -> None:
    frame = proto.encode(msg)
    for cut in range(len(frame)):
        with pytest.raises(ProtocolError):
            proto.decode(frame[:cut])


@pytest.mark.parametrize(
    "obj",
    [
        1,
        "xfer",
        [1, 2, 3],
        {},
        {"type": "unknown", "room": 1},
        {"room": 1, "request_id": "r"},  # no tag
        {"type": "cancel", "room": 1},  # missing field
        {"type": "cancel", "room": "1", "request_id": "r"},  # wrong field type
        {"type": "done", "room": 1, "request_id": "r", "tp_rank": 0, "status": "ok"},
        {"type": "done", "room": 1, "request_id": "r", "tp_rank": 0, "status": 99},  # no such status
        {"type": "done", "room": 1, "request_id": "r", "tp_rank": 0},  # no status
        {"type": "xfer", "room": 1, "request_id": "r", "peer_id": "p", "dst_block_ids": "1,2", "start_block": 0},
        {
            "type": "hello",
            "peer_id": "p",
            "transfer_descriptor": b"s",
            "endpoint": "e",
            "tp_rank": 0,
            "tp_size": 1,
            "block_size": 16,
            "kv_dtype": "f",
            "num_layers": 1,
            "regions": [[1, 2]],  # a region needs three numbers
        },
    ],
)
def test_wrong_shape(obj: object) -> None:
    with pytest.raises(ProtocolError):
        proto.decode(msgspec.msgpack.encode(obj))


def test_done_status_is_an_int_on_the_wire_and_ok_follows_it() -> None:
    ok = proto.TransferDone(room=1, request_id="r", tp_rank=0, status=proto.DoneStatus.OK)
    lost = proto.TransferDone(room=1, request_id="r", tp_rank=0, status=proto.DoneStatus.UNKNOWN_PEER, error="who?")
    assert msgspec.msgpack.decode(proto.encode(lost))["status"] == 1
    assert ok.ok and not lost.ok
    back = proto.decode(proto.encode(lost))
    assert (
        isinstance(back, proto.TransferDone) and back.status is proto.DoneStatus.UNKNOWN_PEER and back.error == "who?"
    )
    assert len({int(s) for s in proto.DoneStatus}) == len(proto.DoneStatus)


def test_hello_carries_an_opaque_descriptor() -> None:
    hello = MESSAGES[0]
    assert isinstance(hello, proto.PeerHello)
    raw = msgspec.msgpack.decode(proto.encode(hello))
    assert raw["transfer_descriptor"] == b"127.0.0.1:15000" and "session" not in raw


def test_json_is_not_msgpack() -> None:
    with pytest.raises(ProtocolError):
        proto.decode(msgspec.json.encode(MESSAGES[-1]))


def test_bootstrap_route_helpers() -> None:
    route = proto.Route(
        attn_tp_size=2,
        attn_cp_size=1,
        dp_size=1,
        block_size=16,
        kv_cache_dtype="float16",
        num_layers=2,
        is_ready=True,
        ranks={proto.rank_key(0, 0, 1): proto.RankInfo("10.0.0.2", 7000)},
    )
    assert proto.rank_key(0, 0, 1) == "0,0,1"
    assert route.rank(0, 0, 1) == proto.RankInfo("10.0.0.2", 7000)
    assert route.rank(0, 0, 0) is None
    assert msgspec.json.decode(msgspec.json.encode(route), type=proto.Route) == route


def test_register_rank_json_round_trip_and_defaults() -> None:
    reg = proto.RegisterRank(2, 1, 1, 0, "10.0.0.3", 7001, 16, "bfloat16")
    assert (reg.attn_cp_size, reg.attn_cp_rank, reg.num_layers) == (1, 0, 0)
    assert msgspec.json.decode(msgspec.json.encode(reg), type=proto.RegisterRank) == reg
