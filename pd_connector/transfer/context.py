"""What both transfer sides share: this rank's KV facts and the manager's plumbing."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pd_connector import messages as proto
from pd_connector.config import ConfigError, DisaggConfig
from pd_connector.layouts.regions import Region
from pd_connector.refusals import VLLM_DEFAULT_KV_PORT
from pd_connector.trace import TraceBook
from pd_connector.transfer.device_sync import NO_DEVICE, DeviceSync
from pd_connector.transfer.outbox import Outbox
from pd_connector.transfer.plan_cache import PlanCache
from pd_connector.transfer.stats import TransferStats

if TYPE_CHECKING:
    from pd_connector.transfer.nhd_reshuffle import NhdReshuffle


def side_channel_port(
    kv_port: int, dp_rank: int, tp_rank: int, tp_size: int, pp_rank: int = 0, pp_size: int = 1
) -> int:
    """A rank's ZMQ port from vLLM's ``kv_port``, as vLLM-Ascend's Mooncake connectors place their side channels
    (``vllm_ascend/distributed/mooncake_connector.py``: ``kv_port + dp_rank * tp * pp`` for the DP rank, then
    ``+ pp_rank * tp + tp_rank``; no prefill context parallel here): one port per rank,
    ``kv_port .. kv_port + dp_size * tp_size * pp_size - 1`` for a deployment."""
    return kv_port + dp_rank * tp_size * pp_size + pp_rank * tp_size + tp_rank


def user_kv_port(kv_transfer_config: Any) -> int | None:
    """``kv_transfer_config.kv_port`` as an int when the user set it; None for vLLM's default (14579) or none.

    ConfigError for a value that is not a port."""
    port = getattr(kv_transfer_config, "kv_port", None)
    if port is None or str(port) == str(VLLM_DEFAULT_KV_PORT):
        return None
    try:
        value = int(port)
    except (TypeError, ValueError):
        raise ConfigError(f"kv_transfer_config.kv_port {port!r} is not a port number") from None
    if not 0 < value < 65536:
        raise ConfigError(f"kv_transfer_config.kv_port {value} is not a port number (1-65535)")
    return value


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
    pp_rank: int = 0  # pipeline stage (layouts.pp); a stage holds and pushes only its layers
    pp_size: int = 1
    region_layers: tuple[int, ...] = ()  # global layer index of each region (layouts.pp); empty: by position
    # vLLM's kv_transfer_config.kv_port when the user set it (user_kv_port); None: a random free ZMQ port.
    kv_port: int | None = None

    @property
    def zmq_port(self) -> int | None:
        """The port this rank's ZMQ PULL socket binds (side_channel_port of kv_port); None: a random one."""
        if self.kv_port is None:
            return None
        return side_channel_port(self.kv_port, self.dp_rank, self.tp_rank, self.tp_size, self.pp_rank, self.pp_size)

    @property
    def zmq_port_origin(self) -> str:
        """How zmq_port follows from kv_port, for errors and logs."""
        return (
            f"kv_transfer_config.kv_port {self.kv_port} + dp_rank {self.dp_rank} * tp_size {self.tp_size} * "
            f"pp_size {self.pp_size} + pp_rank {self.pp_rank} * tp_size {self.tp_size} + tp_rank {self.tp_rank}"
        )

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
    device: DeviceSync = (
        NO_DEVICE  # the KV's device: events, streams, thread binding (pd_connector.transfer.device_sync)
    )
    plans: PlanCache = field(default_factory=PlanCache, compare=False)  # P's write plans per peer (plan_cache)
