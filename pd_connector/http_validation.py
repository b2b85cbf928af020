"""ASGI middleware for `vllm serve`: reject malformed kv_transfer_params with HTTP 400.

vLLM passes kv_transfer_params through untouched, so a bad value would only
surface deep in the engine. Load this with
`vllm serve ... --middleware pd_connector.http_validation.KVParamsValidationMiddleware`
and such requests get an OpenAI-style 400 naming the bad field, while the
server keeps serving. (Without it the connector logs the error and serves the
request without PD transfer.)
"""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from pd_connector.protocol import KVParamsError, parse_kv_params

logger = logging.getLogger(__name__)

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

CHECKED_PATHS = ("/v1/completions", "/v1/chat/completions")


def error_body(message: str, status: int = 400) -> bytes:
    return json.dumps(
        {"error": {"message": message, "type": "invalid_request_error", "param": "kv_transfer_params", "code": status}}
    ).encode()


def check_body(raw: bytes) -> str | None:
    """Return an error message if the JSON body carries malformed kv_transfer_params."""
    try:
        body = json.loads(raw)
    except ValueError:
        return None  # not ours to judge: vLLM answers invalid JSON itself
    if not isinstance(body, dict) or "kv_transfer_params" not in body:
        return None
    try:
        parse_kv_params(body["kv_transfer_params"])
    except KVParamsError as exc:
        return str(exc)
    return None


class KVParamsValidationMiddleware:
    def __init__(self, app: Callable[[Scope, Receive, Send], Awaitable[None]]) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope.get("type") != "http" or scope.get("method") != "POST" or scope.get("path") not in CHECKED_PATHS:
            await self.app(scope, receive, send)
            return
        chunks: list[bytes] = []
        more = True
        while more:
            message = await receive()
            if message["type"] != "http.request":
                await self.app(scope, _replay([message]), send)
                return
            chunks.append(message.get("body", b""))
            more = message.get("more_body", False)
        raw = b"".join(chunks)
        problem = check_body(raw)
        if problem is not None:
            logger.warning("rejected %s: %s", scope.get("path"), problem)
            body = error_body(problem)
            await send(
                {
                    "type": "http.response.start",
                    "status": 400,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
                }
            )
            await send({"type": "http.response.body", "body": body})
            return
        await self.app(scope, _replay([{"type": "http.request", "body": raw, "more_body": False}], receive), send)


def _replay(messages: list[Message], then: Receive | None = None) -> Receive:
    pending = list(messages)

    async def receive() -> Message:
        if pending:
            return pending.pop(0)
        if then is not None:
            return await then()
        return {"type": "http.disconnect"}

    return receive
