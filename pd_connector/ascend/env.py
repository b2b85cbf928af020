"""``ascend_local_comm_res_path``: the A5 HIXL endpoint files, handed to the ascend transport.

As vLLM-Ascend 0.23's worker does for its own connector: the directory holds one
``ub_endpoint_npu_<device id>.json`` per NPU; the file of this rank's NPU is read and put,
as compact JSON, into ``ASCEND_LOCAL_COMM_RES``, which Mooncake's ascend transport (HIXL)
reads when its engine starts. An ``ASCEND_LOCAL_COMM_RES`` already set (vLLM-Ascend's worker
sets it before the connector exists) is left alone.

The rank's NPU is the ``local_rank``-th of ``ASCEND_RT_VISIBLE_DEVICES``; with that unset, the
``local_rank``-th of the machine's *physical* NPU ids, in ascending order, as ``npu-smi info -m``
lists them (vLLM-Ascend: ``DeviceInfo.get_npu_map_info``), not ``local_rank`` itself: a node
whose NPU ids are 8..15 reads ``ub_endpoint_npu_8.json`` on local rank 0. The ids come from an
``npu_ids`` callable (default: ``installed_npu_ids``), which tests replace.
"""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
from collections.abc import Callable, MutableMapping, Sequence
from pathlib import Path

logger = logging.getLogger(__name__)

ENV_VAR = "ASCEND_LOCAL_COMM_RES"
VISIBLE_DEVICES = "ASCEND_RT_VISIBLE_DEVICES"
NPU_SMI = ("npu-smi", "info", "-m")

#: Where the machine's physical NPU ids come from (sorted ascending).
NpuIds = Callable[[], Sequence[int]]


def parse_npu_map(text: str) -> list[int]:
    """The NPU ids in ``npu-smi info -m`` output that have an NPU chip (a numeric chip logic id), sorted.

    The header's columns are separated by two or more spaces, rows by any whitespace; rows
    whose ``Chip Logic ID`` is not a number (``-``: an MCU) are no NPU. Without that column
    every row's NPU ID counts.
    """
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    if not lines:
        raise ValueError("npu-smi info -m printed nothing")
    header = [col.strip() for col in re.split(r"\s{2,}", lines[0]) if col.strip()]
    if "NPU ID" not in header:
        raise ValueError(f"npu-smi info -m: no 'NPU ID' column in {lines[0]!r}")
    npu_col = header.index("NPU ID")
    logic_col = header.index("Chip Logic ID") if "Chip Logic ID" in header else npu_col
    ids: set[int] = set()
    for line in lines[1:]:
        parts = line.split()
        if len(parts) <= max(npu_col, logic_col):
            continue
        if parts[npu_col].isdigit() and parts[logic_col].isdigit():
            ids.add(int(parts[npu_col]))
    return sorted(ids)


def installed_npu_ids() -> list[int]:
    """This machine's physical NPU ids from ``npu-smi info -m`` (C locale), sorted."""
    env = {**os.environ, "LC_ALL": "C", "LANG": "C", "LC_MESSAGES": "C"}
    try:
        out = subprocess.run(NPU_SMI, capture_output=True, text=True, env=env, timeout=60, check=True).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        raise ValueError(
            f"{VISIBLE_DEVICES} is unset and the physical NPU ids could not be read with `{' '.join(NPU_SMI)}` "
            f"({exc}); set {VISIBLE_DEVICES} to this node's NPU ids"
        ) from None
    return parse_npu_map(out)


def rank_npu_id(local_rank: int, visible_devices: str | None, npu_ids: NpuIds = installed_npu_ids) -> int:
    """The physical id of the NPU that local rank ``local_rank`` drives."""
    if visible_devices is not None and visible_devices.strip():
        try:
            devices = [int(d) for d in visible_devices.split(",") if d.strip()]
        except ValueError:
            raise ValueError(f"{VISIBLE_DEVICES}={visible_devices!r} must be comma-separated NPU ids") from None
        where = f"{VISIBLE_DEVICES}={visible_devices!r}"
    else:
        devices = sorted(int(d) for d in npu_ids())
        where = f"this node's NPU ids {devices} ({VISIBLE_DEVICES} unset)"
    if not 0 <= local_rank < len(devices):
        raise ValueError(f"local rank {local_rank} has no NPU in {where}")
    return devices[local_rank]


def endpoint_file(path: str, local_rank: int, visible_devices: str | None, npu_ids: NpuIds = installed_npu_ids) -> Path:
    """The endpoint file of the NPU that local rank ``local_rank`` drives."""
    return Path(path) / f"ub_endpoint_npu_{rank_npu_id(local_rank, visible_devices, npu_ids)}.json"


def setup_local_comm_res(
    path: str,
    local_rank: int,
    env: MutableMapping[str, str] | None = None,
    npu_ids: NpuIds = installed_npu_ids,
) -> bool:
    """Set ``ASCEND_LOCAL_COMM_RES`` from ``path`` for this rank; False when there is nothing to do."""
    env = os.environ if env is None else env
    if not path:
        return False
    if env.get(ENV_VAR):
        logger.info("%s already set; kv_connector_extra_config.ascend_local_comm_res_path not read", ENV_VAR)
        return False
    file = endpoint_file(path, local_rank, env.get(VISIBLE_DEVICES), npu_ids)
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
    logger.info("%s set from %s (local rank %d)", ENV_VAR, file, local_rank)
    return True


def engine_device_name(given: str, uses_hixl: bool, pp_size: int, current_device: Callable[[], int]) -> str:
    """The ``device_name`` this rank's Mooncake engine starts with.

    vLLM-Ascend 0.23's Mooncake connectors start the ``ascend`` transport with the rank's NPU index
    (``torch.npu.current_device()``) as device name when pipeline parallel is on (PP > 1), and
    with none otherwise. PDConnector does the same on the ``ascend`` transport when
    ``device_name`` is not given; a given one (the RDMA NIC of the ``rdma`` transport) is kept.
    """
    if given or not uses_hixl or pp_size <= 1:
        return given
    return str(int(current_device()))
