"""The admin API: instances added and removed at run time, and ``/reset_prefix_cache``.

- ``GET /instances``: every instance (active, draining, waiting) and the routing policy;
- ``POST /instances/add`` and ``/instances/remove`` (bodies: :func:`parse_instances`): an added
  instance joins once it answers its health check (:class:`Membership`); a removed one drains;
- ``POST /instances/drain`` (same bodies, ``timeout_s`` optional): removed, its streams moved, the
  answer once it holds nothing (:mod:`proxy.admin.drain`);
- ``POST /instances/role``: a kv_role kv_both instance serves as a prefiller, a decoder or both, the
  role it gives up drained first (:mod:`proxy.admin.roles`);
- ``POST /reset_prefix_cache``: forwarded to every active backend.

Every one of them is behind the admin token (:mod:`proxy.access.api_keys`; loopback callers only when
none is configured).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from aiohttp import web

from pd_connector.kv_params import DEFAULT_BOOTSTRAP_PORT
from proxy.admin.drain import DEFAULT_DRAIN_TIMEOUT_S
from proxy.admin.roles import RoleChanges, parse_role_change
from proxy.errors import INVALID_REQUEST, NOT_FOUND, RouterError, json_response
from proxy.request.incoming import read_json
from proxy.router_config import ROLES, Backend, Role
from proxy.server.reply import Answer
from proxy.upstream.calls import Failure, fetch, probe
from proxy.upstream.pool import BackendState

if TYPE_CHECKING:
    from proxy.router_state import Router

logger = logging.getLogger("proxy")

Handler = Callable[[web.Request], Awaitable[Answer]]

#: The admin routes' paths (:mod:`proxy.access.api_keys` guards them with the admin token).
ADMIN_PATHS = frozenset(
    {"/instances", "/instances/add", "/instances/remove", "/instances/drain", "/instances/role", "/reset_prefix_cache"}
)


class Membership:
    """Instances added and removed at run time; those added that are not healthy yet wait here."""

    def __init__(self, router: Router) -> None:
        self.router = router
        self.pool = router.pool
        self.config = router.config
        #: Instances added at run time that have not answered a health check yet.
        self.waiting: dict[tuple[str, str, int], tuple[Backend, asyncio.Task[None]]] = {}

    async def _check(self, state: BackendState) -> bool:
        healthy, status, error = await probe(self.router.http, state, self.config.health_timeout)
        state.status_code, state.last_error = status, error
        return healthy

    async def add(self, backend: Backend) -> str:
        """Add ``backend`` to the pool; returns what happened (``added``, ``waiting``, ...)."""
        pool = self.pool
        existing = pool.find(backend.role, backend.host, backend.port)
        if existing is not None:
            changed = existing.backend != backend  # e.g. a decoder restarted with migration's bootstrap port
            if changed:
                logger.info("%s %s: now %s (was %s)", backend.role, backend.address, backend, existing.backend)
                existing.backend = backend
            if existing.draining:
                pool.undrain(existing)
                return "re-activated"
            return "updated" if changed else "already present"
        if backend.key in self.waiting:
            return "waiting"
        state = BackendState(backend, healthy=False)
        healthy = await self._check(state)
        if pool.find(backend.role, backend.host, backend.port) is not None:
            return "already present"  # added concurrently
        if healthy:
            state.healthy = True
            pool.add_state(state)
            return "added"
        logger.warning(
            "%s does not answer its health check yet (%s); checking %d more time(s), %gs apart",
            backend.name,
            state.last_error,
            self.config.max_waiting_retries - 1,
            self.config.waiting_retry_interval,
        )
        task = self.router.spawn(self._wait_for(state))
        self.waiting[backend.key] = (backend, task)
        return "waiting"

    async def _wait_for(self, state: BackendState) -> None:
        backend = state.backend
        try:
            for _ in range(self.config.max_waiting_retries - 1):
                await asyncio.sleep(self.config.waiting_retry_interval)
                if await self._check(state):
                    state.healthy = True
                    self.pool.add_state(state)
                    return
            logger.warning("%s was not added: it did not answer its health checks (%s)", backend.name, state.last_error)
        finally:
            self.waiting.pop(backend.key, None)

    def known(self, backend: Backend) -> bool:
        """Whether ``backend`` is in the pool (active or draining) or waiting to join."""
        return self.pool.find(backend.role, backend.host, backend.port) is not None or backend.key in self.waiting

    def remove(self, role: Role, host: str, port: int) -> str | None:
        """Remove (drain) an instance; returns what happened, or ``None`` if it is unknown."""
        state = self.pool.find(role, host, port)
        if state is None:
            entry = self.waiting.pop((role, host, port), None)
            if entry is None:
                return None
            entry[1].cancel()
            logger.info("%s removed before it became healthy", entry[0].name)
            return "removed"
        if state.draining:
            return "draining"
        return "removed" if self.pool.remove(state) else "draining"

    def listing(self) -> dict[str, Any]:
        """Every instance (active, draining, waiting), in ``/instances`` form."""
        pool = self.pool
        snapshot = pool.snapshot()
        snapshot["waiting"] = [
            {"role": b.role, "host": b.host, "port": b.port, "url": b.url(pool.tls)} for b, _ in self.waiting.values()
        ]
        snapshot["routing"] = self.config.routing
        # vLLM-Ascend proxy's keys.
        snapshot["current_prefill_instances"] = [s.backend.address for s in pool.active["prefill"]]
        snapshot["current_decode_instances"] = [s.backend.address for s in pool.active["decode"]]
        return snapshot

    def report(self, action: str, backends: list[Backend], results: list[str | None]) -> dict[str, Any]:
        """Log ``action``'s results and return the answer's body (results and listing)."""
        pairs = list(zip(backends, results, strict=True))
        message = "; ".join(f"{b.name}: {r}" for b, r in pairs)
        logger.info("instances/%s: %s", action, ", ".join(f"{b.name}: {r}" for b, r in pairs))
        done = [{"role": b.role, "host": b.host, "port": b.port, "result": r} for b, r in pairs]
        return {"message": message, "results": done, **self.listing()}


def _parse_address(text: str) -> tuple[str, int]:
    """``"host:port"`` or ``"[v6]:port"`` -> (host, port)."""
    host, sep, port = text.strip().rpartition(":")
    if not sep or not host or not port.isdigit():
        raise RouterError(400, f"instance {text!r} is not host:port", INVALID_REQUEST, "instances")
    return host.strip("[]"), int(port)


def _check_port(value: Any, field: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 65535:
        raise RouterError(400, f"'{field}' must be a port number in 1..65535, got {value!r}", INVALID_REQUEST, field)
    return value


def parse_instances(payload: Any) -> list[Backend]:
    """The instances named by an ``/instances/add`` or ``/instances/remove`` body.

    Either ``{"role": "prefill"|"decode", "host": H, "port": P, "bootstrap_port": B?}`` or
    vLLM-Ascend's ``{"type": "prefill"|"decode", "instances": ["H:P", ...] | "H:P"}`` (an item
    may also be an object with host, port and bootstrap_port). A prefiller's bootstrap port
    defaults to the top-level ``bootstrap_port``, else 18800; a decoder has one only where given
    (its own bootstrap server, connector ``migration``: a drain moves its streams with their KV);
    ``bootstrap_host`` and ``dp_rank``
    (see :class:`proxy.router_config.Backend`) may be given at the top level or per item.
    ``"kv_role": "kv_both"`` (top level) says the instances were started with kv_role kv_both: they
    may change pools later (``/instances/role``); a kv_both decoder has no bootstrap port (no migration).
    """
    if not isinstance(payload, dict):
        raise RouterError(400, "request body must be a JSON object", INVALID_REQUEST)
    role = payload.get("role", payload.get("type"))
    if role not in ROLES:
        raise RouterError(400, f"'role' must be 'prefill' or 'decode', got {role!r}", INVALID_REQUEST, "role")
    # A decoder has a bootstrap port only when one is given (it is then movable by KV: proxy.strategies.kv_move).
    default_bootstrap = payload.get("bootstrap_port", DEFAULT_BOOTSTRAP_PORT if role == "prefill" else None)
    default_bootstrap_host = payload.get("bootstrap_host")
    kv_role = payload.get("kv_role")
    if kv_role not in (None, "kv_both", "kv_producer" if role == "prefill" else "kv_consumer"):
        raise RouterError(
            400, f"'kv_role' of a {role} instance must be 'kv_both' or its own, got {kv_role!r}", INVALID_REQUEST,
            "kv_role",
        )  # fmt: skip
    both = {"both": True} if kv_role == "kv_both" else {}
    default_dp_rank = payload.get("dp_rank")
    items = payload.get("instances")
    if items is None:
        items = [{"host": payload.get("host"), "port": payload.get("port"), "bootstrap_port": default_bootstrap}]
    elif isinstance(items, str):
        items = [items]
    if not isinstance(items, list) or not items:
        raise RouterError(400, "'instances' must be a non-empty list", INVALID_REQUEST, "instances")
    backends = []
    for item in items:
        if isinstance(item, str):
            host, port = _parse_address(item)
            bootstrap = default_bootstrap
            bootstrap_host, dp_rank = default_bootstrap_host, default_dp_rank
        elif isinstance(item, dict):
            host, port = item.get("host"), item.get("port")
            bootstrap = item.get("bootstrap_port", default_bootstrap)
            bootstrap_host = item.get("bootstrap_host", default_bootstrap_host)
            dp_rank = item.get("dp_rank", default_dp_rank)
        else:
            raise RouterError(400, f"instance {item!r} is not host:port or an object", INVALID_REQUEST, "instances")
        if not isinstance(host, str) or not host.strip():
            raise RouterError(400, f"'host' must be a non-empty string, got {host!r}", INVALID_REQUEST, "host")
        port = _check_port(port, "port")
        if role == "prefill":
            bootstrap = _check_port(bootstrap, "bootstrap_port")
            if bootstrap_host is not None and (not isinstance(bootstrap_host, str) or not bootstrap_host.strip()):
                raise RouterError(
                    400, f"'bootstrap_host' must be a non-empty string, got {bootstrap_host!r}", INVALID_REQUEST,
                    "bootstrap_host",
                )  # fmt: skip
            if dp_rank is not None and (isinstance(dp_rank, bool) or not isinstance(dp_rank, int) or dp_rank < 0):
                raise RouterError(
                    400, f"'dp_rank' must be an integer >= 0, got {dp_rank!r}", INVALID_REQUEST, "dp_rank"
                )  # fmt: skip
            backends.append(
                Backend(
                    "prefill",
                    host.strip(),
                    port,
                    bootstrap,
                    bootstrap_host.strip() if bootstrap_host else None,
                    dp_rank,
                    **both,
                )
            )
        else:
            movable = None if bootstrap is None else _check_port(bootstrap, "bootstrap_port")
            if both and movable is not None:
                raise RouterError(
                    400, "'bootstrap_port' of a kv_both decoder: kv_role kv_both runs no migration", INVALID_REQUEST,
                    "bootstrap_port",
                )  # fmt: skip
            backends.append(Backend("decode", host.strip(), port, movable, **both))
    return backends


def routes(router: Router) -> list[tuple[str, str, Handler]]:
    """The admin endpoints: ``(method, path, handler)``."""
    membership = router.membership
    config = router.config
    roles = RoleChanges(router)

    async def list_instances(_request: web.Request) -> web.StreamResponse:
        return json_response(membership.listing())

    async def add_instances(request: web.Request) -> web.StreamResponse:
        backends = parse_instances(await read_json(request, config.max_body_size))
        results = list(await asyncio.gather(*(membership.add(b) for b in backends)))
        status = 202 if any(r == "waiting" for r in results) else 200
        return json_response(membership.report("add", backends, results), status)

    async def remove_instances(request: web.Request) -> web.StreamResponse:
        backends = parse_instances(await read_json(request, config.max_body_size))
        unknown = [b for b in backends if not membership.known(b)]
        if unknown:
            names = ", ".join(b.name for b in unknown)
            raise RouterError(404, f"unknown instance(s): {names}", NOT_FOUND, "instances")
        results = [membership.remove(b.role, b.host, b.port) for b in backends]
        return json_response(membership.report("remove", backends, results))

    async def drain_instances(request: web.Request) -> web.StreamResponse:
        payload = await read_json(request, config.max_body_size)
        backends = parse_instances(payload)
        timeout = payload.get("timeout_s", DEFAULT_DRAIN_TIMEOUT_S)
        if isinstance(timeout, bool) or not isinstance(timeout, int | float) or timeout <= 0:
            raise RouterError(400, f"'timeout_s' must be a number > 0, got {timeout!r}", INVALID_REQUEST, "timeout_s")
        unknown = [b for b in backends if router.pool.find(b.role, b.host, b.port) is None]
        if unknown:
            names = ", ".join(b.name for b in unknown)
            raise RouterError(404, f"unknown instance(s): {names}", NOT_FOUND, "instances")
        reports = await asyncio.gather(
            *(router.drains.drain(router.pool.find(b.role, b.host, b.port), b.role, b.host, b.port, timeout)
              for b in backends)
        )  # fmt: skip
        results = [r.record() for r in reports]
        drained = all(r["result"] == "drained" for r in results)
        message = "; ".join(
            f"{b.name}: {r['result']} in {r['seconds']} s" for b, r in zip(backends, results, strict=True)
        )
        logger.info("instances/drain: %s", message)
        return json_response({"message": message, "results": results, **membership.listing()}, 200 if drained else 504)

    async def change_role(request: web.Request) -> web.StreamResponse:
        host, port, serves, timeout, bootstrap_port = parse_role_change(await read_json(request, config.max_body_size))
        status, body = await roles.change(host, port, serves, timeout, bootstrap_port)
        return json_response(body, status)

    async def reset_prefix_cache(request: web.Request) -> web.StreamResponse:
        query = request.rel_url.raw_query_string
        path = "/reset_prefix_cache" + (f"?{query}" if query else "")
        backend_auth = {"Authorization": config.backend_authorization} if config.backend_authorization else None

        async def one(state: BackendState) -> str | None:
            reply = await fetch(router.http, state, "POST", path, config.request_timeout, None, backend_auth)
            if isinstance(reply, Failure):
                return f"{state.backend.url(router.pool.tls)}: {reply.detail}"
            return None if reply.status < 300 else f"{state.backend.url(router.pool.tls)}: HTTP {reply.status}"

        states = [*router.pool.active["prefill"], *router.pool.active["decode"]]
        failed = [f for f in await asyncio.gather(*(one(s) for s in states)) if f is not None]
        if failed:
            return json_response({"failed": failed}, 500)
        return web.Response(status=200)

    return [
        ("GET", "/instances", list_instances),
        ("POST", "/instances/add", add_instances),
        ("POST", "/instances/remove", remove_instances),
        ("POST", "/instances/drain", drain_instances),
        ("POST", "/instances/role", change_role),
        ("POST", "/reset_prefix_cache", reset_prefix_cache),
    ]
