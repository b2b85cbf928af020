"""The Router (``python -m proxy``) as a real process in front of real fake-backend processes."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from typing import Any

import httpx
import pytest
from proxy_testlib import HOST, Backends, Router, RouterFactory, wait_until

PATHS = ("/v1/completions", "/v1/chat/completions")


def _body(path: str, **extra: Any) -> dict[str, Any]:
    if path.endswith("/chat/completions"):
        return {"model": "fake-model", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8, **extra}
    return {"model": "fake-model", "prompt": "Hi", "max_tokens": 8, **extra}


def _rid(tag: str) -> str:
    return f"test-{tag}-{uuid.uuid4().hex[:8]}"


def _client(timeout: float = 20.0) -> httpx.Client:
    return httpx.Client(timeout=timeout, trust_env=False)


def _records(port: int, rid: str) -> list[dict[str, Any]]:
    stats = httpx.get(f"http://{HOST}:{port}/stats", timeout=5, trust_env=False).json()
    return [r for r in stats["requests"] if r["request_id"] == rid]


def _record(port: int, rid: str) -> dict[str, Any]:
    found = wait_until(lambda: _records(port, rid), timeout=10)
    assert len(found) == 1, found
    return found[0]


def _wait_state(port: int, rid: str, state: str, timeout: float = 10) -> dict[str, Any]:
    """Wait until the backend's record of request ``rid`` reaches ``state`` (e.g. disconnected)."""
    return wait_until(lambda: next((r for r in _records(port, rid) if r["state"] == state), None), timeout)


def _sse_events(raw: bytes) -> list[str]:
    return [block[len("data: ") :] for block in raw.decode().split("\n\n") if block.startswith("data: ")]


def _assert_openai_error(response: httpx.Response, status: int, error_type: str) -> dict[str, Any]:
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    error = response.json()["error"]
    assert error["type"] == error_type
    assert error["code"] == status
    assert error["param"] is None
    assert error["message"]
    return error


# --- Routers, one per backend combination (started once, outside the per-test timeout) ---


@pytest.fixture(scope="session")
def router_ok(backends: Backends, router_factory: RouterFactory) -> Router:
    return router_factory(backends.ok_p, backends.ok_d)


@pytest.fixture(scope="session")
def router_p500(backends: Backends, router_factory: RouterFactory) -> Router:
    return router_factory(backends.fail500, backends.hang)


@pytest.fixture(scope="session")
def router_d500(backends: Backends, router_factory: RouterFactory) -> Router:
    return router_factory(backends.ok_p, backends.fail500)


@pytest.fixture(scope="session")
def router_p_down(backends: Backends, router_factory: RouterFactory) -> Router:
    return router_factory(backends.down, backends.hang)


@pytest.fixture(scope="session")
def router_d_down(backends: Backends, router_factory: RouterFactory) -> Router:
    return router_factory(backends.hang, backends.down)


@pytest.fixture(scope="session")
def router_slow(backends: Backends, router_factory: RouterFactory) -> Router:
    return router_factory(backends.hang, backends.slow_stream)


@pytest.fixture(scope="session")
def router_p_late_fail(backends: Backends, router_factory: RouterFactory) -> Router:
    return router_factory(backends.fail500_late, backends.slow_stream)


@pytest.fixture(scope="session")
def router_p500_late_d(backends: Backends, router_factory: RouterFactory) -> Router:
    return router_factory(backends.fail500, backends.late_stream)


@pytest.fixture(scope="session")
def router_late_d(backends: Backends, router_factory: RouterFactory) -> Router:
    return router_factory(backends.ok_p, backends.late_stream)


@pytest.fixture(scope="session")
def router_timeout(backends: Backends, router_factory: RouterFactory) -> Router:
    return router_factory(backends.ok_p, backends.hang, "--request-timeout", "1.5")


# --- happy path -------------------------------------------------------------------------


@pytest.mark.parametrize("path", PATHS)
def test_non_streaming_request_reaches_p_and_d(router_ok: Router, path: str) -> None:
    rid = _rid("json")
    body = _body(path, min_tokens=2, max_completion_tokens=8, temperature=0)
    headers = {"X-Request-Id": rid, "Authorization": "Bearer sk-test"}
    with _client() as client:
        response = client.post(f"{router_ok.url}{path}", json=body, headers=headers)
    assert response.status_code == 200, response.text
    assert response.headers["x-request-id"] == rid
    answer = response.json()
    assert answer["choices"], answer
    assert answer["served_by"] == router_ok.decode_port

    p = _record(router_ok.prefill_port, rid)
    d = _record(router_ok.decode_port, rid)
    assert p["path"] == d["path"] == path
    assert p["authorization"] == d["authorization"] == "Bearer sk-test"
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
        "prefill_dp_rank": 0,
    }
    assert answer["kv_transfer_params"] == db["kv_transfer_params"]


@pytest.mark.parametrize("path", PATHS)
def test_streaming_request_relays_d_stream(router_ok: Router, path: str) -> None:
    rid = _rid("sse")
    body = _body(path, stream=True, stream_options={"include_usage": True})
    with _client() as client:
        with client.stream("POST", f"{router_ok.url}{path}", json=body, headers={"X-Request-Id": rid}) as response:
            assert response.status_code == 200
            assert response.headers["content-type"].startswith("text/event-stream")
            assert response.headers["x-request-id"] == rid
            raw = response.read()
    events = _sse_events(raw)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert len(chunks) >= 3
    assert all("error" not in c for c in chunks)

    p = _record(router_ok.prefill_port, rid)
    d = _record(router_ok.decode_port, rid)
    pb, db = p["body"], d["body"]
    assert pb["stream"] is False and "stream_options" not in pb and pb["max_tokens"] == 1
    assert db["stream"] is True and db["stream_options"] == {"include_usage": True}
    assert db["kv_transfer_params"]["do_remote_prefill"] is True
    assert db["kv_transfer_params"]["bootstrap_room"] == pb["kv_transfer_params"]["bootstrap_room"]
    assert chunks[0]["kv_transfer_params"] == db["kv_transfer_params"]
    assert p["state"] == "completed"
    wait_until(lambda: _record(router_ok.decode_port, rid)["state"] == "completed", timeout=5)


def test_request_id_is_generated_and_forwarded(router_ok: Router) -> None:
    with _client() as client:
        response = client.post(f"{router_ok.url}/v1/completions", json=_body("/v1/completions"))
    assert response.status_code == 200
    rid = response.headers["x-request-id"]
    assert rid
    assert _record(router_ok.prefill_port, rid)["request_id"] == rid
    assert _record(router_ok.decode_port, rid)["request_id"] == rid


@pytest.mark.parametrize("where", ["top", "kv"])
def test_client_bootstrap_room_is_used(router_ok: Router, where: str) -> None:
    rid = _rid("room")
    room = 2**63 - 5
    if where == "top":
        body = _body("/v1/completions", bootstrap_room=room)
    else:
        body = _body("/v1/completions", kv_transfer_params={"bootstrap_room": room})
    with _client() as client:
        response = client.post(f"{router_ok.url}/v1/completions", json=body, headers={"X-Request-Id": rid})
    assert response.status_code == 200, response.text
    for port in (router_ok.prefill_port, router_ok.decode_port):
        sent = _record(port, rid)["body"]
        assert sent["kv_transfer_params"]["bootstrap_room"] == room
        assert "bootstrap_room" not in sent


@pytest.mark.parametrize("room", [-1, 2**63, "12", 1.5, True])
def test_invalid_bootstrap_room_is_400(router_ok: Router, room: Any) -> None:
    with _client() as client:
        response = client.post(f"{router_ok.url}/v1/completions", json=_body("/v1/completions", bootstrap_room=room))
    error = _assert_openai_error(response, 400, "invalid_request_error")
    assert "bootstrap_room" in error["message"]


def test_concurrent_requests(router_ok: Router) -> None:
    """Many requests at once, streamed and not, through the one shared client; each gets its own room."""

    async def one(client: httpx.AsyncClient, index: int) -> tuple[str, bytes, int]:
        rid = _rid(f"many{index}")
        stream = index % 2 == 0
        path = PATHS[index % len(PATHS)]
        response = await client.post(
            f"{router_ok.url}{path}", json=_body(path, stream=stream), headers={"X-Request-Id": rid}
        )
        return rid, response.content, response.status_code

    async def run_all() -> list[tuple[str, bytes, int]]:
        async with httpx.AsyncClient(timeout=20, trust_env=False) as client:
            return await asyncio.gather(*(one(client, i) for i in range(24)))

    results = asyncio.run(run_all())
    assert all(status == 200 and content for _, content, status in results)
    rooms = {
        _record(router_ok.decode_port, rid)["body"]["kv_transfer_params"]["bootstrap_room"] for rid, _, _ in results
    }
    assert len(rooms) == len(results)


def test_models_forwarded_to_decoder(router_ok: Router) -> None:
    with _client() as client:
        response = client.get(f"{router_ok.url}/v1/models")
    assert response.status_code == 200
    assert response.json()["data"][0]["owned_by"] == f"fake-{router_ok.decode_port}"


# --- bad requests -----------------------------------------------------------------------


@pytest.mark.parametrize("payload", [b"{not json", b"[1, 2]", b"\xff\xfe", b""])
def test_invalid_json_is_400_and_router_keeps_serving(router_ok: Router, payload: bytes) -> None:
    with _client() as client:
        response = client.post(
            f"{router_ok.url}/v1/chat/completions", content=payload, headers={"Content-Type": "application/json"}
        )
        _assert_openai_error(response, 400, "invalid_request_error")
        assert response.headers["x-request-id"]
        again = client.post(f"{router_ok.url}/v1/chat/completions", json=_body("/v1/chat/completions"))
    assert again.status_code == 200, again.text


# --- prefill failures -------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True])
def test_prefill_500_gives_502_and_cancels_decode(router_p500: Router, stream: bool) -> None:
    rid = _rid("p500")
    with _client() as client:
        response = client.post(
            f"{router_p500.url}/v1/completions",
            json=_body("/v1/completions", stream=stream),
            headers={"X-Request-Id": rid},
        )
    error = _assert_openai_error(response, 502, "prefill_failed")
    assert f"prefiller {HOST}:{router_p500.prefill_port}" in error["message"]
    assert "500" in error["message"]
    assert response.headers["x-request-id"] == rid
    # D (hang) was waiting for the KV: the Router must have closed that request.
    _wait_state(router_p500.decode_port, rid, "disconnected")


@pytest.mark.parametrize("stream", [False, True])
def test_prefill_down_gives_503_quickly_and_cancels_decode(router_p_down: Router, stream: bool) -> None:
    rid = _rid("pdown")
    started = time.monotonic()
    with _client() as client:
        response = client.post(
            f"{router_p_down.url}/v1/chat/completions",
            json=_body("/v1/chat/completions", stream=stream),
            headers={"X-Request-Id": rid},
        )
    assert time.monotonic() - started < 10
    error = _assert_openai_error(response, 503, "prefill_failed")
    assert f"{HOST}:{router_p_down.prefill_port}" in error["message"]
    _wait_state(router_p_down.decode_port, rid, "disconnected")


def test_prefill_fails_after_d_stream_headers_but_before_data_gives_502(router_p500_late_d: Router) -> None:
    """D (like vLLM) sent its 200 headers at once; P failed before D's first chunk: a real 502."""
    rid = _rid("p500-hdr")
    with _client() as client:
        response = client.post(
            f"{router_p500_late_d.url}/v1/chat/completions",
            json=_body("/v1/chat/completions", stream=True),
            headers={"X-Request-Id": rid},
        )
    _assert_openai_error(response, 502, "prefill_failed")
    _wait_state(router_p500_late_d.decode_port, rid, "disconnected")


def test_stream_whose_data_comes_late_is_relayed(router_late_d: Router) -> None:
    rid = _rid("late")
    with _client() as client:
        with client.stream(
            "POST",
            f"{router_late_d.url}/v1/completions",
            json=_body("/v1/completions", stream=True),
            headers={"X-Request-Id": rid},
        ) as response:
            assert response.status_code == 200
            raw = response.read()
    assert _sse_events(raw)[-1] == "[DONE]"


def test_prefill_fails_after_stream_started_ends_with_error_event(router_p_late_fail: Router) -> None:
    rid = _rid("plate")
    with _client() as client:
        with client.stream(
            "POST",
            f"{router_p_late_fail.url}/v1/completions",
            json=_body("/v1/completions", stream=True),
            headers={"X-Request-Id": rid},
        ) as response:
            assert response.status_code == 200
            raw = response.read()
    events = _sse_events(raw)
    assert len(events) >= 2  # some of D's chunks went out before P failed
    assert "[DONE]" not in events
    last = json.loads(events[-1])
    assert last["error"]["type"] == "prefill_failed"
    assert last["error"]["code"] == 502
    assert all("error" not in json.loads(e) for e in events[:-1])
    _wait_state(router_p_late_fail.decode_port, rid, "disconnected")


# --- decode failures --------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True])
def test_decoder_500_is_passed_through(router_d500: Router, stream: bool) -> None:
    rid = _rid("d500")
    with _client() as client:
        response = client.post(
            f"{router_d500.url}/v1/completions",
            json=_body("/v1/completions", stream=stream),
            headers={"X-Request-Id": rid},
        )
    assert response.status_code == 500
    assert response.json() == {
        "error": {
            "message": f"fake backend {router_d500.decode_port} failed on purpose",
            "type": "InternalServerError",
            "code": 500,
        },
        "object": "error",
    }
    assert response.headers["x-request-id"] == rid


@pytest.mark.parametrize("stream", [False, True])
def test_decoder_down_gives_503_and_cancels_prefill(router_d_down: Router, stream: bool) -> None:
    rid = _rid("ddown")
    started = time.monotonic()
    with _client() as client:
        response = client.post(
            f"{router_d_down.url}/v1/completions",
            json=_body("/v1/completions", stream=stream),
            headers={"X-Request-Id": rid},
        )
    assert time.monotonic() - started < 10
    error = _assert_openai_error(response, 503, "decode_failed")
    assert f"decoder {HOST}:{router_d_down.decode_port}" in error["message"]
    _wait_state(router_d_down.prefill_port, rid, "disconnected")


def test_models_with_decoder_down_is_503(router_d_down: Router) -> None:
    with _client() as client:
        response = client.get(f"{router_d_down.url}/v1/models")
    _assert_openai_error(response, 503, "decode_failed")


def test_decoder_timeout_gives_504_and_closes_decode(router_timeout: Router) -> None:
    rid = _rid("dtimeout")
    started = time.monotonic()
    with _client() as client:
        response = client.post(
            f"{router_timeout.url}/v1/completions", json=_body("/v1/completions"), headers={"X-Request-Id": rid}
        )
    assert time.monotonic() - started < 10
    _assert_openai_error(response, 504, "decode_failed")
    _wait_state(router_timeout.decode_port, rid, "disconnected")


# --- client disconnects -----------------------------------------------------------------


@pytest.mark.parametrize("path", PATHS)
def test_client_disconnect_mid_stream_closes_both_backend_requests(router_slow: Router, path: str) -> None:
    rid = _rid("gone")
    with _client() as client:
        with client.stream(
            "POST", f"{router_slow.url}{path}", json=_body(path, stream=True), headers={"X-Request-Id": rid}
        ) as response:
            assert response.status_code == 200
            received = b""
            for chunk in response.iter_bytes():
                received += chunk
                if received.count(b"data: ") >= 2:
                    break
    # Leaving the blocks closed the client's connection mid-stream.
    _wait_state(router_slow.decode_port, rid, "disconnected")
    _wait_state(router_slow.prefill_port, rid, "disconnected")


def test_client_disconnect_before_answer_closes_both_backend_requests(router_slow: Router) -> None:
    """Non-streaming: the client gives up while P hangs and D is still working."""
    rid = _rid("gone-json")
    with _client(timeout=1.0) as client:
        with pytest.raises(httpx.ReadTimeout):
            client.post(
                f"{router_slow.url}/v1/completions", json=_body("/v1/completions"), headers={"X-Request-Id": rid}
            )
    _wait_state(router_slow.decode_port, rid, "disconnected")
    _wait_state(router_slow.prefill_port, rid, "disconnected")


# --- health -----------------------------------------------------------------------------


def test_health_ok(router_ok: Router) -> None:
    response = httpx.get(f"{router_ok.url}/health", timeout=10, trust_env=False)
    assert response.status_code == 200
    body = response.json()
    assert body["status"] == "healthy"
    assert [r["healthy"] for r in body["prefillers"]] == [True]
    assert [r["healthy"] for r in body["decoders"]] == [True]
    assert body["prefillers"][0]["bootstrap_port"] == router_ok.bootstrap_port


def test_health_reflects_a_down_backend(router_p_down: Router) -> None:
    response = httpx.get(f"{router_p_down.url}/health", timeout=10, trust_env=False)
    assert response.status_code == 503
    body = response.json()
    assert body["status"] == "unhealthy"
    (prefiller,) = body["prefillers"]
    assert prefiller["healthy"] is False and prefiller["port"] == router_p_down.prefill_port
    assert prefiller["error"]
    assert [r["healthy"] for r in body["decoders"]] == [True]
