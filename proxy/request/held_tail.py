"""Which of the client's last tokens it has the text of, settled at a cut: :func:`settle_held_tail`.

vLLM's detokenizer holds back the bytes of a token that ends inside a character and sends them
with a later token's text. When the front end reads slower than D generates, vLLM merges several
steps into one stream event: its ``token_ids`` name every step, its text is what the steps sent,
and nothing says whether the text stopped before the event's last tokens (their bytes still held).
:class:`proxy.strategies.resume_body.StreamTracker` counts such an event's tokens as the client's and says how
many of them are unsure (:attr:`~proxy.strategies.resume_body.StreamTracker.unsure`).

A resumed leg whose prompt ends in held tokens goes wrong twice: the client never gets their bytes,
and the new decoder's detokenizer, primed with a prompt whose text ends inside a character, starts
with no prefix, so the first text it sends is the whole prompt's (tokenizers' ``DecodeStream`` as
vLLM primes it). So before a resumed leg is built, an instance's ``/detokenize`` (vLLM's, served by
default) gives the text of the ids up to each possible end, and the client's tokens end at the
longest one whose text does not end in U+FFFD: the steps after it had sent no text, so they are
generated again and their text reaches the client then. Nobody answering leaves the tail as counted
(logged): the stream still resumes.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING

import msgspec

from proxy.upstream.calls import Failure, fetch

if TYPE_CHECKING:
    from proxy.request.attempt import Call, Cut
    from proxy.request.context import RequestContext
    from proxy.strategies.resume_body import StreamTracker
    from proxy.upstream.pool import BackendState

logger = logging.getLogger("proxy")

#: Ids decoded before each candidate end: enough for the last character's bytes whatever came before.
WINDOW = 32
#: Candidate ends checked at most (a merged event of more tokens keeps its older ones as counted).
MAX_CANDIDATES = 16
#: Seconds the instances get, all together, to answer (the cut stream waits that long at most).
TIMEOUT_S = 2.0
_HELD = "\ufffd"
_ENCODER = msgspec.json.Encoder()
_DECODER = msgspec.json.Decoder()


def candidate_ends(tracker: StreamTracker) -> list[int]:
    """Counts of generated tokens the client may have the text of, longest first (empty: nothing unsure)."""
    if tracker.unsure <= 0 or tracker.prompt_ids is None:
        return []
    lowest = max(tracker.committed - min(tracker.unsure, MAX_CANDIDATES), 0)
    return list(range(tracker.committed, lowest - 1, -1))


def window(tracker: StreamTracker, end: int) -> list[int]:
    """The ids whose text ends where the client's would if it had ``end`` generated tokens."""
    prompt = tracker.prompt_ids or []
    ids = [*prompt[-WINDOW:], *tracker.generated[:end]]
    return ids[-WINDOW:]


def longest_whole(ends: list[int], texts: list[str]) -> int | None:
    """The first of ``ends`` (longest first) whose text has no held bytes at its end."""
    for end, text in zip(ends, texts, strict=True):
        if not text.endswith(_HELD):
            return end
    return None


async def _detokenize(
    ctx: RequestContext, state: BackendState, call: Call, ids: list[int], deadline: float
) -> str | None:
    """``state``'s text of ``ids`` (None: no usable answer); sent with ``call``'s backend headers
    (its request id, trace context and the Router's key for the backends)."""
    body: dict[str, object] = {"tokens": ids}
    model = call.body.get("model")
    if isinstance(model, str):
        body["model"] = model
    left = max(0.05, deadline - time.monotonic())
    reply = await fetch(ctx.router.http, state, "POST", "/detokenize", left, _ENCODER.encode(body), call.headers)
    if isinstance(reply, Failure) or reply.status != 200:
        return None
    try:
        text = _DECODER.decode(reply.body).get("prompt")
    except (msgspec.DecodeError, AttributeError):
        return None
    return text if isinstance(text, str) else None


async def settle_held_tail(ctx: RequestContext, cut: Cut, tracker: StreamTracker) -> None:
    """Lower ``tracker``'s count of the client's tokens past any whose text was still held when
    the stream was cut (``cut``; see the module docstring); asks the cut decoder, then its
    prefiller, then any other healthy instance."""
    ends = candidate_ends(tracker)
    if not ends:
        return
    counted = tracker.committed
    sources = [cut.d, cut.p]
    sources += [s for s in ctx.router.pool.all_states() if s.healthy and s not in sources]
    deadline = time.monotonic() + TIMEOUT_S
    for state in sources:
        if time.monotonic() >= deadline:
            break
        texts = await asyncio.gather(
            *(_detokenize(ctx, state, cut.call, window(tracker, end), deadline) for end in ends)
        )
        if any(text is None for text in texts):
            continue
        whole = longest_whole(ends, [t for t in texts if t is not None])
        if whole is None:
            logger.warning(
                "rid=%s room=%s the last %d token(s) all end inside a character; resuming after all %d",
                ctx.rid,
                ctx.progress.room,
                len(ends),
                counted,
            )
        else:
            tracker.hold_back(whole)
            if whole < counted:
                logger.info(
                    "rid=%s room=%s %d of the client's last token(s) had no text yet (/detokenize on %s); "
                    "they are generated again",
                    ctx.rid,
                    ctx.progress.room,
                    counted - whole,
                    state.backend.name,
                )
        return
    logger.warning(
        "rid=%s room=%s no instance answered /detokenize; resuming after all %d token(s) (the last %d may "
        "have had no text yet)",
        ctx.rid,
        ctx.progress.room,
        counted,
        tracker.unsure,
    )
