"""HTTP calls from the Router to its backends (one shared ``aiohttp`` session) and failure classification.

The calls here never raise for a backend failure (only ``CancelledError`` escapes): they return
a :class:`Failure` that says what the client would get and whether another P/D pair may be
tried, so the request handler can race P and D and decide from plain values.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import aiohttp
from aiohttp import web

from proxy.backends import BackendState, describe_exception
from proxy.config import RouterConfig
from proxy.errors import DECODE_FAILED, PREFILL_FAILED, RouterError, excerpt
from proxy.http1 import ConnectFailed

#: Statuses worth trying another P/D pair for (besides connection failures and other 5xx).
RETRYABLE_STATUSES = frozenset({408, 429})
#: Idle backend connections are closed before a uvicorn backend's own keep-alive timeout
#: (vLLM: 5 s), so a request is never written onto a connection the backend is just closing.
KEEPALIVE_S = 4.0


def make_session(config: RouterConfig) -> aiohttp.ClientSession:
    """The Router's one shared, pooled HTTP client session.

    No connection limit (the backends' own queues do the limiting), no ``Accept-Encoding``
    (backends answer uncompressed, so bytes pass through unchanged), no proxy variables.
    Timeouts are given per request (see :class:`proxy.app.Exchange`).
    """
    connector = aiohttp.TCPConnector(limit=0, limit_per_host=0, keepalive_timeout=KEEPALIVE_S, ttl_dns_cache=60)
    return aiohttp.ClientSession(
        connector=connector,
        timeout=aiohttp.ClientTimeout(total=None, sock_connect=config.connect_timeout),
        skip_auto_headers=("Accept-Encoding", "User-Agent"),
        auto_decompress=False,
        trust_env=False,
    )


@dataclass(eq=False)
class Failure:
    """A failed backend request: what the client gets if it is final, and whether to try another pair."""

    state: BackendState
    #: ``connect``, ``timeout``, ``disconnect``, ``http_4xx``, ``http_5xx``, ``empty``, ``error_event``.
    kind: str
    error: RouterError
    retryable: bool
    #: A backend's own error answer ``(status, body, content type)``, passed to the client as is.
    passthrough: tuple[int, bytes, str] | None = None

    def response(self, headers: dict[str, str]) -> web.Response:
        """The client's answer when this failure is final."""
        if self.passthrough is not None:
            status, body, content_type = self.passthrough
            return web.Response(body=body, status=status, headers={**headers, "Content-Type": content_type})
        return self.error.to_response(headers)


def _error_type(state: BackendState) -> str:
    return PREFILL_FAILED if state.backend.role == "prefill" else DECODE_FAILED


def exception_failure(state: BackendState, exc: BaseException, timeout: float) -> Failure:
    """Classify a transport failure talking to ``state``'s backend.

    Connection could not be opened: 503, retryable (and the caller marks the backend
    unhealthy). Connection broke before the answer: 502, retryable. Request deadline passed:
    504, final.
    """
    name = state.backend.name
    detail = describe_exception(exc)
    error_type = _error_type(state)
    if isinstance(exc, ConnectFailed | aiohttp.ClientConnectorError | aiohttp.ConnectionTimeoutError):
        return Failure(state, "connect", RouterError(503, f"{name} could not be reached ({detail})", error_type), True)
    if isinstance(exc, TimeoutError):
        message = f"{name} did not answer in time (request timeout {timeout:g}s; {detail})"
        return Failure(state, "timeout", RouterError(504, message, error_type), False)
    return Failure(state, "disconnect", RouterError(502, f"connection to {name} failed ({detail})", error_type), True)


def http_failure(state: BackendState, status: int, body: bytes, content_type: str) -> Failure:
    """Classify a non-2xx answer of ``state``'s backend.

    A decoder's answer is passed through as is. A prefiller's 4xx (the client's mistake) is
    passed through; its 5xx becomes a 502 naming the prefiller. 5xx, 408 and 429 may be
    retried on another pair; other 4xx are final.
    """
    backend = state.backend
    retryable = status >= 500 or status in RETRYABLE_STATUSES
    kind = "http_5xx" if status >= 500 else "http_4xx"
    message = f"{backend.name} answered HTTP {status}: {excerpt(body)}"
    if backend.role == "prefill" and status >= 500:
        return Failure(state, kind, RouterError(502, message, PREFILL_FAILED), retryable)
    error = RouterError(status, message, _error_type(state))
    return Failure(state, kind, error, retryable, passthrough=(status, body, content_type or "application/json"))


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
    return Failure(state, "error_event", RouterError(status, text, DECODE_FAILED), status >= 500)


def empty_failure(state: BackendState, status: int) -> Failure:
    """The backend answered 2xx with no body at all: never passed on as an empty 200."""
    message = f"{state.backend.name} answered HTTP {status} with an empty body"
    return Failure(state, "empty", RouterError(502, message, _error_type(state)), True)


def passthrough_response(status: int, body: bytes, content_type: str, headers: dict[str, str]) -> web.Response:
    """A backend's answer, relayed with its status and content type."""
    return web.Response(body=body, status=status, headers={**headers, "Content-Type": content_type})
