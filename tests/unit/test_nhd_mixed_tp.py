"""Mixed TP on vLLM-Ascend's token-major KV: KV managers of P and D ranks in this process,
real ZMQ, a real bootstrap server and real Mooncake TCP, KV allocated as vLLM-Ascend allocates it
((k, v) per layer, [num_blocks, block_size, kv_heads, head_dim], 2 MiB-aligned slices).

Each case splits heads inside a block: P2 -> D1, P1 -> D2, P4 -> D2 (8 heads, MHA-like),
P4 -> D1 with 2 heads (GQA, heads replicated on P, two P ranks only free the room) and P1 -> D4
with 2 heads (D replicates). After the transfer every D block holds exactly the heads of the
model's block it stands for, byte for byte; no other D block changed; every entry is a whole
head slice of a block (never one per token), as many as on head-major layouts; and the staging
buffer is smaller than one request's KV, so P gathers in several batches.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from pd_connector.transfer.manager import RankSpec
from tests.support.nhd_mixed_tp import BS, HB, LAYERS, Engines, run_mixed_tp_case


@pytest.fixture(scope="module")
def engines() -> Iterator[Engines]:
    e = Engines()
    try:
        yield e
    finally:
        for b in e.p + e.d:
            b.close()


CASES = [(2, 1, 4), (1, 2, 4), (4, 2, 8), (4, 1, 2), (1, 4, 2)]


@pytest.mark.parametrize(("p_tp", "d_tp", "heads"), CASES, ids=[f"P{p}D{d}-{h}heads" for p, d, h in CASES])
def test_mixed_tp_on_token_major_kv_is_byte_exact(engines: Engines, p_tp: int, d_tp: int, heads: int) -> None:
    run_mixed_tp_case(engines, p_tp, d_tp, heads)


def test_no_staging_means_mixed_tp_on_nhd_is_refused() -> None:
    from pd_connector import messages as proto
    from pd_connector.compat import peer_problem

    spec = RankSpec(0, 2, 0, 1, BS, "float16", LAYERS, total_kv_heads=4, local_kv_heads=2, heads_outermost=False)
    hello = proto.PeerHello(
        peer_id="d", transfer_descriptor=b"x", endpoint="tcp://127.0.0.1:1", tp_rank=0, tp_size=1, block_size=BS,
        kv_dtype="float16", num_layers=LAYERS, regions=[(0, BS * 4 * HB, BS * 4 * HB)] * (2 * LAYERS),
        total_kv_heads=4, local_kv_heads=4, heads_outermost=False, token_major=True,
    )  # fmt: skip
    regions = [__import__("pd_connector.layouts.regions", fromlist=["Region"]).Region(0, BS * 2 * HB, BS * 2 * HB)] * (
        2 * LAYERS
    )
    problem = peer_problem(spec, regions, hello)
    assert problem is not None and "staging_bytes 0" in problem and "NHD" in problem
    staged = RankSpec(
        0, 2, 0, 1, BS, "float16", LAYERS, total_kv_heads=4, local_kv_heads=2, heads_outermost=False, token_major=True
    )
    assert peer_problem(staged, regions, hello) is None
