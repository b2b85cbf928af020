"""The two-instance path: P and D asked at once, D's answer to the client (:func:`two_instance`).

The request's attempts run on P/D pairs the routing policy picks (:meth:`proxy.request.loop.AttemptLoop.pairs`),
each retry avoiding the instances that failed the request, with a fresh room and a backoff, up to
``--max-retries`` attempts in all (the first-token path's attempts included when it hands the request
over). The first attempt that does not fail gives the answer (:meth:`proxy.request.context.RequestContext.answer`);
otherwise the client gets the last failure, or 503 when a role has no instance, or 504 when the
request's time ran out first.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from proxy.errors import DECODE_FAILED, UPSTREAM_UNAVAILABLE, RouterError
from proxy.request.loop import Won

if TYPE_CHECKING:
    from proxy.request.context import RequestContext
    from proxy.server.reply import ClientReply


async def two_instance(ctx: RequestContext) -> ClientReply:
    """The rest of the request's attempts on P/D pairs; the client's answer."""
    loop = ctx.loop
    first = loop.progress.attempts == 0
    tries = ctx.router.config.max_retries - loop.progress.attempts
    got = await loop.pairs(ctx.call, loop.tried, tries, first_room=loop.progress.room if first else None)
    if isinstance(got, Won):
        return await ctx.answer(got)
    if got.missing is not None:
        return ctx.error(RouterError(503, got.why or "", UPSTREAM_UNAVAILABLE))
    if got.failure is None:
        return ctx.error(RouterError(504, "the request timed out before a backend answered", DECODE_FAILED))
    return ctx.final_failure(got.failure)
