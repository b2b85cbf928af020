"""The Router (``python -m proxy``) as a real process forwarding to real fake-backend processes.

What P and D are sent (P: one token, no stream; D: the client's request plus where the KV comes from),
request ids and bootstrap rooms, concurrent requests, /v1/models, and D's answer (stream or JSON)
reaching the client unchanged. ``router_ok`` comes from conftest.py.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import pytest

from tests.support.router_rig import (
    HOST,
    PATHS,
    Backends,
    Router,
    RouterFactory,
    assert_openai_error,
    http_client,
    new_rid,
    record,
    request_body,
    sse_events,
    wait_until,
)

# --- happy path -------------------------------------------------------------------------


@pytest.mark.parametrize("path", PATHS)
def test_non_streaming_request_reaches_p_and_d(router_ok: Router, path: str) -> None:
    rid = new_rid("json")
    body = request_body(path, min_tokens=2, max_completion_tokens=8, temperature=0)
    headers = {"X-Request-Id": rid, "Authorization": "Bearer sk-test"}
    with http_client() as client:
        response = client.post(f"{router_ok.url}{path}", json=body, headers=headers)
    assert response.status_code == 200, response.text
    assert response.headers["x-request-id"] == rid
    answer = response.json()
    assert answer["choices"], answer
    assert answer["served_by"] == router_ok.decode_port

    p = record(router_ok.prefill_port, rid)
    d = record(router_ok.decode_port, rid)
    assert p["path"] == d["path"] == path
    # The client's Authorization is its key for the Router: never passed on (no backend key here).
    assert p["authorization"] is None and d["authorization"] is None
    pb, db = p["body"], d["body"]
    # P: one token, no stream, EOS ignored, feeds a remote decode.
    assert pb["max_tokens"] == 1
    assert pb["max_completion_tokens"] == 1
    assert pb["stream"] is False
    assert pb["ignore_eos"] is True
    assert "min_tokens" not in pb
    assert pb["temperature"] == 0
    room = pb["kv_transfer_params"]["bootstrap_room"]
    assert pb["kv_transfer_params"] == {"do_remote_decode": True, "do_remote_prefill": False, "bootstrap_room": room}
    assert isinstance(room, int) and 0 <= room < 2**63
    # D: the client's request unchanged, plus where P's KV comes from.
    assert db["max_tokens"] == 8
    assert db["max_completion_tokens"] == 8
    assert db["min_tokens"] == 2
    assert "ignore_eos" not in db
    assert db["kv_transfer_params"] == {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "bootstrap_room": room,
        "bootstrap_host": HOST,
        "bootstrap_port": router_ok.bootstrap_port,
    }
    assert answer["kv_transfer_params"] == db["kv_transfer_params"]


@pytest.mark.parametrize("path", PATHS)
def test_streaming_request_relays_d_stream(router_ok: Router, path: str) -> None:
    rid = new_rid("sse")
    body = request_body(path, stream=True, stream_options={"include_usage": True})
    with http_client() as client:
        with client.stream("POST", f"{router_ok.url}{path}", json=body, headers={"X-Request-Id": rid}) as response:
            assert response.status_code == 200
            assert response.headers["content-type"].startswith("text/event-stream")
            assert response.headers["x-request-id"] == rid
            raw = response.read()
    events = sse_events(raw)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert len(chunks) >= 3
    assert all("error" not in c for c in chunks)

    p = record(router_ok.prefill_port, rid)
    d = record(router_ok.decode_port, rid)
    pb, db = p["body"], d["body"]
    assert pb["stream"] is False and "stream_options" not in pb and pb["max_tokens"] == 1
    assert db["stream"] is True and db["stream_options"] == {"include_usage": True}
    assert db["kv_transfer_params"]["do_remote_prefill"] is True
    assert db["kv_transfer_params"]["bootstrap_room"] == pb["kv_transfer_params"]["bootstrap_room"]
    assert chunks[0]["kv_transfer_params"] == db["kv_transfer_params"]
    assert p["state"] == "completed"
    wait_until(lambda: record(router_ok.decode_port, rid)["state"] == "completed", timeout=5)


def test_request_id_is_generated_and_forwarded(router_ok: Router) -> None:
    with http_client() as client:
        response = client.post(f"{router_ok.url}/v1/completions", json=request_body("/v1/completions"))
    assert response.status_code == 200
    rid = response.headers["x-request-id"]
    assert rid
    assert record(router_ok.prefill_port, rid)["request_id"] == rid
    assert record(router_ok.decode_port, rid)["request_id"] == rid


@pytest.mark.parametrize("where", ["top", "kv"])
def test_client_bootstrap_room_is_used(router_ok: Router, where: str) -> None:
    rid = new_rid("room")
    room = 2**63 - 5
    if where == "top":
        body = request_body("/v1/completions", bootstrap_room=room)
    else:
        body = request_body("/v1/completions", kv_transfer_params={"bootstrap_room": room})
    with http_client() as client:
        response = client.post(f"{router_ok.url}/v1/completions", json=body, headers={"X-Request-Id": rid})
    assert response.status_code == 200, response.text
    for port in (router_ok.prefill_port, router_ok.decode_port):
        sent = record(port, rid)["body"]
        assert sent["kv_transfer_params"]["bootstrap_room"] == room
        assert "bootstrap_room" not in sent


@pytest.mark.parametrize("room", [-1, 2**63, "12", 1.5, True])
def test_invalid_bootstrap_room_is_400(router_ok: Router, room: Any) -> None:
    with http_client() as client:
        response = client.post(
            f"{router_ok.url}/v1/completions", json=request_body("/v1/completions", bootstrap_room=room)
        )
    error = assert_openai_error(response, 400, "invalid_request_error", "bootstrap_room")
    assert "bootstrap_room" in error["message"]


def test_concurrent_requests(router_ok: Router) -> None:
    """Many requests at once, streamed and not, through the one shared client; each gets its own room."""

    async def one(client: httpx.AsyncClient, index: int) -> tuple[str, bytes, int]:
        rid = new_rid(f"many{index}")
        stream = index % 2 == 0
        path = PATHS[index % len(PATHS)]
        response = await client.post(
            f"{router_ok.url}{path}", json=request_body(path, stream=stream), headers={"X-Request-Id": rid}
        )
        return rid, response.content, response.status_code

    async def run_all() -> list[tuple[str, bytes, int]]:
        async with httpx.AsyncClient(timeout=20, trust_env=False) as client:
            return await asyncio.gather(*(one(client, i) for i in range(24)))

    results = asyncio.run(run_all())
    assert all(status == 200 and content for _, content, status in results)
    rooms = {
        record(router_ok.decode_port, rid)["body"]["kv_transfer_params"]["bootstrap_room"] for rid, _, _ in results
    }
    assert len(rooms) == len(results)


def test_models_forwarded_to_decoder(router_ok: Router) -> None:
    with http_client() as client:
        response = client.get(f"{router_ok.url}/v1/models")
    assert response.status_code == 200
    assert response.json()["data"][0]["owned_by"] == f"fake-{router_ok.decode_port}"


# --- passthrough ----------------------------------------------------------------------------


@pytest.mark.parametrize("path", PATHS)
def test_stream_bytes_are_passed_through_unchanged(
    backends: Backends, router_factory: RouterFactory, path: str
) -> None:
    """The client gets exactly the bytes D would have sent it directly (chunking aside). Resume off: a
    resumable completions stream has D's token ids nulled and its first event re-encoded (tests/proxy/test_resume.py)."""
    router_ok = router_factory(backends.ok_p, backends.ok_d, "--resume-attempts", "0")
    rid = new_rid("bytes")
    body = request_body(path, stream=True, stream_options={"include_usage": True}, bootstrap_room=77)
    with http_client() as client:
        via_router = client.post(f"{router_ok.url}{path}", json=body, headers={"X-Request-Id": rid})
        sent_to_d = record(router_ok.decode_port, rid)["body"]
        direct = client.post(
            f"http://{HOST}:{router_ok.decode_port}{path}", json=sent_to_d, headers={"X-Request-Id": rid}
        )
    assert via_router.status_code == direct.status_code == 200
    assert via_router.content == direct.content
    assert via_router.headers["content-type"] == direct.headers["content-type"]
    # Usage fields intact: the last chunk before [DONE] carries them.
    events = sse_events(via_router.content)
    assert json.loads(events[-2])["usage"] == {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}


@pytest.mark.parametrize("path", PATHS)
def test_json_answer_is_passed_through_unchanged(router_ok: Router, path: str) -> None:
    rid = new_rid("json-bytes")
    with http_client() as client:
        via_router = client.post(f"{router_ok.url}{path}", json=request_body(path), headers={"X-Request-Id": rid})
    answer = via_router.json()
    assert answer["usage"] == {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}
    assert answer["id"] == f"cmpl-{rid}"
