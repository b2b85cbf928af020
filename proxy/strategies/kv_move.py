"""Moving a drained decoder's stream WITH its KV: the target decoder's leg (:func:`kv_leg`).

A decoder the Router knows the bootstrap port of (``--decoder-bootstrap-ports``, ``/instances/add``
with ``bootstrap_port``: :attr:`proxy.router_config.Backend.movable`) gets a fresh ``migrate_room``
in every resumable request's attempt (:meth:`proxy.request.loop.AttemptLoop.new_attempt`). When a drain closes such a stream
(:mod:`proxy.admin.drain`), vLLM aborts the request there and the connector holds its KV as that room for
a while (``migrate_hold_s``). The stream then goes on on another decoder by an ordinary D-only leg:

- prompt: the leg's prompt ids plus the generated ids the client has (:func:`proxy.strategies.resume_body.resume_call`);
- ``kv_transfer_params``: room = the migrate room, bootstrap host/port = the drained decoder's own
  bootstrap server, DP rank 0, ``prefilled_tokens`` = len(prompt) - 1 (the drained decoder computed
  the KV of at least that many positions: a sampled token's KV is computed by the forward that
  samples the next one). The target loads those blocks from the drained decoder (a D -> D push)
  and computes the last prompt token itself; nothing is prefilled again.

The leg is an attempt with ``p_answered`` whose "prefiller" is the drained decoder (the
:class:`proxy.request.attempt.Cut`'s ``d``), made and settled by the request's
:class:`proxy.request.loop.AttemptLoop`: it holds no lease
there (the drain waits for nothing of it). A rebalance's move (:mod:`proxy.admin.rebalance`) goes to the
decoder its policy chose, while that one is active and healthy; a drain's to the one routing picks. A leg that fails before its first chunk leaves the stream
to a replay leg (:mod:`proxy.strategies.resume`); the target is avoided then only where it was
unreachable (a failed KV load is most often the source's doing: :func:`proxy.request.failure_policy.settle`).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from proxy.request.attempt import Call, Cut, Opened
from proxy.request.failure_policy import Tried
from proxy.request.loop import Won

if TYPE_CHECKING:
    from proxy.request.context import RequestContext
    from proxy.upstream.pool import BackendState

logger = logging.getLogger("proxy")


def prefilled_tokens(call: Call) -> int | None:
    """Tokens of ``call``'s prompt whose KV the drained decoder holds: all but the last (None: too
    short a prompt to move by KV)."""
    prompt = call.body.get("prompt")
    if not isinstance(prompt, list) or len(prompt) < 2:
        return None
    return len(prompt) - 1


def _planned(ctx: RequestContext, source: BackendState, tried: Tried) -> BackendState | None:
    """The decoder a rebalance cut the stream for (:meth:`proxy.admin.drain.Drains.planned_target`),
    while it is active, healthy and has not failed the request; None: routing picks."""
    target = ctx.router.drains.planned_target(ctx)
    if target is None or target is source or target in tried.d or not target.healthy:
        return None
    return target if target in ctx.router.pool.active["decode"] else None


async def kv_leg(ctx: RequestContext, cut: Cut, call: Call, tried: Tried) -> Won | None:
    """Open the leg that continues ``cut``'s stream on another decoder with the KV the drained
    decoder holds as ``cut.kv_room`` (``call``: :func:`proxy.strategies.resume_body.resume_call`'s);
    the leg that opened its stream, or None when none did (the caller replays; ``tried`` gains the
    target only where it was unreachable)."""
    loop = ctx.loop
    source, room = cut.d, cut.kv_room
    prefilled = prefilled_tokens(call)
    if room is None or prefilled is None:
        return None
    d = _planned(ctx, source, tried) or loop.pick("decode", call, room, tried.d)
    if d is None or d in tried.d or loop.remaining() <= 0:
        logger.warning("rid=%s room=%s no decoder to move to by KV; replaying", ctx.rid, room)
        return None
    loop.count()
    got = await loop.run(loop.new_attempt(call, source, d, room, p_answered=True, prefilled_tokens=prefilled), tried)
    if isinstance(got, Won):
        return got if isinstance(got.outcome, Opened) else None
    logger.warning(
        "rid=%s room=%s KV leg on %s (KV from %s) failed before its first chunk (%s); replaying",
        ctx.rid,
        room,
        d.backend.name,
        source.backend.name,
        got.failure.error.message,
    )
    return None
