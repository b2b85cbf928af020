"""Start, watch and stop the processes of a local PD deployment (vLLM P/D instances, the Router).

Used by the local launcher (`python -m launch.local`), the external-DP launcher
(`python -m launch.launch_online_dp`) and the end-to-end test fixtures. This module brings up a
1P1D stack (`start_pd_stack`) and re-exports the pieces it is built from, so `launch.processes`
stays the one import for callers:

- `launch.process_group`: `ProcessGroup` starts every process in its own session, logs its
  stdout/stderr to a file and/or to the console with a prefix, waits for the first or every exit,
  and on exit, exception, SIGINT or SIGTERM stops all of them by process group: SIGTERM, a grace
  period, then SIGKILL. vLLM forks EngineCore and worker children; they share the group of the
  `vllm serve` process, so none of them survives.
- `launch.health`: `wait_all_healthy` / `wait_http_ok` (block until healthy, or raise),
  `watch_health` (report each one as it turns healthy).
- `launch.commands`: `vllm_serve_cmd`, `vllm_env` and `router_cmd` build the command lines and
  environments.
- `launch.ports`: `free_port`, `free_ports`, `port_in_use`.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from launch.commands import KV_PARAMS_MIDDLEWARE, router_cmd, vllm_env, vllm_serve_cmd
from launch.drain import router_drainer
from launch.health import DEFAULT_START_TIMEOUT_S, wait_all_healthy, wait_http_ok, watch_health
from launch.ports import LOOPBACK, free_port, free_ports, port_in_use
from launch.process_group import (
    LOG_TAIL_LINES,
    REPO_ROOT,
    STOP_GRACE_S,
    ManagedProcess,
    ProcessFailed,
    ProcessGroup,
    group_alive,
    group_members,
    signal_group,
    tail,
)

__all__ = [
    "DEFAULT_START_TIMEOUT_S",
    "KV_PARAMS_MIDDLEWARE",
    "LOG_TAIL_LINES",
    "LOOPBACK",
    "REPO_ROOT",
    "STOP_GRACE_S",
    "ManagedProcess",
    "BothStack",
    "PDStack",
    "ProcessFailed",
    "ProcessGroup",
    "free_port",
    "free_ports",
    "group_alive",
    "group_members",
    "port_in_use",
    "router_cmd",
    "signal_group",
    "start_both_stack",
    "start_pd_stack",
    "tail",
    "vllm_env",
    "vllm_serve_cmd",
    "wait_all_healthy",
    "wait_http_ok",
    "watch_health",
]

logger = logging.getLogger(__name__)


# -- a 1P1D stack -----------------------------------------------------------------------------
@dataclass
class PDStack:
    """Where a running 1P1D deployment answers, and its processes."""

    model: str
    host: str
    prefill_port: int
    bootstrap_port: int
    decode_port: int
    router_port: int
    prefill: ManagedProcess
    decode: ManagedProcess
    router: ManagedProcess
    log_dir: Path

    @property
    def router_url(self) -> str:
        return f"http://{self.host}:{self.router_port}"

    @property
    def prefill_url(self) -> str:
        return f"http://{self.host}:{self.prefill_port}"

    @property
    def decode_url(self) -> str:
        return f"http://{self.host}:{self.decode_port}"

    @property
    def pids(self) -> dict[str, int]:
        return {p.name: p.pid for p in (self.prefill, self.decode, self.router)}

    @property
    def log_paths(self) -> dict[str, Path]:
        return {p.name: p.log_path for p in (self.prefill, self.decode, self.router)}


def start_pd_stack(
    group: ProcessGroup,
    model: str | Path,
    *,
    extra_p_config: Mapping[str, Any] | None = None,
    extra_d_config: Mapping[str, Any] | None = None,
    served_model_name: str | None = None,
    timeout: float = DEFAULT_START_TIMEOUT_S,
    host: str = LOOPBACK,
    router_health_path: str = "/health",
    on_progress: Callable[[str], None] | None = None,
    p_args: Sequence[str] = (),
    d_args: Sequence[str] = (),
    p_cpus: str = "0",
    d_cpus: str = "1",
    router_args: Sequence[str] = (),
) -> PDStack:
    """Start P (kv_producer, CPU 0), D (kv_consumer, CPU 1) and the Router; wait until all are healthy.

    `p_args`/`d_args` are extra `vllm serve` flags (e.g. `--tensor-parallel-size 2`), `p_cpus` and
    `d_cpus` each side's cores: its VLLM_CPU_OMP_THREADS_BIND (TP or DP ranks joined by `|`) and
    the placement of its whole process tree (API server, EngineCore, workers: all of them on
    those cores, see `launch.affinity`). The Router is not placed; `router_args` are extra Router
    flags (e.g. `--header-timeout 3`).

    P and D start together and are waited on in parallel; the Router starts right after them
    (it only needs their addresses) and is waited on once P and D are up. Raises `ProcessFailed` with the tail
    of the failing process's log. The processes belong to `group`, which stops them.
    """
    say = on_progress or logger.info
    p_port, bootstrap_port, d_port, router_port = free_ports(4)
    model = str(model)
    p_cmd = vllm_serve_cmd(
        model,
        p_port,
        kv_role="kv_producer",
        bootstrap_port=bootstrap_port,
        extra_config=extra_p_config,
        served_model_name=served_model_name,
        host=host,
        extra_args=p_args,
    )
    d_cmd = vllm_serve_cmd(
        model,
        d_port,
        kv_role="kv_consumer",
        bootstrap_port=bootstrap_port,
        extra_config=extra_d_config,
        served_model_name=served_model_name,
        host=host,
        extra_args=d_args,
    )
    say(f"starting prefill on :{p_port} (bootstrap :{bootstrap_port}) and decode on :{d_port}")
    prefill = group.start("prefill", p_cmd, env=vllm_env(p_cpus))
    decode = group.start("decode", d_cmd, env=vllm_env(d_cpus))
    r_cmd = [*router_cmd(router_port, [(host, p_port, bootstrap_port)], [(host, d_port)], host=host), *router_args]
    say(f"starting router on :{router_port}")
    router_env = dict(os.environ, PYTHONUNBUFFERED="1")
    router = group.start("router", r_cmd, env=router_env, cpus="")
    t0 = time.monotonic()
    # P and D first (the Router is watched meanwhile: polling its health, which checks P and D,
    # would only fill its log with "unhealthy" lines), then the Router.
    wait_all_healthy(
        [(f"http://{host}:{p_port}/health", prefill), (f"http://{host}:{d_port}/health", decode)],
        timeout,
        watch=[router],
    )
    wait_http_ok(
        f"http://{host}:{router_port}{router_health_path}", max(30.0, timeout - (time.monotonic() - t0)), router
    )
    say(f"prefill, decode and router healthy after {time.monotonic() - t0:.1f} s")
    # A SIGTERM drains P and D through the Router first (launch.drain; ProcessGroup.drain_s bounds it).
    router_url = f"http://{host}:{router_port}"
    prefill.drain = router_drainer(router_url, "prefill", host, p_port)
    decode.drain = router_drainer(router_url, "decode", host, d_port)
    return PDStack(
        model=model,
        host=host,
        prefill_port=p_port,
        bootstrap_port=bootstrap_port,
        decode_port=d_port,
        router_port=router_port,
        prefill=prefill,
        decode=decode,
        router=router,
        log_dir=group.log_dir,
    )


# -- kv_both instances ------------------------------------------------------------------------
@dataclass
class BothStack:
    """Where a running deployment of kv_role kv_both instances (each P or D per request) answers."""

    model: str
    host: str
    ports: list[int]
    bootstrap_ports: list[int]
    router_port: int
    instances: list[ManagedProcess]
    router: ManagedProcess

    @property
    def router_url(self) -> str:
        return f"http://{self.host}:{self.router_port}"

    @property
    def urls(self) -> list[str]:
        return [f"http://{self.host}:{port}" for port in self.ports]


def start_both_stack(
    group: ProcessGroup,
    model: str | Path,
    *,
    cpus: Sequence[str] = ("0", "1"),
    extra_config: Mapping[str, Any] | None = None,
    timeout: float = DEFAULT_START_TIMEOUT_S,
    host: str = LOOPBACK,
    router_args: Sequence[str] = (),
) -> BothStack:
    """Start one kv_both instance per entry of `cpus` (its cores), each with its own bootstrap server, and the
    Router with all of them as `--both-hosts`; wait until all are healthy. The processes belong to `group`."""
    count = len(cpus)
    ports = free_ports(2 * count + 1)
    http, bootstrap, router_port = ports[:count], ports[count : 2 * count], ports[-1]
    instances = []
    for i, (port, bport, cpu) in enumerate(zip(http, bootstrap, cpus, strict=True)):
        cmd = vllm_serve_cmd(model, port, kv_role="kv_both", bootstrap_port=bport, extra_config=extra_config, host=host)
        instances.append(group.start(f"both{i}", cmd, env=vllm_env(cpu)))
    r_cmd = [
        sys.executable, "-m", "proxy", "--host", host, "--port", str(router_port),
        "--both-hosts", *[host] * count,
        "--both-ports", *map(str, http),
        "--both-bootstrap-ports", *map(str, bootstrap),
        *router_args,
    ]  # fmt: skip
    router = group.start("router", r_cmd, env=dict(os.environ, PYTHONUNBUFFERED="1"), cpus="")
    t0 = time.monotonic()
    targets = [(f"http://{host}:{port}/health", proc) for port, proc in zip(http, instances, strict=True)]
    wait_all_healthy(targets, timeout, watch=[router])
    router_url = f"http://{host}:{router_port}"
    wait_http_ok(f"{router_url}/health", max(30.0, timeout - (time.monotonic() - t0)), router)
    _wait_router_sees_all(router_url, router, max(30.0, timeout - (time.monotonic() - t0)))
    return BothStack(str(model), host, http, bootstrap, router_port, instances, router)


def _wait_router_sees_all(router_url: str, router: ManagedProcess, timeout: float) -> None:
    """Until the Router's /health counts every instance of both roles healthy (its health checks run on
    an interval: the first healthy one alone would otherwise take every request)."""
    deadline = time.monotonic() + timeout
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # loopback: no HTTP proxy
    while True:
        try:
            with opener.open(f"{router_url}/health", timeout=5) as answer:
                health = json.load(answer)
            roles = ("prefill", "decode")
            if all(health[f"{role}_healthy"] == health[f"{role}_instances"] for role in roles):
                return
        except (OSError, ValueError, KeyError):
            pass
        if router.poll() is not None:
            raise ProcessFailed(f"the Router exited before it saw every instance healthy\n{tail(router.log_path)}")
        if time.monotonic() > deadline:
            raise ProcessFailed(
                f"the Router did not see every instance healthy in {timeout:.0f} s: {router_url}/health"
            )
        time.sleep(0.5)
