"""The Router's HTTP/1.1 server: raw asyncio + httptools for the generation endpoints, aiohttp for the rest.

Every client connection starts on a :class:`proxy.server.hot_connection.HotConnection`. ``POST
/v1/completions`` and ``POST /v1/chat/completions`` (the *hot* routes) are parsed by httptools and
served right there: the same handlers aiohttp has for them (auth, request id, body limit, the
exchange) get a :class:`proxy.server.request.RawRequest`, and the
:class:`proxy.server.reply.ClientReply` they answer with is framed by the connection's own
:class:`proxy.server.request.ReplyWriter`; no aiohttp object is involved. Any other request hands
the connection, with the bytes of that request, to aiohttp's own protocol for the rest of its life,
so every other route keeps aiohttp's behaviour exactly (its head was checked here first).

The hand-over uses aiohttp's public API only, which is why it is kept rather than re-implementing
the other routes: ``AppRunner.server`` is a ``web.Server``, documented as a protocol factory for
``loop.create_server``; one protocol it makes is given the transport with asyncio's own
``transport.set_protocol`` and the ``asyncio.Protocol`` calls ``connection_made`` and
``data_received`` (the request's bytes read so far). aiohttp's routes get the handlers'
``ClientReply`` objects through the application's middleware (:func:`proxy.server.reply.aiohttp_replies`).
tests/proxy/test_aiohttp_contract.py checks each of these on the aiohttp versions setup.py allows.

Kept from aiohttp's server: keep-alive (75 s idle timeout), ``Expect: 100-continue``, HTTP 400
on a malformed request, handler cancellation (a client that goes away cancels its handler task,
which closes both backend requests: vLLM aborts them), TLS (the listening socket's SSL context),
and a graceful stop (in-flight requests get ``SHUTDOWN_TIMEOUT_S``). Added: the limits of
:mod:`proxy.server.hot_connection` (16 KiB head, header, body and write deadlines, one pipelined request
waiting, a body over ``--max-body-size`` answered 413 without being read).

Not supported: a non-generation request *pipelined* behind another request on one connection
(sent before the previous answer ended); the connection is closed after the answers in flight.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import signal
import ssl

from aiohttp import web

from proxy.server.hot_connection import HotConnection, HotHandler
from proxy.server.limits import ServerLimits

__all__ = ["HotConnection", "HotServer", "ServerLimits", "serve"]

logger = logging.getLogger("proxy")

#: Allocations between two collections of the young generation (CPython's default: 700).
GC_THRESHOLD = 10_000
#: Seconds an idle keep-alive connection stays open (aiohttp's default).
KEEPALIVE_TIMEOUT_S = 75.0


class HotServer:
    """What every connection shares: the hot routes, aiohttp's protocol factory, the open connections."""

    def __init__(
        self,
        hot: dict[str, HotHandler],
        aiohttp_server: web.Server,
        max_body_size: int,
        limits: ServerLimits | None = None,
    ) -> None:
        self.hot = hot
        self.aiohttp_server = aiohttp_server
        self.max_body_size = max_body_size
        self.limits = limits or ServerLimits()
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
                transport = connection.transport
                if transport is not None and transport.get_write_buffer_size():
                    connection.abort()  # an answer its client never read: close() would wait for it
                else:
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


async def serve(
    app: web.Application,
    hot: dict[str, HotHandler],
    *,
    host: str,
    port: int,
    reuse_port: bool,
    ssl_context: ssl.SSLContext | None,
    shutdown_timeout: float,
    limits: ServerLimits | None = None,
    backlog: int = 2048,
    max_body_size: int,
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
    hot_server = HotServer(hot, runner.server, max_body_size, limits)
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
