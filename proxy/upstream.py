"""HTTP calls from the Router to its backends, with retries, deadlines and error classification.

The coroutines here never raise for a backend failure (only ``CancelledError`` escapes):
they return a :class:`~proxy.errors.RouterError` the Router can hand to the client, so the
request handler can race P and D with ``asyncio.wait`` and decide from plain values.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Any

import httpx

from proxy.config import Backend, RouterConfig
from proxy.errors import DECODE_FAILED, PREFILL_FAILED, RouterError, excerpt

logger = logging.getLogger("proxy")


class RequestLog(logging.LoggerAdapter):  # type: ignore[type-arg]
    """Logger adapter that prefixes every line with the request's bootstrap room and X-Request-Id."""

    def process(self, msg: Any, kwargs: Any) -> tuple[Any, Any]:
        extra = self.extra or {}
        return f"[room={extra.get('room')} rid={extra.get('rid')}] {msg}", kwargs


def make_client(config: RouterConfig) -> httpx.AsyncClient:
    """The Router's one shared, pooled HTTP client.

    ``read`` is the per-read timeout; the total per-request deadline is enforced separately.
    ``trust_env=False`` keeps ``HTTP(S)_PROXY`` variables from rerouting backend traffic.
    """
    timeout = httpx.Timeout(
        connect=config.connect_timeout,
        read=config.request_timeout,
        write=config.request_timeout,
        pool=config.connect_timeout,
    )
    # Idle connections are dropped before a uvicorn backend's own keep-alive timeout (vLLM: 5 s),
    # so a request is never written onto a connection the backend is just closing.
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=256, keepalive_expiry=4.0)
    return httpx.AsyncClient(timeout=timeout, limits=limits, trust_env=False)


def classify(exc: BaseException, backend: Backend, timeout: float) -> RouterError:
    """Map a transport failure talking to ``backend`` to the error the client gets.

    Connection could not be opened: 503. Timed out: 504. Connection broke mid-request: 502.
    """
    error_type = PREFILL_FAILED if backend.role == "prefill" else DECODE_FAILED
    detail = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    if isinstance(exc, httpx.ConnectError | httpx.ConnectTimeout):
        return RouterError(503, f"{backend.name} could not be reached ({detail})", error_type)
    if isinstance(exc, httpx.TimeoutException | TimeoutError):
        return RouterError(504, f"{backend.name} did not answer in time (limit {timeout:g}s; {detail})", error_type)
    return RouterError(502, f"connection to {backend.name} failed ({detail})", error_type)


class Upstream:
    """Sends requests to backends through the shared client."""

    def __init__(self, client: httpx.AsyncClient, config: RouterConfig) -> None:
        self.client = client
        self.config = config

    def _request(
        self, method: str, backend: Backend, path: str, headers: dict[str, str], body: dict[str, Any] | None
    ) -> httpx.Request:
        content = None
        if body is not None:
            content = json.dumps(body, ensure_ascii=False).encode()
            headers = {**headers, "Content-Type": "application/json"}
        return self.client.build_request(method, f"{backend.base_url}{path}", headers=headers, content=content)

    async def send(self, request: httpx.Request, backend: Backend, log: RequestLog, *, stream: bool) -> httpx.Response:
        """Send ``request``, retrying (exponential back-off) only while the connection cannot be opened.

        Only connection failures are retried: the backend never saw the request, so a retry
        cannot run it twice. Raises the last ``httpx`` error when every attempt failed.
        """
        attempts = self.config.max_retries
        for attempt in range(1, attempts + 1):
            try:
                return await self.client.send(request, stream=stream)
            except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
                if attempt >= attempts:
                    raise
                delay = self.config.retry_delay * 2 ** (attempt - 1)
                log.warning(
                    "%s: connection attempt %d/%d failed (%s); retrying in %.3fs",
                    backend.name,
                    attempt,
                    attempts,
                    type(exc).__name__,
                    delay,
                )
                await asyncio.sleep(delay)
        raise AssertionError("unreachable")  # pragma: no cover

    async def prefill(
        self,
        backend: Backend,
        path: str,
        body: dict[str, Any],
        headers: dict[str, str],
        log: RequestLog,
        *,
        deadline: float,
    ) -> RouterError | None:
        """Run the prefill request on P; return ``None`` on a 2xx answer, else the error for the client.

        ``deadline`` is a ``loop.time()`` value bounding this call.
        """
        timeout = self.config.request_timeout
        started = time.monotonic()
        request = self._request("POST", backend, path, headers, body)
        try:
            async with asyncio.timeout_at(deadline):
                response = await self.send(request, backend, log, stream=False)
        except (httpx.HTTPError, TimeoutError) as exc:
            error = classify(exc, backend, timeout)
            log.error("prefill failed: %s", error.message)
            return error
        elapsed = time.monotonic() - started
        if response.is_success:
            log.info("prefill done on %s: HTTP %d in %.3fs", backend.name, response.status_code, elapsed)
            return None
        error = RouterError(
            502,
            f"{backend.name} answered HTTP {response.status_code}: {excerpt(response.content)}",
            PREFILL_FAILED,
        )
        log.error("prefill failed: %s", error.message)
        return error

    async def decode(
        self,
        backend: Backend,
        path: str,
        body: dict[str, Any],
        headers: dict[str, str],
        log: RequestLog,
        *,
        stream: bool,
        deadline: float,
    ) -> httpx.Response | RouterError:
        """Send the decode request to D.

        Without ``stream`` the whole answer is read before returning. With ``stream`` this returns
        once D's status line and headers arrived; the caller owns the open response and must
        close it. ``deadline`` is a ``loop.time()`` value bounding this call.
        """
        timeout = self.config.request_timeout
        request = self._request("POST", backend, path, headers, body)
        try:
            async with asyncio.timeout_at(deadline):
                response = await self.send(request, backend, log, stream=stream)
        except (httpx.HTTPError, TimeoutError) as exc:
            error = classify(exc, backend, timeout)
            log.error("decode failed: %s", error.message)
            return error
        log.info("%s answered HTTP %d%s", backend.name, response.status_code, " (stream)" if stream else "")
        return response

    async def get(
        self, backend: Backend, path: str, headers: dict[str, str], log: RequestLog
    ) -> httpx.Response | RouterError:
        """A plain GET (used for ``/v1/models``), bounded by the connect timeout and request timeout."""
        timeout = self.config.request_timeout
        request = self._request("GET", backend, path, headers, None)
        try:
            async with asyncio.timeout(timeout):
                return await self.send(request, backend, log, stream=False)
        except (httpx.HTTPError, TimeoutError) as exc:
            return classify(exc, backend, timeout)
