"""P-then-D proxies (vLLM-Ascend's example proxy). P gets ``do_remote_decode`` and no
room, picks one in its scheduler (no I/O), and answers with everything D needs; the proxy hands
that answer to D as its kv_transfer_params."""

from __future__ import annotations

import pytest
from vllm.v1.request import RequestStatus

from pd_connector.bootstrap.placement import advertised_bootstrap_host
from pd_connector.config import parse_config
from pd_connector.kv_params import (
    MAX_ROOM,
    DecodeParams,
    KVParamsError,
    PrefillParams,
    decode_handoff,
    new_room,
    parse_kv_params,
)
from pd_connector.scheduler import PDScheduler
from tests.support.fake_scheduler import BS, FakeRequest, meta

#: What vLLM-Ascend 0.23's load_balance_proxy_server_example.py sends P.
ASCEND_PROXY_P = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


def test_room_is_optional_only_when_asked() -> None:
    assert parse_kv_params(ASCEND_PROXY_P, room_optional=True) == PrefillParams(room=None)
    with pytest.raises(KVParamsError, match="bootstrap_room"):
        parse_kv_params(ASCEND_PROXY_P)
    assert parse_kv_params({**ASCEND_PROXY_P, "bootstrap_room": 5}, room_optional=True) == PrefillParams(room=5)
    with pytest.raises(KVParamsError, match="bootstrap_room"):
        parse_kv_params({**ASCEND_PROXY_P, "bootstrap_room": -1}, room_optional=True)
    assert PrefillParams(room=None).to_json() == {"do_remote_decode": True, "do_remote_prefill": False}


def test_new_rooms_are_63_bit_and_differ() -> None:
    rooms = {new_room() for _ in range(1000)}
    assert len(rooms) == 1000 and all(0 <= r < MAX_ROOM for r in rooms)


def test_handoff_is_a_decode_request() -> None:
    answer = decode_handoff(42, "10.0.0.1", 18800, 3)
    assert answer["prefill_done"] is True
    assert parse_kv_params(answer) == DecodeParams(42, "10.0.0.1", 18800, 3)


@pytest.mark.parametrize("params", [ASCEND_PROXY_P, {"do_remote_decode": True}])
def test_prefill_without_room_picks_one_and_tells_decode(params: dict) -> None:
    sched = PDScheduler(parse_config("kv_producer", {"local_ip": "10.0.0.1", "bootstrap_port": 18900}), BS, dp_rank=0)
    req = FakeRequest("p-1", dict(params), 50, RequestStatus.FINISHED_LENGTH_CAPPED)
    held, answer = sched.request_finished(req, [3, 4, 5, 6])
    assert held and answer is not None
    d = parse_kv_params(answer)
    assert isinstance(d, DecodeParams)
    assert (d.bootstrap_host, d.bootstrap_port, d.prefill_dp_rank) == ("10.0.0.1", 18900, 0)
    (job,) = meta(sched).sends
    assert job.room == d.room and job.block_ids == [3, 4, 5, 6]


def test_each_roomless_request_gets_its_own_room() -> None:
    sched = PDScheduler(parse_config("kv_producer", {}), BS)
    rooms = set()
    for i in range(20):
        req = FakeRequest(f"p-{i}", dict(ASCEND_PROXY_P), 40, RequestStatus.FINISHED_LENGTH_CAPPED)
        rooms.add(sched.request_finished(req, [i])[1]["bootstrap_room"])  # type: ignore[index]
    assert len(rooms) == 20 and {j.room for j in meta(sched).sends} == rooms


def test_aborted_roomless_prefill_drops_its_room() -> None:
    sched = PDScheduler(parse_config("kv_producer", {}), BS)
    req = FakeRequest("p-x", dict(ASCEND_PROXY_P), 40, RequestStatus.FINISHED_ABORTED)
    assert sched.request_finished(req, [1, 2]) == (False, None)
    (room,) = meta(sched).dropped_rooms
    assert 0 <= room < MAX_ROOM


def test_answer_names_the_bootstrap_server_d_can_reach() -> None:
    leader = parse_config("kv_producer", {"local_ip": "10.0.0.1"})
    other = parse_config("kv_producer", {"local_ip": "10.0.0.2", "bootstrap_host": "10.0.0.1", "dp_rank": 1})
    assert advertised_bootstrap_host(leader, 0) == "10.0.0.1"  # the server binds the leader's local_ip
    assert advertised_bootstrap_host(other, 1) == "10.0.0.1"
    no_server = parse_config("kv_producer", {"bootstrap_host": "10.9.9.9", "start_bootstrap_server": False})
    assert advertised_bootstrap_host(no_server, 0) == "10.9.9.9"
    sched = PDScheduler(other, BS, dp_rank=1)
    req = FakeRequest("p-2", {"do_remote_decode": True, "bootstrap_room": 7}, 40, RequestStatus.FINISHED_STOPPED)
    _, answer = sched.request_finished(req, [1])
    assert answer is not None and parse_kv_params(answer) == DecodeParams(7, "10.0.0.1", 18800, 1)
