"""What the Router's raw HTTP/1.1 server (:mod:`proxy.server.hot_server`) hands to a request handler.

The generation handlers (:func:`proxy.request.exchange.generate`, wrapped by :mod:`proxy.access.api_keys` and
``proxy.app``) are written against aiohttp's ``web.Request`` and answer with aiohttp's
``web.Response`` / ``web.StreamResponse``. The raw server keeps them unchanged: it passes a
:class:`RawRequest` that has the part of ``web.Request`` they and aiohttp's response classes
use (``method``, ``path``, ``version``, ``keep_alive``, ``headers``, ``remote``,
``content_length``, ``read()``, the ``_payload_writer`` and ``_prepare_hook`` that
``StreamResponse.prepare`` calls), and a :class:`ResponseWriter` as that payload writer, which
frames the answer (``Content-Length`` or chunked) onto the connection's transport.
"""

from __future__ import annotations

from typing import Any, Protocol

from aiohttp import web
from aiohttp.http import HttpVersion
from multidict import CIMultiDict


class Connection(Protocol):
    """The connection a :class:`ResponseWriter` writes to (``proxy.server.hot_server.HotConnection``)."""

    def send(self, data: bytes) -> None:
        """Write ``data`` to the client (ConnectionResetError once the connection is closing)."""

    def must_drain(self) -> bool:
        """Whether the transport asked the writer to wait (its buffer is over the high mark)."""

    async def drain(self) -> None:
        """Wait until the transport's buffer is below the low mark again."""


class ResponseWriter:
    """aiohttp's payload-writer interface (``AbstractStreamWriter``) over a raw connection.

    The status line and headers are held until the first body write, so that a short answer or
    a stream's first event goes out in one ``send``; ``send_headers`` (called by
    ``StreamResponse.prepare``) only makes sure they leave within this loop iteration.
    """

    buffer_size = 0

    def __init__(self, connection: Connection, loop: Any) -> None:
        self._connection = connection
        self._loop = loop
        self._head: bytes | None = None
        self._chunked = False
        self.length: int | None = None
        self.output_size = 0
        self.done = False
        #: Whether any byte of the answer went out (after that an error can only close the connection).
        self.started = False

    def enable_chunking(self) -> None:
        self._chunked = True

    def enable_compression(self, encoding: str = "deflate", strategy: int | None = None) -> None:
        raise NotImplementedError("the Router does not compress its answers")

    async def write_headers(self, status_line: str, headers: Any) -> None:
        lines = [status_line]
        for name, value in headers.items():
            if "\r" in value or "\n" in value or "\r" in name or "\n" in name:
                raise ValueError(f"newline in response header {name!r}: {value!r}")
            lines.append(f"{name}: {value}")
        lines.append("\r\n")
        self._head = "\r\n".join(lines).encode("latin-1")

    def send_headers(self) -> None:
        if self._head is not None:
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
            if self.length is not None:
                body = body[: max(self.length - self.output_size, 0)]
            framed = body
        self.output_size += len(body)
        if self._head is not None:
            framed, self._head = self._head + framed, None
        return framed

    async def write(self, chunk: bytes | bytearray | memoryview, *, drain: bool = True, **_: Any) -> None:
        framed = self._frame(chunk, last=False)
        if framed:
            self.started = True
            self._connection.send(framed)
        if drain and self._connection.must_drain():
            await self._connection.drain()

    async def write_eof(self, chunk: bytes = b"") -> None:
        if self.done:
            return
        framed = self._frame(chunk, last=True)
        self.done = True
        if framed:
            self.started = True
            self._connection.send(framed)
        if self._connection.must_drain():
            await self._connection.drain()

    async def drain(self) -> None:
        if self._connection.must_drain():
            await self._connection.drain()

    def set_eof(self) -> None:
        self.done = True


class RawRequest:
    """The part of aiohttp's ``web.Request`` the generation handlers and responses use."""

    __slots__ = ("method", "path", "version", "keep_alive", "headers", "remote", "_body", "_limit", "_payload_writer")

    def __init__(
        self,
        method: str,
        path: str,
        version: HttpVersion,
        keep_alive: bool,
        headers: CIMultiDict[str],
        remote: str | None,
        body: bytes | None,
        limit: int,
        writer: ResponseWriter,
    ) -> None:
        self.method = method
        self.path = path
        self.version = version
        self.keep_alive = keep_alive
        self.headers = headers
        self.remote = remote
        #: None: the body went over ``limit`` bytes and was dropped.
        self._body = body
        self._limit = limit
        self._payload_writer = writer

    @property
    def content_length(self) -> int | None:
        value = self.headers.get("Content-Length")
        return int(value) if value is not None and value.isdigit() else None

    async def read(self) -> bytes:
        """The whole body (aiohttp's HTTP 413 exception when it went over the limit)."""
        if self._body is None:
            raise web.HTTPRequestEntityTooLarge(max_size=self._limit, actual_size=self._limit + 1)
        return self._body

    async def _prepare_hook(self, response: web.StreamResponse) -> None:
        """aiohttp's ``on_response_prepare`` signal: the Router connects nothing to it."""
