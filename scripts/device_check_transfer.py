"""The device check's transfer cases (scripts/device_check.py): the connector's transfer path on device memory.

- ``mooncake_connector``: a P and a D ``KVTransferManager`` (bootstrap server, ZMQ hand-shake, batched
  writes, DONE) over the project's Mooncake backend (TCP), KV on the accelerator (CPU without one);
  D's blocks are compared byte for byte with P's, and D's other blocks must be untouched.
- ``d2rh_host_to_device``: D2RH mode as ``worker.py`` wires it: D announces its host pool
  (``host_kv.HostKV``, pinned next to an accelerator), P pushes a request into host blocks through the
  same path, then ``host_kv.D2RHWorker.run_loads`` copies host -> device (the forward's stream, a
  device marker before the load is reported); staged and copied bytes are both compared.
- ``sweep``: ``benchmarks.transfer.measure`` (the connector's path vs one raw Mooncake write of the same
  bytes, ``ratio`` = raw_s / connector_s) with KV in host memory, and in device memory when there is
  an accelerator, for 16, 32 and 128-token blocks.

Nothing here imports vLLM (``pd_connector.vllm_lines.bases`` stands in for its two metadata base classes).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from benchmarks.transfer import DEFAULT_SHAPE, measure, pair_of_managers, scattered_blocks, wait_finished
from pd_connector.d2rh.host_kv import D2RHWorker, HostKV
from pd_connector.layouts.regions import regions_of_kv_caches
from pd_connector.metadata import HostLoad, RecvJob, SendJob
from pd_connector.transfer.device_sync import DeviceSync, for_device

HEADS, BLOCK_SIZE, HEAD_DIM = 8, 16, 128
MOONCAKE = {"protocol": "tcp"}  # said explicitly: the platform probe would ask vLLM
SWEEP_BLOCK_SIZES = (16, 32, 128)
#: The sweep's default KV: small, so a CPU run stays within seconds (``--sweep big``: benchmarks/transfer.py's).
SMALL_SHAPE = {"layers": 2, "kv_heads": 2, "head_dim": 64, "prompt_tokens": 256}
RATIO = "raw_s_median / connector_s_median: the connector's throughput as a share of one raw Mooncake write"


def mooncake_missing() -> str | None:
    """Why Mooncake's transfer engine cannot be used here, or None."""
    try:
        import mooncake.engine  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - any failure to load the engine is a reason to skip
        return (
            f"mooncake is not importable ({type(exc).__name__}: {exc}); install mooncake-transfer-engine "
            "(CPU) or run under the GPU kit's run_kit.sh (CUDA 13 build)"
        )
    return None


def _random_kv(layers: int, blocks: int, device: torch.device, seed: int) -> dict[str, torch.Tensor]:
    """Per-layer KV ``[blocks, heads, block_size, 2 * head_dim]`` of float16, every bit pattern random."""
    g = torch.Generator().manual_seed(seed)
    shape = (blocks, HEADS, BLOCK_SIZE, 2 * HEAD_DIM)
    return {
        f"layers.{i}": torch.randint(-(2**15), 2**15, shape, dtype=torch.int16, generator=g).view(torch.float16).to(device)
        for i in range(layers)
    }  # fmt: skip


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """``t``'s rows as int16 (the KV's own bit patterns), on the CPU."""
    return t.contiguous().view(torch.int16).cpu()


def _exact(p_kv: dict[str, torch.Tensor], d_kv: dict[str, torch.Tensor], src: list[int], dst: list[int]) -> bool:
    return all(torch.equal(_bytes(p_kv[n][src]), _bytes(d_kv[n][dst])) for n in p_kv)


def _untouched(d_kv: dict[str, torch.Tensor], written: list[int], fill: float) -> bool:
    """D's blocks outside ``written`` still hold ``fill`` (no stray write)."""
    rest = [b for b in range(next(iter(d_kv.values())).shape[0]) if b not in set(written)]
    return all(bool((t[rest] == fill).all()) for t in d_kv.values())


def _run(name: str, body: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """A case's JSON: its body's fields with status ok, or status failed and the error."""
    t0 = time.perf_counter()
    try:
        out = {"status": "ok", **body()}
    except Exception as exc:  # noqa: BLE001 - the report names the failure instead of dying
        out = {"status": "failed", "error": f"{type(exc).__name__}: {exc}"}
    return {"name": name, **out, "seconds": round(time.perf_counter() - t0, 3)}


def _pair_io(layers: int, blocks: int, device: torch.device) -> tuple[dict, dict, DeviceSync, list[int], list[int]]:
    """P's random KV, D's KV of -1, the device seam, and P's and D's (scattered) block ids of one request."""
    p_kv = _random_kv(layers, blocks, device, seed=blocks)
    d_kv = {n: torch.full_like(t, -1.0) for n, t in p_kv.items()}
    sync = for_device(device)
    sync.synchronize(next(iter(d_kv.values())))  # the fills landed before any transfer reads or writes
    half = blocks // 2
    return p_kv, d_kv, sync, scattered_blocks(blocks, half, run=3, offset=0), scattered_blocks(blocks, half, 2, 1)


def mooncake_connector(device: torch.device, layers: int, blocks: int) -> dict[str, Any]:
    """P -> D through the connector's transfer path, Mooncake TCP, KV on ``device``: byte-exact."""
    why = mooncake_missing()
    if why is not None:
        return {"name": "mooncake_connector", "status": "skipped", "reason": why}

    def body() -> dict[str, Any]:
        p_kv, d_kv, sync, src, dst = _pair_io(layers, blocks, device)
        tokens = len(src) * BLOCK_SIZE
        pair = pair_of_managers(p_kv, d_kv, blocks, BLOCK_SIZE, "float16", "mooncake", extra=MOONCAKE, device=sync)
        try:
            t0 = time.perf_counter()
            pair.d_mgr.add_recvs([RecvJob("dc-mooncake", 1, "127.0.0.1", pair.bport, 0, dst, 0, tokens)])
            pair.p_mgr.add_sends([SendJob("p-dc-mooncake", 1, src, tokens)])
            wait_finished(pair.d_mgr, "dc-mooncake", timeout=120)
            seconds = time.perf_counter() - t0
        finally:
            pair.close()
        nbytes = len(src) * p_kv["layers.0"][0].numel() * 2 * layers
        return {
            "kv_memory": str(device),
            "layers": layers,
            "blocks": len(src),
            "bytes": nbytes,
            "byte_exact": _exact(p_kv, d_kv, src, dst),
            "untouched_intact": _untouched(d_kv, dst, -1.0),
            "transfer_ms": round(seconds * 1e3, 2),
        }

    return _run("mooncake_connector", body)


def d2rh_copy(device: torch.device, layers: int, blocks: int) -> dict[str, Any]:
    """D2RH: P pushes into D's host pool (Mooncake, else the in-process device_copy backend), then
    ``D2RHWorker`` copies host -> device; staged bytes and device bytes both byte-exact."""
    backend = "mooncake" if mooncake_missing() is None else "device_copy"

    def body() -> dict[str, Any]:
        p_kv, d_kv, sync, src, _ = _pair_io(layers, blocks, device)
        host = HostKV(d_kv, regions_of_kv_caches(d_kv, blocks), blocks, blocks)
        host_ids = scattered_blocks(blocks, len(src), run=2, offset=1)
        dev_ids = scattered_blocks(blocks, len(src), run=3, offset=1)
        tokens = len(src) * BLOCK_SIZE
        extra = MOONCAKE if backend == "mooncake" else None
        pair = pair_of_managers(p_kv, d_kv, blocks, BLOCK_SIZE, "float16", backend, extra=extra, device=sync,
                                d_regions=host.regions, d_num_blocks=host.host_blocks, d_ranges=host.ranges)  # fmt: skip
        try:
            pair.d_mgr.add_recvs([RecvJob("dc-d2rh", 2, "127.0.0.1", pair.bport, 0, host_ids, 0, tokens)])
            pair.p_mgr.add_sends([SendJob("p-dc-d2rh", 2, src, tokens)])
            wait_finished(pair.d_mgr, "dc-d2rh", timeout=120)
            staged = all(
                torch.equal(_bytes(p_kv[n][src]).view(torch.uint8).view(len(src), -1), _host_rows(host, i, host_ids))
                for i, n in enumerate(p_kv)
            )
            worker = D2RHWorker(host, pair.d_mgr.stats, pair.d_mgr.pool.submit, sync)
            t0 = time.perf_counter()
            worker.run_loads([HostLoad("dc-d2rh", host_ids, dev_ids)])  # this thread plays the forward's
            deadline, done = time.monotonic() + 60, False
            while not done and time.monotonic() < deadline:
                worker.outbox.wait(0.05)
                _, recving, failed = worker.outbox.take()
                if failed:
                    raise RuntimeError(f"host -> device copy reported failed: {failed}")
                done = "dc-d2rh" in recving
            seconds = time.perf_counter() - t0
            if not done:
                raise TimeoutError("the host -> device copy was not reported within 60 s")
            meta = worker.take_meta()
        finally:
            pair.close()
        return {
            "kv_memory": str(device),
            "host_pinned": bool(host.buffer.is_pinned()),
            "staging_backend": backend,
            "layers": layers,
            "blocks": len(src),
            "bytes": len(src) * host.block_bytes,
            "staged_byte_exact": staged,
            "byte_exact": _exact(p_kv, d_kv, src, dev_ids),
            "untouched_intact": _untouched(d_kv, dev_ids, -1.0),
            "loaded_reported": meta is not None and meta.loaded.get("dc-d2rh") == 1,
            "copy_ms": round(seconds * 1e3, 3),
        }

    return _run("d2rh_host_to_device", body)


def _host_rows(host: HostKV, region: int, ids: list[int]) -> torch.Tensor:
    """Rows ``ids`` of the host pool's region ``region`` as uint8 ``[len(ids), block_bytes]``."""
    r = host.regions[region]
    at = r.base - host.buffer.data_ptr()
    return host.buffer[at : at + host.host_blocks * r.block_bytes].view(host.host_blocks, r.block_bytes)[ids]


def sweep(device: torch.device, size: str, rounds: int) -> dict[str, Any]:
    """Connector vs one raw Mooncake write, KV in host memory (and device memory on an accelerator)."""
    shape = dict(DEFAULT_SHAPE if size == "big" else SMALL_SHAPE)
    out: dict[str, Any] = {"ratio": RATIO, "size": size, "shape": shape, "rounds": rounds, "rows": []}
    why = mooncake_missing()
    if why is not None:
        return {**out, "status": "skipped", "reason": why}
    memories = [torch.device("cpu")] + ([device] if device.type != "cpu" else [])
    for memory in memories:
        for block_size in SWEEP_BLOCK_SIZES:
            row: dict[str, Any] = {"kv_memory": "host" if memory.type == "cpu" else "device", "device": str(memory),
                                   "block_size": block_size}  # fmt: skip
            try:
                r = measure(**shape, block_size=block_size, rounds=rounds, device=memory, extra=MOONCAKE)
                keep = ("bytes", "entries_per_transfer", "connector_s_median", "raw_s_median", "connector_gbps")
                row.update({k: r[k] for k in (*keep, "raw_gbps", "ratio")}, byte_exact=True)
            except AssertionError as exc:  # measure: a block landed wrong
                row.update(byte_exact=False, error=str(exc))
            except Exception as exc:  # noqa: BLE001 - the row names the failure
                row.update(error=f"{type(exc).__name__}: {exc}")
            out["rows"].append(row)
    failed = any("error" in r for r in out["rows"])
    return {**out, "status": "failed" if failed else "ok"}
