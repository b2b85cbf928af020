"""Request bodies the Router sends to the prefill (P) and decode (D) instances.

Pure functions over the client's parsed JSON body; nothing here does I/O.
"""

from __future__ import annotations

import random
from typing import Any

from proxy.config import Backend
from proxy.errors import INVALID_REQUEST, RouterError

ROOM_LIMIT = 2**63
ROOM_KEY = "bootstrap_room"
KV_KEY = "kv_transfer_params"


def _invalid(message: str) -> RouterError:
    return RouterError(400, message, INVALID_REQUEST)


def _check_room(value: Any, where: str) -> int:
    # bool is a subclass of int: reject it explicitly.
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < ROOM_LIMIT:
        raise _invalid(f"{where} must be an integer in [0, 2**63), got {value!r}")
    return value


def resolve_room(body: dict[str, Any], rng: random.Random | None = None) -> int:
    """Return the request's bootstrap room.

    The client may give one (for idempotent retries and tracing) as a top-level
    ``bootstrap_room`` or as ``kv_transfer_params.bootstrap_room``; otherwise a random
    63-bit one is drawn. Raises :class:`RouterError` (400) when a given value is invalid.
    """
    kv = body.get(KV_KEY)
    if kv is not None and not isinstance(kv, dict):
        raise _invalid(f"{KV_KEY} must be an object")
    top = _check_room(body[ROOM_KEY], ROOM_KEY) if body.get(ROOM_KEY) is not None else None
    nested = None
    if kv is not None and kv.get(ROOM_KEY) is not None:
        nested = _check_room(kv[ROOM_KEY], f"{KV_KEY}.{ROOM_KEY}")
    if top is not None and nested is not None and top != nested:
        raise _invalid(f"{ROOM_KEY} ({top}) and {KV_KEY}.{ROOM_KEY} ({nested}) differ")
    if top is not None:
        return top
    if nested is not None:
        return nested
    return (rng or random).getrandbits(63)


def prefill_body(body: dict[str, Any], room: int) -> dict[str, Any]:
    """Body for P: compute the prompt's KV cache, generate one token, hand the KV to D.

    ``stream`` is off, the token budget is one (``ignore_eos`` so that token is never an
    EOS stop), and ``kv_transfer_params`` marks the request as feeding a remote decode.
    """
    out = dict(body)  # shallow: only top-level keys are replaced
    out.pop(ROOM_KEY, None)
    out["stream"] = False
    out.pop("stream_options", None)
    out["max_tokens"] = 1
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    out.pop("min_tokens", None)
    out["ignore_eos"] = True
    out[KV_KEY] = {"do_remote_decode": True, "do_remote_prefill": False, ROOM_KEY: room}
    return out


def decode_body(body: dict[str, Any], room: int, prefiller: Backend) -> dict[str, Any]:
    """Body for D: the client's request, plus where to get the KV cache from (``prefiller``)."""
    out = dict(body)  # shallow: only top-level keys are replaced
    out.pop(ROOM_KEY, None)
    out[KV_KEY] = {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        ROOM_KEY: room,
        "bootstrap_host": prefiller.host,
        "bootstrap_port": prefiller.bootstrap_port,
        "prefill_dp_rank": 0,
    }
    return out


def wants_stream(body: dict[str, Any]) -> bool:
    """Whether the client asked for a server-sent-event stream."""
    return body.get("stream") is True
