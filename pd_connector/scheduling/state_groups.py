"""Recurrent-state models (Mamba2, gated delta net): the scheduler's part (pd_connector.layouts.state_groups).

P prefills all prompt tokens but the last and says so in its answer; D takes those tokens' KV and the
state after them from P (one state block per state group) and computes the last prompt token itself.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from pd_connector.kv_params import DecodeParams, PrefillParams
from pd_connector.layouts.state_groups import (
    PREFILL_WITHOUT_LAST_TOKEN,
    fill_state_groups,
    prefilled_for_state,
    truncate_for_prefill,
)
from pd_connector.scheduling.extension import Finish, Params, SchedulerExtension

if TYPE_CHECKING:
    from vllm.v1.request import Request

logger = logging.getLogger(__name__)


class PrefillStateExtension(SchedulerExtension):
    """Chosen on P when the model has recurrent-state KV cache groups."""

    def __init__(self) -> None:
        self._truncated: set[str] = set()  # requests prefilled without their last prompt token

    def arrived(self, request: Request, params: Params) -> None:
        """A prefill for D loses its last prompt token (``truncate_for_prefill``): D computes that one."""
        rid = request.request_id
        if not isinstance(params, PrefillParams) or rid in self._truncated or not truncate_for_prefill(request):
            return
        self._truncated.add(rid)
        logger.info(
            "room=%s req=%s: recurrent-state model: prefilling %d of %d prompt tokens, decode computes the last",
            params.room,
            rid,
            request.num_prompt_tokens,
            request.num_prompt_tokens + 1,
        )

    def finished(
        self, request: Request, params: Params, groups: list[list[int]], kv_pending: bool, answer: Finish
    ) -> Finish | None:
        """A truncated prefill's handoff says so: its sampled token is not the answer's first."""
        rid = request.request_id
        if rid not in self._truncated:
            return None
        self._truncated.discard(rid)
        held, handoff = answer
        if not held or handoff is None:
            return None
        return True, {**handoff, PREFILL_WITHOUT_LAST_TOKEN: True}


class DecodeStateExtension(SchedulerExtension):
    """Chosen on D when the model has recurrent-state KV cache groups (``block_sizes``: group -> its tokens
    per block)."""

    def __init__(self, block_sizes: Mapping[int, int]) -> None:
        self.block_sizes = dict(block_sizes)

    def prefilled(self, request: Request, params: DecodeParams, tokens: int | None) -> int | None:
        """All prompt tokens but the last; None (prefilled here) for a one-token prompt or a prompt with
        P's first token appended (``prefilled_for_state``)."""
        return prefilled_for_state(request.num_prompt_tokens, params.prefilled_tokens)

    def load_blocks(
        self,
        request: Request,
        params: DecodeParams,
        tables: Sequence[Sequence[int]],
        groups: list[list[int]],
        covered: int,
        start_block: int,
    ) -> list[list[int]]:
        """Each state group's one state block (``fill_state_groups``)."""
        missing = fill_state_groups(groups, tables, self.block_sizes, covered, start_block)
        if missing:  # vLLM gave no block where the state goes: nothing of it can be loaded
            logger.error(
                "room=%d req=%s: recurrent-state KV cache groups %s hold no block for the state after %d tokens: %s",
                params.room,
                request.request_id,
                missing,
                covered,
                [list(tables[g]) for g in missing],
            )
        return groups
