"""The public aiohttp behaviour the Router relies on (setup.py's aiohttp range is the one these pass on).

The Router writes its generation answers itself (proxy/server/reply.py) and uses aiohttp, through
its public API only, for everything else:

- ``web.AppRunner(..., handler_cancellation=True, shutdown_timeout=...)`` and its ``server``, a
  ``web.Server``: a protocol factory whose protocol takes over a connection the raw server
  already read a request from (``transport.set_protocol``, ``connection_made``, ``data_received``),
  and keeps it alive for the next requests;
- middlewares (``web.middleware``): :func:`proxy.server.reply.aiohttp_replies` turns a handler's
  ``ClientReply`` into ``web.Response`` / ``web.StreamResponse``, and a stream prepared by the
  handler is written through ``StreamResponse.prepare`` / ``write`` / ``write_eof``;
- ``web.Request.read()`` raising ``web.HTTPRequestEntityTooLarge`` over ``client_max_size``;
- handler cancellation: a client that goes away cancels its handler.

Run under each aiohttp of the range: ``PYTHONPATH=<aiohttp X.Y's site dir> python -m pytest tests/proxy``.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path

import aiohttp
from aiohttp import web

from proxy.server.reply import BodyReply, StreamReply, aiohttp_replies, json_reply

SETUP_PY = Path(__file__).resolve().parents[2] / "setup.py"
HOST = "127.0.0.1"


def _pinned_range() -> tuple[tuple[int, ...], tuple[int, ...]]:
    found = re.search(r'"aiohttp>=([0-9.]+),<([0-9.]+)"', SETUP_PY.read_text())
    assert found, "setup.py does not give aiohttp a range (>=X,<Y)"
    return tuple(map(int, found.group(1).split("."))), tuple(map(int, found.group(2).split(".")))


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in re.findall(r"\d+", text)[:3])


def test_installed_aiohttp_is_in_the_tested_range() -> None:
    low, high = _pinned_range()
    have = _version(aiohttp.__version__)
    assert low <= have < high, f"aiohttp {aiohttp.__version__} is outside the tested range >={low},<{high} (setup.py)"


class _HandOver(asyncio.Protocol):
    """What the Router's raw server does for a route it does not serve: give the connection, with
    the bytes it read, to aiohttp's protocol."""

    def __init__(self, server: web.Server) -> None:
        self.server = server
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        assert self.transport is not None
        protocol = self.server()
        assert isinstance(protocol, asyncio.Protocol), type(protocol)
        self.transport.set_protocol(protocol)
        protocol.connection_made(self.transport)
        protocol.data_received(data)


@asynccontextmanager
async def _served(app: web.Application) -> AsyncIterator[int]:
    runner = web.AppRunner(app, handle_signals=False, access_log=None, handler_cancellation=True, shutdown_timeout=1)
    await runner.setup()
    assert isinstance(runner.server, web.Server)
    server = runner.server
    listener = await asyncio.get_running_loop().create_server(lambda: _HandOver(server), HOST, 0)
    try:
        yield listener.sockets[0].getsockname()[1]
    finally:
        listener.close()
        await runner.cleanup()


async def _answer(reader: asyncio.StreamReader) -> tuple[bytes, bytes]:
    """One whole answer (Content-Length or chunked): its head and its body as sent on the wire."""
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
    found = re.search(rb"(?i)\r\ncontent-length: *(\d+)", head)
    if found:
        return head, await reader.readexactly(int(found.group(1)))
    body = b""
    while not body.endswith(b"\r\n0\r\n\r\n") and body != b"0\r\n\r\n":
        body += await asyncio.wait_for(reader.read(65536), 5)
    return head, body


def _app(**routes: Callable[[web.Request], Awaitable[object]]) -> web.Application:
    app = web.Application(client_max_size=16, middlewares=[aiohttp_replies])
    for name, handler in routes.items():
        app.router.add_route("*", f"/{name}", handler)  # type: ignore[arg-type]
    return app


async def _body(_request: web.Request) -> BodyReply:
    return json_reply({"ok": True}, 201, {"X-Request-Id": "r1"})


async def _stream(request: web.Request) -> StreamReply:
    reply = StreamReply(200, {"Content-Type": "text/event-stream"})
    await reply.prepare(request)
    await reply.write(b"data: 1\n\n")
    await reply.write_eof(b"data: [DONE]\n\n")
    return reply


async def _unprepared_stream(_request: web.Request) -> StreamReply:
    return StreamReply(200, {"Content-Type": "text/plain"})


async def _read(request: web.Request) -> BodyReply:
    try:
        await request.read()
    except web.HTTPRequestEntityTooLarge:
        return json_reply({"too_large": True}, 413)
    return json_reply({"too_large": False})


def test_handed_over_connection_serves_replies_and_stays_alive() -> None:
    async def main() -> None:
        app = _app(body=_body, stream=_stream, empty=_unprepared_stream, read=_read)
        async with _served(app) as port:
            reader, writer = await asyncio.open_connection(HOST, port)
            try:
                writer.write(b"GET /body HTTP/1.1\r\nHost: r\r\n\r\n")  # the bytes the raw server read
                head, body = await _answer(reader)
                assert head.startswith(b"HTTP/1.1 201"), head
                assert b"Content-Type: application/json" in head and b"X-Request-Id: r1" in head, head
                assert body == b'{"ok":true}', body
                writer.write(b"POST /stream HTTP/1.1\r\nHost: r\r\nContent-Length: 0\r\n\r\n")  # same connection
                head, body = await _answer(reader)
                assert b"Transfer-Encoding: chunked" in head, head
                assert body == b"9\r\ndata: 1\n\n\r\ne\r\ndata: [DONE]\n\n\r\n0\r\n\r\n", body
                writer.write(b"GET /empty HTTP/1.1\r\nHost: r\r\n\r\n")
                head, body = await _answer(reader)
                assert head.startswith(b"HTTP/1.1 200") and b"Content-Type: text/plain" in head, head
                writer.write(b"POST /read HTTP/1.1\r\nHost: r\r\nContent-Length: 17\r\n\r\n" + b"x" * 17)
                head, body = await _answer(reader)
                assert head.startswith(b"HTTP/1.1 413") and body == b'{"too_large":true}', (head, body)
            finally:
                writer.close()

    asyncio.run(main())


def test_a_client_that_goes_away_cancels_its_handler() -> None:
    started, cancelled = asyncio.Event(), asyncio.Event()

    async def forever(_request: web.Request) -> BodyReply:
        started.set()
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            cancelled.set()
            raise
        return BodyReply(b"late")

    async def main() -> None:
        async with _served(_app(forever=forever)) as port:
            _, writer = await asyncio.open_connection(HOST, port)
            writer.write(b"GET /forever HTTP/1.1\r\nHost: r\r\n\r\n")
            await asyncio.wait_for(started.wait(), 5)
            writer.close()
            await asyncio.wait_for(cancelled.wait(), 5)

    asyncio.run(main())
