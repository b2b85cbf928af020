"""Resuming a streamed chat completion: the chat side of :mod:`proxy.strategies.resume_body`. Pure code.

A cut ``/v1/chat/completions`` stream goes on through ``/v1/completions``: vLLM's chat stream names
the rendered prompt's token ids once (``prompt_token_ids`` on its first event, the role chunk, when
asked ``return_token_ids``) and each chunk's generated ids (``choices[].token_ids``), and without a
tool or reasoning parser a chunk's ``delta.content`` is exactly the text vLLM's detokenizer gives for
those ids, as a completions stream's ``text`` is (vLLM's ``chat_completion_stream_generator`` and
``completion_stream_generator``, 0.23 and 0.32 alike). So the resumed leg is a completions request
whose prompt is the chat prompt's ids plus the generated ids the client has (:func:`leg_body`: the
chat request's sampling fields, no chat template applied again), and each of its events reaches
the client re-shaped into a ``chat.completion.chunk`` (:func:`as_chat_chunk`): the first leg's
``id``/``created``/``model``, ``delta.content`` = the text, no second ``role``, the finish reason,
the usage event when asked. Greedy output is then token for token the uninterrupted chat's.

Not resumed (:func:`chat_ineligible_reason`, and what the first leg's events show:
:func:`delta_refusal`): a request with ``tools`` and a stream whose deltas carry ``reasoning`` or
``tool_calls``, or name token ids with no ``content`` (a tool or reasoning parser on the server): a parser's deltas are not the tokens'
text, and its state (inside a reasoning section, a half-parsed tool call) is not in a completions
leg; a parser that hides the token ids (reasoning not included) leaves the Router nothing to resume from.
"""

from __future__ import annotations

from typing import Any

#: Fields a chat request shares with a completions request, meaning the same there (sampling, stop
#: tokens, detokenization, scheduling, prefix-cache salt, usage): the resumed leg takes them as sent.
#: ``messages`` and the chat template's options are not needed (the leg's prompt is the rendered ids).
SHARED_FIELDS = (
    "model",
    "stream",
    "stream_options",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "repetition_penalty",
    "seed",
    "stop_token_ids",
    "ignore_eos",
    "min_tokens",
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "include_stop_str_in_output",
    "logit_bias",
    "allowed_token_ids",
    "priority",
    "cache_salt",
    "vllm_xargs",
    "return_token_ids",
    "user",
)
#: A chat chunk's text with bytes still held (empty, or ending in U+FFFD raw or escaped), as vLLM writes
#: ``delta`` (``content`` its last key without a parser).
HELD_CONTENT = (b'"content":""}', b'\xef\xbf\xbd"}', b'\\ufffd"}')
#: A delta key a tool or reasoning parser writes (never in JSON-escaped content: its quotes are escaped).
PARSER_MARKS = (b'"reasoning":', b'"reasoning_content":', b'"tool_calls":', b'"delta":{}')
_PARSER_KEYS = {"reasoning": "reasoning parser", "reasoning_content": "reasoning parser", "tool_calls": "tool calls"}


def chat_ineligible_reason(body: dict[str, Any]) -> str | None:
    """Why a chat request's stream cannot be resumed whatever its sampling (None: it may be)."""
    if body.get("tools"):
        return "tools"
    return None


def budget(body: dict[str, Any]) -> int | None:
    """The chat request's token budget (``max_completion_tokens``, else ``max_tokens``); None: none
    given (vLLM's is the model's context length less the prompt)."""
    for key in ("max_completion_tokens", "max_tokens"):
        value = body.get(key)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


def leg_body(body: dict[str, Any]) -> dict[str, Any]:
    """A completions request of the chat request ``body``'s sampling (its prompt and budget are the
    caller's to set)."""
    return {key: body[key] for key in SHARED_FIELDS if key in body}


def delta_refusal(delta: Any, steps: int) -> str | None:
    """What a chat chunk's ``delta`` (its chunk naming ``steps`` token ids) shows of a server-side
    parser (None: plain content). Without a parser vLLM writes ``content`` in every delta, the text
    of the chunk's tokens; a parser that holds a chunk's text (a ``<think>`` token, the start of a
    tool call) sends its ids with an empty delta."""
    if not isinstance(delta, dict):
        return "a chunk without a delta" if steps else None
    for key, reason in _PARSER_KEYS.items():
        if delta.get(key) not in (None, "", []):
            return reason
    if steps and "content" not in delta:
        return "a parser held a chunk's text"
    return None


def as_chat_chunk(payload: dict[str, Any]) -> dict[str, Any]:
    """A completions leg's event (``payload``, its ids and usage already the client's) as the chat
    chunk vLLM's chat stream would have sent: ``delta.content`` = the text, ``stop_reason`` with the
    finish reason, ``token_ids`` as the leg's event has them, ``usage`` when there is one."""
    choices = []
    for choice in payload.get("choices") or ():
        if not isinstance(choice, dict):
            continue
        finish = choice.get("finish_reason")
        out: dict[str, Any] = {
            "index": choice.get("index", 0),
            "delta": {"content": choice.get("text") or ""},
            "logprobs": None,
            "finish_reason": finish,
        }
        if finish is not None:
            out["stop_reason"] = choice.get("stop_reason")
        out["token_ids"] = choice.get("token_ids")
        choices.append(out)
    chunk: dict[str, Any] = {
        "id": payload.get("id"),
        "object": "chat.completion.chunk",
        "created": payload.get("created"),
        "model": payload.get("model"),
        "choices": choices,
    }
    if payload.get("usage") is not None:
        chunk["usage"] = payload["usage"]
    return chunk
