"""D2RH, a D rank's side (pd_connector.d2rh.host_kv): host regions, host -> device copies, staging outcomes."""

from __future__ import annotations

import ctypes
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace
from typing import Any

import torch

from pd_connector.d2rh.host_kv import D2RHWorker, HostKV, device_block_views
from pd_connector.layouts.regions import regions_of_kv_caches
from pd_connector.metadata import HostLoad
from pd_connector.transfer.stats import TransferStats

NUM_BLOCKS, HOST_BLOCKS, BLOCK, HEADS, DIM = 6, 4, 4, 2, 8


def kv_caches() -> dict[str, torch.Tensor]:
    # CUDA-like layout [2, blocks, ...]: K and V regions with a block stride of one block
    return {f"layer.{i}": torch.zeros(2, NUM_BLOCKS, BLOCK, HEADS, DIM) for i in range(2)}


def test_host_regions_are_dense_blocks_of_each_device_region() -> None:
    caches = kv_caches()
    regions = regions_of_kv_caches(caches, NUM_BLOCKS)
    host = HostKV(caches, regions, NUM_BLOCKS, HOST_BLOCKS)
    assert len(host.regions) == len(regions) == 4
    for dev, h in zip(regions, host.regions, strict=True):
        assert h.block_bytes == dev.block_bytes == h.block_stride
    ((base, size),) = host.ranges
    assert base % (2 << 20) == 0 and size >= HOST_BLOCKS * host.block_bytes
    assert all(base <= r.base and r.base + HOST_BLOCKS * r.block_bytes <= base + size for r in host.regions)


def test_copy_lands_each_host_block_in_its_device_block() -> None:
    caches = kv_caches()
    regions = regions_of_kv_caches(caches, NUM_BLOCKS)
    host = HostKV(caches, regions, NUM_BLOCKS, HOST_BLOCKS)
    for i, r in enumerate(host.regions):  # write through the announced addresses, as P's push does
        view = torch.frombuffer(
            (ctypes.c_uint8 * (HOST_BLOCKS * r.block_bytes)).from_address(r.base),
            dtype=torch.uint8,
        )
        for b in range(HOST_BLOCKS):
            view[b * r.block_bytes : (b + 1) * r.block_bytes] = 10 * i + b + 1
    nbytes = host.copy_to_device([2, 3, 0], [5, 1, 2])
    assert nbytes == 3 * host.block_bytes
    views = device_block_views(caches, regions, NUM_BLOCKS)
    for i, view in enumerate(views):
        assert {int(x) for x in view[5].unique()} == {10 * i + 3}
        assert {int(x) for x in view[1].unique()} == {10 * i + 4}
        assert {int(x) for x in view[2].unique()} == {10 * i + 1}
        assert int(view[0].abs().sum()) == 0 and int(view[3].abs().sum()) == 0  # others untouched


def test_worker_reports_loads_to_vllm_and_staging_to_the_scheduler() -> None:
    caches = kv_caches()
    regions = regions_of_kv_caches(caches, NUM_BLOCKS)
    stats = TransferStats()
    worker = D2RHWorker(HostKV(caches, regions, NUM_BLOCKS, HOST_BLOCKS), stats, lambda fn, *a: fn(*a))
    worker.staging_ended({"a", "b"}, {"b": [1]})
    worker.run_loads([HostLoad("c", [0, 1], [3, 4], hit_blocks=2), HostLoad("d", [], [5], failed=True)])
    _, recving, failed = worker.outbox.take()
    assert recving == {"c", "d"} and failed == {"d": [5]}
    meta = worker.take_meta()
    assert meta is not None and meta.staged == {"a": [1, 0], "b": [1, 1]} and meta.loaded == {"c": 1, "d": 1}
    assert worker.take_meta() is None
    snap = stats.snapshot()
    assert (snap.host_loads, snap.host_hit_blocks, snap.host_load_bytes) == (1, 2, 2 * worker.host.block_bytes)
    interval = stats.take_interval()
    assert interval is not None and len(interval["host_load_seconds"]) == 1


class _SlowDevice:
    """A device whose copies complete only when the test says so (its marker's wait blocks until then)."""

    name = "sim:0"

    def __init__(self) -> None:
        self.done = threading.Event()

    def record(self) -> Any:
        return SimpleNamespace(wait=lambda: self.done.wait(10))

    def bind_thread(self) -> None:
        return None

    def synchronize(self, tensor: torch.Tensor) -> None:
        return None


def test_a_copy_reaches_vllm_and_the_scheduler_only_once_the_device_ran_it() -> None:
    caches = kv_caches()
    regions = regions_of_kv_caches(caches, NUM_BLOCKS)
    device = _SlowDevice()
    pool = ThreadPoolExecutor(1)
    worker = D2RHWorker(HostKV(caches, regions, NUM_BLOCKS, HOST_BLOCKS), TransferStats(), pool.submit, device)
    worker.run_loads([HostLoad("c", [0], [3])])  # queued on the stream; returns at once
    time.sleep(0.2)
    assert worker.outbox.take()[1] == set() and worker.take_meta() is None  # host block still pinned
    device.done.set()
    pool.shutdown(wait=True)
    assert worker.outbox.take()[1] == {"c"}
    meta = worker.take_meta()
    assert meta is not None and meta.loaded == {"c": 1}
