"""KV hand-off throughput: the connector's transfer path vs one raw backend write.

Two KVTransferManagers (a prefill rank and a decode rank, each with its own
transfer backend -- Mooncake TCP unless --backend names another registered one --
and KV tensors) and a real bootstrap server run in this
process. Each round, D asks for a request's KV through the full path
(route lookup, ZMQ handshake, coalesced batched writes, DONE message) and we
time submit -> finished_recving. The same number of bytes is then written as
one large raw write between the same backends. Rounds alternate so
noise hits both alike. Prints one JSON object.

`--exposed` instead measures what a prefill waits for its KV to reach D (`exposed_ms`: from
the end of P's forward pass to D's finished_recving), in both transfer modes, D asking first:
`request` pushes the room after the forward (as P's SendJob does); `layer` runs a simulated
forward (`--layer-ms` of matrix products per layer, in `--chunks` steps) calling the layer-wise
streams' save_kv_layer hook after each layer (transfer.layerwise), so only the last layer's write
is left when it ends. `within_bound`: layer mode's exposed time is at most one layer's share of
request mode's whole push plus 1 ms. Defaults for `--exposed` follow the reference model (6
layers, 2 KV heads of 64, fp32, 2,000 tokens).

Region table: a Llama-3-8B-like layer stack in vLLM CPU layout
([num_blocks, kv_heads, block_size, 2 * head_dim] per layer), scaled by flags.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from pd_connector.bootstrap.client import register_rank  # noqa: E402
from pd_connector.bootstrap.server import BootstrapServer, BootstrapState  # noqa: E402
from pd_connector.config import parse_config  # noqa: E402
from pd_connector.layouts.regions import Region, memory_ranges, regions_of_kv_caches  # noqa: E402
from pd_connector.messages import RegisterRank  # noqa: E402
from pd_connector.metadata import RecvJob, SendJob  # noqa: E402
from pd_connector.transfer.backend import TransferBackend  # noqa: E402
from pd_connector.transfer.device_sync import NO_DEVICE, DeviceSync, for_device  # noqa: E402
from pd_connector.transfer.manager import KVTransferManager, RankSpec  # noqa: E402
from pd_connector.transfer.registry import create_backend, known_backends  # noqa: E402

DEFAULT_SHAPE = {"layers": 32, "kv_heads": 8, "head_dim": 128, "prompt_tokens": 4096}
#: The serving benchmarks' reference model (hidden 512, 6 layers, 8 heads, 2 KV heads) at 2,000 tokens.
EXPOSED_SHAPE = {"layers": 6, "kv_heads": 2, "head_dim": 64, "prompt_tokens": 2000}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_kv(
    layers: int, num_blocks: int, heads: int, block_size: int, head_dim: int, device: torch.device | str = "cpu"
) -> dict[str, torch.Tensor]:
    """Per-layer KV tensors on ``device``; every block carries its own (layer, block) marker values."""
    kv = {}
    for i in range(layers):
        t = torch.zeros(num_blocks, heads, block_size, 2 * head_dim, dtype=torch.float16, device=device)
        t[:, :, :, 0] = torch.arange(num_blocks, dtype=torch.float16, device=device).view(-1, 1, 1)
        t[:, :, :, -1] = float(i)
        kv[f"model.layers.{i}.self_attn.attn"] = t
    return kv


def scattered_blocks(num_blocks: int, count: int, run: int, offset: int) -> list[int]:
    """`count` block ids in runs of `run` consecutive ids with gaps, as a busy allocator hands out."""
    ids: list[int] = []
    start = offset
    while len(ids) < count:
        ids.extend(range(start, min(start + run, num_blocks)))
        start += run + 1
    return ids[:count]


def wait_finished(mgr: KVTransferManager, req_id: str, timeout: float = 120.0) -> None:
    """Poll D's finished set every 1 ms (vLLM asks once per engine step, tens of ms apart). A 0.2 ms poll
    took enough of a 2-core machine from Mooncake's transport threads to cost the connector's rounds
    4-6% against the raw write, which polls nothing."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        _, recving, failed = mgr.take_finished()
        if failed:
            raise RuntimeError(f"transfer failed: {failed}")
        if req_id in recving:
            return
        time.sleep(0.001)
    raise TimeoutError(req_id)


@dataclass
class ManagerPair:
    """A prefill and a decode KVTransferManager, their backends, and the bootstrap server P is registered on."""

    server: BootstrapServer
    bport: int
    p_backend: TransferBackend
    d_backend: TransferBackend
    p_mgr: KVTransferManager
    d_mgr: KVTransferManager

    def close(self) -> None:
        self.p_mgr.close()
        self.d_mgr.close()
        self.p_backend.close()
        self.d_backend.close()
        self.server.stop()


def pair_of_managers(
    p_kv: dict[str, torch.Tensor],
    d_kv: dict[str, torch.Tensor],
    num_blocks: int,
    block_size: int,
    kv_dtype: str,
    backend: str,
    p_extra: dict[str, Any] | None = None,
    *,
    extra: dict[str, Any] | None = None,
    device: DeviceSync = NO_DEVICE,
    d_regions: Sequence[Region] | None = None,
    d_num_blocks: int | None = None,
    d_ranges: Sequence[tuple[int, int]] = (),
) -> ManagerPair:
    """A bootstrap server on a free loopback port, one backend per side with its KV registered,
    a P and a D manager over them (one layer per KV tensor), and P's rank registered.

    ``extra``: config keys of both sides; ``device``: the KV's device seam (both managers, as the worker
    passes ``device_sync.for_kv_caches``); ``d_regions`` / ``d_num_blocks`` / ``d_ranges``: what D announces
    and registers besides its KV when P writes elsewhere (D2RH: the host pool, ``host_kv.HostKV``)."""
    layers = len(p_kv)
    bport = free_port()
    extra = {"bootstrap_port": bport, "local_ip": "127.0.0.1", "backend": backend, **(extra or {})}
    p_cfg = parse_config("kv_producer", {**extra, **(p_extra or {})})
    d_cfg = parse_config("kv_consumer", extra)
    server = BootstrapServer(BootstrapState(attn_tp_size=1, attn_dp_size=1), "127.0.0.1", bport)
    server.start()
    spec = RankSpec(0, 1, 0, 1, block_size, kv_dtype, layers, num_blocks=num_blocks)
    d_spec = RankSpec(0, 1, 0, 1, block_size, kv_dtype, layers, num_blocks=d_num_blocks or num_blocks)
    p_backend, d_backend = create_backend(p_cfg), create_backend(d_cfg)
    p_backend.register(memory_ranges(p_kv))
    d_backend.register([*memory_ranges(d_kv), *d_ranges])
    d_regs = list(d_regions) if d_regions is not None else regions_of_kv_caches(d_kv, num_blocks)
    p_mgr = KVTransferManager(p_cfg, spec, regions_of_kv_caches(p_kv, num_blocks), p_backend, device=device)
    d_mgr = KVTransferManager(d_cfg, d_spec, d_regs, d_backend, device=device)
    register_rank(
        f"127.0.0.1:{bport}",
        RegisterRank(1, 0, 1, 0, "127.0.0.1", p_mgr.rank_port, block_size, kv_dtype, num_layers=layers),
        retries=3,
        interval_s=0.2,
        timeout_s=5,
    )
    return ManagerPair(server, bport, p_backend, d_backend, p_mgr, d_mgr)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, help="default 32 (--exposed: 6)")
    ap.add_argument("--kv-heads", type=int, help="default 8 (--exposed: 2)")
    ap.add_argument("--head-dim", type=int, help="default 128 (--exposed: 64)")
    ap.add_argument("--block-size", type=int, default=32)
    ap.add_argument("--prompt-tokens", type=int, help="default 4096 (--exposed: 2000)")
    ap.add_argument("--run", type=int, default=4, help="consecutive blocks per run on D (fragmentation)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument(
        "--backend",
        default="mooncake",
        choices=sorted({*known_backends(), "null"}),
        help="transfer backend; null: the connector's own CPU cost, no byte moves (benchmarks/transfer_null.py)",
    )
    ap.add_argument("--exposed", action="store_true", help="exposed transfer time, request vs layer mode")
    ap.add_argument("--layer-ms", type=float, default=20.0, help="--exposed: simulated compute per layer")
    ap.add_argument("--chunks", type=int, default=1, help="--exposed: prefill steps (chunked prefill)")
    ap.add_argument("--mlp-share", type=float, default=0.5, help="--exposed: a layer's compute after save_kv_layer")
    args = ap.parse_args()
    shape = EXPOSED_SHAPE if args.exposed else DEFAULT_SHAPE
    for key, value in shape.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.exposed:
        from benchmarks.transfer_exposed import run_exposed

        print(json.dumps(run_exposed(args)))
        return
    if args.backend == "null":
        from benchmarks.transfer_null import measure_null

        result = measure_null(
            args.layers, args.kv_heads, args.head_dim, args.block_size, args.prompt_tokens, rounds=args.rounds
        )
        print(json.dumps({**result, **run_facts()}))
        return

    result = measure(
        args.layers, args.kv_heads, args.head_dim, args.block_size, args.prompt_tokens,
        run=args.run, rounds=args.rounds, backend=args.backend,
    )  # fmt: skip
    print(json.dumps({**result, **run_facts()}))


def run_facts() -> dict[str, Any]:
    """The command line, the machine's cores and its load when the run ended (other work skews ratios)."""
    return {
        "command": " ".join(["python", *sys.argv]),
        "cpus": os.cpu_count(),
        "loadavg_1m": round(os.getloadavg()[0], 2),
        "utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def measure(
    layers: int,
    kv_heads: int,
    head_dim: int,
    block_size: int,
    prompt_tokens: int,
    *,
    run: int = 4,
    rounds: int = 5,
    backend: str = "mooncake",
    device: torch.device | str = "cpu",
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The connector's path vs one raw write of the same bytes, KV on ``device``: the JSON ``main`` prints
    (``ratio`` = raw_s_median / connector_s_median). Raises AssertionError when a block landed wrong."""
    device = torch.device(device)
    blocks_needed = -(-prompt_tokens // block_size)
    num_blocks = 2 * blocks_needed + 8
    p_kv = make_kv(layers, num_blocks, kv_heads, block_size, head_dim, device)
    d_kv = {name: torch.full_like(t, -1.0) for name, t in p_kv.items()}
    sync = for_device(device)
    if device.type != "cpu":
        sync.synchronize(next(iter(p_kv.values())))

    pair = pair_of_managers(p_kv, d_kv, num_blocks, block_size, "float16", backend, extra=extra, device=sync)
    p_backend, d_backend, p_mgr, d_mgr, bport = pair.p_backend, pair.d_backend, pair.p_mgr, pair.d_mgr, pair.bport

    src_blocks = scattered_blocks(num_blocks, blocks_needed, run=8, offset=0)
    dst_blocks = scattered_blocks(num_blocks, blocks_needed, run=run, offset=3)
    block_bytes = p_mgr.regions[0].block_bytes
    total = block_bytes * blocks_needed * len(p_mgr.regions)

    # Raw reference: the same bytes as one write (contiguous source and destination). Both are filled:
    # pages never written all map to one zero page on the host, whose reads hit the cache (unlike KV).
    raw_src = torch.full((total,), 7, dtype=torch.uint8, device=device)
    raw_dst = torch.zeros(total, dtype=torch.uint8, device=device)
    p_backend.register([(raw_src.data_ptr(), total)])
    d_backend.register([(raw_dst.data_ptr(), total)])

    def connector_round(i: int) -> float:
        rid = f"bench-{i}"
        t0 = time.perf_counter()
        d_mgr.add_recvs([RecvJob(rid, i, "127.0.0.1", bport, 0, dst_blocks, 0, prompt_tokens)])
        p_mgr.add_sends([SendJob(f"p-{rid}", i, src_blocks, prompt_tokens)])
        wait_finished(d_mgr, rid)
        return time.perf_counter() - t0

    def raw_round() -> float:
        t0 = time.perf_counter()
        p_backend.write(d_backend.descriptor, [raw_src.data_ptr()], [raw_dst.data_ptr()], [total], 1)
        return time.perf_counter() - t0

    connector_round(10_000)  # warm-up: handshake, route cache, connections
    raw_round()
    # A second reference: the same bytes in as many equal entries as the connector wrote (contiguous
    # buffers, one write call): the backend's own cost per entry, which no plan on this layout avoids.
    n_entries = max(1, p_mgr.stats.snapshot().entries_sent)
    size = total // n_entries
    sliced = (
        [raw_src.data_ptr() + i * size for i in range(n_entries)],
        [raw_dst.data_ptr() + i * size for i in range(n_entries)],
    )

    def sliced_round() -> float:
        t0 = time.perf_counter()
        p_backend.write(d_backend.descriptor, sliced[0], sliced[1], [size] * n_entries, p_mgr.cfg.max_batch_entries)
        return time.perf_counter() - t0

    sliced_round()
    conn_times, raw_times, sliced_times = [], [], []
    for i in range(rounds):  # rounds, each in turn led by the other side (neither always runs warm)
        if i % 2:
            raw_times.append(raw_round())
            sliced_times.append(sliced_round())
            conn_times.append(connector_round(i))
        else:
            conn_times.append(connector_round(i))
            sliced_times.append(sliced_round())
            raw_times.append(raw_round())

    # Correctness: every requested block landed where D asked for it.
    for name in p_kv:
        if not torch.equal(p_kv[name][src_blocks].view(torch.int16), d_kv[name][dst_blocks].view(torch.int16)):
            pair.close()
            raise AssertionError(f"KV mismatch in {name}")

    conn_s, raw_s = statistics.median(conn_times), statistics.median(raw_times)
    stats = p_mgr.stats.snapshot()
    entries = stats.entries_sent // max(stats.transfers_ok, 1)
    result = {
        "bytes": total,
        "entries_per_transfer": entries,
        "region_count": len(p_mgr.regions),
        "blocks": blocks_needed,
        "connector_s_median": round(conn_s, 5),
        "raw_s_median": round(raw_s, 5),
        "connector_gbps": round(total / conn_s / 1e9, 3),
        "raw_gbps": round(total / raw_s / 1e9, 3),
        "ratio": round(raw_s / conn_s, 3),
        # Each pair's raw_s / connector_s: noise that hits a pair hits both its sides.
        "ratio_pairs": [round(r / c, 3) for r, c in zip(raw_times, conn_times, strict=True)],
        "ratio_paired_median": round(statistics.median(r / c for r, c in zip(raw_times, conn_times, strict=True)), 3),
        # The same bytes as the connector's entry count of equal entries, one write call: raw_s / that.
        "raw_same_entries_gbps": round(total / statistics.median(sliced_times) / 1e9, 3),
        "raw_same_entries_ratio": round(raw_s / statistics.median(sliced_times), 3),
        # connector vs that write: what the connector's own path costs beyond the backend's per-entry cost.
        "ratio_vs_same_entries": round(statistics.median(sliced_times) / conn_s, 3),
        "rounds": rounds,
        "backend": backend,
        "transport": getattr(p_mgr.cfg.backend_options, "protocol", "") if backend == "mooncake" else backend,
        "pid": os.getpid(),
    }
    pair.close()
    return result


if __name__ == "__main__":
    main()
