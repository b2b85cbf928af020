"""One client connection of the Router's raw HTTP/1.1 server: :class:`HotConnection`.

See :mod:`proxy.server.hot_server` for what it serves and :mod:`proxy.server.limits` for what it refuses
(head size, header, body and write deadlines, pipelining, body size) and how its timers stay cheap.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import socket
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import httptools
from multidict import CIMultiDict

from proxy.server.limits import LINGER_S, MAX_HEAD_BYTES, Phase, ServerLimits, error_bytes
from proxy.server.reply import ClientReply
from proxy.server.request import RawRequest, ReplyWriter

if TYPE_CHECKING:
    from proxy.server.hot_server import HotServer

logger = logging.getLogger("proxy")

_IDLE, _HEAD, _BODY = Phase.IDLE, Phase.HEAD, Phase.BODY  # module globals: one lookup each on the hot path
_HTTP10, _HTTP11 = (1, 0), (1, 1)
HotHandler = Callable[[Any], Awaitable[ClientReply]]


class _Stop(Exception):
    """Raised inside a parser callback: parse nothing more of this connection."""


class HotConnection(asyncio.Protocol):
    """One client connection while it serves hot requests (see the module docstring)."""

    def __init__(self, server: HotServer) -> None:
        self.server = server
        self.loop = server.loop
        self.limits: ServerLimits = server.limits
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
        # Deadlines.
        self._phase = _IDLE
        self._timer: asyncio.TimerHandle | None = None
        self._body_at = 0.0
        self._head_bytes = self._head_first = 0
        self._done = 0  # requests parsed to their end
        self._reading_paused = False
        self._write_timer: asyncio.TimerHandle | None = None
        self._write_left = 0
        self._linger = False
        # The request being parsed.
        self._url = b""
        self._headers: list[tuple[str, str]] = []
        self._handler: HotHandler | None = None
        self._path = ""
        self._header_map: CIMultiDict[str] = CIMultiDict()
        self._body: bytearray | None = None
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
        began_in_head = self._phase is _HEAD
        done = self._done
        if self._in_message and self._raw is not None:
            self._raw.append(data)
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserCallbackError as exc:
            if self._closing:
                return  # refused or cut already (_Stop), or closing behind the answers in flight
            if not self._hand_off:
                self._refuse(400, f"invalid request: {exc.__context__ or exc}")
                return
        except httptools.HttpParserUpgrade:
            self._refuse(400, "protocol upgrade is not supported on this route")
            return
        except httptools.HttpParserError as exc:
            self._refuse(400, f"malformed HTTP request: {exc}")
            return
        if self._hand_off:
            self._to_aiohttp()
            return
        phase = self._phase
        if phase is _IDLE:
            if self._task is None:
                self.idle_since = self.loop.time()
                if self._done == done and self._timer is None:  # bytes that began no request
                    self._arm(self.limits.header_timeout)
        elif self._reading_paused:
            pass
        elif phase is _HEAD:
            if began_in_head:
                self._head_bytes += len(data)
                if self._head_bytes > MAX_HEAD_BYTES:
                    self._refuse(431, f"request line and headers exceed {MAX_HEAD_BYTES} bytes")
                    return
            else:
                self._head_first = len(data)  # the read it began in (not counted above: it may hold more)
            if self._timer is None:
                self._arm(self.limits.header_timeout)
        else:
            self._body_at = self.loop.time()
            if self._timer is None:
                self._arm(self.limits.body_timeout)

    def connection_lost(self, exc: Exception | None) -> None:
        self._closing = True
        self.transport = None
        self.server.connections.discard(self)
        self._queue.clear()
        self._disarm()
        if self._write_timer is not None:
            self._write_timer.cancel()
            self._write_timer = None
        if self._task is not None:
            self._task.cancel()  # handler cancellation: the exchange closes its backend requests
        if self._drained is not None and not self._drained.done():
            self._drained.set_exception(ConnectionResetError("the client closed the connection"))

    def pause_writing(self) -> None:
        self._paused = True
        if self._write_timer is None and self.transport is not None:
            self._write_left = self.transport.get_write_buffer_size()
            self._write_timer = self.loop.call_later(self.limits.write_timeout, self._write_stalled)

    def resume_writing(self) -> None:
        self._paused = False
        if self._write_timer is not None:
            self._write_timer.cancel()
            self._write_timer = None
        if self._drained is not None and not self._drained.done():
            self._drained.set_result(None)
        self._drained = None

    # -- deadlines -------------------------------------------------------------------------------

    def _arm(self, delay: float) -> None:
        self._timer = self.loop.call_later(delay, self._expired)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _expired(self) -> None:
        self._timer = None
        if self.transport is None or self._closing or self._reading_paused:
            return
        phase = self._phase
        if phase is _BODY:
            quiet = self.loop.time() - self._body_at
            if quiet < self.limits.body_timeout:
                self._arm(self.limits.body_timeout - quiet)
                return
            self._refuse(408, f"no byte of the request body for {self.limits.body_timeout:g} s")
        elif phase is _HEAD:
            self._refuse(408, f"request headers not complete within {self.limits.header_timeout:g} s")
        elif self._task is None:
            logger.info("closing the connection of %s: no request within %gs", self.remote, self.limits.header_timeout)
            self.close()

    def _write_stalled(self) -> None:
        self._write_timer = None
        transport = self.transport
        if transport is None or not self._paused:
            return
        left = transport.get_write_buffer_size()
        if left < self._write_left:  # slow, but reading: give it another period
            self._write_left = left
            self._write_timer = self.loop.call_later(self.limits.write_timeout, self._write_stalled)
            return
        timeout = self.limits.write_timeout
        logger.warning(
            "client %s read nothing for %gs (%d bytes unsent): cutting its request", self.remote, timeout, left
        )
        self.abort()

    def _pause_reading(self) -> None:
        if not self._reading_paused and self.transport is not None:
            self._reading_paused = True
            self.transport.pause_reading()
            self._disarm()

    def _resume_reading(self) -> None:
        if self._reading_paused and self.transport is not None and not self._closing:
            self._reading_paused = False
            self.transport.resume_reading()
            if self._phase is _HEAD:
                self._arm(self.limits.header_timeout)
            elif self._phase is _BODY:
                self._body_at = self.loop.time()
                self._arm(self.limits.body_timeout)

    # -- httptools callbacks ---------------------------------------------------------------------

    def on_message_begin(self) -> None:
        self._in_message = True
        self._phase = _HEAD
        self._head_bytes = self._head_first = 0
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
        self._phase = _BODY
        if self._timer is not None:
            self._disarm()
        # The reads it came in bound the head's size; counted exactly only when they could exceed the limit.
        if (
            self._head_first + self._head_bytes + len(self._chunk) > MAX_HEAD_BYTES
            and self._head_size() > MAX_HEAD_BYTES
        ):
            self._refuse(431, f"request line and headers exceed {MAX_HEAD_BYTES} bytes")
            raise _Stop
        path = self._url.split(b"?", 1)[0].decode("latin-1")
        handler = self.server.hot.get(path) if self.parser.get_method() == b"POST" else None
        if handler is None:
            if self._raw is None:
                logger.warning("a request pipelined behind a generation request from %s: closing", self.remote)
                self._closing = True
                self._close_when_idle()
                raise _Stop
            self._hand_off = True
            raise _Stop
        self._raw = None
        self._handler = handler
        self._path = path
        self._body = bytearray()
        headers = CIMultiDict(self._headers)
        self._header_map = headers
        length = headers.get("Content-Length")
        if length is not None and length.isdigit() and int(length) > self.server.max_body_size:
            self._over_limit()  # raises _Stop
        if self.parser.get_http_version() == "1.1" and headers.get("Expect", "").lower() == "100-continue":
            self.send(b"HTTP/1.1 100 Continue\r\n\r\n")

    def _head_size(self) -> int:
        return len(self._url) + sum(len(n) + len(v) + 4 for n, v in self._headers) + 16

    def on_body(self, body: bytes) -> None:
        if self._body is None:
            return
        self._body += body
        if len(self._body) > self.server.max_body_size:
            self._over_limit()

    def on_message_complete(self) -> None:
        self._in_message = False
        self._phase = _IDLE
        self._done += 1
        if self._timer is not None:
            self._disarm()
        handler = self._handler
        if handler is None:
            return
        body, self._body = self._body, None
        self._dispatch(handler, None if body is None else bytes(body), self.parser.should_keep_alive())

    def _over_limit(self) -> None:
        """The body is (or is announced) over the limit: the handler answers 413 now, nothing more is read."""
        handler = self._handler
        assert handler is not None
        self._body = None
        self._in_message = False
        self._phase = _IDLE
        self._linger = True
        self._dispatch(handler, None, False)
        self._closing = True  # after the dispatch: nothing more is parsed or read
        self._pause_reading()
        raise _Stop

    def _dispatch(self, handler: HotHandler, body: bytes | None, keep_alive: bool) -> None:
        self._handler = None
        version = _HTTP11 if self.parser.get_http_version() == "1.1" else _HTTP10
        request = RawRequest(
            "POST",
            self._path,
            version,
            keep_alive,
            self._header_map,
            self.remote,
            body,
            self.server.max_body_size,
            ReplyWriter(self, self.loop, version, keep_alive),
        )
        if self._task is None:
            self._task = self.loop.create_task(self._serve(request, handler))
        elif not self._queue:
            self._queue.append((request, handler))
            self._pause_reading()  # one request waits; the next stays in the socket
        else:
            logger.warning("more than one request pipelined by %s: closing after the answers in flight", self.remote)
            self._closing = True
            self._pause_reading()
            raise _Stop

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
            if self._reading_paused:
                self._resume_reading()
        self._task = None
        if self._closing:
            self.close()
        elif not self._in_message:
            self.idle_since = self.loop.time()
        if self._reading_paused:
            self._resume_reading()

    async def _answer(self, request: RawRequest, handler: HotHandler) -> bool:
        """Run ``handler`` and send its answer; whether the connection may serve another request."""
        writer = request.writer
        try:
            reply = await handler(request)
            if not isinstance(reply, ClientReply):
                raise TypeError(f"POST {request.path}: handler gave a {type(reply).__name__}, not a ClientReply")
            if writer.started and not reply.prepared:
                return False  # an answer was under way when the handler gave another one: cut it
            await reply.prepare(request)
            await reply.write_eof()
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
        return writer.keep_alive

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
        """Close once what was written is sent (after a refused body: its write side first, see LINGER_S)."""
        self._closing = True
        transport = self.transport
        if transport is None:
            return
        self._disarm()
        if self._linger and transport.can_write_eof():
            self._linger = False
            transport.write_eof()
            self._reading_paused = False
            transport.resume_reading()  # what still comes is dropped (data_received: closing)
            self.loop.call_later(LINGER_S, self.abort)
            return
        transport.close()

    def abort(self) -> None:
        """Close at once, dropping what was not sent (a client that stopped reading)."""
        self._closing = True
        if self.transport is not None:
            self.transport.abort()

    def _close_when_idle(self) -> None:
        if self._task is None:
            self.close()

    def _refuse(self, status: int, message: str) -> None:
        """Answer ``status`` (unless an answer is under way) and close."""
        logger.warning("HTTP %d to %s: %s", status, self.remote, message)
        if self._task is None and self.transport is not None:
            self.transport.write(error_bytes(status, message))
        self._closing = True
        self._disarm()
        self._close_when_idle()

    def _to_aiohttp(self) -> None:
        """Give the connection, and the bytes of the request being parsed, to aiohttp's protocol."""
        transport, raw = self.transport, self._raw
        self.server.connections.discard(self)
        self._disarm()
        self.transport = None
        self._closing = True
        if transport is None or raw is None:
            return
        protocol = self.server.aiohttp_server()
        transport.set_protocol(protocol)
        protocol.connection_made(transport)
        protocol.data_received(b"".join(raw))
