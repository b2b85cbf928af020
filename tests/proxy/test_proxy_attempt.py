"""One attempt on one P/D pair (proxy/request/attempt.py), in process, against small asyncio servers.

P and D run as two tasks; the caller awaits D's answer and P's failure together, so a failing P
ends the attempt without cancelling the caller (only a client going away does that).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

import pytest

from proxy.request.attempt import Answered, Attempt, AttemptState, Call, Opened
from proxy.router_config import Backend, RouterConfig
from proxy.router_state import Router
from proxy.upstream.calls import Failure, FailureKind
from proxy.upstream.http1 import UpstreamError

HOST = "127.0.0.1"
Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


async def _read_request(reader: asyncio.StreamReader) -> None:
    head = await reader.readuntil(b"\r\n\r\n")
    length = next(
        (int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length:")), 0
    )
    await reader.readexactly(length)


def fail500(delay: float = 0.0) -> Handler:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        await asyncio.sleep(delay)
        writer.write(b"HTTP/1.1 500 Internal Server Error\r\nContent-Length: 4\r\n\r\nboom")
        await writer.drain()
        await reader.read()

    return handler


def hang(closed: list[bool]) -> Handler:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        await reader.read()  # until the Router closes the connection
        closed.append(True)

    return handler


def answer(stream: bool) -> Handler:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        if not stream:
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}")
        else:
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n")
            writer.write(b"9\r\ndata: 0\n\n\r\n")
        await writer.drain()
        await reader.read()

    return handler


def _run(p: Handler, d: Handler, test: Callable[[Router], Awaitable[None]], stream: bool = False) -> None:
    async def main() -> None:
        servers = [await asyncio.start_server(h, HOST, 0) for h in (p, d)]
        p_port, d_port = (s.sockets[0].getsockname()[1] for s in servers)
        config = RouterConfig((Backend("prefill", HOST, p_port, 18800),), (Backend("decode", HOST, d_port),))
        router = Router(config)
        try:
            async with asyncio.timeout(5):
                await test(router)
        finally:
            for task in list(router.tasks):
                task.cancel()
            router.http.close()
            for server in servers:
                server.close()

    asyncio.run(main())


def _attempt(router: Router, stream: bool = False) -> Attempt:
    call = Call("/v1/completions", "rid-1", {"prompt": "hi", "stream": stream}, stream, 7, {"X-Request-Id": "rid-1"})
    p, d = router.pool.active["prefill"][0], router.pool.active["decode"][0]
    return Attempt(router, call, p, d, room=42, timeout=5)


def _in_flight(router: Router) -> list[tuple[int, int]]:
    return [(s.in_flight, s.in_flight_tokens) for s in router.pool.all_states()]


def test_failing_prefill_ends_the_attempt_without_cancelling_the_caller() -> None:
    d_closed: list[bool] = []

    async def test(router: Router) -> None:
        attempt = _attempt(router)
        assert _in_flight(router) == [(1, 7), (1, 0)]  # leases taken when the attempt is made
        outcome = await attempt.run()
        assert isinstance(outcome, Failure) and outcome.state is attempt.p and outcome.kind is FailureKind.HTTP_5XX
        task = asyncio.current_task()
        assert task is not None and task.cancelling() == 0
        assert attempt.d_task is not None and not attempt.d_task.done()  # D is still waiting
        attempt.close()
        attempt.close()  # idempotent
        for _ in range(100):
            if d_closed:
                break
            await asyncio.sleep(0.01)
        assert d_closed, "closing the attempt closes D's connection"
        assert attempt.state is AttemptState.CLOSED
        assert _in_flight(router) == [(0, 0), (0, 0)]

    _run(fail500(), hang(d_closed), test)


def test_answered_attempt_leaves_prefill_running_and_logs_its_failure(caplog: pytest.LogCaptureFixture) -> None:
    async def test(router: Router) -> None:
        attempt = _attempt(router)
        outcome = await attempt.run()
        assert isinstance(outcome, Answered) and outcome.body == b"{}"
        assert attempt.state is AttemptState.ANSWERED
        attempt.close()
        assert _in_flight(router) == [(1, 7), (0, 0)]  # P detached, still in flight
        assert attempt.p_task is not None
        with caplog.at_level(logging.ERROR, logger="proxy"):
            await asyncio.wait([attempt.p_task])
            await asyncio.sleep(0)
        assert _in_flight(router) == [(0, 0), (0, 0)]
        assert any("rid=rid-1 room=42 prefill failed after D had answered" in r.message for r in caplog.records)

    _run(fail500(delay=0.2), answer(stream=False), test)


def test_prefill_failing_while_d_streams_closes_the_stream() -> None:
    async def test(router: Router) -> None:
        attempt = _attempt(router, stream=True)
        outcome = await attempt.run()
        assert isinstance(outcome, Opened) and outcome.first == b"data: 0\n\n"
        assert attempt.state is AttemptState.STREAMING
        with pytest.raises(UpstreamError):
            while await outcome.response.next_chunk():
                pass
        assert attempt.late_p_failure is not None and attempt.late_p_failure.kind is FailureKind.HTTP_5XX
        attempt.close()
        await asyncio.sleep(0)
        assert _in_flight(router) == [(0, 0), (0, 0)]

    _run(fail500(delay=0.2), answer(stream=True), test)


def test_closing_a_waiting_attempt_cancels_both_requests() -> None:
    p_closed: list[bool] = []
    d_closed: list[bool] = []

    async def test(router: Router) -> None:
        attempt = _attempt(router)
        runner = asyncio.create_task(attempt.run())
        await asyncio.sleep(0.1)
        runner.cancel()  # the client went away
        with pytest.raises(asyncio.CancelledError):
            await runner
        attempt.close()
        for _ in range(100):
            if p_closed and d_closed:
                break
            await asyncio.sleep(0.01)
        assert p_closed and d_closed
        assert _in_flight(router) == [(0, 0), (0, 0)]

    _run(hang(p_closed), hang(d_closed), test)
