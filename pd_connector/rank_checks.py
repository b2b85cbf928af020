"""Start-up checks of a worker rank, before it opens its transfer backend.

- vLLM-Ascend's ``prefill`` / ``decode`` sizes against what this rank runs as;
- the KV's memory against what the backend reaches and how many regions it takes (KV plus P's NHD
  staging buffer), as its options tell (``BackendOptions.memory_problem``: Mooncake's ``tcp`` cannot
  read NPU memory, its ``ascend`` transport takes 256 regions);
- the device name the backend opens with (``backend_config``: the NPU index with PP > 1 on the
  ``ascend`` transport, as vLLM-Ascend's connectors).

Each failure is a ``RankSetupError`` whose message names both values.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from pd_connector.ascend.env import engine_device_name
from pd_connector.ascend.peer_sizes import sizes_mismatch
from pd_connector.config import DisaggConfig
from pd_connector.layouts.regions import memory_ranges

logger = logging.getLogger(__name__)


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
    """The backend must reach the KV's memory and take this many regions: the KV's plus the staging buffer's."""
    regions = len(ranges) + len(staging)
    problem = cfg.backend_options.memory_problem(kv_device_types(kv_caches), regions, len(staging))
    if problem is not None:
        raise RankSetupError(problem)


def prepare_rank(
    cfg: DisaggConfig,
    kv_caches: Mapping[str, Any],
    tp_size: int,
    vllm_dp_size: int,
    staging: Sequence[tuple[int, int]] = (),
) -> list[tuple[int, int]]:
    """Run every start-up check and the backend's own rank set-up; the ranges to register.

    ``staging``: the NHD staging buffer's range (``transfer.staging``), registered with the KV's.
    """
    check_sizes(cfg, tp_size, vllm_dp_size)
    ranges = memory_ranges(kv_caches)
    check_kv_memory(cfg, kv_caches, ranges, staging)
    cfg.backend_options.prepare_rank(local_rank())  # Mooncake: ascend_local_comm_res_path's endpoint file
    return ranges + list(staging)


def current_device_index() -> int:
    """This worker's device index (vLLM-Ascend: ``torch.npu.current_device()``)."""
    import torch

    npu = getattr(torch, "npu", None)
    if npu is not None:
        return int(npu.current_device())
    return int(torch.accelerator.current_device_index())


def backend_config(
    cfg: DisaggConfig, pp_size: int, current_device: Callable[[], int] = current_device_index
) -> DisaggConfig:
    """``cfg`` with the device name this rank's transfer engine opens with (``ascend.env.engine_device_name``)."""
    options = cfg.backend_options
    given = getattr(options, "device_name", None)
    if not isinstance(given, str):
        return cfg
    name = engine_device_name(given, bool(getattr(options, "uses_hixl", False)), pp_size, current_device)
    if name == given:
        return cfg
    logger.info("Mooncake ascend transport opens with device_name %s (this rank's NPU; PP size %d)", name, pp_size)
    return dataclasses.replace(cfg, backend_options=dataclasses.replace(options, device_name=name))  # type: ignore[type-var]
