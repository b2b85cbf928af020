"""D's API server: each answer's ``usage`` says where its prompt KV came from (``usage.pd_kv``).

D's scheduler returns a request's KV account from ``request_finished`` (pd_connector.accounting), and
vLLM puts it in the request's final ``RequestOutput.kv_transfer_params``. vLLM's OpenAI layer copies
``kv_transfer_params`` into non-streamed completion and chat answers only (``OpenAIServingCompletion``,
``OpenAIServingChat``, vLLM 0.23 and 0.32); a stream never carries it. So:

- :func:`hook_engine` wraps the engine client's ``generate`` once (on the instance, ``app.state.engine_client``,
  which both serving classes call at request time): every final output's account is appended to the list
  the current HTTP request set in :data:`_RECORDS` (a context variable: the serving code and the tasks it
  starts run in the request's context);
- :class:`AccountedSend` wraps the ASGI ``send`` of one request: a streamed answer's usage event (``choices``
  empty, ``stream_options.include_usage``) and a JSON answer's ``usage`` get ``pd_kv``; a JSON answer's
  ``kv_transfer_params.pd_kv`` is moved there (``kv_transfer_params`` is null when nothing else is left).

The validation middleware (pd_connector.api_server.validation) runs this on decode instances.
"""

from __future__ import annotations

import enum
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, MutableMapping
from contextvars import ContextVar
from typing import Any

from pd_connector.accounting import ACCOUNT_KEY, merge_accounts
from pd_connector.kv_params import KV_PARAMS_KEY

logger = logging.getLogger(__name__)

Message = MutableMapping[str, Any]
Send = Callable[[Message], Awaitable[None]]

#: The KV accounts of the engine requests the current HTTP request made (None outside one).
_RECORDS: ContextVar[list[dict[str, Any]] | None] = ContextVar("pd_kv_records", default=None)
_HOOKED = "_pd_kv_usage_hooked"


def account_of(kv_transfer_params: Any) -> dict[str, Any] | None:
    """The ``pd_kv`` record in an output's ``kv_transfer_params``, or None."""
    if isinstance(kv_transfer_params, dict) and isinstance(record := kv_transfer_params.get(ACCOUNT_KEY), dict):
        return record
    return None


def hook_engine(state: Any) -> bool:
    """Wrap ``state.engine_client.generate`` (once) to collect final outputs' accounts; False when the
    app state has no engine client yet."""
    engine = getattr(state, "engine_client", None)
    if engine is None:
        return False
    if getattr(engine, _HOOKED, False):
        return True
    original = engine.generate

    async def generate(*args: Any, **kwargs: Any) -> AsyncIterator[Any]:
        records = _RECORDS.get()
        async for output in original(*args, **kwargs):
            if records is not None and getattr(output, "finished", False):
                record = account_of(getattr(output, "kv_transfer_params", None))
                if record is not None:
                    records.append(record)
            yield output

    engine.generate = generate
    setattr(engine, _HOOKED, True)
    return True


def collecting() -> tuple[list[dict[str, Any]], Any]:
    """A fresh record list for the current request, and the token that resets :data:`_RECORDS`."""
    records: list[dict[str, Any]] = []
    return records, _RECORDS.set(records)


def reset(token: Any) -> None:
    _RECORDS.reset(token)


class _Kind(enum.Enum):
    PENDING = "pending"  # no response start seen yet
    JSON = "json"  # a whole JSON answer, held until its last byte
    STREAM = "stream"  # server-sent events, rewritten event by event
    OTHER = "other"  # passed on as it is


class AccountedSend:
    """The ASGI ``send`` of one generation request, adding ``usage.pd_kv`` from ``records``."""

    def __init__(self, send: Send, records: list[dict[str, Any]]) -> None:
        self._send = send
        self._records = records
        self._kind = _Kind.PENDING
        self._start: Message | None = None
        self._body: list[bytes] = []

    async def __call__(self, message: Message) -> None:
        kind = message.get("type")
        if kind == "http.response.start":
            self._kind = _kind_of(message)
            if self._kind is _Kind.JSON:
                self._start = message  # sent with the body, its Content-Length corrected
                return
        elif kind == "http.response.body":
            if self._kind is _Kind.JSON:
                self._body.append(message.get("body", b""))
                if message.get("more_body", False):
                    return
                await self._send_json(message)
                return
            if self._kind is _Kind.STREAM and b'"usage"' in message.get("body", b""):
                message = {**message, "body": with_stream_usage(message.get("body", b""), self._records)}
        await self._send(message)

    async def _send_json(self, last: Message) -> None:
        body = with_json_usage(b"".join(self._body), self._records)
        start = self._start or {"type": "http.response.start", "status": 200, "headers": []}
        length = str(len(body)).encode()
        headers = [(k, length if k.lower() == b"content-length" else v) for k, v in start.get("headers", [])]
        await self._send({**start, "headers": headers})
        await self._send({**last, "body": body, "more_body": False})


def _kind_of(start: Message) -> _Kind:
    if start.get("status") != 200:
        return _Kind.OTHER
    ctype = next((v for k, v in start.get("headers", []) if k.lower() == b"content-type"), b"")
    if ctype.startswith(b"application/json"):
        return _Kind.JSON
    if ctype.startswith(b"text/event-stream"):
        return _Kind.STREAM
    return _Kind.OTHER


def with_json_usage(body: bytes, records: list[dict[str, Any]]) -> bytes:
    """A JSON answer with ``usage.pd_kv`` (from ``records``, else its own ``kv_transfer_params.pd_kv``)."""
    try:
        answer = json.loads(body)
    except ValueError:
        return body
    if not isinstance(answer, dict) or not isinstance(usage := answer.get("usage"), dict):
        return body
    params = answer.get(KV_PARAMS_KEY)
    record = merge_accounts(records) or account_of(params)
    if record is None:
        return body
    usage[ACCOUNT_KEY] = record
    if isinstance(params, dict) and ACCOUNT_KEY in params:
        rest = {k: v for k, v in params.items() if k != ACCOUNT_KEY}
        answer[KV_PARAMS_KEY] = rest or None
    return json.dumps(answer, ensure_ascii=False, separators=(",", ":")).encode()


def with_stream_usage(chunk: bytes, records: list[dict[str, Any]]) -> bytes:
    """SSE bytes whose usage event (``choices`` empty, a ``usage`` object) carries ``usage.pd_kv``."""
    record = merge_accounts(records)
    if record is None:
        return chunk
    events = chunk.split(b"\n\n")
    for i, event in enumerate(events):
        if not event.startswith(b"data: {") or b'"usage"' not in event:
            continue
        try:
            payload = json.loads(event[6:])
        except ValueError:
            continue
        usage = payload.get("usage") if isinstance(payload, dict) else None
        if isinstance(usage, dict) and payload.get("choices") == []:
            usage[ACCOUNT_KEY] = record
            events[i] = b"data: " + json.dumps(payload, ensure_ascii=False, separators=(",", ":")).encode()
    return b"\n\n".join(events)
