"""Answers D cut with ``stop_reason: "recomputed"``: bodies, merged answers and the stream watch.

Pure code, no I/O (:mod:`proxy.strategies.recompute` runs the continuations). vLLM-Ascend's recompute
scheduler (``recompute_scheduler_enable``) lets a decoder that runs out of KV blocks drop a request
instead of preempting it: the request ends with ``finish_reason: "stop"``, ``stop_reason:
"recomputed"`` and no new token, and the front end is expected to prefill the prompt plus the text
generated so far on a fresh P/D pair and go on from there.

What a continuation asks for (:func:`continuation_body`), always built from the client's own body
and all the text generated so far:

- ``/v1/completions``: ``prompt`` + generated text (as vLLM-Ascend's proxy does);
- ``/v1/chat/completions``: the generated text becomes an assistant message the model continues
  (``continue_final_message: true``, ``add_generation_prompt: false``; appended to the client's own
  final assistant message when the client already continues one). vLLM-Ascend's proxy appends it
  to the *first* message's content instead, which puts the answer inside the user's turn;
- ``max_tokens`` / ``max_completion_tokens`` (and ``min_tokens``) less the tokens generated so far
  (a completions request without ``max_tokens`` has vLLM's default, 16); none left: no continuation.

Requests the Router does not continue (:func:`unsupported_reason`: several prompts or samples, token-id
or embedding prompts, echo, beam search) get D's answer as it is.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec

from pd_connector.kv_params import KV_PARAMS_KEY as KV_KEY
from pd_connector.kv_params import ROOM as ROOM_KEY
from proxy.request.payloads import CHAT_COMPLETIONS

RECOMPUTED = "recomputed"
RECOMPUTED_BYTES = b'"recomputed"'  # a stop_reason in an event's JSON (text holding the word is escaped)
#: vLLM's ``max_tokens`` of a completions request that gives none.
COMPLETIONS_DEFAULT_MAX_TOKENS = 16
_RECOMPUTED_BYTES = b'"recomputed"'
_ENCODER = msgspec.json.Encoder()
_DECODER = msgspec.json.Decoder()


def unsupported_reason(endpoint: str, body: dict[str, Any]) -> str | None:
    """Why a recomputed answer to ``body`` is passed on as it is; None when it can be continued."""
    if body.get("n") not in (None, 1) or body.get("best_of") not in (None, 1):
        return "n > 1"
    if body.get("use_beam_search"):
        return "beam search"
    if body.get("echo"):
        return "echo"
    if endpoint == CHAT_COMPLETIONS:
        return None
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        return None
    if not isinstance(prompt, str):
        return "the prompt is not one text (token ids, embeddings or several prompts)"
    return None


@dataclass
class Progress:
    """What the client's answer holds so far, over every leg (D's answer before each recompute)."""

    #: Generated text, every leg's.
    text: str = ""
    #: Generated tokens, every leg's.
    tokens: int = 0
    #: The first leg's prompt tokens (the client's prompt), when D said.
    prompt_tokens: int | None = None
    #: The first leg's answer id (every later event says it too).
    id: str | None = None
    #: Continuations sent so far.
    continuations: int = 0


def continuation_body(endpoint: str, body: dict[str, Any], progress: Progress) -> dict[str, Any] | None:
    """The next leg's body: the client's ``body`` continued after ``progress``; None when no token is
    left to generate."""
    out = dict(body)
    out.pop(ROOM_KEY, None)
    out.pop(KV_KEY, None)
    for key in ("max_tokens", "max_completion_tokens"):
        limit = body.get(key)
        if limit is None and key == "max_tokens" and endpoint != CHAT_COMPLETIONS:
            limit = COMPLETIONS_DEFAULT_MAX_TOKENS
        if isinstance(limit, int):
            if limit - progress.tokens < 1:
                return None
            out[key] = limit - progress.tokens
    min_tokens = body.get("min_tokens")
    if isinstance(min_tokens, int):
        out["min_tokens"] = max(0, min_tokens - progress.tokens)
    if endpoint != CHAT_COMPLETIONS:
        prompt = body["prompt"]
        out["prompt"] = (prompt[0] if isinstance(prompt, list) else prompt) + progress.text
        return out
    messages = list(body["messages"])
    last = messages[-1]
    if body.get("continue_final_message") and last.get("role") == "assistant":
        content = last.get("content")
        if isinstance(content, list):
            messages[-1] = {**last, "content": [*content, {"type": "text", "text": progress.text}]}
        else:
            messages[-1] = {**last, "content": (content or "") + progress.text}
    else:
        messages.append({"role": "assistant", "content": progress.text})
    out["messages"] = messages
    out["continue_final_message"] = True
    out["add_generation_prompt"] = False
    return out


# -- whole (non-streamed) answers ---------------------------------------------------------------


def recomputed_answer(content: bytes) -> dict[str, Any] | None:
    """D's JSON answer, parsed, when its first choice stopped with ``recomputed``; else None."""
    if _RECOMPUTED_BYTES not in content:
        return None
    answer = parse_answer(content)
    return answer if answer is not None and is_recomputed(answer) else None


def parse_answer(content: bytes) -> dict[str, Any] | None:
    """A JSON answer with at least one choice, or None."""
    try:
        answer = _DECODER.decode(content)
    except msgspec.DecodeError:
        return None
    if not isinstance(answer, dict):
        return None
    choices = answer.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        return None
    return answer


def is_recomputed(answer: dict[str, Any]) -> bool:
    return answer["choices"][0].get("stop_reason") == RECOMPUTED


def answer_text(answer: dict[str, Any]) -> str:
    """The first choice's text (completions) or message content (chat)."""
    choice = answer["choices"][0]
    message = choice.get("message")
    text = message.get("content") if isinstance(message, dict) else choice.get("text")
    return text if isinstance(text, str) else ""


def answer_tokens(answer: dict[str, Any]) -> int:
    usage = answer.get("usage")
    tokens = usage.get("completion_tokens") if isinstance(usage, dict) else None
    return tokens if isinstance(tokens, int) else 0


def merged_answer(legs: list[dict[str, Any]], progress: Progress) -> bytes:
    """One answer from every leg's: the first leg's id, the last leg's finish, all the text, the
    logprobs and generated token ids in order, usage summed over the legs (prompt: the first's)."""
    first, last = legs[0], legs[-1]
    out = {**last, "id": first.get("id"), "created": first.get("created", last.get("created"))}
    choice = dict(last["choices"][0])
    message = choice.get("message")
    if isinstance(message, dict):
        choice["message"] = {**message, "content": progress.text}
    else:
        choice["text"] = progress.text
    choices = [leg["choices"][0] for leg in legs]
    for key in ("logprobs", "token_ids"):
        choice[key] = _concat([c.get(key) for c in choices])
    if "prompt_token_ids" in choices[0]:
        choice["prompt_token_ids"] = choices[0]["prompt_token_ids"]
    out["choices"] = [choice]
    usage = last.get("usage")
    if isinstance(usage, dict):
        prompt = first.get("usage", {}).get("prompt_tokens", usage.get("prompt_tokens", 0))
        out["usage"] = {
            **usage,
            "prompt_tokens": prompt,
            "completion_tokens": progress.tokens,
            "total_tokens": prompt + progress.tokens,
        }
    return _ENCODER.encode(out)


def _concat(parts: list[Any]) -> Any:
    """Lists concatenated; dicts (completions logprobs, chat's ``content`` list) field by field; else
    the last part (None stays None)."""
    if all(isinstance(p, list) for p in parts):
        return [x for p in parts for x in p]
    if all(isinstance(p, dict) for p in parts):
        return {key: _concat([p.get(key) for p in parts]) for key in parts[-1]}
    return parts[-1]


# -- streamed answers ---------------------------------------------------------------------------


class _Delta(msgspec.Struct):
    content: str | None = None
    role: str | None = None


class _Choice(msgspec.Struct):
    text: str | None = None
    delta: _Delta | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None


class _Usage(msgspec.Struct):
    prompt_tokens: int = 0
    completion_tokens: int = 0


class _Event(msgspec.Struct):
    id: str | None = None
    choices: list[_Choice] = []
    usage: _Usage | None = None


_EVENT = msgspec.json.Decoder(_Event)


class StreamWatch:
    """A relay transform (:meth:`proxy.request.context.RequestContext.relay`) over one leg of a streamed answer.

    It notes the leg's text and tokens (a token: an event whose choice has no finish reason, other than
    chat's opening role event; D's usage event, when there is one, says the exact count) and watches
    for the event that stops with ``recomputed``: that event and everything after it (D's usage event,
    ``[DONE]``) are held back (:attr:`held`), the relay leaves the client's stream open, and
    :mod:`proxy.strategies.recompute` sends the next leg, whose events this class rewrites for the client
    (``leg`` > 0): the first leg's id, no second role event or prompt ids, usage summed over the legs
    (dropped where only the Router asked for it). An event split over chunks waits for its end.
    """

    __slots__ = (
        "inner",
        "progress",
        "leg",
        "client_usage",
        "parts",
        "tokens",
        "usage",
        "recomputed",
        "held",
        "held_open",
        "_pending",
        "_unread",
    )

    def __init__(
        self,
        inner: Any,
        progress: Progress,
        *,
        leg: int,
        client_usage: bool,
        text: str = "",
        tokens: int = 0,
    ) -> None:
        """``inner``: the path's own transform, applied first (or None). ``text``/``tokens``: what
        the client got of this leg before D's stream (the first-token path's token 1)."""
        self.inner = inner
        self.progress = progress
        self.leg = leg
        self.client_usage = client_usage
        #: The leg's text, in pieces (joined by :attr:`text`).
        self.parts = [text] if text else []
        self.tokens = tokens
        #: The leg's own completion tokens from D's usage event (after ``inner``), when it sent one.
        self.usage: int | None = None
        self.recomputed = False
        #: The events held back from the ``recomputed`` one on, as the client would get them.
        self.held = b""
        #: Set by the relay: D's stream ended after ``recomputed`` and the client's is still open.
        self.held_open = False
        self._pending = b""
        #: The first leg's events passed through without reading them (no ``recomputed`` in their bytes):
        #: parsing every event of every stream cost the Router ~10% of its throughput.
        self._unread: list[bytes] = []

    @property
    def text(self) -> str:
        return "".join(self.parts)

    @property
    def leg_tokens(self) -> int:
        return self.usage if self.usage is not None else self.tokens

    def __call__(self, chunk: bytes) -> bytes:
        if self.inner is not None:
            chunk = self.inner(chunk)
        if (
            self.leg == 0
            and not (self.recomputed or self._pending)
            and chunk.endswith(b"\n\n")
            and RECOMPUTED_BYTES not in chunk
        ):
            self._unread.append(chunk)  # whole events, none recomputed: read only if one comes (_catch_up)
            return chunk
        data = self._pending + chunk if self._pending else chunk
        end = data.rfind(b"\n\n")
        if end < 0:
            self._pending = data
            return b""
        self._pending = data[end + 2 :]
        out = []
        changed = data is not chunk or bool(self._pending)
        for event in data[: end + 2].split(b"\n\n")[:-1]:
            sent = self._event(event)
            if sent is not event:
                changed = True
            if sent is None:
                continue
            if self.recomputed:
                self.held += sent + b"\n\n"
                changed = True
            else:
                out.append(sent)
        if not changed:
            return chunk  # every event unchanged: no copy
        return b"".join(e + b"\n\n" for e in out)

    def _catch_up(self) -> None:
        """Note what the first leg's events passed through unread said (a ``recomputed`` event came)."""
        unread, self._unread = b"".join(self._unread), []
        for event in unread.split(b"\n\n")[:-1]:
            self._event(event, lazy=False)

    def _event(self, event: bytes, lazy: bool = True) -> bytes | None:
        """The event as the client gets it (None: dropped); notes what it says."""
        if not event.startswith(b"data: {"):
            return event  # [DONE], comments
        if lazy and self.leg == 0 and not self.recomputed:
            if RECOMPUTED_BYTES not in event:
                self._unread.append(event + b"\n\n")
                return event
            self._catch_up()
        try:
            parsed = _EVENT.decode(event[6:])
        except (msgspec.DecodeError, msgspec.ValidationError):
            return event
        if self.progress.id is None and parsed.id is not None:
            self.progress.id = parsed.id
        if parsed.usage is not None:
            self.usage = parsed.usage.completion_tokens
            if self.leg == 0 and self.progress.prompt_tokens is None:
                self.progress.prompt_tokens = parsed.usage.prompt_tokens
        if parsed.choices:
            choice = parsed.choices[0]
            if choice.stop_reason == RECOMPUTED and not self.recomputed:
                self.recomputed = True
            delta = choice.delta
            text = choice.text if delta is None else delta.content
            if text:
                self.parts.append(text)
            if choice.finish_reason is None and not (delta is not None and delta.role and not text):
                self.tokens += 1
        if self.leg == 0:
            return event
        return self._rewrite(event, parsed.usage is not None)

    def _rewrite(self, event: bytes, usage: bool) -> bytes | None:
        """A later leg's event for the client: one answer's id, role and prompt ids said once, usage
        over every leg."""
        payload = _DECODER.decode(event[6:])
        if usage:
            if not self.client_usage and not payload.get("choices"):
                return None  # the usage event only the Router asked for
            if not self.client_usage:
                payload.pop("usage", None)
            else:
                given = payload["usage"]
                prompt = self.progress.prompt_tokens
                prompt = given.get("prompt_tokens", 0) if prompt is None else prompt
                completion = self.progress.tokens + (self.usage or 0)
                payload["usage"] = {
                    **given,
                    "prompt_tokens": prompt,
                    "completion_tokens": completion,
                    "total_tokens": prompt + completion,
                }
        if self.progress.id is not None:
            payload["id"] = self.progress.id
        for choice in payload.get("choices") or ():
            if choice.get("prompt_token_ids") is not None:
                choice["prompt_token_ids"] = None
            delta = choice.get("delta")
            if isinstance(delta, dict) and "role" in delta:
                del delta["role"]
                if not delta.get("content") and choice.get("finish_reason") is None and len(delta) <= 1:
                    return None  # the opening role event: the client had it from the first leg
        return b"data: " + _ENCODER.encode(payload)
