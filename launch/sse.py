"""The lines of a server-sent-event stream, as a client of the Router or of vLLM reads them.

Split at ``b"\\n"`` only. httpx's ``iter_lines`` / ``aiter_lines`` split like ``str.splitlines``, also at
U+0085, U+2028, U+2029 and the other separators that JSON leaves unescaped inside strings; a model's
token can decode to one of them (the random test models' byte tokens often do), and that cuts an event
in two, so the client's ``json.loads`` fails on text the server sent whole.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator

import httpx


def _decoded(line: bytes) -> str:
    return line.rstrip(b"\r").decode("utf-8", errors="replace")


def sse_lines(resp: httpx.Response) -> Iterator[str]:
    """The stream's lines (without their line ends) as they arrive."""
    buffer = b""
    for chunk in resp.iter_bytes():
        buffer += chunk
        *lines, buffer = buffer.split(b"\n")
        for line in lines:
            yield _decoded(line)
    if buffer:
        yield _decoded(buffer)


async def asse_lines(resp: httpx.Response) -> AsyncIterator[str]:
    """:func:`sse_lines` of an ``httpx.AsyncClient`` stream."""
    buffer = b""
    async for chunk in resp.aiter_bytes():
        buffer += chunk
        *lines, buffer = buffer.split(b"\n")
        for line in lines:
            yield _decoded(line)
    if buffer:
        yield _decoded(buffer)
