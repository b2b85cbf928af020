"""Mixed tensor-parallel sizes between P and D, end to end, token-identical to a colocated run.

1P(TP2) -> 1D(TP1): D's single rank takes one KV head from each P rank.
1P(TP1) -> 1D(TP2): each D rank takes its one KV head out of P's blocks.
Real `vllm serve` processes with PDConnector, the bootstrap server, Mooncake TCP and the Router.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from launch.processes import ProcessGroup, start_pd_stack
from tests.support.serving import PROMPT_LENGTHS, START_TIMEOUT_S, assert_matches_reference, count_in_log, wait_kv_free

pytestmark = [pytest.mark.e2e, pytest.mark.vllm023]

# A spread of lengths: 1 token, block boundaries, more than 4 blocks.
SAMPLE = [i for i, n in enumerate(PROMPT_LENGTHS) if n in (1, 31, 32, 33, 65, 129, 300)]


def _binds(p_tp: int, d_tp: int) -> tuple[str, str]:
    """P on core 0, D on core 1, whatever the TP sizes (TP ranks of one side share its core).

    On this 2-core box a P process that shares D's core sees Mooncake TCP writes stall now
    and then (see test_pd_dp.py), so P and D are kept apart.
    """
    return "|".join(["0"] * p_tp), "|".join(["1"] * d_tp)


@pytest.mark.parametrize("p_tp, d_tp", [(2, 1), (1, 2)], ids=["P-tp2-D-tp1", "P-tp1-D-tp2"])
def test_mixed_tp_equivalence(reference: dict, tiny_model: Path, tmp_path: Path, p_tp: int, d_tp: int) -> None:
    p_cpus, d_cpus = _binds(p_tp, d_tp)
    with ProcessGroup(tmp_path) as group:
        stack = start_pd_stack(
            group, tiny_model,
            extra_p_config={"room_timeout_s": 60}, extra_d_config={"kv_wait_timeout_s": 60},
            p_args=["--tensor-parallel-size", str(p_tp)], d_args=["--tensor-parallel-size", str(d_tp)],
            p_cpus=p_cpus, d_cpus=d_cpus, timeout=START_TIMEOUT_S,
        )  # fmt: skip
        assert_matches_reference(stack.router_url, str(tiny_model), reference, SAMPLE, f"P tp{p_tp} -> D tp{d_tp}")
        # Two rank pairs per request (P tp2: both P ranks write; D tp2: P writes to both D ranks),
        # streaming and not.
        pushes = count_in_log(stack.prefill.log_path, r"pushed \d+ blocks")
        assert pushes >= 2 * 2 * len(SAMPLE), f"{pushes} pushes logged for {2 * len(SAMPLE)} requests"
        assert wait_kv_free(stack.prefill_url) == 0.0
        assert wait_kv_free(stack.decode_url) == 0.0
