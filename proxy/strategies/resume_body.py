"""Resuming a cut stream on another decoder: the stream tracker and the resumed leg's body.

Pure code, no I/O (:mod:`proxy.strategies.resume` runs the resumed legs). A streamed ``/v1/completions``
or ``/v1/chat/completions`` request that may be resumed (:func:`resumable`) has D asked for
``return_token_ids``; its events go through a :class:`StreamTracker`, which

- records what the client has of the answer: the leg's prompt token ids (D's first event), every
  generated token id, the answer's ``id``/``created``/``model``, whether a finish reason went out;
- strips the token ids from the events unless the client asked for them (``return_token_ids``);
- on a resumed leg, rewrites each event as the first leg's (its ``id``, ``created``, ``model``;
  no second ``prompt_token_ids``) and moves the tokens replayed in the leg's prompt from
  ``prompt_tokens`` to ``completion_tokens`` in usage figures; a chat stream's resumed leg is a
  completions one, its events re-shaped into chat chunks (:mod:`proxy.strategies.resume_chat`).

A resumed leg (:func:`resume_call`) prefills the leg's prompt ids plus the generated ids the
client has (token ids, so the new decoder sees exactly the tokens one instance had: no
re-tokenization of text) and generates the rest of the budget. Tokens whose text is still held back
(empty text or a text ending in U+FFFD: the first bytes of a character) are not replayed but
generated again, so their text reaches the client. An event of several tokens (vLLM merges steps
when its reader lags) may hold its last tokens' bytes with nothing in its text to say so: those are
:attr:`StreamTracker.unsure` until :func:`proxy.request.held_tail.settle_held_tail` asks an instance.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import msgspec

from pd_connector.kv_params import KV_PARAMS_KEY as KV_KEY
from pd_connector.kv_params import ROOM as ROOM_KEY
from proxy.request.payloads import CHAT_COMPLETIONS, COMPLETIONS
from proxy.strategies.first_token_body import (
    continuation_ineligible_reason,
    include_usage,
    seeded_sampling,
    single_prompt,
    wants_token_ids,
)
from proxy.strategies.recompute_body import COMPLETIONS_DEFAULT_MAX_TOKENS
from proxy.strategies.resume_chat import (
    HELD_CONTENT,
    PARSER_MARKS,
    as_chat_chunk,
    budget,
    chat_ineligible_reason,
    delta_refusal,
    leg_body,
)

if TYPE_CHECKING:
    from proxy.request.attempt import Call

_ENCODER = msgspec.json.Encoder()
_DECODER = msgspec.json.Decoder()
_DONE = b"data: [DONE]"
_ERROR = b'data: {"error"'
_IDS = b'"token_ids":['
_NO_IDS = b'"token_ids":null'
_FINISH = b'"finish_reason":'
_NO_FINISH = b'"finish_reason":null'
#: A text the detokenizer still holds bytes of: empty, or ending in U+FFFD (raw or escaped).
_HELD_TEXT = (b'"text":"",', b'\xef\xbf\xbd",', b'\\ufffd",')


#: The seed of a resumed leg of a seeded sampled request: a 63-bit draw from the client's seed and the
#: number of tokens the client has (vLLM takes any signed 64-bit seed).
_SEED_MASK = (1 << 63) - 1


def resume_ineligible_reason(endpoint: str, body: dict[str, Any]) -> str | None:
    """Why a cut stream of ``body`` (the client's, validated) cannot go on on another decoder; None when
    it can: a streamed completions (one prompt) or chat request (no tools) whose continuation samples
    what one instance would (:func:`proxy.strategies.first_token_body.continuation_ineligible_reason`:
    one sample, no echo/logprobs/stop strings/penalties/structured output). Seeded sampling may
    resume: the resumed leg gets a seed of its own (:func:`reseed`)."""
    if endpoint == CHAT_COMPLETIONS:
        reason = chat_ineligible_reason(body)
    elif endpoint == COMPLETIONS:
        reason = None if single_prompt(body.get("prompt")) else "not a single prompt"
    else:
        reason = "not /v1/completions or /v1/chat/completions"
    return reason or continuation_ineligible_reason(body)


def resumable(call: Call, resume_attempts: int) -> bool:
    """Whether a cut stream of ``call`` may be resumed on another decoder: resume on and
    :func:`resume_ineligible_reason` has nothing against it."""
    return resume_attempts > 0 and call.stream and resume_ineligible_reason(call.endpoint, call.body) is None


def reseed(seed: int, tokens: int) -> int:
    """The seed of a resumed leg of a request seeded ``seed`` whose client has ``tokens`` generated
    tokens: the same seed again would restart vLLM's per-request generator, drawing for token
    ``tokens + 1`` the noise it drew for token 1 (the two tokens' samples correlated); a seed drawn
    from both is a fresh, reproducible one."""
    digest = hashlib.blake2b(f"{seed}:{tokens}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") & _SEED_MASK


@dataclass(frozen=True, slots=True)
class Identity:
    """The client's answer as its first event named it."""

    id: Any
    created: Any
    model: Any


class StreamTracker:
    """One leg's events on their way to the client (see the module docstring).

    ``replayed``: trailing tokens of the leg's prompt that the client has as generated ones (1 on the
    first-token path's continuation, more on a resumed leg). ``identity``: the client's answer id,
    created and model (None on a first leg: taken from its first event). ``chat``: the client asked
    ``/v1/chat/completions`` (None: the leg's own endpoint says); a completions leg of a chat client
    has its events re-shaped into chat chunks. ``seed``: the client's seed (None: the leg's).
    """

    def __init__(
        self,
        call: Call,
        *,
        identity: Identity | None = None,
        ids_ahead: int = 0,
        chat: bool | None = None,
        seed: int | None = None,
    ) -> None:
        self.call = call
        self.chat = call.endpoint == CHAT_COMPLETIONS if chat is None else chat
        #: This leg is ``/v1/completions`` for a chat client: each event becomes a chat chunk.
        self.reshape = self.chat and call.endpoint != CHAT_COMPLETIONS
        client_seed = call.body.get("seed") if seed is None else seed
        self.seed = client_seed if isinstance(client_seed, int) and not isinstance(client_seed, bool) else None
        #: Why the stream cannot be resumed after all, seen in its events (a chat parser's output).
        self.refusal: str | None = None
        self._held = HELD_CONTENT if self.chat and not self.reshape else _HELD_TEXT
        #: Leading token ids of this leg the client has already (a resumed leg generates held-back
        #: tokens again: their text is new to the client, their ids are not); not sent a second time.
        self.ids_ahead = ids_ahead if wants_token_ids(call.body) else 0
        self.replayed = call.replayed
        self.identity = identity
        self.resumed = identity is not None
        self.keep_ids = wants_token_ids(call.body)
        #: The leg's prompt token ids (from D's first event).
        self.prompt_ids: list[int] | None = None
        #: Token ids D generated on this leg, in order, and how many of them the client has whole.
        self.generated: list[int] = []
        self.committed = 0
        #: How many of the last committed tokens may still have had their text held: the later
        #: tokens of a merged event (several steps in one event; see :mod:`proxy.request.held_tail`).
        self.unsure = 0
        #: A finish reason went out (the answer is complete but for usage and ``[DONE]``).
        self.finished = False
        #: D's error event, when one came (the leg ends there).
        self.error: str | None = None
        #: The leg's bytes after its last whole event (an event split over chunks).
        self._pending = b""

    def feed(self, chunk: bytes, end: bool = False) -> bytes:
        """D's ``chunk`` as the client gets it (whole events only; ``end``: the leg's last chunk).
        An error event stops the leg there: :attr:`error` says it, nothing after it is passed on."""
        data = self._pending + chunk if self._pending else chunk
        cut = data.rfind(b"\n\n")
        if cut < 0 and not end:
            self._pending = data
            return b""
        if end:
            whole, self._pending = data, b""
        else:
            whole, self._pending = data[: cut + 2], data[cut + 2 :]
        out = []
        for event in whole.split(b"\n\n"):
            if event.startswith(b"data: {"):
                event = self._event(event)
                if self.error is not None:
                    break
            out.append(event)
        return b"\n\n".join(out) if self.error is None else b"".join(e + b"\n\n" for e in out)

    def _event(self, event: bytes) -> bytes:
        if event.startswith(_ERROR):
            self.error = event[6:].decode("utf-8", "replace")[:500]
            return b""
        if (
            self.identity is not None
            and not self.resumed
            and not (self.chat and any(mark in event for mark in PARSER_MARKS))
            and (scanned := self._scan(event)) is not None
        ):
            return scanned
        try:
            payload = _DECODER.decode(event[6:])
        except msgspec.DecodeError:
            return event
        if not isinstance(payload, dict):
            return event
        if self.identity is None:
            self.identity = Identity(payload.get("id"), payload.get("created"), payload.get("model"))
        else:
            for key, value in (
                ("id", self.identity.id),
                ("created", self.identity.created),
                ("model", self.identity.model),
            ):
                if key in payload and value is not None:
                    payload[key] = value
        prompt = payload.get("prompt_token_ids")  # a chat stream's, on its first event
        if isinstance(prompt, list) and self.prompt_ids is None:
            self.prompt_ids = [t for t in prompt if isinstance(t, int)]
        if "prompt_token_ids" in payload and (self.resumed or not self.keep_ids):
            payload["prompt_token_ids"] = None
        for choice in payload.get("choices") or ():
            if isinstance(choice, dict):
                self._choice(choice)
        usage = payload.get("usage")
        if self.resumed and isinstance(usage, dict) and isinstance(usage.get("prompt_tokens"), int):
            # D counts the replayed tokens as prompt; the client has them as generated.
            usage["prompt_tokens"] -= self.replayed
            usage["completion_tokens"] = usage.get("completion_tokens", 0) + self.replayed
            if isinstance(usage.get("total_tokens"), int):
                usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
        if self.reshape:
            payload = as_chat_chunk(payload)
        return b"data: " + _ENCODER.encode(payload)

    def _scan(self, event: bytes) -> bytes | None:
        """A first leg's event after its first, read without a JSON parse (vLLM's compact JSON: the
        choice's ``token_ids`` list, its text and finish reason): parsing every event of every
        stream is a large share of the Router's time. None: not in that form (parse it)."""
        at = event.rfind(_IDS)
        if at < 0:
            return None if self.chat or b'"token_ids"' in event else event  # a chat chunk without ids: parsed
        start = at + len(_IDS)
        stop = event.find(b"]", start)
        if stop < 0:
            return None
        try:
            ids = [int(t) for t in event[start:stop].split(b",") if t.strip()]
        except ValueError:
            return None
        self.generated.extend(ids)
        if _FINISH in event and _NO_FINISH not in event:
            self.finished = True
            self._commit(0)
        elif ids and not any(held in event for held in self._held):
            self._commit(len(ids))
        if self.keep_ids:
            return event
        return event[:at] + _NO_IDS + event[stop + 1 :]

    def _choice(self, choice: dict[str, Any]) -> None:
        prompt = choice.get("prompt_token_ids")
        if isinstance(prompt, list) and self.prompt_ids is None:
            self.prompt_ids = [t for t in prompt if isinstance(t, int)]
        ids = choice.get("token_ids")
        steps = [t for t in ids if isinstance(t, int)] if isinstance(ids, list) else []
        self.generated.extend(steps)
        if self.chat and not self.reshape:
            delta = choice.get("delta")
            text = delta.get("content") if isinstance(delta, dict) else None
            refusal = delta_refusal(delta, len(steps))
            if refusal is None and text and not steps:
                refusal = "no token ids in the chat stream (a parser hides them)"
            if refusal is not None and self.refusal is None:
                self.refusal = refusal
        else:
            text = choice.get("text")
        if steps and isinstance(text, str) and text and not text.endswith("\ufffd"):
            self._commit(len(steps))
        if choice.get("finish_reason") is not None:
            self.finished = True
            self._commit(0)
        if self.resumed or not self.keep_ids:
            if "prompt_token_ids" in choice:
                choice["prompt_token_ids"] = None
        if not self.keep_ids and "token_ids" in choice:
            choice["token_ids"] = None
        elif self.ids_ahead and steps:
            skip = min(self.ids_ahead, len(steps))
            self.ids_ahead -= skip
            choice["token_ids"] = steps[skip:]

    def _commit(self, steps: int) -> None:
        """Every token so far is the client's: the event that sent text named ``steps`` of them
        (0: a finish reason, nothing held). Its text covers the first surely, the others maybe."""
        self.committed = len(self.generated)
        self.unsure = max(0, steps - 1)

    # -- after a cut -----------------------------------------------------------------------------

    def hold_back(self, end: int) -> None:
        """The client has the text of the first ``end`` committed tokens only (the rest was held):
        those are generated again on a resumed leg (:func:`proxy.request.held_tail.settle_held_tail`)."""
        self.committed = min(end, self.committed)
        self.unsure = 0

    def ids_sent_beyond_committed(self) -> int:
        """Token ids the client has past the committed tokens (those of held-back text, sent with
        their events): the next leg generates them again and must not send their ids twice."""
        had = len(self.generated) + self.ids_ahead  # ids_ahead left: the client had those too
        return max(0, had - self.committed) if self.keep_ids else 0

    @property
    def sent_tokens(self) -> int:
        """Tokens the client has as generated (every leg's, replayed ones included)."""
        return self.replayed + self.committed

    def closing_events(self) -> bytes:
        """The end of an answer whose finish reason went out before the cut: usage (when the client
        asked) and ``[DONE]``."""
        out = b""
        if include_usage(self.call.body) and self.identity is not None and self.prompt_ids is not None:
            prompt = len(self.prompt_ids) - self.replayed
            completion = self.replayed + len(self.generated)
            payload = {
                "id": self.identity.id,
                "object": "chat.completion.chunk" if self.chat else "text_completion",
                "created": self.identity.created,
                "model": self.identity.model,
                "choices": [],
                "usage": {
                    "prompt_tokens": prompt,
                    "completion_tokens": completion,
                    "total_tokens": prompt + completion,
                },
            }
            out = b"data: " + _ENCODER.encode(payload) + b"\n\n"
        return out + _DONE + b"\n\n"


def why_not_resumed(tracker: StreamTracker) -> str:
    """Why :func:`resume_call` has no leg for ``tracker``'s stream (for the log line)."""
    if tracker.refusal is not None:
        return tracker.refusal
    if tracker.prompt_ids is None:
        return "no prompt token ids seen"
    return "no token left to generate"


def resume_call(tracker: StreamTracker) -> Call | None:
    """The resumed leg's call: the leg's prompt ids plus the whole tokens the client has, the rest
    of the budget; None when it cannot be built (:func:`why_not_resumed`). A chat stream's leg is a
    ``/v1/completions`` one (:mod:`proxy.strategies.resume_chat`), its ``max_tokens`` None when the
    client gave no budget (:func:`proxy.strategies.resume.resume_stream` sets it from the model's
    context length). A seeded sampled request's leg samples from :func:`reseed`'s seed."""
    call = tracker.call
    if tracker.prompt_ids is None or tracker.refusal is not None:
        return None
    sent = tracker.generated[: tracker.committed]
    replayed = call.replayed + len(sent)
    limit: int | None
    if call.endpoint == CHAT_COMPLETIONS:
        body = leg_body(call.body)
        limit = budget(call.body)
    else:
        body = dict(call.body)
        body.pop(ROOM_KEY, None)
        body.pop(KV_KEY, None)
        body.pop("truncate_prompt_tokens", None)  # the ids are final: D must keep every one
        limit = body.get("max_tokens")
        if not isinstance(limit, int):
            limit = COMPLETIONS_DEFAULT_MAX_TOKENS - call.replayed
    body["prompt"] = [*tracker.prompt_ids, *sent]
    if limit is None:
        body["max_tokens"] = None
    elif limit - len(sent) < 1:
        return None
    else:
        body["max_tokens"] = limit - len(sent)
    min_tokens = body.get("min_tokens")
    if isinstance(min_tokens, int):
        body["min_tokens"] = max(0, min_tokens - len(sent))
    if tracker.seed is not None and seeded_sampling(body):
        body["seed"] = reseed(tracker.seed, replayed)
    return replace(call, endpoint=COMPLETIONS, body=body, tokens=len(body["prompt"]), replayed=replayed)
