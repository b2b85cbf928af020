"""The per-request contract between the Router and PDConnector: ``kv_transfer_params``.

One module builds and parses what a request carries, and holds the constants both
sides share, so the Router (which must run without vLLM) and the connector cannot
drift apart. It imports nothing of vLLM.

P's request: ``{do_remote_decode: true, bootstrap_room}``; D's request:
``{do_remote_prefill: true, bootstrap_room, bootstrap_host, bootstrap_port[, prefill_dp_rank,
prefilled_tokens, migrate_room]}``;
P's answer (vLLM passes it back in the response): ``{bootstrap_room, prefill_done: true}``.

P-then-D proxies (vLLM-Ascend's example proxy, vLLM's toy proxy) send P
``{do_remote_decode: true}`` with no room (``remote_*: null`` at most), then hand D whatever
kv_transfer_params P answered. P then makes up the room itself (``new_room``, when parsed with
``room_optional``) and answers with :func:`decode_handoff`: D's complete request params plus
``prefill_done``.
"""

from __future__ import annotations

import ipaddress
import secrets
from dataclasses import dataclass
from typing import Any

#: Key of the request body vLLM hands to the connector untouched.
KV_PARAMS_KEY = "kv_transfer_params"
REMOTE_DECODE = "do_remote_decode"
REMOTE_PREFILL = "do_remote_prefill"
ROOM = "bootstrap_room"
BOOTSTRAP_HOST = "bootstrap_host"
BOOTSTRAP_PORT = "bootstrap_port"
PREFILL_DP_RANK = "prefill_dp_rank"
PREFILL_DONE = "prefill_done"
#: P's request: how many decode requests (samples, D's ``n``) will load this room's KV (default 1).
DECODE_SAMPLES = "decode_samples"
#: P's answer when it refused the request: why (the room is in use by another request).
PREFILL_ERROR = "prefill_error"
#: D's request: P's KV covers only the prompt's first N tokens (the Router's first-token path
#: sends D P's prompt plus P's first token; D computes that token itself). Absent: all of them.
PREFILLED_TOKENS = "prefilled_tokens"
#: P's answer: P prefilled all prompt tokens but the last (a recurrent-state model, pd_connector.layouts.state_groups);
#: the token it sampled is not the answer's first, so the Router's first-token path does not use it.
PREFILL_WITHOUT_LAST_TOKEN = "prefill_without_last_token"
#: D's request: if this request is ABORTED on D, D holds its KV as this room for
#: ``migrate_hold_s`` seconds, for another decoder to load it (a drain moving the stream with its KV).
MIGRATE_ROOM = "migrate_room"

#: Rooms are 63-bit: [0, MAX_ROOM).
MAX_ROOM = 2**63
MAX_DP_RANK = 1 << 16
MAX_SAMPLES = 1024
MAX_PREFILLED_TOKENS = 1 << 31
#: Port of P's bootstrap server when nobody names one.
DEFAULT_BOOTSTRAP_PORT = 18800


class KVParamsError(ValueError):
    """kv_transfer_params of a request are malformed."""


@dataclass(frozen=True)
class PrefillParams:
    """P side: compute the prompt, then push its KV to the D that asks for `room`.

    ``room`` is None when a P-then-D proxy named none: P picks one (``new_room``) and tells D
    through its answer (``decode_handoff``).
    """

    room: int | None
    #: Decode requests that load this room's KV: D's ``n`` (vLLM runs each sample as its own request).
    samples: int = 1

    def to_json(self) -> dict[str, Any]:
        """The kv_transfer_params a Router sends P for this room (no room: P picks one)."""
        out: dict[str, Any] = {REMOTE_DECODE: True, REMOTE_PREFILL: False}
        if self.room is not None:
            out[ROOM] = self.room
        if self.samples != 1:
            out[DECODE_SAMPLES] = self.samples
        return out


@dataclass(frozen=True)
class DecodeParams:
    """D side: the prompt's KV comes from the prefill deployment at bootstrap_host:port."""

    room: int
    bootstrap_host: str
    bootstrap_port: int
    prefill_dp_rank: int | None
    #: Tokens of D's prompt whose KV P holds (None: the whole prompt).
    prefilled_tokens: int | None = None
    #: Room D holds this request's KV as when it is aborted (migration on); None: not movable.
    migrate_room: int | None = None

    @property
    def bootstrap_addr(self) -> str:
        return host_port(self.bootstrap_host, self.bootstrap_port)

    def to_json(self) -> dict[str, Any]:
        """The kv_transfer_params a Router sends D (``prefill_dp_rank`` only when known)."""
        out: dict[str, Any] = {
            REMOTE_PREFILL: True,
            REMOTE_DECODE: False,
            ROOM: self.room,
            BOOTSTRAP_HOST: self.bootstrap_host,
            BOOTSTRAP_PORT: self.bootstrap_port,
        }
        if self.prefill_dp_rank is not None:
            out[PREFILL_DP_RANK] = self.prefill_dp_rank
        if self.prefilled_tokens is not None:
            out[PREFILLED_TOKENS] = self.prefilled_tokens
        if self.migrate_room is not None:
            out[MIGRATE_ROOM] = self.migrate_room
        return out


def host_port(host: str, port: int) -> str:
    """``host:port`` for a URL (an IPv6 literal in brackets)."""
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"


def _check_host(host: object) -> str:
    """A bootstrap host must be a DNS name or an IP literal (a URL's host part, nothing else)."""
    if not isinstance(host, str) or not host:
        raise KVParamsError(f"kv_transfer_params.bootstrap_host must be a non-empty string, got {host!r}")
    bare = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    ok = len(bare) <= 253 and all(c.isascii() and (c.isalnum() or c in "-._:%") for c in bare)
    if not ok or (":" in bare and not _is_ipv6(bare)):
        raise KVParamsError(f"kv_transfer_params.bootstrap_host is not a host name or IP address: {host!r}")
    return bare


def _is_ipv6(text: str) -> bool:
    try:
        ipaddress.IPv6Address(text.split("%", 1)[0])
    except ValueError:
        return False
    return True


def _int_field(params: dict[str, Any], key: str, lo: int, hi: int, required: bool = True) -> int | None:
    value = params.get(key)
    if value is None:
        if required:
            raise KVParamsError(f"kv_transfer_params.{key} is required")
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        try:
            # The gate alone is not enough: "²" and "--3" pass it, and int() rejects them.
            if not (isinstance(value, str) and value.strip().lstrip("-").isdigit()):
                raise ValueError
            value = int(value)
        except ValueError:
            raise KVParamsError(f"kv_transfer_params.{key} must be an integer, got {value!r}") from None
    if not lo <= value < hi:
        raise KVParamsError(f"kv_transfer_params.{key} must be in [{lo}, {hi}), got {value}")
    return value


def _flag(params: dict[str, Any], key: str) -> bool:
    value = params.get(key, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise KVParamsError(f"kv_transfer_params.{key} must be true or false, got {value!r}")
    return value


def parse_kv_params(params: Any, *, room_optional: bool = False) -> PrefillParams | DecodeParams | None:
    """Parse a request's kv_transfer_params; None if it asks for no PD transfer.

    ``room_optional``: a P request without ``bootstrap_room`` is valid (PrefillParams.room None;
    P itself parses this way). Raises KVParamsError with a message naming the bad field.
    """
    if params is None:
        return None
    if not isinstance(params, dict):
        raise KVParamsError(f"kv_transfer_params must be a JSON object, got {type(params).__name__}")
    remote_decode = _flag(params, REMOTE_DECODE)
    remote_prefill = _flag(params, REMOTE_PREFILL)
    if remote_decode and remote_prefill:
        raise KVParamsError("kv_transfer_params: do_remote_decode and do_remote_prefill are exclusive")
    if remote_decode:
        samples = _int_field(params, DECODE_SAMPLES, 1, MAX_SAMPLES + 1, required=False) or 1
        return PrefillParams(room=_int_field(params, ROOM, 0, MAX_ROOM, required=not room_optional), samples=samples)
    if remote_prefill:
        room = _int_field(params, ROOM, 0, MAX_ROOM)
        host = _check_host(params.get(BOOTSTRAP_HOST))
        port = _int_field(params, BOOTSTRAP_PORT, 1, 65536)
        dp_rank = _int_field(params, PREFILL_DP_RANK, 0, MAX_DP_RANK, required=False)
        prefilled = _int_field(params, PREFILLED_TOKENS, 1, MAX_PREFILLED_TOKENS, required=False)
        migrate_room = _int_field(params, MIGRATE_ROOM, 0, MAX_ROOM, required=False)
        assert room is not None and port is not None
        return DecodeParams(
            room=room,
            bootstrap_host=host,
            bootstrap_port=port,
            prefill_dp_rank=dp_rank,
            prefilled_tokens=prefilled,
            migrate_room=migrate_room,
        )
    return None


def prefill_answer(room: int) -> dict[str, Any]:
    """kv_transfer_params of P's answer once its prefill finished and its KV waits for D."""
    return {ROOM: room, PREFILL_DONE: True}


def prefill_refused(room: int, error: str) -> dict[str, Any]:
    """kv_transfer_params of P's answer when it holds no KV for D (``error`` says why)."""
    return {ROOM: room, PREFILL_DONE: False, PREFILL_ERROR: error}


def refusal_of(answer: Any) -> str | None:
    """The error of a P answer (a completion's JSON body) that refused its room; None otherwise."""
    params = answer.get(KV_PARAMS_KEY) if isinstance(answer, dict) else None
    if not isinstance(params, dict) or params.get(PREFILL_DONE) is not False:
        return None
    error = params.get(PREFILL_ERROR)
    return error if isinstance(error, str) and error else None


def new_room() -> int:
    """A fresh random 63-bit room, for a P request that named none (no I/O)."""
    return secrets.randbelow(MAX_ROOM)


def decode_handoff(room: int, bootstrap_host: str, bootstrap_port: int, prefill_dp_rank: int) -> dict[str, Any]:
    """P's answer for P-then-D proxies: exactly the kv_transfer_params D needs, plus ``prefill_done``.

    A proxy that passes P's answer on to D (as vLLM-Ascend's example proxy does) thereby sends D
    ``do_remote_prefill``, the room, P's bootstrap server and the DP rank that holds the KV.
    """
    params = DecodeParams(room, bootstrap_host, bootstrap_port, prefill_dp_rank).to_json()
    params[PREFILL_DONE] = True
    return params
