"""A small, fast HTTP/1.1 client: every call the Router makes to a backend goes through it.

The P and D generation requests, health checks, ``/v1/models`` and ``/reset_prefix_cache``.
Why not ``aiohttp``'s or ``httpx``'s client: measured here, one P + D request pair through
``aiohttp.ClientSession`` cost about 0.6 ms against a local backend, the same pair over raw
asyncio protocols about 0.2 ms, and the Router's added latency is mostly that. This client does
only what the Router needs: ``GET`` or ``POST`` (a complete JSON body, or none), keep-alive
connections pooled per backend, responses parsed by ``httptools`` (the C parser uvicorn uses),
the body read whole or chunk by chunk (chunked transfer decoding
included), one deadline per request, and an abort that closes the connection (which makes vLLM
abort the request and free its KV blocks). A connection is :class:`ConnState` ``IDLE`` (pooled),
``BUSY`` (carrying one request) or ``CLOSED`` (never used again).

Errors are :class:`UpstreamError` subclasses: :class:`ConnectFailed` (the connection could not
be opened: the backend never saw the request), :class:`ConnectionBroken` (it closed or sent an
invalid response) and :class:`UpstreamTimeout` (the request's deadline passed).
"""

from __future__ import annotations

import asyncio
import collections
import enum
import json
import ssl
import time
from typing import Any

import httptools
import msgspec

#: Idle connections older than this are not reused (below uvicorn's 5 s keep-alive, which vLLM
#: uses, so a request is never written onto a connection the backend is just closing).
KEEPALIVE_S = 4.0
#: Idle connections kept per backend.
MAX_IDLE_PER_BACKEND = 512
#: A response buffering more unread bytes than this stops reading its connection until the
#: reader catches up (a slow client slows the backend down instead of filling memory).
READ_HIGH_WATER = 1 << 20


#: Request-line-and-Host prefixes kept (one per method, backend and path).
MAX_CACHED_HEADS = 1024
_ENCODER = msgspec.json.Encoder()


def encode_json(value: Any) -> bytes:
    """``value`` as compact UTF-8 JSON: msgspec's encoder (several times faster than ``json``),
    ``json`` for what msgspec refuses (integers beyond 64 bits)."""
    try:
        return _ENCODER.encode(value)
    except (TypeError, OverflowError, msgspec.EncodeError):
        return json.dumps(value, ensure_ascii=False).encode()


class ConnState(enum.Enum):
    """Where a pooled connection stands."""

    IDLE = "idle"  # open, in the pool, no request
    BUSY = "busy"  # carrying a request, until its response is released or closed
    CLOSED = "closed"  # aborted or lost: never reused


class UpstreamError(Exception):
    """A request to a backend failed at the transport level."""


class ConnectFailed(UpstreamError):
    """The connection could not be opened (refused, unreachable, connect timeout)."""


class ConnectionBroken(UpstreamError):
    """The connection closed, or the backend sent something that is not HTTP/1.1, mid-request."""


class UpstreamTimeout(UpstreamError, TimeoutError):
    """The request's deadline passed."""


def _clean(value: str) -> str:
    """A header value safe to write (no CR/LF)."""
    if "\r" in value or "\n" in value:
        return value.replace("\r", " ").replace("\n", " ")
    return value


class Response:
    """A backend's response: status and headers at once, the body read whole or chunk by chunk."""

    __slots__ = (
        "status", "headers", "_conn", "_chunks", "_buffered", "_paused", "_waiter", "_eof", "_error", "_timer", "_done",
    )  # fmt: skip

    def __init__(self, conn: _Connection, status: int, headers: dict[str, str]) -> None:
        self.status = status
        #: Response headers, names lower-cased (a repeated header keeps its last value).
        self.headers = headers
        self._conn: _Connection | None = conn
        self._chunks: collections.deque[bytes] = collections.deque()
        self._buffered = 0
        self._paused = False
        self._waiter: asyncio.Future[None] | None = None
        self._eof = False
        self._error: UpstreamError | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._done = False

    @property
    def content_type(self) -> str:
        return self.headers.get("content-type", "")

    def at_eof(self) -> bool:
        """True once the whole body arrived and was read."""
        return self._eof and not self._chunks

    # -- fed by the connection -------------------------------------------------------------

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None:
            self._waiter = None
            if not waiter.done():
                waiter.set_result(None)

    def _feed(self, data: bytes) -> None:
        self._chunks.append(data)
        self._buffered += len(data)
        if self._buffered > READ_HIGH_WATER and not self._paused and self._conn is not None:
            self._paused = True
            self._conn.transport.pause_reading()
        self._wake()

    def _take(self) -> bytes:
        chunks = self._chunks
        data = chunks.popleft() if len(chunks) == 1 else b"".join(chunks)
        chunks.clear()
        self._buffered = 0
        if self._paused and self._conn is not None:
            self._paused = False
            self._conn.transport.resume_reading()
        return data

    def _feed_eof(self) -> None:
        self._eof = True
        self._cancel_timer()
        self._wake()

    def _fail(self, error: UpstreamError) -> None:
        if self._eof or self._error is not None:
            return
        self._error = error
        self._cancel_timer()
        self._wake()

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    # -- reading ---------------------------------------------------------------------------

    async def next_chunk(self) -> bytes:
        """Everything received since the last call (at least one byte), or ``b""`` at the end.

        Raises :class:`UpstreamError` if the connection breaks or the deadline passes first.
        """
        while True:
            if self._chunks:
                return self._take()
            if self._eof:
                return b""
            if self._error is not None:
                raise self._error
            if self._conn is None:
                raise ConnectionBroken("the response was closed")
            self._waiter = asyncio.get_running_loop().create_future()
            await self._waiter

    async def read(self) -> bytes:
        """The whole (remaining) body."""
        parts = []
        while chunk := await self.next_chunk():
            parts.append(chunk)
        return b"".join(parts)

    # -- ending ----------------------------------------------------------------------------

    def release(self) -> None:
        """Done with the response: its connection goes back to the pool if the body ended cleanly,
        else it is closed. Idempotent."""
        if self._done:
            return
        self._done = True
        self._cancel_timer()
        conn, self._conn = self._conn, None
        if conn is not None:
            if self._paused:
                self._paused = False
                conn.transport.resume_reading()
            conn.finish(reuse=self._eof and self._error is None)

    def close(self) -> None:
        """Abort: close the connection (the backend sees the client go away). Idempotent."""
        if self._done:
            return
        self._done = True
        self._cancel_timer()
        conn, self._conn = self._conn, None
        if not self._eof and self._error is None:
            self._error = ConnectionBroken("the response was closed")
        self._wake()
        if conn is not None:
            conn.finish(reuse=False)


class _Connection(asyncio.Protocol):
    """One keep-alive connection to a backend; carries one request at a time."""

    def __init__(self, pool: Http1Pool, key: tuple[str, int]) -> None:
        self.pool = pool
        self.key = key
        #: Opened for a request: busy from the start.
        self.state = ConnState.BUSY
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.response: Response | None = None
        self.headers_waiter: asyncio.Future[Response] | None = None
        self._headers: dict[str, str] = {}
        #: The current response's body ends when the connection closes (no length, not chunked).
        self._until_close = False
        self.keep_alive = True
        self.message_complete = False
        self.idle_since = 0.0

    # -- asyncio protocol ------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        if self.headers_waiter is None and self.response is None:
            self.abort()  # bytes nobody asked for: this connection cannot be trusted any more
            return
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._broken(ConnectionBroken(f"invalid HTTP response from {self.key[0]}:{self.key[1]}: {exc}"))
            self.abort()

    def eof_received(self) -> bool | None:
        return None  # close the transport; connection_lost reports it

    def connection_lost(self, exc: Exception | None) -> None:
        self.state = ConnState.CLOSED
        if self._until_close and exc is None and self.response is not None and not self.message_complete:
            self.keep_alive = False
            self.response._feed_eof()  # the close is the end of this body
            return
        detail = f": {exc}" if exc else ""
        self._broken(ConnectionBroken(f"connection to {self.key[0]}:{self.key[1]} closed{detail}"))

    # -- httptools callbacks ----------------------------------------------------------------

    def on_message_begin(self) -> None:
        self._headers = {}
        self.message_complete = False

    def on_header(self, name: bytes, value: bytes) -> None:
        self._headers[name.decode("latin-1").lower()] = value.decode("latin-1")

    def on_headers_complete(self) -> None:
        self.keep_alive = self.parser.should_keep_alive()
        status = self.parser.get_status_code()
        headers = self._headers
        self._until_close = (
            "content-length" not in headers
            and "transfer-encoding" not in headers
            and status not in (204, 304)
            and status >= 200
        )
        response = Response(self, status, headers)
        self.response = response
        waiter = self.headers_waiter
        self.headers_waiter = None
        if waiter is not None and not waiter.done():
            waiter.set_result(response)

    def on_body(self, body: bytes) -> None:
        if self.response is not None:
            self.response._feed(body)

    def on_message_complete(self) -> None:
        self.message_complete = True
        if self.response is not None:
            self.response._feed_eof()

    # -- requests ------------------------------------------------------------------------------

    def _broken(self, error: UpstreamError) -> None:
        waiter = self.headers_waiter
        self.headers_waiter = None
        if waiter is not None and not waiter.done():
            waiter.set_exception(error)
        if self.response is not None:
            self.response._fail(error)

    def abort(self) -> None:
        self.state = ConnState.CLOSED
        if self.transport is not None:
            self.transport.abort()

    def finish(self, reuse: bool) -> None:
        """The current request is over: pool the connection if it is clean, else close it."""
        self.response = None
        reusable = self.state is ConnState.BUSY and self.keep_alive and self.message_complete
        if reuse and reusable and not self.transport.is_closing():
            self.pool._put(self)
        else:
            self.abort()


class Http1Pool:
    """Keep-alive connections to the backends, and the requests sent over them."""

    def __init__(
        self, connect_timeout: float, keepalive_s: float = KEEPALIVE_S, ssl_context: ssl.SSLContext | None = None
    ) -> None:
        self.connect_timeout = connect_timeout
        #: HTTPS to every backend when set (``--backend-ssl``).
        self.ssl_context = ssl_context
        self.keepalive_s = keepalive_s
        self._idle: dict[tuple[str, int], list[_Connection]] = {}
        self._heads: dict[tuple[str, str, int, str], str] = {}
        self._closed = False

    def _put(self, conn: _Connection) -> None:
        idle = self._idle.setdefault(conn.key, [])
        if self._closed or len(idle) >= MAX_IDLE_PER_BACKEND:
            conn.abort()
            return
        conn.state = ConnState.IDLE
        conn.idle_since = time.monotonic()
        idle.append(conn)

    async def _connection(self, host: str, port: int, timeout: float) -> _Connection:
        key = (host, port)
        idle = self._idle.get(key)
        if idle:
            now = time.monotonic()
            while idle:
                conn = idle.pop()
                if conn.state is ConnState.IDLE and not conn.transport.is_closing():
                    if now - conn.idle_since < self.keepalive_s:
                        conn.state = ConnState.BUSY
                        return conn
                conn.abort()
        loop = asyncio.get_running_loop()
        timeout = min(self.connect_timeout, timeout)
        try:
            async with asyncio.timeout(timeout):
                _, conn = await loop.create_connection(lambda: _Connection(self, key), host, port, ssl=self.ssl_context)
        except TimeoutError:
            raise ConnectFailed(f"connect to {host}:{port} timed out after {timeout:g}s") from None
        except OSError as exc:
            raise ConnectFailed(f"cannot connect to {host}:{port}: {exc.strerror or exc}") from None
        return conn

    async def post(
        self, host: str, port: int, path: str, body: bytes, headers: dict[str, str], timeout: float
    ) -> Response:
        """``POST`` a JSON ``body`` (see :meth:`request`)."""
        return await self.request("POST", host, port, path, body, headers, timeout)

    async def request(
        self,
        method: str,
        host: str,
        port: int,
        path: str,
        body: bytes | None,
        headers: dict[str, str],
        timeout: float,
    ) -> Response:
        """Send ``method path`` with a JSON ``body`` (or none); returns once the status line and
        headers arrived.

        ``timeout`` bounds the whole request, connecting (at most the pool's connect timeout)
        and the body included: when it passes, the connection is closed and the pending read
        raises :class:`UpstreamTimeout`. The caller must ``release()`` or ``close()`` the response.
        """
        if timeout <= 0:
            raise UpstreamTimeout("no time left for the request")
        loop = asyncio.get_running_loop()
        started = time.monotonic()
        conn = await self._connection(host, port, timeout)
        left = timeout - (time.monotonic() - started)
        start = self._heads.get((method, host, port, path))
        if start is None:
            if len(self._heads) >= MAX_CACHED_HEADS:
                self._heads.clear()
            authority = f"[{host}]" if ":" in host and not host.startswith("[") else host
            start = f"{method} {_clean(path)} HTTP/1.1\r\nHost: {authority}:{port}\r\n"
            self._heads[(method, host, port, path)] = start
        head = [start]
        for name, value in headers.items():
            head.append(f"{name}: {_clean(value)}\r\n")
        if body is not None:
            head.append(f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n")
        else:
            head.append("\r\n" if method == "GET" else "Content-Length: 0\r\n\r\n")
        waiter: asyncio.Future[Response] = loop.create_future()
        conn.headers_waiter = waiter
        conn.message_complete = False
        conn.transport.writelines((("".join(head)).encode("latin-1"), body or b""))

        def expire() -> None:
            error = UpstreamTimeout(f"{host}:{port} did not answer within {timeout:g}s")
            if not waiter.done():
                waiter.set_exception(error)
            if conn.response is not None:
                conn.response._fail(error)
            conn.abort()

        timer = loop.call_later(max(0.0, left), expire)
        try:
            response = await waiter
        except BaseException:
            timer.cancel()
            conn.abort()
            raise
        response._timer = timer
        if response._eof:
            timer.cancel()
            response._timer = None
        return response

    def close(self) -> None:
        """Close every idle connection; later ones are closed instead of pooled."""
        self._closed = True
        for idle in self._idle.values():
            for conn in idle:
                conn.abort()
        self._idle.clear()
