"""The Router's HTTP/1.1 server: raw asyncio + httptools for the generation endpoints, aiohttp for the rest.

Every client connection starts on a :class:`HotConnection`. ``POST /v1/completions`` and
``POST /v1/chat/completions`` (the *hot* routes) are parsed by httptools and served right there:
the same handlers aiohttp would run (auth, request id, body limit, the exchange) get a
:class:`proxy.server_request.RawRequest`, and their aiohttp responses are written through a
:class:`proxy.server_request.ResponseWriter`. Any other request hands the connection, with the
bytes of that request, to aiohttp's own protocol (``web.Server``) for the rest of its life, so
every other route keeps aiohttp's behaviour exactly.

Kept from aiohttp's server: keep-alive (75 s idle timeout), ``Expect: 100-continue``, HTTP 400
on a malformed request, the ``--max-body-size`` limit (HTTP 413; the body is read to its end
and dropped), handler cancellation (a client that goes away cancels its
handler task, which closes both backend requests: vLLM aborts them), TLS (the listening socket's
SSL context), and a graceful stop (in-flight requests get ``SHUTDOWN_TIMEOUT_S``).

Not supported: a non-generation request *pipelined* behind another request on one connection
(sent before the previous answer ended); the connection is closed after the answers in flight.
"""

from __future__ import annotations

import asyncio
import collections
import gc
import json
import logging
import signal
import socket
import ssl
from collections.abc import Awaitable, Callable
from typing import Any

import httptools
from aiohttp import web
from aiohttp.http import HttpVersion10, HttpVersion11
from multidict import CIMultiDict

from proxy.server_request import RawRequest, ResponseWriter

logger = logging.getLogger("proxy")

HotHandler = Callable[[Any], Awaitable[web.StreamResponse]]
#: Allocations between two collections of the young generation (CPython's default: 700).
GC_THRESHOLD = 10_000
#: Seconds an idle keep-alive connection stays open (aiohttp's default).
KEEPALIVE_TIMEOUT_S = 75.0
_BAD_REQUEST = (
    b"HTTP/1.1 400 Bad Request\r\nContent-Type: application/json\r\nConnection: close\r\nContent-Length: %d\r\n\r\n%b"
)


class _HandOff(Exception):
    """Raised inside the parser's callback: this request goes to aiohttp."""


class HotServer:
    """What every connection shares: the hot routes, aiohttp's protocol factory, the open connections."""

    def __init__(self, hot: dict[str, HotHandler], aiohttp_server: web.Server, max_body_size: int) -> None:
        self.hot = hot
        self.aiohttp_server = aiohttp_server
        self.max_body_size = max_body_size
        self.connections: set[HotConnection] = set()
        self.loop = asyncio.get_running_loop()
        self._sweeper: asyncio.TimerHandle | None = None
        self._sweep()

    def __call__(self) -> HotConnection:
        return HotConnection(self)

    def _sweep(self) -> None:
        """Close keep-alive connections idle for KEEPALIVE_TIMEOUT_S (checked every few seconds)."""
        now = self.loop.time()
        for connection in list(self.connections):
            if connection.idle_since is not None and now - connection.idle_since > KEEPALIVE_TIMEOUT_S:
                connection.close()
        self._sweeper = self.loop.call_later(5.0, self._sweep)

    async def shutdown(self, timeout: float) -> None:
        """Close idle connections, give the busy ones ``timeout`` seconds, then close them too."""
        if self._sweeper is not None:
            self._sweeper.cancel()
        deadline = self.loop.time() + timeout
        while True:
            for connection in list(self.connections):
                if connection.idle_since is not None:
                    connection.close()
            if not self.connections or self.loop.time() >= deadline:
                break
            await asyncio.sleep(0.05)
        for connection in list(self.connections):
            connection.close()
        await asyncio.sleep(0)


class HotConnection(asyncio.Protocol):
    """One client connection while it serves hot requests (see the module docstring)."""

    def __init__(self, server: HotServer) -> None:
        self.server = server
        self.loop = server.loop
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpRequestParser(self)
        self.remote: str | None = None
        #: loop.time() since when the connection has nothing to do; None while a request is open.
        self.idle_since: float | None = None
        self._task: asyncio.Task[None] | None = None
        self._queue: collections.deque[tuple[RawRequest, HotHandler]] = collections.deque()
        self._closing = False
        self._paused = False
        self._drained: asyncio.Future[None] | None = None
        # The request being parsed.
        self._url = b""
        self._headers: list[tuple[str, str]] = []
        self._handler: HotHandler | None = None
        self._path = ""
        self._header_map: CIMultiDict[str] = CIMultiDict()
        self._body: bytearray | None = None
        self._over_limit = False
        self._in_message = False
        # The bytes of the request being parsed, while it may still go to aiohttp (its start is known).
        self._chunk = b""
        self._chunk_fresh = False
        self._raw: list[bytes] | None = None
        self._hand_off = False

    # -- asyncio.Protocol ------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            try:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            except OSError:  # pragma: no cover
                pass
        peer = transport.get_extra_info("peername")
        self.remote = peer[0] if isinstance(peer, (tuple, list)) else None
        self.idle_since = self.loop.time()
        self.server.connections.add(self)

    def data_received(self, data: bytes) -> None:
        if self._closing:
            return
        self.idle_since = None
        self._chunk = data
        self._chunk_fresh = not self._in_message
        if self._in_message and self._raw is not None:
            self._raw.append(data)
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserCallbackError as exc:
            if self._closing:
                return  # a request pipelined behind a hot one: closed once the answers in flight end
            if not self._hand_off:
                self._bad_request(f"invalid request: {exc.__context__ or exc}")
                return
        except httptools.HttpParserUpgrade:
            self._bad_request("protocol upgrade is not supported on this route")
            return
        except httptools.HttpParserError as exc:
            self._bad_request(f"malformed HTTP request: {exc}")
            return
        if self._hand_off:
            self._to_aiohttp()
        elif self._task is None and not self._in_message and self.transport is not None:
            self.idle_since = self.loop.time()

    def connection_lost(self, exc: Exception | None) -> None:
        self._closing = True
        self.transport = None
        self.server.connections.discard(self)
        self._queue.clear()
        if self._task is not None:
            self._task.cancel()  # handler cancellation: the exchange closes its backend requests
        if self._drained is not None and not self._drained.done():
            self._drained.set_exception(ConnectionResetError("the client closed the connection"))

    def pause_writing(self) -> None:
        self._paused = True

    def resume_writing(self) -> None:
        self._paused = False
        if self._drained is not None and not self._drained.done():
            self._drained.set_result(None)
        self._drained = None

    # -- httptools callbacks ---------------------------------------------------------------------

    def on_message_begin(self) -> None:
        self._in_message = True
        self._url = b""
        self._headers = []
        self._handler = None
        self._body = None
        self._raw = [self._chunk] if self._chunk_fresh and self._task is None and not self._queue else None
        self._chunk_fresh = False

    def on_url(self, url: bytes) -> None:
        self._url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        self._headers.append((name.decode("latin-1"), value.decode("latin-1")))

    def on_headers_complete(self) -> None:
        path = self._url.split(b"?", 1)[0].decode("latin-1")
        handler = self.server.hot.get(path) if self.parser.get_method() == b"POST" else None
        if handler is None:
            if self._raw is None:
                logger.warning("a request pipelined behind a generation request from %s: closing", self.remote)
                self._closing = True
                self._close_when_idle()
                raise _HandOff
            self._hand_off = True
            raise _HandOff
        self._raw = None
        self._handler = handler
        self._path = path
        self._body = bytearray()
        self._over_limit = False
        headers = CIMultiDict(self._headers)
        self._header_map = headers
        length = headers.get("Content-Length")
        if length is not None and length.isdigit() and int(length) > self.server.max_body_size:
            self._over_limit = True
        if self.parser.get_http_version() == "1.1" and headers.get("Expect", "").lower() == "100-continue":
            self.send(b"HTTP/1.1 100 Continue\r\n\r\n")

    def on_body(self, body: bytes) -> None:
        if self._over_limit or self._body is None:
            return
        self._body += body
        if len(self._body) > self.server.max_body_size:
            self._over_limit = True
            self._body = None

    def on_message_complete(self) -> None:
        self._in_message = False
        handler = self._handler
        if handler is None:
            return
        self._handler = None
        writer = ResponseWriter(self, self.loop)
        request = RawRequest(
            "POST",
            self._path,
            HttpVersion11 if self.parser.get_http_version() == "1.1" else HttpVersion10,
            self.parser.should_keep_alive(),
            self._header_map,
            self.remote,
            None if self._over_limit or self._body is None else bytes(self._body),
            self.server.max_body_size,
            writer,
        )
        self._body = None
        if self._task is None:
            self._task = self.loop.create_task(self._serve(request, handler))
        else:
            self._queue.append((request, handler))

    # -- serving ---------------------------------------------------------------------------------

    async def _serve(self, request: RawRequest, handler: HotHandler) -> None:
        while True:
            keep_alive = await self._answer(request, handler)
            if not keep_alive or self.transport is None:
                self.close()
                return
            if not self._queue:
                break
            request, handler = self._queue.popleft()
        self._task = None
        if self._closing:
            self.close()
        elif not self._in_message:
            self.idle_since = self.loop.time()

    async def _answer(self, request: RawRequest, handler: HotHandler) -> bool:
        """Run ``handler`` and send its answer; whether the connection may serve another request."""
        writer: ResponseWriter = request._payload_writer
        try:
            response = await handler(request)
            if writer.started and not response.prepared:
                return False  # an answer was under way when the handler gave another one: cut it
            await response.prepare(request)  # type: ignore[arg-type]
            await response.write_eof()
        except asyncio.CancelledError:
            return False  # the client went away (connection_lost cancelled the task)
        except ConnectionResetError:
            return False
        except Exception:
            logger.exception("unexpected error answering POST %s", request.path)
            if not writer.started and self.transport is not None:
                body = b'{"error": {"message": "internal Router error", "type": "internal_error", "code": 500}}'
                head = b"HTTP/1.1 500 Internal Server Error\r\nContent-Type: application/json\r\nConnection: close\r\n"
                self.send(head + b"Content-Length: %d\r\n\r\n%b" % (len(body), body))
            return False
        return bool(response.keep_alive) and request.keep_alive

    # -- the connection --------------------------------------------------------------------------

    def send(self, data: bytes) -> None:
        transport = self.transport
        if transport is None or transport.is_closing():
            raise ConnectionResetError("cannot write to a closing connection")
        transport.write(data)

    def must_drain(self) -> bool:
        return self._paused

    async def drain(self) -> None:
        if not self._paused:
            return
        if self._drained is None:
            self._drained = self.loop.create_future()
        await self._drained

    def close(self) -> None:
        self._closing = True
        if self.transport is not None:
            self.transport.close()

    def _close_when_idle(self) -> None:
        if self._task is None:
            self.close()

    def _bad_request(self, message: str) -> None:
        logger.warning("HTTP 400 to %s: %s", self.remote, message)
        if self._task is None and self.transport is not None:
            error = {"message": message, "type": "invalid_request_error", "code": 400}
            body = json.dumps({"error": error}).encode()
            self.transport.write(_BAD_REQUEST % (len(body), body))
        self._closing = True
        self._close_when_idle()

    def _to_aiohttp(self) -> None:
        """Give the connection, and the bytes of the request being parsed, to aiohttp's protocol."""
        transport, raw = self.transport, self._raw
        self.server.connections.discard(self)
        self.transport = None
        self._closing = True
        if transport is None or raw is None:
            return
        protocol = self.server.aiohttp_server()
        transport.set_protocol(protocol)
        protocol.connection_made(transport)
        protocol.data_received(b"".join(raw))


async def serve(
    app: web.Application,
    hot: dict[str, HotHandler],
    *,
    host: str,
    port: int,
    reuse_port: bool,
    ssl_context: ssl.SSLContext | None,
    shutdown_timeout: float,
    backlog: int = 2048,
) -> None:
    """Serve ``app`` (the hot routes on :class:`HotConnection`) until SIGINT or SIGTERM."""
    loop = asyncio.get_running_loop()
    runner = web.AppRunner(
        app, handle_signals=False, access_log=None, handler_cancellation=True, shutdown_timeout=shutdown_timeout
    )
    await runner.setup()  # the application's on_startup
    assert runner.server is not None
    # Everything built so far lives as long as the process: keep it out of the collector's scans,
    # and collect the young generation every GC_THRESHOLD allocations instead of every 700 (a
    # request allocates a few hundred objects, nearly all freed by reference counting).
    gc.freeze()
    gc.set_threshold(GC_THRESHOLD, *gc.get_threshold()[1:])
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    hot_server = HotServer(hot, runner.server, app._client_max_size)
    server = await loop.create_server(
        hot_server, host or None, port, backlog=backlog, reuse_port=reuse_port or None, ssl=ssl_context
    )
    try:
        await stop.wait()
    finally:
        server.close()
        await hot_server.shutdown(shutdown_timeout)
        await runner.cleanup()  # aiohttp's connections, then the application's on_cleanup
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
