"""The first-token path's bodies and events: pure functions, no I/O (:mod:`proxy.strategies.first_token` runs it).

A streamed ``/v1/completions`` request whose sampling allows it gets P's own first token at once:
P prefills the prompt and samples token 1 (``max_tokens`` 1, ``return_token_ids`` so the Router
learns the prompt's token ids and token 1's id), the Router streams that token to the client, and
D gets a *continuation*: P's prompt token ids plus token 1, one token fewer to generate, and
``kv_transfer_params.prefilled_tokens`` = the prompt's length (P holds the KV of exactly those
tokens; D computes token 1's own KV and samples token 2 from it). The client sees one stream: P's
chunk, then D's chunks (usage figures corrected for the token that moved into D's prompt).

Eligible are only requests whose continuation samples exactly what one instance would have:
one prompt, one sample, no echo, no logprobs, no stop strings (one could span tokens 1 and 2),
no frequency/presence penalty (they count output tokens, and token 1 is D's prompt), no seed
with sampling (a seeded run is reproducible on one instance only), no structured output.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

import msgspec

from pd_connector.accounting import ACCOUNT_KEY, RecomputeReason
from pd_connector.kv_params import KV_PARAMS_KEY as KV_KEY
from pd_connector.kv_params import PREFILL_WITHOUT_LAST_TOKEN, PrefillParams
from pd_connector.kv_params import ROOM as ROOM_KEY
from proxy.request.payloads import COMPLETIONS

#: Request fields whose presence (non-null, non-empty) keeps a request on the two-instance path.
_BLOCKING_FIELDS = (
    "echo",
    "logprobs",
    "prompt_logprobs",
    "suffix",
    "prompt_embeds",
    "bad_words",
    "response_format",
    "structured_outputs",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
    "guided_whitespace_pattern",
    "return_tokens_as_token_ids",
    "best_of",
    "use_beam_search",
)


class FirstTokenFrom(enum.Enum):
    """Who answered the client's first token (the request's log line says ``first=``)."""

    DECODE = "D"
    PREFILL = "P"  # the first-token path: P's own token, D's from the second on
    #: P's token 1 had no text yet (the first bytes of a character): P's empty chunk, then D's
    #: answer to the client's own request, its repeat of that chunk dropped.
    PREFILL_EMPTY = "P-empty"


_ENCODER = msgspec.json.Encoder()
_DECODER = msgspec.json.Decoder()


def _zero(value: Any) -> bool:
    return value is None or (isinstance(value, (int, float)) and not isinstance(value, bool) and value == 0)


def single_prompt(prompt: Any) -> bool:
    """``prompt`` is one prompt: a string or one array of token ids."""
    return isinstance(prompt, str) or (
        isinstance(prompt, list)
        and bool(prompt)
        and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
    )


def seeded_sampling(body: dict[str, Any]) -> bool:
    """``body`` samples (temperature not 0) from a seed of its own."""
    return body.get("seed") is not None and not _zero(body.get("temperature", 1.0))


def ineligible_reason(endpoint: str, body: dict[str, Any]) -> str | None:
    """Why ``body`` (the client's, validated) cannot take the first-token path; None when it can."""
    if endpoint != COMPLETIONS:
        return "not /v1/completions"
    if body.get("stream") is not True:
        return "not streamed"
    if not single_prompt(body.get("prompt")):
        return "not a single prompt"
    reason = continuation_ineligible_reason(body)
    if reason is None and seeded_sampling(body):
        return "seeded sampling"  # P's token 1 and D's token 2 would each start the seed's generator
    return reason


def continuation_ineligible_reason(body: dict[str, Any]) -> str | None:
    """Why a continuation of ``body``'s streamed answer on another instance (its prompt's token ids
    plus the tokens generated so far as the prompt, the rest of the budget) would not sample what one
    instance would; None when it would. Shared by the first-token path (:func:`ineligible_reason`) and
    resumed streams (:func:`proxy.strategies.resume_body.resume_ineligible_reason`)."""
    if body.get("stream") is not True:
        return "not streamed"
    if body.get("n") not in (None, 1):
        return "n > 1"
    for key in _BLOCKING_FIELDS:
        value = body.get(key)
        if value is None or value is False or value == [] or value == {} or (key == "best_of" and value == 1):
            continue
        return key
    if body.get("stop") not in (None, "", []):
        return "stop strings"
    if not (_zero(body.get("frequency_penalty")) and _zero(body.get("presence_penalty"))):
        return "frequency/presence penalty"
    options = body.get("stream_options")
    if isinstance(options, dict) and options.get("continuous_usage_stats"):
        return "continuous_usage_stats"
    for key in ("max_tokens", "max_completion_tokens"):
        limit = body.get(key)
        if isinstance(limit, int) and limit < 1:
            return f"{key} < 1"
    return None


def prefill_first_body(body: dict[str, Any], room: int) -> dict[str, Any]:
    """Body for P: prefill, sample the first token as one instance would, keep the KV for D.

    Unlike the two-instance path's P body, EOS and ``min_tokens`` keep their meaning (P's token
    may be the whole answer); ``return_token_ids`` gives the Router the ids D continues from.
    """
    out = dict(body)
    out.pop(ROOM_KEY, None)
    out["stream"] = False
    out.pop("stream_options", None)
    out["max_tokens"] = 1
    min_tokens = out.get("min_tokens")
    if isinstance(min_tokens, int) and min_tokens > 1:
        out["min_tokens"] = 1
    out["return_token_ids"] = True
    out[KV_KEY] = PrefillParams(room).to_json()
    return out


@dataclass(frozen=True, slots=True)
class FirstToken:
    """P's answer on the first-token path: token 1 and what the Router needs to continue."""

    id: str
    created: int
    model: str
    text: str
    token_id: int
    prompt_token_ids: list[int]
    #: ``length`` when D continues; ``stop`` (EOS or a stop token): token 1 is the whole answer.
    finish_reason: str | None
    stop_reason: int | str | None
    usage: dict[str, Any] | None


def parse_first_token(content: bytes) -> FirstToken | None:
    """P's JSON answer as a :class:`FirstToken`; None when it lacks the token ids, or when P prefilled all
    prompt tokens but the last (a recurrent-state model: its token is not the answer's first); then D
    decodes from the prompt, as on the two-instance path."""
    try:
        answer = _DECODER.decode(content)
        params = answer.get(KV_KEY)
        if isinstance(params, dict) and params.get(PREFILL_WITHOUT_LAST_TOKEN) is True:
            return None
        choice = answer["choices"][0]
        token_ids = choice.get("token_ids")
        prompt_ids = choice.get("prompt_token_ids")
        if not (isinstance(token_ids, list) and len(token_ids) == 1 and isinstance(prompt_ids, list) and prompt_ids):
            return None
        if not all(isinstance(t, int) for t in prompt_ids) or not isinstance(token_ids[0], int):
            return None
        return FirstToken(
            id=str(answer.get("id") or ""),
            created=int(answer.get("created") or 0),
            model=str(answer.get("model") or ""),
            text=str(choice.get("text") or ""),
            token_id=token_ids[0],
            prompt_token_ids=prompt_ids,
            finish_reason=choice.get("finish_reason"),
            stop_reason=choice.get("stop_reason"),
            usage=answer.get("usage") if isinstance(answer.get("usage"), dict) else None,
        )
    except (msgspec.DecodeError, KeyError, IndexError, TypeError, ValueError, AttributeError):
        return None


def is_whole_answer(first: FirstToken, body: dict[str, Any]) -> bool:
    """Token 1 ends the answer: P stopped (EOS, stop token) or the client asked for one token."""
    return first.finish_reason != "length" or body.get("max_tokens") == 1


def text_may_be_partial(text: str) -> bool:
    """P's text of token 1 may end in an incomplete UTF-8 sequence: vLLM's detokenizers hold such
    bytes back (empty text) and never return text ending in U+FFFD while more bytes may complete it.

    U+FFFD *inside* the text is final (bytes no later byte can complete, e.g. a random prompt's own
    bytes that vLLM re-emits with token 1 when the prompt ends inside a character); D's decode stream,
    primed with the prompt and token 1, then continues exactly as one instance's would (checked
    against ``tokenizers.decoders.DecodeStream`` over random byte prompts)."""
    return not text or text.endswith("\ufffd")


def continuation_body(body: dict[str, Any], first: FirstToken) -> dict[str, Any]:
    """D's request (without ``kv_transfer_params``): P's prompt ids plus token 1, one token fewer."""
    out = dict(body)
    out.pop(ROOM_KEY, None)
    out.pop(KV_KEY, None)
    out.pop("truncate_prompt_tokens", None)  # P truncated already; D must keep every id
    out["prompt"] = [*first.prompt_token_ids, first.token_id]
    max_tokens = out.get("max_tokens")
    if isinstance(max_tokens, int):
        out["max_tokens"] = max_tokens - 1
    min_tokens = out.get("min_tokens")
    if isinstance(min_tokens, int) and min_tokens > 0:
        out["min_tokens"] = min_tokens - 1
    return out


def include_usage(body: dict[str, Any]) -> bool:
    options = body.get("stream_options")
    return isinstance(options, dict) and options.get("include_usage") is True


def _event(payload: dict[str, Any]) -> bytes:
    return b"data: " + _ENCODER.encode(payload) + b"\n\n"


def first_chunk(first: FirstToken, *, final: bool, token_ids: bool = False) -> bytes:
    """The SSE event carrying token 1 (with P's finish reason when it is the whole answer);
    ``token_ids``: the client asked for ``return_token_ids`` (the prompt's ids come here)."""
    choice: dict[str, Any] = {
        "index": 0,
        "text": first.text,
        "logprobs": None,
        "finish_reason": first.finish_reason if final else None,
        "stop_reason": first.stop_reason if final else None,
    }
    if token_ids:
        choice["prompt_token_ids"] = first.prompt_token_ids
        choice["token_ids"] = [first.token_id]
    return _event(
        {
            "id": first.id,
            "object": "text_completion",
            "created": first.created,
            "model": first.model,
            "choices": [choice],
        }
    )


def final_events(first: FirstToken, usage: bool) -> bytes:
    """What ends a stream whose whole answer was token 1: the usage event (when asked), ``[DONE]``."""
    out = b""
    if usage and first.usage is not None:
        payload = {"id": first.id, "object": "text_completion", "created": first.created, "model": first.model}
        out = _event({**payload, "choices": [], "usage": first.usage})
    return out + b"data: [DONE]\n\n"


def wants_token_ids(body: dict[str, Any]) -> bool:
    return body.get("return_token_ids") is True


class ContinuationFix:
    """Rewrites D's events for the client: token 1 was D's prompt, the client counts it as generated.

    ``usage``: the usage event's counts move one token from prompt to completion, and D's KV account
    (``usage.pd_kv``, pd_connector.accounting) no longer counts token 1 as a prompt token D computed
    (``prefilled_part``: P's KV covered all but that token). ``token_ids``:
    D's first event names D's prompt ids (the client's prompt plus token 1); the client had its
    prompt's ids with token 1, so they are dropped (``null``, as on vLLM's later events).
    """

    __slots__ = ("usage", "prompt_ids")

    def __init__(self, usage: bool, token_ids: bool = False) -> None:
        self.usage = usage
        self.prompt_ids = token_ids

    def __call__(self, chunk: bytes) -> bytes:
        usage = self.usage and b'"prompt_tokens"' in chunk
        prompt_ids = self.prompt_ids and b'"prompt_token_ids":[' in chunk
        if not (usage or prompt_ids):
            return chunk
        events = chunk.split(b"\n\n")
        for i, event in enumerate(events):
            if not event.startswith(b"data: {"):
                continue
            try:
                payload = _DECODER.decode(event[6:])
                changed = False
                if usage and isinstance(payload.get("usage"), dict):
                    payload["usage"]["prompt_tokens"] -= 1
                    payload["usage"]["completion_tokens"] += 1
                    _uncount_token_1(payload["usage"].get(ACCOUNT_KEY))
                    changed = True
                for choice in payload.get("choices") or () if prompt_ids else ():
                    if choice.get("prompt_token_ids") is not None:
                        choice["prompt_token_ids"] = None
                        changed = True
            except (msgspec.DecodeError, KeyError, TypeError, AttributeError):
                continue
            if changed:
                events[i] = b"data: " + _ENCODER.encode(payload)
        return b"\n\n".join(events)


def _uncount_token_1(account: Any) -> None:
    """D's KV account without token 1, which D computed as the last token of its prompt."""
    if not isinstance(account, dict):
        return
    recomputed = account.get("recomputed_tokens")
    if isinstance(recomputed, int) and recomputed > 0:
        account["recomputed_tokens"] = recomputed - 1
        if recomputed == 1 and account.get("recompute_reason") == RecomputeReason.PREFILLED_PART.value:
            account["recompute_reason"] = RecomputeReason.NONE.value


class DropRepeatedFirst:
    """Drops D's first event when it repeats the empty token 1 the client already has from P.

    Used where P's token 1 had no text yet (the first bytes of a character): the client gets P's
    empty chunk at once and D answers the client's own request from P's KV, so D's own first token
    (P's token 1 again under greedy sampling) comes a second time. Dropped only while it is empty
    and unfinished; anything else (a different sample with text, a finish reason) goes through.
    """

    __slots__ = ("pending", "done")

    #: A first event longer than this is passed on without looking at it.
    LIMIT = 1 << 16

    def __init__(self) -> None:
        self.pending = b""
        self.done = False

    def __call__(self, chunk: bytes) -> bytes:
        if self.done:
            return chunk
        self.pending += chunk
        head, sep, rest = self.pending.partition(b"\n\n")
        if not sep:
            if len(self.pending) <= self.LIMIT:
                return b""  # the first event is not whole yet
            self.done = True
            return self.pending
        self.done = True
        self.pending = b""
        return rest if _is_empty_token(head) else head + sep + rest


def _is_empty_token(event: bytes) -> bool:
    if not event.startswith(b"data: {"):
        return False
    try:
        choices = _DECODER.decode(event[6:]).get("choices")
    except (msgspec.DecodeError, AttributeError):
        return False
    if not isinstance(choices, list) or len(choices) != 1 or not isinstance(choices[0], dict):
        return False
    choice = choices[0]
    return choice.get("text") == "" and choice.get("finish_reason") is None
