"""The local path: D prefills the request itself (:func:`local_prefill`).

Chosen per request by ``--path-policy`` (:mod:`proxy.planning.live`): the decoder routing picked
gets the client's request as an ordinary vLLM request (no ``kv_transfer_params``, no P, no KV
push) and answers it from the first token on, so its tokens are those a PD answer has. The
attempt is the request's first and runs in the request's own room; its stream is relayed,
resumed if cut and movable by a drain's replay like any other. If D fails before answering and
the failure is retried, the request goes on as two-instance attempts on fresh P/D pairs
(:class:`proxy.request.loop.Next`), the failed decoder avoided.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from proxy.planning.live import Decided
from proxy.request.loop import Next, Won

if TYPE_CHECKING:
    from proxy.request.context import RequestContext
    from proxy.server.reply import ClientReply

logger = logging.getLogger("proxy")


async def local_prefill(ctx: RequestContext, decided: Decided) -> ClientReply | Next:
    """The request on ``decided.d`` alone; the client's answer, or the two-instance path after a retried failure."""
    loop, paths = ctx.loop, ctx.router.paths
    d = decided.d
    if d is None:
        raise ValueError("local_prefill: the decision names no decoder")
    idle = d.in_flight == 0  # D's time to answer is then its prefill time (the path model's sample)
    loop.count()
    attempt = loop.new_attempt(ctx.call, decided.p or d, d, loop.progress.room, local=True)
    paths.sent(decided, d)
    sent = time.monotonic()
    try:
        got = await loop.run(attempt)
    finally:
        paths.local_answered(decided, d)
    if isinstance(got, Won):
        if idle and ctx.call.stream:  # its first chunk came after the prefill
            paths.observe_prefill(d, decided.tokens, (time.monotonic() - sent) * 1000)
        return await ctx.answer(got)
    if loop.may_retry(got.decision):
        logger.warning(
            "rid=%s room=%s local prefill on %s failed (%s); retrying as P/D attempts",
            ctx.rid,
            loop.progress.room,
            d.backend.name,
            got.failure.error.message,
        )
        return Next.TWO_INSTANCE
    return ctx.final_failure(got.failure)
