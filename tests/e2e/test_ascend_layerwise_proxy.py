"""vLLM-Ascend's layer-wise proxy, unmodified, in front of the session's PDConnector P and D (D first).

`load_balance_proxy_layerwise_server_example.py` (vllm-ascend 0.23.0.post1, next to the example proxy
PDC_VLLM_ASCEND_PEERS names, see launch/ascend_peers.py) sends the client's request to D only, with
`kv_transfer_params: {do_remote_prefill: true, metaserver: http://<proxy>/v1/metaserver}` and no room.
D picks the room, asks its prefill deployment for it and posts `{request_id, do_remote_decode,
bootstrap_room}` to the metaserver (pd_connector.metaserver); the proxy then sends the request to P
with those parameters, and P pushes the KV to D. Greedy completions and chat, streamed and not, must
be token-identical to a colocated vLLM, every request a KV push, and neither side may hold KV after.
Only the proxy starts here: P and D are the session's `pd_stack`.
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


def _layerwise_proxy() -> tuple[Path | None, str]:
    """(vLLM-Ascend's layer-wise proxy, "") or (None, why): it sits next to the example proxy."""
    example, missing = ascend_peers.example_proxy()
    if example is None:
        return None, missing
    script = example.parent / LAYERWISE_PROXY
    return (script, "") if script.is_file() else (None, f"{example.parent} holds no {LAYERWISE_PROXY}")


#: Absent: skipped before anything starts, naming the variable; under CI (CI=true) it fails instead.
PROXY_SCRIPT, MISSING = _layerwise_proxy()
_skip = [pytest.mark.skip(reason=f"vLLM-Ascend's layer-wise proxy: {MISSING}")]
pytestmark = [
    pytest.mark.e2e,
    pytest.mark.vllm023,
    *(_skip if PROXY_SCRIPT is None and not ascend_peers.required() else []),
]

HOST = "127.0.0.1"
#: A few prompts: 1 token, one block exactly, one token past a block, many blocks.
PROMPTS = [0, 8, 13, 20]
D_FIRST = r"D first; the prefill is asked through metaserver"
ANSWERED = r"metaserver \S+ answered after"


def test_vllm_ascend_layerwise_proxy_in_front_of_pdconnector(
    reference: dict, pd_stack: PDStack, tmp_path: Path
) -> None:
    if PROXY_SCRIPT is None:
        pytest.fail(f"CI=true and vLLM-Ascend's layer-wise proxy is missing: {MISSING}")
    missing = [m for m in ("fastapi", "httpx", "uvicorn") if importlib.util.find_spec(m) is None]
    assert not missing, f"the layer-wise proxy needs {missing} (pd-connector's base dependencies)"
    assert [PROMPT_LENGTHS[i] for i in PROMPTS] == [1, 32, 65, 257]
    p_log, d_log = pd_stack.prefill.log_path, pd_stack.decode.log_path
    before = {
        "pushed": count_in_log(p_log, r"pushed \d+ blocks"),
        "received": count_in_log(d_log, r"KV received"),
        "failed": count_in_log(d_log, r"KV load failed"),
        "d_first": count_in_log(d_log, D_FIRST),
        "answered": count_in_log(d_log, ANSWERED),
        "p_picked": count_in_log(p_log, r"named no bootstrap_room"),
    }
    (proxy_port,) = free_ports(1)
    with ProcessGroup(tmp_path) as group:
        proxy_cmd = [
            sys.executable,
            str(PROXY_SCRIPT),
            "--host", HOST,
            "--port", str(proxy_port),
            "--prefiller-hosts", HOST,
            "--prefiller-ports", str(pd_stack.prefill_port),
            "--decoder-hosts", HOST,
            "--decoder-ports", str(pd_stack.decode_port),
        ]  # fmt: skip
        proxy = group.start("layerwise-proxy", proxy_cmd, env=dict(os.environ, PYTHONUNBUFFERED="1"), cpus="")
        proxy_url = f"http://{HOST}:{proxy_port}"
        wait_all_healthy([(f"{proxy_url}/healthcheck", proxy)], 60)

        made = assert_matches_reference(proxy_url, pd_stack.model, reference, PROMPTS, "layer-wise proxy, D first")
        for stream in (False, True):
            for i, content in enumerate(CHAT_PROMPTS):
                got = chat(proxy_url, pd_stack.model, content, stream=stream)
                assert got == reference["chat"][stream][i], f"chat {i}, stream={stream}"
                made += 1

    def grown(key: str, path: Path, pattern: str) -> int:
        return count_in_log(path, pattern) - before[key]

    assert grown("d_first", d_log, D_FIRST) == made, "D did not take every request as D first"
    deadline = time.monotonic() + 10  # the last post's answer (P's) may be logged after D's answer
    while grown("answered", d_log, ANSWERED) < made and time.monotonic() < deadline:
        time.sleep(0.2)
    assert grown("answered", d_log, ANSWERED) == made, "D's metaserver posts did not all succeed"
    assert grown("p_picked", p_log, r"named no bootstrap_room") == 0, "P got a request without D's room"
    pushed, received = grown("pushed", p_log, r"pushed \d+ blocks"), grown("received", d_log, r"KV received")
    assert pushed >= made and received >= made, f"{made} requests, {pushed} pushes, {received} receipts"
    assert grown("failed", d_log, r"KV load failed") == 0
    assert wait_kv_free(pd_stack.prefill_url) == 0.0, f"P still holds KV: {kv_usage(pd_stack.prefill_url)}"
    assert wait_kv_free(pd_stack.decode_url) == 0.0, f"D still holds KV: {kv_usage(pd_stack.decode_url)}"
