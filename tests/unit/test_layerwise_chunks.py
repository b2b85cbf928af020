"""layer_chunks.ChunkPlanner: which blocks each step completes, from vLLM-shaped scheduler outputs;
and the transfer_mode setting."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from pd_connector.config import ConfigError, parse_config
from pd_connector.scheduling.layer_chunks import ChunkPlanner, LayerChunk

BS = 16


def new_req(req_id: str, blocks: list[int], computed: int = 0) -> SimpleNamespace:
    return SimpleNamespace(req_id=req_id, block_ids=(blocks,), num_computed_tokens=computed)


def output(
    new: list | None = None, cached: list | None = None, scheduled: dict | None = None, resumed=()
) -> SimpleNamespace:
    cached = cached or []
    return SimpleNamespace(
        scheduled_new_reqs=new or [],
        scheduled_cached_reqs=SimpleNamespace(
            req_ids=[c[0] for c in cached],
            new_block_ids=[(c[1],) if c[1] is not None else None for c in cached],
            num_computed_tokens=[c[2] for c in cached],
            resumed_req_ids=set(resumed),
        ),
        num_scheduled_tokens=scheduled or {},
    )


def test_one_step_prefill_completes_every_block_with_the_partial_last_one() -> None:
    planner = ChunkPlanner(BS)
    assert planner.track("r", 7, 40)
    chunks = planner.plan(output([new_req("r", [4, 5, 6])], scheduled={"r": 40}))
    assert chunks == [LayerChunk("r", 7, (4, 5, 6), 0, 3, True)]
    # Decode steps after the prompt add nothing.
    assert planner.plan(output(cached=[("r", None, 40)], scheduled={"r": 1})) == []


def test_chunked_prefill_completes_only_filled_blocks_until_the_last_chunk() -> None:
    planner = ChunkPlanner(BS)
    planner.track("r", 8, 70)  # 5 blocks, the last one partial
    first = planner.plan(output([new_req("r", [1, 2])], scheduled={"r": 24}))
    assert first == [LayerChunk("r", 8, (1,), 0, 1, False)]  # block 2 holds 8 of 16 tokens
    second = planner.plan(output(cached=[("r", [3, 9], 24)], scheduled={"r": 24}))
    assert second == [LayerChunk("r", 8, (1, 2, 3), 1, 3, False)]
    last = planner.plan(output(cached=[("r", [10], 48)], scheduled={"r": 22}))
    assert last == [LayerChunk("r", 8, (1, 2, 3, 9, 10), 3, 5, True)]


def test_a_chunk_that_fills_no_block_is_not_sent_and_the_prefix_hit_is() -> None:
    planner = ChunkPlanner(BS)
    planner.track("r", 9, 64)
    # 32 tokens from P's prefix cache, then 8 computed: blocks 0, 1 are complete already.
    assert planner.plan(output([new_req("r", [5, 6, 7], computed=32)], scheduled={"r": 8})) == [
        LayerChunk("r", 9, (5, 6), 0, 2, False)
    ]
    assert planner.plan(output(cached=[("r", None, 40)], scheduled={"r": 4})) == []  # block 2 not full
    assert planner.plan(output(cached=[("r", [8], 44)], scheduled={"r": 20})) == [
        LayerChunk("r", 9, (5, 6, 7, 8), 2, 4, True)
    ]


def test_resumed_request_starts_over_with_its_new_blocks() -> None:
    planner = ChunkPlanner(BS)
    planner.track("r", 10, 48)
    planner.plan(output([new_req("r", [1, 2])], scheduled={"r": 32}))
    again = planner.plan(output(cached=[("r", [7, 8, 9], 0)], scheduled={"r": 48}, resumed=["r"]))
    assert again == [LayerChunk("r", 10, (7, 8, 9), 0, 3, True)]


def test_untracked_requests_and_a_second_request_for_a_room_are_left_alone() -> None:
    planner = ChunkPlanner(BS)
    assert planner.track("a", 11, 16)
    assert not planner.track("b", 11, 16)  # same room: request mode (P refuses it when it finishes)
    assert planner.track("a", 11, 16)  # idempotent
    chunks = planner.plan(output([new_req("a", [3]), new_req("c", [4])], scheduled={"a": 16, "c": 16}))
    assert [c.req_id for c in chunks] == ["a"]
    planner.forget("a")
    assert len(planner) == 0 and planner.plan(output(scheduled={"a": 1})) == []


def test_transfer_mode_setting() -> None:
    assert parse_config("kv_producer", {}).transfer_mode == "request"
    assert parse_config("kv_producer", {"transfer_mode": "layer"}).transfer_mode == "layer"
    with pytest.raises(ConfigError, match="transfer_mode must be one of .* got 'layers'"):
        parse_config("kv_producer", {"transfer_mode": "layers"})
