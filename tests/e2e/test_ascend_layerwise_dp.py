"""vLLM-Ascend's layer-wise proxy, unmodified, in front of a data-parallel P (internal DP 2) and one D.

The proxy sends each request to D first with its `metaserver`; D picks the room and, told no
`prefill_dp_rank` (the proxy cannot know which engine vLLM's DP load balancer will pick), looks the
room's DP rank up on P's bootstrap server. Each P engine registers a room's DP rank when the request
arrives (bootstrap.dp_rooms); a room not registered yet waits on D without holding a transfer thread
(transfer.dp_wait). Here each P engine runs one request at a time (`--max-num-seqs 1`) and the prompts
go out together, long ones among them, so they queue behind each other on P: every answer must still be
token-identical to a colocated vLLM, both engines serve, and no KV is held after.

Runs on the vLLM 0.23 line only (marked `vllm023`: the line vLLM-Ascend 0.23 runs on), one stack of its
own (P DP 2 + D + the proxy). Without PDC_VLLM_ASCEND_PEERS it is skipped before anything starts (under
CI=true it fails).
"""

from __future__ import annotations

import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from launch import ascend_peers
from launch.processes import ProcessGroup, start_pd_stack
from tests.support.layerwise_proxy import FlowLog, layerwise_proxy, required_proxy, start_layerwise_proxy
from tests.support.serving import PROMPT_LENGTHS, START_TIMEOUT_S, complete, prompts

PROXY_SCRIPT, MISSING = layerwise_proxy()
_skip = [pytest.mark.skip(reason=f"vLLM-Ascend's layer-wise proxy: {MISSING}")]
pytestmark = [
    pytest.mark.e2e,
    pytest.mark.vllm023,
    *(_skip if PROXY_SCRIPT is None and not ascend_peers.required() else []),
]

#: Both P engines on core 0, D on core 1 (as tests/e2e/test_pd_dp.py: a P engine sharing D's core
#: stalls Mooncake TCP writes on this 2-core box).
P_CORES_DP2 = "0|0"
#: Prompt indices sent together: 300, 257 and 200 tokens, then short ones that queue behind them.
QUEUED = [21, 20, 19, 0, 13, 8]


def _pushes_by_dp_rank(p_log: Path) -> dict[int, int]:
    """DP rank -> pushes in P's log: a worker's pid names its rank in its transfer manager's start line."""
    text = p_log.read_text(errors="replace")
    rank_of = {pid: int(dp) for pid, dp in re.findall(r"pid=(\d+)\)[^\n]*KV transfer manager[^\n]*/dp(\d+)/tp", text)}
    pushes: dict[int, int] = {}
    for pid in re.findall(r"pid=(\d+)\)[^\n]*pushed \d+ blocks", text):
        pushes[rank_of[pid]] = pushes.get(rank_of[pid], 0) + 1
    return pushes


def test_layerwise_proxy_with_a_data_parallel_prefill(reference: dict, tiny_model: Path, tmp_path: Path) -> None:
    script = required_proxy()
    assert [PROMPT_LENGTHS[i] for i in QUEUED] == [300, 257, 200, 1, 65, 32]
    what = "layer-wise proxy, D first, P internal DP 2"
    texts = prompts()
    with ProcessGroup(tmp_path) as group:
        stack = start_pd_stack(
            group, tiny_model,
            extra_p_config={"room_timeout_s": 60, "dp_size": 2}, extra_d_config={"kv_wait_timeout_s": 60},
            p_args=["--data-parallel-size", "2", "--max-num-seqs", "1"], p_cpus=P_CORES_DP2,
            timeout=START_TIMEOUT_S,
        )  # fmt: skip
        flow = FlowLog(stack)
        proxy_url = start_layerwise_proxy(group, script, stack)
        model = str(tiny_model)
        with ThreadPoolExecutor(len(QUEUED)) as pool:
            futures = {
                (i, n % 2 == 1): pool.submit(complete, proxy_url, model, texts[i], stream=n % 2 == 1)
                for n, i in enumerate(QUEUED)
            }
            for (i, stream), future in futures.items():
                got = future.result()
                assert got == reference["completions"][stream][i], f"{what}: prompt {i}, stream={stream}"
        flow.check(len(QUEUED), what)
        assert sorted(_pushes_by_dp_rank(stack.prefill.log_path)) == [0, 1], f"{what}: one P engine served all"
        d_log = stack.decode.log_path.read_text(errors="replace")
        assert "registered no DP rank for room" not in d_log, f"{what}: a load gave up on its room's DP rank"
