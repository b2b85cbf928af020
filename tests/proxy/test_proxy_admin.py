"""Instances added and removed at run time (with drain), /metrics, /health and /healthcheck."""

from __future__ import annotations

import json
import time
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from launch.sse import sse_lines
from tests.support.router_rig import (
    HOST,
    Backends,
    Router,
    RouterFactory,
    admin_headers,
    assert_openai_error,
    http_client,
    new_rid,
    records,
    request_body,
    sse_events,
    wait_until,
)


def _instances(router: Router) -> dict[str, Any]:
    return httpx.get(f"{router.url}/instances", headers=admin_headers(router), timeout=10, trust_env=False).json()


def _ports(entries: list[dict[str, Any]]) -> list[int]:
    return [e["port"] for e in entries]


def _admin(router: Router, action: str, payload: Any) -> httpx.Response:
    return httpx.post(
        f"{router.url}/instances/{action}", json=payload, headers=admin_headers(router), timeout=30, trust_env=False
    )


def _samples(router: Router) -> list[Any]:
    text = httpx.get(f"{router.url}/metrics", timeout=10, trust_env=False).text
    return [s for family in text_string_to_metric_families(text) for s in family.samples]


def _value(samples: list[Any], name: str, **labels: str) -> float:
    return sum(s.value for s in samples if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))


# --- add / remove / drain -----------------------------------------------------------------


@pytest.fixture
def router_admin(backends: Backends, fresh_router: RouterFactory) -> Router:
    """A Router of its own per test (the tests change its membership)."""
    return fresh_router(backends.ok_p, backends.ok_d, "--max-waiting-retries", "2", "--waiting-retry-interval", "0.3")


def test_add_a_decoder_then_remove_it_while_a_stream_drains(router_admin: Router, backends: Backends) -> None:
    router = router_admin
    added = _admin(router, "add", {"role": "decode", "host": HOST, "port": backends.slow_short})
    assert added.status_code == 200, added.text
    assert added.json()["results"][0]["result"] == "added"
    assert _ports(added.json()["decoders"]) == [backends.ok_d, backends.slow_short]
    assert added.json()["current_decode_instances"] == [f"{HOST}:{backends.ok_d}", f"{HOST}:{backends.slow_short}"]

    rid = new_rid("drain")
    body = request_body("/v1/completions", stream=True, bootstrap_room=1)  # room 1 -> decoders[1]
    with http_client() as client:
        with client.stream("POST", f"{router.url}/v1/completions", json=body, headers={"X-Request-Id": rid}) as resp:
            assert resp.status_code == 200
            chunks = resp.iter_bytes()
            received = next(chunks)
            removed = _admin(router, "remove", {"role": "decode", "host": HOST, "port": backends.slow_short})
            assert removed.status_code == 200, removed.text
            assert removed.json()["results"][0]["result"] == "draining"
            listing = _instances(router)
            assert _ports(listing["decoders"]) == [backends.ok_d]
            assert _ports(listing["draining"]) == [backends.slow_short]
            # New requests, whatever their room, go to the remaining decoder (room 1 itself is in flight:
            # 5 and 3 are the same residues mod 2).
            for room in (5, 3):
                other = new_rid("after-remove")
                with http_client() as second:
                    again = second.post(
                        f"{router.url}/v1/completions",
                        json=request_body("/v1/completions", bootstrap_room=room),
                        headers={"X-Request-Id": other},
                    )
                assert again.status_code == 200
                assert again.json()["served_by"] == backends.ok_d
            # The draining decoder's stream runs to its end.
            for chunk in chunks:
                received += chunk
    events = sse_events(received)
    assert events[-1] == "[DONE]"
    assert len(events) == 22  # 20 tokens, the final chunk, [DONE]
    wait_until(lambda: _instances(router)["draining"] == [], 10)
    assert _ports(_instances(router)["decoders"]) == [backends.ok_d]


def test_add_and_remove_in_vllm_ascend_format(router_admin: Router, backends: Backends) -> None:
    router = router_admin
    added = _admin(router, "add", {"type": "prefill", "instances": [f"{HOST}:{backends.ok_p2}"]})
    assert added.status_code == 200, added.text
    prefillers = added.json()["prefillers"]
    assert _ports(prefillers) == [backends.ok_p, backends.ok_p2]
    assert prefillers[1]["bootstrap_port"] == 18800
    rid = new_rid("added-p")
    with http_client() as client:
        response = client.post(
            f"{router.url}/v1/completions",
            json=request_body("/v1/completions", bootstrap_room=1),
            headers={"X-Request-Id": rid},
        )
    assert response.status_code == 200
    (p,) = records(backends.ok_p2, rid)
    assert response.json()["kv_transfer_params"]["bootstrap_port"] == 18800
    assert p["body"]["kv_transfer_params"]["bootstrap_room"] == 1
    # Nothing in flight: removal is immediate.
    removed = _admin(router, "remove", {"type": "prefill", "instances": f"{HOST}:{backends.ok_p2}"})
    assert removed.status_code == 200
    assert removed.json()["results"][0]["result"] == "removed"
    assert removed.json()["current_prefill_instances"] == [f"{HOST}:{backends.ok_p}"]
    assert _instances(router)["draining"] == []


def test_added_prefiller_gets_its_bootstrap_port(router_admin: Router, backends: Backends) -> None:
    router = router_admin
    payload = {"role": "prefill", "host": HOST, "port": backends.ok_p2, "bootstrap_port": 17777}
    assert _admin(router, "add", payload).status_code == 200
    again = _admin(router, "add", payload)
    assert again.json()["results"][0]["result"] == "already present"
    with http_client() as client:
        response = client.post(f"{router.url}/v1/completions", json=request_body("/v1/completions", bootstrap_room=1))
    assert response.json()["kv_transfer_params"]["bootstrap_port"] == 17777
    # The same instance restarted with another bootstrap port: its details are updated, not ignored.
    moved = _admin(router, "add", {**payload, "bootstrap_port": 17778})
    assert moved.json()["results"][0]["result"] == "updated"
    with http_client() as client:
        response = client.post(f"{router.url}/v1/completions", json=request_body("/v1/completions", bootstrap_room=1))
    assert response.json()["kv_transfer_params"]["bootstrap_port"] == 17778


def test_added_dp_rank_prefiller_names_its_rank_and_bootstrap_host(router_admin: Router, backends: Backends) -> None:
    router = router_admin
    payload = {
        "type": "prefill",
        "instances": [{"host": HOST, "port": backends.ok_p2, "bootstrap_host": "127.0.0.9", "dp_rank": 3}],
    }
    assert _admin(router, "add", payload).status_code == 200
    (record,) = [p for p in _instances(router)["prefillers"] if p["port"] == backends.ok_p2]
    assert (record["bootstrap_host"], record["dp_rank"]) == ("127.0.0.9", 3)


def test_an_instance_that_never_answers_is_dropped(router_admin: Router, backends: Backends) -> None:
    router = router_admin
    added = _admin(router, "add", {"role": "decode", "host": HOST, "port": backends.down})
    assert added.status_code == 202, added.text
    assert added.json()["results"][0]["result"] == "waiting"
    assert _ports(added.json()["waiting"]) == [backends.down]
    assert _ports(added.json()["decoders"]) == [backends.ok_d]
    wait_until(lambda: _instances(router)["waiting"] == [], 10)
    assert _ports(_instances(router)["decoders"]) == [backends.ok_d]


@pytest.mark.parametrize(
    ("payload", "status", "param"),
    [
        ({"role": "router", "host": HOST, "port": 1}, 400, "role"),
        ({"role": "decode", "host": "", "port": 1}, 400, "host"),
        ({"role": "decode", "host": HOST, "port": 70000}, 400, "port"),
        ({"role": "prefill", "host": HOST, "port": 1, "bootstrap_port": "x"}, 400, "bootstrap_port"),
        ({"role": "prefill", "host": HOST, "port": 1, "dp_rank": -1}, 400, "dp_rank"),
        ({"role": "prefill", "host": HOST, "port": 1, "bootstrap_host": ""}, 400, "bootstrap_host"),
        ({"type": "decode", "instances": ["nocolon"]}, 400, "instances"),
        ({"type": "decode", "instances": []}, 400, "instances"),
        (["not", "an", "object"], 400, None),
    ],
)
def test_bad_instance_requests_are_400(router_admin: Router, payload: Any, status: int, param: str | None) -> None:
    assert_openai_error(_admin(router_admin, "add", payload), status, "invalid_request_error", param)


def test_removing_an_unknown_instance_is_404(router_admin: Router, backends: Backends) -> None:
    response = _admin(router_admin, "remove", {"role": "decode", "host": HOST, "port": backends.ok_p2})
    assert_openai_error(response, 404, "not_found_error", "instances")


def test_removing_the_last_decoder_then_requests_get_503(router_admin: Router, backends: Backends) -> None:
    router = router_admin
    assert _admin(router, "remove", {"role": "decode", "host": HOST, "port": backends.ok_d}).status_code == 200
    with http_client() as client:
        response = client.post(f"{router.url}/v1/completions", json=request_body("/v1/completions"))
    assert_openai_error(response, 503, "upstream_unavailable")
    assert httpx.get(f"{router.url}/health", timeout=10, trust_env=False).status_code == 503
    assert _admin(router, "add", {"role": "decode", "host": HOST, "port": backends.ok_d}).status_code == 200
    with http_client() as client:
        assert client.post(f"{router.url}/v1/completions", json=request_body("/v1/completions")).status_code == 200


# --- metrics and health ---------------------------------------------------------------------


@pytest.fixture(scope="session")
def router_metrics(backends: Backends, router_factory: RouterFactory) -> Router:
    return router_factory(backends.ok_p, (backends.ok_d, backends.slow_stream), "--health-interval", "0.5")


def test_metrics_count_requests_errors_backends_and_latencies(router_metrics: Router, backends: Backends) -> None:
    router = router_metrics
    with http_client() as client:
        for stream in (False, True):
            body = request_body("/v1/chat/completions", stream=stream, bootstrap_room=0)
            assert client.post(f"{router.url}/v1/chat/completions", json=body).status_code == 200
        bad = client.post(f"{router.url}/v1/completions", content=b"{", headers={"Content-Type": "application/json"})
        assert bad.status_code == 400
    samples = _samples(router)
    chat = "/v1/chat/completions"
    assert _value(samples, "pd_router_requests_total", endpoint=chat, status="200") == 2
    assert _value(samples, "pd_router_requests_total", endpoint="/v1/completions", status="400") == 1
    assert _value(samples, "pd_router_errors_total", endpoint="/v1/completions", type="invalid_request_error") == 1
    p, d = f"{HOST}:{backends.ok_p}", f"{HOST}:{backends.ok_d}"
    assert _value(samples, "pd_router_backend_requests_total", endpoint=chat, role="prefill", backend=p) == 2
    assert _value(samples, "pd_router_backend_requests_total", endpoint=chat, role="decode", backend=d) == 2
    assert _value(samples, "pd_router_time_to_first_byte_seconds_count", endpoint=chat) == 2
    assert _value(samples, "pd_router_request_duration_seconds_count", endpoint=chat) == 2
    assert _value(samples, "pd_router_request_duration_seconds_bucket", endpoint=chat, le="+Inf") == 2
    assert _value(samples, "pd_router_backend_healthy", role="decode", backend=d) == 1
    assert _value(samples, "pd_router_backend_in_flight_requests", role="decode", backend=d) == 0


def test_metrics_show_in_flight_requests_per_backend(router_metrics: Router, backends: Backends) -> None:
    router = router_metrics
    slow = f"{HOST}:{backends.slow_stream}"
    body = request_body("/v1/completions", stream=True, bootstrap_room=1)  # -> the slow decoder
    with http_client() as client:
        with client.stream("POST", f"{router.url}/v1/completions", json=body) as response:
            chunks = response.iter_bytes()  # (a dropped iterator would close the stream)
            next(chunks)
            samples = _samples(router)
            assert _value(samples, "pd_router_backend_in_flight_requests", role="decode", backend=slow) == 1
    # Closing the stream ended it everywhere.
    wait_until(
        lambda: _value(_samples(router), "pd_router_backend_in_flight_requests", role="decode", backend=slow) == 0,
        10,
    )
    assert _value(_samples(router), "pd_router_requests_total", endpoint="/v1/completions", status="499") >= 1


def test_health_reports_every_backend(router_metrics: Router, backends: Backends) -> None:
    url, headers = f"{router_metrics.url}/health", admin_headers(router_metrics)
    body = httpx.get(url, headers=headers, timeout=10, trust_env=False).json()
    assert body["status"] == "healthy"
    assert [(r["port"], r["healthy"]) for r in body["decoders"]] == [
        (backends.ok_d, True),
        (backends.slow_stream, True),
    ]
    assert body["prefillers"][0]["in_flight_prompt_tokens"] == 0
    summary = httpx.get(f"{router_metrics.url}/healthcheck", timeout=10, trust_env=False).json()
    assert summary == {
        "status": "ok",
        "prefill_instances": 1,
        "decode_instances": 2,
        "request_num": summary["request_num"],
    }


def test_unknown_paths_and_methods_get_openai_errors(router_metrics: Router) -> None:
    with http_client() as client:
        assert_openai_error(client.get(f"{router_metrics.url}/v1/nothing"), 404, "not_found_error")
        assert_openai_error(client.get(f"{router_metrics.url}/v1/completions"), 405, "invalid_request_error")


def test_reset_prefix_cache_reaches_every_backend(router_metrics: Router) -> None:
    # The fake backends have no /reset_prefix_cache: the Router reports each failure.
    url, headers = f"{router_metrics.url}/reset_prefix_cache", admin_headers(router_metrics)
    response = httpx.post(url, headers=headers, timeout=10, trust_env=False)
    assert response.status_code == 500
    assert len(response.json()["failed"]) == 3


def test_router_log_line_has_request_id_and_room(router_metrics: Router) -> None:
    rid = new_rid("logged")
    with http_client() as client:
        client.post(
            f"{router_metrics.url}/v1/completions",
            json=request_body("/v1/completions", bootstrap_room=424242),
            headers={"X-Request-Id": rid},
        )
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        lines = [line for line in router_metrics.proc.log_text().splitlines() if rid in line]
        if any("room=424242" in line and "status=200" in line for line in lines):
            break
        time.sleep(0.1)
    else:
        pytest.fail(f"no log line with rid={rid} and room=424242: {json.dumps(lines)}")


def test_a_client_that_hangs_up_after_done_counts_as_served(router_factory: RouterFactory, backends: Backends) -> None:
    router = router_factory(backends.ok_p, backends.lingering_d)
    body = request_body("/v1/completions", stream=True, bootstrap_room=1)
    with http_client() as client, client.stream("POST", f"{router.url}/v1/completions", json=body) as response:
        assert response.status_code == 200
        for line in sse_lines(response):
            if line == "data: [DONE]":
                break  # close the connection before the stream's end
    endpoint = "/v1/completions"
    wait_until(lambda: _value(_samples(router), "pd_router_requests_total", endpoint=endpoint, status="200") == 1, 10)
    samples = _samples(router)
    assert _value(samples, "pd_router_requests_total", endpoint=endpoint, status="499") == 0
    assert _value(samples, "pd_router_errors_total", endpoint=endpoint) == 0
