"""The client's side of a request: its id, its JSON body, the headers passed on to the backends."""

from __future__ import annotations

import json
import random
from typing import Any

from aiohttp import web

from proxy.errors import INVALID_REQUEST, RouterError

#: W3C trace-context headers passed to P and D (vLLM with --otlp-traces-endpoint continues the trace).
TRACE_HEADERS = ("traceparent", "tracestate")


def backend_headers(request: web.Request, rid: str, authorization: str | None) -> dict[str, str]:
    """Headers of a call to a backend on behalf of ``request``: its id, the Router's own
    ``authorization`` for the backends (if any) and the client's W3C trace context (if any).

    The client's ``Authorization`` is never passed on: it is the client's key for the Router
    (``--api-key``), and P and D get the one configured for them (``--backend-api-key-file``).
    """
    headers = {"X-Request-Id": rid}
    for name in TRACE_HEADERS:
        if value := request.headers.get(name):
            headers[name] = value
    if authorization:
        headers["Authorization"] = authorization
    return headers


def request_id(request: web.Request) -> str:
    """The client's ``X-Request-Id``, else a new one: 32 random hex digits (as ``uuid4().hex``,
    from the process's PRNG, reseeded in each forked worker, with no system call per request)."""
    return request.headers.get("X-Request-Id", "").strip() or f"{random.getrandbits(128):032x}"


async def read_json(request: web.Request, limit: int) -> Any:
    """The request's JSON body (HTTP 413 over ``limit`` bytes, 400 if it is not JSON)."""
    length = request.content_length
    if length is not None and length > limit:
        raise RouterError(413, f"request body of {length} bytes exceeds the limit of {limit} bytes", INVALID_REQUEST)
    try:
        raw = await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise RouterError(413, f"request body exceeds the limit of {limit} bytes", INVALID_REQUEST) from None
    try:
        return json.loads(raw)
    except ValueError as exc:
        raise RouterError(400, f"request body is not valid JSON: {exc}", INVALID_REQUEST) from None
    except RecursionError:
        raise RouterError(400, "request body nests JSON too deeply", INVALID_REQUEST) from None
