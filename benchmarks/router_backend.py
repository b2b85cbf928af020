"""The fast fake backend of `benchmarks/router.py` (its own process: ``router.py --serve-backend PORT...``).

It answers a streaming completion with an SSE stream of a few chunks, one event-loop turn apart,
a non-streaming one (the prefill call) with a small JSON body, and any other request (health,
models) with 200.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Sequence
from typing import Any

HOST = "127.0.0.1"


def _sse_event(payload: dict) -> bytes:
    return b"data: " + json.dumps(payload, separators=(", ", ": ")).encode() + b"\n\n"


def _chunked(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


def backend_responses(chunks: int) -> tuple[bytes, list[bytes], bytes]:
    """(non-streaming answer, streaming answer's writes, plain 200) as raw HTTP/1.1 bytes."""
    created = int(time.time())

    def completion(choice: dict[str, Any], **extra: Any) -> dict[str, Any]:
        return {"id": "cmpl-bench", "object": "text_completion", "created": created, "model": "bench",
                "choices": [choice], **extra}  # fmt: skip

    events = []
    for i in range(chunks):
        choice = {"index": 0, "text": f" token{i}", "logprobs": None, "finish_reason": None, "stop_reason": None}
        events.append(_sse_event(completion(choice)))
    usage = {"prompt_tokens": 16, "total_tokens": 16 + chunks, "completion_tokens": chunks}
    final = {"index": 0, "text": "", "logprobs": None, "finish_reason": "length", "stop_reason": None}
    events.append(_sse_event(completion(final, usage=usage)))
    head = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream; charset=utf-8\r\ntransfer-encoding: chunked\r\n\r\n"
    writes = [head + _chunked(events[0])] + [_chunked(e) for e in events[1:]]
    writes.append(_chunked(b"data: [DONE]\n\n") + b"0\r\n\r\n")
    body = json.dumps(
        completion(
            {"index": 0, "text": " token0", "logprobs": None, "finish_reason": "length"},
            usage={"prompt_tokens": 16, "total_tokens": 17, "completion_tokens": 1},
            kv_transfer_params=None,
        )
    ).encode()
    answer = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body)
    models = json.dumps({"object": "list", "data": [{"id": "bench", "object": "model"}]}).encode()
    plain = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (
        len(models),
        models,
    )
    return answer, writes, plain


def serve_backend(ports: Sequence[int], chunks: int) -> None:
    """A minimal keep-alive HTTP/1.1 server on every port: SSE stream or JSON for POSTs, 200 for the rest.

    Several ports let a router that refuses one URL as both prefiller and decoder (sglang-router)
    see two instances.
    """
    import httptools

    answer, stream_writes, plain = backend_responses(chunks)

    class Protocol(asyncio.Protocol):
        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            self.transport = transport
            self.parser = httptools.HttpRequestParser(self)
            self.url = b""
            self.body: list[bytes] = []

        def on_message_begin(self) -> None:
            self.url = b""
            self.body = []

        def on_url(self, url: bytes) -> None:
            self.url += url

        def on_body(self, body: bytes) -> None:
            self.body.append(body)

        def on_message_complete(self) -> None:
            if self.parser.get_method() != b"POST":
                self.transport.write(plain)
                return
            request = json.loads(b"".join(self.body))
            if request.get("stream"):
                asyncio.get_running_loop().create_task(self.stream())
            else:
                self.transport.write(answer)

        async def stream(self) -> None:
            # Separate writes, one event-loop turn apart, like a server producing tokens.
            for data in stream_writes:
                if self.transport.is_closing():
                    return
                self.transport.write(data)
                await asyncio.sleep(0)

        def data_received(self, data: bytes) -> None:
            try:
                self.parser.feed_data(data)
            except httptools.HttpParserError:
                self.transport.close()

    async def main() -> None:
        loop = asyncio.get_running_loop()
        servers = [await loop.create_server(Protocol, HOST, port, backlog=4096) for port in ports]
        await asyncio.gather(*(server.serve_forever() for server in servers))

    run(main())


def run(coro) -> None:  # type: ignore[no-untyped-def]
    """Run `coro` on uvloop when installed, else on asyncio's loop."""
    try:
        import uvloop

        uvloop.run(coro)
    except ImportError:  # pragma: no cover
        asyncio.run(coro)
