"""The Router's one failure policy: what a failed backend call within an attempt leads to.

Every path that calls backends asks :func:`decide` and acts on its :class:`Decision`: a request's
attempts (whichever strategy runs them) through :meth:`proxy.request.loop.AttemptLoop.fail`, which calls
:func:`settle` (it counts the failure, marks the backend unhealthy and records which instances failed
this request, :class:`Tried`), and ``/v1/models`` in :mod:`proxy.app` through :func:`count_failure` (the
one place that marks a backend unhealthy, always with ``pd_router_backend_errors`` counted). The rules:

- **retry** on another pair where the failure is retryable (:attr:`proxy.upstream.calls.Failure.retryable`:
  connection failures, broken connections, 5xx/408/429, empty answers, an error event first);
- **mark the backend unhealthy** when it could not be connected to, or P stopped answering
  ``/health`` while its request ran: the health loop brings it back;
- **avoid the pair's P too** when D answered 5xx or an error event: D's failed KV load is most often
  P's doing (P frozen or gone, D's liveness saw it), which D cannot name;
- **release P's room** when P holds the room's KV and D never asked for it (D could not be
  connected to): another decoder loads, and so frees, it (:mod:`proxy.request.room_release`), unless the
  same room goes to another decoder (:attr:`Decision.same_room_other_d`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from proxy.upstream.calls import Failure, FailureKind
from proxy.upstream.pool import BackendState

if TYPE_CHECKING:
    from proxy.request.attempt import Attempt
    from proxy.router_state import Router

#: D's failures that most often are P's doing (D's KV load from P failed).
D_LOAD_FAILURES = frozenset({FailureKind.HTTP_5XX, FailureKind.ERROR_EVENT})


@dataclass(frozen=True, slots=True)
class Decision:
    """What one failed backend call leads to."""

    #: Try another pair (the caller also checks its attempts and deadline).
    retry: bool
    #: Take the failed backend out of routing until a health check finds it back.
    mark_unhealthy: bool
    #: D failed: the retry avoids the attempt's P too.
    avoid_p: bool
    #: P holds the room's KV and D never asked for it: free the room on P now.
    release_room: bool
    #: P had answered before the attempt (first-token path) and D could not be connected to:
    #: another decoder may load the same room instead of a new P/D pair.
    same_room_other_d: bool


def decide(failure: Failure, attempt: Attempt | None = None) -> Decision:
    """The policy for ``failure``, of a call within ``attempt`` (None: a call outside any attempt,
    such as ``/v1/models``)."""
    connect = failure.kind is FailureKind.CONNECT
    by_d = attempt is not None and failure.state is attempt.d
    return Decision(
        retry=failure.retryable,
        mark_unhealthy=connect or failure.unresponsive,
        avoid_p=attempt is not None and _avoid_p(failure, attempt.d),
        release_room=by_d and connect and attempt is not None and not _moves_kv(attempt) and attempt.holds_p_room(),
        same_room_other_d=by_d and connect and attempt is not None and attempt.p_answered,
    )


def _avoid_p(failure: Failure, d: BackendState) -> bool:
    """Whether ``failure`` is decoder ``d``'s of a kind most often its P's doing (P is avoided too)."""
    return failure.state is d and failure.kind in D_LOAD_FAILURES


def _moves_kv(attempt: Attempt) -> bool:
    """Whether ``attempt`` loads a drained decoder's KV (its "P" is that decoder:
    :mod:`proxy.strategies.kv_move`); its room is the decoder's own to free (``migrate_hold_s``)."""
    return attempt.p.backend.role == "decode" and not attempt.local


@dataclass(slots=True)
class Tried:
    """The instances that failed one client request (routing avoids them on its retries)."""

    p: set[BackendState] = field(default_factory=set)
    d: set[BackendState] = field(default_factory=set)

    def add(self, state: BackendState) -> None:
        (self.p if state.backend.role == "prefill" else self.d).add(state)

    @classmethod
    def after_cut(cls, failure: Failure, p: BackendState, d: BackendState) -> Tried:
        """What a stream's next leg avoids after the stream of the pair ``p``/``d`` was cut by
        ``failure``: the instance that failed, the decoder, and P where D's failure is most often P's."""
        tried = cls()
        tried.add(failure.state)
        tried.d.add(d)
        if _avoid_p(failure, d):
            tried.p.add(p)
        return tried


def count_failure(router: Router, endpoint: str, failure: Failure, attempt: Attempt | None = None) -> Decision:
    """Count ``failure`` (``pd_router_backend_errors``) and mark its backend unhealthy where
    :func:`decide` says so: every call that takes a backend out of routing goes through here."""
    decision = decide(failure, attempt)
    router.metrics.backend_error(endpoint, failure.state.backend, failure.kind.value)
    if decision.mark_unhealthy:
        router.pool.mark_unhealthy(failure.state, failure.error.message)
    return decision


def settle(router: Router, endpoint: str, failure: Failure, tried: Tried, attempt: Attempt | None = None) -> Decision:
    """Count ``failure``, mark its backend unhealthy and note the instances to avoid, as
    :func:`decide` says; the caller (:meth:`proxy.request.loop.AttemptLoop.fail`) retries and
    releases the room.

    A leg that loads a drained decoder's KV (``attempt.p`` is that decoder:
    :mod:`proxy.strategies.kv_move`) avoids its target only where the target was unreachable: a
    failed KV load is most often the source's doing, and the source is never avoided as a P."""
    decision = count_failure(router, endpoint, failure, attempt)
    if attempt is not None and _moves_kv(attempt):
        if decision.mark_unhealthy:
            tried.add(failure.state)
        return decision
    tried.add(failure.state)
    if decision.avoid_p and attempt is not None:
        tried.p.add(attempt.p)
    return decision


#: Failures of a stream that started which a resumed leg may follow: the decoder (or the pair's
#: prefiller) broke or failed, not the client's deadline or a refusal of the request itself.
RESUMABLE_KINDS = frozenset(
    {
        FailureKind.CONNECT,
        FailureKind.DISCONNECT,
        FailureKind.HTTP_5XX,
        FailureKind.ERROR_EVENT,
        FailureKind.EMPTY,
        FailureKind.DRAIN,
    }
)


def resume_refusal(failure: Failure, resumes_made: int, limit: int) -> str | None:
    """Why a stream cut by ``failure`` after it started is not resumed on another decoder (None: it
    is); ``resumes_made`` resumed legs were tried for the request already, ``--resume-attempts`` is
    ``limit``."""
    if limit < 1:
        return "resume is off (--resume-attempts 0)"
    if resumes_made >= limit:
        return f"{resumes_made} resumed leg(s) tried already (--resume-attempts {limit})"
    if failure.kind not in RESUMABLE_KINDS and not failure.unresponsive:
        return f"a {failure.kind.value} failure is not resumed"
    return None
