"""One shared secret for PDConnector's control plane (issue 9 P3).

The token comes from a file (``auth_token_file``) or an environment variable (``auth_token_env``)
named in ``kv_connector_extra_config``, never from the command line itself. With a token:

- every bootstrap HTTP call carries ``Authorization: Bearer <token>`` (``/bootstrap/health`` excepted),
  checked by the server with a constant-time compare;
- every ZMQ frame is ``MAC(32 bytes) + payload``, the MAC an HMAC-SHA256 of the payload keyed with
  the token; a frame whose MAC does not match is refused (counted, logged with the sender it claims).

Without a token, frames and calls are unsigned (a loopback deployment, or ``insecure: true``).
"""

from __future__ import annotations

import hashlib
import hmac
import os
from pathlib import Path

MAC_BYTES = 32
AUTH_HEADER = "Authorization"


class AuthError(ValueError):
    """The token cannot be read, or a frame / call does not carry the right one."""


def load_token(token_file: str, token_env: str) -> bytes | None:
    """The token named by the config (file first, else environment variable); None if neither is set."""
    if token_file and token_env:
        raise AuthError("set one of kv_connector_extra_config.auth_token_file and auth_token_env, not both")
    if token_file:
        try:
            text = Path(token_file).read_text().strip()
        except OSError as exc:
            raise AuthError(f"kv_connector_extra_config.auth_token_file {token_file!r} cannot be read: {exc}") from None
        source = f"file {token_file}"
    elif token_env:
        text = os.environ.get(token_env, "").strip()
        source = f"environment variable {token_env}"
    else:
        return None
    if len(text) < 16:
        raise AuthError(f"the auth token from {source} is empty or shorter than 16 characters")
    return text.encode()


def sign(token: bytes | None, payload: bytes) -> bytes:
    """The frame to send: ``payload`` itself without a token, else its MAC followed by it."""
    if token is None:
        return payload
    return hmac.new(token, payload, hashlib.sha256).digest() + payload


def verify(token: bytes | None, frame: bytes) -> bytes:
    """The payload of a received frame; raises AuthError if the token is set and its MAC is wrong."""
    if token is None:
        return frame
    if len(frame) < MAC_BYTES:
        raise AuthError(f"frame of {len(frame)} bytes carries no MAC")
    mac, payload = frame[:MAC_BYTES], frame[MAC_BYTES:]
    if not hmac.compare_digest(mac, hmac.new(token, payload, hashlib.sha256).digest()):
        raise AuthError("frame MAC does not match the shared token")
    return payload


def bearer(token: bytes | None) -> dict[str, str]:
    """Headers of a bootstrap call (none without a token)."""
    return {AUTH_HEADER: f"Bearer {token.decode()}"} if token is not None else {}


def check_bearer(token: bytes | None, header: str | None) -> bool:
    """Whether a call's ``Authorization`` header carries the token (always true without one)."""
    if token is None:
        return True
    expected = f"Bearer {token.decode()}".encode()
    return hmac.compare_digest((header or "").encode(), expected)
