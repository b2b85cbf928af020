"""The Router's own answers on its raw server (proxy/server/reply.py, request.py): the bytes on the connection."""

from __future__ import annotations

import asyncio

import pytest
from multidict import CIMultiDict

from proxy.server.reply import BodyReply, ClientReply, StreamReply, json_reply
from proxy.server.request import RawRequest, ReplyWriter


class _Wire:
    """A connection that keeps each send."""

    def __init__(self) -> None:
        self.sends: list[bytes] = []

    def send(self, data: bytes) -> None:
        self.sends.append(data)

    def must_drain(self) -> bool:
        return False

    async def drain(self) -> None:
        return None


def _request(wire: _Wire, version: tuple[int, int] = (1, 1), keep_alive: bool = True) -> RawRequest:
    writer = ReplyWriter(wire, asyncio.get_running_loop(), version, keep_alive)
    return RawRequest("POST", "/v1/completions", version, keep_alive, CIMultiDict(), "127.0.0.1", b"{}", 1024, writer)


def _head(sent: bytes) -> tuple[str, dict[str, str], bytes]:
    head, _, body = sent.partition(b"\r\n\r\n")
    status, *lines = head.decode("latin-1").split("\r\n")
    return status, {k.lower(): v for k, v in (line.split(": ", 1) for line in lines)}, body


def _send(reply: ClientReply, *parts: bytes, **request: object) -> tuple[list[bytes], RawRequest]:
    async def run() -> tuple[list[bytes], RawRequest]:
        wire = _Wire()
        raw = _request(wire, **request)  # type: ignore[arg-type]
        await reply.prepare(raw)
        if isinstance(reply, StreamReply):
            for part in parts:
                await reply.write(part)
        await reply.write_eof()
        await asyncio.sleep(0)  # a held status line leaves within the loop iteration
        return wire.sends, raw

    return asyncio.run(run())


def test_a_body_reply_is_one_send_with_its_length() -> None:
    sends, raw = _send(json_reply({"ok": True}, 201, {"X-Request-Id": "r1"}))
    assert len(sends) == 1, sends
    status, headers, body = _head(sends[0])
    assert status == "HTTP/1.1 201 Created"
    assert headers["content-length"] == "11" and body == b'{"ok":true}', (headers, body)
    assert headers["content-type"] == "application/json" and headers["x-request-id"] == "r1", headers
    assert headers["server"] and headers["date"].endswith(" GMT"), headers
    assert "connection" not in headers and raw.writer.keep_alive


def test_a_stream_is_chunked_and_its_head_goes_with_the_first_event() -> None:
    sends, _ = _send(StreamReply(200, {"Content-Type": "text/event-stream"}), b"data: 1\n\n", b"data: 2\n\n")
    assert len(sends) == 3, sends
    status, headers, body = _head(sends[0])
    assert status == "HTTP/1.1 200 OK" and headers["transfer-encoding"] == "chunked", headers
    assert body == b"9\r\ndata: 1\n\n\r\n", body
    assert sends[1:] == [b"9\r\ndata: 2\n\n\r\n", b"0\r\n\r\n"]


def test_a_prepared_stream_sends_its_head_within_the_loop_iteration() -> None:
    async def run() -> list[bytes]:
        wire = _Wire()
        await StreamReply(200).prepare(_request(wire))
        assert wire.sends == []
        await asyncio.sleep(0)
        return wire.sends

    (head,) = asyncio.run(run())
    assert head.startswith(b"HTTP/1.1 200 OK\r\n") and head.endswith(b"\r\n\r\n"), head


def test_http10_keep_alive_and_close() -> None:
    sends, raw = _send(BodyReply(b"x"), version=(1, 0), keep_alive=True)
    status, headers, _ = _head(sends[0])
    assert status.startswith("HTTP/1.0 200") and headers["connection"] == "keep-alive", headers
    assert raw.writer.keep_alive
    sends, raw = _send(StreamReply(200), b"abc", version=(1, 0), keep_alive=True)  # no length, no chunks
    _, headers, body = _head(sends[0])
    assert "transfer-encoding" not in headers and body == b"abc", (headers, body)
    assert not raw.writer.keep_alive  # the body ends with the connection
    reply = BodyReply(b"x")
    reply.force_close()
    sends, raw = _send(reply)
    assert _head(sends[0])[1]["connection"] == "close" and not raw.writer.keep_alive


def test_no_body_on_204_and_bad_values_are_refused() -> None:
    sends, _ = _send(BodyReply(b"", 204))
    status, headers, body = _head(sends[0])
    assert status == "HTTP/1.1 204 No Content" and "content-length" not in headers and body == b"", sends
    with pytest.raises(ValueError, match="X-Bad"):
        _send(BodyReply(b"x", 200, {"X-Bad": "a\r\nb"}))
    with pytest.raises(ValueError, match="status 42"):
        BodyReply(b"x", 42)
    reply = BodyReply(b"x")
    _send(reply)
    with pytest.raises(RuntimeError, match="raw server"):
        reply.for_aiohttp()
    with pytest.raises(ValueError, match="fixed"):
        asyncio.run(BodyReply(b"x").write_eof(b"more"))
