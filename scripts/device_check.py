"""Device check: does P's KV push wait for an asynchronous accelerator? torch only.

    python scripts/device_check.py [--layers 24] [--blocks 64] [--work 16]   # prints one JSON object

On a CUDA GPU (one run well under 8 minutes, nothing to install: no Mooncake, no vLLM):

- P's and D's KV live in device memory; the bytes move through ``TorchCopyBackend``, a test
  ``TransferBackend`` (pd_connector/transfer/backend.py) that copies with torch on its *own* stream
  and synchronises that stream before ``write`` returns, as a DMA engine would;
- the forward is simulated on a side stream: per layer, ``--work`` chained matmuls (slow on purpose),
  then a kernel writing the layer's KV, then the hook (``save_kv_layer``) at once, while the device
  is still busy;
- layer mode pushes layer by layer through the real ``LayerStreams`` (transfer/layerwise.py) when
  its imports are there (msgspec), else through a minimal per-layer pusher with the same ordering;
  request mode pushes every layer after the forward, behind one marker;
- each mode runs with the ordering on (``device_sync.TorchDeviceSync``: a marker on the forward's
  stream, the push thread bound to the device waits for it) and off (``NO_DEVICE``: the old
  ordering), and D's blocks are compared byte for byte with what the forward wrote.

Expected on a GPU: ordering on, every layer exact; ordering off, stale layers (the corruption the
ordering prevents). On CPU (no GPU: the JSON says so) the same pipeline runs on CPU tensors, where
kernels are synchronous: both orderings are exact and no corruption can be shown; the unit test
tests/unit/test_device_check.py runs it so. No GPU was available in the session that wrote this
script: it has run on CPU only, its GPU numbers are still to be taken.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import sys
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pd_connector.device_sync import NO_DEVICE, DeviceSync, Marker, for_device  # noqa: E402
from pd_connector.transfer.backend import Ints, TransferError, Wanted, write_in_batches  # noqa: E402

HEADS, BLOCK_SIZE, HEAD_DIM = 8, 16, 128
_TABLE: dict[bytes, TorchCopyBackend] = {}
_IDS = itertools.count(1)


class TorchCopyBackend:
    """A TransferBackend over torch copies between registered tensors of this process, on its own stream."""

    def __init__(self, device: torch.device) -> None:
        self._descriptor = f"torch-copy-{next(_IDS)}".encode()
        self._device = device
        self._tensors: list[tuple[int, int, torch.Tensor]] = []  # (base, bytes, flat uint8 view)
        self._ranges: list[tuple[int, int]] = []
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        _TABLE[self._descriptor] = self

    @property
    def descriptor(self) -> bytes:
        return self._descriptor

    def track(self, tensors: Sequence[torch.Tensor]) -> None:
        """Tensors whose memory ``register`` may name (torch cannot copy from a bare device address)."""
        for t in tensors:
            self._tensors.append((t.data_ptr(), t.numel() * t.element_size(), t.view(-1).view(torch.uint8)))

    def register(self, ranges: Sequence[tuple[int, int]]) -> None:
        for addr, n in ranges:
            self._find(addr, n)
            self._ranges.append((addr, n))

    def _find(self, addr: int, n: int) -> tuple[torch.Tensor, int]:
        for base, size, flat in self._tensors:
            if base <= addr and addr + n <= base + size:
                return flat, addr - base
        raise TransferError(f"range 0x{addr:x}+{n} is not in a tracked tensor")

    def write(self, peer_descriptor: bytes, src: Ints, dst: Ints, lengths: Ints, max_batch: int,
              still_wanted: Wanted = None) -> None:  # fmt: skip
        peer = _TABLE.get(peer_descriptor)
        if peer is None:
            raise TransferError(f"no torch-copy backend {peer_descriptor!r}")

        def batch(s: list[int], d: list[int], n: list[int]) -> int:
            with torch.cuda.stream(self._stream) if self._stream is not None else contextlib.nullcontext():
                for s_addr, d_addr, length in zip(s, d, n, strict=True):
                    s_flat, s_off = self._find(s_addr, length)
                    d_flat, d_off = peer._find(d_addr, length)
                    d_flat[d_off : d_off + length].copy_(s_flat[s_off : s_off + length], non_blocking=True)
            if self._stream is not None:
                self._stream.synchronize()  # landed before write returns (as Mooncake's synchronous transfer)
            return 0

        write_in_batches(batch, src, dst, lengths, max_batch, still_wanted, what="torch copy", peer="d")

    def close(self) -> None:
        _TABLE.pop(self._descriptor, None)


class Forward:
    """The simulated forward: per layer, slow kernels, then the layer's KV write, on a side stream."""

    def __init__(self, device: torch.device, work: int) -> None:
        self.device = device
        self.work = work
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        n = 4096 if device.type == "cuda" else 64  # on an H200 a 4096^3 matmul takes about 0.2 ms
        self._a = torch.randn(n, n, device=device, dtype=torch.float16) / n**0.5
        self._w = torch.randn(n, n, device=device, dtype=torch.float16) / n**0.5
        _ = self._a @ self._w  # warm-up (cuBLAS handles) outside the timed part
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def layer(self, kv: torch.Tensor, blocks: torch.Tensor, fresh: torch.Tensor) -> None:
        x = self._a
        for _ in range(self.work):
            x = x @ self._w
        kv.index_copy_(0, blocks, fresh)

    def context(self) -> Any:
        return torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext()


def _entries(p: torch.Tensor, d: torch.Tensor, src: list[int], dst: list[int]) -> tuple[list[int], ...]:
    block = p[0].numel() * p.element_size()
    return (
        [p.data_ptr() + b * block for b in src],
        [d.data_ptr() + b * block for b in dst],
        [block] * len(src),
    )


def _pusher_layer_mode(sync: DeviceSync, backend: TorchCopyBackend, peer: bytes,
                       entries: list[tuple[list[int], ...]]) -> tuple[Callable[[int], None], Callable[[], None]]:  # fmt: skip
    """The minimal pusher (no msgspec): per layer a marker now, the bound writer thread waits, then writes."""
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="check-push", initializer=sync.bind_thread)
    futures = []

    def write(marker: Marker, layer: int) -> None:
        marker.wait()
        backend.write(peer, *entries[layer], max_batch=4096)

    def on_layer(layer: int) -> None:
        futures.append(pool.submit(write, sync.record(), layer))

    def finish() -> None:
        for f in futures:
            f.result()
        pool.shutdown()

    return on_layer, finish


def _layer_streams(sync: DeviceSync, backend: TorchCopyBackend, peer: TorchCopyBackend, p_kv: dict, d_kv: dict,
                   src: list[int], dst: list[int]) -> tuple[Callable[[int], None], Callable[[], None]]:  # fmt: skip
    """The real LayerStreams (transfer/layerwise.py) fed save_kv_layer calls; ImportError without msgspec."""
    from pd_connector import messages as proto
    from pd_connector.layer_chunks import LayerChunk
    from pd_connector.layout import regions_of_kv_caches
    from pd_connector.trace import TraceBook
    from pd_connector.transfer.context import RankContext, RankSpec
    from pd_connector.transfer.layerwise import LayerStreams, layer_regions_of
    from pd_connector.transfer.outbox import Outbox
    from pd_connector.transfer.stats import TransferStats

    nb, layers = next(iter(p_kv.values())).shape[0], len(p_kv)
    spec = RankSpec(0, 1, 0, 1, BLOCK_SIZE, "float16", layers, total_kv_heads=HEADS, local_kv_heads=HEADS,
                    num_blocks=nb)  # fmt: skip
    cfg = SimpleNamespace(max_batch_entries=4096)  # all LayerStreams reads of the config (parse_config probes vLLM)
    ctx = RankContext(cfg, spec, regions_of_kv_caches(p_kv, nb), lambda *a: None, lambda *a: None,
                      TransferStats("check"), Outbox(), TraceBook("prefill", None, enabled=False), device=sync)  # fmt: skip
    hello = proto.PeerHello("d", peer.descriptor, "", 0, 1, BLOCK_SIZE, "float16", layers,
                            [r.as_tuple() for r in regions_of_kv_caches(d_kv, nb)], HEADS, HEADS, num_blocks=nb)  # fmt: skip
    req = proto.TransferRequest(1, "d-req", "d", list(dst), 0)
    done = threading.Event()
    results: list[Any] = []

    class Host:
        taken = False

        def take_for_stream(self, room: int) -> list[Any]:
            out, Host.taken = ([] if Host.taken else [req]), True
            return out

        def peer_of(self, peer_id: str) -> tuple[Any, None]:
            return hello, None

        def guard_of(self, peer: Any, r: Any) -> tuple[None, None]:
            return None, None

        def stream_done(self, p_req_id: str, result: Any) -> None:
            results.append(result)
            done.set()

    streams = LayerStreams(ctx, backend, Host(), layer_regions_of(p_kv, [1] * layers))
    names, step = list(p_kv), object()
    chunks = [LayerChunk("p-req", 1, tuple(src), 0, len(src), True)]

    def finish() -> None:
        streams.on_forward_end(chunks, step)
        if not done.wait(120):
            raise TimeoutError("LayerStreams did not finish")
        streams.close()
        if results[0].status.name != "OK":
            raise TransferError(results[0].error)

    return (lambda layer: streams.on_layer(chunks, step, names[layer])), finish


def run_case(device: torch.device, mode: str, ordered: bool, layers: int, blocks: int, work: int) -> dict[str, Any]:
    sync = for_device(device) if ordered else NO_DEVICE
    shape = (blocks, HEADS, BLOCK_SIZE, 2 * HEAD_DIM)
    p_kv = {f"layers.{i}": torch.zeros(shape, dtype=torch.float16, device=device) for i in range(layers)}
    d_kv = {f"layers.{i}": torch.full(shape, -7.0, dtype=torch.float16, device=device) for i in range(layers)}
    half = blocks // 2
    src, dst = list(range(half)), list(range(half, 2 * half))
    g = torch.Generator().manual_seed(layers)
    fresh = {n: torch.randint(1, 2000, (half, *shape[1:]), generator=g).to(torch.float16).to(device) for n in p_kv}
    p_be, d_be = TorchCopyBackend(device), TorchCopyBackend(device)
    p_be.track(list(p_kv.values()))
    d_be.track(list(d_kv.values()))
    for be, kv in ((p_be, p_kv), (d_be, d_kv)):
        be.register([(t.data_ptr(), t.numel() * t.element_size()) for t in kv.values()])
    entries = [_entries(p_kv[n], d_kv[n], src, dst) for n in p_kv]
    forward = Forward(device, work)
    idx = torch.tensor(src, device=device)
    path = "seam"
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    if mode == "layer":
        try:
            on_layer, finish = _layer_streams(sync, p_be, d_be, p_kv, d_kv, src, dst)
            path = "LayerStreams"
        except ImportError:
            on_layer, finish = _pusher_layer_mode(sync, p_be, d_be.descriptor, entries)
        with forward.context():  # the forward's thread: its current stream is the side stream
            for i, name in enumerate(p_kv):
                forward.layer(p_kv[name], idx, fresh[name])
                on_layer(i)  # save_kv_layer, while the device still computes
        finish()
    else:
        with forward.context():
            for name in p_kv:
                forward.layer(p_kv[name], idx, fresh[name])
            marker = sync.record()  # the SendJob's marker (start_load_kv of the next step)
        pool = ThreadPoolExecutor(max_workers=1, initializer=sync.bind_thread)

        def push() -> None:
            marker.wait()
            for e in entries:
                p_be.write(d_be.descriptor, *e, max_batch=4096)

        pool.submit(push).result()
        pool.shutdown()
    pushed_s = time.perf_counter() - t0
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    stale = [n for n in p_kv if not torch.equal(d_kv[n][dst].view(torch.int16), fresh[n].view(torch.int16))]
    p_be.close()
    d_be.close()
    return {
        "mode": mode,
        "ordering": "on" if ordered else "off",
        "path": path,
        "layers": layers,
        "layers_exact": layers - len(stale),
        "layers_stale": len(stale),
        "bytes_per_layer": len(src) * p_kv["layers.0"][0].numel() * 2,
        "push_s": round(pushed_s, 4),
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--blocks", type=int, default=64)
    ap.add_argument("--work", type=int, default=16, help="chained 4096x4096 matmuls before each layer's KV write")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    gpu = device.type == "cuda"
    t0 = time.perf_counter()
    runs = [
        run_case(device, mode, ordered, args.layers, args.blocks, args.work)
        for mode in ("layer", "request")
        for ordered in (True, False)
    ]
    on = [r for r in runs if r["ordering"] == "on"]
    off = [r for r in runs if r["ordering"] == "off"]
    report = {
        "gpu": gpu,
        "device": torch.cuda.get_device_name(device) if gpu else "cpu (no GPU: CPU kernels are synchronous)",
        "torch": torch.__version__,
        "ordered_byte_exact": all(r["layers_stale"] == 0 for r in on),
        "corruption_without_ordering": any(r["layers_stale"] > 0 for r in off),
        "runs": runs,
        "seconds": round(time.perf_counter() - t0, 2),
    }
    if not gpu:
        report["note"] = "no GPU: the pipeline ran on CPU tensors; corruption without ordering needs an async device"
    return report


if __name__ == "__main__":
    out = main()
    print(json.dumps(out, indent=2))
    sys.exit(0 if out["ordered_byte_exact"] and (out["corruption_without_ordering"] or not out["gpu"]) else 1)
