"""transfer_mode "layer" end to end: P writes each layer's KV while its (chunked) prefill runs, and
P + D + Router stay token-identical to one colocated vLLM.

Its own 1P1D stack (P and D with ``transfer_mode: "layer"``; the session stack stays in request
mode, so both modes are covered). P prefills in chunks of 48 tokens (``--max-num-batched-tokens``),
so long prompts take several steps whose chunks end inside a block: the streams push only the
blocks each chunk completes, the last partial block with the final chunk.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from launch import ascend_peers
from launch.processes import PDStack, ProcessGroup, start_pd_stack
from pd_connector.trace import parse_trace_line
from tests.support.layerwise_proxy import check_layerwise_proxy, layerwise_proxy
from tests.support.serving import (
    CHAT_PROMPTS,
    PROMPT_LENGTHS,
    START_TIMEOUT_S,
    assert_matches_reference,
    chat,
    count_in_log,
    kv_usage,
    wait_kv_free,
)

pytestmark = [pytest.mark.e2e, pytest.mark.vllm023]

#: P's prefill chunk (tokens per step): a block is 32 tokens, so chunks end inside blocks.
CHUNK_TOKENS = 48


@pytest.fixture(scope="module")
def layer_stack(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[PDStack]:
    with ProcessGroup(tmp_path_factory.mktemp("pd-layer-logs")) as group:
        yield start_pd_stack(
            group,
            tiny_model,
            extra_p_config={"transfer_mode": "layer", "room_timeout_s": 20.0},
            extra_d_config={"transfer_mode": "layer", "kv_wait_timeout_s": 15.0},
            p_args=["--max-num-batched-tokens", str(CHUNK_TOKENS), "--max-num-seqs", "8"],
            timeout=START_TIMEOUT_S,
        )


def test_layer_mode_is_token_identical_to_colocated(reference: dict, layer_stack: PDStack) -> None:
    log = layer_stack.prefill.log_path
    assert count_in_log(log, r"transfer_mode 'layer': each of the \d+ layers") >= 1, "P did not enable layer push"
    pushed_before = count_in_log(log, r"pushed \d+ blocks")
    made = assert_matches_reference(
        layer_stack.router_url, layer_stack.model, reference, list(range(len(PROMPT_LENGTHS))), "layer mode"
    )
    for i, content in enumerate(CHAT_PROMPTS):
        assert chat(layer_stack.router_url, layer_stack.model, content, stream=False) == reference["chat"][False][i]
    pushed = count_in_log(log, r"pushed \d+ blocks") - pushed_before
    assert pushed >= made, f"only {pushed} KV pushes logged by P for {made} requests"
    # Streamed, not pushed after the prefill: some pushes started before P's scheduler saw the prefill end.
    records = [r for r in map(parse_trace_line, log.read_text(errors="replace").splitlines()) if r]
    early = [r for r in records if (r.at("push_started") or 1e18) < (r.at("prefill_done") or 0)]
    assert early, "no push started before its prefill finished: nothing was streamed layer by layer"
    assert wait_kv_free(layer_stack.prefill_url) == 0.0, f"P still holds KV: {kv_usage(layer_stack.prefill_url)}"
    assert wait_kv_free(layer_stack.decode_url) == 0.0, f"D still holds KV: {kv_usage(layer_stack.decode_url)}"


@pytest.mark.skipif(
    layerwise_proxy()[0] is None and not ascend_peers.required(),
    reason=f"vLLM-Ascend's layer-wise proxy: {layerwise_proxy()[1]}",
)
def test_layer_mode_behind_vllm_ascends_layerwise_proxy(reference: dict, layer_stack: PDStack, tmp_path: Path) -> None:
    """D first (vLLM-Ascend's layer-wise proxy, tests/support/layerwise_proxy.py): D asks before P has the
    request, so P streams each prefill's layers to the waiting D."""
    log = layer_stack.prefill.log_path
    start = len(log.read_bytes())
    check_layerwise_proxy(reference, layer_stack, tmp_path, "layer-wise proxy, D first, P in layer mode")
    new_lines = log.read_bytes()[start:].decode(errors="replace").splitlines()
    records = [r for r in map(parse_trace_line, new_lines) if r]
    assert any((r.at("push_started") or 1e18) < (r.at("prefill_done") or 0) for r in records), "nothing streamed"
