"""KV cache groups (vLLM's hybrid KV cache manager, ``SupportsHMA``): which blocks of which layers move.

With the hybrid manager on, vLLM splits a model's layers into KV cache groups (full attention,
sliding window, ...; ``kv_cache_config.kv_cache_groups[i].layer_names``) and gives a request one
block table per group, all drawn from one block pool. A layer's KV lives in its group's blocks.
So P pushes, for every group, the blocks of that group's table into D's table of the same group,
touching only that group's layers (regions).

Sliding-window groups: vLLM replaces the blocks that fell out of the window with its null block
(id 0, ``NULL_BLOCK``) on both sides (P frees them before ``request_finished``; D allocates nulls
for them when it admits the external tokens). What moves is every block D holds a real block for;
a null on D is skipped (D does not need it; the null block is never written); a null on P where D
has a real block is an error (P freed KV that D's window still needs): the load fails and vLLM
recomputes or fails the request.

Single-group deployments keep the old messages: the group lists are empty and the single
``block_ids`` / ``dst_block_ids`` list is group 0.

Everything here is pure: no I/O, no tensors touched (``region_groups`` only reads shapes).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from pd_connector.layouts.regions import LayoutError, Region, block_runs, regions_of_kv_caches

__all__ = [
    "NULL_BLOCK",
    "BlockTableError",
    "GroupError",
    "all_groups",
    "check_group_block_sizes",
    "check_peer_groups",
    "decode_group_blocks",
    "group_block_sizes",
    "group_entries",
    "group_pairs",
    "layer_groups",
    "layer_kinds",
    "recurrent_groups",
    "real_blocks",
    "recv_groups",
    "send_groups",
    "sliding_windows",
    "received_bytes",
    "region_groups",
    "replay_needs_freed_block",
]

#: vLLM's placeholder block (BlockPool.null_block): holds no KV, is never read or written.
NULL_BLOCK = 0

Entries = tuple[list[int], list[int], list[int]]
#: (src regions, dst regions, block runs) -> backend entries for those region pairs.
EntriesFn = Callable[[Sequence[Region], Sequence[Region], list[tuple[int, int, int]]], Entries]


class GroupError(LayoutError):
    """KV cache groups that do not pair up between P and D, or block tables that do not fit them."""


class BlockTableError(GroupError):
    """D asks for blocks of a group that P does not hold (past its end, or freed out of its window)."""


# ------------------------------------------------------------ layers and regions


def layer_groups(kv_cache_config: Any, layer_names: Sequence[str]) -> list[int]:
    """KV cache group index of each layer in ``layer_names`` (from ``kv_cache_config.kv_cache_groups``).

    No config (or one group): every layer is group 0. With several groups every layer must be in
    exactly one of them.
    """
    groups = list(getattr(kv_cache_config, "kv_cache_groups", None) or [])
    if len(groups) <= 1:
        return [0] * len(layer_names)
    owner: dict[str, int] = {}
    for index, group in enumerate(groups):
        for name in group.layer_names:
            if name in owner and owner[name] != index:
                raise GroupError(f"layer {name} is in KV cache groups {owner[name]} and {index}")
            owner[name] = index
    missing = [name for name in layer_names if name not in owner]
    if missing:
        raise GroupError(
            f"KV layers {missing} are in none of the {len(groups)} KV cache groups "
            f"({[list(g.layer_names) for g in groups]})"
        )
    return [owner[name] for name in layer_names]


def region_groups(kv_caches: Mapping[str, Any], kv_cache_config: Any, num_blocks: int) -> tuple[int, ...]:
    """Group index of every region of ``layout.regions_of_kv_caches(kv_caches, num_blocks)``, in its order.

    Empty when there is one group (the messages then carry no group lists).
    """
    if len(getattr(kv_cache_config, "kv_cache_groups", None) or []) <= 1:
        return ()
    per_layer = layer_groups(kv_cache_config, list(kv_caches))
    out: list[int] = []
    for (name, value), group in zip(kv_caches.items(), per_layer, strict=True):
        out += [group] * len(regions_of_kv_caches({name: value}, num_blocks))
    return tuple(out)


def group_block_sizes(kv_cache_config: Any, default: int) -> list[int]:
    """Tokens per block of each KV cache group (``default`` when there is no config)."""
    groups = list(getattr(kv_cache_config, "kv_cache_groups", None) or [])
    if not groups:
        return [default]
    return [int(getattr(g.kv_cache_spec, "block_size", default) or default) for g in groups]


def check_group_block_sizes(sizes: Sequence[int]) -> int:
    """The one block size all groups share; GroupError naming them when they differ."""
    if len(set(sizes)) != 1:
        raise GroupError(
            f"KV cache groups have block sizes {list(sizes)}; PDConnector moves groups of one block size only "
            "(start vLLM with --disable-hybrid-kv-cache-manager for this model)"
        )
    return sizes[0]


def sliding_windows(kv_cache_config: Any) -> list[int]:
    """The sliding windows (tokens) of the KV cache groups, when vLLM runs several groups."""
    groups = list(getattr(kv_cache_config, "kv_cache_groups", None) or [])
    if len(groups) <= 1:
        return []
    windows = (getattr(g.kv_cache_spec, "sliding_window", None) for g in groups)
    return sorted({int(w) for w in windows if isinstance(w, int) and w > 0})


def replay_needs_freed_block(num_tokens: int, windows: Sequence[int], block_size: int) -> int | None:
    """The window for which D cannot recompute a fully loaded prompt's last token exactly, else None.

    vLLM admits the loaded prompt with its window's skipped blocks computed for ``num_tokens``
    tokens (nulls up to ``(num_tokens - w + 1) // block_size``), then recomputes the last prompt
    token, whose window also needs token ``num_tokens - w``. When that token opens a block (the
    boundary case) its block is already the null block on D, and P freed it as well: only a local
    prefill on D gives the same KV as a colocated run.
    """
    for w in windows:
        first_kept = num_tokens - w + 1  # tokens vLLM skips for the next token
        if first_kept > 0 and first_kept % block_size == 0:
            return w
    return None


def _spec_kinds(spec: Any) -> list[Any]:
    """The per-layer specs of a group's spec (vLLM's UniformTypeKVCacheSpecs holds several)."""
    inner = getattr(spec, "kv_cache_specs", None)
    return list(inner.values()) if isinstance(inner, Mapping) else [spec]


def _kind_name(spec: Any) -> str:
    """A spec's class, with the recurrent mixer it serves (MambaSpec.mamba_type: MAMBA2, GDN_ATTN, ...)."""
    mixer = getattr(spec, "mamba_type", None)
    name = getattr(mixer, "name", None) or (str(mixer) if mixer is not None else "")
    return f"{type(spec).__name__} ({name})" if name else type(spec).__name__


def layer_kinds(kv_cache_config: Any) -> str:
    """The model's layer kinds, one per KV cache group: spec class, layer count and the first layer names."""
    parts = []
    for group in getattr(kv_cache_config, "kv_cache_groups", None) or []:
        names = list(group.layer_names)
        shown = ", ".join(names[:2]) + (", ..." if len(names) > 2 else "")
        kinds = sorted({_kind_name(s) for s in _spec_kinds(group.kv_cache_spec)})
        parts.append(f"{' + '.join(kinds)}: {len(names)} layers ({shown})")
    return "; ".join(parts)


def recurrent_groups(kv_cache_config: Any) -> list[int]:
    """KV cache groups whose layers keep something other than attention KV (vLLM's MambaSpec and the like).

    Such a layer (Mamba, Mamba2, gated delta net, short conv, ...) keeps one recurrent state per
    request, not per-token KV in blocks: moving its "blocks" as attention KV gives D a wrong state.
    A spec counts when it is a vLLM ``KVCacheSpec`` that is no ``AttentionSpec`` (inside a
    ``UniformTypeKVCacheSpecs`` too); other objects (tests' stand-ins) are taken for attention.
    """
    try:
        from vllm.v1.kv_cache_interface import AttentionSpec, KVCacheSpec
    except ImportError:  # no vLLM: nothing to tell them apart by
        return []
    out = []
    for index, group in enumerate(getattr(kv_cache_config, "kv_cache_groups", None) or []):
        specs = _spec_kinds(group.kv_cache_spec)
        if any(isinstance(s, KVCacheSpec) and not isinstance(s, AttentionSpec) for s in specs):
            out.append(index)
    return out


# ------------------------------------------------------------ block tables


def all_groups(primary: Sequence[int], groups: Sequence[Sequence[int]]) -> list[list[int]]:
    """A message's block table per group: ``groups`` when it has several, else ``[primary]``."""
    return [list(g) for g in groups] if groups else [list(primary)]


def send_groups(job: Any) -> list[list[int]]:
    """P: a SendJob's block table per group."""
    return all_groups(job.block_ids, job.group_block_ids)


def recv_groups(job: Any) -> list[list[int]]:
    """D: a RecvJob's (or TransferRequest's) destination blocks per group."""
    groups = getattr(job, "dst_group_block_ids", None)
    return all_groups(job.dst_block_ids, groups if groups is not None else job.dst_groups)


def real_blocks(groups: Sequence[Sequence[int]]) -> list[int]:
    """The block ids of the groups a load fills: with several groups the non-null ones, with one all of them."""
    if len(groups) <= 1:
        return [b for g in groups for b in g]
    return [b for g in groups for b in g if b != NULL_BLOCK]


def decode_group_blocks(block_ids: Sequence[Sequence[int]], start_block: int, num_blocks: int) -> list[list[int]]:
    """D: per group, the blocks P fills (block index ``start_block`` up to ``num_blocks``)."""
    return [list(ids[start_block:num_blocks]) for ids in block_ids]


def group_pairs(
    src_groups: Sequence[Sequence[int]], dst_groups: Sequence[Sequence[int]], start_block: int
) -> list[tuple[list[int], list[int]]]:
    """Per group, the (P blocks, D blocks) to copy: P's from ``start_block`` on against D's.

    With several groups D's null blocks are skipped, and P's null block where D needs KV (out of
    P's sliding window) is a BlockTableError; one group moves its table as given (as before
    groups). BlockTableError also when D asks past the end of a P group; GroupError when the
    group counts differ.
    """
    if len(src_groups) != len(dst_groups):
        raise GroupError(f"prefill has {len(src_groups)} KV cache groups, decode asks for {len(dst_groups)}")
    nulls = len(dst_groups) > 1
    pairs = []
    for g, (src, dst) in enumerate(zip(src_groups, dst_groups, strict=True)):
        end = start_block + len(dst)
        if start_block < 0 or end > len(src):
            raise BlockTableError(
                f"KV cache group {g}: decode asks for blocks {start_block}..{end - 1} but prefill holds {len(src)}"
            )
        s_ids, d_ids = [], []
        for i, d in enumerate(dst):
            if nulls and d == NULL_BLOCK:
                continue
            s = src[start_block + i]
            if nulls and s == NULL_BLOCK:
                raise BlockTableError(
                    f"KV cache group {g}: decode needs block {start_block + i}, which prefill already freed "
                    "(out of its sliding window)"
                )
            s_ids.append(s)
            d_ids.append(d)
        pairs.append((s_ids, d_ids))
    return pairs


def group_entries(
    groups_of_regions: Sequence[int],
    src_regions: Sequence[Region],
    dst_regions: Sequence[Region],
    pairs: Sequence[tuple[list[int], list[int]]],
    entries: EntriesFn,
) -> Entries:
    """Backend entries of every group: each group's block pairs over that group's region pairs only."""
    if len(groups_of_regions) != len(src_regions):
        raise GroupError(f"{len(groups_of_regions)} region groups for {len(src_regions)} KV regions")
    if len(src_regions) != len(dst_regions):
        raise GroupError(f"KV region count differs: prefill has {len(src_regions)}, decode has {len(dst_regions)}")
    src_addrs: list[int] = []
    dst_addrs: list[int] = []
    lengths: list[int] = []
    for g, (s_ids, d_ids) in enumerate(pairs):
        if not s_ids:
            continue
        idx = [i for i, owner in enumerate(groups_of_regions) if owner == g]
        a, b, c = entries([src_regions[i] for i in idx], [dst_regions[i] for i in idx], block_runs(s_ids, d_ids))
        src_addrs += a
        dst_addrs += b
        lengths += c
    return src_addrs, dst_addrs, lengths


def check_peer_groups(ours: Sequence[int], theirs: Sequence[int], num_regions: int) -> None:
    """GroupError unless both sides assign their KV regions to the same groups (empty: all group 0)."""
    a = tuple(ours) or (0,) * num_regions
    b = tuple(theirs) or (0,) * num_regions
    if a != b:
        raise GroupError(
            f"KV cache groups differ: prefill regions are in groups {list(a)}, decode's in {list(b)} "
            "(start both with the hybrid KV cache manager on, or both with --disable-hybrid-kv-cache-manager)"
        )


def received_bytes(
    regions: Sequence[Region], groups_of_regions: Sequence[int], dst_groups: Sequence[Sequence[int]]
) -> int:
    """Bytes a load fills: per region, its block bytes times the blocks of its group it fills."""
    nulls = len(dst_groups) > 1  # one group: every block counts (as before groups)
    counts = [sum(1 for b in g if not (nulls and b == NULL_BLOCK)) for g in dst_groups]
    owners = tuple(groups_of_regions) or (0,) * len(regions)
    return sum(r.block_bytes * counts[g] for r, g in zip(regions, owners, strict=True) if g < len(counts))
