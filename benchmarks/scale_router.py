"""The Router at deployment size (``benchmarks/scale.py``): 1 to 64 fake backends per role.

The backends are ``benchmarks/router_backend.py``'s fast fake server (one process listening on 2N
ports: N prefillers, N decoders); the Router is ``python -m proxy`` (one worker, default routing
unless ``--routing``, ``--no-first-token-from-prefill`` as in ``benchmarks/router.py``) with all of them.
Per backend count: one closed-loop stream (per-request latency, the Router's CPU per request), then
``concurrency`` streams (saturation: the Router's requests per second, its CPU per request and
how busy its one core was). The load generator is ``benchmarks/router.py``'s.
"""

from __future__ import annotations

import asyncio
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.router import HOST, Phase, Process, _percentile, free_port, run_phase
from benchmarks.scale_control import process_cpu_s


def _tree_cpu_s(pid: int) -> float:
    """CPU seconds of a process and its children (``--workers`` forks)."""
    import psutil

    root = psutil.Process(pid)
    total = 0.0
    for proc in [root, *root.children(recursive=True)]:
        try:
            times = proc.cpu_times()
            total += times.user + times.system
        except psutil.NoSuchProcess:
            pass
    return total or process_cpu_s(pid)


def _phase(port: int, pid: int, streams: int, duration: float) -> tuple[Phase, float]:
    c0 = _tree_cpu_s(pid)
    phase = asyncio.run(run_phase(port, streams, duration))
    return phase, _tree_cpu_s(pid) - c0


def _summary(phase: Phase, cpu_s: float) -> dict[str, Any]:
    done = len(phase.latencies)
    return {
        "requests": done,
        "failed": phase.failed,
        "p50_ms": round(_percentile(phase.latencies, 0.5) * 1e3, 3),
        "p99_ms": round(_percentile(phase.latencies, 0.99) * 1e3, 3),
        "rps": round(done / phase.elapsed, 1),
        "router_cpu_ms_per_request": round(cpu_s * 1e3 / done, 4) if done else None,
        "router_cpu_busy": round(cpu_s / phase.elapsed, 3),
    }


def measure_router(
    backends: int, concurrency: int, duration: float, routing: str, log_dir: Path | None, tries: int = 3
) -> dict[str, Any]:
    """The Router with ``backends`` prefillers and as many decoders, at one stream and at ``concurrency``.

    A start that fails (a free port taken by another process before the backends bound it) is tried
    again with new ports."""
    for attempt in range(1, tries + 1):
        try:
            return _measure_router(backends, concurrency, duration, routing, log_dir)
        except RuntimeError as exc:
            if attempt == tries or "exited" not in str(exc):
                raise
            print(f"router at {backends} backends: {exc}; trying again", file=sys.stderr, flush=True)
    raise AssertionError("unreachable")


def _measure_router(
    backends: int, concurrency: int, duration: float, routing: str, log_dir: Path | None
) -> dict[str, Any]:
    log_dir = log_dir or Path(tempfile.mkdtemp(prefix="scale-router-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    p_ports = [free_port() for _ in range(backends)]
    d_ports = [free_port() for _ in range(backends)]
    port = free_port()
    here = Path(__file__).resolve().parent
    serve = [sys.executable, str(here / "router.py"), "--serve-backend", *map(str, p_ports + d_ports), "--chunks", "4"]
    router = [sys.executable, "-m", "proxy", "--host", HOST, "--port", str(port), "--workers", "1"]
    router += ["--prefiller-hosts", *[HOST] * backends, "--prefiller-ports", *map(str, p_ports)]
    router += ["--decoder-hosts", *[HOST] * backends, "--decoder-ports", *map(str, d_ports)]
    router += ["--routing", routing, "--no-first-token-from-prefill"]
    processes: list[Process] = []
    try:
        processes.append(Process(f"backends-{backends}", serve, log_dir))
        for p in (p_ports[-1], d_ports[-1]):
            processes[-1].wait_http(p, "/health")
        processes.append(Process(f"router-{backends}", router, log_dir))
        processes[-1].wait_http(port, "/health")
        pid = processes[-1].popen.pid
        asyncio.run(run_phase(port, concurrency, 0.5))  # warm-up: connections to every backend
        time.sleep(0.2)
        one, one_cpu = _phase(port, pid, 1, duration / 2)
        many, many_cpu = _phase(port, pid, concurrency, duration)
        return {
            "backends_per_role": backends,
            "one_stream": _summary(one, one_cpu),
            "saturation": {**_summary(many, many_cpu), "concurrency": concurrency},
        }
    finally:
        for process in reversed(processes):
            process.stop()
