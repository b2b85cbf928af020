"""OpenAI-style error bodies and the Router's own error type."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from aiohttp import web

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

JSON_CONTENT_TYPE = "application/json"


def error_body(message: str, error_type: str, code: int, param: str | None = None) -> dict[str, Any]:
    """Return an OpenAI-style error object: ``{"error": {"message", "type", "param", "code"}}``."""
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


def json_response(payload: Any, status: int = 200, headers: dict[str, str] | None = None) -> web.Response:
    """A JSON response (compact separators, UTF-8)."""
    body = json.dumps(payload, ensure_ascii=False, separators=(",", ":")).encode()
    return web.Response(body=body, status=status, headers=headers, content_type=JSON_CONTENT_TYPE)


def error_response(
    status: int,
    message: str,
    error_type: str,
    headers: dict[str, str] | None = None,
    param: str | None = None,
) -> web.Response:
    """Return a JSON response with an OpenAI-style error body and the given HTTP status."""
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

    def to_response(self, headers: dict[str, str] | None = None) -> web.Response:
        """Render this error as a JSON response."""
        return error_response(self.status, self.message, self.error_type, headers, self.param)

    def to_sse(self) -> bytes:
        """Render this error as a server-sent event (used when a stream has already started)."""
        return sse_error_event(self.message, self.error_type, self.status)
