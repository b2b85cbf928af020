"""D2RH's host pool index (pd_connector.d2rh.host_pool): hash-keyed prefix cache, pins, bounds, LRU eviction."""

from __future__ import annotations

import pytest

from pd_connector.d2rh.host_pool import HostPool, PoolError


def test_fresh_blocks_until_full_then_refused_without_change() -> None:
    pool = HostPool(4)
    got = pool.acquire([], 3)
    assert got == ([], [0, 1, 2])
    assert pool.acquire([], 2) is None  # one left: nothing taken
    assert (pool.available(), pool.pinned, pool.used) == (1, 3, 3)
    assert pool.acquire([], 1) == ([], [3])
    assert pool.acquire([], 1) is None


def test_committed_blocks_are_hits_by_hash_and_survive_release() -> None:
    pool = HostPool(8)
    _, fresh = pool.acquire([], 3)
    assert pool.hits(["a", "b", "c"]) == 0  # staged but not committed: never a hit (half-filled)
    pool.commit(fresh, ["a", "b", None])  # the last block is partial: not cached
    pool.release(fresh)
    assert pool.cached == 2 and pool.pinned == 0
    assert pool.hits(["a", "b", "c"]) == 2
    assert pool.hits(["a", "x", "b"]) == 1  # a prefix: the run ends at the first miss
    assert pool.hits([None, "a"]) == 0
    hits, new = pool.acquire(["a", "b"], 1)
    assert hits == fresh[:2] and len(new) == 1


def test_pinned_blocks_are_never_evicted_and_lru_goes_first() -> None:
    pool = HostPool(3)
    _, (b0, b1, b2) = pool.acquire([], 3)
    pool.commit([b0, b1, b2], ["h0", "h1", "h2"])
    pool.release([b1])  # released first: least recently used
    pool.release([b0])
    assert pool.acquire([], 3) is None  # b2 still pinned
    _, (evicted,) = pool.acquire([], 1)
    assert evicted == b1 and pool.hits(["h1"]) == 0 and pool.hits(["h0"]) == 1
    assert pool.evictions == 1
    # a hit pins its block: it is no longer evictable
    (hit,), _ = pool.acquire(["h0"], 0)
    assert hit == b0
    assert pool.acquire([], 1) is None


def test_acquire_counts_its_own_hits_as_not_evictable() -> None:
    pool = HostPool(2)
    _, (b0, b1) = pool.acquire([], 2)
    pool.commit([b0, b1], ["h0", "h1"])
    pool.release([b0, b1])
    assert pool.acquire(["h0", "h1"], 1) is None  # both blocks are its hits: none left to evict
    assert pool.pinned == 0 and pool.hits(["h0", "h1"]) == 2


def test_shared_hits_need_every_pin_released() -> None:
    pool = HostPool(2)
    _, (b0,) = pool.acquire([], 1)
    pool.commit([b0], ["h"])
    pool.acquire(["h"], 0)
    pool.release([b0])
    assert pool.pinned == 1
    pool.release([b0])
    assert pool.pinned == 0 and pool.cached == 1


def test_a_failed_staging_is_never_cached_and_frees_its_blocks() -> None:
    pool = HostPool(2)
    _, fresh = pool.acquire([], 2)
    pool.drop(fresh)
    assert pool.cached == 0 and pool.available() == 2 and pool.used == 0


def test_duplicate_hash_keeps_the_first_block() -> None:
    pool = HostPool(4)
    _, (b0,) = pool.acquire([], 1)
    _, (b1,) = pool.acquire([], 1)
    pool.commit([b0], ["h"])
    pool.commit([b1], ["h"])  # two requests staged the same block at once
    pool.release([b0, b1])
    assert pool.cached == 1 and pool.available() == 4  # b1 went back free


def test_bookkeeping_errors_are_loud() -> None:
    pool = HostPool(2)
    with pytest.raises(PoolError):
        pool.release([0])
    with pytest.raises(PoolError):
        pool.commit([1], ["h"])
    with pytest.raises(ValueError):
        HostPool(0)
