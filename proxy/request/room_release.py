"""Releasing a room P holds for a decoder that will not come.

P keeps a finished prefill's KV for its room until a decoder loads it, or until its
``room_timeout_s``. When the Router gives a room up after P answered (the client left, no decoder
is left, or the decoder could not be reached and the request goes on elsewhere), a detached
one-token, non-streamed request to another decoder loads that KV, which frees it on P at once;
nothing of its answer is used.

Only where the decoder certainly never asked P for the room (as :mod:`proxy.request.failure_policy`
decides: D could not be connected to), or no decoder was asked at all: a decoder that got the
request may have loaded the KV already, and a second load of a room P no longer holds would
fail on that other decoder for nothing. The request's :class:`proxy.request.loop.AttemptLoop` is
the one caller; its module says when.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Collection
from typing import TYPE_CHECKING

from proxy.request.payloads import decode_body
from proxy.upstream.calls import Failure, fetch
from proxy.upstream.http1 import encode_json
from proxy.upstream.pool import BackendState
from proxy.upstream.routing import RouteRequest

if TYPE_CHECKING:
    from proxy.request.attempt import Call
    from proxy.router_state import Router

logger = logging.getLogger("proxy")


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
