"""In-process unit tests: backend pool (routing, health, drain), request validation, failure classification."""

from __future__ import annotations

from typing import Any

import pytest

from proxy.app import parse_instances
from proxy.errors import RouterError
from proxy.request.payloads import estimate_prompt_tokens, validate_body
from proxy.router_config import Backend
from proxy.upstream.calls import FailureKind, empty_failure, error_event_failure, exception_failure, http_failure
from proxy.upstream.http1 import ConnectFailed, ConnectionBroken, UpstreamTimeout
from proxy.upstream.pool import BackendPool, BackendState
from proxy.upstream.routing import POLICIES, Choice, RouteRequest, candidates

P = tuple(Backend("prefill", "p", 8100 + i, 18800) for i in range(3))
D = tuple(Backend("decode", "d", 8200 + i) for i in range(2))


def _ports(states: list[BackendState | None]) -> list[int | None]:
    return [s.backend.port if s is not None else None for s in states]


# --- routing -----------------------------------------------------------------------------------


def test_room_policy_is_room_mod_n() -> None:
    pool = BackendPool(P, D)
    assert _ports([pool.pick("prefill", room) for room in range(6)]) == [8100, 8101, 8102, 8100, 8101, 8102]
    assert _ports([pool.pick("decode", room) for room in range(4)]) == [8200, 8201, 8200, 8201]


def test_room_policy_walks_past_unhealthy_and_excluded() -> None:
    pool = BackendPool(P, D)
    p1 = pool.active["prefill"][1]
    pool.mark_unhealthy(p1, "down")
    assert pool.pick("prefill", 1).backend.port == 8102
    assert pool.pick("prefill", 0).backend.port == 8100  # rooms of healthy ones keep their instance
    p2 = pool.active["prefill"][2]
    assert pool.pick("prefill", 1, exclude={p2}).backend.port == 8100
    # Nothing healthy and fresh left: an unhealthy fresh one, then anything.
    p0 = pool.active["prefill"][0]
    assert pool.pick("prefill", 1, exclude={p0, p2}).backend.port == 8101
    assert pool.pick("prefill", 1, exclude={p0, p1, p2}) is not None


def test_all_unhealthy_still_routes() -> None:
    pool = BackendPool(P, D)
    for state in pool.active["decode"]:
        pool.mark_unhealthy(state, "down")
    assert _ports([pool.pick("decode", room) for room in range(2)]) == [8200, 8201]


def test_least_loaded_prefill_counts_prompt_tokens_decode_counts_requests() -> None:
    pool = BackendPool(P, D, routing="least-loaded")
    p = pool.active["prefill"]
    d = pool.active["decode"]
    big = pool.lease(p[0], 1000)
    small = [pool.lease(p[1], 10) for _ in range(5)]
    assert pool.pick("prefill", 0) is p[2]
    small.append(pool.lease(p[2], 20))
    assert pool.pick("prefill", 0) is p[2]  # 1000, 50, 20 tokens in flight
    small.append(pool.lease(p[2], 40))
    assert pool.pick("prefill", 0) is p[1]  # 1000, 50, 60: fewest tokens, not fewest requests
    leases = [pool.lease(d[0]), pool.lease(d[0]), pool.lease(d[1])]
    assert pool.pick("decode", 0) is d[1]
    for lease in (*leases, big, *small):
        lease.release()
        lease.release()  # idempotent
    assert all(s.in_flight == 0 and s.in_flight_tokens == 0 for s in pool.all_states())


def test_least_loaded_ties_are_broken_by_room_and_health_first() -> None:
    pool = BackendPool(P, D, routing="least-loaded")
    assert _ports([pool.pick("decode", room) for room in range(2)]) == [8200, 8201]
    busy = pool.lease(pool.active["decode"][1])
    pool.mark_unhealthy(pool.active["decode"][0], "down")
    assert pool.pick("decode", 0) is pool.active["decode"][1]  # healthy beats less loaded
    busy.release()


def test_pick_least_loaded_returns_the_minimum() -> None:
    pool = BackendPool(P, D, routing="least-loaded")
    p = pool.active["prefill"]
    leases = [pool.lease(p[0], 5), pool.lease(p[1], 3), pool.lease(p[2], 9)]
    assert pool.pick("prefill", 123) is p[1]
    for lease in leases:
        lease.release()


def test_a_policy_gets_the_request_and_the_candidates_with_their_load(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[Choice] = []

    def spy(choice: Choice) -> BackendState:
        """the last candidate"""
        seen.append(choice)
        return choice.candidates[-1]

    monkeypatch.setitem(POLICIES, "spy", spy)  # a policy is one function and one table line
    pool = BackendPool(P, D, routing="spy")
    p0, p1, p2 = pool.active["prefill"]
    lease = pool.lease(p0, 30)
    pool.mark_unhealthy(p1, "down")
    body = {"prompt": "x" * 40}
    assert pool.pick("prefill", 5, exclude={p2}, request=RouteRequest(5, 10, body)) is p0
    (choice,) = seen
    assert (choice.role, choice.request.room, choice.request.tokens) == ("prefill", 5, 10)
    assert choice.request.body is body
    assert list(choice.instances) == [p0, p1, p2] and list(choice.candidates) == [p0]  # p1 unhealthy, p2 tried
    assert (choice.load(p0), choice.load(p2)) == (30, 0)
    lease.release()
    with pytest.raises(ValueError, match="unknown routing policy"):
        BackendPool(P, D, routing="nope")


def test_candidates_prefer_healthy_untried_then_untried_then_all() -> None:
    pool = BackendPool(P, D)
    p0, p1, p2 = pool.active["prefill"]
    pool.mark_unhealthy(p0, "down")
    assert candidates([p0, p1, p2]) == [p1, p2]
    assert candidates([p0, p1, p2], {p1, p2}) == [p0]
    assert candidates([p0, p1, p2], {p0, p1, p2}) == [p0, p1, p2]


def test_health_results_update_state() -> None:
    pool = BackendPool(P, D)
    state = pool.active["decode"][0]
    pool.set_health(state, False, 503, "HTTP 503")
    assert not state.healthy and state.last_error == "HTTP 503" and state.status_code == 503
    pool.set_health(state, True, 200, None)
    assert state.healthy and state.last_error is None


# --- membership and drain ------------------------------------------------------------------------


def test_remove_drains_until_the_last_request_ends() -> None:
    pool = BackendPool(P, D)
    d0 = pool.active["decode"][0]
    lease = pool.lease(d0)
    assert pool.remove(d0) is False
    assert d0.draining and d0 not in pool.active["decode"]
    assert pool.find("decode", "d", 8200) is d0
    assert _ports([pool.pick("decode", room) for room in range(3)]) == [8201, 8201, 8201]
    lease.release()
    assert pool.find("decode", "d", 8200) is None
    assert pool.draining == {}


def test_remove_idle_is_immediate_and_readd_while_draining_undrains() -> None:
    pool = BackendPool(P, D)
    p0 = pool.active["prefill"][0]
    assert pool.remove(p0) is True
    assert pool.find("prefill", "p", 8100) is None
    d1 = pool.active["decode"][1]
    lease = pool.lease(d1)
    pool.remove(d1)
    pool.undrain(d1)
    assert not d1.draining and pool.active["decode"][-1] is d1 and pool.draining == {}
    lease.release()
    assert pool.find("decode", "d", 8201) is d1


def test_empty_role_picks_none() -> None:
    pool = BackendPool(P[:1], D[:1])
    pool.remove(pool.active["decode"][0])
    assert pool.pick("decode", 0) is None


# --- instance requests ----------------------------------------------------------------------------


def test_parse_instances_both_formats() -> None:
    ours = parse_instances({"role": "prefill", "host": "10.0.0.1", "port": 8100, "bootstrap_port": 9000})
    assert ours == [Backend("prefill", "10.0.0.1", 8100, 9000)]
    ascend = parse_instances({"type": "decode", "instances": ["a:1", "[::1]:2", {"host": "b", "port": 3}]})
    assert ascend == [Backend("decode", "a", 1), Backend("decode", "::1", 2), Backend("decode", "b", 3)]
    assert parse_instances({"type": "prefill", "instances": "h:5"}) == [Backend("prefill", "h", 5, 18800)]


# --- request validation and prompt size -------------------------------------------------------------


@pytest.mark.parametrize(
    "prompt",
    ["text", ["a"], [1, 2, 3], [[1, 2]]],  # a batch of prompts is refused (tests/proxy/test_proxy_payloads.py)
)
def test_valid_prompts(prompt: Any) -> None:
    assert validate_body({"prompt": prompt}, "/v1/completions")


def test_prompt_embeds_without_prompt_is_accepted() -> None:
    assert validate_body({"prompt_embeds": "base64"}, "/v1/completions")


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ([], None),
        ({"prompt": "x", "stream": 1}, "stream"),
        ({"prompt": "x", "n": 1.0}, "n"),
        ({"prompt": []}, "prompt"),
        ({"prompt": [[1], "a"]}, "prompt"),
        ({"prompt": [True]}, "prompt"),
        ({}, "prompt"),
    ],
)
def test_invalid_bodies(body: Any, param: str | None) -> None:
    with pytest.raises(RouterError) as info:
        validate_body(body, "/v1/completions")
    assert info.value.status == 400 and info.value.param == param


@pytest.mark.parametrize(
    ("body", "tokens"),
    [
        ({"prompt": "x" * 400}, 100),
        ({"prompt": "abc"}, 1),
        ({"prompt": ""}, 1),
        ({"prompt": [1, 2, 3, 4, 5]}, 5),
        ({"prompt": [[1, 2], [3, 4, 5]]}, 5),
        ({"prompt": ["x" * 8, "y" * 8]}, 4),
        ({"messages": [{"role": "user", "content": "x" * 40}, {"role": "system", "content": "y" * 40}]}, 20),
        ({"messages": [{"role": "user", "content": [{"type": "text", "text": "z" * 80}, {"type": "image_url"}]}]}, 20),
    ],
)
def test_prompt_token_estimate(body: dict[str, Any], tokens: int) -> None:
    assert estimate_prompt_tokens(body) == tokens


# --- failure classification ----------------------------------------------------------------------


def _state(role: str) -> BackendState:
    return BackendState(P[0] if role == "prefill" else D[0])


def test_connection_refused_is_503_retryable() -> None:
    exc = ConnectFailed("cannot connect to p:8100: Connection refused")
    failure = exception_failure(_state("prefill"), exc, 600)
    assert (failure.kind, failure.error.status, failure.retryable) == (FailureKind.CONNECT, 503, True)
    assert failure.error.error_type == "prefill_failed"


def test_broken_connection_is_502_retryable_and_timeout_is_504_final() -> None:
    broken = exception_failure(_state("decode"), ConnectionBroken("connection to d:8200 closed"), 600)
    assert (broken.kind, broken.error.status, broken.retryable) == (FailureKind.DISCONNECT, 502, True)
    for exc in (TimeoutError(), UpstreamTimeout("d:8200 did not answer within 5s")):
        timeout = exception_failure(_state("decode"), exc, 5)
        assert (timeout.kind, timeout.error.status, timeout.retryable) == (FailureKind.TIMEOUT, 504, False)


@pytest.mark.parametrize(
    ("role", "status", "client_status", "retryable", "passthrough"),
    [
        ("prefill", 500, 502, True, False),
        ("prefill", 400, 400, False, True),
        ("prefill", 429, 429, True, True),
        ("decode", 500, 500, True, True),
        ("decode", 503, 503, True, True),
        ("decode", 404, 404, False, True),
    ],
)
def test_http_errors(role: str, status: int, client_status: int, retryable: bool, passthrough: bool) -> None:
    failure = http_failure(_state(role), status, b'{"error": "x"}', "application/json")
    assert failure.retryable is retryable
    assert (failure.passthrough is not None) is passthrough
    response = failure.response({"X-Request-Id": "r"})
    assert response.status == client_status
    assert response.headers["X-Request-Id"] == "r"


def test_error_event_and_empty_answers() -> None:
    event = b'data: {"error": {"message": "boom", "type": "x", "code": 500}}\n\ndata: [DONE]\n\n'
    failure = error_event_failure(_state("decode"), event)
    assert failure is not None and failure.retryable and failure.error.status == 500
    assert "boom" in failure.error.message
    assert error_event_failure(_state("decode"), b'data: {"id": 1}\n\n') is None
    assert empty_failure(_state("decode"), 200).error.status == 502
