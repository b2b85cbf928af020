"""2P as one external data-parallel deployment (DP 2, started by launch_online_dp.py) -> 1D, through the Router.

The prefill side is what an operator runs with the vLLM-Ascend launcher flags:
`python -m launch.launch_online_dp --dp-size 2 ... -- <vllm serve args> --kv-transfer-config ...`.
The tiny model is dense, so the launcher runs each DP rank as its own `vllm serve` (vLLM 0.32
refuses external DP for dense models) and writes `dp_rank`/`dp_size`/`bootstrap_host` into each
rank's connector config: rank 0 hosts the deployment's bootstrap server, rank 1 registers with it.

Two Routers sit in front of the same P ranks and D:
- one told each prefiller's DP rank (`--prefiller-dp-ranks 0 1`): D gets `prefill_dp_rank`;
- one not told: D asks the bootstrap server which DP rank holds each room.
Rooms are given by the client, so `room % 2` picks the P rank and both ranks serve.
Answers must be token-identical to a colocated vLLM.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import sys
from pathlib import Path

import pytest

from launch.processes import (
    KV_PARAMS_MIDDLEWARE,
    ProcessGroup,
    free_ports,
    start_pd_stack,
    vllm_env,
    vllm_serve_cmd,
)
from tests.support.serving import (
    PROMPT_LENGTHS,
    START_TIMEOUT_S,
    assert_matches_reference,
    count_in_log,
    start_router_when_healthy,
    wait_kv_free,
)

pytestmark = pytest.mark.e2e

HOST = "127.0.0.1"
SAMPLE = [i for i, n in enumerate(PROMPT_LENGTHS) if n in (1, 32, 33, 129, 300)]
#: Both P ranks on core 0, D alone on core 1. Measured on this 2-core box: a P process sharing
#: D's core sees Mooncake TCP writes to D stall past MC_TCP_PROGRESS_TIMEOUT_SEC now and then
#: (internal DP with P on "0|1": most writes of the rank on core 1 failed; with "0|0": none).
P_CORES_DP2 = "0|0"


def _two_consecutive_free_ports() -> int:
    """A port p such that p and p + 1 were both free a moment ago (launch_online_dp gives rank i port p + i)."""
    for _ in range(50):
        (port,) = free_ports(1)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as first, socket.socket() as second:
            try:
                first.bind((HOST, port))
                second.bind((HOST, port + 1))
            except OSError:
                continue
        return port
    raise RuntimeError("no two consecutive free ports found")


def _rank_pids(launcher_log: Path) -> list[int]:
    text = launcher_log.read_text(errors="replace") if launcher_log.exists() else ""
    return [int(pid) for pid in re.findall(r"started dp rank \d+ \(pid (\d+)", text)]


def test_external_dp2_prefill_to_one_decode_through_the_router(
    reference: dict, tiny_model: Path, tmp_path: Path
) -> None:
    bootstrap_port, rpc_port, d_port, router_ranked, router_asking = free_ports(5)
    p0_port = _two_consecutive_free_ports()
    p_ports = [p0_port, p0_port + 1]
    kv_config = {
        "kv_connector": "PDConnector",
        "kv_role": "kv_producer",
        "kv_connector_extra_config": {
            "bootstrap_port": bootstrap_port,
            "local_ip": HOST,
            "protocol": "tcp",
            "room_timeout_s": 60,
        },
    }
    rank_log_dir = tmp_path / "dp-ranks"
    launcher = [
        sys.executable, "-m", "launch.launch_online_dp",
        "--dp-size", "2", "--tp-size", "1",
        "--dp-address", HOST, "--dp-rpc-port", str(rpc_port),
        "--vllm-start-port", str(p0_port),
        "--model", str(tiny_model), "--host", HOST,
        "--device", "cpu", "--cpu-bind", P_CORES_DP2.replace("|", ";"),
        "--log-dir", str(rank_log_dir), "--stop-grace-s", "8",
        "--",
        "--dtype", "float32", "--block-size", "32", "--max-model-len", "2048", "--enforce-eager",
        "--kv-transfer-config", json.dumps(kv_config),
        "--middleware", KV_PARAMS_MIDDLEWARE,
    ]  # fmt: skip
    env = vllm_env("0")
    env.pop("VLLM_CPU_OMP_THREADS_BIND")  # the launcher binds each rank
    with ProcessGroup(tmp_path) as group:
        try:
            prefill = group.start("launch-online-dp", launcher, env=env)
            d_cmd = vllm_serve_cmd(
                tiny_model, d_port, kv_role="kv_consumer", bootstrap_port=bootstrap_port,
                extra_config={"kv_wait_timeout_s": 60},
            )  # fmt: skip
            decode = group.start("decode", d_cmd, env=vllm_env("1"))
            prefillers = [(HOST, port, bootstrap_port) for port in p_ports]
            instances = [(f"http://{HOST}:{port}/health", prefill) for port in p_ports]
            instances.append((f"http://{HOST}:{d_port}/health", decode))
            ranked_url = start_router_when_healthy(
                group, router_ranked, prefillers, [(HOST, d_port)], instances,
                extra_args=["--prefiller-dp-ranks", "0", "1"], name="router-ranked",
            )  # fmt: skip
            asking_url = start_router_when_healthy(
                group, router_asking, prefillers, [(HOST, d_port)], instances, name="router-asking"
            )
            launcher_log = prefill.log_path.read_text(errors="replace")
            assert "dp mode independent" in launcher_log, launcher_log[-2000:]

            requests = 0
            for first_room, url, what in ((0, ranked_url, "ranked"), (1000, asking_url, "asking")):
                # Unique rooms; room % 2 picks the P rank, so both serve, streaming and not.
                requests += assert_matches_reference(
                    url, str(tiny_model), reference, SAMPLE, f"external DP2 -> D, Router {what}",
                    room_of=lambda n, stream, first=first_room: first + 2 * n + int(stream),
                )  # fmt: skip

            # Each P rank pushed the KV of the requests routed to it; rank 1 registered with rank 0's server.
            logs = [rank_log_dir / f"dp_rank_{r}.log" for r in (0, 1)]
            pushes = [count_in_log(path, r"pushed \d+ blocks") for path in logs]
            # room % 2 picks the rank, unless the Router found a rank's health check slow at that moment
            # and skipped it (this box is small), so each rank must have served a good share, not exactly half.
            assert sum(pushes) >= requests and min(pushes) >= requests // 4, pushes
            assert count_in_log(logs[1], r"registered rank dp=1 tp=0 with bootstrap") == 1
            for port in (*p_ports, d_port):
                assert wait_kv_free(f"http://{HOST}:{port}") == 0.0
        finally:
            # The launcher stops its ranks on SIGTERM; make sure by pid in case it could not.
            pids = _rank_pids(prefill.log_path) if "prefill" in locals() else []
            group.stop_all()
            for pid in pids:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(pid, signal.SIGKILL)


def test_internal_dp2_prefill_to_one_decode_through_the_router(
    reference: dict, tiny_model: Path, tmp_path: Path
) -> None:
    """P is one `vllm serve --data-parallel-size 2`: vLLM's own load balancer picks the engine per request.

    The Router cannot know which engine that is, so it sends no `prefill_dp_rank` and D asks the
    bootstrap server (hosted by DP engine 0; engine 1 registers with it) where each room went.
    vLLM runs a dense model's DP engines as independent engines of DP size 1, so the deployment's
    size comes from `kv_connector_extra_config.dp_size`.
    """
    with ProcessGroup(tmp_path) as group:
        stack = start_pd_stack(
            group, tiny_model,
            extra_p_config={"room_timeout_s": 60, "dp_size": 2}, extra_d_config={"kv_wait_timeout_s": 60},
            p_args=["--data-parallel-size", "2"], p_cpus=P_CORES_DP2, timeout=START_TIMEOUT_S,
        )  # fmt: skip
        assert_matches_reference(stack.router_url, str(tiny_model), reference, SAMPLE, "internal DP2 -> D")
        log = stack.prefill.log_path
        assert count_in_log(log, r"registered rank dp=1 tp=0 with bootstrap") == 1
        assert count_in_log(log, r"pushed \d+ blocks") >= 2 * len(SAMPLE)
        assert wait_kv_free(stack.prefill_url) == 0.0
        assert wait_kv_free(stack.decode_url) == 0.0
