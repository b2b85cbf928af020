"""A D request whose KV load failed gets an error naming the room and what P's bootstrap server says of it,
not vLLM's bare "Internal server error" (pd_connector.api_server.load_errors).

The middleware in front of a tiny Starlette app that answers as vLLM's OpenAI layer does for a request
finished with an error; the names come from a real bootstrap server over a real P rank (the in-process
rig of test_transfer_manager)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.testclient import TestClient

from pd_connector.api_server.load_errors import LOAD_FAILED_STATUS, LOAD_FAILED_TYPE, describe
from pd_connector.api_server.validation import KVParamsValidationMiddleware
from pd_connector.bootstrap.client import release_room
from pd_connector.bootstrap.rooms_api import RankRooms
from pd_connector.bootstrap.server import BootstrapServer
from pd_connector.metadata import SendJob
from tests.support.loopback import HOST, free_port
from tests.support.transfer_rig import BLOCK_SIZE, Rig, Side

BARE = {"error": {"message": "Internal server error", "type": "InternalServerError", "param": None, "code": 500}}
OTHER = {"error": {"message": "something else broke", "type": "InternalServerError", "param": None, "code": 500}}


async def _vllm_like(request: Request) -> Response:
    """Answers as vLLM's OpenAI layer: the prompt picks a bare error, another 500, a stream, or tokens."""
    body = json.loads(await request.body())
    what = body["prompt"]
    if what == "bare":
        return JSONResponse(BARE, status_code=500)
    if what == "other":
        return JSONResponse(OTHER, status_code=500)
    if what == "stream":

        async def events() -> Any:
            yield b"data: " + json.dumps(BARE).encode() + b"\n\n"
            yield b"data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")
    return JSONResponse({"choices": [{"text": "ok"}]})


@pytest.fixture
def p_rank(rig: Rig) -> Iterator[tuple[Side, int]]:
    p = rig.make("prefill", seed=31)
    assert p.mgr.prefill is not None
    rooms = RankRooms(rig.server.state, p.mgr.prefill, p.mgr.channel.send, p.mgr.endpoint)
    server = BootstrapServer(rig.server.state, HOST, free_port(), rooms=rooms)
    server.start()
    try:
        yield p, server.port
    finally:
        server.stop()


def _post(client: TestClient, port: int, room: int, prompt: str) -> Any:
    params = {"do_remote_prefill": True, "bootstrap_room": room, "bootstrap_host": HOST, "bootstrap_port": port}
    body = {"model": "m", "prompt": prompt, "kv_transfer_params": params}
    return client.post("/v1/completions", json=body)


@pytest.fixture
def client() -> Iterator[TestClient]:
    app = Starlette(routes=[Route("/v1/completions", _vllm_like, methods=["POST"])])
    with TestClient(KVParamsValidationMiddleware(app)) as c:
        yield c


def test_a_room_p_never_prefilled_is_named(client: TestClient, p_rank: tuple[Side, int]) -> None:
    _, port = p_rank
    r = _post(client, port, 123, "bare")
    assert r.status_code == LOAD_FAILED_STATUS
    err = r.json()["error"]
    assert err["type"] == LOAD_FAILED_TYPE and err["param"] == "kv_transfer_params"
    assert err["message"] == (
        f"room 123: prefill at {HOST}:{port} holds no KV for this room (never prefilled, or already released)"
    )


def test_a_released_room_names_why(client: TestClient, p_rank: tuple[Side, int]) -> None:
    p, port = p_rank
    p.mgr.add_sends([SendJob("p-req", 124, [1], BLOCK_SIZE)])
    release_room(f"{HOST}:{port}", 124, "client disconnected before the answer", 2.0)
    p.wait_sent("p-req", timeout=2)
    message = _post(client, port, 124, "bare").json()["error"]["message"]
    assert message.startswith(f"room 124: prefill at {HOST}:{port} no longer holds KV for this room")
    assert "client disconnected before the answer" in message


def test_a_held_room_points_at_decodes_log(client: TestClient, p_rank: tuple[Side, int]) -> None:
    p, port = p_rank
    p.mgr.add_sends([SendJob("p-req", 125, [1], BLOCK_SIZE)])
    message = _post(client, port, 125, "bare").json()["error"]["message"]
    assert "holds this room's KV, but loading it failed" in message and "room=125" in message


def test_a_stream_error_event_is_named(client: TestClient, p_rank: tuple[Side, int]) -> None:
    _, port = p_rank
    r = _post(client, port, 126, "stream")
    assert r.status_code == 200
    events = [e for e in r.text.split("\n\n") if e]
    first = json.loads(events[0][len("data: ") :])
    assert first["error"]["code"] == LOAD_FAILED_STATUS
    assert first["error"]["message"].startswith(f"room 126: prefill at {HOST}:{port} holds no KV")
    assert events[-1] == "data: [DONE]"


def test_other_answers_pass_untouched(client: TestClient, p_rank: tuple[Side, int]) -> None:
    _, port = p_rank
    r = _post(client, port, 127, "other")
    assert r.status_code == 500 and r.json() == OTHER
    r = _post(client, port, 127, "tokens")
    assert r.status_code == 200 and r.json() == {"choices": [{"text": "ok"}]}


def test_an_unreachable_bootstrap_server_is_named_too(client: TestClient) -> None:
    port = free_port()  # nothing listens there
    r = _post(client, port, 128, "bare")
    message = r.json()["error"]["message"]
    assert r.status_code == LOAD_FAILED_STATUS
    assert message.startswith(f"room 128: prefill at {HOST}:{port}: loading the KV failed")
    assert "could not tell why" in message


def test_describe_names_a_prefill_still_running_and_another_dp_rank() -> None:
    running = describe("h:1", 7, {"state": "awaiting_prefill"})
    assert running == "room 7: prefill at h:1 has not finished this room's prefill (kv_wait_timeout_s ran out first)"
    other_dp = describe("h:1", 7, {"state": "unknown", "dp_rank": 2, "seen_by": "dp rank 0"})
    assert other_dp.endswith("(never prefilled, or already released); its DP rank 2 holds the room")
