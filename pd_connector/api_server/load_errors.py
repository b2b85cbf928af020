"""D's API server: a request whose KV load failed gets an error that names the room and why.

With ``kv_load_failure_policy`` "fail" (vLLM's default), vLLM's scheduler finishes a request whose KV
load failed with ``RequestStatus.FINISHED_ERROR``; its OpenAI serving layer then raises
``GenerationError("Internal server error")``: HTTP 500 with that bare message, or, once a stream
began, an error event with it. Nothing of the connector's reason reaches that layer on either vLLM
line (the error output carries no ``kv_transfer_params``), and the engine runs in another process.

So the API server's middleware (``validation.KVParamsValidationMiddleware``) wraps the ``send`` of
each request that loads KV (``named_load_errors``): vLLM's bare error for it is replaced by one that
names the room and what P's bootstrap server says of it (``GET /bootstrap/room_status``:
``bootstrap.rooms_api``), e.g. ``room 123: prefill at 10.0.0.2:8998 holds no KV for this room (never
prefilled, or released)``: HTTP ``LOAD_FAILED_STATUS`` (502: the KV's source failed the request; a
Router retries it on another pair) with type ``LOAD_FAILED_TYPE``, or the same message in the stream's
error event. Any other answer passes untouched. With ``kv_load_failure_policy`` "recompute" vLLM
prefills the request itself and nothing is rewritten.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from pd_connector.bootstrap.client import BootstrapError, RouteCache
from pd_connector.kv_params import DecodeParams, host_port

logger = logging.getLogger(__name__)

Message = MutableMapping[str, Any]
Send = Callable[[Message], Awaitable[None]]

LOAD_FAILED_STATUS = 502
LOAD_FAILED_TYPE = "kv_transfer_load_failed"
#: vLLM's message for a request finished with an error (GenerationError's default, both lines).
VLLM_BARE_ERROR = b"Internal server error"
STATUS_TIMEOUT_S = 3.0


def describe(addr: str, room: int, status: dict[str, object] | None, problem: str = "") -> str:
    """The named error for a failed KV load of ``room`` from the prefill at ``addr``, by what its bootstrap
    server said (``status``; None: it could not tell, ``problem`` says why)."""
    where = f"room {room}: prefill at {addr}"
    if status is None:
        return f"{where}: loading the KV failed, and prefill's bootstrap server could not tell why ({problem})"
    state, detail = status.get("state"), str(status.get("detail") or "")
    if state == "held":
        return f"{where} holds this room's KV, but loading it failed (see decode's log for room={room})"
    if state == "closed":
        return f"{where} no longer holds KV for this room: {detail}"
    if state == "awaiting_prefill":
        return f"{where} has not finished this room's prefill (kv_wait_timeout_s ran out first)"
    dp = status.get("dp_rank")
    seen = f"; its DP rank {dp} holds the room" if isinstance(dp, int) and status.get("seen_by") else ""
    return f"{where} holds no KV for this room (never prefilled, or already released){seen}"


class LoadErrorNamer:
    """Asks P's bootstrap server what it knows of a room (with ``routes``' token and CA bundle)."""

    def __init__(self, routes: Callable[[], RouteCache]) -> None:
        self._routes = routes

    async def name(self, params: DecodeParams) -> str:
        addr = host_port(params.bootstrap_host, params.bootstrap_port)
        try:
            status = await asyncio.to_thread(self._routes().room_status, addr, params.room, STATUS_TIMEOUT_S)
        except BootstrapError as exc:
            return describe(addr, params.room, None, str(exc))
        return describe(addr, params.room, status)


def _error_body(message: str) -> dict[str, Any]:
    return {
        "error": {
            "message": message,
            "type": LOAD_FAILED_TYPE,
            "param": "kv_transfer_params",
            "code": LOAD_FAILED_STATUS,
        }
    }


def named_load_errors(send: Send, params: DecodeParams, namer: LoadErrorNamer) -> Send:
    """``send`` of a request that loads KV (``params``), vLLM's bare error replaced by a named one."""
    held: Message | None = None  # a 500's start, until its body shows whether it is vLLM's bare error
    body: list[bytes] = []

    async def wrapped(message: Message) -> None:
        nonlocal held
        kind = message.get("type")
        if kind == "http.response.start" and message.get("status") == 500:
            held = message
            return
        if kind != "http.response.body":
            await send(message)
            return
        chunk = message.get("body", b"")
        if held is not None:  # a 500: its whole body, then judged
            body.append(chunk)
            if message.get("more_body", False):
                return
            start, held = held, None
            whole = b"".join(body)
            if VLLM_BARE_ERROR not in whole:
                await send(start)
                await send({"type": "http.response.body", "body": whole})
                return
            text = await namer.name(params)
            logger.error("room=%d answering HTTP %d: %s", params.room, LOAD_FAILED_STATUS, text)
            new = json.dumps(_error_body(text)).encode()
            headers = [(k, v) for k, v in start.get("headers", []) if k.lower() not in (b"content-length",)]
            headers.append((b"content-length", str(len(new)).encode()))
            await send({**start, "status": LOAD_FAILED_STATUS, "headers": headers})
            await send({"type": "http.response.body", "body": new})
            return
        if chunk.startswith(b'data: {"error"') and VLLM_BARE_ERROR in chunk:  # a stream's error event
            text = await namer.name(params)
            logger.error("room=%d answering an error event: %s", params.room, text)
            event = b"data: " + json.dumps(_error_body(text)).encode() + b"\n\n"
            rest = chunk.split(b"\n\n", 1)[1] if b"\n\n" in chunk else b""
            message = {**message, "body": event + rest}
        await send(message)

    return wrapped
