"""What the ZMQ channel checks before it uses anything a peer sent: frame size, endpoints, text in logs.

- ``MAX_FRAME_BYTES``: every PDConnector ZMQ socket sets ``zmq.MAXMSGSIZE`` to it (plus the MAC); ZMQ
  drops the connection of a peer that announces a bigger frame before reading it into memory.
- ``check_endpoint``: an endpoint is ``tcp://<IPv4 | [IPv6] | host name>:<port 1..65535>``; anything
  else is refused with a BadEndpoint (ValueError) naming it before a socket is made for it (ZMQ's own error on
  ``connect`` is terse and comes after a socket was opened).
- ``message_problem`` / ``escaped``: text from a peer never reaches a log line raw. A message whose
  identifiers (peer id, request id, endpoints, dtype names) hold a character that can start a new line
  or drive a terminal (control characters other than tab, Unicode line and paragraph separators) is
  refused; the free text of ``TransferDone.error`` is escaped instead.
"""

from __future__ import annotations

import re
import unicodedata

import msgspec

from pd_connector import messages as proto

#: The largest payload a PDConnector frame may carry. The largest legitimate messages: a
#: TransferRequest for a 16M-token prompt at block size 16 (2^20 block ids, at most 5 msgpack bytes
#: each, ~5 MiB, and as many again in ``dst_groups`` for a second KV cache group, ~10 MiB), and a
#: PeerHello (a region per layer and KV part: a few hundred bytes per layer). 64 MiB leaves room for
#: a few more cache groups and bounds what a stranger can make a rank buffer per frame.
MAX_FRAME_BYTES = 64 * 2**20

_ENDPOINT = re.compile(
    r"tcp://(\[[0-9A-Fa-f:.]+\]|[0-9]{1,3}(?:\.[0-9]{1,3}){3}|[A-Za-z0-9](?:[A-Za-z0-9.-]{0,252})):(\d{1,5})"
)
#: Fields holding endpoints, per message type.
_ENDPOINT_FIELDS = {"endpoint", "reply_to", "about"}
#: Characters never let into a log line: they start a new line or drive a terminal.
_BAD_CATEGORIES = ("Cc", "Zl", "Zp")


class BadEndpoint(ValueError):
    """An endpoint ZMQ would refuse (the message names it and the expected form)."""


def check_endpoint(endpoint: str) -> str:
    """``endpoint`` if ZMQ can connect to it as given, else BadEndpoint naming it and the expected form."""
    m = _ENDPOINT.fullmatch(endpoint) if isinstance(endpoint, str) else None
    if m is None or not 1 <= int(m.group(2)) <= 65535:
        raise BadEndpoint(
            f"invalid ZMQ endpoint '{escaped(str(endpoint))}': expected tcp://<ip or [ipv6] or host>:<port 1..65535>"
        )
    return endpoint


def unsafe(text: str) -> bool:
    """Whether ``text`` holds a character that could forge or garble a log line (tab is fine)."""
    return any(c != "\t" and unicodedata.category(c) in _BAD_CATEGORIES for c in text)


def escaped(text: str, limit: int = 200) -> str:
    """``text`` with every unsafe character written as a Python escape, at most ``limit`` characters."""
    out = "".join(c.encode("unicode_escape").decode("ascii") if unsafe(c) else c for c in text[:limit])
    return out + ("..." if len(text) > limit else "")


def message_problem(msg: proto.Message) -> str | None:
    """Why a decoded message must be dropped (an identifier unsafe in a log, a bad endpoint), or None."""
    for name in msg.__struct_fields__:
        value = getattr(msg, name)
        if not isinstance(value, str) or name == "error":
            continue
        if unsafe(value):
            return f"{type(msg).__name__}.{name} '{escaped(value)}' holds control characters"
        if name in _ENDPOINT_FIELDS and value:  # "" is allowed: TransferRequest.endpoint is optional
            try:
                check_endpoint(value)
            except ValueError as exc:
                return f"{type(msg).__name__}.{name}: {exc}"
    return None


def with_safe_text(msg: proto.Message) -> proto.Message:
    """``msg`` with the free text D logs (``TransferDone.error``) escaped where needed."""
    if isinstance(msg, proto.TransferDone) and unsafe(msg.error):
        return msgspec.structs.replace(msg, error=escaped(msg.error, limit=2000))
    return msg
