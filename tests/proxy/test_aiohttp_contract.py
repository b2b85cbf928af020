"""The part of aiohttp the Router's raw server relies on beyond its public API (setup.py pins it).

The hot server (proxy/server/hot_server.py) answers with aiohttp's own ``web.Response`` /
``web.StreamResponse`` but hands them a ``proxy.server.request.RawRequest``, so it relies on what
``StreamResponse.prepare`` reads from a request: ``_payload_writer`` (the writer it writes to) and
``_prepare_hook`` (aiohttp's ``on_response_prepare`` signal). These tests fail with a clear message on
an aiohttp that reads anything else, before any Router test does.
"""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

import aiohttp
from aiohttp import web
from aiohttp.http import HttpVersion11
from multidict import CIMultiDict

from proxy.server.request import RawRequest, ResponseWriter

SETUP_PY = Path(__file__).resolve().parents[2] / "setup.py"


class _Wire:
    """A connection that keeps what was sent."""

    def __init__(self) -> None:
        self.sent = bytearray()

    def send(self, data: bytes) -> None:
        self.sent += data

    def must_drain(self) -> bool:
        return False

    async def drain(self) -> None:
        return None


def _pinned_range() -> tuple[tuple[int, ...], tuple[int, ...]]:
    found = re.search(r'"aiohttp>=([0-9.]+),<([0-9.]+)"', SETUP_PY.read_text())
    assert found, "setup.py does not pin aiohttp to a range (>=X,<Y)"
    return tuple(map(int, found.group(1).split("."))), tuple(map(int, found.group(2).split(".")))


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in re.findall(r"\d+", text)[:3])


def test_installed_aiohttp_is_in_the_pinned_range() -> None:
    low, high = _pinned_range()
    have = _version(aiohttp.__version__)
    assert low <= have < high, f"aiohttp {aiohttp.__version__} is outside the tested range >={low},<{high} (setup.py)"


def _answer(response: web.StreamResponse, body: bytes | None = None) -> bytes:
    async def run() -> bytes:
        wire = _Wire()
        writer = ResponseWriter(wire, asyncio.get_running_loop())
        request = RawRequest(
            "POST", "/v1/completions", HttpVersion11, True, CIMultiDict(), "127.0.0.1", b"{}", 1024, writer
        )
        await response.prepare(request)  # type: ignore[arg-type]  # the contract under test
        if body is not None:
            await response.write(body)
        await response.write_eof()
        await asyncio.sleep(0)  # a held status line leaves within the loop iteration
        return bytes(wire.sent)

    return asyncio.run(run())


def test_a_response_prepared_with_a_raw_request_writes_through_its_writer() -> None:
    sent = _answer(web.json_response({"ok": True}))
    head, _, body = sent.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200 OK"), sent[:80]
    assert b"Content-Type: application/json" in head, head
    assert body == b'{"ok": true}', body


def test_a_stream_response_is_chunked_through_the_writer() -> None:
    stream = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    sent = _answer(stream, b"data: 1\n\n")
    head, _, body = sent.partition(b"\r\n\r\n")
    assert b"Transfer-Encoding: chunked" in head, head
    assert body == b"9\r\ndata: 1\n\n\r\n0\r\n\r\n", body
