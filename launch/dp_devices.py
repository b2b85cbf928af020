"""Device placement of the local DP ranks: NPU ids or CPU cores, `tp` groups per rank.

On Ascend each rank gets ASCEND_RT_VISIBLE_DEVICES (consecutive ids of the node's pool); on CPU
each rank gets VLLM_CPU_OMP_THREADS_BIND (its share of this process's CPUs, or the given lists).
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
from collections.abc import Mapping, Sequence

from launch.affinity import format_cpus
from launch.dp_checks import UsageError, parse_id_list


def detect_device() -> str:
    """'npu' when this node looks like an Ascend node (npu-smi on PATH or torch_npu installed)."""
    if shutil.which("npu-smi") or importlib.util.find_spec("torch_npu") is not None:
        return "npu"
    return "cpu"


def count_npus() -> int | None:
    """Number of NPUs `npu-smi info -l` reports, or None when it cannot tell."""
    if not shutil.which("npu-smi"):
        return None
    try:
        out = subprocess.run(["npu-smi", "info", "-l"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    m = re.search(r"Total Count\s*:\s*(\d+)", out)
    return int(m.group(1)) if m else None


def compact_ids(ids: Sequence[int]) -> str:
    """[0,1,2,5,7,8] -> '0-2,5,7-8' (the form VLLM_CPU_OMP_THREADS_BIND takes)."""
    return format_cpus(ids)


def npu_assignments(local: int, tp: int, visible: str | None, env: Mapping[str, str]) -> list[str]:
    """ASCEND_RT_VISIBLE_DEVICES of each local rank: consecutive groups of `tp` ids of the pool."""
    need = local * tp
    if visible is not None:
        pool = parse_id_list(visible, "--visible-devices")
        source = "--visible-devices"
    elif env.get("ASCEND_RT_VISIBLE_DEVICES"):
        pool = parse_id_list(env["ASCEND_RT_VISIBLE_DEVICES"], "ASCEND_RT_VISIBLE_DEVICES")
        source = "ASCEND_RT_VISIBLE_DEVICES"
    else:
        count = count_npus()
        pool = list(range(count if count is not None else need))
        source = "npu-smi" if count is not None else ""
    if len(pool) < need:
        raise UsageError(
            f"--dp-size-local ({local}) * --tp-size ({tp}) = {need} NPUs, but only {len(pool)} are available ({source})"
        )
    return [",".join(str(x) for x in pool[i * tp : (i + 1) * tp]) for i in range(local)]


def cpu_assignments(local: int, tp: int, cpu_bind: str, cpus: Sequence[int] | None = None) -> list[str]:
    """VLLM_CPU_OMP_THREADS_BIND of each local rank ('' = vLLM's default)."""
    if cpu_bind == "none":
        return [""] * local
    if cpu_bind == "auto":
        pool = sorted(cpus if cpus is not None else os.sched_getaffinity(0))
        need = local * tp
        if len(pool) < need:
            raise UsageError(
                f"--cpu-bind auto needs one CPU per rank and TP rank ({local} x {tp} = {need}), "
                f"but this process may use only {len(pool)}; pass --cpu-bind none or fewer ranks"
            )
        per_rank = len(pool) // local
        per_tp = per_rank // tp
        out = []
        for i in range(local):
            mine = pool[i * per_rank : (i + 1) * per_rank]
            groups = [compact_ids(mine[t * per_tp : (t + 1) * per_tp]) for t in range(tp)]
            out.append("|".join(groups))
        return out
    lists = [x.strip() for x in cpu_bind.split(";")]
    if len(lists) != local or any(not x for x in lists):
        raise UsageError(f"--cpu-bind needs {local} non-empty core lists separated by ';', got {cpu_bind!r}")
    for x in lists:
        if len(x.split("|")) != tp:
            raise UsageError(f"--cpu-bind: {x!r} must hold {tp} core group(s) joined by '|' (one per TP rank)")
        for group in x.split("|"):
            parse_id_list(group, "--cpu-bind")
    return lists
