"""One shared secret for PDConnector's control plane (the secret itself never travels: keys are derived from it).

The token comes from a file (``auth_token_file``) or an environment variable (``auth_token_env``)
named in ``kv_connector_extra_config``, never from the command line itself. It is keying material
only (``keys``: HKDF-SHA256, one key per purpose); no call, frame or log line carries it:

- every bootstrap HTTP call (``/bootstrap/health`` excepted) carries an HMAC signature of the id of the
  server it is for (its audience), its method, path, body hash, time and a fresh nonce, keyed with the
  *bootstrap key* (``bootstrap.signing``); the server refuses a wrong, stale, repeated one, or one meant
  for another server (one token may be shared by every P and D);
- every ZMQ frame is ``MAC(32 bytes) + envelope + payload`` (``transfer.frames``): sender, session,
  sequence, time and receiver (its audience) under an HMAC-SHA256 keyed with the *frame key*; a frame
  whose MAC does not match, or that is stale, misdirected or a replay, is refused (counted, logged by
  size and reason).

Without a token, frames and calls are unsigned (a loopback deployment, or ``insecure: true``).
"""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Protocol

MAC_BYTES = 32
AUTH_HEADER = "Authorization"


class AuthError(ValueError):
    """The token cannot be read, or a frame / call does not carry the right one."""


class TokenSettings(Protocol):
    """Where a config names its token (``DisaggConfig``'s two keys)."""

    @property
    def auth_token_file(self) -> str: ...

    @property
    def auth_token_env(self) -> str: ...


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


@functools.lru_cache(maxsize=8)
def _cached_token(token_file: str, token_env: str) -> bytes | None:
    return load_token(token_file, token_env)


def token_of(cfg: TokenSettings) -> bytes | None:
    """The control-plane token ``cfg`` names (read once per file / variable name), None without one."""
    return _cached_token(cfg.auth_token_file, cfg.auth_token_env)
