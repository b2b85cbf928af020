"""Limits of the Router's own HTTP server (proxy/server/hot_connection.py), over raw sockets.

A real ``python -m proxy`` (short deadlines) for the head size, header and body deadlines,
slowloris, pipelining and the 413; the server object in-process for the write deadline (a
handler that streams until its client's buffers are full) and for paused reading.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

from aiohttp import web

from proxy.server.hot_server import HotServer
from proxy.server.limits import MAX_HEAD_BYTES, ServerLimits
from proxy.server.reply import StreamReply, json_reply
from tests.support.raw_http import RawConnection, json_body, raw_post
from tests.support.router_rig import HOST, Backends, RouterFactory, new_rid

LIMIT_FLAGS = ("--header-timeout", "1", "--body-timeout", "1", "--max-body-size", "2000")
#: What a deadline of 1 s may take on a busy 2-core machine.
SLACK_S = 4.0


def _router_port(backends: Backends, router_factory: RouterFactory) -> int:
    return router_factory(backends.ok_p, backends.ok_d, *LIMIT_FLAGS).proc.port


def _status_then_closed(conn: RawConnection, within: float) -> int:
    """The status of the answer the server sends (0: none), after which it must close within ``within`` s."""
    conn.sock.settimeout(within)
    line = conn.file.readline()
    status = int(line.split()[1]) if line.startswith(b"HTTP/1.1 ") else 0
    while conn.file.read(4096):
        pass  # the rest of the answer, then EOF (a timeout here fails the test)
    return status


def _normal_request_ok(port: int) -> None:
    conn = RawConnection(port)
    try:
        conn.send(raw_post("/v1/completions", json_body("/v1/completions"), new_rid("limits-ok")))
        status, _, body = conn.answer()
        assert status == 200, body
        assert json.loads(body)["choices"]
    finally:
        conn.close()


def test_head_over_16_kib_is_431_whole_or_still_arriving(backends: Backends, router_factory: RouterFactory) -> None:
    port = _router_port(backends, router_factory)
    conn = RawConnection(port)
    try:  # a complete head, too large
        conn.send(raw_post("/v1/completions", b"{}", new_rid("limits-431"), f"X-Big: {'a' * MAX_HEAD_BYTES}\r\n"))
        assert _status_then_closed(conn, SLACK_S) == 431
    finally:
        conn.close()
    conn = RawConnection(port)
    try:  # a head that never ends, fed in pieces faster than the header deadline
        conn.send(b"POST /v1/completions HTTP/1.1\r\nHost: router\r\nX-Endless: ")
        sent = 0
        try:
            while sent < 4 * MAX_HEAD_BYTES:
                time.sleep(0.02)
                conn.send(b"b" * 4096)
                sent += 4096
        except OSError:
            pass  # closed by the Router while sending: what is expected
        assert sent <= 2 * MAX_HEAD_BYTES + 4096, sent
        assert _status_then_closed(conn, SLACK_S) == 431
    finally:
        conn.close()
    _normal_request_ok(port)


def test_header_deadline_answers_408_and_closes(backends: Backends, router_factory: RouterFactory) -> None:
    port = _router_port(backends, router_factory)
    conn = RawConnection(port)
    try:
        t0 = time.monotonic()
        conn.send(b"POST /v1/completions HTTP/1.1\r\nHost: rou")
        assert _status_then_closed(conn, 1 + SLACK_S) == 408
        assert 0.8 <= time.monotonic() - t0 <= 1 + SLACK_S
    finally:
        conn.close()


def test_body_deadline_answers_408_and_closes(backends: Backends, router_factory: RouterFactory) -> None:
    port = _router_port(backends, router_factory)
    conn = RawConnection(port)
    try:
        body = json_body("/v1/completions")
        conn.send(raw_post("/v1/completions", body, new_rid("limits-body"))[: -len(body) // 2])
        t0 = time.monotonic()
        time.sleep(0.5)
        conn.send(body[len(body) // 2 : len(body) // 2 + 1])  # progress resets the deadline
        assert _status_then_closed(conn, 1.5 + SLACK_S) == 408
        assert 1.3 <= time.monotonic() - t0 <= 1.5 + SLACK_S
    finally:
        conn.close()


def test_slowloris_connections_are_all_closed_and_the_router_serves_meanwhile(
    backends: Backends, router_factory: RouterFactory
) -> None:
    port = _router_port(backends, router_factory)
    socks = []
    try:
        t0 = time.monotonic()
        for _ in range(200):
            sock = socket.create_connection((HOST, port), timeout=10)
            sock.sendall(b"P")
            socks.append(sock)
        _normal_request_ok(port)  # served while 200 heads hang
        for sock in socks:
            sock.settimeout(max(0.1, t0 + 1 + SLACK_S + 2 - time.monotonic()))
            while sock.recv(4096):
                pass  # the 408, then EOF; a timeout fails the test
        assert time.monotonic() - t0 <= 1 + SLACK_S + 2
        _normal_request_ok(port)
    finally:
        for sock in socks:
            sock.close()


def test_bytes_that_begin_no_request_are_closed_too(backends: Backends, router_factory: RouterFactory) -> None:
    port = _router_port(backends, router_factory)
    conn = RawConnection(port)
    try:
        conn.send(b"\r\n")
        assert _status_then_closed(conn, 1 + SLACK_S) == 0
    finally:
        conn.close()


def test_over_limit_body_is_413_at_once_without_reading_it(backends: Backends, router_factory: RouterFactory) -> None:
    port = _router_port(backends, router_factory)
    conn = RawConnection(port)
    try:  # announced: answered before any body byte is sent
        head = "POST /v1/completions HTTP/1.1\r\nHost: router\r\nContent-Length: 100000000\r\n\r\n"
        conn.send(head.encode())
        assert _status_then_closed(conn, SLACK_S) == 413
    finally:
        conn.close()
    conn = RawConnection(port)
    try:  # chunked: answered once the body grows over the limit, the rest never read
        conn.send(b"POST /v1/completions HTTP/1.1\r\nHost: router\r\nTransfer-Encoding: chunked\r\n\r\n")
        conn.send(b"%x\r\n%b\r\n" % (3000, b"x" * 3000))
        assert _status_then_closed(conn, SLACK_S) == 413
    finally:
        conn.close()
    conn = RawConnection(port)
    try:  # with Expect: 100-continue, no 100 goes out
        head = "POST /v1/completions HTTP/1.1\r\nHost: router\r\nExpect: 100-continue\r\nContent-Length: 5000\r\n\r\n"
        conn.send(head.encode())
        assert _status_then_closed(conn, SLACK_S) == 413
    finally:
        conn.close()
    _normal_request_ok(port)


def test_at_most_one_pipelined_request_waits(backends: Backends, router_factory: RouterFactory) -> None:
    port = _router_port(backends, router_factory)
    conn = RawConnection(port)
    try:
        rids = [new_rid(f"limits-pipe{i}") for i in range(4)]
        conn.send(b"".join(raw_post("/v1/completions", json_body("/v1/completions"), rid) for rid in rids))
        for rid in rids[:2]:  # the one answered and the one waiting
            status, headers, body = conn.answer()
            assert (status, headers["x-request-id"]) == (200, rid), body
        assert conn.closed_by_peer()  # the others were not taken
    finally:
        conn.close()


# -- the server object in-process --------------------------------------------------------------


async def _serve(handler, limits: ServerLimits) -> tuple[asyncio.Server, HotServer]:  # type: ignore[no-untyped-def]
    aiohttp_server = web.Server(lambda request: web.Response(status=404))
    hot = HotServer({"/v1/completions": handler}, aiohttp_server, 1 << 20, limits)
    server = await asyncio.get_running_loop().create_server(hot, HOST, 0)
    return server, hot


def test_write_deadline_cuts_a_client_that_stops_reading() -> None:
    limits = ServerLimits(header_timeout=5, body_timeout=5, write_timeout=0.5)
    cancelled: list[float] = []

    async def endless(request):  # type: ignore[no-untyped-def]
        response = StreamReply(200, {"Content-Type": "text/event-stream"})
        await response.prepare(request)
        try:
            while True:
                await response.write(b"data: " + b"x" * 65536 + b"\n\n")
        except asyncio.CancelledError:
            cancelled.append(time.monotonic())  # what closes the backend requests in the Router
            raise

    async def main() -> None:
        server, hot = await _serve(endless, limits)
        port = server.sockets[0].getsockname()[1]
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.setblocking(False)
        await asyncio.get_running_loop().sock_connect(sock, (HOST, port))
        await asyncio.get_running_loop().sock_sendall(sock, raw_post("/v1/completions", b"{}", "rid-w"))
        t0 = time.monotonic()
        try:
            async with asyncio.timeout(10):
                while not cancelled:
                    await asyncio.sleep(0.05)
            assert cancelled[0] - t0 < 0.5 + SLACK_S
            assert not hot.connections  # the connection is gone
        finally:
            sock.close()
            server.close()

    asyncio.run(main())


def test_reading_pauses_while_one_request_waits() -> None:
    release = threading.Event()
    served: list[str] = []

    async def slow(request):  # type: ignore[no-untyped-def]
        while not release.is_set():
            await asyncio.sleep(0.02)
        served.append(request.headers["X-Request-Id"])
        return json_reply({"ok": True})

    async def main() -> None:
        server, hot = await _serve(slow, ServerLimits())
        port = server.sockets[0].getsockname()[1]
        reader, writer = await asyncio.open_connection(HOST, port)
        try:
            for i in range(3):  # three writes: the first served, the second waits, the third stays unread
                writer.write(raw_post("/v1/completions", b"{}", f"r{i}"))
                await writer.drain()
                await asyncio.sleep(0.2)
            (conn,) = hot.connections
            assert len(conn._queue) == 1
            assert conn.transport is not None and not conn.transport.is_reading()
            release.set()
            for _ in range(3):
                line = await asyncio.wait_for(reader.readline(), 5)
                assert line.startswith(b"HTTP/1.1 200"), line
                length = 0
                while (header := await reader.readline()) != b"\r\n":
                    if header.lower().startswith(b"content-length:"):
                        length = int(header.split(b":")[1])
                await reader.readexactly(length)
            assert served == ["r0", "r1", "r2"]
        finally:
            writer.close()
            server.close()

    asyncio.run(main())
