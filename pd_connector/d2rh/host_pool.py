"""D2RH: the index of a decode instance's host KV pool (scheduler side; pure bookkeeping, no memory).

The pool has ``capacity`` host blocks; every rank of the instance holds its own bytes of block ``i``
at the same block id (``host_kv.HostKV``), so one index in the scheduler serves all ranks. A block
is *free*, *pinned* (a request stages into it or loads from it: refcount > 0) or *cached*: a full
block whose KV is known good, keyed by vLLM's block hash, kept after its requests ended and reused
by later requests with the same prefix. Cached blocks no request pins are evictable, least recently
used first. A block is never handed out twice while pinned, and a block whose staging failed is
never cached (``drop``).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Sequence


class PoolError(ValueError):
    """A release of a block that is not pinned (a bookkeeping bug)."""


class HostPool:
    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"a host pool needs at least one block, got {capacity}")
        self.capacity = capacity
        self._free: list[int] = list(range(capacity - 1, -1, -1))  # pop() hands out low ids first
        self._pins: dict[int, int] = {}
        self._by_hash: dict[Hashable, int] = {}
        self._hash_of: dict[int, Hashable] = {}
        self._evictable: OrderedDict[int, None] = OrderedDict()  # cached, unpinned; oldest first
        self.evictions = 0

    # ------------------------------------------------------------------ queries

    def hits(self, hashes: Sequence[Hashable | None]) -> int:
        """How many leading ``hashes`` are cached (None ends the run: a partial block is never cached)."""
        n = 0
        for h in hashes:
            if h is None or h not in self._by_hash:
                break
            n += 1
        return n

    def available(self) -> int:
        """Blocks an acquire can take now: free plus evictable."""
        return len(self._free) + len(self._evictable)

    @property
    def used(self) -> int:
        """Blocks pinned or cached (not free)."""
        return self.capacity - len(self._free)

    @property
    def pinned(self) -> int:
        return len(self._pins)

    @property
    def cached(self) -> int:
        return len(self._hash_of)

    # ------------------------------------------------------------------ moves

    def acquire(self, hit_hashes: Sequence[Hashable], new: int) -> tuple[list[int], list[int]] | None:
        """Pin the cached blocks of ``hit_hashes`` and ``new`` fresh blocks (evicting LRU cached blocks no
        one pins); None, changing nothing, when there is not room for ``new`` blocks."""
        hit_ids = [self._by_hash[h] for h in hit_hashes]
        evictable_after = len(self._evictable) - sum(1 for b in set(hit_ids) if b in self._evictable)
        if new > len(self._free) + evictable_after:
            return None
        for block in hit_ids:
            self._pin(block)
        fresh: list[int] = []
        for _ in range(new):
            if self._free:
                block = self._free.pop()
            else:
                block, _ = self._evictable.popitem(last=False)
                del self._by_hash[self._hash_of.pop(block)]
                self.evictions += 1
            self._pin(block)
            fresh.append(block)
        return hit_ids, fresh

    def commit(self, blocks: Sequence[int], hashes: Sequence[Hashable | None]) -> None:
        """The staged ``blocks`` hold good KV: key each under its hash (None: a partial block, not cached).
        A hash already cached under another block keeps that block (this one frees on release)."""
        for block, h in zip(blocks, hashes, strict=False):
            if h is None or h in self._by_hash or block in self._hash_of:
                continue
            if block not in self._pins:
                raise PoolError(f"host block {block} is not pinned; cannot cache it")
            self._by_hash[h] = block
            self._hash_of[block] = h

    def release(self, blocks: Sequence[int]) -> None:
        """Unpin ``blocks``: a cached block becomes evictable (most recently used), any other is free."""
        for block in blocks:
            pins = self._pins.get(block, 0)
            if pins <= 0:
                raise PoolError(f"host block {block} released but not pinned")
            if pins > 1:
                self._pins[block] = pins - 1
                continue
            del self._pins[block]
            if block in self._hash_of:
                self._evictable[block] = None
            else:
                self._free.append(block)

    def drop(self, blocks: Sequence[int]) -> None:
        """Unpin ``blocks`` whose content is not trusted (failed staging): uncached ones go back free.
        A cached block among them (a host hit of the same request) keeps its entry."""
        self.release(blocks)

    # ------------------------------------------------------------------ internals

    def _pin(self, block: int) -> None:
        self._pins[block] = self._pins.get(block, 0) + 1
        self._evictable.pop(block, None)
