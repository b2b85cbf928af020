"""Per-request KV accounting on a decode instance: where a prompt's KV came from (scheduler side, no I/O).

For every request D finishes normally, :class:`KVAccounts` tells how D's prompt KV came to be:

- ``pushed_tokens``: prompt tokens whose KV P pushed and D loaded (vLLM's ``num_external_tokens`` of the
  load, minus any part a failed load lost);
- ``prefix_hit_tokens``: prompt tokens D found in its own prefix cache (the local hit vLLM hands
  ``get_num_new_matched_tokens``, whole blocks);
- ``recomputed_tokens``: the rest, computed by D's own forward, with ``recompute_reason``
  (:class:`RecomputeReason`; ``none`` exactly when nothing was recomputed).

The three always add up to the request's prompt tokens. When P pushed the whole prompt, vLLM runs the
last prompt token once more to sample the first token (``Scheduler._update_waiting_for_remote_kv`` sets
``num_computed_tokens`` to ``num_tokens - 1``, vLLM 0.23 and 0.32); its KV came from P, so it counts as
pushed, and a healthy pair shows ``recomputed_tokens`` 0. ``kv_bytes``: bytes of D's KV blocks the load
filled, on all of D's TP ranks (what P's ``vllm:pd_kv_sent_bytes_total`` grows by); ``transfer_ms``: from
the step that allocated the load's blocks to the step vLLM learnt it finished (on the Router's
two-instance path, D asks while P still prefills, so this includes P's prefill).

The record goes back in the request's ``kv_transfer_params`` (key :data:`ACCOUNT_KEY`), which vLLM puts in
the final output; ``pd_connector.api_server.usage`` moves it into the answer's ``usage``.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from pd_connector.bypass import BypassReason

#: Key of the record in D's answer ``kv_transfer_params`` and in the answer's ``usage``.
ACCOUNT_KEY = "pd_kv"
#: Stats interval keys (pd_connector.metrics): tokens by source, and requests that recomputed, by reason.
TOKENS_KEY = "kv_tokens"
RECOMPUTES_KEY = "kv_recomputes"
SOURCES = ("pushed", "prefix_hit", "recomputed")


class RecomputeReason(enum.Enum):
    """Why D computed prompt tokens itself (``recompute_reason``)."""

    NONE = "none"  # nothing recomputed
    LOAD_FAILED = "load_failed"  # P's KV did not (all) arrive; vLLM recomputed per kv_load_failure_policy
    PREFILLED_PART = "prefilled_part"  # P's KV covers the prompt's first ``prefilled_tokens`` only
    REPLAYED = "replayed"  # vLLM computed part of a loaded KV again (its sliding-window replay)
    NOT_LOADED = "not_loaded"  # D loaded nothing for a request with P's parameters (an extension's choice)
    # Requests served without a transfer (pd_connector.bypass), with the same names:
    NO_PARAMS = BypassReason.NO_PARAMS.value
    MALFORMED = BypassReason.MALFORMED.value
    NOT_ASKED = BypassReason.NOT_ASKED.value
    WRONG_ROLE = BypassReason.WRONG_ROLE.value
    PREFIX_CACHED = BypassReason.PREFIX_CACHED.value
    WINDOW_RECOMPUTE = BypassReason.WINDOW_RECOMPUTE.value
    STATE_RECOMPUTE = BypassReason.STATE_RECOMPUTE.value

    @classmethod
    def of_bypass(cls, reason: BypassReason) -> RecomputeReason:
        return cls(reason.value)


RECOMPUTE_REASONS: tuple[str, ...] = tuple(r.value for r in RecomputeReason if r is not RecomputeReason.NONE)


@dataclass(frozen=True, slots=True)
class KVAccount:
    """Where one request's prompt KV came from on D; the three token counts add up to ``prompt_tokens``."""

    prompt_tokens: int
    pushed_tokens: int
    prefix_hit_tokens: int
    recomputed_tokens: int
    recompute_reason: RecomputeReason
    kv_bytes: int = 0
    transfer_ms: float | None = None

    def __post_init__(self) -> None:
        counts = (self.pushed_tokens, self.prefix_hit_tokens, self.recomputed_tokens, self.kv_bytes)
        if min(counts) < 0:
            raise ValueError(f"KVAccount: negative count in {self}")
        if self.pushed_tokens + self.prefix_hit_tokens + self.recomputed_tokens != self.prompt_tokens:
            raise ValueError(
                f"KVAccount: pushed {self.pushed_tokens} + prefix hit {self.prefix_hit_tokens} + recomputed "
                f"{self.recomputed_tokens} != prompt_tokens {self.prompt_tokens}"
            )
        if (self.recomputed_tokens > 0) != (self.recompute_reason is not RecomputeReason.NONE):
            raise ValueError(
                f"KVAccount: recompute_reason {self.recompute_reason.value!r} with {self.recomputed_tokens} "
                "recomputed tokens (a recompute needs a reason, and only a recompute has one)"
            )

    def to_json(self) -> dict[str, Any]:
        """The ``usage.pd_kv`` object (without the Router's ``path``)."""
        return {
            "pushed_tokens": self.pushed_tokens,
            "prefix_hit_tokens": self.prefix_hit_tokens,
            "recomputed_tokens": self.recomputed_tokens,
            "recompute_reason": self.recompute_reason.value,
            "kv_bytes": self.kv_bytes,
            "transfer_ms": None if self.transfer_ms is None else round(self.transfer_ms, 3),
        }


def merge_accounts(records: Sequence[dict[str, Any]]) -> dict[str, Any] | None:
    """One ``usage.pd_kv`` for an answer of several engine requests (``n`` > 1, several prompts): counts and
    bytes summed, the longest transfer, the first reason other than ``none``. None when ``records`` is empty."""
    if not records:
        return None
    if len(records) == 1:
        return dict(records[0])
    out: dict[str, Any] = {}
    for key in ("pushed_tokens", "prefix_hit_tokens", "recomputed_tokens", "kv_bytes"):
        out[key] = sum(int(r.get(key) or 0) for r in records)
    reasons = [r.get("recompute_reason") for r in records if r.get("recompute_reason") not in (None, "none")]
    out["recompute_reason"] = reasons[0] if reasons else "none"
    times = [float(t) for r in records if isinstance(t := r.get("transfer_ms"), (int, float))]
    out["transfer_ms"] = max(times) if times else None
    return out


@dataclass(slots=True)
class _Books:
    """What D's scheduler learnt of one request so far."""

    prefix_hit: int = 0
    bypass: BypassReason | None = None
    loaded: int = 0  # vLLM's num_external_tokens of the load
    load_blocks: int = 0  # blocks the load fills (all KV cache groups, null blocks not counted)
    load_bytes: int = 0
    load_started: float | None = None
    load_done: float | None = None
    failed: bool = False
    computed_at_start: int | None = None  # num_computed_tokens when first scheduled
    watched_blocks: frozenset[int] = field(default_factory=frozenset)


class KVAccounts:
    """D's per-request books (one engine's scheduler); ``finish`` gives the request's :class:`KVAccount`.

    ``group_block_bytes``: bytes of one block of each KV cache group on one rank (every layer of the group);
    ``ranks``: D's ranks holding KV (tensor parallel size): a load fills each rank's blocks.
    """

    def __init__(self, block_size: int, group_block_bytes: Sequence[int] = (), ranks: int = 1) -> None:
        self.block_size = block_size
        self.group_block_bytes = list(group_block_bytes)
        self.ranks = max(1, ranks)
        self._books: dict[str, _Books] = {}
        self._tokens = dict.fromkeys(SOURCES, 0)
        self._recomputes: dict[str, int] = {}

    def _of(self, rid: str) -> _Books:
        books = self._books.get(rid)
        if books is None:
            books = self._books[rid] = _Books()
        return books

    def local_hit(self, rid: str, tokens: int) -> None:
        """vLLM's local prefix hit for ``rid`` (get_num_new_matched_tokens; a later lookup replaces it)."""
        self._of(rid).prefix_hit = max(0, tokens)

    def hit_of(self, rid: str) -> int:
        """The local prefix hit recorded for ``rid`` (0 when none)."""
        books = self._books.get(rid)
        return books.prefix_hit if books is not None else 0

    def bypassed(self, rid: str, reason: BypassReason) -> None:
        self._of(rid).bypass = reason

    def load(self, rid: str, tokens: int, groups: Sequence[Sequence[int]], null_block: int | None = 0) -> None:
        """D allocated blocks for a load of ``tokens`` prompt tokens (``groups``: the blocks P fills, per group)."""
        books = self._of(rid)
        if books.load_started is not None:
            return  # vLLM allocates again once the load is done (for the rest of the prompt)
        books.loaded = max(0, tokens)
        books.load_started = time.monotonic()
        nulls = len(groups) > 1  # one group: every block counts
        counts = [sum(1 for b in g if not (nulls and b == null_block)) for g in groups]
        books.load_blocks = sum(counts)
        books.load_bytes = self.ranks * sum(
            n * self.group_block_bytes[g] for g, n in enumerate(counts) if g < len(self.group_block_bytes)
        )
        books.watched_blocks = frozenset(groups[0]) if groups else frozenset()

    def load_finished(self, rid: str) -> None:
        books = self._books.get(rid)
        if books is not None and books.load_started is not None and books.load_done is None:
            books.load_done = time.monotonic()

    def load_failed(self, rid: str) -> None:
        if (books := self._books.get(rid)) is not None:
            books.failed = True

    def blocks_failed(self, block_ids: set[int]) -> None:
        """vLLM 0.23: blocks whose load failed; the loads filling any of them failed."""
        for books in self._books.values():
            if books.load_started is not None and not books.watched_blocks.isdisjoint(block_ids):
                books.failed = True

    def scheduled(self, rid: str, num_computed_tokens: int) -> None:
        """vLLM scheduled ``rid`` for the first time with ``num_computed_tokens`` of KV in place."""
        books = self._books.get(rid)
        if books is not None and books.computed_at_start is None:
            books.computed_at_start = num_computed_tokens

    def forget(self, rid: str) -> None:
        self._books.pop(rid, None)

    def finish(self, rid: str, prompt_tokens: int, has_decode_params: bool) -> KVAccount:
        """The request's account (its books are dropped); counted for ``/metrics``."""
        books = self._books.pop(rid, None) or _Books()
        account = self._account(books, prompt_tokens, has_decode_params)
        self._tokens["pushed"] += account.pushed_tokens
        self._tokens["prefix_hit"] += account.prefix_hit_tokens
        self._tokens["recomputed"] += account.recomputed_tokens
        if account.recompute_reason is not RecomputeReason.NONE:
            reason = account.recompute_reason.value
            self._recomputes[reason] = self._recomputes.get(reason, 0) + 1
        return account

    def _account(self, books: _Books, prompt: int, has_decode_params: bool) -> KVAccount:
        started = books.computed_at_start
        hit = min(books.prefix_hit, prompt)
        if books.loaded == 0 and started is not None:
            hit = min(started, prompt)  # nothing loaded: what vLLM had in place is its own prefix cache
        loaded = min(books.loaded, prompt - hit)
        # What vLLM holds at the first schedule after a whole load: all of it, less the last token it reruns.
        expected = hit + loaded if hit + loaded < prompt else prompt - 1
        reason = RecomputeReason.NONE
        pushed = loaded
        if loaded and (books.failed or (started is not None and started < expected)):
            pushed = 0 if started is None else max(0, min(started - hit, loaded))
            reason = RecomputeReason.LOAD_FAILED if books.failed else RecomputeReason.REPLAYED
        recomputed = prompt - hit - pushed
        if recomputed > 0 and reason is RecomputeReason.NONE:
            if books.bypass is not None:
                reason = RecomputeReason.of_bypass(books.bypass)
            elif loaded:
                reason = RecomputeReason.PREFILLED_PART
            else:
                reason = RecomputeReason.NOT_LOADED if has_decode_params else RecomputeReason.NO_PARAMS
        elif recomputed == 0:
            reason = RecomputeReason.NONE
        kv_bytes = books.load_bytes
        if pushed < loaded and books.load_blocks:  # a failed load: the blocks of what was kept
            kept = -(-pushed // self.block_size) if pushed else 0
            kv_bytes = kv_bytes * min(kept, books.load_blocks) // books.load_blocks
        transfer_ms = None
        if books.load_started is not None and books.load_done is not None:
            transfer_ms = (books.load_done - books.load_started) * 1000
        return KVAccount(prompt, pushed, hit, recomputed, reason, kv_bytes, transfer_ms)

    def take(self) -> dict[str, Any] | None:
        """Token counts by source and recomputes by reason since the previous call (None: nothing finished)."""
        if not any(self._tokens.values()) and not self._recomputes:
            return None
        out = {TOKENS_KEY: self._tokens, RECOMPUTES_KEY: self._recomputes}
        self._tokens, self._recomputes = dict.fromkeys(SOURCES, 0), {}
        return out


def group_block_bytes(kv_cache_config: Any) -> list[int]:
    """Bytes of one block of each KV cache group on one rank, all its layers (from vLLM's KVCacheConfig)."""
    groups = getattr(kv_cache_config, "kv_cache_groups", None) or []
    out: list[int] = []
    for group in groups:
        spec = group.kv_cache_spec
        inner = getattr(spec, "kv_cache_specs", None)  # UniformTypeKVCacheSpecs: one spec per layer
        if isinstance(inner, dict):
            out.append(sum(_page_bytes(s) for s in inner.values()))
        else:
            out.append(_page_bytes(spec) * len(group.layer_names))
    return out


def _page_bytes(spec: Any) -> int:
    """A layer's bytes per block without vLLM's page padding (what a transfer writes)."""
    real = getattr(spec, "real_page_size_bytes", None)
    return int(real if isinstance(real, int) else spec.page_size_bytes)
