"""The scheduler core's per-request decisions, pure (no I/O, no state): a request's parameters, the
prompt tokens whose KV P holds, and why D loads nothing from P for a request."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

from pd_connector.bypass import BypassReason
from pd_connector.kv_params import DecodeParams, KVParamsError, PrefillParams, new_room, parse_kv_params
from pd_connector.layouts.kv_groups import replay_needs_freed_block

if TYPE_CHECKING:
    from vllm.v1.request import Request

logger = logging.getLogger(__name__)


def params_of(request: Request) -> PrefillParams | DecodeParams | None:
    """Parsed kv_transfer_params; malformed ones are logged and ignored (served locally).

    A P request that names no room (P-then-D proxies) gets a fresh one here; P's answer tells D.
    """
    try:
        params = parse_kv_params(request.kv_transfer_params, room_optional=True)
    except KVParamsError as exc:
        logger.error("req=%s: ignoring malformed kv_transfer_params: %s", request.request_id, exc)
        return None
    if isinstance(params, PrefillParams) and params.room is None:
        params = PrefillParams(room=new_room(), samples=params.samples)
        logger.info(
            "room=%d req=%s: the request named no bootstrap_room; prefill picked one", params.room, request.request_id
        )
    return params


def prefilled_tokens(request: Request, params: DecodeParams) -> int:
    """Prompt tokens of a D request whose KV P holds: all, or ``prefilled_tokens`` when the Router
    appended P's first token to the prompt (never more than the prompt)."""
    if params.prefilled_tokens is None:
        return request.num_prompt_tokens
    return min(params.prefilled_tokens, request.num_prompt_tokens)


def no_load_reason(
    request: Request,
    params: DecodeParams,
    covered: int | None,
    computed: int,
    sliding_windows: Sequence[int],
    block_size: int,
) -> BypassReason | None:
    """D: why nothing is loaded from P for this request (logged), or None when its load goes ahead.

    ``covered``: the prompt tokens whose KV P holds (None: a recurrent-state prompt prefilled here);
    ``computed``: D's local prefix cache hit; ``sliding_windows``: the KV cache groups' windows.
    """
    rid, room, prompt = request.request_id, params.room, request.num_prompt_tokens
    if covered is None:  # recurrent state: a one-token prompt, or P's first token appended
        appended = " with prefill's first token appended" if params.prefilled_tokens is not None else ""
        logger.info(
            "room=%d req=%s: recurrent-state model, %d prompt tokens%s: prefilled here; prefill told to free "
            "the room",
            room, rid, prompt, appended,
        )  # fmt: skip
        return BypassReason.STATE_RECOMPUTE
    if covered - computed <= 0:
        # D's own prefix cache holds all P prefilled (a continuation of the first-token path can
        # end on a block boundary): no load, vLLM must not see finished_recving; P frees the room.
        logger.info(
            "room=%d req=%s: all %d prefilled tokens are in D's prefix cache; prefill told to free the room",
            room, rid, covered,
        )  # fmt: skip
        return BypassReason.PREFIX_CACHED
    # Only a load of the whole prompt makes vLLM recompute its last token (which a window may
    # not reach); with P's first token appended, D computes that token itself.
    if covered != prompt:
        return None
    window = replay_needs_freed_block(covered, sliding_windows, block_size)
    if window is None:
        return None
    logger.info(
        "room=%d req=%s: %d prompt tokens end where the %d-token window opens a block: vLLM's recompute "
        "of the last token would read a freed block, so this prompt is prefilled here",
        room, rid, prompt, window,
    )  # fmt: skip
    return BypassReason.WINDOW_RECOMPUTE
