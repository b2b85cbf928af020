"""The limits of the Router's raw HTTP/1.1 server (:class:`proxy.server.hot_connection.HotConnection`).

What a client connection is refused, and when the server gives up on it:

- **Head size**: the request line and headers together at most :data:`MAX_HEAD_BYTES` (16 KiB),
  else HTTP 431 and the connection closes. A head still incomplete is cut at that size plus at
  most one read (the bytes of the read in which it began are not counted).
- **Header deadline** (``--header-timeout``): a request whose head is not complete that many
  seconds after its first byte arrived gets HTTP 408 and the connection closes (slowloris).
- **Body deadline** (``--body-timeout``): no body byte for that many seconds: 408 and closed.
- **Write deadline** (``--write-timeout``): a client that stops reading (the transport's buffer
  above its high mark and not shrinking for that many seconds) is cut: the connection is aborted,
  which cancels its handler and so the backend requests.
- **Pipelining**: one request may wait behind the one being answered, and reading stops while it
  does; a second one closes the connection once the answers in flight are sent.
- **Body size** (``--max-body-size``): a body announced or grown over the limit is answered 413
  (by the handler, so auth and the log line are the usual ones) without reading it further; the
  connection then closes (its write side first, the rest of the body dropped for at most
  :data:`LINGER_S`, so the client reads the 413 rather than a reset).

Timers are ``loop.call_later`` handles, armed only when a read leaves a request incomplete (a
request that arrives in one read, the usual case, costs no timer) and checked lazily: a body
that keeps flowing updates a timestamp, not the timer. A request for another route, handed to
aiohttp, has its head checked here (size, deadline); its body and answer are aiohttp's.
"""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass

#: Largest request line plus headers accepted (HTTP 431 beyond).
MAX_HEAD_BYTES = 16 * 1024
#: Seconds the rest of a refused body is read and dropped after the 413 went out.
LINGER_S = 2.0
_STATUS_TEXT = {400: "Bad Request", 408: "Request Timeout", 431: "Request Header Fields Too Large"}


@dataclass(frozen=True)
class ServerLimits:
    """Deadlines of the raw server (``--header-timeout``, ``--body-timeout``, ``--write-timeout``)."""

    header_timeout: float = 10.0
    body_timeout: float = 30.0
    write_timeout: float = 30.0


class Phase(enum.Enum):
    """Where the request being read stands."""

    IDLE = "idle"  # between requests
    HEAD = "head"  # its request line or headers are arriving
    BODY = "body"  # its headers are complete, its body is arriving


def error_bytes(status: int, message: str, error_type: str = "invalid_request_error") -> bytes:
    """A whole ``Connection: close`` answer with an OpenAI-style error body."""
    body = json.dumps({"error": {"message": message, "type": error_type, "code": status}}).encode()
    head = f"HTTP/1.1 {status} {_STATUS_TEXT[status]}\r\nContent-Type: application/json\r\nConnection: close\r\n"
    return head.encode() + b"Content-Length: %d\r\n\r\n%b" % (len(body), body)
