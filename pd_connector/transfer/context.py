"""What both transfer sides share: this rank's KV facts and the manager's plumbing."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pd_connector import messages as proto
from pd_connector.config import DisaggConfig
from pd_connector.device_sync import NO_DEVICE, DeviceSync
from pd_connector.layout import Region
from pd_connector.trace import TraceBook
from pd_connector.transfer.outbox import Outbox
from pd_connector.transfer.stats import TransferStats

if TYPE_CHECKING:
    from pd_connector.transfer.nhd_reshuffle import NhdReshuffle


@dataclass(frozen=True)
class RankSpec:
    """Where this worker sits in its instance and how its KV looks."""

    tp_rank: int
    tp_size: int
    dp_rank: int
    dp_size: int
    block_size: int
    kv_dtype: str
    num_layers: int
    total_kv_heads: int = 1  # 1 for MLA
    local_kv_heads: int = 1
    use_mla: bool = False
    heads_outermost: bool = True
    # KV parts are [blocks, block_size, heads, dim] and a staging buffer is set up: mixed TP goes
    # through transfer.nhd_reshuffle.
    token_major: bool = False
    model: str = ""  # compat.model_fingerprint; "" skips the model check
    num_blocks: int = 0  # KV blocks of each region (0: unknown); peers' writes must stay inside them
    kv_device: str = "cpu"  # torch device type of the KV tensors (transfer.checksum reads them on "cpu")
    region_groups: tuple[int, ...] = ()  # KV cache group of each region (kv_groups); empty: all group 0
    pp_rank: int = 0  # pipeline stage (pp_stages); a stage holds and pushes only its layers
    pp_size: int = 1
    region_layers: tuple[int, ...] = ()  # global layer index of each region (pp_stages); empty: by position

    @property
    def heads(self) -> int:
        """Head count the TP mapping works with (MLA's latent is one replicated head)."""
        return 1 if self.use_mla else self.total_kv_heads


@dataclass(frozen=True)
class RankContext:
    """One rank's settings, KV regions and the manager's channel, pool, stats, outbox and traces."""

    cfg: DisaggConfig
    spec: RankSpec
    regions: Sequence[Region]
    send: Callable[[str, proto.Message], None]  # Channel.send(endpoint, msg)
    submit: Callable[..., None]  # TaskPool.submit(fn, *args)
    stats: TransferStats
    outbox: Outbox
    traces: TraceBook  # this side's phase traces (pd_connector.trace); logged by TP rank 0 only
    reshuffle: NhdReshuffle | None = None  # token-major KV with a staging buffer (mixed TP on NHD)
    device: DeviceSync = NO_DEVICE  # the KV's device: events, streams, thread binding (pd_connector.device_sync)
