"""vLLM-Ascend's layer-wise proxy (D first, metaserver), unmodified, in front of a PDConnector P/D stack.

`load_balance_proxy_layerwise_server_example.py` (vllm-ascend 0.23.0.post1, next to the example proxy
PDC_VLLM_ASCEND_PEERS names, see launch/ascend_peers.py) sends the client's request to D only, with
`kv_transfer_params: {do_remote_prefill: true, metaserver: http://<proxy>/v1/metaserver}` and no room.
D picks the room, asks its prefill deployment for it and posts `{request_id, do_remote_decode,
bootstrap_room}` to the metaserver (pd_connector.ascend.metaserver); the proxy then sends the request to P
with those parameters, and P pushes the KV to D. :func:`check_layerwise_proxy` starts only the proxy.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import time
from pathlib import Path

import pytest

from launch import ascend_peers
from launch.processes import PDStack, ProcessGroup, free_ports, wait_all_healthy
from tests.support.serving import (
    CHAT_PROMPTS,
    PROMPT_LENGTHS,
    assert_matches_reference,
    chat,
    count_in_log,
    kv_usage,
    wait_kv_free,
)

LAYERWISE_PROXY = "load_balance_proxy_layerwise_server_example.py"
HOST = "127.0.0.1"
#: A few prompts: 1 token, one block exactly, one token past a block, many blocks.
PROMPTS = [0, 8, 13, 20]
D_FIRST = r"D first; the prefill is asked through metaserver"
ANSWERED = r"metaserver \S+ answered after"


def layerwise_proxy() -> tuple[Path | None, str]:
    """(vLLM-Ascend's layer-wise proxy, "") or (None, why): it sits next to the example proxy."""
    example, missing = ascend_peers.example_proxy()
    if example is None:
        return None, missing
    script = example.parent / LAYERWISE_PROXY
    return (script, "") if script.is_file() else (None, f"{example.parent} holds no {LAYERWISE_PROXY}")


def required_proxy() -> Path:
    """The layer-wise proxy's script; skips the test without it (fails under CI=true)."""
    script, missing = layerwise_proxy()
    if script is None:
        if ascend_peers.required():
            pytest.fail(f"CI=true and vLLM-Ascend's layer-wise proxy is missing: {missing}")
        pytest.skip(f"vLLM-Ascend's layer-wise proxy: {missing}")
    absent = [m for m in ("fastapi", "httpx", "uvicorn") if importlib.util.find_spec(m) is None]
    assert not absent, f"the layer-wise proxy needs {absent} (pd-connector's base dependencies)"
    return script


def start_layerwise_proxy(group: ProcessGroup, script: Path, stack: PDStack) -> str:
    """The proxy, unmodified, in front of ``stack``'s P (one API server, whatever its DP size) and D; its URL
    once healthy. It belongs to ``group``, which stops it."""
    (proxy_port,) = free_ports(1)
    proxy_cmd = [
        sys.executable,
        str(script),
        "--host", HOST,
        "--port", str(proxy_port),
        "--prefiller-hosts", HOST,
        "--prefiller-ports", str(stack.prefill_port),
        "--decoder-hosts", HOST,
        "--decoder-ports", str(stack.decode_port),
    ]  # fmt: skip
    proxy = group.start("layerwise-proxy", proxy_cmd, env=dict(os.environ, PYTHONUNBUFFERED="1"), cpus="")
    proxy_url = f"http://{HOST}:{proxy_port}"
    wait_all_healthy([(f"{proxy_url}/healthcheck", proxy)], 60)
    return proxy_url


class FlowLog:
    """The D-first flow's lines in P's and D's logs, counted from its creation on."""

    def __init__(self, stack: PDStack) -> None:
        self.stack = stack
        p_log, d_log = stack.prefill.log_path, stack.decode.log_path
        self.patterns = {
            "pushed": (p_log, r"pushed \d+ blocks"),
            "received": (d_log, r"KV received"),
            "failed": (d_log, r"KV load failed"),
            "d_first": (d_log, D_FIRST),
            "answered": (d_log, ANSWERED),
            "p_picked": (p_log, r"named no bootstrap_room"),
        }
        self.before = {key: count_in_log(path, pattern) for key, (path, pattern) in self.patterns.items()}

    def grown(self, key: str) -> int:
        path, pattern = self.patterns[key]
        return count_in_log(path, pattern) - self.before[key]

    def check(self, made: int, what: str) -> None:
        """Every one of ``made`` requests D first with a successful post, pushed by P and received by D, no
        load failed, no KV held after on either side."""
        assert self.grown("d_first") == made, f"{what}: D did not take every request as D first"
        deadline = time.monotonic() + 10  # the last post's answer (P's) may be logged after D's answer
        while self.grown("answered") < made and time.monotonic() < deadline:
            time.sleep(0.2)
        assert self.grown("answered") == made, f"{what}: D's metaserver posts did not all succeed"
        assert self.grown("p_picked") == 0, f"{what}: P got a request without D's room"
        pushed, received = self.grown("pushed"), self.grown("received")
        assert pushed >= made and received >= made, f"{what}: {made} requests, {pushed} pushes, {received} receipts"
        assert self.grown("failed") == 0, f"{what}: a KV load failed"
        stack = self.stack
        assert wait_kv_free(stack.prefill_url) == 0.0, f"P still holds KV: {kv_usage(stack.prefill_url)}"
        assert wait_kv_free(stack.decode_url) == 0.0, f"D still holds KV: {kv_usage(stack.decode_url)}"


def check_layerwise_proxy(reference: dict, stack: PDStack, log_dir: Path, what: str) -> int:
    """The proxy in front of ``stack``'s P and D: greedy completions and chat, streamed and not, equal to
    ``reference``; then :meth:`FlowLog.check`. Skips (fails under CI=true) without the proxy. Returns the
    requests made."""
    script = required_proxy()
    assert [PROMPT_LENGTHS[i] for i in PROMPTS] == [1, 32, 65, 257]
    flow = FlowLog(stack)
    with ProcessGroup(log_dir) as group:
        proxy_url = start_layerwise_proxy(group, script, stack)
        made = assert_matches_reference(proxy_url, stack.model, reference, PROMPTS, what)
        for stream in (False, True):
            for i, content in enumerate(CHAT_PROMPTS):
                got = chat(proxy_url, stack.model, content, stream=stream)
                assert got == reference["chat"][stream][i], f"{what}: chat {i}, stream={stream}"
                made += 1
    flow.check(made, what)
    return made
