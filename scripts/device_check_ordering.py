"""The device check's ordering cases (scripts/device_check.py): does P's KV push wait for the device?

Per case, a simulated forward writes each layer's KV on a side stream (``--work`` slow matmuls first)
and P's push runs from a thread bound to the device, layer by layer (layer mode: through the real
``LayerStreams`` of transfer/layerwise.py when msgspec is there, else a minimal pusher with the same
ordering) or after the forward behind one marker (request mode); with the ordering on
(``device_sync.TorchDeviceSync``) and off (``NO_DEVICE``). D's blocks are compared byte for byte with
what the forward wrote. The bytes move through ``TorchCopyBackend`` (torch copies on its own stream,
synchronised before ``write`` returns, as a DMA engine) or through the project's Mooncake backend
(``transfer/mooncake.py``, TCP) on the same memory.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace
from typing import Any

import torch

from pd_connector.transfer.backend import Ints, TransferBackend, TransferError, Wanted, write_in_batches
from pd_connector.transfer.device_sync import NO_DEVICE, DeviceSync, Marker, for_device

HEADS, BLOCK_SIZE, HEAD_DIM = 8, 16, 128
_TABLE: dict[bytes, TorchCopyBackend] = {}
_IDS = itertools.count(1)
#: Mooncake backends of finished cases, their memory unregistered: the next cases reuse them (a
#: TransferEngine takes about a second to tear down).
_IDLE_MOONCAKE: list[TransferBackend] = []


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


def open_backend(name: str, device: torch.device, tensors: Sequence[torch.Tensor]) -> TransferBackend:
    """A backend with ``tensors`` registered: ``torch`` (TorchCopyBackend) or ``mooncake`` (TCP, this host)."""
    ranges = [(t.data_ptr(), t.numel() * t.element_size()) for t in tensors]
    if name == "mooncake":
        from pd_connector.transfer.mooncake import MooncakeBackend

        mooncake = _IDLE_MOONCAKE.pop() if _IDLE_MOONCAKE else MooncakeBackend.open("127.0.0.1", "tcp")
        mooncake.register(ranges)
        return mooncake
    if name != "torch":
        raise ValueError(f"ordering backend must be 'torch' or 'mooncake', got {name!r}")
    be = TorchCopyBackend(device)
    be.track(tensors)
    be.register(ranges)
    return be


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


def _pusher_layer_mode(sync: DeviceSync, backend: TransferBackend, peer: bytes,
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


def _layer_streams(sync: DeviceSync, backend: TransferBackend, peer: TransferBackend, p_kv: dict, d_kv: dict,
                   src: list[int], dst: list[int]) -> tuple[Callable[[int], None], Callable[[], None]]:  # fmt: skip
    """The real LayerStreams (transfer/layerwise.py) fed save_kv_layer calls; ImportError without msgspec."""
    from pd_connector import messages as proto
    from pd_connector.layouts.regions import regions_of_kv_caches
    from pd_connector.scheduling.layer_chunks import LayerChunk
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


def run_case(device: torch.device, mode: str, ordered: bool, layers: int, blocks: int, work: int,
             backend: str = "torch") -> dict[str, Any]:  # fmt: skip
    """One case: ``mode`` layer / request, the ordering on or off, the bytes through ``backend`` (torch / mooncake)."""
    sync = for_device(device) if ordered else NO_DEVICE
    shape = (blocks, HEADS, BLOCK_SIZE, 2 * HEAD_DIM)
    p_kv = {f"layers.{i}": torch.zeros(shape, dtype=torch.float16, device=device) for i in range(layers)}
    d_kv = {f"layers.{i}": torch.full(shape, -7.0, dtype=torch.float16, device=device) for i in range(layers)}
    half = blocks // 2
    src, dst = list(range(half)), list(range(half, 2 * half))
    g = torch.Generator().manual_seed(layers)
    fresh = {n: torch.randint(1, 2000, (half, *shape[1:]), generator=g).to(torch.float16).to(device) for n in p_kv}
    p_be, d_be = open_backend(backend, device, list(p_kv.values())), open_backend(backend, device, list(d_kv.values()))
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
    if backend == "mooncake":
        _IDLE_MOONCAKE.extend((p_be, d_be))
    return {
        "mode": mode,
        "backend": backend,
        "ordering": "on" if ordered else "off",
        "path": path,
        "layers": layers,
        "layers_exact": layers - len(stale),
        "layers_stale": len(stale),
        "bytes_per_layer": len(src) * p_kv["layers.0"][0].numel() * 2,
        "push_s": round(pushed_s, 4),
    }
