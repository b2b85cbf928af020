"""The three systems `benchmarks/serving.py` compares, each started in a `ProcessGroup` on the same cores.

- `pd`: 1P1D PDConnector (P's whole process tree on `p_cpus`, D's on `d_cpus`) behind the Router;
- `colocated`: two plain `vllm serve` instances, one on each side's cores, behind a round-robin
  front end (`serving_proxy.py rr`; the Router has no plain mode);
- `colocated_p` (closed-loop phase only): ONE plain instance on P's cores, behind the same front
  end: the prefill capacity PD gives its prompts, so pd / colocated_p is PD's own tax (hop, handshake,
  push, P's steps) with the core split taken out. D's cores stay idle;
- `vllm_mooncake`: vLLM's in-tree MooncakeConnector 1P1D (Mooncake TCP) on the same cores behind
  `serving_proxy.py mooncake`, with the CPU patches of `vllm_mooncake_cpu/sitecustomize.py`.

Every instance gets the same `vllm serve` flags (`launch.commands.vllm_serve_cmd` + `serve_args`);
front ends are not placed on cores (like the Router).
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from launch.processes import (
    ManagedProcess,
    ProcessGroup,
    free_ports,
    start_pd_stack,
    vllm_env,
    vllm_serve_cmd,
    wait_all_healthy,
    wait_http_ok,
)

BENCH_DIR = Path(__file__).resolve().parent
PROXY = BENCH_DIR / "serving_proxy.py"
MOONCAKE_PATCH_DIR = BENCH_DIR / "vllm_mooncake_cpu"
HOST = "127.0.0.1"
SYSTEMS = ("pd", "colocated", "vllm_mooncake")
#: P's engine id in vLLM-Mooncake mode (the front end names it to D).
MOONCAKE_ENGINE_ID = "bench-prefill"


def mooncake_patches() -> list[str]:
    """The patch list of `vllm_mooncake_cpu/sitecustomize.py`, read without importing it here."""
    namespace: dict[str, object] = {}
    source = (MOONCAKE_PATCH_DIR / "sitecustomize.py").read_text()
    start = source.index("PATCHES = [")
    exec(source[start : source.index("]\n", start) + 2], namespace)  # noqa: S102 - our own literal list
    return list(namespace["PATCHES"])  # type: ignore[call-overload]


def _url(port: int) -> str:
    return f"http://{HOST}:{port}"


def _front_end(
    group: ProcessGroup, port: int, args: Sequence[str], backends: Sequence[tuple[str, ManagedProcess]], timeout: float
) -> str:
    """Wait until every backend is healthy, then start the front end and wait for it."""
    wait_all_healthy([(f"{url}/health", proc) for url, proc in backends], timeout)
    cmd = [sys.executable, str(PROXY), "--port", str(port), *args]
    proc = group.start("front", cmd, env=dict(os.environ, PYTHONUNBUFFERED="1"), cpus="")
    wait_http_ok(f"{_url(port)}/health", 60.0, proc)
    return _url(port)


#: PDConnector's ``transfer_mode`` for the ``pd`` system (``serving.py --pd-transfer-mode``).
PD_TRANSFER_MODE = {"mode": "layer"}


def start_pd(group: ProcessGroup, model: str, serve_args: Sequence[str], cpus: tuple[str, str], timeout: float) -> str:
    mode = {"transfer_mode": PD_TRANSFER_MODE["mode"]}
    stack = start_pd_stack(
        group, model, p_args=serve_args, d_args=serve_args, p_cpus=cpus[0], d_cpus=cpus[1], timeout=timeout,
        extra_p_config=mode, extra_d_config=mode,
    )  # fmt: skip
    return stack.router_url


def start_colocated(
    group: ProcessGroup, model: str, serve_args: Sequence[str], cpus: tuple[str, str], timeout: float
) -> str:
    a, b, front = free_ports(3)
    backends = []
    for name, port, core in (("colocated-a", a, cpus[0]), ("colocated-b", b, cpus[1])):
        proc = group.start(name, vllm_serve_cmd(model, port, extra_args=serve_args), env=vllm_env(core))
        backends.append((_url(port), proc))
    return _front_end(group, front, ["rr", _url(a), _url(b)], backends, timeout)


def start_colocated_p(
    group: ProcessGroup, model: str, serve_args: Sequence[str], cpus: tuple[str, str], timeout: float
) -> str:
    port, front = free_ports(2)
    proc = group.start("colocated-p", vllm_serve_cmd(model, port, extra_args=serve_args), env=vllm_env(cpus[0]))
    return _front_end(group, front, ["rr", _url(port)], [(_url(port), proc)], timeout)


def start_vllm_mooncake(
    group: ProcessGroup, model: str, serve_args: Sequence[str], cpus: tuple[str, str], timeout: float
) -> str:
    p_port, d_port, bootstrap, front = free_ports(4)
    roles = (("prefill", p_port, cpus[0], "kv_producer"), ("decode", d_port, cpus[1], "kv_consumer"))
    backends = []
    for name, port, core, role in roles:
        config: dict[str, object] = {
            "kv_connector": "MooncakeConnector",
            "kv_role": role,
            "engine_id": MOONCAKE_ENGINE_ID if role == "kv_producer" else "bench-decode",
            "kv_connector_extra_config": {"mooncake_protocol": "tcp"},
        }
        env = vllm_env(core)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(MOONCAKE_PATCH_DIR), env.get("PYTHONPATH")]))
        env["VLLM_MOONCAKE_BOOTSTRAP_PORT"] = str(bootstrap)
        env["VLLM_HOST_IP"] = HOST
        cmd = vllm_serve_cmd(model, port, extra_args=[*serve_args, "--kv-transfer-config", json.dumps(config)])
        backends.append((_url(port), group.start(f"mooncake-{name}", cmd, env=env)))
    args = ["mooncake", _url(p_port), _url(d_port), _url(bootstrap), MOONCAKE_ENGINE_ID]
    return _front_end(group, front, args, backends, timeout)


STARTERS: dict[str, Callable[[ProcessGroup, str, Sequence[str], tuple[str, str], float], str]] = {
    "pd": start_pd,
    "colocated": start_colocated,
    "colocated_p": start_colocated_p,
    "vllm_mooncake": start_vllm_mooncake,
}
