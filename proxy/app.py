"""The Router's aiohttp application: ``create_app(config)``.

Request lifecycle (DESIGN.md §3): a completion or chat request gets a bootstrap room, one
prefill instance P and one decode instance D; both requests are sent at once; D's answer
(JSON, or the SSE stream byte for byte) goes back to the client.

- Failover: until the first byte of the answer goes to the client (a stream's headers are held
  back until D's first chunk), a failed attempt (a backend unreachable, a connection broken, a
  5xx/408/429, an empty answer, an error event as D's first chunk) closes both backend requests
  and is retried on another P/D pair with a fresh room, up to ``--max-retries`` attempts in
  all. After that byte, nothing is retried: a stream that breaks ends with an SSE error event.
- Abort: the application runs with aiohttp's handler cancellation, so a client that goes away
  cancels its handler; the handler then closes both backend connections, and vLLM aborts a
  request whose connection closes, freeing its KV blocks.
- Never an empty 200 and never a hang: every failure becomes an OpenAI-style error (or the
  backend's own error answer), and every request has a deadline (``--request-timeout``).

The P and D calls go through :mod:`proxy.http1` (the Router's own keep-alive HTTP/1.1 client:
most of the Router's added latency was ``aiohttp``'s client); health checks, ``/v1/models``
and ``/reset_prefix_cache`` use an ``aiohttp`` session. Other endpoints: ``/v1/models``,
``/health``, ``/healthcheck``, ``/metrics`` (:mod:`proxy.metrics`), ``GET /instances``,
``POST /instances/add`` and ``/instances/remove`` (:func:`parse_instances`),
``POST /reset_prefix_cache``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

import aiohttp
from aiohttp import web

from pd_connector.kv_params import DEFAULT_BOOTSTRAP_PORT
from proxy.backends import BackendPool, BackendState, Lease, check_all, describe_exception, pool_health, probe
from proxy.config import ROLES, Backend, Role, RouterConfig
from proxy.errors import (
    CLIENT_DISCONNECTED,
    DECODE_FAILED,
    INTERNAL_ERROR,
    INVALID_REQUEST,
    NOT_FOUND,
    UPSTREAM_UNAVAILABLE,
    RouterError,
    error_response,
    json_response,
)
from proxy.http1 import Http1Pool, Response, UpstreamError
from proxy.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from proxy.metrics import RouterMetrics
from proxy.payloads import (
    CHAT_COMPLETIONS,
    COMPLETIONS,
    decode_body,
    estimate_prompt_tokens,
    new_room,
    prefill_body,
    resolve_room,
    validate_body,
)
from proxy.upstream import (
    Failure,
    empty_failure,
    error_event_failure,
    exception_failure,
    http_failure,
    make_session,
    passthrough_response,
)

logger = logging.getLogger("proxy")

#: Status recorded (nginx convention) when the client went away before the answer ended.
CLIENT_CLOSED_REQUEST = 499
#: How long a graceful shutdown waits for requests in flight.
SHUTDOWN_TIMEOUT_S = 5.0
ROUTER_KEY: web.AppKey[Router] = web.AppKey("router")
_TRANSPORT_ERRORS = (aiohttp.ClientError, TimeoutError, OSError)


class _Opened:
    """D's streamed answer, open: its response, first chunk and in-flight lease."""

    __slots__ = ("response", "first", "lease")

    def __init__(self, response: Response, first: bytes, lease: Lease) -> None:
        self.response = response
        self.first = first
        self.lease = lease

    def close(self) -> None:
        self.response.close()
        self.lease.release()


class _Answered:
    """D's whole (non-streamed) 2xx answer."""

    __slots__ = ("status", "body", "content_type")

    def __init__(self, status: int, body: bytes, content_type: str) -> None:
        self.status = status
        self.body = body
        self.content_type = content_type


class Router:
    """Application state: configuration, backend pool, metrics, the shared HTTP session."""

    def __init__(self, config: RouterConfig) -> None:
        self.config = config
        self.pool = BackendPool(config.prefillers, config.decoders, config.routing)
        self.metrics = RouterMetrics(self.pool)
        self._session: aiohttp.ClientSession | None = None
        #: The hot path's HTTP client (generation requests to P and D).
        self.http = Http1Pool(config.connect_timeout)
        #: Tasks the Router keeps references to until they end (detached prefills, aborts, ...).
        self.tasks: set[asyncio.Task[Any]] = set()
        #: Instances added at run time that have not answered a health check yet.
        self.waiting: dict[tuple[str, str, int], tuple[Backend, asyncio.Task[None]]] = {}

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            raise RuntimeError("the Router's HTTP session is not started (run the application)")
        return self._session

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
        """Run ``coro`` as a task referenced until it ends."""
        task = asyncio.get_running_loop().create_task(coro)
        self.keep(task)
        return task

    def keep(self, task: asyncio.Task[Any]) -> None:
        """Reference ``task`` until it ends (so it is not garbage-collected while running)."""
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    # -- lifecycle -------------------------------------------------------------------------

    async def startup(self, _app: web.Application) -> None:
        self._session = make_session(self.config)
        if self.config.health_interval > 0:
            self.spawn(self._health_loop())

    async def cleanup(self, _app: web.Application) -> None:
        for task in list(self.tasks):
            task.cancel()
        if self.tasks:
            await asyncio.wait(self.tasks, timeout=2.0)
        self.http.close()
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def _health_loop(self) -> None:
        while True:
            try:
                await check_all(self.session, self.pool, self.config.health_timeout)
            except Exception:  # pragma: no cover (check_all does not raise)
                logger.exception("health check round failed")
            await asyncio.sleep(self.config.health_interval)

    # -- generation ------------------------------------------------------------------------

    async def generate(self, request: web.Request, endpoint: str) -> web.StreamResponse:
        """Serve ``POST /v1/completions`` and ``POST /v1/chat/completions``."""
        t0 = time.monotonic()
        rid = request.headers.get("X-Request-Id", "").strip() or uuid.uuid4().hex
        try:
            raw = await _read_body(request, self.config.max_body_size)
            try:
                body = json.loads(raw)
            except ValueError as exc:
                raise RouterError(400, f"request body is not valid JSON: {exc}", INVALID_REQUEST) from None
            validate_body(body, endpoint)
            room = resolve_room(body)
        except RouterError as error:
            logger.warning("rid=%s POST %s rejected: HTTP %d %s", rid, endpoint, error.status, error.message)
            self.metrics.error(endpoint, error.error_type)
            self.metrics.request_done(endpoint, error.status, None, time.monotonic() - t0)
            return error.to_response({"X-Request-Id": rid})
        exchange = Exchange(self, request, endpoint, rid, body, room, t0)
        return await exchange.run()

    # -- instances -------------------------------------------------------------------------

    async def add_instance(self, backend: Backend) -> str:
        """Add ``backend`` to the pool; returns what happened (``added``, ``waiting``, ...)."""
        existing = self.pool.find(backend.role, backend.host, backend.port)
        if existing is not None:
            if existing.draining:
                self.pool.undrain(existing)
                return "re-activated"
            return "already present"
        if backend.key in self.waiting:
            return "waiting"
        state = BackendState(backend, healthy=False)
        healthy, status, error = await probe(self.session, backend, self.config.health_timeout)
        if self.pool.find(backend.role, backend.host, backend.port) is not None:
            return "already present"  # added concurrently
        state.status_code, state.last_error, state.last_check = status, error, time.time()
        if healthy:
            state.healthy = True
            self.pool.add_state(state)
            return "added"
        logger.warning(
            "%s does not answer its health check yet (%s); checking %d more time(s), %gs apart",
            backend.name,
            error,
            self.config.max_waiting_retries - 1,
            self.config.waiting_retry_interval,
        )
        task = self.spawn(self._wait_for(state))
        self.waiting[backend.key] = (backend, task)
        return "waiting"

    async def _wait_for(self, state: BackendState) -> None:
        backend = state.backend
        try:
            for _ in range(self.config.max_waiting_retries - 1):
                await asyncio.sleep(self.config.waiting_retry_interval)
                healthy, status, error = await probe(self.session, backend, self.config.health_timeout)
                state.status_code, state.last_error, state.last_check = status, error, time.time()
                if healthy:
                    state.healthy = True
                    self.pool.add_state(state)
                    return
            logger.warning("%s was not added: it did not answer its health checks (%s)", backend.name, state.last_error)
        finally:
            self.waiting.pop(backend.key, None)

    def remove_instance(self, role: Role, host: str, port: int) -> str | None:
        """Remove (drain) an instance; returns what happened, or ``None`` if it is unknown."""
        state = self.pool.find(role, host, port)
        if state is None:
            entry = self.waiting.pop((role, host, port), None)
            if entry is None:
                return None
            entry[1].cancel()
            logger.info("%s removed before it became healthy", entry[0].name)
            return "removed"
        if state.draining:
            return "draining"
        return "removed" if self.pool.remove(state) else "draining"

    def instances(self) -> dict[str, Any]:
        """Every instance (active, draining, waiting), in ``/instances`` form."""
        snapshot = self.pool.snapshot()
        snapshot["waiting"] = [
            {"role": b.role, "host": b.host, "port": b.port, "url": b.base_url} for b, _ in self.waiting.values()
        ]
        snapshot["routing"] = self.config.routing
        # vLLM-Ascend proxy's keys.
        snapshot["current_prefill_instances"] = [s.backend.address for s in self.pool.active["prefill"]]
        snapshot["current_decode_instances"] = [s.backend.address for s in self.pool.active["decode"]]
        return snapshot


async def _read_body(request: web.Request, limit: int) -> bytes:
    length = request.content_length
    if length is not None and length > limit:
        raise RouterError(413, f"request body of {length} bytes exceeds the limit of {limit} bytes", INVALID_REQUEST)
    try:
        return await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise RouterError(413, f"request body exceeds the limit of {limit} bytes", INVALID_REQUEST) from None


class Exchange:
    """One client generation request: its attempts, its answer, its cleanup and its log line."""

    def __init__(
        self,
        router: Router,
        request: web.Request,
        endpoint: str,
        rid: str,
        body: dict[str, Any],
        room: int,
        t0: float,
    ) -> None:
        self.router = router
        self.request = request
        self.endpoint = endpoint
        self.rid = rid
        self.body = body
        self.room = room
        self.t0 = t0
        self.stream = body.get("stream") is True
        self.tokens = estimate_prompt_tokens(body)
        config = router.config
        self.deadline = t0 + config.request_timeout
        headers = {"X-Request-Id": rid}
        if auth := request.headers.get("Authorization") or config.backend_authorization:
            headers["Authorization"] = auth
        self.headers = headers
        self.out_headers = {"X-Request-Id": rid}
        self.p_state: BackendState | None = None
        self.d_state: BackendState | None = None
        self.p_task: asyncio.Task[Failure | None] | None = None
        self.opened: _Opened | None = None
        #: While D's request runs in the handler itself, a failing P interrupts it (see _attempt).
        self._interruptible: asyncio.Task[Any] | None = None
        self._interrupted = False
        self.attempts = 0
        self.status = 0
        self.ttfb: float | None = None
        self.late_p_failure: Failure | None = None
        self.stream_done = False
        #: The last bytes relayed to the client; a stream whose tail is ``data: [DONE]`` is complete
        #: even if the client hangs up before the Router ends the chunked body.
        self._tail = b""

    # -- the whole request ------------------------------------------------------------------

    @property
    def sent_done_event(self) -> bool:
        """Whether the client already has the stream's final ``data: [DONE]`` event."""
        return self._tail.rstrip().endswith(b"data: [DONE]")

    async def run(self) -> web.StreamResponse:
        try:
            return await self._attempts()
        except asyncio.CancelledError:
            if self.sent_done_event:
                logger.debug("rid=%s room=%s client closed the connection after [DONE]", self.rid, self.room)
                raise
            self.status = CLIENT_CLOSED_REQUEST
            self.router.metrics.error(self.endpoint, CLIENT_DISCONNECTED)
            logger.warning(
                "rid=%s room=%s client disconnected %s; closing the backend requests",
                self.rid,
                self.room,
                "mid-stream" if self.ttfb is not None else "before the answer",
            )
            raise
        except Exception as exc:
            logger.exception("rid=%s room=%s unexpected error", self.rid, self.room)
            self.status = 500
            self.router.metrics.error(self.endpoint, INTERNAL_ERROR)
            if self.ttfb is not None:
                raise
            return error_response(500, f"internal Router error: {type(exc).__name__}", INTERNAL_ERROR, self.out_headers)
        finally:
            self._abort_attempt()
            elapsed = time.monotonic() - self.t0
            self.router.metrics.request_done(self.endpoint, self.status, self.ttfb, elapsed)
            logger.info(
                "rid=%s room=%s POST %s stream=%s P=%s D=%s status=%d attempts=%d ttfb_ms=%s total_ms=%.1f",
                self.rid,
                self.room,
                self.endpoint,
                self.stream,
                self.p_state.backend.address if self.p_state else "-",
                self.d_state.backend.address if self.d_state else "-",
                self.status,
                self.attempts,
                f"{self.ttfb * 1000:.1f}" if self.ttfb is not None else "-",
                elapsed * 1000,
            )

    async def _attempts(self) -> web.StreamResponse:
        router = self.router
        config = router.config
        pool = router.pool
        tried_p: set[BackendState] = set()
        tried_d: set[BackendState] = set()
        failure: Failure | None = None
        for attempt in range(1, config.max_retries + 1):
            if attempt > 1:
                router.metrics.retry(self.endpoint)
                self.room = new_room()
                delay = config.retry_delay * 2 ** (attempt - 2)
                if delay > 0:
                    await asyncio.sleep(delay)
            p = pool.pick("prefill", self.room, tried_p)
            d = pool.pick("decode", self.room, tried_d)
            if p is None or d is None:
                missing = "prefill" if p is None else "decode"
                return self._error(RouterError(503, f"no {missing} instance is available", UPSTREAM_UNAVAILABLE))
            remaining = self.deadline - time.monotonic()
            if remaining <= 0:
                break
            self.attempts = attempt
            self.p_state, self.d_state = p, d
            outcome = await self._attempt(p, d, remaining)
            if not isinstance(outcome, Failure):
                return await self._answer(outcome)
            failure = outcome
            self._abort_attempt()
            router.metrics.backend_error(self.endpoint, failure.state.backend, failure.kind)
            if failure.kind == "connect":
                pool.mark_unhealthy(failure.state, failure.error.message)
            (tried_p if failure.state.backend.role == "prefill" else tried_d).add(failure.state)
            if not failure.retryable or attempt == config.max_retries:
                break
            logger.warning(
                "rid=%s room=%s attempt %d/%d failed (%s); retrying on another pair with a fresh room",
                self.rid,
                self.room,
                attempt,
                config.max_retries,
                failure.error.message,
            )
        if failure is None:
            failure_error = RouterError(504, "the request timed out before a backend answered", DECODE_FAILED)
            return self._error(failure_error)
        return self._final_failure(failure)

    # -- one attempt ---------------------------------------------------------------------------

    async def _prefill(self, state: BackendState, timeout: float) -> Failure | None:
        router = self.router
        lease = router.pool.lease(state, self.tokens)
        router.metrics.backend_request(self.endpoint, state.backend)
        backend = state.backend
        data = json.dumps(prefill_body(self.body, self.room), ensure_ascii=False).encode()
        try:
            response = await router.http.post(backend.host, backend.port, self.endpoint, data, self.headers, timeout)
            try:
                content = await response.read()
            finally:
                response.release()
            if response.status < 300:
                return None
            return http_failure(state, response.status, content, response.content_type)
        except UpstreamError as exc:
            return exception_failure(state, exc, router.config.request_timeout)
        finally:
            lease.release()

    async def _decode(self, state: BackendState, timeout: float) -> _Opened | _Answered | Failure:
        router = self.router
        lease = router.pool.lease(state)
        router.metrics.backend_request(self.endpoint, state.backend)
        backend = state.backend
        data = json.dumps(decode_body(self.body, self.room, self.p_state.backend), ensure_ascii=False).encode()
        response: Response | None = None
        try:
            response = await router.http.post(backend.host, backend.port, self.endpoint, data, self.headers, timeout)
            status = response.status
            content_type = response.content_type
            if status >= 300 or not self.stream:
                content = await response.read()
                response.release()
                lease.release()
                if status >= 300:
                    return http_failure(state, status, content, content_type)
                if not content:
                    return empty_failure(state, status)
                return _Answered(status, content, content_type or "application/json")
            first = await response.next_chunk()
            if not first:
                response.release()
                lease.release()
                return empty_failure(state, status)
            failure = error_event_failure(state, first)
            if failure is not None:
                response.close()
                lease.release()
                return failure
            return _Opened(response, first, lease)
        except BaseException as exc:
            if response is not None:
                response.close()
            lease.release()
            if isinstance(exc, UpstreamError):
                return exception_failure(state, exc, router.config.request_timeout)
            raise

    async def _attempt(self, p: BackendState, d: BackendState, timeout: float) -> _Opened | _Answered | Failure:
        """Send P's request (a task) and D's (in this task, its answer is the critical path) at once.

        Returns D's answer (its first chunk, when streaming), or the attempt's failure. A P that
        fails first interrupts D's request by cancelling this task; ``uncancel()`` tells that
        cancellation from a client that went away (aiohttp cancels the handler then).
        """
        handler = asyncio.current_task()
        self.p_task = p_task = asyncio.get_running_loop().create_task(self._prefill(p, timeout))
        self._interrupted = False
        self._interruptible = handler
        p_task.add_done_callback(self._on_early_prefill)
        try:
            result = await self._decode(d, timeout)
        except asyncio.CancelledError:
            if self._interrupted and handler is not None and handler.uncancel() == 0:
                return p_task.result()  # P's failure
            raise
        finally:
            self._interruptible = None
        if isinstance(result, _Opened):
            self.opened = result
        if p_task.done() and not p_task.cancelled() and p_task.result() is not None:
            return p_task.result()  # P failed too: its error is the cause (D waits for P's KV)
        return result

    def _on_early_prefill(self, task: asyncio.Task[Failure | None]) -> None:
        handler = self._interruptible
        if handler is None or task.cancelled() or task.exception() is not None or task.result() is None:
            return
        self._interrupted = True
        handler.cancel()

    def _abort_attempt(self) -> None:
        """Close whatever the current attempt still has open (idempotent, synchronous).

        A cancelled task closes its connection when it next runs; closing a backend connection
        makes vLLM abort the request and free its KV blocks.
        """
        p_task = self.p_task
        if p_task is not None and not p_task.done():
            p_task.cancel()
            self.router.keep(p_task)
        if self.opened is not None:
            self.opened.close()
            self.opened = None
        self.p_task = None

    # -- answers -------------------------------------------------------------------------------

    def _error(self, error: RouterError) -> web.Response:
        self.status = error.status
        self.router.metrics.error(self.endpoint, error.error_type)
        logger.error("rid=%s room=%s answering HTTP %d: %s", self.rid, self.room, error.status, error.message)
        return error.to_response(self.out_headers)

    def _final_failure(self, failure: Failure) -> web.Response:
        self.status = failure.passthrough[0] if failure.passthrough else failure.error.status
        self.router.metrics.error(self.endpoint, failure.error.error_type)
        logger.error(
            "rid=%s room=%s answering HTTP %d after %d attempt(s): %s",
            self.rid,
            self.room,
            self.status,
            self.attempts,
            failure.error.message,
        )
        return failure.response(self.out_headers)

    def _detach_prefill(self) -> None:
        """D has answered: let a still-running P request end on its own, and log a failure."""
        p_task = self.p_task
        self.p_task = None
        if p_task is None or p_task.done():
            return
        self.router.keep(p_task)
        rid, room = self.rid, self.room

        def done(task: asyncio.Task[Failure | None]) -> None:
            if not task.cancelled() and task.exception() is None and task.result() is not None:
                logger.error(
                    "rid=%s room=%s prefill failed after D had answered: %s", rid, room, task.result().error.message
                )

        p_task.add_done_callback(done)

    async def _answer(self, outcome: _Opened | _Answered) -> web.StreamResponse:
        if isinstance(outcome, _Answered):
            self._detach_prefill()
            self.status = outcome.status
            self.ttfb = time.monotonic() - self.t0
            return passthrough_response(outcome.status, outcome.body, outcome.content_type, self.out_headers)
        return await self._relay(outcome)

    async def _relay(self, opened: _Opened) -> web.StreamResponse:
        """Send D's stream to the client unchanged; end it with an error event if P or D fails."""
        upstream = opened.response
        response = web.StreamResponse(
            status=upstream.status,
            headers={
                "Content-Type": upstream.content_type or "text/event-stream",
                "Cache-Control": "no-cache",
                "X-Request-Id": self.rid,
            },
        )
        self.status = upstream.status
        p_task = self.p_task
        if p_task is not None and not p_task.done():
            p_task.add_done_callback(self._on_late_prefill)
        failure: Failure | None = None
        timeout = self.router.config.request_timeout
        eof_sent = False
        chunk = opened.first
        try:
            await response.prepare(self.request)
            while True:
                if upstream.at_eof() and self.late_p_failure is None:
                    # The end of D's stream came with this chunk: send both in one write.
                    await response.write_eof(chunk)
                    eof_sent = True
                else:
                    await response.write(chunk)
                self._tail = (self._tail + chunk)[-64:]
                if self.ttfb is None:
                    self.ttfb = time.monotonic() - self.t0
                if eof_sent:
                    break
                try:
                    chunk = await upstream.next_chunk()
                except UpstreamError as exc:
                    failure = exception_failure(opened.lease.state, exc, timeout)
                    break
                if not chunk:
                    break
        except ConnectionResetError:
            raise asyncio.CancelledError from None  # the client went away
        if eof_sent:
            failure = None
        elif self.late_p_failure is not None:
            failure = self.late_p_failure
        if failure is None:
            self.stream_done = True
            upstream.release()
            opened.lease.release()
            self.opened = None
            self._detach_prefill()
        else:
            self.router.metrics.backend_error(self.endpoint, failure.state.backend, failure.kind)
            self.router.metrics.error(self.endpoint, failure.error.error_type)
            logger.error(
                "rid=%s room=%s stream cut after it started: %s; ending it with an error event",
                self.rid,
                self.room,
                failure.error.message,
            )
            self._abort_attempt()
            try:
                await response.write(failure.error.to_sse())
            except ConnectionResetError:
                raise asyncio.CancelledError from None
        if not eof_sent:
            try:
                await response.write_eof()
            except ConnectionResetError:
                raise asyncio.CancelledError from None
        return response

    def _on_late_prefill(self, task: asyncio.Task[Failure | None]) -> None:
        if self.stream_done or task.cancelled() or task.exception() is not None:
            return
        failure = task.result()
        if failure is not None and self.opened is not None:
            self.late_p_failure = failure
            self.opened.response.close()


def _request_id(request: web.Request) -> str:
    return request.headers.get("X-Request-Id", "").strip() or uuid.uuid4().hex


def _parse_address(text: str) -> tuple[str, int]:
    """``"host:port"`` or ``"[v6]:port"`` -> (host, port)."""
    host, sep, port = text.strip().rpartition(":")
    if not sep or not host or not port.isdigit():
        raise RouterError(400, f"instance {text!r} is not host:port", INVALID_REQUEST, "instances")
    return host.strip("[]"), int(port)


def _check_port(value: Any, field: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 65535:
        raise RouterError(400, f"'{field}' must be a port number in 1..65535, got {value!r}", INVALID_REQUEST, field)
    return value


def parse_instances(payload: Any) -> list[Backend]:
    """The instances named by an ``/instances/add`` or ``/instances/remove`` body.

    Either ``{"role": "prefill"|"decode", "host": H, "port": P, "bootstrap_port": B?}`` or
    vLLM-Ascend's ``{"type": "prefill"|"decode", "instances": ["H:P", ...] | "H:P"}`` (an item
    may also be an object with host, port and bootstrap_port). A prefiller's bootstrap port
    defaults to the top-level ``bootstrap_port``, else 18800; ``bootstrap_host`` and ``dp_rank``
    (see :class:`proxy.config.Backend`) may be given at the top level or per item.
    """
    if not isinstance(payload, dict):
        raise RouterError(400, "request body must be a JSON object", INVALID_REQUEST)
    role = payload.get("role", payload.get("type"))
    if role not in ROLES:
        raise RouterError(400, f"'role' must be 'prefill' or 'decode', got {role!r}", INVALID_REQUEST, "role")
    default_bootstrap = payload.get("bootstrap_port", DEFAULT_BOOTSTRAP_PORT)
    default_bootstrap_host = payload.get("bootstrap_host")
    default_dp_rank = payload.get("dp_rank")
    items = payload.get("instances")
    if items is None:
        items = [{"host": payload.get("host"), "port": payload.get("port"), "bootstrap_port": default_bootstrap}]
    elif isinstance(items, str):
        items = [items]
    if not isinstance(items, list) or not items:
        raise RouterError(400, "'instances' must be a non-empty list", INVALID_REQUEST, "instances")
    backends = []
    for item in items:
        if isinstance(item, str):
            host, port = _parse_address(item)
            bootstrap = default_bootstrap
            bootstrap_host, dp_rank = default_bootstrap_host, default_dp_rank
        elif isinstance(item, dict):
            host, port = item.get("host"), item.get("port")
            bootstrap = item.get("bootstrap_port", default_bootstrap)
            bootstrap_host = item.get("bootstrap_host", default_bootstrap_host)
            dp_rank = item.get("dp_rank", default_dp_rank)
        else:
            raise RouterError(400, f"instance {item!r} is not host:port or an object", INVALID_REQUEST, "instances")
        if not isinstance(host, str) or not host.strip():
            raise RouterError(400, f"'host' must be a non-empty string, got {host!r}", INVALID_REQUEST, "host")
        port = _check_port(port, "port")
        if role == "prefill":
            bootstrap = _check_port(bootstrap, "bootstrap_port")
            if bootstrap_host is not None and (not isinstance(bootstrap_host, str) or not bootstrap_host.strip()):
                raise RouterError(
                    400, f"'bootstrap_host' must be a non-empty string, got {bootstrap_host!r}", INVALID_REQUEST,
                    "bootstrap_host",
                )  # fmt: skip
            if dp_rank is not None and (isinstance(dp_rank, bool) or not isinstance(dp_rank, int) or dp_rank < 0):
                raise RouterError(
                    400, f"'dp_rank' must be an integer >= 0, got {dp_rank!r}", INVALID_REQUEST, "dp_rank"
                )  # fmt: skip
            backends.append(
                Backend(
                    "prefill",
                    host.strip(),
                    port,
                    bootstrap,
                    bootstrap_host.strip() if bootstrap_host else None,
                    dp_rank,
                )
            )
        else:
            backends.append(Backend("decode", host.strip(), port))
    return backends


def create_app(config: RouterConfig) -> web.Application:
    """Build the Router application for ``config`` (run it with handler cancellation on)."""
    router = Router(config)
    app = web.Application(client_max_size=config.max_body_size)
    app[ROUTER_KEY] = router
    app.on_startup.append(router.startup)
    app.on_cleanup.append(router.cleanup)

    def guarded(
        handler: Callable[[web.Request], Awaitable[web.StreamResponse]],
    ) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
        async def run(request: web.Request) -> web.StreamResponse:
            try:
                return await handler(request)
            except RouterError as error:
                return error.to_response({"X-Request-Id": _request_id(request)})
            except Exception as exc:
                logger.exception("unexpected error serving %s %s", request.method, request.path)
                return error_response(500, f"internal Router error: {type(exc).__name__}", INTERNAL_ERROR)

        return run

    async def completions(request: web.Request) -> web.StreamResponse:
        return await router.generate(request, COMPLETIONS)

    async def chat_completions(request: web.Request) -> web.StreamResponse:
        return await router.generate(request, CHAT_COMPLETIONS)

    async def models(request: web.Request) -> web.StreamResponse:
        rid = _request_id(request)
        headers = {"X-Request-Id": rid}
        if auth := request.headers.get("Authorization") or config.backend_authorization:
            headers["Authorization"] = auth
        decoders = sorted(router.pool.active["decode"], key=lambda s: not s.healthy)
        last: Failure | None = None
        timeout = aiohttp.ClientTimeout(total=config.request_timeout, sock_connect=config.connect_timeout)
        for state in decoders:
            try:
                async with router.session.get(
                    state.backend.base_url + "/v1/models", headers=headers, timeout=timeout
                ) as response:
                    content = await response.read()
                    content_type = response.headers.get("Content-Type", "application/json")
                    status = response.status
            except _TRANSPORT_ERRORS as exc:
                last = exception_failure(state, exc, config.request_timeout)
                if last.kind == "connect":
                    router.pool.mark_unhealthy(state, last.error.message)
                logger.warning("rid=%s GET /v1/models: %s", rid, last.error.message)
                continue
            if status >= 500:
                last = http_failure(state, status, content, content_type)
                continue
            return passthrough_response(status, content, content_type, {"X-Request-Id": rid})
        if last is None:
            return error_response(503, "no decode instance is available", UPSTREAM_UNAVAILABLE, {"X-Request-Id": rid})
        return last.response({"X-Request-Id": rid})

    async def health(_request: web.Request) -> web.StreamResponse:
        await check_all(router.session, router.pool, config.health_timeout)
        healthy, body = pool_health(router.pool)
        body["routing"] = config.routing
        if not healthy:
            logger.warning("health: unhealthy: %s", json.dumps(body))
        return json_response(body, 200 if healthy else 503)

    async def healthcheck(_request: web.Request) -> web.StreamResponse:
        # vLLM-Ascend proxy's summary.
        pool = router.pool
        in_flight = sum(s.in_flight for s in pool.active["decode"]) + sum(s.in_flight for s in pool.draining.values())
        return json_response(
            {
                "status": "ok",
                "prefill_instances": len(pool.active["prefill"]),
                "decode_instances": len(pool.active["decode"]),
                "request_num": in_flight,
            }
        )

    async def metrics(_request: web.Request) -> web.StreamResponse:
        return web.Response(body=router.metrics.render(), headers={"Content-Type": METRICS_CONTENT_TYPE})

    async def list_instances(_request: web.Request) -> web.StreamResponse:
        return json_response(router.instances())

    async def _instances_body(request: web.Request) -> Any:
        raw = await _read_body(request, config.max_body_size)
        try:
            return json.loads(raw)
        except ValueError as exc:
            raise RouterError(400, f"request body is not valid JSON: {exc}", INVALID_REQUEST) from None

    async def add_instances(request: web.Request) -> web.StreamResponse:
        backends = parse_instances(await _instances_body(request))
        results = await asyncio.gather(*(router.add_instance(b) for b in backends))
        done = [
            {"role": b.role, "host": b.host, "port": b.port, "result": r}
            for b, r in zip(backends, results, strict=True)
        ]
        logger.info("instances/add: %s", ", ".join(f"{b.name}: {r}" for b, r in zip(backends, results, strict=True)))
        status = 202 if any(r == "waiting" for r in results) else 200
        message = "; ".join(f"{b.name}: {r}" for b, r in zip(backends, results, strict=True))
        return json_response({"message": message, "results": done, **router.instances()}, status)

    async def remove_instances(request: web.Request) -> web.StreamResponse:
        backends = parse_instances(await _instances_body(request))
        unknown = [
            b for b in backends if router.pool.find(b.role, b.host, b.port) is None and b.key not in router.waiting
        ]
        if unknown:
            names = ", ".join(b.name for b in unknown)
            raise RouterError(404, f"unknown instance(s): {names}", NOT_FOUND, "instances")
        results = [router.remove_instance(b.role, b.host, b.port) for b in backends]
        done = [
            {"role": b.role, "host": b.host, "port": b.port, "result": r}
            for b, r in zip(backends, results, strict=True)
        ]
        logger.info("instances/remove: %s", ", ".join(f"{b.name}: {r}" for b, r in zip(backends, results, strict=True)))
        message = "; ".join(f"{b.name}: {r}" for b, r in zip(backends, results, strict=True))
        return json_response({"message": message, "results": done, **router.instances()})

    async def reset_prefix_cache(request: web.Request) -> web.StreamResponse:
        states = [*router.pool.active["prefill"], *router.pool.active["decode"]]
        timeout = aiohttp.ClientTimeout(total=config.request_timeout, sock_connect=config.connect_timeout)

        async def one(state: BackendState) -> str | None:
            try:
                async with router.session.post(
                    state.backend.base_url + "/reset_prefix_cache", params=request.query, timeout=timeout
                ) as response:
                    await response.read()
                    return None if response.status < 300 else f"{state.backend.base_url}: HTTP {response.status}"
            except _TRANSPORT_ERRORS as exc:
                return f"{state.backend.base_url}: {describe_exception(exc)}"

        failed = [f for f in await asyncio.gather(*(one(s) for s in states)) if f is not None]
        if failed:
            return json_response({"failed": failed}, 500)
        return web.Response(status=200)

    known_paths = {
        COMPLETIONS,
        CHAT_COMPLETIONS,
        "/v1/models",
        "/health",
        "/healthcheck",
        "/metrics",
        "/instances",
        "/instances/add",
        "/instances/remove",
        "/reset_prefix_cache",
    }

    async def fallback(request: web.Request) -> web.StreamResponse:
        if request.path in known_paths:
            return error_response(405, f"method {request.method} is not allowed on {request.path}", INVALID_REQUEST)
        return error_response(404, f"no route {request.method} {request.path}", NOT_FOUND)

    app.router.add_post(COMPLETIONS, guarded(completions))
    app.router.add_post(CHAT_COMPLETIONS, guarded(chat_completions))
    app.router.add_get("/v1/models", guarded(models))
    app.router.add_get("/health", guarded(health))
    app.router.add_get("/healthcheck", guarded(healthcheck))
    app.router.add_get("/metrics", guarded(metrics))
    app.router.add_get("/instances", guarded(list_instances))
    app.router.add_post("/instances/add", guarded(add_instances))
    app.router.add_post("/instances/remove", guarded(remove_instances))
    app.router.add_post("/reset_prefix_cache", guarded(reset_prefix_cache))
    app.router.add_route("*", "/{tail:.*}", fallback)
    return app


def router_of(app: web.Application) -> Router:
    """The :class:`Router` state of an application made by :func:`create_app`."""
    return app[ROUTER_KEY]
