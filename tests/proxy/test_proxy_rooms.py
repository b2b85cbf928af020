"""Rooms and n > 1: P prefills once for every sample, one request per room at a time,
client rooms only with ``--trust-client-room``."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

from pd_connector.kv_params import KVParamsError, PrefillParams, parse_kv_params, prefill_refused
from proxy.request.payloads import decode_body, prefill_body, resolve_room
from proxy.request.rooms_in_flight import RoomsInUse
from proxy.router_config import Backend
from proxy.upstream.calls import refused_failure
from proxy.upstream.pool import BackendState
from tests.support.router_rig import Backends, RouterFactory, http_client, new_rid, record, request_body

PREFILLER = Backend("prefill", "10.0.0.7", 8100, 18800)


@pytest.mark.parametrize("n", [2, 3, 16])
def test_prefill_never_carries_n_but_tells_p_how_many_samples_load(n: int) -> None:
    client = {"model": "m", "prompt": "hi", "n": n, "best_of": n + 1, "seed": 7, "temperature": 0.8}
    p = prefill_body(client, 9)
    assert "n" not in p and "best_of" not in p
    assert p["kv_transfer_params"] == {
        "do_remote_decode": True,
        "do_remote_prefill": False,
        "bootstrap_room": 9,
        "decode_samples": n,
    }
    assert parse_kv_params(p["kv_transfer_params"]) == PrefillParams(9, samples=n)
    d = decode_body(client, 9, PREFILLER)
    assert d["n"] == n and d["seed"] == 7  # D samples as the client asked
    assert client["n"] == n  # the client's body is not modified


def test_one_sample_sends_no_samples_key() -> None:
    assert "decode_samples" not in prefill_body({"prompt": "x", "n": 1}, 1)["kv_transfer_params"]
    assert "decode_samples" not in prefill_body({"prompt": "x"}, 1)["kv_transfer_params"]


@pytest.mark.parametrize("bad", [0, -1, 1025, "x", True])
def test_bad_samples_in_p_params_name_the_field(bad: Any) -> None:
    with pytest.raises(KVParamsError, match="decode_samples"):
        parse_kv_params({"do_remote_decode": True, "bootstrap_room": 1, "decode_samples": bad})


def test_client_room_is_ignored_unless_trusted() -> None:
    body = {"prompt": "x", "bootstrap_room": 5}
    assert resolve_room(body, trust_client=True) == 5
    assert len({resolve_room(body, trust_client=False) for _ in range(20)} - {5}) == 20
    with pytest.raises(Exception, match="bootstrap_room"):
        resolve_room({"prompt": "x", "bootstrap_room": -1}, trust_client=False)  # still checked


def test_rooms_in_use_refuses_a_live_room() -> None:
    rooms = RoomsInUse()
    rooms.claim(3)
    with pytest.raises(Exception, match="in use") as info:
        rooms.claim(3)
    assert info.value.status == 409  # type: ignore[attr-defined]
    rooms.release(3)
    rooms.claim(3)
    assert len(rooms) == 1


def test_p_answer_that_refused_its_room_is_a_final_409() -> None:
    state = BackendState(PREFILLER)
    import json

    body = json.dumps({"choices": [], "kv_transfer_params": prefill_refused(4, "room 4 is in use")}).encode()
    failure = refused_failure(state, body)
    assert failure is not None and failure.error.status == 409 and not failure.retryable
    assert "room 4 is in use" in failure.error.message
    ok = json.dumps({"kv_transfer_params": {"bootstrap_room": 4, "prefill_done": True}}).encode()
    assert refused_failure(state, ok) is None


def test_untrusted_router_draws_its_own_room(router_factory: RouterFactory, backends: Backends) -> None:
    router = router_factory(backends.ok_p, backends.ok_d, "--no-trust-client-room")
    rid = new_rid("untrusted")
    with http_client() as client:
        resp = client.post(
            f"{router.url}/v1/completions",
            json=request_body("/v1/completions", bootstrap_room=77, n=2),
            headers={"X-Request-Id": rid},
        )
    assert resp.status_code == 200, resp.text
    p = record(backends.ok_p, rid)["body"]
    d = record(backends.ok_d, rid)["body"]
    assert p["kv_transfer_params"]["bootstrap_room"] == d["kv_transfer_params"]["bootstrap_room"] != 77
    assert "n" not in p and p["kv_transfer_params"]["decode_samples"] == 2 and d["n"] == 2


def test_same_client_room_twice_at_once_one_served_one_refused(
    router_factory: RouterFactory, backends: Backends
) -> None:
    router = router_factory(backends.ok_p, backends.slow_short)
    room = 4242
    results: dict[str, Any] = {}

    def first() -> None:
        with http_client() as client:
            body = request_body("/v1/completions", stream=True, bootstrap_room=room)
            with client.stream("POST", f"{router.url}/v1/completions", json=body) as resp:
                results["first"] = resp.status_code
                results["first_body"] = resp.read()

    thread = threading.Thread(target=first)
    thread.start()
    time.sleep(0.5)  # the first stream runs (about 2 s)
    with http_client() as client:
        second = client.post(f"{router.url}/v1/completions", json=request_body("/v1/completions", bootstrap_room=room))
    thread.join(20)
    assert results["first"] == 200 and results["first_body"].rstrip().endswith(b"data: [DONE]")
    assert second.status_code == 409, second.text
    error = second.json()["error"]
    assert error["type"] == "room_in_use" and str(room) in error["message"]
    with http_client() as client:  # the room is free again once the first request ended
        again = client.post(f"{router.url}/v1/completions", json=request_body("/v1/completions", bootstrap_room=room))
    assert again.status_code == 200, again.text
