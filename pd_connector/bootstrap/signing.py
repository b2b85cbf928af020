"""Signed bootstrap calls: the token never travels, a captured call cannot be replayed.

Every bootstrap call but ``/bootstrap/health`` carries

    Authorization: PDC-HMAC-SHA256 ts=<unix seconds>,nonce=<32 hex digits>,sig=<64 hex digits>

where ``sig`` is the HMAC-SHA256, keyed with the *bootstrap key* (``keys.bootstrap_key``: derived from the
token, never the token), of ``method``, path (and query), SHA-256 of the body, ``ts`` and ``nonce``
(``canonical``). The server (``CallVerifier``) refuses a call whose time is more than ``WINDOW_S`` from
its own clock, whose signature does not match, or whose nonce it already accepted within the window. It
remembers accepted nonces for ``2 * WINDOW_S`` (older calls are stale anyway), at most ``NONCES_KEPT``;
with that many live it refuses new calls (HTTP 429) rather than forget one. Only calls with a valid
signature reach the nonce store, so only key holders can fill it.

A server that receives a call learns its signature: it cannot make another call from it (other method,
path, body or nonce), nor a frame (the frame key is another HKDF output of the token).
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from pd_connector.auth import AUTH_HEADER
from pd_connector.keys import bootstrap_key

SCHEME = "PDC-HMAC-SHA256"
#: How far a call's time may be from the server's clock (either way).
WINDOW_S = 60.0
#: Nonces of accepted calls a server remembers at most (calls per 2 * WINDOW_S).
NONCES_KEPT = 200_000
_HEADER = re.compile(rf"{SCHEME} ts=(\d{{1,12}}),nonce=([0-9a-f]{{32}}),sig=([0-9a-f]{{64}})")
_LABEL = b"pd-connector bootstrap call v2"


def canonical(method: str, target: str, body: bytes, ts: int, nonce: str) -> bytes:
    """The bytes a call's signature covers."""
    digest = hashlib.sha256(body).hexdigest()
    return b"\n".join(
        x.encode() if isinstance(x, str) else x for x in (_LABEL, method.upper(), target, digest, str(ts), nonce)
    )


def sign_call(
    key: bytes | None, method: str, target: str, body: bytes = b"", now: float | None = None
) -> dict[str, str]:
    """The headers that sign one call (none without a key). ``target``: path and query, as the server sees them."""
    if key is None:
        return {}
    ts = int(time.time() if now is None else now)
    nonce = secrets.token_hex(16)
    sig = hmac.new(key, canonical(method, target, body, ts, nonce), hashlib.sha256).hexdigest()
    return {AUTH_HEADER: f"{SCHEME} ts={ts},nonce={nonce},sig={sig}"}


def signed_headers(token: bytes | None, method: str, target: str, body: bytes = b"") -> dict[str, str]:
    """``sign_call`` with the bootstrap key of ``token`` (tools and tests that hold the token)."""
    return sign_call(bootstrap_key(token), method, target, body)


@dataclass(frozen=True)
class Refusal:
    """Why a call was refused: its HTTP status and a message that names the problem (never a key)."""

    status: int
    message: str


class CallVerifier:
    """The server side: checks a call's signature, time and nonce (thread-safe)."""

    def __init__(
        self,
        key: bytes,
        window_s: float = WINDOW_S,
        kept: int = NONCES_KEPT,
        clock: Callable[[], float] = time.time,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self._key = key
        self._window = window_s
        self._kept = kept
        self._clock = clock  # wall clock: compared with the caller's ts
        self._monotonic = monotonic  # when a remembered nonce may be forgotten
        self._nonces: OrderedDict[str, float] = OrderedDict()  # nonce -> forget at (monotonic), oldest first
        self._lock = threading.Lock()

    def check(self, method: str, target: str, body: bytes, header: str | None) -> Refusal | None:
        """None if the call is signed, fresh and new; else why not (its nonce is then remembered)."""
        m = _HEADER.fullmatch((header or "").strip())
        if m is None:
            return Refusal(
                401,
                f"missing or malformed call signature (expected '{AUTH_HEADER}: {SCHEME} ts=...,nonce=...,sig=...')",
            )
        ts, nonce, sig = int(m.group(1)), m.group(2), m.group(3)
        skew = self._clock() - ts
        if abs(skew) > self._window:
            return Refusal(
                401, f"call signed {skew:.0f} s away from this server's clock (accepted within {self._window:g} s)"
            )
        expected = hmac.new(self._key, canonical(method, target, body, ts, nonce), hashlib.sha256).hexdigest()
        if not hmac.compare_digest(sig, expected):
            return Refusal(401, "call signature does not match (a wrong token, or a changed method, path or body)")
        now = self._monotonic()
        with self._lock:
            while self._nonces and next(iter(self._nonces.values())) <= now:
                self._nonces.popitem(last=False)
            if nonce in self._nonces:
                return Refusal(401, f"call nonce {nonce} was already used (a replayed call)")
            if len(self._nonces) >= self._kept:
                return Refusal(
                    429, f"more than {self._kept} signed calls within {2 * self._window:g} s; try again later"
                )
            self._nonces[nonce] = now + 2 * self._window
        return None

    @property
    def remembered(self) -> int:
        with self._lock:
            return len(self._nonces)
