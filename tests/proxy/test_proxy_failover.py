"""Failover, health skipping and routing policies, with real Router and backend processes.

With ``--routing room`` (the default) a request's first attempt goes to
``prefillers[room % nP]`` and ``decoders[room % nD]``, so a client-given ``bootstrap_room``
steers it to a chosen backend.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.router_rig import (
    FAKE_BACKEND,
    HOST,
    Backends,
    Proc,
    Router,
    RouterFactory,
    assert_openai_error,
    free_port,
    http_client,
    new_rid,
    records,
    request_body,
    sse_events,
    wait_until,
)


def _post(router: Router, rid: str, body: dict[str, Any], path: str = "/v1/completions") -> httpx.Response:
    with http_client() as client:
        return client.post(f"{router.url}{path}", json=body, headers={"X-Request-Id": rid})


def _metric(router: Router, name: str, **labels: str) -> float:
    """Sum of the samples of ``name`` whose labels include ``labels`` (0 if none)."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{router.url}/metrics", timeout=10, trust_env=False).text
    total = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                total += sample.value
    return total


def _served(ports: tuple[int, ...], rid: str) -> dict[int, list[dict[str, Any]]]:
    return {port: records(port, rid) for port in ports}


# --- failover before the first byte ---------------------------------------------------------


def _router_d_down_and_ok(backends: Backends, fresh_router: RouterFactory) -> Router:
    # No background health checks: only the request path marks the down decoder unhealthy.
    return fresh_router(backends.ok_p, (backends.down, backends.ok_d), "--health-interval", "0")


@pytest.mark.parametrize("stream", [False, True])
def test_unreachable_decoder_fails_over_to_the_other(
    backends: Backends, fresh_router: RouterFactory, stream: bool
) -> None:
    router = _router_d_down_and_ok(backends, fresh_router)
    rid = new_rid("d-failover")
    # room 0 -> decoders[0], the one that is down.
    response = _post(router, rid, request_body("/v1/completions", stream=stream, bootstrap_room=0))
    assert response.status_code == 200, response.text
    if stream:
        assert sse_events(response.content)[-1] == "[DONE]"
    (d,) = records(router.decode_ports[1], rid)
    # The retry used a fresh room, given to P and D alike.
    room = d["body"]["kv_transfer_params"]["bootstrap_room"]
    assert room != 0
    p_rooms = [r["body"]["kv_transfer_params"]["bootstrap_room"] for r in records(router.prefill_port, rid)]
    assert room in p_rooms
    assert _metric(router, "pd_router_retries_total") == 1
    assert _metric(router, "pd_router_backend_errors_total", role="decode", kind="connect") == 1


def test_unreachable_decoder_is_skipped_afterwards(backends: Backends, fresh_router: RouterFactory) -> None:
    router = _router_d_down_and_ok(backends, fresh_router)
    assert _post(router, new_rid("d-mark"), request_body("/v1/completions", bootstrap_room=0)).status_code == 200
    assert _metric(router, "pd_router_backend_healthy", backend=f"{HOST}:{router.decode_ports[0]}") == 0
    for room in (0, 2, 4):
        rid = new_rid("d-skip")
        response = _post(router, rid, request_body("/v1/completions", bootstrap_room=room))
        assert response.status_code == 200, response.text
        # No retry: the first attempt already went to the healthy decoder, with the client's room.
        (d,) = records(router.decode_ports[1], rid)
        assert d["body"]["kv_transfer_params"]["bootstrap_room"] == room
    assert _metric(router, "pd_router_retries_total") == 1


@pytest.fixture(scope="session")
def router_p500_and_ok(backends: Backends, router_factory: RouterFactory) -> Router:
    return router_factory((backends.fail500, backends.ok_p), backends.ok_d_slow)


def test_failing_prefiller_fails_over_with_a_fresh_room(router_p500_and_ok: Router) -> None:
    router = router_p500_and_ok
    rid = new_rid("p-failover")
    response = _post(
        router, rid, request_body("/v1/chat/completions", stream=True, bootstrap_room=10), path="/v1/chat/completions"
    )
    assert response.status_code == 200, response.text
    assert sse_events(response.content)[-1] == "[DONE]"
    (failed,) = records(router.prefill_ports[0], rid)
    (good,) = records(router.prefill_ports[1], rid)
    assert failed["body"]["kv_transfer_params"]["bootstrap_room"] == 10
    assert good["body"]["kv_transfer_params"]["bootstrap_room"] != 10
    # D got two requests: the first (room 10) was closed, the second (fresh room) answered.
    d_records = {r["body"]["kv_transfer_params"]["bootstrap_room"]: r for r in records(router.decode_port, rid)}
    assert set(d_records) == {10, good["body"]["kv_transfer_params"]["bootstrap_room"]}
    wait_until(
        lambda: (
            next(
                r for r in records(router.decode_port, rid) if r["body"]["kv_transfer_params"]["bootstrap_room"] == 10
            )["state"]
            == "disconnected"
        ),
        10,
    )


@pytest.fixture(scope="session")
def router_p500_one_attempt(backends: Backends, router_factory: RouterFactory) -> Router:
    return router_factory((backends.fail500, backends.ok_p), backends.ok_d_slow, "--max-retries", "1")


def test_max_retries_1_means_one_attempt(router_p500_one_attempt: Router) -> None:
    router = router_p500_one_attempt
    rid = new_rid("p-once")
    response = _post(router, rid, request_body("/v1/completions", bootstrap_room=0))
    assert_openai_error(response, 502, "prefill_failed")
    assert len(records(router.prefill_ports[0], rid)) == 1
    assert records(router.prefill_ports[1], rid) == []


@pytest.fixture(scope="session")
def router_error_event_and_ok(backends: Backends, router_factory: RouterFactory) -> Router:
    return router_factory(backends.ok_p, (backends.error_event, backends.ok_d))


def test_error_event_as_first_chunk_fails_over(router_error_event_and_ok: Router) -> None:
    router = router_error_event_and_ok
    rid = new_rid("err-event")
    response = _post(router, rid, request_body("/v1/completions", stream=True, bootstrap_room=0))
    assert response.status_code == 200
    events = sse_events(response.content)
    assert events[-1] == "[DONE]"
    assert all("error" not in json.loads(e) for e in events[:-1])
    assert len(records(router.decode_ports[0], rid)) == 1
    assert len(records(router.decode_ports[1], rid)) == 1


@pytest.fixture(scope="session")
def router_d400(backends: Backends, router_factory: RouterFactory) -> Router:
    return router_factory(backends.ok_p, (backends.fail400, backends.ok_d))


def test_client_error_from_decoder_is_not_retried(router_d400: Router) -> None:
    router = router_d400
    rid = new_rid("d400")
    response = _post(router, rid, request_body("/v1/completions", bootstrap_room=0))
    assert response.status_code == 400
    assert response.json()["error"]["message"] == f"fake backend {router.decode_ports[0]} failed on purpose"
    assert records(router.decode_ports[1], rid) == []


@pytest.fixture(scope="session")
def router_p400(backends: Backends, router_factory: RouterFactory) -> Router:
    return router_factory((backends.fail400, backends.ok_p), backends.hang)


def test_client_error_from_prefiller_is_passed_through(router_p400: Router) -> None:
    router = router_p400
    rid = new_rid("p400")
    response = _post(router, rid, request_body("/v1/completions", bootstrap_room=0))
    assert response.status_code == 400
    assert response.json()["error"]["message"] == f"fake backend {router.prefill_ports[0]} failed on purpose"
    assert records(router.prefill_ports[1], rid) == []


# --- never retry after bytes went out -------------------------------------------------------


@pytest.fixture(scope="session")
def router_dies_mid_stream(backends: Backends, router_factory: RouterFactory) -> Router:
    # Resume off: the cut stream ends as without it (tests/proxy/test_resume.py resumes it).
    return router_factory(backends.ok_p, (backends.die_mid_stream, backends.ok_d), "--resume-attempts", "0")


def test_decoder_dying_mid_stream_ends_with_error_event_and_no_retry(router_dies_mid_stream: Router) -> None:
    router = router_dies_mid_stream
    rid = new_rid("died")
    started = time.monotonic()
    response = _post(router, rid, request_body("/v1/completions", stream=True, bootstrap_room=0))
    assert time.monotonic() - started < 10
    assert response.status_code == 200
    events = sse_events(response.content)
    assert "[DONE]" not in events
    assert [json.loads(e)["choices"][0]["text"] for e in events[:-1]] == ["tok0 ", "tok1 ", "tok2 "]
    error = json.loads(events[-1])["error"]
    assert error["type"] == "decode_failed" and error["code"] == 502
    assert len(records(router.decode_ports[0], rid)) == 1
    assert records(router.decode_ports[1], rid) == []


# --- health: skipped while down, back once healthy ------------------------------------------


def test_backend_is_used_again_once_its_health_check_passes(
    backends: Backends, fresh_router: RouterFactory, proc_dir: Path
) -> None:
    late_port = free_port()
    router = fresh_router(backends.ok_p, (late_port, backends.ok_d), "--health-interval", "0.3")
    wait_until(lambda: _metric(router, "pd_router_backend_healthy", backend=f"{HOST}:{late_port}") == 0, 10)
    rid = new_rid("late-down")
    assert _post(router, rid, request_body("/v1/completions", bootstrap_room=0)).status_code == 200
    assert len(records(backends.ok_d, rid)) == 1
    args = [sys.executable, str(FAKE_BACKEND), "--port", str(late_port), "--mode", "ok"]
    late = Proc("late backend", late_port, args, proc_dir / f"late-{late_port}.log").start()
    try:
        late.wait_listening()
        wait_until(lambda: _metric(router, "pd_router_backend_healthy", backend=f"{HOST}:{late_port}") == 1, 10)
        rid = new_rid("late-up")
        assert _post(router, rid, request_body("/v1/completions", bootstrap_room=0)).status_code == 200
        assert len(records(late_port, rid)) == 1
    finally:
        late.stop()


# --- least-loaded routing -----------------------------------------------------------------


@pytest.fixture(scope="session")
def router_least_loaded(backends: Backends, router_factory: RouterFactory) -> Router:
    return router_factory(
        (backends.hang, backends.hang2), (backends.slow_stream, backends.slow_stream2), "--routing", "least-loaded"
    )


def test_least_loaded_picks_fewest_prompt_tokens_and_requests(router_least_loaded: Router) -> None:
    """P hangs (stays in flight) and D streams slowly, so every request stays in flight."""
    router = router_least_loaded
    rids = [new_rid(f"ll{i}") for i in range(3)]
    prompts = ["x" * 4000, "short", "tiny"]  # ~1000, 2 and 1 estimated tokens
    with http_client() as client:
        streams = []
        iterators = []  # (a dropped iterator would close its stream)
        try:
            for rid, prompt in zip(rids, prompts, strict=True):
                body = {"model": "fake-model", "prompt": prompt, "max_tokens": 8, "stream": True}
                stream = client.stream("POST", f"{router.url}/v1/completions", json=body, headers={"X-Request-Id": rid})
                response = stream.__enter__()
                streams.append(stream)
                assert response.status_code == 200
                iterators.append(response.iter_bytes())
                next(iterators[-1])  # D's first chunk arrived: the request is in flight
            p_of = {rid: next(p for p in router.prefill_ports if records(p, rid)) for rid in rids}
            d_of = {rid: next(d for d in router.decode_ports if records(d, rid)) for rid in rids}
        finally:
            for stream in streams:
                stream.__exit__(None, None, None)
    # P: the long prompt's prefiller holds ~1000 tokens, so both short ones go to the other.
    assert p_of[rids[1]] != p_of[rids[0]]
    assert p_of[rids[2]] == p_of[rids[1]]
    # D: fewest in-flight requests: the second request goes to the other decoder.
    assert d_of[rids[1]] != d_of[rids[0]]


def test_openai_api_key_is_sent_in_place_of_the_client_authorization(
    backends: Backends, fresh_router: RouterFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OPENAI_API_KEY", "sk-router")
    router = fresh_router(backends.ok_p, backends.ok_d)
    rid = new_rid("apikey")
    assert _post(router, rid, request_body("/v1/completions")).status_code == 200
    assert records(backends.ok_p, rid)[0]["authorization"] == "Bearer sk-router"
    assert records(backends.ok_d, rid)[0]["authorization"] == "Bearer sk-router"
    with http_client() as client:
        rid = new_rid("client-auth")
        headers = {"X-Request-Id": rid, "Authorization": "Bearer sk-client"}
        client.post(f"{router.url}/v1/completions", json=request_body("/v1/completions"), headers=headers)
    assert records(backends.ok_d, rid)[0]["authorization"] == "Bearer sk-router"
