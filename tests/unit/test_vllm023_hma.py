"""pd_connector.vllm_lines.hma_023: vLLM 0.23's failed-load scan over every KV cache group's block table.

One group: the same results as vLLM's own method (compared on random cases, on whichever vLLM line
runs the test; both read one table there). Two groups: the cut is the first block index that holds an
invalid block in any group; the null block of a window group is never evicted. The install replaces only
the single-table method it knows.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest
from vllm.v1.core.sched.scheduler import Scheduler

from pd_connector.vllm_lines import hma_023 as vllm023_hma
from pd_connector.vllm_lines.hma_023 import install, needs_install, update_requests_with_invalid_blocks

BLOCK = 4


@dataclass
class Req:
    request_id: str
    num_computed_tokens: int


@dataclass
class Manager:
    tables: dict[str, tuple[list[int], ...]] = field(default_factory=dict)

    def get_block_ids(self, req_id: str) -> tuple[list[int], ...]:
        return self.tables[req_id]


@dataclass
class FakeScheduler:
    kv_cache_manager: Manager
    block_size: int = BLOCK


def vllm_method():
    """vLLM's own method (the one install replaced, if it ran in this process)."""
    return vllm023_hma.REPLACED.get(Scheduler, Scheduler._update_requests_with_invalid_blocks)


def run(method, tables: dict[str, tuple[list[int], ...]], computed: dict[str, int], invalid: set[int],
        scheduled: dict[str, int], evict: bool):  # fmt: skip
    reqs = [Req(rid, n) for rid, n in computed.items()]
    result = method(FakeScheduler(Manager(tables)), reqs, invalid, scheduled, evict)
    return result, {r.request_id: r.num_computed_tokens for r in reqs}


@pytest.mark.parametrize("seed", range(40))
def test_one_group_gives_what_vllms_own_method_gives(seed: int) -> None:
    rng = random.Random(seed)
    ids = list(range(1, 60))
    rng.shuffle(ids)
    tables: dict[str, tuple[list[int], ...]] = {}
    computed: dict[str, int] = {}
    scheduled: dict[str, int] = {}
    shared = ids.pop()
    for i in range(rng.randint(1, 4)):
        n = rng.randint(1, 6)
        table = [ids.pop() for _ in range(n)]
        if rng.random() < 0.3:
            table[0] = shared  # a block two requests share
        tables[f"r{i}"] = (table,)
        computed[f"r{i}"] = rng.randint(0, n * BLOCK)
        scheduled[f"r{i}"] = rng.randint(0, 2)
    every = [b for (t,) in tables.values() for b in t]
    invalid = set(rng.sample(every, rng.randint(1, len(every))))
    evict = rng.random() < 0.5
    ours = run(update_requests_with_invalid_blocks, tables, computed, invalid, scheduled, evict)
    theirs = run(vllm_method(), tables, computed, invalid, scheduled, evict)
    assert ours == theirs


def test_two_groups_cut_at_the_first_invalid_index_of_any_group() -> None:
    # Full-attention table and a window table whose first block fell out of the window (null block 0).
    tables = {"d": ([10, 11, 12, 13], [0, 21, 22, 23])}
    (affected, tokens, evict), computed = run(
        update_requests_with_invalid_blocks, tables, {"d": 16}, {22, 13}, {}, True
    )
    assert affected == {"d"}
    assert computed == {"d": 2 * BLOCK}  # block index 2 is the first holding an invalid block (22)
    assert tokens == 16 - 2 * BLOCK
    assert evict == {12, 13, 22, 23}


def test_two_groups_null_block_is_never_evicted_and_untouched_requests_keep_their_tokens() -> None:
    tables = {"a": ([10, 11], [0, 21]), "b": ([30, 31], [0, 41])}
    (affected, tokens, evict), computed = run(update_requests_with_invalid_blocks, tables,
                                              {"a": 8, "b": 8}, {10}, {}, True)  # fmt: skip
    assert affected == {"a"} and computed == {"a": 0, "b": 8} and tokens == 8
    assert evict == {10, 11, 21}


def test_a_block_shared_with_an_earlier_request_is_recomputed_by_that_one_only() -> None:
    tables = {"a": ([10, 11], [20, 21]), "b": ([10, 12], [20, 22])}
    (affected, _, _), computed = run(update_requests_with_invalid_blocks, tables,
                                     {"a": 8, "b": 8}, {10, 20}, {"b": 1}, False)  # fmt: skip
    assert affected == {"a", "b"}
    assert computed == {"a": 0, "b": 7}  # b keeps its computed prefix (8 minus the 1 scheduled token)


def test_install_replaces_only_the_single_table_method() -> None:
    class Old:
        def _update_requests_with_invalid_blocks(self, requests, invalid_block_ids, num_scheduled_tokens):
            for request in requests:
                req_id = request.request_id
                (req_block_ids,) = self.kv_cache_manager.get_block_ids(req_id)
                del req_block_ids

    class Other:
        def _update_requests_with_invalid_blocks(self, requests, invalid_block_ids, num_scheduled_tokens):
            return set(), 0, set()

    original = Other._update_requests_with_invalid_blocks
    assert needs_install(Old) and not needs_install(Other)
    assert install(Old) and install(Old)  # idempotent
    assert Old._update_requests_with_invalid_blocks is update_requests_with_invalid_blocks
    assert not install(Other) and Other._update_requests_with_invalid_blocks is original


def test_vllms_scheduler_has_the_method_this_module_knows() -> None:
    """On both vLLM lines the scheduler reads one table there; install would find it."""
    assert needs_install(Scheduler) or Scheduler in vllm023_hma.REPLACED
