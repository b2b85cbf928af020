"""Other routers' PD requests on P and D: sglang-router's top-level bootstrap fields and vllm-router's
Mooncake ``transfer_id`` become PDConnector's kv_transfer_params (pd_connector.api_server.front_ends, applied by
the HTTP middleware), and P's bootstrap server answers vLLM's Mooncake ``/query``."""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route
from starlette.testclient import TestClient

from pd_connector.api_server.front_ends import FrontEnd, Side, TranslationError, room_of_transfer_id, translate
from pd_connector.api_server.validation import KVParamsValidationMiddleware
from pd_connector.bootstrap.mooncake_query import dp_rank_of_engine_id, engine_id
from pd_connector.bootstrap.server import BootstrapState, create_app
from pd_connector.kv_params import DecodeParams, PrefillParams, parse_kv_params
from pd_connector.messages import RegisterRank

SGLANG = {"model": "m", "prompt": "hi", "max_tokens": 9, "bootstrap_host": "10.0.0.2", "bootstrap_port": 8998}


def test_sglang_prefill_only_prefills_and_holds_the_room() -> None:
    body = {**SGLANG, "bootstrap_room": 42, "min_tokens": 3, "n": 2}
    assert translate(body, Side.PREFILL) is FrontEnd.SGLANG
    assert parse_kv_params(body["kv_transfer_params"]) == PrefillParams(42, samples=2)
    assert (body["max_tokens"], body["min_tokens"]) == (1, 1)
    assert not {"bootstrap_host", "bootstrap_port", "bootstrap_room"} & set(body)


def test_sglang_chat_prefill_caps_max_completion_tokens() -> None:
    body = {"messages": [], "max_completion_tokens": 7, "bootstrap_room": 3, "bootstrap_host": "h", "bootstrap_port": 1}
    translate(body, Side.PREFILL)
    assert body["max_completion_tokens"] == 1 and body["max_tokens"] == 1


def test_sglang_decode_loads_from_the_named_bootstrap() -> None:
    body = {**SGLANG, "bootstrap_room": 42}
    assert translate(body, Side.DECODE) is FrontEnd.SGLANG
    assert parse_kv_params(body["kv_transfer_params"]) == DecodeParams(42, "10.0.0.2", 8998, None)
    assert body["max_tokens"] == 9
    body = {**SGLANG, "bootstrap_port": None, "bootstrap_room": 1}
    translate(body, Side.DECODE)
    assert body["kv_transfer_params"]["bootstrap_port"] == 18800  # sglang-router's "--prefill URL none"


@pytest.mark.parametrize("bad", [{"bootstrap_room": -1}, {"bootstrap_room": 1, "bootstrap_host": None}])
def test_sglang_fields_that_cannot_be_used_are_refused(bad: dict[str, Any]) -> None:
    with pytest.raises(TranslationError):
        translate({**SGLANG, **bad}, Side.DECODE)


def test_mooncake_transfer_id_gives_both_sides_the_same_room() -> None:
    p = {"kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False, "transfer_id": "xfer-1"}}
    d = {
        "kv_transfer_params": {
            "do_remote_decode": False,
            "do_remote_prefill": True,
            "transfer_id": "xfer-1",
            "remote_bootstrap_addr": "http://127.0.0.1:41003",
            "remote_engine_id": engine_id(1),
        }
    }
    assert translate(p, Side.PREFILL) is translate(d, Side.DECODE) is FrontEnd.MOONCAKE
    room = room_of_transfer_id("xfer-1")
    assert parse_kv_params(p["kv_transfer_params"]) == PrefillParams(room)
    assert parse_kv_params(d["kv_transfer_params"]) == DecodeParams(room, "127.0.0.1", 41003, 1)
    assert room != room_of_transfer_id("xfer-2")


def test_own_params_are_left_alone() -> None:
    body = {"kv_transfer_params": {"do_remote_decode": True, "bootstrap_room": 5}, "bootstrap_room": 6}
    assert translate(dict(body), Side.PREFILL) is None
    assert dp_rank_of_engine_id("eng-0") is None and dp_rank_of_engine_id(engine_id(3)) == 3


async def echo(request: Request) -> JSONResponse:
    return JSONResponse(json.loads(await request.body()))


def _client(role: str) -> TestClient:
    app = Starlette(routes=[Route("/v1/completions", echo, methods=["POST"])])
    app.add_middleware(KVParamsValidationMiddleware)
    kv = SimpleNamespace(kv_connector="PDConnector", kv_role=role, kv_connector_extra_config={})
    app.state.vllm_config = SimpleNamespace(kv_transfer_config=kv, cache_config=SimpleNamespace(block_size=0))
    return TestClient(app)


def test_middleware_maps_sglang_fields_on_prefill() -> None:
    with _client("kv_producer") as client:
        r = client.post("/v1/completions", json={**SGLANG, "bootstrap_room": 7})
    assert r.status_code == 200
    assert r.json()["kv_transfer_params"] == PrefillParams(7).to_json() and r.json()["max_tokens"] == 1
    with _client("kv_producer") as client:
        r = client.post("/v1/completions", json={**SGLANG, "bootstrap_room": "x"})
    assert r.status_code == 400 and "bootstrap_room" in r.json()["error"]["message"]


def test_bootstrap_server_answers_mooncake_query() -> None:
    state = BootstrapState(attn_tp_size=1, attn_dp_size=2)
    with TestClient(create_app(state, token=b"t" * 32)) as client:
        assert client.get("/query").status_code == 503  # ranks still registering
        for dp in range(2):
            state.register_rank(RegisterRank(1, 0, 2, dp, "127.0.0.1", 9000 + dp, 16, "auto"))
        r = client.get("/query")  # unsigned: vllm-router cannot sign, and the answer names no address
    assert r.status_code == 200
    assert r.json() == {str(dp): {"engine_id": engine_id(dp), "worker_addr": {}} for dp in range(2)}
