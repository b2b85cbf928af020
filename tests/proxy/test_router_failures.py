"""The Router (``python -m proxy``) as a real process in front of failing, down, slow or hanging fake backends.

Prefill failures (502/503, D's request cancelled, an error event once the stream started), decode
failures (passed through, 503, 504 on timeout), client disconnects closing both backend requests,
and /health reporting each backend. ``router_ok`` comes from conftest.py.
"""

from __future__ import annotations

import json
import time

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
    request_body,
    sse_events,
    wait_none_open,
    wait_state,
)

# --- Routers, one per backend combination (started once, outside the per-test timeout) ---


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
