"""`benchmarks/transfer.py --backend null`: PDConnector's own CPU cost per transfer and per entry.

The connector's whole transfer path (D's request, bootstrap route, ZMQ handshake, P's write plan,
write guard, batches through ``backend.write_pipelined``, ``TransferDone``, D's finished_recving)
between two KVTransferManagers in this process, over the ``null`` backend (``transfer.null_backend``):
writes are accepted and end at once, no byte moves. So the time and CPU a round takes are the
connector's alone.

The same request (the benchmark's region table, 4096 tokens) is sent with D's blocks in runs of
``--null-runs`` consecutive ids (P's are one run), which changes only the entry count. Per shape:
median wall time and process CPU time of a round. ``cpu_us_per_entry`` and ``cpu_ms_per_transfer``
are the least-squares line through (entries, CPU) of all shapes: its slope and intercept. The CPU
counts both managers, their threads and this process's polling for D's finish.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch

from benchmarks.transfer import pair_of_managers, scattered_blocks, wait_finished
from pd_connector.metadata import RecvJob, SendJob
from pd_connector.transfer import null_backend

#: D's run lengths (consecutive block ids) of the shapes measured: the entry count per transfer changes.
NULL_RUNS = (1, 4, 32, 1 << 20)


def empty_kv(layers: int, num_blocks: int, heads: int, block_size: int, head_dim: int) -> dict[str, torch.Tensor]:
    """Per-layer KV tensors in vLLM's CPU layout, never touched (no page is committed: nothing is written)."""
    shape = (num_blocks, heads, block_size, 2 * head_dim)
    return {f"model.layers.{i}.self_attn.attn": torch.empty(shape, dtype=torch.float16) for i in range(layers)}


def fit(points: list[tuple[float, float]]) -> tuple[float, float]:
    """(intercept, slope) of the least-squares line through (x, y) points."""
    n = len(points)
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    slope = sum((x - mx) * (y - my) for x, y in points) / sxx if sxx else 0.0
    return my - slope * mx, slope


def measure_null(
    layers: int,
    kv_heads: int,
    head_dim: int,
    block_size: int,
    prompt_tokens: int,
    *,
    rounds: int = 5,
    runs: tuple[int, ...] = NULL_RUNS,
) -> dict[str, Any]:
    """The connector's own cost over the null backend, per D run length and fitted (module docstring)."""
    null_backend.enable()
    blocks_needed = -(-prompt_tokens // block_size)
    num_blocks = 2 * blocks_needed + 8
    p_kv = empty_kv(layers, num_blocks, kv_heads, block_size, head_dim)
    d_kv = empty_kv(layers, num_blocks, kv_heads, block_size, head_dim)
    pair = pair_of_managers(p_kv, d_kv, num_blocks, block_size, "float16", null_backend.NAME)
    p_mgr, d_mgr, bport = pair.p_mgr, pair.d_mgr, pair.bport
    src_blocks = list(range(1, 1 + blocks_needed))
    shapes = []
    room = 0
    try:
        for run in runs:
            dst_blocks = scattered_blocks(num_blocks, blocks_needed, run=run, offset=1)
            walls, cpus, entries = [], [], []
            for i in range(rounds + 1):  # the first round of each shape warms up
                room += 1
                rid = f"null-{room}"
                before = p_mgr.stats.snapshot().entries_sent
                w0, c0 = time.perf_counter(), time.process_time()
                d_mgr.add_recvs([RecvJob(rid, room, "127.0.0.1", bport, 0, dst_blocks, 0, prompt_tokens)])
                p_mgr.add_sends([SendJob(f"p-{rid}", room, src_blocks, prompt_tokens)])
                wait_finished(d_mgr, rid)
                wall, cpu = time.perf_counter() - w0, time.process_time() - c0
                if i:
                    walls.append(wall)
                    cpus.append(cpu)
                    entries.append(p_mgr.stats.snapshot().entries_sent - before)
            n = int(statistics.median(entries))
            cpu_s = statistics.median(cpus)
            shapes.append(
                {
                    "dst_run": run,
                    "entries_per_transfer": n,
                    "wall_ms_median": round(statistics.median(walls) * 1e3, 3),
                    "cpu_ms_median": round(cpu_s * 1e3, 3),
                    "cpu_us_per_entry_all_in": round(cpu_s / max(n, 1) * 1e6, 3),
                }
            )
    finally:
        pair.close()
    intercept, slope = fit([(s["entries_per_transfer"], s["cpu_ms_median"] / 1e3) for s in shapes])
    return {
        "backend": null_backend.NAME,
        "layers": layers,
        "block_size": block_size,
        "prompt_tokens": prompt_tokens,
        "rounds": rounds,
        "shapes": shapes,
        "cpu_us_per_entry": round(slope * 1e6, 3),
        "cpu_ms_per_transfer": round(intercept * 1e3, 3),
    }
