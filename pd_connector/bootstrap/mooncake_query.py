"""``GET /query`` on P's bootstrap server: vLLM's in-tree MooncakeConnector answer, for vllm-router.

vllm-router ``--kv-connector mooncake`` reads it once per prefill at start-up (retrying while it
fails) and keeps one ``engine_id`` per DP rank, which it hands to D as ``remote_engine_id``
(pd_connector.api_server.front_ends maps that back to ``prefill_dp_rank``). The answer's shape is vLLM's:
``{dp_rank: {"engine_id": str, "worker_addr": {tp_rank: {pp_rank: addr}}}}``; PDConnector's
workers are found through ``/bootstrap/route``, so ``worker_addr`` stays empty and the call,
which vllm-router cannot sign, reveals no address (only the DP size).
"""

from __future__ import annotations

import re
from typing import Any

QUERY_PATH = "/query"
_ENGINE_PREFIX = "pdconnector-dp"
_ENGINE_RE = re.compile(re.escape(_ENGINE_PREFIX) + r"(\d{1,5})")


def engine_id(dp_rank: int) -> str:
    return f"{_ENGINE_PREFIX}{dp_rank}"


def dp_rank_of_engine_id(value: Any) -> int | None:
    """The DP rank an ``engine_id`` of :func:`query_answer` names; None for anything else."""
    match = _ENGINE_RE.fullmatch(value) if isinstance(value, str) else None
    return int(match.group(1)) if match else None


def query_answer(dp_size: int) -> dict[str, dict[str, Any]]:
    """The body of ``GET /query`` for a deployment of ``dp_size`` DP ranks (all registered)."""
    return {str(dp): {"engine_id": engine_id(dp), "worker_addr": {}} for dp in range(dp_size)}
