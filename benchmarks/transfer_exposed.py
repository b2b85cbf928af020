"""`benchmarks/transfer.py --exposed`: how long a finished prefill waits for its KV to reach D.

A prefill rank and a decode rank (KVTransferManagers, Mooncake TCP by default, a real bootstrap
server) in this process; KV in vLLM's CPU layout, fp32. Per round, D asks for a room first, then:

- `request`: the forward pass is over (no compute simulated), P's SendJob comes and the room
  is pushed whole: exposed = the whole push (submit -> D's finished_recving);
- `layer`: a simulated forward (`--layer-ms` of matrix products per layer, `--chunks` steps of
  a chunked prefill, each completing its share of the blocks, the last one partial) calls the
  layer-wise streams' `on_layer` where vLLM calls save_kv_layer: after the layer's attention op,
  before its MLP (`--mlp-share` of the layer's compute, 0 to call it at the layer's very end);
  `on_forward_end` after the last layer: exposed = end of the last step -> D's finished_recving.

Rounds alternate the modes. `layer_share_ms` is request mode's median push divided by the layer
count; `within_bound`: layer mode's median exposed time <= layer_share_ms + 1 ms.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch

from benchmarks.transfer import pair_of_managers, scattered_blocks, wait_finished
from pd_connector.metadata import RecvJob, SendJob
from pd_connector.scheduling.layer_chunks import LayerChunk
from pd_connector.transfer.layerwise import LayerStreams, layer_regions_of

DTYPE = torch.float32


def make_kv(layers: int, num_blocks: int, heads: int, block_size: int, head_dim: int, fill: float | None) -> dict:
    """vLLM CPU layout [num_blocks, kv_heads, block_size, 2 * head_dim] per layer (random, or ``fill``)."""
    shape = (num_blocks, heads, block_size, 2 * head_dim)
    g = torch.Generator().manual_seed(0)
    make = (
        (lambda: torch.full(shape, fill, dtype=DTYPE))
        if fill is not None
        else (lambda: torch.randn(shape, generator=g))
    )
    return {f"model.layers.{i}.self_attn.attn": make() for i in range(layers)}


def busy(ms: float, a: torch.Tensor) -> None:
    """About ``ms`` of compute in this thread (a layer's share of a prefill)."""
    end = time.perf_counter() + ms / 1e3
    while time.perf_counter() < end:
        torch.mm(a, a)


def chunk_plan(num_tokens: int, block_size: int, chunks: int) -> list[tuple[int, int, bool]]:
    """(start block, end block, final) of each step of a prefill cut into ``chunks`` equal token ranges."""
    out, done = [], 0
    for i in range(chunks):
        after = num_tokens * (i + 1) // chunks
        final = i == chunks - 1
        end = -(-after // block_size) if final else after // block_size
        out.append((done, end, final))
        done = end
    return out


def run_exposed(args: argparse.Namespace) -> dict[str, Any]:
    blocks = -(-args.prompt_tokens // args.block_size)
    num_blocks = 2 * blocks + 8
    p_kv = make_kv(args.layers, num_blocks, args.kv_heads, args.block_size, args.head_dim, None)
    d_kv = make_kv(args.layers, num_blocks, args.kv_heads, args.block_size, args.head_dim, -1.0)
    pair = pair_of_managers(
        p_kv, d_kv, num_blocks, args.block_size, "float32", args.backend, {"transfer_mode": "layer"}
    )
    p_mgr, d_mgr, bport = pair.p_mgr, pair.d_mgr, pair.bport
    assert p_mgr.prefill is not None
    streams: LayerStreams = p_mgr.prefill.enable_layer_push(layer_regions_of(p_kv, [1] * args.layers))
    src = scattered_blocks(num_blocks, blocks, run=8, offset=0)
    dst = scattered_blocks(num_blocks, blocks, run=4, offset=3)
    work = torch.randn(256, 256)
    torch.set_num_threads(1)  # one compute thread, as a vLLM CPU worker bound to one core
    plan = chunk_plan(args.prompt_tokens, args.block_size, args.chunks)

    def d_asks(room: int, rid: str) -> None:
        d_mgr.add_recvs([RecvJob(rid, room, "127.0.0.1", bport, 0, dst, 0, args.prompt_tokens)])
        deadline = time.monotonic() + 10
        while room not in p_mgr.prefill._rooms:  # type: ignore[union-attr]
            if time.monotonic() > deadline:
                raise TimeoutError(f"room {room} never reached P")
            time.sleep(0.0005)

    def free(room: int, rid: str) -> None:
        p_mgr.add_sends([SendJob(f"p-{rid}", room, src, args.prompt_tokens)])
        deadline = time.monotonic() + 30
        while f"p-{rid}" not in p_mgr.take_finished()[0]:
            if time.monotonic() > deadline:
                raise TimeoutError(f"P never freed room {room}")
            time.sleep(0.0005)

    def request_round(room: int) -> float:
        rid = f"req-{room}"
        d_asks(room, rid)
        t_end = time.perf_counter()  # the forward is over: P's SendJob comes
        p_mgr.add_sends([SendJob(f"p-{rid}", room, src, args.prompt_tokens)])
        wait_finished(d_mgr, rid)
        exposed = time.perf_counter() - t_end
        deadline = time.monotonic() + 30
        while f"p-{rid}" not in p_mgr.take_finished()[0]:
            if time.monotonic() > deadline:
                raise TimeoutError(f"P never freed room {room}")
            time.sleep(0.0005)
        return exposed

    def layer_round(room: int) -> float:
        rid = f"layer-{room}"
        d_asks(room, rid)
        for start, end, final in plan:
            step = object()
            chunks = [LayerChunk(f"p-{rid}", room, tuple(src[:end]), start, end, final)]
            for name in p_kv:
                busy(args.layer_ms * (1 - args.mlp_share), work)  # norm, QKV, attention (KV written)
                streams.on_layer(chunks, step, name)
                busy(args.layer_ms * args.mlp_share, work)  # output projection's rest, MLP
            streams.on_forward_end(chunks, step)
        t_end = time.perf_counter()
        wait_finished(d_mgr, rid)
        exposed = time.perf_counter() - t_end
        free(room, rid)
        return exposed

    request_round(90_000)  # warm-up: handshake, route cache, connections
    layer_round(90_001)
    req_ms, layer_ms = [], []
    for i in range(args.rounds):
        req_ms.append(request_round(2 * i) * 1e3)
        layer_ms.append(layer_round(2 * i + 1) * 1e3)
    for name in p_kv:  # the last round's KV landed where D asked for it
        assert torch.equal(p_kv[name][src], d_kv[name][dst]), f"KV mismatch in {name}"
    push = statistics.median(req_ms)
    share = push / args.layers
    exposed = statistics.median(layer_ms)
    result = {
        "bytes": blocks * args.layers * p_mgr.regions[0].block_bytes,
        "prompt_tokens": args.prompt_tokens,
        "layers": args.layers,
        "blocks": blocks,
        "chunks": args.chunks,
        "layer_compute_ms": args.layer_ms,
        "mlp_share": args.mlp_share,
        "request_exposed_ms_median": round(push, 3),
        "layer_exposed_ms_median": round(exposed, 3),
        "request_exposed_ms": [round(x, 3) for x in req_ms],
        "layer_exposed_ms": [round(x, 3) for x in layer_ms],
        "layer_share_ms": round(share, 3),
        "bound_ms": round(share + 1.0, 3),
        "within_bound": exposed <= share + 1.0,
        "rounds": args.rounds,
        "backend": args.backend,
    }
    streams.close()
    pair.close()
    return result
