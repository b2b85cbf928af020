"""OpenAI-style error bodies and the Router's own error type.

Answers are :class:`proxy.server.reply.BodyReply` objects, which the raw server writes itself and
aiohttp's routes send through the application's middleware (:func:`proxy.server.reply.aiohttp_replies`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from proxy.server.reply import BodyReply, json_reply

#: Error ``type`` values the Router itself produces.
INVALID_REQUEST = "invalid_request_error"
NOT_FOUND = "not_found_error"
PREFILL_FAILED = "prefill_failed"
DECODE_FAILED = "decode_failed"
#: The request's bootstrap room is taken by another request (``--trust-client-room``) or P refused it.
ROOM_IN_USE = "room_in_use"
UPSTREAM_UNAVAILABLE = "upstream_unavailable"
INTERNAL_ERROR = "internal_error"
#: Recorded in metrics (never sent: the client is gone).
CLIENT_DISCONNECTED = "client_disconnected"


def error_body(message: str, error_type: str, code: int, param: str | None = None) -> dict[str, Any]:
    """Return an OpenAI-style error object: ``{"error": {"message", "type", "param", "code"}}``."""
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


def json_response(payload: Any, status: int = 200, headers: Mapping[str, str] | None = None) -> BodyReply:
    """A JSON answer (compact separators, UTF-8)."""
    return json_reply(payload, status, headers)


def error_response(
    status: int,
    message: str,
    error_type: str,
    headers: Mapping[str, str] | None = None,
    param: str | None = None,
) -> BodyReply:
    """Return a JSON answer with an OpenAI-style error body and the given HTTP status."""
    return json_response(error_body(message, error_type, status, param), status, headers)


def sse_error_event(message: str, error_type: str, code: int) -> bytes:
    """Return one server-sent event carrying an OpenAI-style error (for a stream already under way)."""
    return b"data: " + json.dumps(error_body(message, error_type, code)).encode() + b"\n\n"


def excerpt(data: bytes | str, limit: int = 300) -> str:
    """Return at most ``limit`` characters of a backend's body, on one line, for error messages."""
    text = data.decode("utf-8", errors="replace") if isinstance(data, bytes) else data
    text = " ".join(text.split())
    return text if len(text) <= limit else text[:limit] + "..."


@dataclass(eq=False)
class RouterError(Exception):
    """A failure the Router reports to the client as an HTTP error with an OpenAI-style body."""

    status: int
    message: str
    error_type: str
    param: str | None = None

    def __str__(self) -> str:
        return f"HTTP {self.status} {self.error_type}: {self.message}"

    def to_response(self, headers: Mapping[str, str] | None = None) -> BodyReply:
        """Render this error as a JSON answer."""
        return error_response(self.status, self.message, self.error_type, headers, self.param)

    def to_sse(self) -> bytes:
        """Render this error as a server-sent event (used when a stream has already started)."""
        return sse_error_event(self.message, self.error_type, self.status)
