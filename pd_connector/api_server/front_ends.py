"""Other routers' PD requests, rewritten into PDConnector's ``kv_transfer_params`` (P's and D's API server).

The HTTP middleware (pd_connector.api_server.validation) applies :func:`translate` to each completion
body before vLLM parses it, so P and D serve these front ends unmodified:

- **sglang-router** ``--pd-disaggregation`` sends the same body to P and D at once, with SGLang's
  top-level ``bootstrap_host`` / ``bootstrap_port`` / ``bootstrap_room``. P gets
  ``PrefillParams(room)`` and ``max_tokens`` 1 (it only prefills and holds the room: the router
  discards its answer); D gets ``DecodeParams(room, bootstrap_host, bootstrap_port)``.
- **vllm-router** ``--kv-connector mooncake`` (vLLM's in-tree MooncakeConnector protocol) sends P
  ``{do_remote_decode, transfer_id}`` and D ``{do_remote_prefill, transfer_id,
  remote_bootstrap_addr, remote_engine_id}``, after reading P's bootstrap ``/query``
  (pd_connector.bootstrap.mooncake_query). Both sides derive the same room from ``transfer_id``;
  D's bootstrap address and prefill DP rank come from ``remote_bootstrap_addr`` / ``remote_engine_id``.

Requests that already carry PDConnector's own parameters are left alone. No I/O.
"""

from __future__ import annotations

import enum
import hashlib
from typing import Any
from urllib.parse import urlsplit

from pd_connector.bootstrap.mooncake_query import dp_rank_of_engine_id
from pd_connector.kv_params import (
    BOOTSTRAP_HOST,
    BOOTSTRAP_PORT,
    DEFAULT_BOOTSTRAP_PORT,
    KV_PARAMS_KEY,
    MAX_ROOM,
    MAX_SAMPLES,
    REMOTE_DECODE,
    REMOTE_PREFILL,
    ROOM,
    DecodeParams,
    PrefillParams,
)

#: vllm-router's Mooncake fields.
TRANSFER_ID = "transfer_id"
REMOTE_BOOTSTRAP_ADDR = "remote_bootstrap_addr"
REMOTE_ENGINE_ID = "remote_engine_id"
#: Body fields that cap how many tokens a completion generates (chat has both).
_LENGTH_FIELDS = ("max_tokens", "max_completion_tokens")


class Side(enum.Enum):
    PREFILL = "prefill"
    DECODE = "decode"


class FrontEnd(enum.Enum):
    """Which router's PD protocol a body spoke (for the log line)."""

    SGLANG = "sglang-router (bootstrap_room)"
    MOONCAKE = "vllm-router mooncake (transfer_id)"


class TranslationError(ValueError):
    """The foreign PD fields are there but unusable (HTTP 400 names the field)."""


def room_of_transfer_id(transfer_id: str) -> int:
    """The room both P and D derive from vllm-router's ``transfer_id`` (63 bits of its SHA-256)."""
    return int.from_bytes(hashlib.sha256(transfer_id.encode()).digest()[:8], "big") % MAX_ROOM


def translate(body: dict[str, Any], side: Side) -> FrontEnd | None:
    """Rewrite ``body`` in place into PDConnector's kv_transfer_params; which protocol it spoke (None: none)."""
    params = body.get(KV_PARAMS_KEY)
    if params is None and ROOM in body:
        _from_sglang(body, side)
        return FrontEnd.SGLANG
    if isinstance(params, dict) and TRANSFER_ID in params and ROOM not in params:
        body[KV_PARAMS_KEY] = _from_mooncake(params, side)
        return FrontEnd.MOONCAKE
    return None


def _from_sglang(body: dict[str, Any], side: Side) -> None:
    room = _int(body.pop(ROOM), ROOM, MAX_ROOM)
    host, port = body.pop(BOOTSTRAP_HOST, None), body.pop(BOOTSTRAP_PORT, None)
    if side is Side.PREFILL:
        n = body.get("n")
        samples = n if isinstance(n, int) and not isinstance(n, bool) and 1 <= n <= MAX_SAMPLES else 1
        body[KV_PARAMS_KEY] = PrefillParams(room, samples).to_json()
        _prefill_only(body)
        return
    if not isinstance(host, str) or not host:
        raise TranslationError(f"{BOOTSTRAP_HOST} must name the prefill's bootstrap host, got {host!r}")
    port = DEFAULT_BOOTSTRAP_PORT if port is None else _int(port, BOOTSTRAP_PORT, 65536)
    body[KV_PARAMS_KEY] = DecodeParams(room, host, port, None).to_json()


def _from_mooncake(params: dict[str, Any], side: Side) -> dict[str, Any]:
    transfer_id = params.get(TRANSFER_ID)
    if not isinstance(transfer_id, str) or not transfer_id:
        raise TranslationError(f"kv_transfer_params.{TRANSFER_ID} must be a non-empty string")
    room = room_of_transfer_id(transfer_id)
    if side is Side.PREFILL:
        if params.get(REMOTE_DECODE) is not True:
            return params  # not a prefill request: the connector counts it as served without transfer
        return PrefillParams(room).to_json()
    if params.get(REMOTE_PREFILL) is not True:
        return params
    addr = params.get(REMOTE_BOOTSTRAP_ADDR)
    parts = urlsplit(addr if isinstance(addr, str) and "//" in addr else f"//{addr}")
    try:
        host, port = parts.hostname, parts.port
    except ValueError:
        host = port = None
    if not host or port is None:
        raise TranslationError(f"kv_transfer_params.{REMOTE_BOOTSTRAP_ADDR} must be http://host:port, got {addr!r}")
    dp_rank = dp_rank_of_engine_id(params.get(REMOTE_ENGINE_ID))
    return DecodeParams(room, host, port, dp_rank).to_json()


def _prefill_only(body: dict[str, Any]) -> None:
    """P computes the prompt and one token only; its answer is discarded by the front end."""
    for key in _LENGTH_FIELDS:
        if key in body or key == "max_tokens":
            body[key] = 1
    if isinstance(body.get("min_tokens"), int):
        body["min_tokens"] = min(body["min_tokens"], 1)


def _int(value: Any, name: str, hi: int) -> int:
    if isinstance(value, str) and value.isdigit():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < hi:
        raise TranslationError(f"{name} must be an integer in [0, {hi}), got {value!r}")
    return value
