"""The Router's FastAPI application: ``create_app(config)``.

Request lifecycle (DESIGN.md §3): a completion or chat request gets a bootstrap room, one
prefill instance P and one decode instance D; both requests are sent at once; D's answer
(JSON or SSE stream) goes back to the client. If either side fails, the other side's HTTP
request is closed (vLLM aborts a request whose connection closes, which frees its KV
blocks) and the client gets an OpenAI-style error: never an empty 200, never a hang.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from contextlib import asynccontextmanager, suppress
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from proxy.backends import BackendPool, pool_health
from proxy.config import Backend, RouterConfig
from proxy.errors import DECODE_FAILED, INVALID_REQUEST, RouterError, error_response, excerpt
from proxy.payloads import decode_body, prefill_body, resolve_room, wants_stream
from proxy.upstream import RequestLog, Upstream, classify, logger, make_client

#: How long the Router waits for an aborted backend request to close before answering.
ABORT_WAIT_S = 2.0
#: Status recorded (nginx convention) when the client went away before an answer.
CLIENT_CLOSED_REQUEST = 499


class RouterState:
    """Per-application state: configuration, backends, the shared HTTP client, background tasks."""

    def __init__(self, config: RouterConfig) -> None:
        self.config = config
        self.pool = BackendPool.from_config(config)
        self._client: httpx.AsyncClient | None = None
        self._upstream: Upstream | None = None
        self._background: set[asyncio.Task[Any]] = set()

    @property
    def client(self) -> httpx.AsyncClient:
        """The shared HTTP client (exists while the application is running)."""
        if self._client is None:
            raise RuntimeError("the Router's HTTP client is not started (use the app's lifespan)")
        return self._client

    @property
    def upstream(self) -> Upstream:
        """Backend caller bound to the shared client."""
        if self._upstream is None:
            raise RuntimeError("the Router's HTTP client is not started (use the app's lifespan)")
        return self._upstream

    @asynccontextmanager
    async def running(self) -> AsyncIterator[None]:
        """Open the shared client for the application's lifetime; cancel leftovers at shutdown."""
        async with make_client(self.config) as client:
            self._client = client
            self._upstream = Upstream(client, self.config)
            try:
                yield
            finally:
                for task in list(self._background):
                    task.cancel()
                if self._background:
                    await asyncio.wait(self._background, timeout=ABORT_WAIT_S)
                self._client = None
                self._upstream = None

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
        """Run ``coro`` as a task the application keeps a reference to until it ends."""
        task = asyncio.create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return task

    async def abort(self, task: asyncio.Task[Any]) -> None:
        """Cancel a backend request task and close whatever it produced.

        Cancelling an in-flight ``httpx`` request closes its connection, which makes vLLM
        abort the request. The closing runs in a background task, so it completes even if
        the caller is itself being cancelled; the caller waits for it (bounded) otherwise.
        """
        if not task.done():
            task.cancel()
        await asyncio.shield(self.spawn(self._reap(task)))

    async def close_response(self, response: httpx.Response) -> None:
        """Close an open (streamed) backend response; completes even if the caller is cancelled."""
        if not response.is_closed:
            await asyncio.shield(self.spawn(response.aclose()))

    async def _reap(self, task: asyncio.Task[Any]) -> None:
        await asyncio.wait({task}, timeout=ABORT_WAIT_S)
        if not task.done():
            task.add_done_callback(lambda t: self.spawn(self._reap(t)))
            return
        if task.cancelled() or task.exception() is not None:
            return
        result = task.result()
        if isinstance(result, httpx.Response) and not result.is_closed:
            await result.aclose()

    def detach_prefill(self, task: asyncio.Task[RouterError | None], log: RequestLog) -> None:
        """Let a still-running prefill request finish on its own; log its outcome.

        Used once D has answered successfully: P's result no longer changes the answer.
        """
        self._background.add(task)

        def done(t: asyncio.Task[RouterError | None]) -> None:
            self._background.discard(t)
            if t.cancelled():
                return
            exc = t.exception()
            if exc is not None:
                log.error("prefill request raised after the answer was sent: %r", exc)
            elif t.result() is not None:
                log.error("prefill failed after D had answered (D's answer was returned): %s", t.result())

        task.add_done_callback(done)


class RelayStreamingResponse(StreamingResponse):
    """A ``StreamingResponse`` that always runs ``on_close`` when it ends, however it ends."""

    def __init__(
        self,
        content: AsyncIterator[bytes],
        *,
        on_close: Callable[[], Awaitable[None]],
        status_code: int,
        headers: dict[str, str],
        media_type: str,
    ) -> None:
        super().__init__(content, status_code=status_code, headers=headers, media_type=media_type)
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                with suppress(RuntimeError):
                    await aclose()
            await self._on_close()


async def _wait_for_disconnect(request: Request) -> None:
    """Return when the client closes its connection (the request body was already read)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def _next_chunk(chunks: AsyncIterator[bytes]) -> bytes | None:
    """Next chunk of a backend stream, or ``None`` at its end."""
    try:
        return await anext(chunks)
    except StopAsyncIteration:
        return None


class Relay:
    """One client request in flight: the P and D tasks, and who owns (must close) them."""

    def __init__(
        self,
        state: RouterState,
        log: RequestLog,
        out_headers: dict[str, str],
        decoder: Backend,
        p_task: asyncio.Task[RouterError | None],
        d_task: asyncio.Task[httpx.Response | RouterError],
        disconnect: asyncio.Task[None],
        deadline: float,
    ) -> None:
        self.state = state
        self.log = log
        self.out_headers = out_headers
        self.decoder = decoder
        self.p_task = p_task
        self.d_task = d_task
        self.disconnect = disconnect
        self.deadline = deadline
        # Which tasks this object still has to abort in cleanup(); ownership moves to the
        # stream generator (or to a background logger) when the answer is handed off.
        self.owns_p = True
        self.owns_d = True
        self.d_response: httpx.Response | None = None
        self._chunk_task: asyncio.Task[bytes | None] | None = None
        self._stream_closed = False
        self._stream_complete = False
        self._p_checked = False

    # -- helpers -------------------------------------------------------------------------

    def _prefill_error(self) -> RouterError | None:
        """P's error if P has finished with one."""
        if self.p_task.done() and not self.p_task.cancelled():
            return self.p_task.result()
        return None

    def _client_gone(self) -> Response:
        self.log.warning("client disconnected before the answer; closing the backend requests")
        return Response(status_code=CLIENT_CLOSED_REQUEST, headers=self.out_headers)

    def _fail(self, error: RouterError) -> Response:
        self.log.error("answering HTTP %d: %s", error.status, error.message)
        return error.to_response(self.out_headers)

    def _passthrough(self, response: httpx.Response, content: bytes) -> Response:
        return Response(
            content=content,
            status_code=response.status_code,
            headers=self.out_headers,
            media_type=response.headers.get("content-type", "application/json"),
        )

    def _time_left(self) -> float:
        return max(0.0, self.deadline - asyncio.get_running_loop().time())

    async def cleanup(self) -> None:
        """Abort whatever this object still owns (called when the handler returns or fails)."""
        self.disconnect.cancel()
        if self.owns_p:
            self.owns_p = False
            await self.state.abort(self.p_task)
        if self.owns_d:
            self.owns_d = False
            if self._chunk_task is not None:
                self._chunk_task.cancel()
            await self.state.abort(self.d_task)
            if self.d_response is not None:
                await self.state.close_response(self.d_response)

    # -- phase 1: until D has answered (status and headers) --------------------------------

    async def _until_decoder_answers(self) -> Response | httpx.Response:
        """Race P, D and the client. Returns D's 2xx response, or the final response to send."""
        while True:
            waiting: set[asyncio.Future[Any]] = {self.d_task, self.disconnect}
            if not self.p_task.done():
                waiting.add(self.p_task)
            await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
            if self.disconnect.done():
                return self._client_gone()
            if self.d_task.done():
                result = self.d_task.result()
                if isinstance(result, httpx.Response) and result.is_success:
                    return result
                if isinstance(result, httpx.Response):
                    self.d_response = result
                # D failed. If P failed too, P's error is the cause (D waits for P's KV).
                p_error = self._prefill_error()
                if p_error is not None:
                    return self._fail(p_error)
                if isinstance(result, RouterError):
                    return self._fail(result)
                return await self._decoder_error(result)
            p_error = self._prefill_error()
            if p_error is not None:
                return self._fail(p_error)
            # P finished fine; keep waiting for D.

    async def _decoder_error(self, response: httpx.Response) -> Response:
        """Pass D's non-2xx status and body through to the client."""
        try:
            async with asyncio.timeout(min(self._time_left(), 30.0)):
                content = await response.aread()
        except (httpx.HTTPError, TimeoutError) as exc:
            return self._fail(classify(exc, self.decoder, self.state.config.request_timeout))
        self.log.warning(
            "%s answered HTTP %d; passing it through: %s",
            self.decoder.name,
            response.status_code,
            excerpt(content),
        )
        return self._passthrough(response, content)

    # -- non-streaming -----------------------------------------------------------------------

    async def answer_json(self) -> Response:
        """Return D's whole answer (the client did not ask for a stream)."""
        outcome = await self._until_decoder_answers()
        if isinstance(outcome, Response):
            return outcome
        content = outcome.content
        if not content:
            return self._fail(
                RouterError(
                    502, f"{self.decoder.name} answered HTTP {outcome.status_code} with an empty body", DECODE_FAILED
                )
            )
        if not self.p_task.done():
            self.owns_p = False
            self.log.info("D answered before P's response; returning D's answer, P finishes in the background")
            self.state.detach_prefill(self.p_task, self.log)
        self.log.info("answered HTTP %d (%d bytes)", outcome.status_code, len(content))
        return self._passthrough(outcome, content)

    # -- streaming ---------------------------------------------------------------------------

    async def answer_stream(self) -> Response:
        """Relay D's SSE stream, once D answered 2xx and either P succeeded or D's first bytes came."""
        outcome = await self._until_decoder_answers()
        if isinstance(outcome, Response):
            return outcome
        self.d_response = outcome
        chunks = outcome.aiter_bytes()
        self._chunk_task = asyncio.create_task(_next_chunk(chunks))
        # Hold the status line back until P succeeded or D sent data: if P fails first the
        # client still gets a real HTTP error instead of a 200 stream that ends in an error.
        while True:
            waiting: set[asyncio.Future[Any]] = {self._chunk_task, self.disconnect}
            if not self.p_task.done():
                waiting.add(self.p_task)
            done, _ = await asyncio.wait(waiting, timeout=self._time_left(), return_when=asyncio.FIRST_COMPLETED)
            if self.disconnect.done():
                return self._client_gone()
            if not done:
                return self._fail(
                    RouterError(504, f"{self.decoder.name} sent no data within the request timeout", DECODE_FAILED)
                )
            p_error = self._prefill_error()
            if p_error is not None:
                return self._fail(p_error)
            if self._chunk_task.done() or self.p_task.done():
                break
        # P's outcome was examined (and was a success) iff P is done by now.
        self._p_checked = self.p_task.done()
        if self._chunk_task.done():
            exc = self._chunk_task.exception()
            if exc is not None:
                return self._fail(classify(exc, self.decoder, self.state.config.request_timeout))
            if self._chunk_task.result() is None:
                p_error = self._prefill_error()
                return self._fail(
                    p_error
                    or RouterError(502, f"{self.decoder.name} ended its stream without sending any data", DECODE_FAILED)
                )
        # Hand the backend requests over to the stream generator / its on_close.
        self.owns_p = False
        self.owns_d = False
        self.log.info("streaming %s's answer (HTTP %d)", self.decoder.name, outcome.status_code)
        return RelayStreamingResponse(
            self._relay_chunks(chunks),
            on_close=self._close_stream,
            status_code=outcome.status_code,
            headers=self.out_headers,
            media_type=outcome.headers.get("content-type", "text/event-stream"),
        )

    async def _relay_chunks(self, chunks: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
        """Yield D's bytes unchanged; end with an SSE error event if P or D fails mid-stream."""
        assert self._chunk_task is not None
        sent = 0
        p_pending = not self._p_checked
        try:
            while True:
                chunk_task = self._chunk_task
                waiting: set[asyncio.Future[Any]] = {chunk_task}
                if p_pending:
                    waiting.add(self.p_task)
                done, _ = await asyncio.wait(waiting, timeout=self._time_left(), return_when=asyncio.FIRST_COMPLETED)
                if not done:
                    error = RouterError(
                        504, f"{self.decoder.name}'s stream did not finish within the request timeout", DECODE_FAILED
                    )
                    self.log.error("stream cut after %d bytes: %s", sent, error.message)
                    yield error.to_sse()
                    return
                if p_pending and self.p_task.done():
                    p_pending = False
                    self._p_checked = True
                    p_error = self._prefill_error()
                    if p_error is not None:
                        if chunk_task.done() and chunk_task.exception() is None:
                            yield chunk_task.result() or b""
                        self.log.error(
                            "prefill failed after %d bytes of D's stream were sent; ending the stream with an "
                            "error event: %s",
                            sent,
                            p_error.message,
                        )
                        yield p_error.to_sse()
                        return
                if not chunk_task.done():
                    continue
                exc = chunk_task.exception()
                if exc is not None:
                    error = classify(exc, self.decoder, self.state.config.request_timeout)
                    self.log.error("D's stream broke after %d bytes: %s", sent, error.message)
                    yield error.to_sse()
                    return
                chunk = chunk_task.result()
                if chunk is None:
                    self._stream_complete = True
                    self.log.info("stream finished (%d bytes)", sent)
                    return
                sent += len(chunk)
                yield chunk
                self._chunk_task = asyncio.create_task(_next_chunk(chunks))
        finally:
            await self._close_stream()

    async def _close_stream(self) -> None:
        """Close D's stream and P's request (idempotent). Synchronous cancels come first."""
        if self._stream_closed:
            return
        self._stream_closed = True
        if self._chunk_task is not None and not self._chunk_task.done():
            self._chunk_task.cancel()
        if not self._stream_complete:
            self.log.warning("stream closed before D finished (client gone or error); closing backend requests")
        p_running = not self.p_task.done()
        if p_running and self._stream_complete:
            self.state.detach_prefill(self.p_task, self.log)
        elif p_running:
            self.p_task.cancel()
        if self.d_response is not None:
            await self.state.close_response(self.d_response)
        if p_running and not self._stream_complete:
            await self.state.abort(self.p_task)


async def _generate(state: RouterState, request: Request, path: str) -> Response:
    """Serve ``POST /v1/completions`` and ``POST /v1/chat/completions``."""
    rid = (request.headers.get("x-request-id") or "").strip() or uuid.uuid4().hex
    out_headers = {"X-Request-Id": rid}
    raw = await request.body()
    try:
        body = json.loads(raw)
    except ValueError as exc:
        RequestLog(logger, {"room": None, "rid": rid}).warning("rejected %s: invalid JSON (%s)", path, exc)
        return error_response(400, f"request body is not valid JSON: {exc}", INVALID_REQUEST, out_headers)
    if not isinstance(body, dict):
        RequestLog(logger, {"room": None, "rid": rid}).warning("rejected %s: body is not a JSON object", path)
        return error_response(400, "request body must be a JSON object", INVALID_REQUEST, out_headers)
    try:
        room = resolve_room(body)
    except RouterError as error:
        RequestLog(logger, {"room": None, "rid": rid}).warning("rejected %s: %s", path, error.message)
        return error.to_response(out_headers)

    log = RequestLog(logger, {"room": room, "rid": rid})
    prefiller, decoder = state.pool.select(room)
    stream = wants_stream(body)
    forward = {"X-Request-Id": rid}
    if auth := request.headers.get("authorization"):
        forward["Authorization"] = auth
    deadline = asyncio.get_running_loop().time() + state.config.request_timeout
    log.info("POST %s stream=%s -> P %s, D %s", path, stream, prefiller.name, decoder.name)

    upstream = state.upstream
    p_task = asyncio.create_task(
        upstream.prefill(prefiller, path, prefill_body(body, room), forward, log, deadline=deadline)
    )
    d_task = asyncio.create_task(
        upstream.decode(
            decoder, path, decode_body(body, room, prefiller), forward, log, stream=stream, deadline=deadline
        )
    )
    disconnect = asyncio.create_task(_wait_for_disconnect(request))
    relay = Relay(state, log, out_headers, decoder, p_task, d_task, disconnect, deadline)
    try:
        return await (relay.answer_stream() if stream else relay.answer_json())
    finally:
        await relay.cleanup()


def create_app(config: RouterConfig) -> FastAPI:
    """Build the Router application for ``config``."""
    state = RouterState(config)

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        async with state.running():
            yield

    app = FastAPI(
        title="PDConnector Router",
        lifespan=lifespan,
        docs_url=None,
        redoc_url=None,
        openapi_url=None,
    )
    app.state.router_state = state

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unexpected error serving %s %s", request.method, request.url.path, exc_info=exc)
        return error_response(500, f"internal Router error: {type(exc).__name__}", "internal_error")

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await _generate(state, request, "/v1/completions")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await _generate(state, request, "/v1/chat/completions")

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        rid = (request.headers.get("x-request-id") or "").strip() or uuid.uuid4().hex
        out_headers = {"X-Request-Id": rid}
        forward = {"X-Request-Id": rid}
        if auth := request.headers.get("authorization"):
            forward["Authorization"] = auth
        log = RequestLog(logger, {"room": None, "rid": rid})
        last_error: RouterError | None = None
        for decoder in state.pool.decoders:
            result = await state.upstream.get(decoder, "/v1/models", forward, log)
            if isinstance(result, RouterError):
                log.warning("GET /v1/models: %s", result.message)
                last_error = result
                continue
            return Response(
                content=result.content,
                status_code=result.status_code,
                headers=out_headers,
                media_type=result.headers.get("content-type", "application/json"),
            )
        assert last_error is not None
        return last_error.to_response(out_headers)

    @app.get("/health")
    async def health() -> JSONResponse:
        healthy, body = await pool_health(state.client, state.pool, config.health_timeout)
        if not healthy:
            logger.warning("health: unhealthy: %s", json.dumps(body))
        return JSONResponse(body, status_code=200 if healthy else 503)

    return app
