"""Start-up checks of a worker rank, before it opens its transfer backend.

- vLLM-Ascend's ``prefill`` / ``decode`` sizes against what this rank runs as;
- the transport against the memory the KV lives in (``tcp`` cannot read NPU memory);
- the registered region count (KV plus P's NHD staging buffer) against the transport's limit (256 on ``ascend``).

Each failure is a ``RankSetupError`` whose message names both values.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from pd_connector.ascend_env import setup_local_comm_res
from pd_connector.config import DisaggConfig
from pd_connector.layout import memory_ranges
from pd_connector.peer_sizes import sizes_mismatch
from pd_connector.platform_transport import region_limit_problem, transport_problem


class RankSetupError(ValueError):
    """This rank's configuration or KV memory does not fit its deployment or transport."""


def check_sizes(cfg: DisaggConfig, tp_size: int, vllm_dp_size: int) -> None:
    """This rank's own side (``prefill`` on P, ``decode`` on D) must match its TP and DP sizes.

    vLLM's DP size is compared only when vLLM runs the ranks as one DP group: independent
    engines report 1 (on P, ``prefill.dp_size`` then is the deployment's ``dp_size``, which
    ``config`` already checked against an explicit ``dp_size``).
    """
    own = cfg.prefill if cfg.is_prefill else cfg.decode
    dp = vllm_dp_size if vllm_dp_size > 1 else None
    problem = sizes_mismatch(cfg.mode, own, f"this {cfg.mode} instance", dp, tp_size)
    if problem is not None:
        raise RankSetupError(problem)


def kv_device_types(kv_caches: Mapping[str, Any]) -> set[str]:
    types = set()
    for value in kv_caches.values():
        for part in value if isinstance(value, (list, tuple)) else [value]:
            types.add(str(part.device.type))
    return types


def local_rank() -> int:
    """This worker's rank on its node (vLLM's world group), 0 when vLLM cannot tell."""
    try:
        from vllm.distributed.parallel_state import get_world_group

        return int(get_world_group().local_rank)
    except Exception:  # noqa: BLE001 - no initialized world group (tests, tools)
        return 0


def check_kv_memory(
    cfg: DisaggConfig,
    kv_caches: Mapping[str, Any],
    ranges: Sequence[tuple[int, int]],
    staging: Sequence[tuple[int, int]] = (),
) -> None:
    """The transport must reach the KV's memory and take this many regions: the KV's plus the staging buffer's."""
    problem = transport_problem(cfg.protocol, kv_device_types(kv_caches)) or region_limit_problem(
        cfg.protocol, len(ranges) + len(staging), staging=len(staging)
    )
    if problem is not None:
        raise RankSetupError(problem)


def prepare_rank(
    cfg: DisaggConfig,
    kv_caches: Mapping[str, Any],
    tp_size: int,
    vllm_dp_size: int,
    staging: Sequence[tuple[int, int]] = (),
) -> list[tuple[int, int]]:
    """Run every start-up check and set the ascend transport's environment; the ranges to register.

    ``staging``: the NHD staging buffer's range (``transfer.staging``), registered with the KV's.
    """
    check_sizes(cfg, tp_size, vllm_dp_size)
    ranges = memory_ranges(kv_caches)
    check_kv_memory(cfg, kv_caches, ranges, staging)
    if cfg.ascend_local_comm_res_path:
        setup_local_comm_res(cfg.ascend_local_comm_res_path, local_rank())
    return ranges + list(staging)
