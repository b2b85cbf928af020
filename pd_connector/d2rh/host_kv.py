"""D2RH, a D rank's side (pd_connector.d2rh.scheduler has the scheduler's): the host KV pool's memory and its copies.

**Memory.** One host buffer (pinned when the KV is on an accelerator, 2 MiB-aligned like the NHD
staging buffer) holds ``host_blocks`` blocks of every KV region of the rank, region by region, each
block dense (stride = the region's block bytes). Those host regions are what the rank announces to P
in its hello (``PeerHello.regions``, ``num_blocks`` = the pool's size) and registers with the
transfer backend, so P's pushes (and P's write guard) target host block ids exactly as they target
device block ids without D2RH: P needs nothing new.

**Copies.** A ``HostLoad`` copies host blocks into the request's device blocks region by region, in
``start_load_kv`` on the forward's thread and stream (queued before this step's forward; a later
forward reading those blocks runs after it on that stream). The request goes to vLLM
(``finished_recving``) and the scheduler unpins the host blocks only once a device marker recorded
after the copy completed (on CPU the copy is synchronous); so no host block is reused while a copy
may still read it.

**Staging outcomes.** In D2RH mode every ``DecodeSide`` load is a staging load into host blocks; its
end (ok, or failed once every P rank asked stopped writing: ``transfer.loads``) is reported to the
scheduler in the worker metadata (``D2RHWorkerMeta.staged``), never to vLLM.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch

from pd_connector.config import ConfigError, DisaggConfig
from pd_connector.d2rh.host_pool import HostPool
from pd_connector.d2rh.scheduler import D2RHScheduler, D2RHWorkerMeta
from pd_connector.layouts.regions import Region, block_runs
from pd_connector.metadata import HostLoad
from pd_connector.transfer.device_sync import NO_DEVICE, DeviceSync, Marker
from pd_connector.transfer.outbox import Outbox
from pd_connector.transfer.staging import STAGING_ALIGN, round_up
from pd_connector.transfer.stats import TransferStats

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

logger = logging.getLogger(__name__)


def pool_blocks(cfg: DisaggConfig, device_blocks: int) -> int:
    """The host pool's size: ``host_pool_blocks``, else the device cache's block count."""
    return cfg.host_pool_blocks or device_blocks


def d2rh_scheduler(
    cfg: DisaggConfig, vllm_config: VllmConfig, kv_cache_config: KVCacheConfig | None, block_size: int, groups: int
) -> D2RHScheduler:
    """The scheduler side of D2RH mode for this engine (one host pool index for all its ranks)."""
    if groups > 1:
        raise ConfigError(
            "kv_connector_extra_config.d2rh: the host KV pool serves models with one KV cache group; this model "
            f"has {groups} (hybrid): start decode without d2rh, or with --disable-hybrid-kv-cache-manager"
        )
    device_blocks = int(getattr(kv_cache_config, "num_blocks", 0) or vllm_config.cache_config.num_gpu_blocks or 0)
    capacity = pool_blocks(cfg, device_blocks)
    par = vllm_config.parallel_config
    ranks = par.tensor_parallel_size * par.pipeline_parallel_size
    logger.info(
        "D2RH: host KV pool of %d blocks (device cache %d), %d rank(s); d2rh_zmq_port %d and "
        "d2rh_scheduler_ready_port %d are not opened (rank channel and vLLM's worker metadata carry their messages)",
        capacity, device_blocks, ranks, cfg.d2rh_zmq_port, cfg.d2rh_scheduler_ready_port,
    )  # fmt: skip
    return D2RHScheduler(HostPool(capacity), block_size, ranks, cfg.kv_wait_timeout_s)


def _storage_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """The whole storage under ``tensor`` as a flat uint8 tensor (same device)."""
    storage = tensor.untyped_storage()
    return torch.empty(0, dtype=torch.uint8, device=tensor.device).set_(storage, 0, (storage.nbytes(),), (1,))


def device_block_views(kv_caches: Mapping[str, Any], regions: Sequence[Region], num_blocks: int) -> list[torch.Tensor]:
    """Per region, a ``[num_blocks, block_bytes]`` uint8 view of the KV memory (rows ``block_stride`` apart)."""
    flats = []
    for value in kv_caches.values():
        for part in value if isinstance(value, (list, tuple)) else [value]:
            flat = _storage_bytes(part)
            flats.append((flat.data_ptr(), flat.numel(), flat))
    views = []
    for r in regions:
        for ptr, size, flat in flats:
            if ptr <= r.base and r.base + (num_blocks - 1) * r.block_stride + r.block_bytes <= ptr + size:
                views.append(flat.as_strided((num_blocks, r.block_bytes), (r.block_stride, 1), r.base - ptr))
                break
        else:
            raise ValueError(f"KV region at 0x{r.base:x} lies in no KV tensor's storage")
    return views


class HostKV:
    """The host pool's memory: one buffer, a dense host region per KV region."""

    def __init__(
        self, kv_caches: Mapping[str, Any], regions: Sequence[Region], num_blocks: int, host_blocks: int
    ) -> None:
        first = next(iter(kv_caches.values()))
        first = first[0] if isinstance(first, (list, tuple)) else first
        self.device = first.device
        pin = self.device.type != "cpu"
        total = sum(host_blocks * r.block_bytes for r in regions)
        size = round_up(total)
        raw = torch.empty(size + STAGING_ALIGN, dtype=torch.uint8, pin_memory=pin)
        offset = (-raw.data_ptr()) % STAGING_ALIGN
        self.buffer = raw[offset : offset + size]
        self.host_blocks = host_blocks
        self.regions: list[Region] = []
        self._host_views: list[torch.Tensor] = []
        at = 0
        for r in regions:
            view = self.buffer[at : at + host_blocks * r.block_bytes].view(host_blocks, r.block_bytes)
            self._host_views.append(view)
            self.regions.append(Region(view.data_ptr(), r.block_bytes, r.block_bytes))
            at += host_blocks * r.block_bytes
        self._device_views = device_block_views(kv_caches, regions, num_blocks)
        self.block_bytes = sum(r.block_bytes for r in regions)  # one block id, all regions
        logger.info(
            "D2RH host KV pool: %d blocks x %d bytes (%d regions) at 0x%x%s",
            host_blocks, self.block_bytes, len(regions), self.buffer.data_ptr(), ", pinned" if pin else "",
        )  # fmt: skip

    @property
    def ranges(self) -> list[tuple[int, int]]:
        """Memory to register with the transfer backend (P writes there)."""
        return [(self.buffer.data_ptr(), self.buffer.numel())]

    def copy_to_device(self, host_ids: Sequence[int], device_ids: Sequence[int]) -> int:
        """Queue the copy of ``host_ids`` into ``device_ids`` (pairwise) on the current stream; its bytes."""
        runs = block_runs(list(host_ids), list(device_ids))
        blocking = self.device.type == "cpu"
        for host, dev in zip(self._host_views, self._device_views, strict=True):
            for src, dst, n in runs:
                dev[dst : dst + n].copy_(host[src : src + n], non_blocking=not blocking)
        return len(host_ids) * self.block_bytes


class D2RHWorker:
    """One D rank's D2RH work: host loads, and the staging outcomes it reports to the scheduler."""

    def __init__(
        self, host: HostKV, stats: TransferStats, submit: Callable[..., None], device: DeviceSync = NO_DEVICE
    ) -> None:
        self.host = host
        self._stats = stats
        self._submit = submit
        self._device = device
        self.outbox = Outbox()  # host loads done: vLLM's finished_recving
        self._lock = threading.Lock()
        self._staged: dict[str, list[int]] = {}
        self._loaded: dict[str, int] = {}

    def staging_ended(self, recving: set[str], failed: Mapping[str, Any]) -> None:
        """DecodeSide's loads that ended (into host blocks): the scheduler hears it with the worker metadata."""
        with self._lock:
            for rid in recving:
                self._staged[rid] = [1, 1 if rid in failed else 0]

    def run_loads(self, loads: Sequence[HostLoad]) -> None:
        """Forward thread (start_load_kv): copy each load's host blocks into its device blocks."""
        for load in loads:
            if load.failed:
                logger.error("req=%s: its staging in D's host pool failed; the load is reported failed", load.req_id)
                self._done(load.req_id, failed_blocks=list(load.dst_block_ids))
                continue
            started = time.perf_counter()
            nbytes = self.host.copy_to_device(load.host_block_ids, load.dst_block_ids)
            marker = self._device.record()
            if self._device is NO_DEVICE:
                self._finish(load, nbytes, started, marker)
            else:  # wait for the device off the forward's thread
                self._submit(self._finish, load, nbytes, started, marker)

    def _finish(self, load: HostLoad, nbytes: int, started: float, marker: Marker) -> None:
        marker.wait()
        seconds = time.perf_counter() - started
        self._stats.observe_host_load(nbytes, load.hit_blocks, seconds)
        logger.info(
            "req=%s: %d blocks host -> device in %.2f ms (%d host-pool hits)",
            load.req_id, len(load.dst_block_ids), seconds * 1e3, load.hit_blocks,
        )  # fmt: skip
        self._done(load.req_id)

    def _done(self, rid: str, failed_blocks: list[int] | None = None) -> None:
        with self._lock:
            self._loaded[rid] = self._loaded.get(rid, 0) + 1
        self.outbox.received(rid, failed_blocks=failed_blocks)

    def take_meta(self) -> D2RHWorkerMeta | None:
        with self._lock:
            if not self._staged and not self._loaded:
                return None
            meta = D2RHWorkerMeta(self._staged, self._loaded)
            self._staged, self._loaded = {}, {}
        return meta
