"""Request bodies: validation of the client's, and the ones the Router sends to P and D.

Pure functions over the client's parsed JSON body; nothing here does I/O.
"""

from __future__ import annotations

import random
from collections.abc import Collection
from typing import Any

from pd_connector.kv_params import KV_PARAMS_KEY as KV_KEY
from pd_connector.kv_params import MAX_ROOM, MAX_SAMPLES, PREFILL_DP_RANK, DecodeParams, PrefillParams
from pd_connector.kv_params import ROOM as ROOM_KEY
from proxy.errors import INVALID_REQUEST, RouterError
from proxy.router_config import Backend

COMPLETIONS = "/v1/completions"
CHAT_COMPLETIONS = "/v1/chat/completions"
#: Characters per token of the cheap prompt-size estimate used by least-loaded routing.
CHARS_PER_TOKEN = 4
#: Integer fields checked by the Router (vLLM checks the rest and answers 400 itself).
_INT_FIELDS = ("max_tokens", "max_completion_tokens", "min_tokens", "n")


def _invalid(message: str, param: str | None = None) -> RouterError:
    return RouterError(400, message, INVALID_REQUEST, param)


def _is_int(value: Any) -> bool:
    # bool is a subclass of int: reject it explicitly.
    return isinstance(value, int) and not isinstance(value, bool)


def _check_room(value: Any, where: str) -> int:
    if not _is_int(value) or not 0 <= value < MAX_ROOM:
        raise _invalid(f"{where} must be an integer in [0, 2**63), got {value!r}", where)
    return value


def _type_name(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def validate_body(body: Any, endpoint: str) -> dict[str, Any]:
    """Check the fields the Router relies on; raise :class:`RouterError` (400) naming the bad one.

    The Router reads ``stream``, the prompt (``prompt`` or ``messages``, for its size estimate)
    and the bootstrap room; it also checks the token-count fields' types. Everything else is
    left to vLLM, whose 4xx answers are passed through to the client.
    """
    if not isinstance(body, dict):
        raise _invalid(f"request body must be a JSON object, got {_type_name(body)}")
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise _invalid(f"'stream' must be a boolean, got {_type_name(stream)}", "stream")
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise _invalid(f"'stream_options' must be an object, got {_type_name(options)}", "stream_options")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise _invalid(f"'model' must be a string, got {_type_name(model)}", "model")
    for key in _INT_FIELDS:
        value = body.get(key)
        if value is not None and not _is_int(value):
            raise _invalid(f"'{key}' must be an integer, got {_type_name(value)}", key)
    if endpoint == CHAT_COMPLETIONS:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise _invalid("'messages' must be a non-empty array of message objects", "messages")
        if not all(isinstance(m, dict) for m in messages):
            raise _invalid("every item of 'messages' must be an object", "messages")
    else:
        prompt = body.get("prompt")
        if prompt is None:
            if body.get("prompt_embeds") is None:
                raise _invalid("'prompt' is required", "prompt")
        elif not _valid_prompt(prompt):
            raise _invalid(
                "'prompt' must be a string, an array of strings, an array of token ids or an array of "
                f"token-id arrays, got {_type_name(prompt)}",
                "prompt",
            )
        elif (count := batch_size(prompt)) > 1:
            # vLLM runs each prompt of a batch as its own request, all with the one kv_transfer_params:
            # they would share one bootstrap room (one prompt's KV named for all).
            raise _invalid(
                f"'prompt' holds a batch of {count} prompts; the Router takes one prompt per request "
                "(send one request per prompt)",
                "prompt",
            )
    kv = body.get(KV_KEY)
    if kv is not None and not isinstance(kv, dict):
        raise _invalid(f"'{KV_KEY}' must be an object", KV_KEY)
    return body


def batch_size(prompt: Any) -> int:
    """How many prompts a valid ``prompt`` holds (an array of strings or of token-id arrays is a batch)."""
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        return len(prompt)
    return 1


def check_prefill_dp_rank(body: dict[str, Any], ranks: Collection[int | None]) -> None:
    """A client's ``kv_transfer_params.prefill_dp_rank`` must be possible: an integer >= 0 and, where the
    prefillers' DP ranks are configured (``ranks``), one of them; else :class:`RouterError` (400) naming it.

    The Router picks P itself and sends D that P's rank, so a possible value changes nothing.
    """
    kv = body.get(KV_KEY)
    if not isinstance(kv, dict) or kv.get(PREFILL_DP_RANK) is None:
        return
    where = f"{KV_KEY}.{PREFILL_DP_RANK}"
    value = kv[PREFILL_DP_RANK]
    if not _is_int(value) or value < 0:
        raise _invalid(f"{where} must be an integer >= 0, got {value!r}", where)
    known = sorted({r for r in ranks if r is not None})
    if known and value not in known:
        raise _invalid(f"{where} is {value}, but no prefiller has that DP rank (configured: {known})", where)


def _valid_prompt(prompt: Any) -> bool:
    if isinstance(prompt, str):
        return True
    if not isinstance(prompt, list) or not prompt:
        return False
    first = prompt[0]
    if isinstance(first, str):
        return all(isinstance(p, str) for p in prompt)
    if _is_int(first):
        return all(_is_int(p) for p in prompt)
    if isinstance(first, list):
        return all(isinstance(p, list) and all(_is_int(t) for t in p) for p in prompt)
    return False


def estimate_prompt_tokens(body: dict[str, Any]) -> int:
    """A cheap estimate of the prompt's size in tokens, for least-loaded prefill routing.

    Token-id prompts count exactly; text counts one token per :data:`CHARS_PER_TOKEN`
    characters (completions ``prompt``; chat: every message's text content). At least 1.
    """
    chars = 0
    tokens = 0
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        chars = len(prompt)
    elif isinstance(prompt, list):
        for item in prompt:
            if isinstance(item, str):
                chars += len(item)
            elif isinstance(item, list):
                tokens += len(item)
            else:
                tokens += 1
    messages = body.get("messages")
    if isinstance(messages, list):
        for message in messages:
            content = message.get("content") if isinstance(message, dict) else None
            if isinstance(content, str):
                chars += len(content)
            elif isinstance(content, list):
                for part in content:
                    text = part.get("text") if isinstance(part, dict) else None
                    if isinstance(text, str):
                        chars += len(text)
    return max(1, tokens + (chars + CHARS_PER_TOKEN - 1) // CHARS_PER_TOKEN)


def resolve_room(body: dict[str, Any], rng: random.Random | None = None, *, trust_client: bool = True) -> int:
    """Return the request's bootstrap room.

    The client may give one (for idempotent retries and tracing) as a top-level
    ``bootstrap_room`` or as ``kv_transfer_params.bootstrap_room``; it is used only when
    ``trust_client`` (``--trust-client-room``), else a random 63-bit one is drawn. Raises
    :class:`RouterError` (400) when a given value is invalid (checked either way).
    """
    kv = body.get(KV_KEY)
    if kv is not None and not isinstance(kv, dict):
        raise _invalid(f"{KV_KEY} must be an object", KV_KEY)
    top = _check_room(body[ROOM_KEY], ROOM_KEY) if body.get(ROOM_KEY) is not None else None
    nested = None
    if kv is not None and kv.get(ROOM_KEY) is not None:
        nested = _check_room(kv[ROOM_KEY], f"{KV_KEY}.{ROOM_KEY}")
    if top is not None and nested is not None and top != nested:
        raise _invalid(f"{ROOM_KEY} ({top}) and {KV_KEY}.{ROOM_KEY} ({nested}) differ", ROOM_KEY)
    if trust_client and top is not None:
        return top
    if trust_client and nested is not None:
        return nested
    return new_room(rng)


def new_room(rng: random.Random | None = None) -> int:
    """A random 63-bit bootstrap room."""
    return (rng or random).getrandbits(63)


def prefill_body(body: dict[str, Any], room: int) -> dict[str, Any]:
    """Body for P: compute the prompt's KV cache, generate one token, hand the KV to D.

    ``stream`` is off, the token budget is one (``ignore_eos`` so that token is never an
    EOS stop), and ``kv_transfer_params`` marks the request as feeding a remote decode.
    """
    out = dict(body)  # shallow: only top-level keys are replaced
    out.pop(ROOM_KEY, None)
    out["stream"] = False
    out.pop("stream_options", None)
    out["max_tokens"] = 1
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    out.pop("min_tokens", None)
    out["ignore_eos"] = True
    # vLLM runs n samples as n requests sharing the room: P prefills once (no n, no best_of) and
    # serves the room to each of D's n requests.
    n = out.pop("n", None)
    out.pop("best_of", None)
    samples = n if _is_int(n) and 1 <= n <= MAX_SAMPLES else 1
    out[KV_KEY] = PrefillParams(room, samples).to_json()
    return out


def local_body(body: dict[str, Any]) -> dict[str, Any]:
    """Body for D prefilling the request itself (``--path-policy``): the client's request as an ordinary
    vLLM request, without the Router's room and without ``kv_transfer_params``."""
    out = dict(body)  # shallow: only top-level keys are removed
    out.pop(ROOM_KEY, None)
    out.pop(KV_KEY, None)
    return out


def decode_body(
    body: dict[str, Any],
    room: int,
    prefiller: Backend,
    prefilled_tokens: int | None = None,
    migrate_room: int | None = None,
) -> dict[str, Any]:
    """Body for D: the client's request, plus where to get the KV cache from (``prefiller``).

    ``prefilled_tokens``: P holds the KV of only the prompt's first that many tokens (the
    first-token path's continuation, a stream moved with its KV); None: of the whole prompt.
    ``prefiller`` may be a drained decoder (:mod:`proxy.strategies.kv_move`): its own bootstrap server, DP rank
    0. ``migrate_room``: D is movable by KV; if the request is aborted there, D holds its KV as this
    room for a while (a drain's move loads it from there).
    """
    out = dict(body)  # shallow: only top-level keys are replaced
    out.pop(ROOM_KEY, None)
    host, port = prefiller.bootstrap_address
    rank = prefiller.dp_rank if prefiller.role == "prefill" else 0
    out[KV_KEY] = DecodeParams(room, host, port, rank, prefilled_tokens, migrate_room).to_json()
    return out
