"""The plan of this node's external-DP ranks: each rank's template command line and environment.

`build_plans(args, extra)` checks the launcher's flags, picks the DP mode, assigns devices and
writes one `RankPlan` per local rank; it starts nothing, so it is unit-testable as it is.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import os
import shlex
import shutil
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from launch.affinity import format_cpus, parse_cpus, taskset_prefix
from launch.dp_checks import UsageError, validate
from launch.dp_devices import cpu_assignments, detect_device, npu_assignments
from launch.dp_mode import KV_TRANSFER_FLAG, resolve_dp_mode, rewrite_kv_transfer_config
from launch.ports import port_in_use

TEMPLATE = Path(__file__).resolve().parent / "run_dp_template.sh"
#: Directory that holds the `launch` package (for `python -m launch.vllm_cli` in the ranks).
PACKAGE_PARENT = Path(__file__).resolve().parent.parent


@dataclass
class RankPlan:
    """How one local DP rank is started: the template's command line and the env it adds."""

    dp_rank: int
    local_index: int
    port: int
    devices: str
    cmd: list[str]
    env: dict[str, str] = field(default_factory=dict)
    health_url: str = ""
    #: "vllm" (external DP through vLLM's --data-parallel-* flags) or "independent".
    dp_mode: str = "vllm"
    #: Why that mode was chosen (one line).
    dp_mode_reason: str = ""
    #: independent mode: whether a --kv-transfer-config was found and given this rank's DP place.
    kv_config_rewritten: bool = False
    #: cpu: the cores the rank's whole process tree runs on ('' = not placed), all TP groups together.
    cpus: str = ""

    def shell_line(self) -> str:
        """A copy-pasteable shell line: `env K=V ... [taskset -c CPUS] bash template args...`."""
        assignments = [f"{k}={v}" for k, v in sorted(self.env.items())]
        return shlex.join(["env", *assignments, *taskset_prefix(self.cpus), *self.cmd])


def resolve_serve_cmd(explicit: str | None) -> list[str]:
    """The command each rank runs vLLM's CLI with (for display and for PD_SERVE_CMD)."""
    if explicit:
        return shlex.split(explicit)
    if shutil.which("vllm"):
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            importlib.metadata.version("vllm")
            return ["vllm"]
    return [sys.executable, "-m", "launch.vllm_cli"]


def build_plans(
    args: argparse.Namespace,
    extra: Sequence[str],
    *,
    environ: Mapping[str, str] | None = None,
    cpus: Sequence[int] | None = None,
) -> list[RankPlan]:
    """Validate the flags and work out every local rank's command line and environment."""
    environ = os.environ if environ is None else environ
    dp_mode, dp_mode_reason = resolve_dp_mode(args)
    local = validate(args, extra, dp_mode)
    device = detect_device() if args.device == "auto" else args.device
    if device == "npu":
        devices = npu_assignments(local, args.tp_size, args.visible_devices, environ)
    else:
        devices = cpu_assignments(local, args.tp_size, args.cpu_bind, cpus)
    serve_cmd = resolve_serve_cmd(args.serve_cmd)
    if any(not part or any(c.isspace() for c in part) for part in serve_cmd):
        raise UsageError(f"the serve command must be words without whitespace, got {serve_cmd!r}")
    health_host = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(args.host, args.host)
    if ":" in health_host:
        health_host = f"[{health_host}]"
    plans = []
    for i in range(local):
        dp_rank = args.dp_rank_start + i
        port = args.vllm_start_port + i
        rank_extra, rewritten = list(extra), False
        if dp_mode == "independent":
            rank_extra, rewritten = rewrite_kv_transfer_config(
                extra, dp_rank=dp_rank, dp_size=args.dp_size, bootstrap_host=args.dp_address
            )
        cmd = [
            "bash",
            str(args.template),
            devices[i],
            str(port),
            str(args.dp_size),
            str(dp_rank),
            args.dp_address,
            str(args.dp_rpc_port),
            str(args.tp_size),
            *rank_extra,
        ]
        env = {
            "PD_DEVICE": device,
            "PD_HOST": args.host,
            "PD_PYTHON": sys.executable,
            "PD_SERVE_CMD": " ".join(serve_cmd),
            "PD_DP_LOCAL_INDEX": str(i),
            "PD_DP_MODE": dp_mode,
        }
        if args.model:
            env["PD_MODEL"] = args.model
        if serve_cmd[1:3] == ["-m", "launch.vllm_cli"]:
            current = environ.get("PYTHONPATH", "")
            env["PYTHONPATH"] = str(PACKAGE_PARENT) + (os.pathsep + current if current else "")
        plans.append(
            RankPlan(
                dp_rank=dp_rank,
                local_index=i,
                port=port,
                devices=devices[i],
                cmd=cmd,
                env=env,
                health_url=f"http://{health_host}:{port}/health",
                dp_mode=dp_mode,
                dp_mode_reason=dp_mode_reason,
                kv_config_rewritten=rewritten,
                cpus=format_cpus(parse_cpus(devices[i])) if device == "cpu" and devices[i] else "",
            )
        )
    return plans


def plan_notes(plans: Sequence[RankPlan]) -> list[str]:
    """What to say about the plans before starting them: the DP mode and why, and what independent mode lacks."""
    notes = [f"dp mode {plans[0].dp_mode} ({plans[0].dp_mode_reason})"]
    if plans[0].dp_mode == "independent" and not plans[0].kv_config_rewritten:
        notes.append(
            f"note: no PDConnector {KV_TRANSFER_FLAG} after --, so nothing to give dp_rank/dp_size: "
            "the ranks start as plain independent vLLM instances"
        )
    return notes


def check_ports_free(host: str, plans: Sequence[RankPlan]) -> None:
    """Raise `UsageError` when a rank's API port cannot be bound on `host` now."""
    bind_host = host or "0.0.0.0"
    for plan in plans:
        if port_in_use(bind_host, plan.port):
            raise UsageError(f"API port {plan.port} (dp rank {plan.dp_rank}) is already in use on {bind_host}")
