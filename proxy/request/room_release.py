"""Releasing a room P holds (or will hold) for a decoder that will not come.

P keeps a finished prefill's KV for its room until a decoder loads it, or until its
``room_timeout_s``. Two ways free it at once, both detached from the client's request:

- :func:`release_on_p`, the direct one: ``POST /bootstrap/release_room`` on P's bootstrap server
  (``pd_connector.bootstrap.rooms_api``), which frees the room on every P rank that holds it, stops a
  push in flight, frees a prefill still running as soon as it ends, and refuses a decoder that asks for
  the room afterwards at once. Safe at any point of the request, so it is what a client that leaves
  gets (:meth:`proxy.request.loop.AttemptLoop.client_left`): every room of the request sent to a
  prefiller is released. With a token-protected deployment the Router signs the call with the token
  in the file named by ``PD_ROUTER_BOOTSTRAP_TOKEN_FILE`` (and verifies an HTTPS bootstrap server with
  the CA bundle named by ``PD_ROUTER_BOOTSTRAP_CA``).
- :func:`release_room`, the fallback when the direct call fails (an older P release, a refused or
  unreachable bootstrap server): a one-token, non-streamed request to another decoder loads the KV,
  which frees it on P; nothing of its answer is used. Only where the decoder certainly never asked P
  for the room (as :mod:`proxy.request.failure_policy` decides: D could not be connected to), or no
  decoder was asked at all: a decoder that got the request may have loaded the KV already, and a
  second load of a room P no longer holds would fail on that other decoder for nothing.

The request's :class:`proxy.request.loop.AttemptLoop` is the one caller; its module says when.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
from collections.abc import Callable, Collection
from typing import TYPE_CHECKING

from pd_connector.auth import load_token
from pd_connector.bootstrap import client as bootstrap
from pd_connector.kv_params import host_port
from proxy.request.payloads import decode_body
from proxy.upstream.calls import Failure, fetch
from proxy.upstream.http1 import encode_json
from proxy.upstream.pool import BackendState
from proxy.upstream.routing import RouteRequest

if TYPE_CHECKING:
    from proxy.request.attempt import Call
    from proxy.router_state import Router

logger = logging.getLogger("proxy")

#: Environment variables: the file holding the P/D deployment's token (signs release calls), and the
#: CA bundle an HTTPS bootstrap server is verified with.
TOKEN_FILE_ENV = "PD_ROUTER_BOOTSTRAP_TOKEN_FILE"
CA_ENV = "PD_ROUTER_BOOTSTRAP_CA"
#: How long one release call may take (it runs detached: the client's request never waits for it).
RELEASE_TIMEOUT_S = 5.0


@functools.lru_cache(maxsize=1)
def _credentials(token_file: str, ca: str) -> tuple[bytes | None, str]:
    return (load_token(token_file, "") if token_file else None), ca


def release_on_p(
    router: Router, p: BackendState, room: int, rid: str, why: str, fallback: Callable[[], object] | None = None
) -> None:
    """Free ``room`` on ``p``'s prefill deployment through its bootstrap server (detached; ``why`` is
    logged there and told to a decoder that asks for the room later). When the call cannot be made or
    fails, ``fallback`` runs (None: P's room_timeout_s frees the room)."""
    host, port = p.backend.bootstrap_address
    if port is None:
        if fallback is not None:
            fallback()
        return
    addr = host_port(host, port)

    async def release() -> None:
        try:
            token, ca = _credentials(os.environ.get(TOKEN_FILE_ENV, ""), os.environ.get(CA_ENV, ""))
            answer = await asyncio.to_thread(bootstrap.release_room, addr, room, why, RELEASE_TIMEOUT_S, token, ca)
        except Exception as exc:  # noqa: BLE001 - any failure: the fallback, else room_timeout_s
            then = "releasing it through a decoder" if fallback is not None else "P's room_timeout_s frees it"
            logger.warning("rid=%s room=%s releasing P's room at %s failed (%s); %s", rid, room, addr, exc, then)
            if fallback is not None:
                fallback()
            return
        logger.info(
            "rid=%s room=%s released on %s (%s; P's leader rank had %s)", rid, room, addr, why, answer.get("before")
        )

    router.keep(asyncio.get_running_loop().create_task(release()))


def release_room(
    router: Router,
    p: BackendState,
    room: int,
    call: Call,
    prefilled_tokens: int | None,
    avoid: Collection[BackendState] = (),
) -> bool:
    """Free ``room`` on ``p`` through a decoder not in ``avoid`` (``call``: the request whose KV
    P holds; ``prefilled_tokens`` as it was sent). Returns False when no such decoder exists."""
    d = router.pool.pick("decode", room, avoid, RouteRequest(room, call.tokens, call.body))
    if d is None or d in avoid:
        logger.warning("rid=%s room=%s no decoder to release P's KV; room_timeout_s frees it", call.rid, room)
        return False
    body = {**call.body, "stream": False, "max_tokens": 1}
    if "max_completion_tokens" in body:
        body["max_completion_tokens"] = 1
    body.pop("stream_options", None)
    body.pop("min_tokens", None)
    data = encode_json(decode_body(body, room, p.backend, prefilled_tokens))
    rid, endpoint, headers = call.rid, call.endpoint, call.headers
    logger.info("rid=%s room=%s releasing %s's KV of the room through %s", rid, room, p.backend.name, d.backend.name)

    async def release() -> None:
        reply = await fetch(router.http, d, "POST", endpoint, router.config.request_timeout, data, headers)
        if isinstance(reply, Failure) or reply.status >= 300:
            detail = reply.detail if isinstance(reply, Failure) else f"HTTP {reply.status}"
            logger.warning("rid=%s room=%s releasing P's KV through %s failed: %s", rid, room, d.backend.name, detail)
        else:
            logger.debug("rid=%s room=%s P's KV released through %s", rid, room, d.backend.name)

    router.keep(asyncio.get_running_loop().create_task(release()))
    return True
