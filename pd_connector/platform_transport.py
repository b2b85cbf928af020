"""Which Mooncake transport fits this machine, and whether it can reach the KV's memory.

- ``default_protocol()``: ``ascend`` on an Ascend NPU machine (vLLM's current platform is
  ``npu``, or ``torch_npu`` is installed), else ``tcp``. It is what ``protocol`` means when
  ``kv_connector_extra_config`` leaves it out.
- ``transport_problem(protocol, device_types)``: a transport that cannot read the memory the
  KV cache lives in (``tcp`` or ``rdma`` with NPU device memory) is refused at start-up.
- ``REGION_LIMITS``: most memory regions a transport registers (HCCL's 256 on ``ascend``).
"""

from __future__ import annotations

import importlib.util
import logging
from collections.abc import Iterable

logger = logging.getLogger(__name__)

#: Device types whose memory each transport cannot read or write.
_UNREACHABLE: dict[str, frozenset[str]] = {
    "tcp": frozenset({"npu"}),
    "rdma": frozenset({"npu"}),
    "ascend": frozenset(),
}

#: Most registered memory regions per transport (vLLM-Ascend: MAX_HCCL_REGISTER_REGIONS = 256).
REGION_LIMITS: dict[str, int] = {"ascend": 256}


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


def default_protocol() -> str:
    """The Mooncake transport of this platform: ``ascend`` on NPUs, ``tcp`` elsewhere."""
    return "ascend" if on_npu() else "tcp"


def transport_problem(protocol: str, device_types: Iterable[str]) -> str | None:
    """Why ``protocol`` cannot move KV that lives on ``device_types``; None if it can."""
    bad = sorted(set(device_types) & _UNREACHABLE.get(protocol, frozenset()))
    if not bad:
        return None
    return (
        f"kv_connector_extra_config.protocol {protocol!r} cannot read KV cache memory on device {bad[0]!r}; "
        "use protocol 'ascend' (Mooncake's NPU build) for KV in NPU memory"
    )


def region_limit_problem(protocol: str, count: int, staging: int = 0) -> str | None:
    """Why ``count`` registered regions (``staging`` of them NHD staging buffers) exceed what ``protocol`` takes."""
    limit = REGION_LIMITS.get(protocol)
    if limit is None or count <= limit:
        return None
    what = f"the KV cache needs {count} memory regions registered"
    fix = "fewer layers per worker (a larger TP/PP size) or KV tensors allocated next to each other fit"
    if staging:
        what += f" ({count - staging} of KV and {staging} NHD staging buffer)"
        fix += "; so does kv_connector_extra_config.staging_bytes 0 (no mixed TP on NHD) or decode.tp_size equal to prefill's"
    return f"{what}, but the {protocol!r} transport takes at most {limit} (REGION_LIMITS); {fix}"
