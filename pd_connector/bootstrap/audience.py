"""Which bootstrap server a signed call is for: its server id, read once per address and kept.

A signed bootstrap call names its audience, the id of the server it is for (``bootstrap.signing``). A
server draws its id when it starts and tells it to anyone in its ``GET /bootstrap/health`` answer (not
signed: the id is public, it only names the server). A client (``bootstrap.client``) reads it the first
time it calls an address and keeps it (``ServerIds``), so a call costs no extra round trip; a call
refused for naming another id (the server restarted: a new id) makes the client read it again and sign
once more. Over plain http a man in the middle can lie about the id, or forward a call anywhere: the
bootstrap server's TLS (``bootstrap_ssl_*``) is what ties an address to its server.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any, Protocol

import httpx

from pd_connector.bootstrap.signing import SERVER_ID, VERSION

HEALTH_PATH = "/bootstrap/health"
#: Addresses whose server id a process keeps at most (the oldest forgotten first).
KEPT = 4096


class Send(Protocol):
    """``httpx.request`` / ``httpx.Client.request``: how a client sends one request."""

    def __call__(self, method: str, url: str, **kwargs: Any) -> httpx.Response: ...


class AudienceError(RuntimeError):
    """The server at an address tells no usable id; ``retry``: whether asking again later may help."""

    def __init__(self, message: str, retry: bool) -> None:
        super().__init__(message)
        self.retry = retry


class ServerIds:
    """Server ids by base URL (``http(s)://host:port``), read from ``/bootstrap/health`` (thread-safe)."""

    def __init__(self, kept: int = KEPT) -> None:
        self._ids: OrderedDict[str, str] = OrderedDict()
        self._kept = kept
        self._lock = threading.Lock()

    def of(self, base: str, send: Send, timeout_s: float) -> str:
        """The id of the server at ``base``: kept, else read from its health answer (httpx errors pass)."""
        with self._lock:
            known = self._ids.get(base)
        if known is not None:
            return known
        resp = send("GET", f"{base}{HEALTH_PATH}", timeout=timeout_s)
        if resp.status_code != 200:
            raise AudienceError(
                f"bootstrap server {base} answered GET {HEALTH_PATH} with HTTP {resp.status_code}; "
                "its server id (the audience of signed calls) is unknown",
                retry=resp.status_code >= 500,
            )
        try:
            answer = resp.json()
        except ValueError:
            answer = None
        server_id = answer.get("server_id") if isinstance(answer, dict) else None
        if not isinstance(server_id, str) or SERVER_ID.fullmatch(server_id) is None:
            raise AudienceError(
                f"bootstrap server {base} tells no server id in GET {HEALTH_PATH}: it runs a PDConnector older "
                f"than call signature version {VERSION} (calls signed for one server); run the same PDConnector "
                "release on every P and D",
                retry=False,
            )
        with self._lock:
            self._ids[base] = server_id
            self._ids.move_to_end(base)
            while len(self._ids) > self._kept:
                self._ids.popitem(last=False)
        return server_id

    def forget(self, base: str, server_id: str) -> None:
        """Drop ``base``'s id if it is still ``server_id`` (a call signed for it was refused as not for it)."""
        with self._lock:
            if self._ids.get(base) == server_id:
                del self._ids[base]


#: The process's server ids: every bootstrap client signs with them.
SERVER_IDS = ServerIds()
