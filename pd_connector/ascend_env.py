"""``ascend_local_comm_res_path``: the A5 HIXL endpoint files, handed to the ascend transport.

As vLLM-Ascend's worker does for its own connector: the directory holds one
``ub_endpoint_npu_<device id>.json`` per NPU; the file of this rank's NPU (``local_rank``-th
of ``ASCEND_RT_VISIBLE_DEVICES``, or device ``local_rank`` when that is unset) is read and put,
as compact JSON, into ``ASCEND_LOCAL_COMM_RES``, which Mooncake's ascend transport (HIXL)
reads when its engine starts. An ``ASCEND_LOCAL_COMM_RES`` already set (vLLM-Ascend's worker
sets it before the connector exists) is left alone.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import MutableMapping
from pathlib import Path

logger = logging.getLogger(__name__)

ENV_VAR = "ASCEND_LOCAL_COMM_RES"
VISIBLE_DEVICES = "ASCEND_RT_VISIBLE_DEVICES"


def endpoint_file(path: str, local_rank: int, visible_devices: str | None) -> Path:
    """The endpoint file of the NPU that local rank ``local_rank`` drives."""
    if visible_devices is not None and visible_devices.strip():
        devices = [int(d) for d in visible_devices.split(",") if d.strip()]
        if not 0 <= local_rank < len(devices):
            raise ValueError(f"local rank {local_rank} has no NPU in {VISIBLE_DEVICES}={visible_devices!r}")
        device = devices[local_rank]
    else:
        device = local_rank
    return Path(path) / f"ub_endpoint_npu_{device}.json"


def setup_local_comm_res(path: str, local_rank: int, env: MutableMapping[str, str] | None = None) -> bool:
    """Set ``ASCEND_LOCAL_COMM_RES`` from ``path`` for this rank; False when there is nothing to do."""
    env = os.environ if env is None else env
    if not path:
        return False
    if env.get(ENV_VAR):
        logger.info("%s already set; kv_connector_extra_config.ascend_local_comm_res_path not read", ENV_VAR)
        return False
    file = endpoint_file(path, local_rank, env.get(VISIBLE_DEVICES))
    try:
        data = json.loads(file.read_text())
    except FileNotFoundError:
        raise FileNotFoundError(
            f"endpoint config file {file} not found: kv_connector_extra_config.ascend_local_comm_res_path must "
            "name a directory of ub_endpoint_npu_<device>.json files"
        ) from None
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot read endpoint config file {file}: {exc}") from None
    env[ENV_VAR] = json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    logger.info("%s set from %s", ENV_VAR, file)
    return True
