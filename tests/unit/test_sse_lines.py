"""launch.sse: a stream's lines split at b"\\n" only, so a token that decodes to U+2028 or U+0085 (JSON
leaves both unescaped inside strings) does not cut its event in two, as httpx's iter_lines would."""

from __future__ import annotations

import asyncio
import json

import httpx

from launch.sse import asse_lines, sse_lines

EVENT = {"choices": [{"text": "a\u2028b\x85c\u2029d\u00e9"}]}
BODY = ("data: " + json.dumps(EVENT, ensure_ascii=False) + "\r\n\r\ndata: [DONE]\n\n").encode()


def _chunks(size: int) -> list[bytes]:
    return [BODY[i : i + size] for i in range(0, len(BODY), size)]  # cuts inside the UTF-8 characters too


def test_sync_lines_keep_the_event_whole_at_any_chunking() -> None:
    for size in (1, 3, 7, len(BODY)):
        resp = httpx.Response(200, content=iter(_chunks(size)))
        lines = list(sse_lines(resp))
        assert lines == [lines[0], "", "data: [DONE]", ""], lines
        assert json.loads(lines[0][len("data: ") :]) == EVENT
    assert len(list(httpx.Response(200, content=BODY).iter_lines())) > 4  # what httpx itself does


def test_async_lines_keep_the_event_whole() -> None:
    class Stream(httpx.AsyncByteStream):
        async def __aiter__(self):  # type: ignore[override]
            for chunk in _chunks(5):
                yield chunk

    async def lines() -> list[str]:
        return [line async for line in asse_lines(httpx.Response(200, stream=Stream()))]

    got = asyncio.run(lines())
    assert json.loads(got[0][len("data: ") :]) == EVENT and got[2] == "data: [DONE]"
