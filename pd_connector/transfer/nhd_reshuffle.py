"""Mixed TP on token-major (NHD) KV: heads reshuffled with torch ops through a bounded buffer.

vLLM-Ascend keeps each KV part as ``[num_blocks, block_size, kv_heads, head_dim]``: inside a
block the heads of one token are next to each other, so a head slice of a block is
``block_size`` byte ranges. Instead of one transfer entry per token, each slice of a block
moves as one byte range (as on head-major layouts):

- **P before the write** (P holds more heads than the slice, e.g. P1 -> D2): P gathers the
  slice's heads of a batch of blocks into its staging buffer (``[blocks, block_size, n, dim]``,
  at most ``staging_bytes``; allocated and registered with the KV, see ``transfer.staging``),
  writes each block's part as one range, and reuses the buffer for the next batch.
- **D after the read** (D takes its heads from several P ranks, e.g. P2 -> D1, P4 -> D2): each
  P rank writes its part of a block, ``[block_size, n, dim]``, as one range at offset
  ``dst_head * block_size * dim`` of D's block, so D's block holds the parts one after the other;
  once every P rank is done, D permutes each received block to ``[block_size, heads, dim]`` in
  batches of at most ``staging_bytes`` before vLLM sees the request.

``RankSpec.token_major`` / ``PeerHello.token_major`` say a rank's KV has this layout; P takes
this path when both sides are token major and the plan splits heads.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch

from pd_connector import messages as proto
from pd_connector.layouts.regions import LayoutError, Region, block_dim
from pd_connector.layouts.tp import HeadSlice, plan_decode_rank, slices_from
from pd_connector.metadata import SendJob
from pd_connector.transfer.device_sync import DeviceSync, synchronize_tensor

if TYPE_CHECKING:
    from pd_connector.transfer.context import RankSpec

logger = logging.getLogger(__name__)

Entries = tuple[list[int], list[int], list[int]]
#: backend.write(src, dst, lengths) bound to one peer (raises TransferError).
WriteFn = Callable[[list[int], list[int], list[int]], None]


def token_major_views(
    kv_caches: Mapping[str, Any], num_blocks: int, block_size: int, local_heads: int
) -> list[torch.Tensor] | None:
    """Per region (in ``regions_of_kv_caches`` order) a uint8 view ``[num_blocks, block_size, heads, bytes]``.

    None unless every KV part is token major: ``[num_blocks (* kernel blocks), tokens, local_heads,
    head_dim]`` with tokens, heads and head_dim dense inside a block (blocks may be strided).
    """
    views = []
    for value in kv_caches.values():
        for part in value if isinstance(value, (list, tuple)) else [value]:
            if not isinstance(part, torch.Tensor) or part.dim() != 4 or part.shape[2] != local_heads:
                return None
            try:
                if block_dim(tuple(part.shape), num_blocks)[0] != 0:
                    return None
                view = part.view(num_blocks, block_size, local_heads, part.shape[3]).view(torch.uint8)
            except (LayoutError, RuntimeError):
                return None
            dim_bytes = view.shape[3]
            if view.stride()[1:] != (local_heads * dim_bytes, dim_bytes, 1):
                return None
            views.append(view)
    return views


def needs_staging(slices: Sequence[HeadSlice], p_heads: int, d_heads: int) -> bool:
    """Whether a plan splits a block's heads (so token-major KV goes through this module)."""
    return any(not (s.num_heads == p_heads == d_heads) for s in slices)


def plan_slices(spec: RankSpec, p_tp: int, d_tp: int, d_rank: int, room: int) -> list[HeadSlice]:
    """D rank ``d_rank``'s plan for ``room``, as P and D both compute it."""
    return plan_decode_rank(spec.heads, p_tp, d_tp, d_rank, is_mla=spec.use_mla, spread=room % p_tp)


def staged_work(
    spec: RankSpec, peer: proto.PeerHello, job: SendJob, start: int, dst_blocks: Sequence[int]
) -> tuple[list[HeadSlice], list[tuple[int, int]]] | None:
    """(this P rank's slices, (src, dst) block pairs) when a push goes through this module, else None.

    That is when both sides are token major and the plan splits a block's heads; the caller
    checked the block range.
    """
    if not (spec.token_major and peer.token_major) or not dst_blocks:
        return None
    if spec.heads_outermost and peer.heads_outermost:
        return None  # head slices are byte ranges already (layouts.tp.head_entries)
    plan = plan_slices(spec, spec.tp_size, peer.tp_size, peer.tp_rank, job.room)
    if not needs_staging(plan, spec.local_kv_heads, peer.local_kv_heads):
        return None
    src_blocks = job.block_ids[start : start + len(dst_blocks)]
    return slices_from(plan, spec.tp_rank), list(zip(src_blocks, dst_blocks, strict=True))


class NhdReshuffle:
    """One rank's token-major KV views and its bounded staging buffer (P: gather; D: permute).

    Its torch ops run on the calling transfer thread, bound to the rank's device (``device_sync``),
    on that thread's current stream, which ``_synchronize`` waits for.
    """

    #: The rank's device seam (``KVTransferManager`` sets it); None: chosen from each tensor's device.
    device: DeviceSync | None = None

    def __init__(self, views: Sequence[torch.Tensor], staging_bytes: int, staging: torch.Tensor | None = None) -> None:
        """``staging``: P's registered buffer (``transfer.staging.aligned_buffer``), None on D (it stages nothing)."""
        self.views = list(views)
        self.staging_bytes = staging_bytes
        self._staging = staging
        self._lock = threading.Lock()

    @property
    def registered_ranges(self) -> list[tuple[int, int]]:
        """(addr, length) of the staging buffer, registered with the KV's ranges; [] without one."""
        buf = self._staging
        return [] if buf is None else [(buf.data_ptr(), buf.numel())]

    # ------------------------------------------------------------------ P side

    def _buffer(self) -> torch.Tensor:
        """The staging buffer registered at KV registration time. Caller holds the lock."""
        if self._staging is None:
            raise LayoutError("this rank has no NHD staging buffer (a decode rank stages nothing)")
        return self._staging

    def push(
        self,
        src_regions: Sequence[Region],
        dst_regions: Sequence[Region],
        slices: Sequence[HeadSlice],
        pairs: Sequence[tuple[int, int]],
        write: WriteFn,
    ) -> tuple[int, int]:
        """Write this P rank's ``slices`` of blocks ``pairs`` (src, dst) into D's token-major blocks.

        Returns (bytes, entries). Slices with all of P's heads go straight from P's blocks; the
        others through the staging buffer, one batch of blocks at a time.
        """
        direct: Entries = ([], [], [])
        nbytes = entries = 0
        staged: list[tuple[int, HeadSlice]] = []
        for r, (src, dst, view) in enumerate(zip(src_regions, dst_regions, self.views, strict=True)):
            block_size, p_heads, dim_bytes = view.shape[1:]
            for s in slices:
                if s.num_heads != p_heads:
                    staged.append((r, s))
                    continue
                length = s.num_heads * block_size * dim_bytes
                for sb, db in pairs:
                    direct[0].append(src.base + sb * src.block_stride)
                    direct[1].append(dst.base + db * dst.block_stride + s.dst_head * block_size * dim_bytes)
                    direct[2].append(length)
        if direct[0]:
            write(*direct)
            nbytes, entries = sum(direct[2]), len(direct[2])
        for r, s in staged:
            b, e = self._push_staged(self.views[r], dst_regions[r], s, pairs, write)
            nbytes, entries = nbytes + b, entries + e
        return nbytes, entries

    def _push_staged(
        self, view: torch.Tensor, dst: Region, s: HeadSlice, pairs: Sequence[tuple[int, int]], write: WriteFn
    ) -> tuple[int, int]:
        block_size, _, dim_bytes = view.shape[1:]
        chunk = s.num_heads * block_size * dim_bytes
        per_batch = self.staging_bytes // chunk
        if per_batch < 1:
            raise LayoutError(f"staging_bytes {self.staging_bytes} is smaller than one block's head slice ({chunk})")
        heads = view.narrow(2, s.src_head, s.num_heads)
        nbytes = entries = 0
        for start in range(0, len(pairs), per_batch):
            batch = pairs[start : start + per_batch]
            idx = torch.tensor([sb for sb, _ in batch], dtype=torch.long, device=view.device)
            with self._lock:
                buf = self._buffer()
                out = buf[: len(batch) * chunk].view(len(batch), block_size, s.num_heads, dim_bytes)
                torch.index_select(heads, 0, idx, out=out)
                _synchronize(out, self.device)  # the gather is done before the backend reads it
                base = buf.data_ptr()
                src = [base + i * chunk for i in range(len(batch))]
                dst_addrs = [dst.base + db * dst.block_stride + s.dst_head * block_size * dim_bytes for _, db in batch]
                write(src, dst_addrs, [chunk] * len(batch))
            nbytes, entries = nbytes + chunk * len(batch), entries + len(batch)
        return nbytes, entries

    # ------------------------------------------------------------------ D side

    def reformat(self, blocks: Sequence[int], slices: Sequence[HeadSlice]) -> None:
        """Turn received blocks from slice-after-slice into ``[block_size, heads, dim]`` (in place)."""
        if len(slices) <= 1 or not blocks:
            return
        for view in self.views:
            block_size, d_heads, dim_bytes = view.shape[1:]
            block_bytes = block_size * d_heads * dim_bytes
            per_batch = max(1, self.staging_bytes // (2 * block_bytes))
            for start in range(0, len(blocks), per_batch):
                idx = torch.tensor(list(blocks[start : start + per_batch]), dtype=torch.long, device=view.device)
                raw = view.index_select(0, idx).view(len(idx), -1)
                out = torch.empty((len(idx), block_size, d_heads, dim_bytes), dtype=torch.uint8, device=view.device)
                for s in slices:
                    off = s.dst_head * block_size * dim_bytes
                    part = raw[:, off : off + s.num_heads * block_size * dim_bytes]
                    out[:, :, s.dst_head : s.dst_head + s.num_heads] = part.view(
                        len(idx), block_size, s.num_heads, dim_bytes
                    )
                view.index_copy_(0, idx, out)
            _synchronize(view, self.device)  # permuted before vLLM's stream reads the blocks


def _synchronize(t: torch.Tensor, device: DeviceSync | None) -> None:
    """Wait for the work this thread queued on ``t``'s device (its current stream there; a no-op on
    CPU), before the backend (P's staging buffer) or vLLM (D's permuted blocks) reads ``t``.

    ``device``: the rank's seam (``device_sync``); None: the torch module of ``t``'s device."""
    synchronize_tensor(t, device)
