"""Shared by the external-DP launcher tests (tests/test_launch_online_dp_*.py): paths, flags, plans."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from launch.dp_plan import RankPlan, build_plans
from launch.launch_online_dp import parse_args

REPO = Path(__file__).resolve().parents[2]
TEMPLATE = REPO / "launch" / "run_dp_template.sh"

#: The launcher flags of a two-rank group on this host (no device flags).
BASE = ["--dp-size", "2", "--dp-address", "127.0.0.1", "--dp-rpc-port", "13345", "--vllm-start-port", "18100"]
#: A PDConnector --kv-transfer-config (without the per-rank extra config).
KV = {"kv_connector": "PDConnector", "kv_role": "kv_producer"}


def plans_for(argv: list[str], **kw: Any) -> list[RankPlan]:
    """The per-rank plans the launcher would build for `argv` (keyword arguments go to build_plans)."""
    args, extra = parse_args(argv)
    return build_plans(args, extra, **kw)
