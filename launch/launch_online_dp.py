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
pinned to a device; with `--cpu-bind auto` (the default) each rank's OpenMP threads get their own
share of this process's CPUs (VLLM_CPU_OMP_THREADS_BIND, one group per TP rank joined by `|`),
`--cpu-bind "0-3;4-7"` gives each rank its cores explicitly (`;` between ranks, `|` between the
TP ranks of one rank), and `--cpu-bind none` leaves vLLM's default.

The launcher checks the constraints of the vLLM-Ascend deployment guide before starting anything
(one-line message, exit code 2), starts each rank in its own process group, reports when each
rank's `/health` answers, forwards SIGINT/SIGTERM to every rank's process group (SIGKILL after
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
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import importlib.util
import ipaddress
import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import NoReturn, TextIO

from launch.processes import group_alive, signal_group

PROG = "launch_online_dp"
TEMPLATE = Path(__file__).resolve().parent / "run_dp_template.sh"
#: Directory that holds the `launch` package (for `python -m launch.vllm_cli` in the ranks).
PACKAGE_PARENT = Path(__file__).resolve().parent.parent
EXIT_USAGE = 2
DEFAULT_STOP_GRACE_S = 20.0
POLL_INTERVAL_S = 0.2

#: `vllm serve` flags that the launcher sets per rank; passing them after `--` is an error.
PER_RANK_FLAGS = (
    "--host",
    "--port",
    "--data-parallel-size",
    "-dp",
    "--data-parallel-rank",
    "-dpn",
    "--data-parallel-address",
    "-dpa",
    "--data-parallel-rpc-port",
    "-dpp",
    "--data-parallel-size-local",
    "-dpl",
    "--data-parallel-start-rank",
    "-dpr",
    "--data-parallel-hybrid-lb",
    "-dph",
    "--tensor-parallel-size",
    "-tp",
)
DP_MODES = ("auto", "vllm", "independent")
#: config.json keys (top level or in "text_config") whose positive integer value marks an MoE model.
MOE_CONFIG_KEYS = ("num_local_experts", "n_routed_experts", "num_experts", "moe_num_experts", "num_experts_per_tok")
KV_TRANSFER_FLAG = "--kv-transfer-config"
PD_CONNECTOR = "PDConnector"
#: kv_connector_extra_config keys the launcher sets per rank with --dp-mode independent.
INJECTED_DP_KEYS = ("dp_rank", "dp_size")
_HOSTNAME_RE = re.compile(
    r"^(?=.{1,253}$)[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?(\.[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*$"
)


class UsageError(Exception):
    """A flag value or a combination of flags that the launcher refuses (exit code 2)."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # one line instead of usage + message
        self.exit(EXIT_USAGE, f"{PROG}: error: {message} (see --help)\n")


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

    def shell_line(self) -> str:
        """A copy-pasteable shell line: `env K=V ... bash template args...`."""
        assignments = [f"{k}={v}" for k, v in sorted(self.env.items())]
        return shlex.join(["env", *assignments, *self.cmd])


# -- arguments --------------------------------------------------------------------------------
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
        "or one core list per rank separated by ';' (e.g. '0-3;4-7', TP ranks inside joined by '|')",
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


# -- checks -----------------------------------------------------------------------------------
def _valid_port(port: int) -> bool:
    return 1 <= port <= 65535


def _valid_address(addr: str) -> bool:
    with contextlib.suppress(ValueError):
        ipaddress.ip_address(addr)
        return True
    return bool(_HOSTNAME_RE.match(addr))


def validate(args: argparse.Namespace, extra: Sequence[str], dp_mode: str = "vllm") -> int:
    """Check the flags against the deployment guide's constraints; return the local rank count.

    Raises `UsageError` with a one-line message on the first violation. With `dp_mode`
    "independent" the DP RPC port is unused, so it may fall among the API ports.
    """
    if args.dp_size < 1:
        raise UsageError(f"--dp-size must be >= 1, got {args.dp_size}")
    if args.tp_size < 1:
        raise UsageError(f"--tp-size must be >= 1, got {args.tp_size}")
    local = args.dp_size if args.dp_size_local == -1 else args.dp_size_local
    if not 1 <= local <= args.dp_size:
        raise UsageError(
            f"--dp-size-local must be -1 or between 1 and --dp-size ({args.dp_size}), got {args.dp_size_local}"
        )
    if args.dp_rank_start < 0:
        raise UsageError(f"--dp-rank-start must be >= 0, got {args.dp_rank_start}")
    if args.dp_rank_start + local > args.dp_size:
        raise UsageError(
            f"--dp-rank-start ({args.dp_rank_start}) + --dp-size-local ({local}) must be <= --dp-size "
            f"({args.dp_size}): ranks {args.dp_rank_start}..{args.dp_rank_start + local - 1} do not exist"
        )
    if not args.dp_address or not _valid_address(args.dp_address):
        raise UsageError(f"--dp-address must be an IP address or host name, got {args.dp_address!r}")
    if not _valid_port(args.dp_rpc_port):
        raise UsageError(f"--dp-rpc-port must be between 1 and 65535, got {args.dp_rpc_port}")
    last_port = args.vllm_start_port + local - 1
    if not _valid_port(args.vllm_start_port) or not _valid_port(last_port):
        raise UsageError(
            f"--vllm-start-port must leave {local} ports within 1..65535 (got {args.vllm_start_port}..{last_port})"
        )
    if dp_mode != "independent" and args.vllm_start_port <= args.dp_rpc_port <= last_port:
        raise UsageError(f"--dp-rpc-port {args.dp_rpc_port} falls in the API ports {args.vllm_start_port}..{last_port}")
    if args.stop_grace_s < 0:
        raise UsageError(f"--stop-grace-s must be >= 0, got {args.stop_grace_s}")
    for arg in extra:
        flag = arg.split("=", 1)[0]
        if flag in PER_RANK_FLAGS:
            raise UsageError(
                f"{flag} is set per rank by the launcher; use the launcher's flag instead of passing it after --"
            )
    if not args.template.is_file():
        raise UsageError(f"template {args.template} does not exist")
    return local


def _moe_markers(config: Mapping[str, object]) -> list[str]:
    """The MoE keys of a model's config.json (top level and "text_config") with a positive integer value."""
    found = []
    for prefix, scope in (("", config), ("text_config.", config.get("text_config"))):
        if not isinstance(scope, Mapping):
            continue
        for key in MOE_CONFIG_KEYS:
            value = scope.get(key)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                found.append(f"{prefix}{key}={value}")
    return found


def detect_dp_mode(model: str | None) -> tuple[str, str]:
    """("independent", why) for a local model directory whose config.json shows a dense model, else ("vllm", why)."""
    if not model:
        return "vllm", "no --model to inspect"
    config_path = Path(model).expanduser() / "config.json"
    try:
        if not config_path.is_file():
            return "vllm", f"no local {config_path} (a hub name?), so dense vs MoE is unknown"
        config = json.loads(config_path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        return "vllm", f"cannot read {config_path}: {exc}"
    if not isinstance(config, dict):
        return "vllm", f"{config_path} is not a JSON object"
    markers = _moe_markers(config)
    if markers:
        return "vllm", f"{config_path} shows an MoE model: {', '.join(markers)}"
    return "independent", f"{config_path} shows a dense model (no expert count), which vLLM refuses in external DP"


def resolve_dp_mode(args: argparse.Namespace) -> tuple[str, str]:
    """The DP mode the ranks run in ("vllm" or "independent") and why."""
    if args.dp_mode != "auto":
        return args.dp_mode, f"--dp-mode {args.dp_mode}"
    mode, why = detect_dp_mode(args.model)
    return mode, f"auto: {why}"


def _flag_name(arg: str) -> str:
    """`--kv_transfer_config=...` -> `--kv_transfer_config` -> `--kv-transfer-config` (vLLM reads `_` as `-`)."""
    name = arg.split("=", 1)[0]
    if not name.startswith("--"):
        return name
    head, dot, tail = name[2:].partition(".")
    return "--" + head.replace("_", "-") + dot + tail


def _with_dp_place(value: str, dp_rank: int, dp_size: int, bootstrap_host: str) -> str | None:
    """The JSON of --kv-transfer-config with this rank's dp_rank, dp_size (and bootstrap_host) in its extra config.

    None when the config names another connector than PDConnector (its extra config is left alone).
    """
    what = f"{KV_TRANSFER_FLAG} (rewritten per rank with --dp-mode independent)"
    try:
        config = json.loads(value)
    except ValueError as exc:
        raise UsageError(f"{what} must be a JSON object, got {value!r}: {exc}") from None
    if not isinstance(config, dict):
        raise UsageError(f"{what} must be a JSON object, got {value!r}")
    if config.get("kv_connector", PD_CONNECTOR) != PD_CONNECTOR:
        return None
    extra_config = config.get("kv_connector_extra_config")
    if extra_config is None:
        extra_config = config["kv_connector_extra_config"] = {}
    if not isinstance(extra_config, dict):
        raise UsageError(f"{what}: kv_connector_extra_config must be a JSON object, got {extra_config!r}")
    for key in INJECTED_DP_KEYS:
        if key in extra_config:
            raise UsageError(
                f"{KV_TRANSFER_FLAG}: kv_connector_extra_config.{key} is set per rank by the launcher with "
                "--dp-mode independent (from --dp-rank-start and --dp-size); remove it"
            )
    extra_config["dp_rank"] = dp_rank
    extra_config["dp_size"] = dp_size
    extra_config.setdefault("bootstrap_host", bootstrap_host)
    return json.dumps(config, separators=(",", ":"))


def rewrite_kv_transfer_config(
    extra: Sequence[str], *, dp_rank: int, dp_size: int, bootstrap_host: str
) -> tuple[list[str], bool]:
    """Give every `--kv-transfer-config JSON` / `--kv-transfer-config=JSON` in `extra` this rank's DP place.

    Returns the rewritten arguments and whether a PDConnector --kv-transfer-config was rewritten.
    """
    out: list[str] = []
    found = False
    i = 0
    while i < len(extra):
        arg = extra[i]
        name = _flag_name(arg)
        if name.startswith(KV_TRANSFER_FLAG + "."):
            raise UsageError(
                f"{arg.split('=', 1)[0]}: with --dp-mode independent pass {KV_TRANSFER_FLAG} as one JSON object "
                "(the launcher rewrites it per rank), not in dotted form"
            )
        if name == KV_TRANSFER_FLAG:
            if "=" in arg:
                flag, value = arg.split("=", 1)
            elif i + 1 < len(extra):
                flag, value = arg, extra[i + 1]
                i += 1
            else:
                raise UsageError(f"{arg} needs a value (a JSON object)")
            rewritten = _with_dp_place(value, dp_rank, dp_size, bootstrap_host)
            found = found or rewritten is not None
            value = value if rewritten is None else rewritten
            out += [f"{flag}={value}"] if "=" in arg else [flag, value]
        else:
            out.append(arg)
        i += 1
    return out, found


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


def _parse_id_list(text: str, what: str) -> list[int]:
    ids: list[int] = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        try:
            if "-" in part:
                lo, hi = (int(x) for x in part.split("-", 1))
                if lo > hi:
                    raise ValueError
                ids.extend(range(lo, hi + 1))
            else:
                ids.append(int(part))
        except ValueError:
            raise UsageError(f"{what}: {part!r} is not an id or an id range") from None
    if any(i < 0 for i in ids):
        raise UsageError(f"{what}: ids must be >= 0")
    if len(set(ids)) != len(ids):
        raise UsageError(f"{what}: ids must not repeat, got {text!r}")
    return ids


def compact_ids(ids: Sequence[int]) -> str:
    """[0,1,2,5,7,8] -> '0-2,5,7-8' (the form VLLM_CPU_OMP_THREADS_BIND takes)."""
    parts: list[str] = []
    i = 0
    while i < len(ids):
        j = i
        while j + 1 < len(ids) and ids[j + 1] == ids[j] + 1:
            j += 1
        parts.append(str(ids[i]) if i == j else f"{ids[i]}-{ids[j]}")
        i = j + 1
    return ",".join(parts)


def npu_assignments(local: int, tp: int, visible: str | None, env: Mapping[str, str]) -> list[str]:
    """ASCEND_RT_VISIBLE_DEVICES of each local rank: consecutive groups of `tp` ids of the pool."""
    need = local * tp
    if visible is not None:
        pool = _parse_id_list(visible, "--visible-devices")
        source = "--visible-devices"
    elif env.get("ASCEND_RT_VISIBLE_DEVICES"):
        pool = _parse_id_list(env["ASCEND_RT_VISIBLE_DEVICES"], "ASCEND_RT_VISIBLE_DEVICES")
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
            _parse_id_list(group, "--cpu-bind")
    return lists


def port_in_use(host: str, port: int) -> bool:
    """True if `port` cannot be bound on `host` right now."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return True
    return False


def resolve_serve_cmd(explicit: str | None) -> list[str]:
    """The command each rank runs vLLM's CLI with (for display and for PD_SERVE_CMD)."""
    if explicit:
        return shlex.split(explicit)
    if shutil.which("vllm"):
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            importlib.metadata.version("vllm")
            return ["vllm"]
    return [sys.executable, "-m", "launch.vllm_cli"]


# -- plans ------------------------------------------------------------------------------------
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
            )
        )
    return plans


def check_ports_free(host: str, plans: Sequence[RankPlan]) -> None:
    bind_host = host or "0.0.0.0"
    for plan in plans:
        if port_in_use(bind_host, plan.port):
            raise UsageError(f"API port {plan.port} (dp rank {plan.dp_rank}) is already in use on {bind_host}")


# -- running ----------------------------------------------------------------------------------
def say(message: str, stream: TextIO | None = None) -> None:
    print(f"{PROG}: {message}", file=stream or sys.stderr, flush=True)


def stop_ranks(procs: Sequence[tuple[RankPlan, subprocess.Popen[bytes]]], grace_s: float) -> None:
    """SIGTERM every rank's process group, wait up to `grace_s`, then SIGKILL what is left."""
    live = [(plan, p) for plan, p in procs if p.poll() is None or group_alive(p.pid)]
    for plan, p in live:
        say(f"stopping dp rank {plan.dp_rank} (process group {p.pid})")
        signal_group(p.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    pending = list(live)
    while pending and time.monotonic() < deadline:
        for item in list(pending):
            _, p = item
            p.poll()  # reap the leader so a zombie does not count as alive
            if p.poll() is not None and not group_alive(p.pid):
                pending.remove(item)
        if pending:
            time.sleep(0.1)
    for plan, p in pending:
        say(f"dp rank {plan.dp_rank} did not stop within {grace_s:.0f} s; sending SIGKILL")
        signal_group(p.pid, signal.SIGKILL)
    for _, p in pending:
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.wait(timeout=5)


def _log_tail(path: Path, lines: int = 15) -> str:
    """The last `lines` lines of a rank's log, headed by its path."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 16384))
            text = f.read().decode("utf-8", errors="replace")
    except OSError:
        return f"(no log at {path})"
    body = "\n".join(text.splitlines()[-lines:])
    return f"last lines of {path}:\n{body}"


def _exit_code(returncode: int) -> int:
    return 128 - returncode if returncode < 0 else returncode


def _watch_health(plans: Sequence[RankPlan], procs: Sequence[subprocess.Popen[bytes]], t0: float) -> None:
    pending = list(zip(plans, procs, strict=True))
    while pending:
        for item in list(pending):
            plan, proc = item
            if proc.poll() is not None:
                pending.remove(item)
                continue
            try:
                with urllib.request.urlopen(plan.health_url, timeout=2) as resp:
                    ok = resp.status == 200
            except (urllib.error.URLError, OSError, ValueError):
                ok = False
            if ok:
                pending.remove(item)
                say(f"dp rank {plan.dp_rank} healthy at {plan.health_url} after {time.monotonic() - t0:.1f} s")
                if not pending and all(p.poll() is None for p in procs):
                    say(f"all {len(plans)} local DP rank(s) healthy after {time.monotonic() - t0:.1f} s")
        time.sleep(1.0)


def run_ranks(
    plans: Sequence[RankPlan],
    *,
    log_dir: Path | None = None,
    grace_s: float = DEFAULT_STOP_GRACE_S,
    keep_going: bool = False,
    health_watch: bool = True,
) -> int:
    """Start every rank, wait for them, stop them all on SIGINT/SIGTERM or a failure; return the exit code."""
    requested: list[int] = []

    def on_signal(signum: int, _frame: object) -> None:
        requested.append(signum)

    old = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    procs: list[tuple[RankPlan, subprocess.Popen[bytes]]] = []
    code = 0
    try:
        if log_dir is not None:
            log_dir.mkdir(parents=True, exist_ok=True)
        t0 = time.monotonic()
        for plan in plans:
            env = dict(os.environ)
            env.update(plan.env)
            if log_dir is not None:
                log_path = log_dir / f"dp_rank_{plan.dp_rank}.log"
                with open(log_path, "ab") as log:
                    proc = subprocess.Popen(
                        plan.cmd,
                        env=env,
                        stdin=subprocess.DEVNULL,
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        start_new_session=True,
                    )
                where = f"log {log_path}"
            else:
                proc = subprocess.Popen(plan.cmd, env=env, stdin=subprocess.DEVNULL, start_new_session=True)
                where = "output inline"
            procs.append((plan, proc))
            say(f"started dp rank {plan.dp_rank} (pid {proc.pid}, port {plan.port}, devices '{plan.devices}', {where})")
        if health_watch:
            threading.Thread(
                target=_watch_health, args=(plans, [p for _, p in procs], t0), daemon=True, name="health-watch"
            ).start()
        done: set[int] = set()
        while not requested:
            for plan, proc in procs:
                rc = proc.poll()
                if rc is None or plan.dp_rank in done:
                    continue
                done.add(plan.dp_rank)
                say(f"dp rank {plan.dp_rank} exited with code {rc}")
                if rc != 0 and log_dir is not None:
                    say(_log_tail(log_dir / f"dp_rank_{plan.dp_rank}.log"))
                if rc != 0 and code == 0:
                    code = _exit_code(rc)
            if len(done) == len(procs) or (done and not keep_going):
                break
            time.sleep(POLL_INTERVAL_S)
        if requested:
            sig = signal.Signals(requested[0])
            say(f"received {sig.name}; stopping {len(procs)} rank(s)")
            code = 128 + sig.value
        elif len(done) < len(procs):
            # A DP group cannot go on without one of its ranks (vLLM's API server even exits 0
            # after its engine died), so the others are stopped.
            say("a rank exited; stopping the others (use --keep-going to leave them running)")
    finally:
        # Ignore further Ctrl-C while stopping, so the ranks are always cleaned up.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        try:
            stop_ranks(procs, grace_s)
        finally:
            for sig, handler in old.items():
                signal.signal(sig, handler)
    return code


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
    notes = [f"dp mode {plans[0].dp_mode} ({plans[0].dp_mode_reason})"]
    if plans[0].dp_mode == "independent" and not plans[0].kv_config_rewritten:
        notes.append(
            f"note: no PDConnector {KV_TRANSFER_FLAG} after --, so nothing to give dp_rank/dp_size: "
            "the ranks start as plain independent vLLM instances"
        )
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
