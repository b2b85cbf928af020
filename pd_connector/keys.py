"""Keys derived from the shared control-plane secret: one per purpose, never the secret.

The configured token (``auth.load_token``) is only keying material. Each use gets its own key,
HKDF-SHA256 (RFC 5869) of the token with a purpose label:

- ``frame``: the HMAC key of every ZMQ frame (``transfer.frames``);
- ``bootstrap``: the HMAC key of every bootstrap HTTP call (``bootstrap.signing``).

HKDF is one-way: a party that learns one key (a bootstrap server that sees a call's signature never
does, but a key could leak from a process) learns neither the token nor the other key. The token itself
never leaves the process: no header, frame or log line carries it.
"""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass

#: HKDF salt: fixed, names the protocol (RFC 5869 allows a non-secret constant).
SALT = b"pd-connector control plane"
FRAME_INFO = b"pd-connector/v2 zmq frame mac"
BOOTSTRAP_INFO = b"pd-connector/v2 bootstrap call mac"
KEY_BYTES = 32


def hkdf_sha256(ikm: bytes, info: bytes, length: int = KEY_BYTES, salt: bytes = SALT) -> bytes:
    """RFC 5869 HKDF with SHA-256: extract (HMAC(salt, ikm)) then expand ``length`` bytes for ``info``."""
    if not 0 < length <= 255 * hashlib.sha256().digest_size:
        raise ValueError(f"HKDF-SHA256 output length must be 1..{255 * 32}, got {length}")
    prk = hmac.new(salt, ikm, hashlib.sha256).digest()
    out, block, counter = b"", b"", 1
    while len(out) < length:
        block = hmac.new(prk, block + info + bytes([counter]), hashlib.sha256).digest()
        out += block
        counter += 1
    return out[:length]


@dataclass(frozen=True, repr=False)
class Keys:
    """The per-purpose keys of one deployment's token (``repr`` hides them)."""

    frame: bytes
    bootstrap: bytes

    def __repr__(self) -> str:
        return "Keys(frame=<hidden>, bootstrap=<hidden>)"


def derive_keys(token: bytes) -> Keys:
    """The frame and bootstrap keys of ``token`` (distinct, each 32 bytes)."""
    return Keys(frame=hkdf_sha256(token, FRAME_INFO), bootstrap=hkdf_sha256(token, BOOTSTRAP_INFO))


def frame_key(token: bytes | None) -> bytes | None:
    """The ZMQ frame key of ``token`` (None without a token: frames unsigned)."""
    return None if token is None else derive_keys(token).frame


def bootstrap_key(token: bytes | None) -> bytes | None:
    """The bootstrap call key of ``token`` (None without a token: calls unsigned)."""
    return None if token is None else derive_keys(token).bootstrap
