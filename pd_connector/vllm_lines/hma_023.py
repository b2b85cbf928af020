"""vLLM 0.23 (vLLM-Ascend 0.23's line): failed KV loads of hybrid models, so PDConnector is ``SupportsHMA`` there.

vLLM 0.23 reports a connector's failed loads only by block id (``get_block_ids_with_load_errors``);
its scheduler then walks every waiting-for-KV and running request in
``Scheduler._update_requests_with_invalid_blocks``, which unpacks *one* block table per request
(``(req_block_ids,) = get_block_ids(...)``). With the hybrid KV cache manager on (a sliding-window or
compressed-cache model: several KV cache groups) the first failed load would raise there and take
the engine down. vLLM 0.32 reports failed loads by request id instead and never reaches that path.

``install`` replaces that one method, on the 0.23 line only, with a multi-group reading of the same
rule: a request's computed tokens are cut at the first block index that holds an invalid block in
*any* group (all groups share one block size: ``kv_groups.check_group_block_sizes``; the null
block of a window group is never reported invalid), and the blocks to evict are every group's blocks
from that index on. With one group it does exactly what vLLM 0.23 does. The recompute or fail
policy (``kv_load_failure_policy``) and everything around it stay vLLM's.

It is installed by the scheduler-side connector (EngineCore process) when vLLM has no
``KVConnectorTransferResults`` and the KV cache config has more than one group; a Scheduler whose
method is not the single-table one it expects (a later 0.23.x, a subclass that overrides it) is left
alone, and the connector then refuses the hybrid manager with a message naming the flag.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Iterable
from typing import Any

logger = logging.getLogger(__name__)

#: The line of vLLM 0.23's method that reads a single KV cache group's block table.
SINGLE_TABLE = "(req_block_ids,) = self.kv_cache_manager.get_block_ids(req_id)"
METHOD = "_update_requests_with_invalid_blocks"
_MARK = "__pd_connector_multi_group__"
#: The methods ``install`` replaced, by class (kept for tests that compare against vLLM's own).
REPLACED: dict[type, Any] = {}


def invalid_by_index(tables: tuple[list[int], ...], num_blocks: int, invalid: set[int]) -> dict[int, set[int]]:
    """{block index below ``num_blocks``: the invalid blocks at that index, over every group's table}."""
    found: dict[int, set[int]] = {}
    for table in tables:
        for idx, block_id in zip(range(num_blocks), table, strict=False):
            if block_id in invalid:
                found.setdefault(idx, set()).add(block_id)
    return found


def update_requests_with_invalid_blocks(
    self: Any,
    requests: Iterable[Any],
    invalid_block_ids: set[int],
    num_scheduled_tokens: dict[str, int],
    evict_blocks: bool = True,
) -> tuple[set[str], int, set[int]]:
    """vLLM 0.23's ``Scheduler._update_requests_with_invalid_blocks``, reading every KV cache group's table.

    Same contract and rule: returns (affected request ids, tokens to recompute, block ids to evict);
    an affected request's ``num_computed_tokens`` is cut at the first block index holding an invalid
    block that no earlier request of this call already marked for recompute; a request all of whose
    invalid blocks were marked keeps its computed prefix (the earlier one recomputes them).
    """
    affected: set[str] = set()
    total_tokens = 0
    to_evict: set[int] = set()
    marked: set[int] = set()  # invalid blocks an earlier request of this call recomputes
    block_size = self.block_size
    for request in requests:
        req_id = request.request_id
        tables = self.kv_cache_manager.get_block_ids(req_id)
        computed = request.num_computed_tokens - num_scheduled_tokens.get(req_id, 0)
        bad = invalid_by_index(tables, (computed + block_size - 1) // block_size, invalid_block_ids)
        if not bad:
            continue
        affected.add(req_id)
        cut = next((idx for idx in sorted(bad) if not bad[idx] <= marked), None)
        for blocks in bad.values():
            marked |= blocks
        if cut is None:
            total_tokens += request.num_computed_tokens - computed
            request.num_computed_tokens = computed
            continue
        request.num_computed_tokens = cut * block_size
        total_tokens += computed - request.num_computed_tokens
        if evict_blocks:
            for table in tables:
                to_evict.update(b for b in table[cut:] if b)  # 0: the null block of a window group
    return affected, total_tokens, to_evict


def needs_install(scheduler_cls: type) -> bool:
    """True when ``scheduler_cls`` has vLLM 0.23's single-table method (not yet replaced)."""
    method = getattr(scheduler_cls, METHOD, None)
    if method is None or getattr(method, _MARK, False):
        return False
    try:
        return SINGLE_TABLE in inspect.getsource(method)
    except (OSError, TypeError):
        return False


def install(scheduler_cls: type | None = None) -> bool:
    """Replace vLLM 0.23's single-table method on ``scheduler_cls`` (default: vLLM's Scheduler).

    True when the multi-group method is in place afterwards (installed now or before), False when
    the class does not have the method this module knows (then nothing is changed).
    """
    if scheduler_cls is None:
        from vllm.v1.core.sched.scheduler import Scheduler

        scheduler_cls = Scheduler
    current = getattr(scheduler_cls, METHOD, None)
    if current is not None and getattr(current, _MARK, False):
        return True
    if not needs_install(scheduler_cls):
        return False
    setattr(update_requests_with_invalid_blocks, _MARK, True)
    REPLACED[scheduler_cls] = current
    setattr(scheduler_cls, METHOD, update_requests_with_invalid_blocks)
    logger.info(
        "vLLM 0.23: %s.%s reads every KV cache group's block table (failed loads of hybrid models)",
        scheduler_cls.__name__,
        METHOD,
    )
    return True
