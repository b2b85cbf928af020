"""The Router's answers to its clients: :class:`BodyReply` (a whole body) and :class:`StreamReply`.

Every Router handler answers with one of these (or, on the routes only aiohttp serves, with an
aiohttp response). What writes it depends on who serves the request:

- the raw server (:mod:`proxy.server.hot_server`, a :class:`proxy.server.request.RawRequest`): the
  connection's own :class:`proxy.server.request.ReplyWriter` frames it (``Content-Length`` or
  chunked) onto the transport;
- aiohttp (a connection handed over to it, or the application served by aiohttp alone): aiohttp's
  public ``web.Response`` / ``web.StreamResponse``. A stream prepared by the handler is written
  through a ``web.StreamResponse`` prepared on that request; a reply returned unprepared is turned
  into aiohttp's response by :func:`aiohttp_replies`, the application's middleware.

Handlers use the same calls either way: ``prepare(request)``, ``write(data)`` (streams),
``write_eof(data)``, and read ``status``, ``headers``, ``prepared``, ``keep_alive``.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, TypeAlias

from aiohttp import web
from multidict import CIMultiDict

from proxy.server.request import RawRequest, ReplyWriter

__all__ = ["Answer", "BodyReply", "ClientReply", "StreamReply", "aiohttp_replies", "json_reply"]

JSON_CONTENT_TYPE = "application/json"


class ClientReply:
    """What the two kinds of answer share: status, headers, keep-alive, and where they are written."""

    __slots__ = ("status", "headers", "keep_alive", "_raw", "_aiohttp")

    def __init__(self, status: int = 200, headers: Mapping[str, str] | None = None) -> None:
        if not 100 <= status <= 999:
            raise ValueError(f"HTTP status {status!r} is not a three-digit status code")
        self.status = status
        self.headers: CIMultiDict[str] = CIMultiDict(headers or {})
        #: False: close the connection after this answer; None: as the request asks.
        self.keep_alive: bool | None = None
        self._raw: ReplyWriter | None = None
        self._aiohttp: web.StreamResponse | None = None

    @property
    def content_type(self) -> str | None:
        """The media type of ``Content-Type`` (without its parameters), or None."""
        value = self.headers.get("Content-Type")
        return value.split(";", 1)[0].strip() if value is not None else None

    @property
    def prepared(self) -> bool:
        """Whether :meth:`prepare` ran (the status line and headers are committed)."""
        return self._raw is not None or self._aiohttp is not None

    def force_close(self) -> None:
        """Close the connection after this answer."""
        self.keep_alive = False

    async def prepare(self, request: RawRequest | web.BaseRequest) -> None:
        """Commit the status and headers for ``request`` (again: nothing happens)."""
        if self.prepared:
            return
        if isinstance(request, RawRequest):
            self._raw = request.writer
            self._start_raw(request.writer)
            return
        response = self._to_aiohttp()
        await response.prepare(request)
        self._aiohttp = response

    async def write_eof(self, data: bytes = b"") -> None:
        """End the answer (with ``data`` as its last bytes)."""
        raise NotImplementedError

    def for_aiohttp(self) -> web.StreamResponse:
        """The aiohttp response that carries this reply (the one prepared, or a new one)."""
        if self._aiohttp is not None:
            return self._aiohttp
        if self._raw is not None:
            raise RuntimeError(f"HTTP {self.status} reply was prepared on the raw server: aiohttp cannot send it")
        return self._to_aiohttp()

    def _start_raw(self, writer: ReplyWriter) -> None:
        raise NotImplementedError

    def _to_aiohttp(self) -> web.StreamResponse:
        raise NotImplementedError


class BodyReply(ClientReply):
    """A whole answer: one body, sent with its ``Content-Length``."""

    __slots__ = ("body",)

    def __init__(self, body: bytes = b"", status: int = 200, headers: Mapping[str, str] | None = None) -> None:
        super().__init__(status, headers)
        self.body = bytes(body)

    def _start_raw(self, writer: ReplyWriter) -> None:
        writer.start(self.status, self.headers, len(self.body), self.keep_alive, flush_soon=False)

    def _to_aiohttp(self) -> web.StreamResponse:
        response = web.Response(body=self.body, status=self.status, headers=self.headers)
        if self.keep_alive is False:
            response.force_close()
        return response

    async def write_eof(self, data: bytes = b"") -> None:
        if data:
            raise ValueError(f"a BodyReply's body is fixed ({len(self.body)} bytes); write_eof got {len(data)} more")
        if self._raw is not None:
            await self._raw.write_eof(self.body)
        elif self._aiohttp is not None:
            await self._aiohttp.write_eof()
        else:
            raise RuntimeError("write_eof() before prepare()")


class StreamReply(ClientReply):
    """An answer written piece by piece (chunked on HTTP/1.1), e.g. an SSE stream."""

    __slots__ = ()

    def _start_raw(self, writer: ReplyWriter) -> None:
        length = self.headers.get("Content-Length")
        size = int(length) if length is not None and length.isdigit() else None
        writer.start(self.status, self.headers, size, self.keep_alive, flush_soon=True)

    def _to_aiohttp(self) -> web.StreamResponse:
        response = web.StreamResponse(status=self.status, headers=self.headers)
        if self.keep_alive is False:
            response.force_close()
        return response

    async def write(self, data: bytes) -> None:
        """Send ``data`` (waits while the client's buffer is full; ConnectionResetError once it is gone)."""
        if self._raw is not None:
            await self._raw.write(data)
        elif self._aiohttp is not None:
            await self._aiohttp.write(data)
        else:
            raise RuntimeError("write() before prepare()")

    async def write_eof(self, data: bytes = b"") -> None:
        if self._raw is not None:
            await self._raw.write_eof(data)
        elif self._aiohttp is not None:
            await self._aiohttp.write_eof(data)
        else:
            raise RuntimeError("write_eof() before prepare()")


#: What a handler on an aiohttp route may return.
Answer: TypeAlias = ClientReply | web.StreamResponse


def json_reply(payload: Any, status: int = 200, headers: Mapping[str, str] | None = None) -> BodyReply:
    """A JSON answer (compact separators, UTF-8)."""
    body = json.dumps(payload, ensure_ascii=False, separators=(",", ":")).encode()
    reply = BodyReply(body, status, headers)
    reply.headers["Content-Type"] = JSON_CONTENT_TYPE
    return reply


@web.middleware
async def aiohttp_replies(
    request: web.Request, handler: Callable[[web.Request], Awaitable[Answer]]
) -> web.StreamResponse:
    """aiohttp middleware: a handler's :class:`ClientReply` as the aiohttp response that carries it."""
    answer = await handler(request)
    return answer.for_aiohttp() if isinstance(answer, ClientReply) else answer
