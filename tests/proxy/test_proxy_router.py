"""The Router (``python -m proxy``) as a real process in front of real fake-backend processes."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import httpx
import pytest

from tests.support.router_rig import (
    HOST,
    PATHS,
    Backends,
    Router,
    RouterFactory,
    admin_headers,
    assert_openai_error,
    http_client,
    new_rid,
    record,
    request_body,
    sse_events,
    wait_none_open,
    wait_state,
    wait_until,
)

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


# --- bad requests -----------------------------------------------------------------------


@pytest.mark.parametrize("payload", [b"{not json", b"[1, 2]", b"\xff\xfe", b"", b"[" * 100_000 + b"]" * 100_000])
def test_invalid_json_is_400_and_router_keeps_serving(router_ok: Router, payload: bytes) -> None:
    with http_client() as client:
        response = client.post(
            f"{router_ok.url}/v1/chat/completions", content=payload, headers={"Content-Type": "application/json"}
        )
        assert_openai_error(response, 400, "invalid_request_error")
        assert response.headers["x-request-id"]
        again = client.post(f"{router_ok.url}/v1/chat/completions", json=request_body("/v1/chat/completions"))
    assert again.status_code == 200, again.text


# --- prefill failures -------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True])
def test_prefill_500_gives_502_and_cancels_decode(router_p500: Router, stream: bool) -> None:
    rid = new_rid("p500")
    with http_client() as client:
        response = client.post(
            f"{router_p500.url}/v1/completions",
            json=request_body("/v1/completions", stream=stream),
            headers={"X-Request-Id": rid},
        )
    error = assert_openai_error(response, 502, "prefill_failed")
    assert f"prefiller {HOST}:{router_p500.prefill_port}" in error["message"]
    assert "500" in error["message"]
    assert response.headers["x-request-id"] == rid
    # D (hang) was waiting for the KV: the Router must have closed that request.
    wait_state(router_p500.decode_port, rid, "disconnected")


@pytest.mark.parametrize("stream", [False, True])
def test_prefill_down_gives_503_quickly_and_cancels_decode(router_p_down: Router, stream: bool) -> None:
    rid = new_rid("pdown")
    started = time.monotonic()
    with http_client() as client:
        response = client.post(
            f"{router_p_down.url}/v1/chat/completions",
            json=request_body("/v1/chat/completions", stream=stream),
            headers={"X-Request-Id": rid},
        )
    assert time.monotonic() - started < 10
    error = assert_openai_error(response, 503, "prefill_failed")
    assert f"{HOST}:{router_p_down.prefill_port}" in error["message"]
    wait_none_open(router_p_down.decode_port, rid)


def test_prefill_fails_after_d_stream_headers_but_before_data_gives_502(router_p500_late_d: Router) -> None:
    """D (like vLLM) sent its 200 headers at once; P failed before D's first chunk: a real 502."""
    rid = new_rid("p500-hdr")
    with http_client() as client:
        response = client.post(
            f"{router_p500_late_d.url}/v1/chat/completions",
            json=request_body("/v1/chat/completions", stream=True),
            headers={"X-Request-Id": rid},
        )
    assert_openai_error(response, 502, "prefill_failed")
    wait_state(router_p500_late_d.decode_port, rid, "disconnected")


def test_stream_whose_data_comes_late_is_relayed(router_late_d: Router) -> None:
    rid = new_rid("late")
    with http_client() as client:
        with client.stream(
            "POST",
            f"{router_late_d.url}/v1/completions",
            json=request_body("/v1/completions", stream=True),
            headers={"X-Request-Id": rid},
        ) as response:
            assert response.status_code == 200
            raw = response.read()
    assert sse_events(raw)[-1] == "[DONE]"


def test_prefill_fails_after_stream_started_ends_with_error_event(router_p_late_fail: Router) -> None:
    rid = new_rid("plate")
    with http_client() as client:
        with client.stream(
            "POST",
            f"{router_p_late_fail.url}/v1/completions",
            json=request_body("/v1/completions", stream=True),
            headers={"X-Request-Id": rid},
        ) as response:
            assert response.status_code == 200
            raw = response.read()
    events = sse_events(raw)
    assert len(events) >= 2  # some of D's chunks went out before P failed
    assert "[DONE]" not in events
    last = json.loads(events[-1])
    assert last["error"]["type"] == "prefill_failed"
    assert last["error"]["code"] == 502
    assert all("error" not in json.loads(e) for e in events[:-1])
    wait_state(router_p_late_fail.decode_port, rid, "disconnected")


# --- decode failures --------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True])
def test_decoder_500_is_passed_through(router_d500: Router, stream: bool) -> None:
    rid = new_rid("d500")
    with http_client() as client:
        response = client.post(
            f"{router_d500.url}/v1/completions",
            json=request_body("/v1/completions", stream=stream),
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
    rid = new_rid("ddown")
    started = time.monotonic()
    with http_client() as client:
        response = client.post(
            f"{router_d_down.url}/v1/completions",
            json=request_body("/v1/completions", stream=stream),
            headers={"X-Request-Id": rid},
        )
    assert time.monotonic() - started < 10
    error = assert_openai_error(response, 503, "decode_failed")
    assert f"decoder {HOST}:{router_d_down.decode_port}" in error["message"]
    wait_none_open(router_d_down.prefill_port, rid)


def test_models_with_decoder_down_is_503(router_d_down: Router) -> None:
    with http_client() as client:
        response = client.get(f"{router_d_down.url}/v1/models")
    assert_openai_error(response, 503, "decode_failed")


def test_decoder_timeout_gives_504_and_closes_decode(router_timeout: Router) -> None:
    rid = new_rid("dtimeout")
    started = time.monotonic()
    with http_client() as client:
        response = client.post(
            f"{router_timeout.url}/v1/completions", json=request_body("/v1/completions"), headers={"X-Request-Id": rid}
        )
    assert time.monotonic() - started < 10
    assert_openai_error(response, 504, "decode_failed")
    wait_state(router_timeout.decode_port, rid, "disconnected")


# --- client disconnects -----------------------------------------------------------------


@pytest.mark.parametrize("path", PATHS)
def test_client_disconnect_mid_stream_closes_both_backend_requests(router_slow: Router, path: str) -> None:
    rid = new_rid("gone")
    with http_client() as client:
        with client.stream(
            "POST", f"{router_slow.url}{path}", json=request_body(path, stream=True), headers={"X-Request-Id": rid}
        ) as response:
            assert response.status_code == 200
            received = b""
            for chunk in response.iter_bytes():
                received += chunk
                if received.count(b"data: ") >= 2:
                    break
    # Leaving the blocks closed the client's connection mid-stream.
    wait_state(router_slow.decode_port, rid, "disconnected")
    wait_state(router_slow.prefill_port, rid, "disconnected")


def test_client_disconnect_before_answer_closes_both_backend_requests(router_slow: Router) -> None:
    """Non-streaming: the client gives up while P hangs and D is still working."""
    rid = new_rid("gone-json")
    with http_client(timeout=1.0) as client:
        with pytest.raises(httpx.ReadTimeout):
            client.post(
                f"{router_slow.url}/v1/completions", json=request_body("/v1/completions"), headers={"X-Request-Id": rid}
            )
    wait_state(router_slow.decode_port, rid, "disconnected")
    wait_state(router_slow.prefill_port, rid, "disconnected")


# --- health -----------------------------------------------------------------------------


def test_health_ok(router_ok: Router) -> None:
    public = httpx.get(f"{router_ok.url}/health", timeout=10, trust_env=False)
    assert public.status_code == 200
    assert public.json() == {
        "status": "healthy", "prefill_healthy": 1, "prefill_instances": 1, "decode_healthy": 1, "decode_instances": 1,
    }  # fmt: skip
    response = httpx.get(f"{router_ok.url}/health", headers=admin_headers(router_ok), timeout=10, trust_env=False)
    assert response.status_code == 200
    body = response.json()
    assert body["status"] == "healthy"
    assert [r["healthy"] for r in body["prefillers"]] == [True]
    assert [r["healthy"] for r in body["decoders"]] == [True]
    assert body["prefillers"][0]["bootstrap_port"] == router_ok.bootstrap_port


def test_health_reflects_a_down_backend(router_p_down: Router) -> None:
    public = httpx.get(f"{router_p_down.url}/health", timeout=10, trust_env=False)
    assert public.status_code == 503
    assert public.json()["status"] == "unhealthy" and "prefillers" not in public.json()
    url, headers = f"{router_p_down.url}/health", admin_headers(router_p_down)
    response = httpx.get(url, headers=headers, timeout=10, trust_env=False)
    assert response.status_code == 503
    body = response.json()
    assert body["status"] == "unhealthy"
    (prefiller,) = body["prefillers"]
    assert prefiller["healthy"] is False and prefiller["port"] == router_p_down.prefill_port
    assert prefiller["error"]
    assert [r["healthy"] for r in body["decoders"]] == [True]


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


# --- bad input ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "extra", "param"),
    [
        ("/v1/completions", {"stream": "yes"}, "stream"),
        ("/v1/completions", {"max_tokens": "8"}, "max_tokens"),
        ("/v1/completions", {"max_tokens": True}, "max_tokens"),
        ("/v1/completions", {"prompt": 5}, "prompt"),
        ("/v1/completions", {"prompt": None}, "prompt"),
        ("/v1/completions", {"prompt": [1, "a"]}, "prompt"),
        ("/v1/completions", {"model": 3}, "model"),
        ("/v1/completions", {"stream_options": []}, "stream_options"),
        ("/v1/completions", {"kv_transfer_params": "x"}, "kv_transfer_params"),
        ("/v1/chat/completions", {"messages": "hi"}, "messages"),
        ("/v1/chat/completions", {"messages": []}, "messages"),
        ("/v1/chat/completions", {"messages": ["hi"]}, "messages"),
    ],
)
def test_wrong_types_are_400_with_the_field_named(router_ok: Router, path: str, extra: dict, param: str) -> None:
    with http_client() as client:
        response = client.post(f"{router_ok.url}{path}", json=request_body(path, **extra))
    error = assert_openai_error(response, 400, "invalid_request_error", param)
    assert param in error["message"]


@pytest.fixture(scope="session")
def router_small_body(backends: Backends, router_factory: RouterFactory) -> Router:
    return router_factory(backends.ok_p, backends.ok_d, "--max-body-size", "1k")


@pytest.mark.parametrize("chunked", [False, True])
def test_body_over_the_limit_is_413_and_router_keeps_serving(router_small_body: Router, chunked: bool) -> None:
    big = json.dumps(request_body("/v1/completions", prompt="x" * 2000)).encode()
    with http_client() as client:
        content = iter([big[:500], big[500:]]) if chunked else big
        response = client.post(
            f"{router_small_body.url}/v1/completions", content=content, headers={"Content-Type": "application/json"}
        )
        error = assert_openai_error(response, 413, "invalid_request_error")
        assert "1024" in error["message"]
        again = client.post(f"{router_small_body.url}/v1/completions", json=request_body("/v1/completions"))
    assert again.status_code == 200, again.text
