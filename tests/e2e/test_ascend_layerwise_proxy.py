"""vLLM-Ascend's layer-wise proxy, unmodified, in front of the session's PDConnector P and D (D first).

The proxy sends the client's request to D only, with a `metaserver` and no room; D picks the room and
posts P's parameters to the proxy's metaserver, which hands them to P (pd_connector.ascend.metaserver). Greedy
completions and chat, streamed and not, token-identical to a colocated vLLM, every request a KV push,
no KV held after (tests/support/layerwise_proxy.py). Only the proxy starts here: P and D are the
session's `pd_stack` (request mode); test_pd_layer_mode.py runs the same checks with P in layer mode.
Without PDC_VLLM_ASCEND_PEERS the test is skipped before anything starts (under CI=true it fails).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from launch import ascend_peers
from launch.processes import PDStack
from tests.support.layerwise_proxy import check_layerwise_proxy, layerwise_proxy

PROXY_SCRIPT, MISSING = layerwise_proxy()
_skip = [pytest.mark.skip(reason=f"vLLM-Ascend's layer-wise proxy: {MISSING}")]
pytestmark = [
    pytest.mark.e2e,
    pytest.mark.vllm023,
    *(_skip if PROXY_SCRIPT is None and not ascend_peers.required() else []),
]


def test_vllm_ascend_layerwise_proxy_in_front_of_pdconnector(
    reference: dict, pd_stack: PDStack, tmp_path: Path
) -> None:
    check_layerwise_proxy(reference, pd_stack, tmp_path, "layer-wise proxy, D first, P in request mode")
