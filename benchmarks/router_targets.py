"""The routers `benchmarks/router.py` measures, each in its PD mode in front of the same fake backends.

- `router`: `python -m proxy` (this repository), default flags;
- `ascend_proxy`: vLLM-Ascend's `load_balance_proxy_server_example.py` (unmodified, default flags);
- `vllm_router`: `vllm-router --vllm-pd-disaggregation` (pip `vllm-router`, when installed): P
  first, then D with P's `kv_transfer_params` (its default `--kv-connector nixl` protocol);
- `sglang_router`: `python -m sglang_router.launch_router --pd-disaggregation` (pip
  `sglang-router`, when installed): P and D at once, D's answer returned.

All of them run on the same cores (`benchmarks/router.py --router-cpus`): vllm-router and
sglang-router run one tokio worker thread per core they may use, our Router one process per
core (`--workers`, `--router-workers`).

The last two take `--policy round_robin` (their default `cache_aware` builds a prefix tree, a
routing feature the others do not have) and a free `--prometheus-port` (default 29000 on every
interface). sglang-router refuses one URL as both prefiller and decoder, so every target gets the
backend's prefill port as P and its decode port as D.
"""

from __future__ import annotations

import importlib.util
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

HOST = "127.0.0.1"


@dataclass(frozen=True)
class Target:
    """How to start one router: its command line and the path that answers 200 once it is up."""

    name: str
    cmd: list[str]
    health_path: str


def _which(name: str) -> str | None:
    """A console script next to this interpreter (the venv's bin), else on PATH."""
    local = Path(sys.executable).parent / name
    return str(local) if local.is_file() else shutil.which(name)


def installed() -> dict[str, bool]:
    """Which optional routers can run here."""
    return {
        "vllm_router": _which("vllm-router") is not None,
        "sglang_router": importlib.util.find_spec("sglang_router") is not None,
    }


def proxy_flags(prefill_port: int, decode_port: int) -> list[str]:
    """The Router's / Ascend proxy's instance flags (vLLM-Ascend's names)."""
    return [
        "--prefiller-hosts", HOST, "--prefiller-ports", str(prefill_port),
        "--decoder-hosts", HOST, "--decoder-ports", str(decode_port),
    ]  # fmt: skip


def targets(
    ports: dict[str, int],
    prefill_port: int,
    decode_port: int,
    ascend_proxy: Path,
    metrics_ports: dict[str, int],
    router_workers: int = 1,
) -> list[Target]:
    """Every router target that can run here, in a fixed order (this repository's Router first,
    with ``--workers router_workers``)."""
    instances = proxy_flags(prefill_port, decode_port)
    listen = ["--host", HOST]
    ours = [sys.executable, "-m", "proxy", *listen, "--port", str(ports["router"]), *instances]
    out = [
        # The fake backend's P answer names no token ids (the first-token path would fall back to
        # P, then D, one after the other): the Router's own relay is measured, P and D at once. Every
        # request goes to P and D, as with the other routers (a path decision's own cost is measured
        # in-process: benchmarks/path_decision.py, the report's ``path_decision``).
        Target(
            "router",
            [*ours, "--workers", str(router_workers), "--no-first-token-from-prefill", "--path-policy", "always-pd"],
            "/health",
        ),
        Target(
            "ascend_proxy",
            [sys.executable, str(ascend_proxy), *listen, "--port", str(ports["ascend_proxy"]), *instances],
            "/healthcheck",
        ),
    ]
    pd = ["--prefill", f"http://{HOST}:{prefill_port}", "--decode", f"http://{HOST}:{decode_port}"]
    have = installed()
    vllm_router = _which("vllm-router")
    if have["vllm_router"] and vllm_router and "vllm_router" in ports:
        cmd = [vllm_router, *listen, "--port", str(ports["vllm_router"]), "--vllm-pd-disaggregation", *pd]
        cmd += ["--policy", "round_robin", "--prometheus-host", HOST]
        cmd += ["--prometheus-port", str(metrics_ports["vllm_router"]), "--log-level", "warning"]
        out.append(Target("vllm_router", cmd, "/health"))
    if have["sglang_router"] and "sglang_router" in ports:
        cmd = [sys.executable, "-m", "sglang_router.launch_router", *listen, "--port", str(ports["sglang_router"])]
        cmd += ["--pd-disaggregation", *pd, "--policy", "round_robin", "--prometheus-host", HOST]
        cmd += ["--prometheus-port", str(metrics_ports["sglang_router"]), "--log-level", "warn"]
        out.append(Target("sglang_router", cmd, "/health"))
    return out
