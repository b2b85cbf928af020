"""Start the external data-parallel (DP) ranks of one node: `python -m launch.launch_online_dp ...`.

Flag-compatible with vLLM-Ascend's `examples/external_online_dp/launch_online_dp.py`: it starts
`--dp-size-local` DP ranks on this node, ranks `--dp-rank-start` ... `--dp-rank-start +
--dp-size-local - 1` of a DP group of `--dp-size`, each as its own `vllm serve` (its own API
server on `--vllm-start-port + i`), through `run_dp_template.sh` with that template's seven
positional arguments:

    devices port dp_size dp_rank dp_address dp_rpc_port tp_size [extra vllm serve args...]

Everything after `--` goes to every rank's `vllm serve` (`--kv-transfer-config ...`,
`--served-model-name ...`), unchanged but for the per-rank `--kv-transfer-config` of
`--dp-mode independent` (below). Examples (two nodes, DP 4, TP 1; then DP 2 on this CPU machine, MoE and dense):

    python -m launch.launch_online_dp --dp-size 4 --dp-size-local 2 --dp-rank-start 0 \\
        --dp-address 10.0.0.1 --dp-rpc-port 12321 --vllm-start-port 7100 --model /models/x
    python -m launch.launch_online_dp --dp-size 4 --dp-size-local 2 --dp-rank-start 2 \\
        --dp-address 10.0.0.1 --dp-rpc-port 12321 --vllm-start-port 7100 --model /models/x
    python -m launch.launch_online_dp --dp-size 2 --dp-address 127.0.0.1 --dp-rpc-port 13345 \\
        --vllm-start-port 8100 --model ./models/tiny-moe --host 127.0.0.1 --device cpu \\
        -- --dtype float32 --block-size 32 --enforce-eager
    python -m launch.launch_online_dp --dp-size 2 --dp-address 127.0.0.1 --vllm-start-port 8100 \\
        --model ./models/tiny-llama --host 127.0.0.1 --device cpu -- --dtype float32 --block-size 32 \\
        --kv-transfer-config '{"kv_connector":"PDConnector","kv_role":"kv_producer"}'

Devices: on Ascend (`npu-smi` on PATH or `torch_npu` installed, or `--device npu`) rank i sees
the NPUs `i*tp ... (i+1)*tp - 1` of the node's pool (`--visible-devices`, else
`ASCEND_RT_VISIBLE_DEVICES`, else 0..N-1) through ASCEND_RT_VISIBLE_DEVICES. On CPU nothing is
pinned to a device; with `--cpu-bind auto` (the default) each rank gets its own share of this
process's CPUs, `--cpu-bind "0-3;4-7"` gives each rank its cores explicitly (`;` between ranks,
`|` between the TP ranks of one rank), and `--cpu-bind none` leaves vLLM's default. A rank's
cores are both its OpenMP binding (VLLM_CPU_OMP_THREADS_BIND, one group per TP rank joined by
`|`) and the placement of its whole process tree (API server, EngineCore, workers; like
`taskset -c`, which `--dry-run` shows), so ranks never run on each other's cores.

The launcher checks the constraints of the vLLM-Ascend deployment guide before starting anything
(one-line message, exit code 2), starts each rank in its own process group, reports when each
rank's `/health` answers, shows each rank's output inline (every line headed by `[dp rank R] `)
unless `--log-dir` is given, forwards SIGINT/SIGTERM to every rank's process group (SIGKILL after
`--stop-grace-s`), stops the others as soon as one rank exits, whatever its exit code (unless
`--keep-going`: a DP group cannot run with a rank missing, and vLLM's API server exits 0 after its
engine died), and exits when the ranks have exited: 0 if all exited 0, else the first failing
rank's code (128+N for signal N), 128+N when it was stopped by signal N.

DP modes (`--dp-mode`): vLLM 0.32 refuses external DP for dense (non-MoE) models ("Non-MoE
models do not support external data parallel mode"), so the launcher can start the ranks in two
ways. `vllm`: each rank gets `--data-parallel-size/-rank/-address/-rpc-port` and the ranks
coordinate through rank 0's DP coordinator at --dp-address:--dp-rpc-port (MoE models).
`independent`: each rank is a plain `vllm serve` without any `--data-parallel-*` flag (the
template sees PD_DP_MODE=independent; --dp-rpc-port is unused), and PDConnector learns the
rank's place from the launcher, which rewrites the JSON of `--kv-transfer-config` per rank: it
sets `kv_connector_extra_config.dp_rank` (the rank's DP rank) and `.dp_size` (--dp-size), and
`.bootstrap_host` to --dp-address unless given (the DP master node runs rank 0, which hosts the
prefill deployment's bootstrap server). `auto` (the default) picks `independent` when `--model`
is a local directory whose config.json describes a dense model, else `vllm` (an MoE model, or no
local config.json to read, e.g. a hub name). Without a `--kv-transfer-config` nothing is
injected: the ranks are plain independent instances (the launcher notes it).

vLLM 0.32 on CPU (measured): MoE models start in `vllm` mode, but the first forward pass fails:
vLLM's CPU communicator lacks `all_gatherv`, which MoE layers use across DP ranks. Torch
compilation of such a model also fails there; pass --enforce-eager.

This module is the command line only: the plan (checks, DP mode, devices, command lines) comes
from `launch.dp_plan` (with `launch.dp_checks`, `launch.dp_mode`, `launch.dp_devices`); the ranks
run in a `launch.process_group.ProcessGroup`, their health is reported by `launch.health`.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import NoReturn, TextIO

from launch.dp_checks import UsageError
from launch.dp_mode import DP_MODES
from launch.dp_plan import TEMPLATE, RankPlan, build_plans, check_ports_free, plan_notes
from launch.health import watch_health
from launch.process_group import ManagedProcess, ProcessGroup, tail

PROG = "launch_online_dp"
EXIT_USAGE = 2
DEFAULT_STOP_GRACE_S = 20.0
#: Lines of a failed rank's log shown when it exits.
FAILED_LOG_LINES = 15
#: Signals that stop every rank (exit code 128 + N).
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # one line instead of usage + message
        self.exit(EXIT_USAGE, f"{PROG}: error: {message} (see --help)\n")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog=PROG,
        description="Start this node's external-DP vLLM ranks (one `vllm serve` per DP rank).",
        epilog="Arguments after `--` are passed to every rank's `vllm serve`.",
    )
    g = p.add_argument_group("vLLM-Ascend launcher flags")
    g.add_argument("--dp-size", type=int, required=True, help="DP ranks in the whole DP group (all nodes)")
    g.add_argument("--tp-size", type=int, default=1, help="tensor-parallel size of each rank (default 1)")
    g.add_argument("--dp-size-local", type=int, default=-1, help="DP ranks started on this node (-1: all of --dp-size)")
    g.add_argument("--dp-rank-start", type=int, default=0, help="DP rank of this node's first rank (default 0)")
    g.add_argument("--dp-address", required=True, help="address of the DP master node (the one with DP rank 0)")
    g.add_argument(
        "--dp-rpc-port",
        type=int,
        default=12345,
        help="DP RPC port on the master node (default 12345; unused with --dp-mode independent)",
    )
    g.add_argument(
        "--vllm-start-port", type=int, default=9000, help="API port of the first local rank; rank i gets +i (9000)"
    )
    o = p.add_argument_group("PDConnector additions")
    o.add_argument("--model", help="model path or name (sets PD_MODEL for the template)")
    o.add_argument(
        "--dp-mode",
        choices=DP_MODES,
        default="auto",
        help="vllm: pass --data-parallel-* to each rank (MoE models); independent: plain `vllm serve` per rank "
        "(dense models, which vLLM refuses in external DP), with dp_rank, dp_size and bootstrap_host (default "
        "--dp-address) written into kv_connector_extra_config of --kv-transfer-config; auto (default): "
        "independent when --model is a local directory whose config.json shows a dense model, else vllm",
    )
    o.add_argument("--host", default="0.0.0.0", help="address each rank's API server binds (default 0.0.0.0)")
    o.add_argument(
        "--device",
        choices=("auto", "npu", "cpu"),
        default="auto",
        help="auto: npu when npu-smi or torch_npu is present, else cpu",
    )
    o.add_argument(
        "--visible-devices",
        help="npu: comma-separated NPU ids to hand out, tp per rank (default: ASCEND_RT_VISIBLE_DEVICES or 0..N-1)",
    )
    o.add_argument(
        "--cpu-bind",
        default="auto",
        help="cpu: 'auto' (split this process's CPUs between the ranks), 'none' (vLLM's default), "
        "or one core list per rank separated by ';' (e.g. '0-3;4-7', TP ranks inside joined by '|'); "
        "a rank's whole process tree runs on its cores, its OpenMP threads are bound to them",
    )
    o.add_argument("--template", type=Path, default=TEMPLATE, help=f"per-rank start script (default {TEMPLATE})")
    o.add_argument(
        "--serve-cmd",
        help="command that runs vLLM's CLI in each rank (default: `vllm`, or `python -m launch.vllm_cli` "
        "where the `vllm` console script fails, e.g. vllm-cpu)",
    )
    o.add_argument("--log-dir", type=Path, help="write each rank's output to LOG_DIR/dp_rank_<r>.log")
    o.add_argument("--stop-grace-s", type=float, default=DEFAULT_STOP_GRACE_S, help="SIGTERM to SIGKILL delay")
    o.add_argument("--keep-going", action="store_true", help="when a rank exits, keep the others running")
    o.add_argument("--no-health-watch", action="store_true", help="do not poll each rank's /health")
    o.add_argument("--skip-port-check", action="store_true", help="do not check that the API ports are free")
    o.add_argument("--dry-run", action="store_true", help="print each rank's command and env; start nothing")
    return p


def split_argv(argv: Sequence[str]) -> tuple[list[str], list[str]]:
    """Split the command line at the first `--`: (launcher args, args for `vllm serve`)."""
    argv = list(argv)
    if "--" in argv:
        i = argv.index("--")
        return argv[:i], argv[i + 1 :]
    return argv, []


def parse_args(argv: Sequence[str]) -> tuple[argparse.Namespace, list[str]]:
    own, extra = split_argv(argv)
    args = build_parser().parse_args(own)
    return args, extra


# -- running ----------------------------------------------------------------------------------
def say(message: str, stream: TextIO | None = None) -> None:
    print(f"{PROG}: {message}", file=stream or sys.stderr, flush=True)


def _exit_code(returncode: int) -> int:
    return 128 - returncode if returncode < 0 else returncode


def _failed_log_tail(path: Path) -> str:
    """The last lines of a rank's log, headed by its path."""
    if not path.is_file():
        return f"(no log at {path})"
    return f"last lines of {path}:\n{tail(path, FAILED_LOG_LINES)}"


def _start_rank(group: ProcessGroup, plan: RankPlan, *, log: bool) -> ManagedProcess:
    env = dict(os.environ)
    env.update(plan.env)
    label = f"dp rank {plan.dp_rank}"
    proc = group.start(
        f"dp_rank_{plan.dp_rank}",
        plan.cmd,
        env=env,
        cwd=os.getcwd(),
        label=label,
        log=log,
        echo=None if log else f"[{label}] ",
        cpus=plan.cpus,
    )
    where = f"log {proc.log_path}" if proc.log_path is not None else "output inline"
    where += f", process tree on cpus {plan.cpus}" if plan.cpus else ""
    say(f"started dp rank {plan.dp_rank} (pid {proc.pid}, port {plan.port}, devices '{plan.devices}', {where})")
    return proc


def _report_health(plans: Sequence[RankPlan], procs: Sequence[ManagedProcess], t0: float) -> None:
    """Say, from a background thread, when each rank's /health answers, and when all of them have."""
    healthy: list[int] = []

    def on_healthy(i: int) -> None:
        healthy.append(i)
        say(f"dp rank {plans[i].dp_rank} healthy at {plans[i].health_url} after {time.monotonic() - t0:.1f} s")
        if len(healthy) == len(plans) and all(p.is_running() for p in procs):
            say(f"all {len(plans)} local DP rank(s) healthy after {time.monotonic() - t0:.1f} s")

    targets = [(plan.health_url, proc) for plan, proc in zip(plans, procs, strict=True)]
    threading.Thread(target=watch_health, args=(targets, on_healthy), daemon=True, name="health-watch").start()


def run_ranks(
    plans: Sequence[RankPlan],
    *,
    log_dir: Path | None = None,
    grace_s: float = DEFAULT_STOP_GRACE_S,
    keep_going: bool = False,
    health_watch: bool = True,
) -> int:
    """Start every rank, wait for them, stop them all on SIGINT/SIGTERM/SIGHUP or when one exits; return the exit code.

    0 if every rank exited 0, else the first failing rank's code (128+N for signal N); 128+N when
    stopped by signal N.
    """
    failed: list[int] = []

    def on_exit(proc: ManagedProcess, code: int) -> None:
        if code != 0:
            if proc.log_path is not None:
                say(_failed_log_tail(proc.log_path))
            failed.append(_exit_code(code))

    group = ProcessGroup(log_dir, stop_grace_s=grace_s, signals=STOP_SIGNALS, report=say)
    try:
        with group:
            t0 = time.monotonic()
            procs = [_start_rank(group, plan, log=log_dir is not None) for plan in plans]
            if health_watch:
                _report_health(plans, procs, t0)
            # A DP group cannot go on without one of its ranks (vLLM's API server even exits 0
            # after its engine died), so the first exit stops the others.
            exits = group.wait(first=not keep_going, on_exit=on_exit)
            if len(exits) < len(procs):
                say("a rank exited; stopping the others (use --keep-going to leave them running)")
    except KeyboardInterrupt:  # SIGINT: the group has stopped every rank
        return 128 + signal.SIGINT
    except SystemExit as exc:  # SIGTERM/SIGHUP: likewise, code 128 + N
        return exc.code if isinstance(exc.code, int) else 1
    return failed[0] if failed else 0


# -- main -------------------------------------------------------------------------------------
def main(argv: Sequence[str] | None = None) -> int:
    args, extra = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        plans = build_plans(args, extra)
        if not args.dry_run and not args.skip_port_check:
            check_ports_free(args.host, plans)
    except UsageError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    notes = plan_notes(plans)
    if args.dry_run:
        for note in notes:
            print(f"# {note}")
        for plan in plans:
            print(f"# dp rank {plan.dp_rank} (local {plan.local_index}): {plan.health_url}")
            print(plan.shell_line())
        return 0
    for note in notes:
        say(note)
    if plans[0].dp_mode == "independent":
        where = f"independent instances, DP master {args.dp_address}"
    else:
        where = f"master {args.dp_address}:{args.dp_rpc_port}"
    say(
        f"starting {len(plans)} of {args.dp_size} DP rank(s) "
        f"({plans[0].dp_rank}..{plans[-1].dp_rank}), tp {args.tp_size}, {where}"
    )
    return run_ranks(
        plans,
        log_dir=args.log_dir,
        grace_s=args.stop_grace_s,
        keep_going=args.keep_going,
        health_watch=not args.no_health_watch,
    )


if __name__ == "__main__":
    sys.exit(main())
