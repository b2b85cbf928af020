"""The Router's own HTTP/1.1 client (proxy/upstream/http1.py) and its one-shot calls (proxy/upstream/calls.py: fetch,
probe) against small in-process asyncio servers."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Awaitable, Callable

import pytest

from proxy.router_config import Backend
from proxy.upstream.calls import Failure, FailureKind, Reply, fetch, probe
from proxy.upstream.http1 import READ_HIGH_WATER, ConnectFailed, ConnectionBroken, ConnState, Http1Pool, UpstreamTimeout
from proxy.upstream.pool import BackendState

HOST = "127.0.0.1"
Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


async def _read_request(reader: asyncio.StreamReader) -> tuple[bytes, bytes] | None:
    """One request: (head, body), or None at EOF."""
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except asyncio.IncompleteReadError:
        return None
    length = 0
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            length = int(line.split(b":", 1)[1])
    return head, await reader.readexactly(length)


def _run(handler: Handler, test: Callable[[Http1Pool, int, list[int]], Awaitable[None]], timeout: float = 5) -> None:
    """Serve ``handler`` on a free port and run ``test(pool, port, connections)``."""

    async def main() -> None:
        connections: list[int] = []

        async def on_connect(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            connections.append(1)
            try:
                await handler(reader, writer)
            finally:
                writer.close()

        server = await asyncio.start_server(on_connect, HOST, 0)
        port = server.sockets[0].getsockname()[1]
        pool = Http1Pool(connect_timeout=2)
        try:
            async with asyncio.timeout(timeout):
                await test(pool, port, connections)
        finally:
            pool.close()
            server.close()

    asyncio.run(main())


def _json_server(body: bytes = b'{"ok": true}') -> Handler:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while await _read_request(reader) is not None:
            writer.write(
                b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
            )
            await writer.drain()

    return handler


def test_json_response_and_connection_reuse() -> None:
    async def test(pool: Http1Pool, port: int, connections: list[int]) -> None:
        for _ in range(3):
            response = await pool.post(HOST, port, "/v1/completions", b"{}", {"X-Request-Id": "r1"}, 5)
            assert response.status == 200
            assert response.content_type == "application/json"
            assert await response.read() == b'{"ok": true}'
            response.release()
        assert len(connections) == 1

    _run(_json_server(), test)


def test_request_carries_headers_and_body() -> None:
    seen: list[tuple[bytes, bytes]] = []

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        request = await _read_request(reader)
        assert request is not None
        seen.append(request)
        writer.write(b"HTTP/1.1 204 No Content\r\n\r\n")
        await writer.drain()

    async def test(pool: Http1Pool, port: int, connections: list[int]) -> None:
        headers = {"X-Request-Id": "abc\r\nEvil: 1", "Authorization": "Bearer k"}
        response = await pool.post(HOST, port, "/v1/chat/completions", b'{"a": 1}', headers, 5)
        assert response.status == 204 and await response.read() == b""
        response.release()

    _run(handler, test)
    head, body = seen[0]
    assert head.startswith(b"POST /v1/chat/completions HTTP/1.1\r\n")
    assert b"\r\nX-Request-Id: abc  Evil: 1\r\n" in head  # CR/LF cannot inject a header
    assert b"\r\nAuthorization: Bearer k\r\n" in head
    assert b"\r\nContent-Type: application/json\r\n" in head
    assert body == b'{"a": 1}'


def test_chunked_stream_is_decoded_chunk_by_chunk() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n")
        for i in range(3):
            data = b"data: %d\n\n" % i
            writer.write(b"%x\r\n%s\r\n" % (len(data), data))
            await writer.drain()
            await asyncio.sleep(0.02)
        writer.write(b"0\r\n\r\n")
        await writer.drain()
        await _read_request(reader)

    async def test(pool: Http1Pool, port: int, connections: list[int]) -> None:
        response = await pool.post(HOST, port, "/v1/completions", b"{}", {}, 5)
        assert response.content_type == "text/event-stream"
        received = []
        while chunk := await response.next_chunk():
            received.append(chunk)
        assert b"".join(received) == b"data: 0\n\ndata: 1\n\ndata: 2\n\n"
        assert response.at_eof()
        response.release()

    _run(handler, test)


def test_body_until_close() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nConnection: close\r\n\r\nall of it")
        await writer.drain()

    async def test(pool: Http1Pool, port: int, connections: list[int]) -> None:
        response = await pool.post(HOST, port, "/x", b"{}", {}, 5)
        assert await response.read() == b"all of it"
        response.release()

    _run(handler, test)


def test_connection_refused_is_connect_failed_and_a_connect_failure() -> None:
    with socket.socket() as sock:
        sock.bind((HOST, 0))
        port = sock.getsockname()[1]  # bound, not listening

    async def main() -> None:
        pool = Http1Pool(connect_timeout=2)
        with pytest.raises(ConnectFailed):
            await pool.post(HOST, port, "/x", b"{}", {}, 5)
        # Classified once, the same for every kind of call (fetch: health, models, admin, prefill).
        state = BackendState(Backend("prefill", HOST, port, 18800))
        failure = await fetch(pool, state, "GET", "/health", 5)
        assert isinstance(failure, Failure)
        assert (failure.kind, failure.error.status, failure.retryable) == (FailureKind.CONNECT, 503, True)
        assert failure.detail.startswith("ConnectFailed: ")
        healthy, status, error = await probe(pool, state, 5)
        assert (healthy, status) == (False, None) and error == failure.detail

    asyncio.run(main())


def test_close_mid_body_is_connection_broken() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n")
        await writer.drain()
        await asyncio.sleep(0.05)

    async def test(pool: Http1Pool, port: int, connections: list[int]) -> None:
        response = await pool.post(HOST, port, "/x", b"{}", {}, 5)
        assert await response.next_chunk() == b"hello"
        with pytest.raises(ConnectionBroken):
            await response.next_chunk()
        response.close()

    _run(handler, test)


def test_close_before_headers_is_connection_broken() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)

    async def test(pool: Http1Pool, port: int, connections: list[int]) -> None:
        with pytest.raises(ConnectionBroken):
            await pool.post(HOST, port, "/x", b"{}", {}, 5)

    _run(handler, test)


def test_invalid_response_is_connection_broken() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        writer.write(b"this is not HTTP\r\n\r\n")
        await writer.drain()
        await asyncio.sleep(0.5)

    async def test(pool: Http1Pool, port: int, connections: list[int]) -> None:
        with pytest.raises(ConnectionBroken):
            await pool.post(HOST, port, "/x", b"{}", {}, 5)

    _run(handler, test)


@pytest.mark.parametrize("phase", ["headers", "body"])
def test_deadline_covers_headers_and_body(phase: str) -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        if phase == "body":
            writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nok\r\n")
            await writer.drain()
        await reader.read()  # until the client closes

    async def test(pool: Http1Pool, port: int, connections: list[int]) -> None:
        loop = asyncio.get_running_loop()
        started = loop.time()
        with pytest.raises(UpstreamTimeout):
            response = await pool.post(HOST, port, "/x", b"{}", {}, 0.3)
            assert await response.next_chunk() == b"ok"
            await response.next_chunk()
        assert 0.25 < loop.time() - started < 2

    _run(handler, test)


def test_cancelled_request_closes_the_connection() -> None:
    closed = []

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        await reader.read()  # returns when the client closes
        closed.append(True)

    async def test(pool: Http1Pool, port: int, connections: list[int]) -> None:
        task = asyncio.create_task(pool.post(HOST, port, "/x", b"{}", {}, 5))
        await asyncio.sleep(0.1)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        for _ in range(50):
            if closed:
                break
            await asyncio.sleep(0.02)
        assert closed

    _run(handler, test)


def test_slow_reader_pauses_the_connection() -> None:
    total = 4 * READ_HIGH_WATER

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % total)
        block = b"x" * 65536
        for _ in range(total // len(block)):
            writer.write(block)
            await writer.drain()

    async def test(pool: Http1Pool, port: int, connections: list[int]) -> None:
        response = await pool.post(HOST, port, "/x", b"{}", {}, 10)
        await asyncio.sleep(0.3)  # the server writes; the client does not read
        assert response._buffered <= READ_HIGH_WATER + 2 * 65536 + 262144
        assert len(await response.read()) == total
        response.release()

    _run(handler, test, timeout=10)


def test_ipv6_backend() -> None:
    try:
        with socket.socket(socket.AF_INET6) as sock:
            sock.bind(("::1", 0))
    except OSError:
        pytest.skip("no IPv6 loopback here")
    seen: list[bytes] = []

    async def main() -> None:
        async def on_connect(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            request = await _read_request(reader)
            assert request is not None
            seen.append(request[0])
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
            await writer.drain()
            writer.close()

        server = await asyncio.start_server(on_connect, "::1", 0)
        port = server.sockets[0].getsockname()[1]
        pool = Http1Pool(connect_timeout=2)
        try:
            response = await pool.post("::1", port, "/x", b"{}", {}, 5)
            assert await response.read() == b"ok"
            response.release()
        finally:
            pool.close()
            server.close()

    asyncio.run(main())
    assert b"\r\nHost: [::1]:" in seen[0]


def _recording_server(seen: list[bytes], status: bytes = b"200 OK", body: bytes = b"ok") -> Handler:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while (request := await _read_request(reader)) is not None:
            seen.append(request[0] + request[1])
            writer.write(b"HTTP/1.1 %s\r\nContent-Length: %d\r\n\r\n%s" % (status, len(body), body))
            await writer.drain()

    return handler


def test_get_and_bodyless_post_and_connection_states() -> None:
    seen: list[bytes] = []

    async def test(pool: Http1Pool, port: int, connections: list[int]) -> None:
        response = await pool.request("GET", HOST, port, "/health", None, {"X-Request-Id": "h"}, 5)
        conn = response._conn
        assert conn is not None and conn.state is ConnState.BUSY
        assert (response.status, await response.read()) == (200, b"ok")
        response.release()
        assert conn.state is ConnState.IDLE
        response = await pool.request("POST", HOST, port, "/reset_prefix_cache?device=npu", None, {}, 5)
        assert response._conn is conn and conn.state is ConnState.BUSY  # the pooled connection, reused
        assert await response.read() == b"ok"
        response.close()
        assert conn.state is ConnState.CLOSED
        assert len(connections) == 1

    _run(_recording_server(seen), test)
    get, post = seen
    assert get.startswith(b"GET /health HTTP/1.1\r\n") and get.endswith(b"\r\nX-Request-Id: h\r\n\r\n")
    assert b"Content-Length" not in get and b"Content-Type" not in get
    assert post.startswith(b"POST /reset_prefix_cache?device=npu HTTP/1.1\r\n")
    assert post.endswith(b"\r\nContent-Length: 0\r\n\r\n")


@pytest.mark.parametrize(
    ("status", "expected"),
    [(b"200 OK", (True, 200, None)), (b"503 Service Unavailable", (False, 503, "HTTP 503"))],
)
def test_probe_reads_the_health_answer(status: bytes, expected: tuple[bool, int | None, str | None]) -> None:
    async def test(pool: Http1Pool, port: int, connections: list[int]) -> None:
        state = BackendState(Backend("decode", HOST, port))
        assert await probe(pool, state, 5) == expected
        reply = await fetch(pool, state, "GET", "/v1/models", 5)
        assert isinstance(reply, Reply) and reply.body == b"ok"

    _run(_recording_server([], status), test)


def test_fetch_timeout_names_the_nominal_timeout() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        await reader.read()  # never answers

    async def test(pool: Http1Pool, port: int, connections: list[int]) -> None:
        state = BackendState(Backend("decode", HOST, port))
        failure = await fetch(pool, state, "POST", "/v1/completions", 0.2, b"{}", {}, nominal_timeout=600)
        assert isinstance(failure, Failure)
        assert (failure.kind, failure.error.status, failure.retryable) == (FailureKind.TIMEOUT, 504, False)
        assert "request timeout 600s" in failure.error.message

    _run(handler, test)
