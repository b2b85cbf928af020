"""Which platform this process runs on, for backends whose default depends on it.

- ``on_npu()``: whether this is an Ascend NPU machine (vLLM's current platform is ``npu``, or
  ``torch_npu`` is installed when vLLM cannot tell). The Mooncake backend picks its default
  transport from it (``transfer.mooncake.default_protocol``); which transport reaches which memory,
  and how many regions it takes, is the backend's own (``BackendOptions.memory_problem``).
"""

from __future__ import annotations

import importlib.util
import logging

logger = logging.getLogger(__name__)


def _platform_device_type() -> str | None:
    try:
        from vllm.platforms import current_platform
    except Exception:  # noqa: BLE001 - no vLLM (Router, tools): fall back to torch_npu presence
        return None
    try:
        return str(current_platform.device_type)
    except Exception:  # noqa: BLE001 - an unresolvable platform tells nothing
        return None


def on_npu() -> bool:
    """Whether this process runs on an Ascend NPU machine."""
    device_type = _platform_device_type()
    if device_type is not None and device_type != "":
        return device_type == "npu"
    try:
        return importlib.util.find_spec("torch_npu") is not None
    except (ImportError, ValueError):
        return False
