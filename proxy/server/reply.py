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

A reply given a ``usage_path`` (the request's exchange sets it on D's answers) names the Router's path
in D's KV account (``usage.pd_kv``, pd_connector.api_server.usage) of a JSON answer and of a stream's
usage event (``choices`` empty): ``usage.pd_kv.path`` (``pd``, ``delta``, ``local``). An answer without
D's account is passed on as it is.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, TypeAlias

import msgspec
from aiohttp import web
from multidict import CIMultiDict

from pd_connector.accounting import ACCOUNT_KEY as USAGE_KV_KEY
from proxy.server.request import RawRequest, ReplyWriter

__all__ = ["Answer", "BodyReply", "ClientReply", "StreamReply", "aiohttp_replies", "json_reply"]

JSON_CONTENT_TYPE = "application/json"
_ACCOUNT = b'"' + USAGE_KV_KEY.encode() + b'"'
_ENCODER = msgspec.json.Encoder()
_DECODER = msgspec.json.Decoder()

#: Gives the path the request took, asked when an answer's usage passes (None: leave it).
UsagePath: TypeAlias = Callable[[], str | None]


def _with_path(payload: Any, path: str) -> bool:
    """Set ``usage.pd_kv.path`` in a decoded answer or event whose usage has D's account; whether it did
    (an answer without one, from a backend that keeps no account, stays as it is)."""
    usage = payload.get("usage") if isinstance(payload, dict) else None
    account = usage.get(USAGE_KV_KEY) if isinstance(usage, dict) else None
    if not isinstance(account, dict):
        return False
    account["path"] = path
    return True


def json_with_path(body: bytes, path: str) -> bytes:
    """A whole JSON answer with ``usage.pd_kv.path``; unchanged when it has no ``usage`` object."""
    if _ACCOUNT not in body:
        return body
    try:
        payload = _DECODER.decode(body)
    except msgspec.DecodeError:
        return body
    return _ENCODER.encode(payload) if _with_path(payload, path) else body


def sse_with_path(chunk: bytes, path: str) -> bytes:
    """SSE bytes whose usage event (``choices`` empty) has ``usage.pd_kv.path``; others unchanged."""
    if _ACCOUNT not in chunk:
        return chunk
    events = chunk.split(b"\n\n")
    changed = False
    for i, event in enumerate(events):
        if not event.startswith(b"data: {") or _ACCOUNT not in event:
            continue
        try:
            payload = _DECODER.decode(event[6:])
        except msgspec.DecodeError:
            continue
        if isinstance(payload, dict) and payload.get("choices") == [] and _with_path(payload, path):
            events[i] = b"data: " + _ENCODER.encode(payload)
            changed = True
    return b"\n\n".join(events) if changed else chunk


class ClientReply:
    """What the two kinds of answer share: status, headers, keep-alive, and where they are written."""

    __slots__ = ("status", "headers", "keep_alive", "usage_path", "_raw", "_aiohttp")

    def __init__(self, status: int = 200, headers: Mapping[str, str] | None = None) -> None:
        if not 100 <= status <= 999:
            raise ValueError(f"HTTP status {status!r} is not a three-digit status code")
        self.status = status
        self.headers: CIMultiDict[str] = CIMultiDict(headers or {})
        #: False: close the connection after this answer; None: as the request asks.
        self.keep_alive: bool | None = None
        #: The Router's path for ``usage.pd_kv.path`` (D's answers); None: usage is left as it is.
        self.usage_path: UsagePath | None = None
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
        self._before_start()
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

    def _before_start(self) -> None:
        """Called once as the reply is prepared, before its headers go."""

    def _start_raw(self, writer: ReplyWriter) -> None:
        raise NotImplementedError

    def _to_aiohttp(self) -> web.StreamResponse:
        raise NotImplementedError

    def _noted(self, data: bytes) -> bytes:
        """``data`` of a stream with the path in its usage event, when it carries one."""
        if self.usage_path is None or _ACCOUNT not in data:
            return data
        path = self.usage_path()
        return data if path is None else sse_with_path(data, path)


class BodyReply(ClientReply):
    """A whole answer: one body, sent with its ``Content-Length``."""

    __slots__ = ("body",)

    def __init__(self, body: bytes = b"", status: int = 200, headers: Mapping[str, str] | None = None) -> None:
        super().__init__(status, headers)
        self.body = bytes(body)

    def _before_start(self) -> None:
        if self.usage_path is not None and self.status == 200 and _ACCOUNT in self.body:
            path = self.usage_path()
            if path is not None:
                self.body = json_with_path(self.body, path)
                if "Content-Length" in self.headers:
                    self.headers["Content-Length"] = str(len(self.body))

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
        data = self._noted(data)
        if self._raw is not None:
            await self._raw.write(data)
        elif self._aiohttp is not None:
            await self._aiohttp.write(data)
        else:
            raise RuntimeError("write() before prepare()")

    async def write_eof(self, data: bytes = b"") -> None:
        data = self._noted(data)
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
