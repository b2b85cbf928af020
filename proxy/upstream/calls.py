"""Backend failures, classified once, and the Router's one-shot backend calls.

Every backend call goes through :class:`proxy.upstream.http1.Http1Pool`, whose transport errors are
:class:`proxy.upstream.http1.UpstreamError`; :func:`exception_failure` and :func:`http_failure` turn them
and non-2xx answers into a :class:`Failure` that says what the client would get and whether
another P/D pair may be tried. :func:`fetch` (one request, whole answer) never raises for a
backend failure (only ``CancelledError`` escapes), so callers decide from plain values; health
checks (:func:`probe`, :func:`check_all`), ``/v1/models``, ``/reset_prefix_cache`` and the
prefill call use it.
"""

from __future__ import annotations

import asyncio
import enum
import json
from dataclasses import dataclass
from typing import Any

from pd_connector.kv_params import PREFILL_ERROR, refusal_of
from proxy.errors import DECODE_FAILED, PREFILL_FAILED, ROOM_IN_USE, RouterError, excerpt
from proxy.server.reply import BodyReply
from proxy.upstream.http1 import ConnectFailed, Http1Pool, UpstreamError
from proxy.upstream.pool import BackendPool, BackendState

#: Statuses worth trying another P/D pair for (besides connection failures and other 5xx).
RETRYABLE_STATUSES = frozenset({408, 429})


@dataclass(frozen=True, slots=True)
class Reply:
    """A backend's whole answer (:func:`fetch`), whatever its status."""

    status: int
    body: bytes
    content_type: str


class FailureKind(enum.Enum):
    """What went wrong with a backend call (the value is the ``kind`` label of
    ``pd_router_backend_errors_total``)."""

    CONNECT = "connect"  # the connection could not be opened: the backend is down
    TIMEOUT = "timeout"  # the request's deadline passed (or P stopped answering /health)
    DISCONNECT = "disconnect"  # the connection broke before the answer
    HTTP_4XX = "http_4xx"
    HTTP_5XX = "http_5xx"
    EMPTY = "empty"  # a 2xx answer with no body
    ERROR_EVENT = "error_event"  # D's stream began with an error event
    REFUSED = "refused"  # P holds no KV for the room: it is in use
    DRAIN = "drain"  # the Router closed D's stream: D is draining (proxy.admin.drain)


@dataclass(eq=False)
class Failure:
    """A failed backend request: what the client gets if it is final, and whether to try another pair."""

    state: BackendState
    kind: FailureKind
    error: RouterError
    retryable: bool
    #: A backend's own error answer ``(status, body, content type)``, passed to the client as is.
    passthrough: tuple[int, bytes, str] | None = None
    #: What went wrong, without the backend's name (``ConnectFailed: ...``, ``HTTP 503``).
    detail: str = ""
    #: P stopped answering ``/health`` while its request ran (:mod:`proxy.strategies.prefill_watch`): given up
    #: as a retryable timeout, and the backend is down (:mod:`proxy.request.failure_policy`).
    unresponsive: bool = False

    def response(self, headers: dict[str, str]) -> BodyReply:
        """The client's answer when this failure is final."""
        if self.passthrough is not None:
            status, body, content_type = self.passthrough
            return passthrough_response(status, body, content_type, headers)
        return self.error.to_response(headers)


def _error_type(state: BackendState) -> str:
    return PREFILL_FAILED if state.backend.role == "prefill" else DECODE_FAILED


def describe_exception(exc: BaseException) -> str:
    """``Type: message`` (or just the type when the message is empty), on one line."""
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def exception_failure(state: BackendState, exc: BaseException, timeout: float) -> Failure:
    """Classify a transport failure talking to ``state``'s backend.

    Connection could not be opened (:class:`proxy.upstream.http1.ConnectFailed`): 503, retryable (and
    :mod:`proxy.request.failure_policy` marks the backend unhealthy). Deadline passed (a ``TimeoutError``): 504, final.
    Connection broke before the answer (any other error): 502, retryable.
    """
    name = state.backend.name
    detail = describe_exception(exc)
    error_type = _error_type(state)
    if isinstance(exc, ConnectFailed):
        error = RouterError(503, f"{name} could not be reached ({detail})", error_type)
        return Failure(state, FailureKind.CONNECT, error, True, detail=detail)
    if isinstance(exc, TimeoutError):
        message = f"{name} did not answer in time (request timeout {timeout:g}s; {detail})"
        return Failure(state, FailureKind.TIMEOUT, RouterError(504, message, error_type), False, detail=detail)
    error = RouterError(502, f"connection to {name} failed ({detail})", error_type)
    return Failure(state, FailureKind.DISCONNECT, error, True, detail=detail)


def http_failure(state: BackendState, status: int, body: bytes, content_type: str) -> Failure:
    """Classify a non-2xx answer of ``state``'s backend.

    A decoder's answer is passed through as is. A prefiller's 4xx (the client's mistake) is
    passed through; its 5xx becomes a 502 naming the prefiller. 5xx, 408 and 429 may be
    retried on another pair; other 4xx are final.
    """
    backend = state.backend
    retryable = status >= 500 or status in RETRYABLE_STATUSES
    kind = FailureKind.HTTP_5XX if status >= 500 else FailureKind.HTTP_4XX
    message = f"{backend.name} answered HTTP {status}: {excerpt(body)}"
    if backend.role == "prefill" and status >= 500:
        return Failure(state, kind, RouterError(502, message, PREFILL_FAILED), retryable, detail=f"HTTP {status}")
    error = RouterError(status, message, _error_type(state))
    passthrough = (status, body, content_type or "application/json")
    return Failure(state, kind, error, retryable, passthrough, f"HTTP {status}")


def error_event_failure(state: BackendState, first: bytes) -> Failure | None:
    """D's stream began with an error event (``data: {"error": ...}``): a failure, not an answer.

    Returns ``None`` when ``first`` is not an error event.
    """
    if not first.startswith(b'data: {"error"'):
        return None
    event = first.split(b"\n\n", 1)[0][len(b"data: ") :]
    code = 502
    message = excerpt(event)
    try:
        payload: Any = json.loads(event)
        error = payload.get("error") or {}
        message = str(error.get("message") or message)
        code = int(error.get("code") or 502)
    except (ValueError, TypeError, AttributeError):
        pass
    status = code if 400 <= code < 600 else 502
    text = f"{state.backend.name} sent an error event before any data: {message}"
    return Failure(state, FailureKind.ERROR_EVENT, RouterError(status, text, DECODE_FAILED), status >= 500)


def refused_failure(state: BackendState, body: bytes) -> Failure | None:
    """P answered 200 but holds no KV for the room (``kv_params.prefill_refused``): a final 409.

    Returns ``None`` for a normal answer (only a body naming ``prefill_error`` is parsed).
    """
    if PREFILL_ERROR.encode() not in body:
        return None
    try:
        error = refusal_of(json.loads(body))
    except ValueError:
        return None
    if error is None:
        return None
    message = f"{state.backend.name} refused the request: {error}"
    return Failure(
        state, FailureKind.REFUSED, RouterError(409, message, ROOM_IN_USE, "bootstrap_room"), False, None, "refused"
    )


def empty_failure(state: BackendState, status: int) -> Failure:
    """The backend answered 2xx with no body at all: never passed on as an empty 200."""
    message = f"{state.backend.name} answered HTTP {status} with an empty body"
    return Failure(state, FailureKind.EMPTY, RouterError(502, message, _error_type(state)), True)


def unresponsive_failure(state: BackendState, message: str) -> Failure:
    """``state``'s backend stopped answering ``/health`` while its request ran: a retryable 504."""
    error = RouterError(504, message, _error_type(state))
    return Failure(state, FailureKind.TIMEOUT, error, True, detail="unresponsive", unresponsive=True)


def passthrough_response(status: int, body: bytes, content_type: str, headers: dict[str, str]) -> BodyReply:
    """A backend's answer, relayed with its status and content type."""
    return BodyReply(body, status, {**headers, "Content-Type": content_type})


async def fetch(
    http: Http1Pool,
    state: BackendState,
    method: str,
    path: str,
    timeout: float,
    body: bytes | None = None,
    headers: dict[str, str] | None = None,
    nominal_timeout: float | None = None,
) -> Reply | Failure:
    """One request to ``state``'s backend, its whole answer read: the :class:`Reply` (any
    status), or the classified transport :class:`Failure`.

    ``timeout`` is the time left for the request; ``nominal_timeout`` (default: ``timeout``)
    the configured one that a timeout's error message names.
    """
    backend = state.backend
    try:
        response = await http.request(method, backend.host, backend.port, path, body, headers or {}, timeout)
        try:
            content = await response.read()
        finally:
            response.release()
        return Reply(response.status, content, response.content_type)
    except UpstreamError as exc:
        return exception_failure(state, exc, timeout if nominal_timeout is None else nominal_timeout)


async def probe(http: Http1Pool, state: BackendState, timeout: float) -> tuple[bool, int | None, str | None]:
    """``GET /health`` on one backend: ``(healthy, status_code, error)`` (never raises)."""
    reply = await fetch(http, state, "GET", "/health", timeout)
    if isinstance(reply, Failure):
        return False, None, reply.detail
    if 200 <= reply.status < 300:
        return True, reply.status, None
    return False, reply.status, f"HTTP {reply.status}"


async def check_all(http: Http1Pool, pool: BackendPool, timeout: float) -> None:
    """Health-check every instance of the pool at once and record the results."""
    states = pool.all_states()
    results = await asyncio.gather(*(probe(http, s, timeout) for s in states))
    for state, (healthy, status, error) in zip(states, results, strict=True):
        pool.set_health(state, healthy, status, error)
