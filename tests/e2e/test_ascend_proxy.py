"""vLLM-Ascend's example proxy, unmodified, in front of a PDConnector P and D.

`load_balance_proxy_server_example.py` (vllm-ascend 0.23.0.post1; PDC_VLLM_ASCEND_PEERS says where it
is, see launch/ascend_peers.py) calls P first with `kv_transfer_params: {do_remote_decode: true, remote_*: null}` (no room), then calls D
with whatever kv_transfer_params P answered. PDConnector's P picks the room and answers with D's
complete parameters, so the KV still moves P -> D over Mooncake TCP. Greedy answers must be
token-identical to a colocated vLLM, every request must have been a KV push, and neither side may
hold KV afterwards.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest

from launch import ascend_peers
from launch.processes import ProcessGroup, free_ports, vllm_env, vllm_serve_cmd, wait_all_healthy
from tests.support.serving import (
    PROMPT_LENGTHS,
    START_TIMEOUT_S,
    assert_matches_reference,
    count_in_log,
    kv_usage,
    wait_kv_free,
)

#: vLLM-Ascend's example proxy, or None and why. Absent: the test is skipped before any vLLM starts,
#: naming the variable; under CI (CI=true) it fails instead.
PROXY_SCRIPT, MISSING = ascend_peers.example_proxy()
_skip = [pytest.mark.skip(reason=f"vLLM-Ascend's example proxy: {MISSING}")]
pytestmark = [
    pytest.mark.e2e,
    pytest.mark.vllm023,
    *(_skip if PROXY_SCRIPT is None and not ascend_peers.required() else []),
]

HOST = "127.0.0.1"
#: 20 prompts: 1 token to more than 8 blocks, around every block boundary.
PROMPTS = list(range(len(PROMPT_LENGTHS)))[-20:]


def test_vllm_ascend_example_proxy_in_front_of_pdconnector(reference: dict, tiny_model: Path, tmp_path: Path) -> None:
    if PROXY_SCRIPT is None:
        pytest.fail(f"CI=true and vLLM-Ascend's example proxy is missing: {MISSING}")
    missing = [m for m in ("fastapi", "httpx", "uvicorn") if importlib.util.find_spec(m) is None]
    assert not missing, f"the example proxy needs {missing} (pd-connector's base dependencies)"
    assert len(PROMPTS) == 20 and PROMPT_LENGTHS[PROMPTS[0]] <= 5
    p_port, bootstrap_port, d_port, proxy_port = free_ports(4)
    with ProcessGroup(tmp_path) as group:
        prefill = group.start(
            "prefill",
            vllm_serve_cmd(tiny_model, p_port, kv_role="kv_producer", bootstrap_port=bootstrap_port),
            env=vllm_env("0"),
        )
        decode = group.start(
            "decode",
            vllm_serve_cmd(tiny_model, d_port, kv_role="kv_consumer", bootstrap_port=bootstrap_port),
            env=vllm_env("1"),
        )
        proxy_cmd = [
            sys.executable,
            str(PROXY_SCRIPT),
            "--host", HOST,
            "--port", str(proxy_port),
            "--prefiller-hosts", HOST,
            "--prefiller-ports", str(p_port),
            "--decoder-hosts", HOST,
            "--decoder-ports", str(d_port),
        ]  # fmt: skip
        proxy = group.start("ascend-proxy", proxy_cmd, env=dict(os.environ, PYTHONUNBUFFERED="1"), cpus="")
        p_url, d_url, proxy_url = (f"http://{HOST}:{port}" for port in (p_port, d_port, proxy_port))
        wait_all_healthy([(f"{p_url}/health", prefill), (f"{d_url}/health", decode)], START_TIMEOUT_S, watch=[proxy])
        wait_all_healthy([(f"{proxy_url}/healthcheck", proxy)], 60)

        made = assert_matches_reference(proxy_url, str(tiny_model), reference, PROMPTS, "vLLM-Ascend proxy -> P -> D")

        assert count_in_log(prefill.log_path, r"named no bootstrap_room; prefill picked one") >= made
        pushed = count_in_log(prefill.log_path, r"pushed \d+ blocks")
        received = count_in_log(decode.log_path, r"KV received")
        assert pushed >= made and received >= made, f"{made} requests, {pushed} pushes, {received} receipts"
        assert count_in_log(decode.log_path, r"KV load failed") == 0
        assert wait_kv_free(p_url) == 0.0, f"P still holds KV: {kv_usage(p_url)}"
        assert wait_kv_free(d_url) == 0.0, f"D still holds KV: {kv_usage(d_url)}"
