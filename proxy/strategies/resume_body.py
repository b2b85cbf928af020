"""Resuming a cut stream on another decoder: the stream tracker and the resumed leg's body.

Pure code, no I/O (:mod:`proxy.strategies.resume` runs the resumed legs). A streamed ``/v1/completions``
request that may be resumed (:func:`resumable`) has D asked for ``return_token_ids``; its events
go through a :class:`StreamTracker`, which

- records what the client has of the answer: the leg's prompt token ids (D's first event), every
  generated token id, the answer's ``id``/``created``/``model``, whether a finish reason went out;
- strips the token ids from the events unless the client asked for them (``return_token_ids``);
- on a resumed leg, rewrites each event as the first leg's (its ``id``, ``created``, ``model``;
  no second ``prompt_token_ids``) and moves the tokens replayed in the leg's prompt from
  ``prompt_tokens`` to ``completion_tokens`` in usage figures.

A resumed leg (:func:`resume_call`) prefills the leg's prompt ids plus the generated ids the
client has (token ids, so the new decoder sees exactly the tokens one instance had: no
re-tokenization of text) and generates the rest of the budget. Tokens whose text is still held back
(empty text or a text ending in U+FFFD: the first bytes of a character) are not replayed but
generated again, so their text reaches the client. An event of several tokens (vLLM merges steps
when its reader lags) may hold its last tokens' bytes with nothing in its text to say so: those are
:attr:`StreamTracker.unsure` until :func:`proxy.request.held_tail.settle_held_tail` asks an instance.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import msgspec

from pd_connector.kv_params import KV_PARAMS_KEY as KV_KEY
from pd_connector.kv_params import ROOM as ROOM_KEY
from proxy.request.payloads import COMPLETIONS
from proxy.strategies.first_token_body import include_usage, ineligible_reason, wants_token_ids
from proxy.strategies.recompute_body import COMPLETIONS_DEFAULT_MAX_TOKENS

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


def resumable(call: Call, resume_attempts: int) -> bool:
    """Whether a cut stream of ``call`` may be resumed on another decoder: resume on, a streamed
    completions request whose continuation samples what one instance would (the first-token
    path's rules: one prompt, one sample, no echo/logprobs/stop strings/penalties/structured output)."""
    return (
        resume_attempts > 0
        and call.stream
        and call.endpoint == COMPLETIONS
        and ineligible_reason(COMPLETIONS, call.body) is None
    )


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
    created and model (None on a first leg: taken from its first event).
    """

    def __init__(self, call: Call, *, identity: Identity | None = None, ids_ahead: int = 0) -> None:
        self.call = call
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
        if self.identity is not None and not self.resumed and (scanned := self._scan(event)) is not None:
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
        return b"data: " + _ENCODER.encode(payload)

    def _scan(self, event: bytes) -> bytes | None:
        """A first leg's event after its first, read without a JSON parse (vLLM's compact JSON: the
        choice's ``token_ids`` list, its text and finish reason): parsing every event of every
        stream is a large share of the Router's time. None: not in that form (parse it)."""
        at = event.rfind(_IDS)
        if at < 0:
            return None if b'"token_ids"' in event else event
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
        elif ids and not any(held in event for held in _HELD_TEXT):
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
                "object": "text_completion",
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


def resume_call(tracker: StreamTracker) -> Call | None:
    """The resumed leg's call: the leg's prompt ids plus the whole tokens the client has, the rest
    of the budget; None when it cannot be built (no prompt ids seen, no token left to generate)."""
    call = tracker.call
    if tracker.prompt_ids is None:
        return None
    body = dict(call.body)
    body.pop(ROOM_KEY, None)
    body.pop(KV_KEY, None)
    body.pop("truncate_prompt_tokens", None)  # the ids are final: D must keep every one
    sent = tracker.generated[: tracker.committed]
    body["prompt"] = [*tracker.prompt_ids, *sent]
    limit = body.get("max_tokens")
    if not isinstance(limit, int):
        limit = COMPLETIONS_DEFAULT_MAX_TOKENS - call.replayed
    if limit - len(sent) < 1:
        return None
    body["max_tokens"] = limit - len(sent)
    min_tokens = body.get("min_tokens")
    if isinstance(min_tokens, int):
        body["min_tokens"] = max(0, min_tokens - len(sent))
    return replace(call, body=body, tokens=len(body["prompt"]), replayed=call.replayed + len(sent))
