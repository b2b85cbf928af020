"""Signed bootstrap calls: the token never travels, a captured call works nowhere, not even once more.

Every bootstrap call but ``/bootstrap/health`` carries

    Authorization: PDC-HMAC-SHA256 v=3,aud=<server id>,ts=<unix seconds>,nonce=<32 hex digits>,sig=<64 hex digits>

where ``sig`` is the HMAC-SHA256, keyed with the *bootstrap key* (``keys.bootstrap_key``: derived from the
token, never the token), of the version label, the *audience*, ``method``, path (and query), SHA-256 of the
body, ``ts`` and ``nonce`` (``canonical``).

The audience is the server id of the bootstrap server the call is for: 32 random hex digits a server draws
when it starts (``new_server_id``) and tells anyone in its ``GET /bootstrap/health`` answer (clients read it
once per address and keep it: ``bootstrap.audience``). One token may be shared by every P and D, so without
it a call captured on its way to one prefill deployment's server would be accepted, once, by any other; with
it, a server refuses a call signed for another id (HTTP 401, reason ``audience``), and a restarted server (a
new id) refuses calls captured before its restart although it forgot their nonces.

The server (``CallVerifier``) also refuses a call whose time is more than ``WINDOW_S`` from its own clock,
whose signature does not match, or whose nonce it already accepted within the window. It remembers accepted
nonces for ``2 * WINDOW_S`` (older calls are stale anyway), at most ``NONCES_KEPT``; with that many live it
refuses new calls (HTTP 429) rather than forget one. Only calls with a valid signature reach the nonce
store, so only key holders can fill it. A call signed the way of an older PDConnector (no ``v=``, or
another version) is refused with a message naming both versions.

A server that receives a call learns its signature: it cannot make another call from it (other audience,
method, path, body or nonce), nor a frame (the frame key is another HKDF output of the token).
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
#: The signature format this release signs and accepts (``v=`` of the header, part of the signed label).
VERSION = 3
#: How far a call's time may be from the server's clock (either way).
WINDOW_S = 60.0
#: Nonces of accepted calls a server remembers at most (calls per 2 * WINDOW_S).
NONCES_KEPT = 200_000
#: A server id: what ``new_server_id`` draws, what ``aud=`` carries.
SERVER_ID = re.compile(r"[0-9a-f]{32}")
_HEADER = re.compile(
    rf"{SCHEME} v=(\d{{1,3}}),aud=([0-9a-f]{{32}}),ts=(\d{{1,12}}),nonce=([0-9a-f]{{32}}),sig=([0-9a-f]{{64}})"
)
_OTHER_VERSION = re.compile(rf"{SCHEME} (?:v=(\d{{1,3}}),)?.*ts=\d")  # recognisably ours, another version
_LABEL = f"pd-connector bootstrap call v{VERSION}".encode()


def new_server_id() -> str:
    """A bootstrap server's id for one run (the audience calls to it are signed for)."""
    return secrets.token_hex(16)


def canonical(audience: str, method: str, target: str, body: bytes, ts: int, nonce: str) -> bytes:
    """The bytes a call's signature covers."""
    digest = hashlib.sha256(body).hexdigest()
    parts = (_LABEL, audience, method.upper(), target, digest, str(ts), nonce)
    return b"\n".join(x.encode() if isinstance(x, str) else x for x in parts)


def sign_call(
    key: bytes | None, method: str, target: str, body: bytes = b"", now: float | None = None, *, audience: str
) -> dict[str, str]:
    """The headers that sign one call (none without a key) for the server whose id is ``audience``.

    ``target``: path and query, as the server sees them."""
    if key is None:
        return {}
    if SERVER_ID.fullmatch(audience) is None:
        raise ValueError(f"bootstrap server id {audience!r} is not 32 lowercase hex digits")
    ts = int(time.time() if now is None else now)
    nonce = secrets.token_hex(16)
    sig = hmac.new(key, canonical(audience, method, target, body, ts, nonce), hashlib.sha256).hexdigest()
    return {AUTH_HEADER: f"{SCHEME} v={VERSION},aud={audience},ts={ts},nonce={nonce},sig={sig}"}


def signed_headers(
    token: bytes | None, method: str, target: str, body: bytes = b"", *, audience: str
) -> dict[str, str]:
    """``sign_call`` with the bootstrap key of ``token`` (tools and tests that hold the token)."""
    return sign_call(bootstrap_key(token), method, target, body, audience=audience)


@dataclass(frozen=True)
class Refusal:
    """Why a call was refused: its HTTP status, a short ``reason`` (malformed, version, stale, signature,
    audience, replay, busy) and a message that names the problem (never a key)."""

    status: int
    message: str
    reason: str = ""


class CallVerifier:
    """The server side: checks a call's signature, audience, time and nonce (thread-safe).

    ``audience``: this server's id (``new_server_id``)."""

    def __init__(
        self,
        key: bytes,
        audience: str,
        window_s: float = WINDOW_S,
        kept: int = NONCES_KEPT,
        clock: Callable[[], float] = time.time,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self._key = key
        self.audience = audience
        self._window = window_s
        self._kept = kept
        self._clock = clock  # wall clock: compared with the caller's ts
        self._monotonic = monotonic  # when a remembered nonce may be forgotten
        self._nonces: OrderedDict[str, float] = OrderedDict()  # nonce -> forget at (monotonic), oldest first
        self._lock = threading.Lock()

    def check(self, method: str, target: str, body: bytes, header: str | None) -> Refusal | None:
        """None if the call is signed for this server, fresh and new; else why not."""
        text = (header or "").strip()
        m = _HEADER.fullmatch(text)
        if m is None or int(m.group(1)) != VERSION:
            return _format_refusal(text, m)
        audience, ts, nonce, sig = m.group(2), int(m.group(3)), m.group(4), m.group(5)
        skew = self._clock() - ts
        if abs(skew) > self._window:
            return Refusal(
                401,
                f"call signed {skew:.0f} s away from this server's clock (accepted within {self._window:g} s)",
                "stale",
            )
        expected = hmac.new(self._key, canonical(audience, method, target, body, ts, nonce), hashlib.sha256)
        if not hmac.compare_digest(sig, expected.hexdigest()):
            return Refusal(
                401, "call signature does not match (a wrong token, or a changed method, path or body)", "signature"
            )
        if not hmac.compare_digest(audience, self.audience):
            return Refusal(
                401,
                f"call is signed for bootstrap server {audience}, this is {self.audience} (a call meant for another "
                "server or deployment, or for this one before it restarted)",
                "audience",
            )
        now = self._monotonic()
        with self._lock:
            while self._nonces and next(iter(self._nonces.values())) <= now:
                self._nonces.popitem(last=False)
            if nonce in self._nonces:
                return Refusal(401, f"call nonce {nonce} was already used (a replayed call)", "replay")
            if len(self._nonces) >= self._kept:
                return Refusal(
                    429, f"more than {self._kept} signed calls within {2 * self._window:g} s; try again later", "busy"
                )
            self._nonces[nonce] = now + 2 * self._window
        return None

    @property
    def remembered(self) -> int:
        with self._lock:
            return len(self._nonces)


def _format_refusal(text: str, m: re.Match[str] | None) -> Refusal:
    """Why a header is not a version-``VERSION`` signature: another version (named), or not one at all."""
    other = m.group(1) if m is not None else None
    if other is None and (old := _OTHER_VERSION.match(text)) is not None:
        other = old.group(1) or "2"  # version 2 wrote no v=
    if other is not None and other != str(VERSION):
        return Refusal(
            401,
            f"call signed with PDConnector call signature version {other}; this server accepts version {VERSION} only "
            "(signed for one server's id): run the same PDConnector release on every P and D",
            "version",
        )
    return Refusal(
        401,
        f"missing or malformed call signature (expected '{AUTH_HEADER}: {SCHEME} v={VERSION},aud=<server id>,"
        "ts=...,nonce=...,sig=...')",
        "malformed",
    )
