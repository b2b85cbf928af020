"""What the Router's raw HTTP/1.1 server (:mod:`proxy.server.hot_server`) hands to a request handler.

The generation handlers (:func:`proxy.request.exchange.generate`, wrapped by :mod:`proxy.access.api_keys`
and ``proxy.app``) read a request through the part of aiohttp's ``web.Request`` they use
(``method``, ``path``, ``version``, ``keep_alive``, ``headers``, ``remote``, ``content_length``,
``read()``); :class:`RawRequest` has exactly that, plus its connection's :class:`ReplyWriter`.
They answer with a :class:`proxy.server.reply.Reply`, which the writer frames onto the
connection (``Content-Length`` or chunked). Nothing here touches aiohttp's objects.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from http import HTTPStatus
from typing import Any, Protocol

from aiohttp import web
from multidict import CIMultiDict

#: The ``Server`` header of the Router's own answers.
SERVER_NAME = "pd-router"
_DAYS = ("Mon", "Tue", "Wed", "Thu", "Fri", "Sat", "Sun")
_MONTHS = ("", "Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec")
_date_second = 0
_date_text = ""


def http_date() -> str:
    """The current time as an HTTP ``Date`` value (computed once per second)."""
    global _date_second, _date_text
    now = int(time.time())
    if now != _date_second:
        year, month, day, hh, mm, ss, weekday, *_ = time.gmtime(now)
        _date_text = f"{_DAYS[weekday]}, {day:02d} {_MONTHS[month]} {year:04d} {hh:02d}:{mm:02d}:{ss:02d} GMT"
        _date_second = now
    return _date_text


def _reason(status: int) -> str:
    try:
        return HTTPStatus(status).phrase
    except ValueError:
        return ""


class Connection(Protocol):
    """The connection a :class:`ReplyWriter` writes to (``proxy.server.hot_connection.HotConnection``)."""

    def send(self, data: bytes) -> None:
        """Write ``data`` to the client (ConnectionResetError once the connection is closing)."""

    def must_drain(self) -> bool:
        """Whether the transport asked the writer to wait (its buffer is over the high mark)."""

    async def drain(self) -> None:
        """Wait until the transport's buffer is below the low mark again."""


class ReplyWriter:
    """Frames one answer onto a raw connection.

    :meth:`start` builds the status line and headers and holds them until the first body write,
    so that a short answer or a stream's first event goes out in one ``send``; with
    ``flush_soon`` (a stream) they leave within this loop iteration even if no write follows.
    """

    __slots__ = ("_connection", "_loop", "_version", "_request_keep_alive", "_head", "_chunked", "_length")
    __slots__ += ("output_size", "done", "started", "keep_alive")

    def __init__(self, connection: Connection, loop: Any, version: tuple[int, int], keep_alive: bool) -> None:
        self._connection = connection
        self._loop = loop
        self._version = version
        self._request_keep_alive = keep_alive
        self._head: bytes | None = None
        self._chunked = False
        self._length: int | None = None
        self.output_size = 0
        self.done = False
        #: Whether any byte of the answer went out (after that an error can only close the connection).
        self.started = False
        #: Whether the connection may serve another request after this answer (set by start()).
        self.keep_alive = keep_alive

    def start(
        self, status: int, headers: Mapping[str, str], length: int | None, keep_alive: bool | None, flush_soon: bool
    ) -> None:
        """Commit the status line and ``headers``; ``length`` None: a body of unknown length."""
        if self._head is not None or self.started:
            raise RuntimeError(f"the status line of this answer is committed already (HTTP {status} is one too many)")
        alive = self._request_keep_alive and keep_alive is not False
        http11 = self._version >= (1, 1)
        out = CIMultiDict(headers)
        out.popall("Content-Length", None)
        out.popall("Transfer-Encoding", None)
        empty = status < 200 or status in (204, 304)
        if empty:
            self._length = 0
        elif length is not None:
            self._length = length
            out["Content-Length"] = str(length)
        elif http11:
            self._chunked = True
            out["Transfer-Encoding"] = "chunked"
        else:
            alive = False  # HTTP/1.0 without a length: the body ends with the connection
        if not empty and length != 0:
            out.setdefault("Content-Type", "application/octet-stream")
        out.setdefault("Date", http_date())
        out.setdefault("Server", SERVER_NAME)
        if "Connection" not in out:
            if alive and not http11:
                out["Connection"] = "keep-alive"
            elif not alive and http11:
                out["Connection"] = "close"
        self.keep_alive = alive
        lines = [f"HTTP/{self._version[0]}.{self._version[1]} {status} {_reason(status)}"]
        for name, value in out.items():
            if "\r" in value or "\n" in value or "\r" in name or "\n" in name:
                raise ValueError(f"newline in response header {name!r}: {value!r}")
            lines.append(f"{name}: {value}")
        lines.append("\r\n")
        self._head = "\r\n".join(lines).encode("latin-1")
        if flush_soon:
            self._loop.call_soon(self._flush_head)

    def _flush_head(self) -> None:
        if self._head is not None and not self.done:
            head, self._head = self._head, None
            self.started = True
            try:
                self._connection.send(head)
            except ConnectionResetError:
                pass  # the connection is gone; its handler is being cancelled

    def _frame(self, data: bytes | bytearray | memoryview, last: bool) -> bytes:
        body = bytes(data)
        if self._chunked:
            framed = b"%x\r\n%b\r\n" % (len(body), body) if body else b""
            if last:
                framed += b"0\r\n\r\n"
        else:
            if self._length is not None:
                body = body[: max(self._length - self.output_size, 0)]
            framed = body
        self.output_size += len(body)
        if self._head is not None:
            framed, self._head = self._head + framed, None
        return framed

    async def write(self, data: bytes | bytearray | memoryview) -> None:
        """Send ``data`` as the next part of the body; waits while the client's buffer is full."""
        if self.done:
            raise RuntimeError("write() after write_eof()")
        framed = self._frame(data, last=False)
        if framed:
            self.started = True
            self._connection.send(framed)
        if self._connection.must_drain():
            await self._connection.drain()

    async def write_eof(self, data: bytes | bytearray | memoryview = b"") -> None:
        """Send ``data`` and end the body (again: nothing happens)."""
        if self.done:
            return
        framed = self._frame(data, last=True)
        self.done = True
        if framed:
            self.started = True
            self._connection.send(framed)
        if self._connection.must_drain():
            await self._connection.drain()


class RawRequest:
    """The part of aiohttp's ``web.Request`` the generation handlers use, and its connection's writer."""

    __slots__ = ("method", "path", "version", "keep_alive", "headers", "remote", "writer", "_body", "_limit")

    def __init__(
        self,
        method: str,
        path: str,
        version: tuple[int, int],
        keep_alive: bool,
        headers: CIMultiDict[str],
        remote: str | None,
        body: bytes | None,
        limit: int,
        writer: ReplyWriter,
    ) -> None:
        self.method = method
        self.path = path
        self.version = version
        self.keep_alive = keep_alive
        self.headers = headers
        self.remote = remote
        #: Where the answer goes (:meth:`proxy.server.reply.Reply.prepare` uses it).
        self.writer = writer
        #: None: the body went over ``limit`` bytes and was dropped.
        self._body = body
        self._limit = limit

    @property
    def content_length(self) -> int | None:
        value = self.headers.get("Content-Length")
        return int(value) if value is not None and value.isdigit() else None

    async def read(self) -> bytes:
        """The whole body (aiohttp's HTTP 413 exception, as ``web.Request.read`` raises, over the limit)."""
        if self._body is None:
            raise web.HTTPRequestEntityTooLarge(max_size=self._limit, actual_size=self._limit + 1)
        return self._body
