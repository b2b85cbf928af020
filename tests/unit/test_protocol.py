"""protocol: kv_transfer_params parsing and the ZMQ message codec."""

from __future__ import annotations

import msgspec
import pytest

from pd_connector import protocol as proto
from pd_connector.protocol import (
    MAX_ROOM,
    DecodeParams,
    KVParamsError,
    PrefillParams,
    ProtocolError,
    parse_kv_params,
)

D_OK = {
    "do_remote_prefill": True,
    "bootstrap_room": 12345,
    "bootstrap_host": "10.0.0.1",
    "bootstrap_port": 18800,
}

# ------------------------------------------------------------ kv_transfer_params


@pytest.mark.parametrize(
    "params",
    [
        None,
        {},
        {"bootstrap_room": 5},
        {"do_remote_decode": False, "do_remote_prefill": False, "bootstrap_room": 5},
        {"do_remote_decode": None},
        {"something_else": 1},
    ],
)
def test_no_transfer(params: object) -> None:
    assert parse_kv_params(params) is None


def test_prefill_params() -> None:
    assert parse_kv_params({"do_remote_decode": True, "bootstrap_room": 7}) == PrefillParams(room=7)
    assert parse_kv_params({"do_remote_decode": True, "bootstrap_room": 0}) == PrefillParams(room=0)
    top = MAX_ROOM - 1
    assert parse_kv_params({"do_remote_decode": True, "bootstrap_room": top}) == PrefillParams(room=top)


def test_prefill_params_numeric_string_room() -> None:
    assert parse_kv_params({"do_remote_decode": True, "bootstrap_room": "42"}) == PrefillParams(room=42)


def test_decode_params_without_dp_rank() -> None:
    parsed = parse_kv_params(dict(D_OK))
    assert parsed == DecodeParams(room=12345, bootstrap_host="10.0.0.1", bootstrap_port=18800, prefill_dp_rank=None)
    assert isinstance(parsed, DecodeParams)
    assert parsed.bootstrap_addr == "10.0.0.1:18800"


def test_decode_params_with_dp_rank() -> None:
    parsed = parse_kv_params({**D_OK, "prefill_dp_rank": 3, "do_remote_decode": False})
    assert isinstance(parsed, DecodeParams)
    assert parsed.prefill_dp_rank == 3
    assert parse_kv_params({**D_OK, "prefill_dp_rank": None}).prefill_dp_rank is None  # type: ignore[union-attr]


@pytest.mark.parametrize("params", ["room=1", 5, ["do_remote_decode"], b"{}", 1.5])
def test_non_dict(params: object) -> None:
    with pytest.raises(KVParamsError, match="kv_transfer_params must be a JSON object"):
        parse_kv_params(params)


D_BAD = [
    # (override, field named in the error)
    ({"do_remote_decode": True}, "do_remote_decode"),  # both flags
    ({"do_remote_prefill": "yes"}, "do_remote_prefill"),
    ({"do_remote_prefill": 1}, "do_remote_prefill"),
    ({"bootstrap_room": None}, "bootstrap_room"),
    ({"bootstrap_room": -1}, "bootstrap_room"),
    ({"bootstrap_room": MAX_ROOM}, "bootstrap_room"),
    ({"bootstrap_room": 2**64}, "bootstrap_room"),
    ({"bootstrap_room": True}, "bootstrap_room"),
    ({"bootstrap_room": False}, "bootstrap_room"),
    ({"bootstrap_room": 1.5}, "bootstrap_room"),
    ({"bootstrap_room": "abc"}, "bootstrap_room"),
    ({"bootstrap_room": [1]}, "bootstrap_room"),
    # digit-looking strings int() rejects: must be KVParamsError, not a bare ValueError
    ({"bootstrap_room": "\u00b2"}, "bootstrap_room"),
    ({"bootstrap_room": "--3"}, "bootstrap_room"),
    ({"bootstrap_room": "9" * 5000}, "bootstrap_room"),
    ({"bootstrap_port": "\u00b9\u00b2"}, "bootstrap_port"),
    ({"bootstrap_host": None}, "bootstrap_host"),
    ({"bootstrap_host": ""}, "bootstrap_host"),
    ({"bootstrap_host": 10}, "bootstrap_host"),
    ({"bootstrap_host": ["h"]}, "bootstrap_host"),
    ({"bootstrap_port": None}, "bootstrap_port"),
    ({"bootstrap_port": 0}, "bootstrap_port"),
    ({"bootstrap_port": 65536}, "bootstrap_port"),
    ({"bootstrap_port": -80}, "bootstrap_port"),
    ({"bootstrap_port": "http"}, "bootstrap_port"),
    ({"bootstrap_port": True}, "bootstrap_port"),
    ({"prefill_dp_rank": -1}, "prefill_dp_rank"),
    ({"prefill_dp_rank": 1 << 16}, "prefill_dp_rank"),
    ({"prefill_dp_rank": "x"}, "prefill_dp_rank"),
    ({"prefill_dp_rank": True}, "prefill_dp_rank"),
]


@pytest.mark.parametrize(("override", "field"), D_BAD)
def test_decode_malformed_names_field(override: dict, field: str) -> None:
    params = {**D_OK, **override}
    with pytest.raises(KVParamsError) as info:
        parse_kv_params(params)
    assert field in str(info.value)


def test_decode_missing_fields() -> None:
    for field in ("bootstrap_room", "bootstrap_host", "bootstrap_port"):
        params = dict(D_OK)
        del params[field]
        with pytest.raises(KVParamsError, match=field):
            parse_kv_params(params)


@pytest.mark.parametrize(
    ("params", "field"),
    [
        ({"do_remote_decode": True}, "bootstrap_room"),
        ({"do_remote_decode": True, "bootstrap_room": -5}, "bootstrap_room"),
        ({"do_remote_decode": True, "bootstrap_room": MAX_ROOM}, "bootstrap_room"),
        ({"do_remote_decode": True, "bootstrap_room": True}, "bootstrap_room"),
        ({"do_remote_decode": "true", "bootstrap_room": 1}, "do_remote_decode"),
        ({"do_remote_decode": True, "do_remote_prefill": True, "bootstrap_room": 1}, "do_remote_prefill"),
    ],
)
def test_prefill_malformed_names_field(params: dict, field: str) -> None:
    with pytest.raises(KVParamsError) as info:
        parse_kv_params(params)
    assert field in str(info.value)


def test_kv_params_error_is_value_error() -> None:
    assert issubclass(KVParamsError, ValueError)


# ------------------------------------------------------------------ ZMQ messages

MESSAGES = [
    proto.PeerHello(
        peer_id="127.0.0.1:15000/dp0/tp0",
        session="127.0.0.1:15000",
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
    proto.TransferDone(room=5, request_id="r", tp_rank=1, ok=True),
    proto.TransferDone(room=5, request_id="r", tp_rank=1, ok=False, error="block size mismatch"),
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
        {"type": "done", "room": 1, "request_id": "r", "tp_rank": 0, "ok": "yes"},
        {"type": "xfer", "room": 1, "request_id": "r", "peer_id": "p", "dst_block_ids": "1,2", "start_block": 0},
        {
            "type": "hello",
            "peer_id": "p",
            "session": "s",
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
