"""Bootstrap server: topology, rank table and room -> dp-rank routes.

One per prefill deployment, run by P's leader rank (dp 0, tp 0) in a daemon
thread. Prefill ranks register here; decode ranks read `/bootstrap/route` once
per prefill deployment. It holds no transfer state.

An entry is never silently taken over: a registration that moves a registered rank to
another ip/port is accepted, and logged as a re-registration, when the deployment has a token (the
caller carried it) or, without one, when the old endpoint no longer accepts TCP connections (the
rank restarted or died; a stopped-but-alive process still accepts, so it counts as live). Otherwise
it is a 409 and the table keeps the live rank. ``register_dp_rank`` likewise: changing a room's DP
rank needs the token. With certificate and key files the server speaks TLS only. The room calls (release a
room on every P rank, a room's status) are ``bootstrap.rooms_api``'s; the state is ``bootstrap.state``'s.

With a token every call but ``/bootstrap/health`` and ``/query`` (bootstrap.mooncake_query) must be
signed with the bootstrap key derived from it (``bootstrap.signing``: this server's id, method, path, body
hash, time within a window, a nonce used once); the token itself never travels. A wrong, stale, replayed
signature, or one signed for another server (another deployment sharing the token, or this one before a
restart), is a 401 naming the problem. The server id is drawn at start and told by ``/bootstrap/health``.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import msgspec
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from pd_connector.auth import AUTH_HEADER
from pd_connector.bootstrap.mooncake_query import QUERY_PATH, query_answer
from pd_connector.bootstrap.rooms_api import RoomControl, add_room_routes
from pd_connector.bootstrap.signing import VERSION, CallVerifier, new_server_id
from pd_connector.bootstrap.state import BootstrapState, Conflict, QueryDpRanks, RegisterDpRank
from pd_connector.keys import bootstrap_key
from pd_connector.log_limit import LogLimiter
from pd_connector.messages import RegisterRank

__all__ = ["BootstrapServer", "BootstrapState", "create_app"]

logger = logging.getLogger(__name__)

#: How long the server tries to connect to a registered rank's endpoint to tell whether it is alive.
LIVENESS_PROBE_S = 0.5


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": message}, status_code=status)


async def still_listening(ip: str, port: int, timeout_s: float = LIVENESS_PROBE_S) -> bool:
    """Whether ``ip:port`` accepts a TCP connection within ``timeout_s`` (a registered rank is alive)."""
    try:
        _, writer = await asyncio.wait_for(asyncio.open_connection(ip, port), timeout_s)
    except (TimeoutError, OSError):
        return False
    writer.close()
    try:
        await writer.wait_closed()
    except OSError:
        pass
    return True


def create_app(
    state: BootstrapState,
    token: bytes | None = None,
    server_id: str = "",
    clock: Callable[[], float] | None = None,
    rooms: RoomControl | None = None,
) -> FastAPI:
    """The bootstrap HTTP API (JSON bodies; bad JSON -> 400 with a message).

    With ``token`` (pd_connector.auth), every call but ``/bootstrap/health`` must be signed with its
    bootstrap key for ``server_id`` (``bootstrap.signing``; empty: a new id), which ``/bootstrap/health``
    tells; one that is not, or is stale, replayed or signed for another server, gets 401 and a log line
    naming the caller and the problem (``refused`` counts them). ``clock``: the verifier's wall and
    monotonic clock (tests replay calls later without waiting); None: the real ones. ``rooms``: the
    prefill ranks' rooms the room calls act on (``bootstrap.rooms_api``; None: they answer 503).
    """
    app = FastAPI(title="PDConnector bootstrap")
    #: Refusals (401, 400, 409): a few lines per kind, caller host and route per window (log_limit).
    refusals = LogLimiter(logger)
    key = bootstrap_key(token)
    server_id = server_id or new_server_id()
    verifier = (
        None
        if key is None
        else CallVerifier(key, server_id, clock=clock or time.time, monotonic=clock or time.monotonic)
    )

    @app.middleware("http")
    async def _check_signature(request: Request, call_next: Any) -> Response:
        if verifier is not None and request.url.path not in ("/bootstrap/health", QUERY_PATH):
            target = request.url.path + (f"?{request.url.query}" if request.url.query else "")
            body = await request.body()  # Starlette hands the read body on to the route
            refusal = verifier.check(request.method, target, body, request.headers.get(AUTH_HEADER))
            if refusal is not None:
                state.refused += 1
                refusals.warning(
                    ("token", _peer_host(request), _route_of(app, request)),
                    "bootstrap: refusing %s from %s: %s",
                    _route_of(app, request),
                    _peer(request),
                    refusal.message,
                )
                return JSONResponse(
                    {"error": f"PDConnector call signature refused: {refusal.message}", "reason": refusal.reason},
                    status_code=refusal.status,
                )
        return await call_next(request)

    @app.exception_handler(_BadRequest)
    async def _on_bad_request(request: Request, exc: _BadRequest) -> JSONResponse:
        refusals.warning(
            ("bad request", _peer_host(request), _route_of(app, request)),
            "bootstrap: %s %s from %s: HTTP 400 %s", request.method, request.url.path, _peer(request), exc,
        )  # fmt: skip
        return _error(400, str(exc))

    async def body_as(request: Request, typ: type) -> object:
        raw = await request.body()
        try:
            return msgspec.json.decode(raw, type=typ)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise _BadRequest(f"invalid {typ.__name__} body: {exc}") from None
        except RecursionError:
            raise _BadRequest(f"invalid {typ.__name__} body: JSON nested too deeply") from None

    @app.exception_handler(Exception)
    async def _on_error(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("bootstrap: %s %s failed", request.method, _route_of(app, request))
        return _error(500, "internal error (the bootstrap server's log has the details)")

    @app.put("/bootstrap/register_rank")
    async def register_rank(request: Request) -> JSONResponse:
        req = await body_as(request, RegisterRank)
        assert isinstance(req, RegisterRank)
        name = f"dp={req.attn_dp_rank} cp={req.attn_cp_rank} tp={req.attn_tp_rank}" + (
            f" pp={req.pp_rank}" if state.pp_size > 1 else ""
        )
        old = state.rank_table.get((req.attn_dp_rank, req.attn_cp_rank, req.attn_tp_rank, req.pp_rank))
        new = f"{req.rank_ip}:{req.rank_port}"
        moved = old is not None and (old.rank_ip, old.rank_port) != (req.rank_ip, req.rank_port)
        if moved and token is None and await still_listening(old.rank_ip, old.rank_port):
            state.conflicts += 1
            refusals.warning(
                ("live rank", _peer_host(request)),
                "bootstrap: refusing to move live rank %s from %s:%d to %s (caller %s): no auth token configured",
                name, old.rank_ip, old.rank_port, new, _peer(request),
            )  # fmt: skip
            return _error(
                409,
                f"rank {name} is registered at {old.rank_ip}:{old.rank_port}, which still accepts connections; "
                "a live rank is only replaced with the deployment's auth token (kv_connector_extra_config."
                "auth_token_file / auth_token_env)",
            )
        try:
            state.register_rank(req)
        except ValueError as exc:
            return _error(400, str(exc))
        if moved:
            assert old is not None
            logger.warning(
                "bootstrap: rank %s re-registered: %s:%d -> %s (%s)",
                name, old.rank_ip, old.rank_port, new, "token checked" if token else "old endpoint gone",
            )  # fmt: skip
        logger.info(
            "bootstrap: registered rank %s%s at %s:%d (%d/%d)",
            name,
            f" layers [{req.first_layer}, {req.end_layer})" if state.pp_size > 1 else "",
            req.rank_ip,
            req.rank_port,
            len(state.rank_table),
            state.expected_count,
        )
        return JSONResponse({"status": "ok", "is_ready": state.is_ready})

    @app.get("/bootstrap/route")
    async def route() -> Response:
        return Response(msgspec.json.encode(state.route()), media_type="application/json")

    @app.post("/bootstrap/register_dp_rank")
    async def register_dp_rank(request: Request) -> JSONResponse:
        req = await body_as(request, RegisterDpRank)
        assert isinstance(req, RegisterDpRank)
        try:
            old = state.register_dp_rank(req.bootstrap_room, req.dp_rank, replace=token is not None)
        except Conflict as exc:
            refusals.warning(
                ("dp rank", _peer_host(request)),
                "bootstrap: room=%d: refusing register_dp_rank from %s: %s", req.bootstrap_room, _peer(request), exc,
            )  # fmt: skip
            return _error(409, str(exc))
        except ValueError as exc:
            return _error(400, str(exc))
        if old is not None:
            logger.warning("bootstrap: room=%d re-registered: dp rank %d -> %d", req.bootstrap_room, old, req.dp_rank)
        return JSONResponse({"status": "ok"})

    @app.post("/bootstrap/query_dp_ranks")
    async def query_dp_ranks(request: Request) -> JSONResponse:
        req = await body_as(request, QueryDpRanks)
        assert isinstance(req, QueryDpRanks)
        return JSONResponse({"dp_ranks": state.query_dp_ranks(req.bootstrap_rooms)})

    @app.get(QUERY_PATH)
    async def mooncake_query() -> JSONResponse:
        """vLLM's MooncakeConnector ``/query`` (vllm-router --kv-connector mooncake); 503 until ready."""
        if not state.is_ready:
            return _error(503, "prefill ranks are still registering")
        return JSONResponse(query_answer(state.attn_dp_size))

    add_room_routes(app, rooms, body_as, _error)

    @app.get("/bootstrap/health")
    async def health() -> JSONResponse:
        return JSONResponse(
            {
                "status": "ok",
                "server_id": server_id,  # the audience signed calls name (bootstrap.signing), public
                "signature_version": VERSION,
                "is_ready": state.is_ready,
                "registered": len(state.rank_table),
                "expected": state.expected_count,
                "refused": state.refused,
                "conflicts": state.conflicts,
            }
        )

    return app


class _BadRequest(Exception):
    pass


def _peer(request: Request) -> str:
    return f"{request.client.host}:{request.client.port}" if request.client else "unknown"


def _peer_host(request: Request) -> str:
    """The caller's host, without its (per-connection) port: part of its refusal lines' key."""
    return request.client.host if request.client else "unknown"


def _route_of(app: FastAPI, request: Request) -> str:
    """``METHOD path`` of one of the app's routes, else ``other``: part of a refusal line's key
    (never the caller's own path, which would make the keys unbounded)."""
    path = request.url.path
    known = any(getattr(route, "path", None) == path for route in app.router.routes)
    return f"{request.method} {path}" if known and request.method in ("GET", "PUT", "POST") else "other"


class BootstrapServer:
    """Runs the bootstrap app with uvicorn in a daemon thread (TLS with ``ssl_certfile``/``ssl_keyfile``).

    ``clock``: the call verifier's clock (``create_app``), for tests. ``rooms``: what the room calls act on
    (``bootstrap.rooms_api.RankRooms``, set by the leader rank once its transfer manager runs)."""

    def __init__(
        self,
        state: BootstrapState,
        host: str,
        port: int,
        token: bytes | None = None,
        ssl_certfile: str = "",
        ssl_keyfile: str = "",
        clock: Callable[[], float] | None = None,
        rooms: RoomControl | None = None,
    ) -> None:
        self.state = state
        self.host, self.port = host, port
        self.scheme = "https" if ssl_certfile else "http"
        #: This run's id: signed calls name it as their audience (bootstrap.signing), /bootstrap/health tells it.
        self.server_id = new_server_id()
        app = create_app(state, token, self.server_id, clock, rooms)
        config = uvicorn.Config(
            app,
            host=host,
            port=port,
            log_level="warning",
            access_log=False,
            ssl_certfile=ssl_certfile or None,
            ssl_keyfile=ssl_keyfile or None,
        )
        self._server = uvicorn.Server(config)
        self._thread: threading.Thread | None = None

    def start(self, timeout: float = 10.0) -> None:
        # Fail fast with a clear message if the port is taken (uvicorn would only log it).
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind((self.host, self.port))
            except OSError as exc:
                raise RuntimeError(
                    f"bootstrap server cannot bind {self.host}:{self.port}: {exc}; "
                    "set kv_connector_extra_config.bootstrap_port to a free port"
                ) from exc
        self._thread = threading.Thread(target=self._server.run, name="pd-bootstrap", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"bootstrap server did not start on {self.host}:{self.port}")
            time.sleep(0.02)
        logger.info(
            "bootstrap server listening on %s://%s:%d (server id %s)", self.scheme, self.host, self.port, self.server_id
        )

    def stop(self) -> None:
        self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=5)
