"""The NHD staging buffer (``transfer.nhd_reshuffle``): which rank gets one, and how it is allocated.

**Rule.** A rank gets a staging buffer when it is a prefill rank, ``staging_bytes`` > 0, its KV is
token major (NHD: ``[blocks, block_size, heads, dim]``, not MLA, heads not outermost; see
``nhd_reshuffle.token_major_views``) and mixed TP may occur: the config's ``decode.tp_size`` is
absent or differs from this rank's TP size. A decode rank never gets one: it permutes what landed
with transient tensors and registers nothing more than its KV. A prefill rank without a buffer
advertises no token-major reshuffling, so a decode instance whose TP size would need it is refused
at the handshake (``compat.peer_problem``) instead of failing a transfer.

**Allocation.** At KV registration time (``worker.PDWorker.register_kv_caches``), never from a
transfer thread: on the KV's device, with 2 MiB of slack and sliced to a 2 MiB-aligned start, its
size rounded up to 2 MiB (vLLM-Ascend allocates its KV slices so, and Mooncake's ``ascend``
transport expects registered memory so). Its range is registered in the same ``register`` call as
the KV's ranges and counted against the transport's region limit (``rank_checks.check_kv_memory``).
The buffer may be larger than ``staging_bytes``; a batch still uses at most ``staging_bytes``.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

from pd_connector.transfer.nhd_reshuffle import NhdReshuffle, token_major_views

if TYPE_CHECKING:
    from pd_connector.config import DisaggConfig

logger = logging.getLogger(__name__)

#: Alignment of the staging buffer's start address and size (vLLM-Ascend's KV slices: 2 MiB).
STAGING_ALIGN = 2 << 20


def round_up(nbytes: int, align: int = STAGING_ALIGN) -> int:
    """``nbytes`` rounded up to a multiple of ``align`` (at least one ``align``)."""
    return max(1, -(-nbytes // align)) * align


def aligned_buffer(nbytes: int, device: torch.device, align: int = STAGING_ALIGN) -> torch.Tensor:
    """A uint8 tensor on ``device`` of ``round_up(nbytes)`` bytes starting at an ``align``-aligned address.

    The slice keeps the whole allocation (``align`` bytes of slack) alive.
    """
    size = round_up(nbytes, align)
    raw = torch.empty(size + align, dtype=torch.uint8, device=device)
    offset = (-raw.data_ptr()) % align
    return raw[offset : offset + size]


def mixed_tp_possible(cfg: DisaggConfig, tp_size: int) -> bool:
    """Whether a decode instance with another TP size may connect (``decode.tp_size`` absent or different)."""
    decode_tp = cfg.decode.tp_size if cfg.decode is not None else None
    return decode_tp is None or decode_tp != tp_size


def nhd_reshuffle(
    cfg: DisaggConfig,
    kv_caches: Mapping[str, Any],
    num_blocks: int,
    block_size: int,
    local_heads: int,
    *,
    use_mla: bool,
    heads_outermost: bool,
    tp_size: int,
) -> NhdReshuffle | None:
    """This rank's head reshuffling for mixed TP on token-major KV, with P's staging buffer; None if none.

    The caller registers ``registered_ranges`` of the result with the KV's ranges (see the module's rule).
    """
    if use_mla or not cfg.staging_bytes or (local_heads > 1 and heads_outermost):
        return None  # head-major KV moves head slices as byte ranges already
    views = token_major_views(kv_caches, num_blocks, block_size, local_heads)
    if not views:
        return None
    if cfg.is_decode:
        return NhdReshuffle(views, cfg.staging_bytes)
    if not mixed_tp_possible(cfg, tp_size):
        logger.info("no NHD staging buffer: decode.tp_size is this rank's TP size %d", tp_size)
        return None
    buf = aligned_buffer(cfg.staging_bytes, views[0].device)
    logger.info(
        "NHD staging buffer of %d bytes at 0x%x on %s (staging_bytes %d)",
        buf.numel(),
        buf.data_ptr(),
        buf.device,
        cfg.staging_bytes,
    )
    return NhdReshuffle(views, cfg.staging_bytes, buf)
