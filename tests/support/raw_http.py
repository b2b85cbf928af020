"""Raw HTTP/1.1 over one socket, for tests that write the Router's request bytes themselves.

``RawConnection`` sends bytes and reads whole responses with http.client, keeping the connection
open between them (keep-alive, pipelining); ``raw_post`` builds a POST's bytes; ``json_body`` a
generation request's JSON body.
"""

from __future__ import annotations

import http.client
import json
import socket
from typing import IO, Any

from tests.support.router_rig import HOST, request_body


class _KeepOpen:
    """The connection's reader as http.client sees it: its close() (at a response's end) keeps it open."""

    def __init__(self, file: IO[bytes]) -> None:
        self.file = file

    def __getattr__(self, name: str) -> Any:
        return getattr(self.file, name)

    def close(self) -> None:
        pass


class RawConnection:
    """One client connection; ``answer()`` reads the next whole HTTP response from it."""

    def __init__(self, port: int) -> None:
        self.sock = socket.create_connection((HOST, port), timeout=10)
        self.file: IO[bytes] = self.sock.makefile("rb")

    def makefile(self, *_args: Any, **_kwargs: Any) -> _KeepOpen:  # what http.client.HTTPResponse reads
        return _KeepOpen(self.file)

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def answer(self, method: str = "POST") -> tuple[int, dict[str, str], bytes]:
        response = http.client.HTTPResponse(self, method=method)  # type: ignore[arg-type]
        response.begin()
        return response.status, {k.lower(): v for k, v in response.getheaders()}, response.read()

    def closed_by_peer(self) -> bool:
        return self.sock.recv(1) == b""

    def close(self) -> None:
        self.file.close()
        self.sock.close()


def raw_post(path: str, body: bytes, rid: str, extra: str = "", version: str = "1.1") -> bytes:
    head = f"POST {path} HTTP/{version}\r\nHost: router\r\nX-Request-Id: {rid}\r\nContent-Type: application/json\r\n"
    return (head + f"Content-Length: {len(body)}\r\n{extra}\r\n").encode() + body


def json_body(path: str, **extra: Any) -> bytes:
    return json.dumps(request_body(path, **extra)).encode()
