"""ASGI middleware for `vllm serve`: reject malformed kv_transfer_params with HTTP 400.

vLLM passes kv_transfer_params through untouched, so a bad value would only
surface deep in the engine. Load this with
`vllm serve ... --middleware pd_connector.api_server.validation.KVParamsValidationMiddleware`
and such requests get an OpenAI-style 400 naming the bad field, while the
server keeps serving. (Without it the connector logs the error and serves the
request without PD transfer.)

On a decode instance it also checks, before the engine sees the request, that the
prefill deployment named in the request can feed this instance: it reads the
deployment's route from its bootstrap server (cached for a while) and compares block
size and KV dtype with this server's own configuration. A mismatch answers HTTP 409
with a message naming both values, instead of a generic failed request (the
connector's handshake check stays as the backstop).

It reads routes as the connector does (this instance's token, CA bundle and
``trusted_bootstrap_hosts``, from its kv_connector_extra_config), and answers at once, naming the
address, when a request's bootstrap address cannot be used: HTTP 403 for a host D does not trust
(nothing is contacted), 502 for a server that cannot be reached or refuses D (wrong token, bad
route), instead of a load that fails after ``kv_wait_timeout_s``. A server that is there but busy
or not ready yet is left to the connector, which retries.

On D it also adds ``usage.pd_kv`` to every completion and chat answer (streamed ones in their usage
event): where the prompt's KV came from (pd_connector.api_server.usage, pd_connector.accounting).

On P and D alike it first rewrites other routers' PD requests into PDConnector's kv_transfer_params
(pd_connector.api_server.front_ends: sglang-router's top-level ``bootstrap_*`` fields, vllm-router's Mooncake
``transfer_id``), so those front ends move the KV instead of silently recomputing it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from pd_connector.api_server.front_ends import Side, TranslationError, translate
from pd_connector.api_server.load_errors import LoadErrorNamer, named_load_errors
from pd_connector.api_server.usage import AccountedSend, collecting, hook_engine, reset
from pd_connector.ascend.metaserver import UNTRUSTED_STATUS as METASERVER_STATUS
from pd_connector.ascend.metaserver import UNTRUSTED_TYPE as METASERVER_TYPE
from pd_connector.ascend.metaserver import metaserver_of, refusal, trusted_of_app
from pd_connector.bootstrap.client import ROUTE_TTL_S as CONNECTOR_ROUTE_TTL_S
from pd_connector.bootstrap.client import BootstrapBusy, BootstrapError, BootstrapUntrusted, RouteCache
from pd_connector.compat import kv_dtype_name, model_fingerprint, route_mismatch
from pd_connector.config import ConfigError, parse_config
from pd_connector.kv_params import KV_PARAMS_KEY, DecodeParams, KVParamsError, host_port, parse_kv_params
from pd_connector.messages import Route

logger = logging.getLogger(__name__)

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

CHECKED_PATHS = ("/v1/completions", "/v1/chat/completions")
#: HTTP status and error type of a request whose prefill deployment cannot feed this instance.
INCOMPATIBLE_STATUS = 409
INCOMPATIBLE_TYPE = "kv_transfer_incompatible"
#: A request naming a bootstrap host this instance does not trust, and one whose server cannot be used.
UNTRUSTED_STATUS, UNTRUSTED_TYPE = 403, "kv_transfer_untrusted_bootstrap"
UNREACHABLE_STATUS, UNREACHABLE_TYPE = 502, "kv_transfer_bootstrap_unreachable"
#: How long a route read from a bootstrap server is trusted (as long as the connector's own cache trusts
#: one, so the check and the load go stale together after P restarts), and how long a failed read is not
#: retried.
ROUTE_TTL_S = CONNECTOR_ROUTE_TTL_S
ROUTE_FAILURE_TTL_S = 1.0
ROUTE_TIMEOUT_S = 5.0


def error_body(message: str, status: int = 400, error_type: str = "invalid_request_error") -> bytes:
    return json.dumps(
        {"error": {"message": message, "type": error_type, "param": "kv_transfer_params", "code": status}}
    ).encode()


def parse_body(raw: bytes) -> tuple[DecodeParams | None, str | None]:
    """(D params if the body asks for a remote prefill, error message if its kv_transfer_params are malformed)."""
    try:
        body = json.loads(raw)
    except ValueError:
        return None, None  # not ours to judge: vLLM answers invalid JSON itself
    except RecursionError:
        return None, "request body nests JSON too deeply"  # vLLM's own parser would fail with a 500
    if not isinstance(body, dict) or KV_PARAMS_KEY not in body:
        return None, None
    if metaserver_of(body[KV_PARAMS_KEY]) is not None:
        return None, None  # D first (vLLM-Ascend's layer-wise proxy): its metaserver is checked by the caller
    try:
        params = parse_kv_params(body[KV_PARAMS_KEY], room_optional=True)  # P picks a missing room
    except KVParamsError as exc:
        return None, str(exc)
    return (params if isinstance(params, DecodeParams) else None), None


class Problem(Exception):
    """Why a request's prefill deployment cannot feed this instance: the HTTP status, type and message."""

    def __init__(self, status: int, error_type: str, message: str) -> None:
        super().__init__(message)
        self.status, self.error_type, self.message = status, error_type, message


class CompatibilityCheck:
    """D's API server: can the prefill deployment a request names feed this instance?"""

    def __init__(self) -> None:
        self._local: tuple[int, str, str] | None = None
        self._local_known = False
        self._routes = RouteCache(ROUTE_TIMEOUT_S, ttl_s=ROUTE_TTL_S)
        #: Bootstrap addresses whose route could not be read: until when, and the error (None: busy).
        self._unreadable: dict[str, tuple[float, Problem | None]] = {}
        self._locks: dict[str, asyncio.Lock] = {}

    def _local_config(self, scope: Scope) -> tuple[int, str, str] | None:
        """(block size, KV dtype, model) of this server, or None when it is not a PDConnector decode instance."""
        if self._local_known:
            return self._local
        app = scope.get("app")
        vllm_config = getattr(getattr(app, "state", None), "vllm_config", None)
        if vllm_config is None:
            return None  # the app state is set up at startup; ask again on the next request
        kv = vllm_config.kv_transfer_config
        block_size = vllm_config.cache_config.block_size
        if (
            kv is not None
            and kv.kv_connector == "PDConnector"
            and kv.kv_role in ("kv_consumer", "kv_both")
            and block_size
        ):
            self._local = (int(block_size), kv_dtype_name(vllm_config), model_fingerprint(vllm_config))
            try:  # read routes as this instance's connector does
                cfg = parse_config(kv.kv_role, getattr(kv, "kv_connector_extra_config", None))
                self._routes = RouteCache.for_config(cfg, timeout_s=ROUTE_TIMEOUT_S, ttl_s=ROUTE_TTL_S)
            except ConfigError as exc:  # the connector refuses to start with it anyway
                logger.error("compatibility check: bad kv_connector_extra_config: %s", exc)
        self._local_known = True
        return self._local

    async def problem(self, scope: Scope, params: DecodeParams) -> Problem | None:
        """Why the request's prefill deployment cannot feed this instance; None if it can or nobody can tell."""
        local = self._local_config(scope)
        if local is None:
            return None
        addr = host_port(params.bootstrap_host, params.bootstrap_port)
        try:
            self._routes.check_trusted(addr)
            route = await self._route(addr)
        except BootstrapUntrusted as exc:
            return Problem(UNTRUSTED_STATUS, UNTRUSTED_TYPE, str(exc))
        except Problem as exc:
            return exc
        if route is None:
            return None
        rank = params.prefill_dp_rank
        if rank is not None and not 0 <= rank < route.dp_size:
            return Problem(
                400,
                "invalid_request_error",
                f"kv_transfer_params.prefill_dp_rank {rank}: the prefill deployment at {addr} has DP ranks "
                f"0..{route.dp_size - 1}",
            )
        mismatch = route_mismatch(route, addr, local[0], local[1], None, local[2])
        return Problem(INCOMPATIBLE_STATUS, INCOMPATIBLE_TYPE, mismatch) if mismatch is not None else None

    async def _route(self, addr: str) -> Route | None:
        """The deployment's complete route (cached by RouteCache); None while it is busy or not ready.

        Raises Problem (502, for ROUTE_FAILURE_TTL_S) when the server cannot be reached or refuses.
        """
        lock = self._locks.setdefault(addr, asyncio.Lock())
        async with lock:
            until, failed = self._unreadable.get(addr, (0.0, None))
            if until > time.monotonic():
                if failed is not None:
                    raise failed
                return None
            try:
                return await asyncio.to_thread(self._routes.get, addr)
            except BootstrapBusy as exc:
                logger.info("compatibility check skipped: bootstrap %s is busy: %s", addr, exc)
                self._unreadable[addr] = (time.monotonic() + ROUTE_FAILURE_TTL_S, None)
                return None
            except BootstrapError as exc:
                problem = Problem(UNREACHABLE_STATUS, UNREACHABLE_TYPE, f"cannot use bootstrap address {addr}: {exc}")
                self._unreadable[addr] = (time.monotonic() + ROUTE_FAILURE_TTL_S, problem)
                raise problem from None


class KVParamsValidationMiddleware:
    def __init__(self, app: Callable[[Scope, Receive, Send], Awaitable[None]]) -> None:
        self.app = app
        self.compat = CompatibilityCheck()
        self.load_errors = LoadErrorNamer(lambda: self.compat._routes)  # its token, CA bundle, trusted hosts
        self._side: Side | None = None
        self._side_known = False
        self._decoder: bool | None = None

    def _side_of(self, scope: Scope) -> Side | None:
        """PREFILL / DECODE on a PDConnector instance (from vLLM's app state), else None."""
        if not self._side_known:
            vllm_config = getattr(getattr(scope.get("app"), "state", None), "vllm_config", None)
            if vllm_config is None:
                return None  # set up at startup; ask again on the next request
            kv = vllm_config.kv_transfer_config
            if kv is not None and kv.kv_connector == "PDConnector":
                self._side = {"kv_producer": Side.PREFILL, "kv_consumer": Side.DECODE}.get(kv.kv_role)
            self._side_known = True
        return self._side

    def _decodes(self, scope: Scope) -> bool:
        """Whether this is a PDConnector instance that decodes (kv_consumer, or kv_both), whose answers
        carry the KV account in ``usage`` (pd_connector.api_server.usage)."""
        if self._decoder is None:
            vllm_config = getattr(getattr(scope.get("app"), "state", None), "vllm_config", None)
            if vllm_config is None:
                return False  # set up at startup; ask again on the next request
            kv = vllm_config.kv_transfer_config
            self._decoder = kv is not None and kv.kv_connector == "PDConnector" and kv.kv_role != "kv_producer"
        return self._decoder

    def _translate(self, scope: Scope, raw: bytes) -> tuple[bytes, str | None]:
        """Other routers' PD fields (sglang-router, vllm-router mooncake) as kv_transfer_params (front_ends)."""
        if b"bootstrap_room" not in raw and b"transfer_id" not in raw:
            return raw, None
        side = self._side_of(scope)
        if side is None:
            return raw, None
        try:
            body = json.loads(raw)
        except (ValueError, RecursionError):
            return raw, None  # judged below
        if not isinstance(body, dict):
            return raw, None
        try:
            front_end = translate(body, side)
        except TranslationError as exc:
            return raw, str(exc)
        if front_end is None:
            return raw, None
        logger.debug("%s: %s request mapped to kv_transfer_params %s", side.value, front_end.value, body[KV_PARAMS_KEY])
        new = json.dumps(body).encode()
        length = str(len(new)).encode()
        scope["headers"] = [(k, length if k == b"content-length" else v) for k, v in scope.get("headers", [])]
        return new, None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope.get("type") != "http" or scope.get("method") != "POST" or scope.get("path") not in CHECKED_PATHS:
            await self.app(scope, receive, send)
            return
        chunks: list[bytes] = []
        more = True
        while more:
            message = await receive()
            if message["type"] != "http.request":
                await self.app(scope, _replay([message]), send)
                return
            chunks.append(message.get("body", b""))
            more = message.get("more_body", False)
        raw, problem = self._translate(scope, b"".join(chunks))
        if problem is not None:
            logger.warning("rejected %s: %s", scope.get("path"), problem)
            await _send_error(send, error_body(problem), 400)
            return
        if b'"metaserver"' in raw and (trusted := trusted_of_app(scope)) is not None:
            problem = refusal(
                raw, trusted
            )  # D first: post only to trusted metaservers (pd_connector.ascend.metaserver)
            if problem is not None:
                logger.warning("rejected %s: %s", scope.get("path"), problem)
                await _send_error(send, error_body(problem, METASERVER_STATUS, METASERVER_TYPE), METASERVER_STATUS)
                return
        params, problem = parse_body(raw)
        if problem is not None:
            logger.warning("rejected %s: %s", scope.get("path"), problem)
            await _send_error(send, error_body(problem), 400)
            return
        if params is not None:
            conflict = await self.compat.problem(scope, params)
            if conflict is not None:
                logger.error(
                    "room=%d rejected %s: HTTP %d %s", params.room, scope.get("path"), conflict.status, conflict
                )
                await _send_error(
                    send, error_body(conflict.message, conflict.status, conflict.error_type), conflict.status
                )
                return
            send = named_load_errors(send, params, self.load_errors)  # a failed KV load names its room
        replay = _replay([{"type": "http.request", "body": raw, "more_body": False}], receive)
        if not self._decodes(scope) or not hook_engine(getattr(scope.get("app"), "state", None)):
            await self.app(scope, replay, send)
            return
        records, token = collecting()  # the engine's final outputs add their KV accounts (usage.pd_kv)
        try:
            await self.app(scope, replay, AccountedSend(send, records))
        finally:
            reset(token)


async def _send_error(send: Send, body: bytes, status: int) -> None:
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
        }
    )
    await send({"type": "http.response.body", "body": body})


def _replay(messages: list[Message], then: Receive | None = None) -> Receive:
    pending = list(messages)

    async def receive() -> Message:
        if pending:
            return pending.pop(0)
        if then is not None:
            return await then()
        return {"type": "http.disconnect"}

    return receive
