"""The Router's aiohttp application: ``create_app(config)`` and its routes.

``python -m proxy`` serves it through :mod:`proxy.server.hot_server`: ``POST`` on the two generation
endpoints runs the same handlers (:data:`HOT_ROUTES_KEY`) on a raw asyncio + httptools server,
every other request is aiohttp's.

Request lifecycle (docs/design.md, sections 2 and 4): a completion or chat request gets a bootstrap room, one
prefill instance P and one decode instance D; both requests are sent at once; D's answer
(JSON, or the SSE stream byte for byte) goes back to the client.

- Failover: until the first byte of the answer goes to the client (a stream's headers are held
  back until D's first chunk), a failed attempt (a backend unreachable, a connection broken, a
  5xx/408/429, an empty answer, an error event as D's first chunk) closes both backend requests
  and is retried on another P/D pair with a fresh room, up to ``--max-retries`` attempts in
  all. After that byte, nothing is retried: a stream that breaks ends with an SSE error event.
- Abort: the application runs with aiohttp's handler cancellation, so a client that goes away
  cancels its handler; the handler then closes both backend connections, and vLLM aborts a
  request whose connection closes, freeing its KV blocks.
- Never an empty 200 and never a hang: every failure becomes an OpenAI-style error (or the
  backend's own error answer), and every request has a deadline (``--request-timeout``).

Where things are: :mod:`proxy.request.exchange` (one client request, its retries and its answer),
:mod:`proxy.request.attempt` (one try on one P/D pair), :mod:`proxy.admin.instances` (``/instances``,
``/instances/add|remove``, ``/reset_prefix_cache``), :mod:`proxy.router_state` (the application
state), :mod:`proxy.upstream.routing` (routing policies), :mod:`proxy.upstream.http1` (the one HTTP client for
every backend call), :mod:`proxy.upstream.calls` (failure classification, health checks). Routes
here: the two generation endpoints, ``/v1/models``, ``/health``, ``/healthcheck``,
``/metrics`` (:mod:`proxy.router_metrics`) and the admin ones.
"""

from __future__ import annotations

import json
import logging

from aiohttp import web

from proxy.access.api_keys import Gate
from proxy.admin import instances as admin
from proxy.admin.instances import ADMIN_PATHS, Handler, parse_instances
from proxy.errors import (
    INTERNAL_ERROR,
    INVALID_REQUEST,
    NOT_FOUND,
    UPSTREAM_UNAVAILABLE,
    RouterError,
    error_response,
    json_response,
)
from proxy.request.exchange import generate
from proxy.request.failure_policy import count_failure
from proxy.request.incoming import backend_headers, request_id
from proxy.request.payloads import CHAT_COMPLETIONS, COMPLETIONS
from proxy.router_config import RouterConfig
from proxy.router_metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from proxy.router_state import Router
from proxy.server.reply import aiohttp_replies
from proxy.server.workers import MEMBERSHIP_PATHS, current_worker, refuse_membership_changes
from proxy.upstream.calls import Failure, fetch, http_failure, passthrough_response
from proxy.upstream.pool import health_summary, pool_health

__all__ = ["HOT_ROUTES_KEY", "ROUTER_KEY", "SHUTDOWN_TIMEOUT_S", "Router", "create_app", "parse_instances"]

logger = logging.getLogger("proxy")

#: How long a graceful shutdown waits for requests in flight.
SHUTDOWN_TIMEOUT_S = 5.0
ROUTER_KEY: web.AppKey[Router] = web.AppKey("router")
#: The generation endpoints' handlers (auth and error answers included) by path, for the raw
#: server (proxy.server.hot_server) that serves ``POST`` on them without aiohttp's request machinery.
HOT_ROUTES_KEY: web.AppKey[dict[str, Handler]] = web.AppKey("hot_routes")
#: The routes proxy.server.hot_server serves itself (``POST`` only).
HOT_PATHS = (COMPLETIONS, CHAT_COMPLETIONS)


def _guarded(handler: Handler) -> Handler:
    """``handler`` with a RouterError as its error answer and any other exception as a 500."""

    async def run(request: web.Request) -> web.StreamResponse:
        try:
            return await handler(request)
        except RouterError as error:
            return error.to_response({"X-Request-Id": request_id(request)})
        except Exception as exc:
            logger.exception("unexpected error serving %s %s", request.method, request.path)
            return error_response(500, f"internal Router error: {type(exc).__name__}", INTERNAL_ERROR)

    return run


def _routes(router: Router, gate: Gate) -> list[tuple[str, str, Handler]]:
    config = router.config

    async def completions(request: web.Request) -> web.StreamResponse:
        return await generate(router, request, COMPLETIONS)

    async def chat_completions(request: web.Request) -> web.StreamResponse:
        return await generate(router, request, CHAT_COMPLETIONS)

    async def models(request: web.Request) -> web.StreamResponse:
        rid = request_id(request)
        headers = backend_headers(request, rid, config.backend_authorization)
        out_headers = {"X-Request-Id": rid}
        last: Failure | None = None
        for state in sorted(router.pool.active["decode"], key=lambda s: not s.healthy):
            reply = await fetch(router.http, state, "GET", "/v1/models", config.request_timeout, None, headers)
            if isinstance(reply, Failure):
                last = reply
                count_failure(router, "/v1/models", last)  # counted, marked unhealthy if unreachable
                logger.warning("rid=%s GET /v1/models: %s", rid, last.error.message)
                continue
            if reply.status >= 500:
                last = http_failure(state, reply.status, reply.body, reply.content_type)
                count_failure(router, "/v1/models", last)
                continue
            content_type = reply.content_type or "application/json"
            return passthrough_response(reply.status, reply.body, content_type, out_headers)
        if last is None:
            return error_response(503, "no decode instance is available", UPSTREAM_UNAVAILABLE, out_headers)
        return last.response(out_headers)

    async def health(request: web.Request) -> web.StreamResponse:
        # What the health loop recorded (no probe per call); every backend's record only for the admin.
        await router.health_known()
        healthy, body = pool_health(router.pool)
        if not healthy:
            logger.warning("health: unhealthy: %s", json.dumps(body))
        if not gate.admits_admin(request):
            return json_response(health_summary(router.pool, body["status"]), 200 if healthy else 503)
        body["routing"] = config.routing
        if (worker := current_worker()) is not None:
            body["worker"] = worker.record()
        return json_response(body, 200 if healthy else 503)

    async def healthcheck(_request: web.Request) -> web.StreamResponse:
        # vLLM-Ascend proxy's summary.
        pool = router.pool
        in_flight = sum(s.in_flight for s in pool.active["decode"]) + sum(s.in_flight for s in pool.draining.values())
        return json_response(
            {
                "status": "ok",
                "prefill_instances": len(pool.active["prefill"]),
                "decode_instances": len(pool.active["decode"]),
                "request_num": in_flight,
            }
        )

    async def metrics(_request: web.Request) -> web.StreamResponse:
        return web.Response(body=router.metrics.render(), headers={"Content-Type": METRICS_CONTENT_TYPE})

    return [
        ("POST", COMPLETIONS, completions),
        ("POST", CHAT_COMPLETIONS, chat_completions),
        ("GET", "/v1/models", models),
        ("GET", "/health", health),
        ("GET", "/healthcheck", healthcheck),
        ("GET", "/metrics", metrics),
        *admin.routes(router),
    ]


def create_app(config: RouterConfig) -> web.Application:
    """Build the Router application for ``config`` (run it with handler cancellation on)."""
    router = Router(config)
    app = web.Application(client_max_size=config.max_body_size, middlewares=[aiohttp_replies])  # Reply -> aiohttp
    app[ROUTER_KEY] = router
    app.on_startup.append(router.startup)
    app.on_cleanup.append(router.cleanup)
    gate = Gate(config.access, router.metrics, ADMIN_PATHS)  # keys and admin token (proxy.access.api_keys)
    routes = _routes(router, gate)
    if config.workers > 1:  # a pool change would reach one worker only (proxy.server.workers)
        refuse = refuse_membership_changes(config.workers)
        routes = [(m, p, refuse if p in MEMBERSHIP_PATHS else h) for m, p, h in routes]
    known_paths = {path for _, path, _ in routes}

    async def fallback(request: web.Request) -> web.StreamResponse:
        if request.path in known_paths:
            return error_response(405, f"method {request.method} is not allowed on {request.path}", INVALID_REQUEST)
        return error_response(404, f"no route {request.method} {request.path}", NOT_FOUND)

    hot: dict[str, Handler] = {}
    for method, path, handler in routes:
        served = _guarded(gate.wrap(path, handler))
        if method == "GET":
            app.router.add_get(path, served)  # HEAD too
        else:
            app.router.add_route(method, path, served)
        if method == "POST" and path in HOT_PATHS:
            hot[path] = served
    app[HOT_ROUTES_KEY] = hot
    app.router.add_route("*", "/{tail:.*}", gate.wrap_fallback(fallback))
    return app
