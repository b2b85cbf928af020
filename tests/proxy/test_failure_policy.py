"""proxy.request.failure_policy: each failure kind, on P or on D, leads to its one decision."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, cast

import pytest

from proxy.errors import RouterError
from proxy.request.failure_policy import Decision, Tried, decide, settle
from proxy.router_config import Backend
from proxy.upstream.calls import Failure, FailureKind, unresponsive_failure
from proxy.upstream.pool import BackendState

#: Each kind's ``retryable`` as proxy.upstream.calls classifies it (HTTP statuses: 503 and 400).
RETRYABLE = {
    FailureKind.CONNECT: True,
    FailureKind.TIMEOUT: False,
    FailureKind.DISCONNECT: True,
    FailureKind.HTTP_4XX: False,
    FailureKind.HTTP_5XX: True,
    FailureKind.EMPTY: True,
    FailureKind.ERROR_EVENT: True,
    FailureKind.REFUSED: False,
    FailureKind.DRAIN: True,
}


@dataclass
class FakeAttempt:
    """What the policy reads of an attempt."""

    p: BackendState
    d: BackendState
    p_answered: bool = False
    p_holds_room: bool = True
    local: bool = False

    def holds_p_room(self) -> bool:
        return self.p_holds_room


@dataclass
class FakePool:
    marked: list[tuple[BackendState, str]] = field(default_factory=list)

    def mark_unhealthy(self, state: BackendState, reason: str) -> None:
        self.marked.append((state, reason))


@dataclass
class FakeMetrics:
    errors: list[tuple[str, str, str]] = field(default_factory=list)

    def backend_error(self, endpoint: str, backend: Backend, kind: str) -> None:
        self.errors.append((endpoint, backend.address, kind))


@dataclass
class FakeRouter:
    pool: FakePool = field(default_factory=FakePool)
    metrics: FakeMetrics = field(default_factory=FakeMetrics)


def _pair() -> tuple[BackendState, BackendState]:
    return BackendState(Backend("prefill", "p", 8100, 18800)), BackendState(Backend("decode", "d", 8200))


def _failure(state: BackendState, kind: FailureKind) -> Failure:
    return Failure(state, kind, RouterError(502, f"{kind.value} on {state.backend.name}", "x"), RETRYABLE[kind])


def _decide(failure: Failure, attempt: FakeAttempt | None) -> Decision:
    return decide(failure, cast(Any, attempt))


def test_the_metric_labels_are_the_kinds_former_strings() -> None:
    assert [k.value for k in FailureKind] == [
        "connect",
        "timeout",
        "disconnect",
        "http_4xx",
        "http_5xx",
        "empty",
        "error_event",
        "refused",
        "drain",  # the Router closed a draining decoder's stream (proxy.admin.drain)
    ]


@pytest.mark.parametrize(
    ("kind", "decision"),
    [
        (FailureKind.CONNECT, Decision(True, True, False, True, False)),
        (FailureKind.TIMEOUT, Decision(False, False, False, False, False)),
        (FailureKind.DISCONNECT, Decision(True, False, False, False, False)),
        (FailureKind.HTTP_4XX, Decision(False, False, False, False, False)),
        (FailureKind.HTTP_5XX, Decision(True, False, True, False, False)),
        (FailureKind.EMPTY, Decision(True, False, False, False, False)),
        (FailureKind.ERROR_EVENT, Decision(True, False, True, False, False)),
        (FailureKind.REFUSED, Decision(False, False, False, False, False)),
    ],
)
def test_a_decoder_failure(kind: FailureKind, decision: Decision) -> None:
    """D's failures: only 5xx and an error event avoid P; only D unreachable releases P's room."""
    p, d = _pair()
    assert _decide(_failure(d, kind), FakeAttempt(p, d)) == decision


@pytest.mark.parametrize("kind", list(FailureKind))
def test_a_prefiller_failure_never_avoids_or_releases(kind: FailureKind) -> None:
    p, d = _pair()
    expected = Decision(RETRYABLE[kind], kind is FailureKind.CONNECT, False, False, False)
    assert _decide(_failure(p, kind), FakeAttempt(p, d)) == expected
    assert _decide(_failure(p, kind), None) == expected  # outside an attempt (P alone, /v1/models)


def test_the_room_is_released_only_where_p_holds_it() -> None:
    p, d = _pair()
    failure = _failure(d, FailureKind.CONNECT)
    assert _decide(failure, FakeAttempt(p, d, p_holds_room=False)).release_room is False
    assert _decide(failure, FakeAttempt(p, d, p_holds_room=True)).release_room is True


def test_after_p_answered_an_unreachable_decoder_may_hand_the_same_room_to_another() -> None:
    p, d = _pair()
    answered = FakeAttempt(p, d, p_answered=True)
    assert _decide(_failure(d, FailureKind.CONNECT), answered).same_room_other_d is True
    assert _decide(_failure(d, FailureKind.DISCONNECT), answered).same_room_other_d is False
    assert _decide(_failure(d, FailureKind.CONNECT), FakeAttempt(p, d)).same_room_other_d is False


def test_an_unresponsive_prefiller_is_retried_elsewhere_and_marked_unhealthy() -> None:
    p, d = _pair()
    failure = unresponsive_failure(p, "p stopped answering")
    assert (failure.kind, failure.error.status, failure.error.error_type) == (
        FailureKind.TIMEOUT,
        504,
        "prefill_failed",
    )
    assert _decide(failure, None) == Decision(True, True, False, False, False)


def test_settle_counts_marks_and_records_what_to_avoid() -> None:
    p, d = _pair()
    router = FakeRouter()
    tried = Tried()
    decision = settle(
        cast(Any, router), "/v1/completions", _failure(d, FailureKind.HTTP_5XX), tried, cast(Any, FakeAttempt(p, d))
    )
    assert decision.avoid_p and tried.p == {p} and tried.d == {d}
    assert router.metrics.errors == [("/v1/completions", d.backend.address, "http_5xx")]
    assert router.pool.marked == []
    tried = Tried()
    settle(cast(Any, router), "/v1/completions", _failure(p, FailureKind.CONNECT), tried)
    assert tried.p == {p} and tried.d == set()
    assert router.pool.marked == [(p, "connect on " + p.backend.name)]
    assert router.metrics.errors[-1] == ("/v1/completions", p.backend.address, "connect")
