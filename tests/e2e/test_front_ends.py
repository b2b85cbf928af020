"""PDConnector P and D, unmodified, behind the PD routers users already run (the ``routers`` extra).

Each row starts only its router (a Rust binary, up in a second or two) in front of the session's P/D
stack (tests/e2e/conftest.py), so no extra vLLM starts:

- ``sglang_router``: ``python -m sglang_router.launch_router --pd-disaggregation``: P and D at
  once, SGLang's top-level ``bootstrap_host/port/room`` (pd_connector.api_server.front_ends maps them);
- ``vllm_router_nixl``: ``vllm-router --vllm-pd-disaggregation`` (``--kv-connector nixl``): P, then
  D with P's answered kv_transfer_params;
- ``vllm_router_mooncake``: ``vllm-router --kv-connector mooncake``: reads P's bootstrap ``/query``
  (pd_connector.bootstrap.mooncake_query), then a shared ``transfer_id`` on P and D.

For each: greedy completions, stream and not, token-identical to the colocated ``reference``; P's
``vllm:pd_kv_pushes_total`` grows by one per request (the KV moved); P and D served none of them
without a transfer (``vllm:pd_requests_without_transfer_total``); nothing is held afterwards. And
the bypass counter moves for a request sent to D without transfer parameters.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from launch.processes import LOOPBACK, ProcessGroup, free_ports, wait_http_ok
from tests.support.front_ends import BYPASSED, PUSHES, misrouted
from tests.support.front_ends import vllm_router_binary as _vllm_router
from tests.support.front_ends import wait_routable as _wait_routable
from tests.support.metrics import metric, wait_metric
from tests.support.serving import assert_matches_reference, complete, kv_usage, prompts, wait_kv_free

pytestmark = [pytest.mark.e2e]

#: Prompts (indices into tests.support.serving.prompts) of 5, 47 and 129 tokens: 6 requests per row.
INDICES = [3, 10, 17]


def _sglang_router(port: int, metrics_port: int, p: str, bootstrap: int, d: str) -> list[str]:
    return [
        sys.executable, "-m", "sglang_router.launch_router", "--host", LOOPBACK, "--port", str(port),
        "--pd-disaggregation", "--prefill", p, str(bootstrap), "--decode", d, "--policy", "round_robin",
        "--prometheus-host", LOOPBACK, "--prometheus-port", str(metrics_port), "--log-level", "warn",
    ]  # fmt: skip


def _vllm_router_cmd(connector: str) -> Callable[[int, int, str, int, str], list[str]]:
    def cmd(port: int, metrics_port: int, p: str, bootstrap: int, d: str) -> list[str]:
        return [
            _vllm_router() or "vllm-router", "--host", LOOPBACK, "--port", str(port), "--vllm-pd-disaggregation",
            "--kv-connector", connector, "--prefill", p, str(bootstrap), "--decode", d, "--policy", "round_robin",
            "--prometheus-host", LOOPBACK, "--prometheus-port", str(metrics_port), "--log-level", "warning",
        ]  # fmt: skip

    return cmd


ROWS: dict[str, tuple[Callable[[int, int, str, int, str], list[str]], bool]] = {
    "sglang_router": (_sglang_router, importlib.util.find_spec("sglang_router") is not None),
    "vllm_router_nixl": (_vllm_router_cmd("nixl"), _vllm_router() is not None),
    "vllm_router_mooncake": (_vllm_router_cmd("mooncake"), _vllm_router() is not None),
}


@pytest.mark.parametrize("row", list(ROWS))
def test_front_end_moves_kv_and_matches_colocated(reference: dict, pd_stack, row: str, tmp_path: Path) -> None:
    make_cmd, installed = ROWS[row]
    if not installed:
        pytest.fail(f"{row} is not installed: pip install -e '.[routers]' (scripts/setup.sh does)")
    port, metrics_port = free_ports(2)
    cmd = make_cmd(port, metrics_port, pd_stack.prefill_url, pd_stack.bootstrap_port, pd_stack.decode_url)
    p, d = pd_stack.prefill_url, pd_stack.decode_url
    with ProcessGroup(tmp_path) as group:
        router = group.start(row, cmd, env=dict(os.environ, RUST_LOG="warn"), cpus="")
        url = f"http://{LOOPBACK}:{port}"
        wait_http_ok(f"{url}/health", 60, router)
        _wait_routable(url, pd_stack.model)
        time.sleep(1.0)  # the warm-up's push is counted
        pushes, bypassed = metric(p, PUSHES), misrouted(p) + misrouted(d)
        made = assert_matches_reference(url, pd_stack.model, reference, INDICES, row)
        moved = wait_metric(p, PUSHES, pushes + made) - pushes
    assert moved >= made, f"{row}: P pushed KV for {moved:.0f} of {made} requests"
    assert misrouted(p) + misrouted(d) == bypassed, f"{row}: requests served without a KV transfer"
    assert wait_kv_free(p) == 0.0, f"{row}: P still holds KV: {kv_usage(p)}"
    assert wait_kv_free(d) == 0.0, f"{row}: D still holds KV: {kv_usage(d)}"


def test_bypass_counter_moves_for_a_decode_request_without_params(pd_stack) -> None:
    d = pd_stack.decode_url
    before = metric(d, BYPASSED, reason="no_kv_transfer_params")
    complete(d, pd_stack.model, prompts()[INDICES[0]], stream=False, max_tokens=2)
    assert wait_metric(d, BYPASSED, before + 1, reason="no_kv_transfer_params") == before + 1
