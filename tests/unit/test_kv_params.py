"""kv_params: the kv_transfer_params contract shared by the Router and the connector."""

from __future__ import annotations

import subprocess
import sys

import pytest

from pd_connector.kv_params import (
    MAX_ROOM,
    DecodeParams,
    KVParamsError,
    PrefillParams,
    parse_kv_params,
    prefill_answer,
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


def test_decode_params_prefilled_tokens_round_trip() -> None:
    parsed = parse_kv_params({**D_OK, "prefilled_tokens": 64})
    assert isinstance(parsed, DecodeParams) and parsed.prefilled_tokens == 64
    assert parsed.to_json()["prefilled_tokens"] == 64
    assert "prefilled_tokens" not in DecodeParams(1, "h", 2, None).to_json()


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
    ({"prefilled_tokens": 0}, "prefilled_tokens"),
    ({"prefilled_tokens": "x"}, "prefilled_tokens"),
    ({"prefilled_tokens": 1 << 31}, "prefilled_tokens"),
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


def test_builders_round_trip_through_the_parser() -> None:
    prefill = PrefillParams(room=MAX_ROOM - 1)
    assert parse_kv_params(prefill.to_json()) == prefill
    for dp_rank in (None, 3):
        decode = DecodeParams(room=9, bootstrap_host="::1", bootstrap_port=18800, prefill_dp_rank=dp_rank)
        as_json = decode.to_json()
        assert ("prefill_dp_rank" in as_json) == (dp_rank is not None)
        assert parse_kv_params(as_json) == decode
    assert prefill_answer(7) == {"bootstrap_room": 7, "prefill_done": True}


def test_contract_and_router_import_without_vllm() -> None:
    code = (
        "import sys; sys.modules['vllm'] = None\n"
        "import pd_connector.kv_params, proxy.request.payloads, proxy.app\n"
        "assert not any(m == 'vllm' or m.startswith('vllm.') for m in sys.modules if sys.modules[m] is not None)\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
