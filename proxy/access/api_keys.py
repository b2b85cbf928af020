"""Who may call the Router: client API keys and the admin token.

- ``/v1/*`` (completions, chat, models; as ``vllm serve --api-key`` guards its ``/v1`` prefix):
  with API keys configured, the client must send ``Authorization: Bearer <key>``; else 401.
- Admin routes (:data:`proxy.admin.instances.ADMIN_PATHS`: ``/instances``, ``/instances/add|remove``,
  ``/reset_prefix_cache``): with an admin token configured, every caller must send it as
  ``Authorization: Bearer <token>`` (an API key is not enough). ``python -m proxy`` always has
  one: configured, or generated at start-up into a 0600 file (:mod:`proxy.access.admin_token`), unless
  ``--insecure-admin`` opens the admin routes to everyone. An application built with neither
  answers every admin call 403.
- ``/health``, ``/healthcheck``, ``/metrics`` stay open, as on ``vllm serve``; ``/health`` gives
  every backend's record (addresses, errors) only to a caller with the admin token, a summary
  (verdict and counts) to others.

Keys are compared as SHA-256 digests with :func:`hmac.compare_digest` (constant time, and the
length of a key does not leak); every key is compared, so the time does not say which matched.
The check wraps only the guarded routes' handlers (nothing at all runs when no key is set): one
header lookup and one digest compare per request. A refusal is one WARNING line naming the
caller's address, the route and the request id, and is counted in
``pd_router_auth_refused_total{endpoint,reason}``.
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import ipaddress
import logging
from collections.abc import Collection
from typing import TYPE_CHECKING

from aiohttp import web

from pd_connector.log_limit import LogLimiter
from proxy.errors import error_response
from proxy.request.incoming import request_id
from proxy.router_config import AccessConfig
from proxy.server.reply import Answer

if TYPE_CHECKING:
    from proxy.admin.instances import Handler
    from proxy.router_metrics import RouterMetrics

logger = logging.getLogger("proxy")

#: Paths guarded by the client API keys (``vllm serve`` guards the same prefix).
CLIENT_PREFIX = "/v1"
#: OpenAI error types of a refusal.
AUTHENTICATION_ERROR = "authentication_error"
PERMISSION_ERROR = "permission_error"


class Refusal(enum.Enum):
    """Why a call was refused (the ``reason`` label of ``pd_router_auth_refused_total``)."""

    MISSING = "missing"  # no bearer credential
    WRONG = "wrong"  # a credential that is not a configured key/token
    NO_TOKEN = "no_token"  # an admin call, and no admin token is configured (library use)


class Access(enum.Enum):
    """What a route requires."""

    PUBLIC = "public"
    CLIENT = "client"
    ADMIN = "admin"


def _digest(secret: str) -> bytes:
    return hashlib.sha256(secret.encode("utf-8")).digest()


class BearerCheck:
    """``Authorization: Bearer <secret>`` checked against a set of secrets in constant time."""

    __slots__ = ("_digests",)

    def __init__(self, secrets: Collection[str]) -> None:
        if not secrets:
            raise ValueError("BearerCheck needs at least one secret")
        self._digests = tuple(_digest(s) for s in secrets)

    def check(self, header: str | None) -> Refusal | None:
        """``None`` if ``header`` carries one of the secrets, else why not."""
        if not header:
            return Refusal.MISSING
        scheme, _, credential = header.partition(" ")
        if scheme.lower() != "bearer" or not credential.strip():
            return Refusal.MISSING
        digest = _digest(credential.strip())
        match = False
        for known in self._digests:
            match |= hmac.compare_digest(known, digest)
        return None if match else Refusal.WRONG


def is_loopback(remote: str | None) -> bool:
    """Whether a peer address (``request.remote``) is a loopback one (IPv4, IPv6, v4-mapped)."""
    if not remote:
        return False
    try:
        address = ipaddress.ip_address(remote.split("%", 1)[0])
    except ValueError:
        return False
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped.is_loopback
    return address.is_loopback


def access_of(path: str, admin_paths: Collection[str]) -> Access:
    """What calling ``path`` requires."""
    if path in admin_paths:
        return Access.ADMIN
    if path == CLIENT_PREFIX or path.startswith(CLIENT_PREFIX + "/"):
        return Access.CLIENT
    return Access.PUBLIC


class Gate:
    """The Router's access rules (:class:`AccessConfig`), applied by wrapping route handlers."""

    def __init__(self, access: AccessConfig, metrics: RouterMetrics, admin_paths: Collection[str]) -> None:
        self.access = access
        self.metrics = metrics
        self.admin_paths = frozenset(admin_paths)
        self.client = BearerCheck(access.api_keys) if access.api_keys else None
        self.admin = BearerCheck([access.admin_token]) if access.admin_token else None
        #: Refusal lines: a few per endpoint, reason and caller per window (pd_connector.log_limit).
        self._refusals = LogLimiter(logger)

    def wrap(self, endpoint: str, handler: Handler) -> Handler:
        """``handler`` behind the rule of ``endpoint`` (itself when nothing is required)."""
        kind = access_of(endpoint, self.admin_paths)
        if kind is Access.CLIENT and self.client is not None:
            return self._bearer(endpoint, handler, self.client, "an API key")
        if kind is Access.ADMIN:
            if self.admin is not None:
                return self._bearer(endpoint, handler, self.admin, "the admin token")
            if not self.access.insecure_admin:
                return self._no_admin(endpoint)
        return handler

    def admits_admin(self, request: web.Request) -> bool:
        """Whether ``request`` carries the admin token (always, with ``--insecure-admin``): who may
        read the details of ``/health``. Refused here is not counted: the route itself is public."""
        if self.admin is None:
            return self.access.insecure_admin
        return self.admin.check(request.headers.get("Authorization")) is None

    def wrap_fallback(self, handler: Handler) -> Handler:
        """The 404/405 handler: under ``/v1`` a caller without a key gets 401 first (as vLLM)."""
        client = self.client
        if client is None:
            return handler
        bearer = self._bearer(CLIENT_PREFIX + "/*", handler, client, "an API key")

        async def fallback(request: web.Request) -> Answer:
            if access_of(request.path, ()) is Access.CLIENT and request.method != "OPTIONS":
                return await bearer(request)
            return await handler(request)

        return fallback

    def _bearer(self, endpoint: str, handler: Handler, check: BearerCheck, what: str) -> Handler:
        async def guarded(request: web.Request) -> Answer:
            refusal = check.check(request.headers.get("Authorization"))
            if refusal is None:
                return await handler(request)
            message = f"{endpoint} needs {what}: send 'Authorization: Bearer <key>'"
            if refusal is Refusal.WRONG:
                message = f"{endpoint}: the bearer credential is not valid ({what} is needed)"
            self._refused(request, endpoint, refusal)
            return error_response(
                401, message, AUTHENTICATION_ERROR, {"WWW-Authenticate": "Bearer", "X-Request-Id": request_id(request)}
            )

        return guarded

    def _no_admin(self, endpoint: str) -> Handler:
        async def refuse(request: web.Request) -> Answer:
            self._refused(request, endpoint, Refusal.NO_TOKEN)
            message = (
                f"{endpoint} is refused: no admin token is configured on the Router "
                "(--admin-token-file or PD_ROUTER_ADMIN_TOKEN; --insecure-admin opens it to everyone)"
            )
            return error_response(403, message, PERMISSION_ERROR, {"X-Request-Id": request_id(request)})

        return refuse

    def _refused(self, request: web.Request, endpoint: str, refusal: Refusal) -> None:
        self._refusals.warning(
            (endpoint, refusal.value, request.remote),
            "rid=%s refused %s %s from %s: %s credential",
            request_id(request),
            request.method,
            request.path,
            request.remote or "?",
            refusal.value,
        )
        self.metrics.auth_refused(endpoint, refusal.value)


def startup_notes(access: AccessConfig, host: str) -> list[tuple[int, str]]:
    """What the Router says at start-up about its access rules: ``(log level, line)`` pairs."""
    notes: list[tuple[int, str]] = []
    exposed = not is_loopback(host) and host != "localhost"
    if access.api_keys:
        notes.append(
            (logging.INFO, f"clients need an API key on {CLIENT_PREFIX}/* ({len(access.api_keys)} configured)")
        )
    elif exposed:
        notes.append(
            (logging.WARNING, f"no API key configured: anyone who reaches {host} can send requests "
             "(--api-key-file or PD_ROUTER_API_KEY)")
        )  # fmt: skip
    if access.admin_token and access.generated_token_file:
        notes.append(
            (logging.WARNING, "no admin token configured: generated one for the admin routes (/instances*, "
             f"/reset_prefix_cache) in {access.generated_token_file} (mode 0600; send it as 'Authorization: Bearer')")
        )  # fmt: skip
    elif access.admin_token:
        notes.append((logging.INFO, "admin routes (/instances*, /reset_prefix_cache) need the admin token"))
    elif access.insecure_admin:
        notes.append(
            (logging.WARNING, "--insecure-admin: admin routes (/instances*, /reset_prefix_cache) answer anyone")
        )
    else:
        notes.append(
            (logging.WARNING, "no admin token configured: admin routes (/instances*, /reset_prefix_cache) refuse "
             "every call (--admin-token-file or PD_ROUTER_ADMIN_TOKEN)")
        )  # fmt: skip
    return notes
