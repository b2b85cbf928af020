"""Mixed tensor-parallel sizes between P and D, end to end, token-identical to a colocated run.

1P(TP2) -> 1D(TP1): D's single rank takes one KV head from each P rank.
1P(TP1) -> 1D(TP2): each D rank takes its one KV head out of P's blocks.
Real `vllm serve` processes with PDConnector, the bootstrap server, Mooncake TCP and the Router.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from launch.processes import ProcessGroup, free_ports, vllm_env, vllm_serve_cmd
from tests.e2e.helpers import (
    PROMPT_LENGTHS,
    assert_matches_reference,
    count_in_log,
    start_router_when_healthy,
    wait_kv_free,
)

pytestmark = pytest.mark.e2e

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
    p_port, bootstrap_port, d_port, router_port = free_ports(4)
    with ProcessGroup(tmp_path) as group:
        p_cmd = vllm_serve_cmd(
            tiny_model,
            p_port,
            kv_role="kv_producer",
            bootstrap_port=bootstrap_port,
            extra_config={"room_timeout_s": 60},
            extra_args=["--tensor-parallel-size", str(p_tp)],
        )
        d_cmd = vllm_serve_cmd(
            tiny_model,
            d_port,
            kv_role="kv_consumer",
            bootstrap_port=bootstrap_port,
            extra_config={"kv_wait_timeout_s": 60},
            extra_args=["--tensor-parallel-size", str(d_tp)],
        )
        p_bind, d_bind = _binds(p_tp, d_tp)
        prefill = group.start("prefill", p_cmd, env=vllm_env(p_bind))
        decode = group.start("decode", d_cmd, env=vllm_env(d_bind))
        url = start_router_when_healthy(
            group,
            router_port,
            [("127.0.0.1", p_port, bootstrap_port)],
            [("127.0.0.1", d_port)],
            [(f"http://127.0.0.1:{p_port}/health", prefill), (f"http://127.0.0.1:{d_port}/health", decode)],
        )
        assert_matches_reference(url, str(tiny_model), reference, SAMPLE, f"P tp{p_tp} -> D tp{d_tp}")
        # Two rank pairs per request (P tp2: both P ranks write; D tp2: P writes to both D ranks),
        # streaming and not.
        pushes = count_in_log(prefill.log_path, r"pushed \d+ blocks")
        assert pushes >= 2 * 2 * len(SAMPLE), f"{pushes} pushes logged for {2 * len(SAMPLE)} requests"
        assert wait_kv_free(f"http://127.0.0.1:{p_port}") == 0.0
        assert wait_kv_free(f"http://127.0.0.1:{d_port}") == 0.0
