"""A pipeline-parallel prefill, end to end, token-identical to a colocated run.

1P(PP2) -> 1D(PP1), configured as vLLM-Ascend's users write it (``prefill: {pp_size: 2}``): each P
stage registers its layers with the bootstrap server and pushes only them; D asks both stages and
starts decoding once both wrote. Real `vllm serve` processes with PDConnector, the bootstrap server,
Mooncake TCP and the Router.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from launch.processes import ProcessGroup, start_pd_stack
from tests.support.serving import PROMPT_LENGTHS, START_TIMEOUT_S, assert_matches_reference, count_in_log, wait_kv_free

pytestmark = [pytest.mark.e2e, pytest.mark.vllm023]

# 1 token, a block boundary, several blocks.
SAMPLE = [i for i, n in enumerate(PROMPT_LENGTHS) if n in (1, 32, 33, 129)]


def test_pipeline_parallel_prefill_equivalence(reference: dict, tiny_model: Path, tmp_path: Path) -> None:
    sizes = {"prefill": {"tp_size": 1, "pp_size": 2, "pp_layer_partition": "1,1"}, "decode": {"pp_size": 1}}
    with ProcessGroup(tmp_path) as group:
        stack = start_pd_stack(
            group, tiny_model,
            extra_p_config={"room_timeout_s": 60, **sizes}, extra_d_config={"kv_wait_timeout_s": 60, **sizes},
            p_args=["--pipeline-parallel-size", "2"],
            p_cpus="0|0", d_cpus="1", timeout=START_TIMEOUT_S,
        )  # fmt: skip
        # Both stages of the tiny model's 2 layers registered with their layers.
        log = stack.prefill.log_path
        assert count_in_log(log, r"bootstrap: registered rank dp=0 cp=0 tp=0 pp=1 layers \[1, 2\)") == 1
        assert count_in_log(log, r"bootstrap: registered rank dp=0 cp=0 tp=0 pp=0 layers \[0, 1\)") == 1
        assert_matches_reference(stack.router_url, str(tiny_model), reference, SAMPLE, "P pp2 -> D pp1")
        # Each stage pushes its own layer for every request, streaming and not.
        pushes = count_in_log(log, r"pushed \d+ blocks")
        assert pushes >= 2 * 2 * len(SAMPLE), f"{pushes} pushes logged for {2 * len(SAMPLE)} requests"
        assert wait_kv_free(stack.prefill_url) == 0.0
        assert wait_kv_free(stack.decode_url) == 0.0
