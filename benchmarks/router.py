"""Router overhead: our Router vs vLLM-Ascend's proxy, vllm-router, sglang-router and a direct connection, in one run.

All targets sit in front of the same fast local backend (``router_backend.py``: a minimal
HTTP/1.1 server on raw asyncio, started as a subprocess on two ports, a prefill port and a
decode port, that answers a streaming completion with an SSE stream of a few chunks at once and
a non-streaming one, the prefill call, with a small JSON body):

- ``direct``: the load generator talks to the backend's decode port itself;
- ``router``: ``python -m proxy`` (this repository), default flags (log level INFO: one log
  line per request) but ``--workers`` (``--router-workers``, default one per router CPU);
- ``ascend_proxy``: vLLM-Ascend 0.23.0.post1's ``load_balance_proxy_server_example.py`` (unmodified,
  default flags; it calls P, then D), found through ``PDC_VLLM_ASCEND_PEERS`` (``launch/ascend_peers.py``)
  or ``--ascend-proxy``; without it this target is left out and the JSON's ``left_out`` says why;
- ``vllm_router`` / ``sglang_router``: the pip packages ``vllm-router`` / ``sglang-router`` in
  their PD modes, when installed (``pip install -e .[bench]``); see ``router_targets.py``.

The load generator (this process: asyncio + httptools, keep-alive connections, one per
stream) sends streaming ``/v1/completions`` requests in closed loops. Each round runs, for every
target in turn (the order rotates between rounds): a latency phase with one stream, then a
throughput phase with ``--concurrency`` streams (default 64). A response counts as a failure
unless it is HTTP 200 and its body ends with ``data: [DONE]``.

Printed JSON (one object): per target ``p50_ms`` (one stream, all rounds pooled),
``p50_ms_at_concurrency``, ``rps`` and ``failed``; ``added_p50_ms`` = the median over rounds of
(router p50 - direct p50), each round's two latency phases run back to back (the time the extra
hop adds to one request, robust to load from other processes changing between rounds);
``rps`` = the router's requests per second at ``--concurrency`` streams;
``rps_ratio_vs_ascend_proxy`` = router rps / Ascend proxy rps; ``vs_ours``: for every other
router its ``rps`` and ``p50_ms`` next to ours, ``rps_ratio_ours_vs`` and ``p50_ratio_ours_vs``.

Placement (the same for every router): every router process is pinned to ``--router-cpus``
(default: every CPU this process may use); the Rust routers run one tokio worker thread per CPU
they may use, and our Router gets as many worker processes (``--router-workers``). The load
generator and the backend are not pinned (``--client-cpus`` pins them): they share the machine
with whichever router is under load (the others idle), so every router competes with the same
client and backend work.
Also printed: ``added_p50_ms`` per target, ``rps_ratio_vs_vllm_router`` and
``vllm_router_added_p50_ms`` at the top level, ``router_cpus`` and ``router_workers``.

Why latency is measured with one stream: with 64 closed-loop streams every target saturates
this machine's CPU (2 cores shared by load generator, backend and proxy), so a p50 at 64
streams is queueing (``64 / rps``), not the cost of the hop; it is reported too.

Run: ``python benchmarks/router.py`` (about a minute); ``--help`` for the knobs.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import http.client
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from benchmarks import path_decision  # noqa: E402
from benchmarks.router_backend import run, serve_backend  # noqa: E402
from benchmarks.router_targets import installed, targets  # noqa: E402
from launch import ascend_peers  # noqa: E402

HOST = "127.0.0.1"


# -- the load generator ------------------------------------------------------------------------


class _Client(asyncio.Protocol):
    """One keep-alive client connection, parsing responses with httptools."""

    def __init__(self) -> None:
        import httptools

        self.parser = httptools.HttpResponseParser(self)
        self.waiter: asyncio.Future[int] | None = None
        self.tail = b""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport

    def on_body(self, body: bytes) -> None:
        self.tail = (self.tail + body)[-32:]

    def on_message_complete(self) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(self.parser.get_status_code())

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except Exception as exc:  # noqa: BLE001 (any parse error fails the request)
            if self.waiter is not None and not self.waiter.done():
                self.waiter.set_exception(exc)

    def connection_lost(self, exc: Exception | None) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_exception(ConnectionError("connection lost"))


@dataclass
class Phase:
    latencies: list[float] = field(default_factory=list)
    failed: int = 0
    elapsed: float = 0.0


async def _stream_loop(port: int, request: bytes, end: float, phase: Phase) -> None:
    loop = asyncio.get_running_loop()
    transport, client = await loop.create_connection(_Client, HOST, port)
    try:
        while time.perf_counter() < end:
            client.waiter = loop.create_future()
            client.tail = b""
            started = time.perf_counter()
            transport.write(request)
            try:
                status = await client.waiter
            except (ConnectionError, OSError, ValueError, RuntimeError):
                phase.failed += 1
                transport.close()
                transport, client = await loop.create_connection(_Client, HOST, port)
                continue
            if status != 200 or not client.tail.endswith(b"data: [DONE]\n\n"):
                phase.failed += 1
                continue
            phase.latencies.append(time.perf_counter() - started)
    finally:
        transport.close()


async def run_phase(port: int, concurrency: int, duration: float, path: str = "/v1/completions") -> Phase:
    """``concurrency`` closed-loop streams for ``duration`` seconds against ``port``."""
    body = json.dumps({"model": "bench", "prompt": "Hello, world! " * 4, "max_tokens": 8, "stream": True}).encode()
    request = b"POST %s HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (
        path.encode(),
        HOST.encode(),
        len(body),
        body,
    )
    phase = Phase()
    started = time.perf_counter()
    end = started + duration
    await asyncio.gather(*(_stream_loop(port, request, end, phase) for _ in range(concurrency)))
    phase.elapsed = time.perf_counter() - started
    return phase


# -- processes ---------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind((HOST, 0))
        return sock.getsockname()[1]


class Process:
    """A child process in its own session, stopped (with its children) by its process group id."""

    def __init__(self, name: str, args: list[str], log_dir: Path, cpus: set[int] | None = None) -> None:
        self.name = name
        self.log_path = log_dir / f"{name}.log"
        with open(self.log_path, "wb") as log:
            self.popen = subprocess.Popen(
                args,
                cwd=REPO_ROOT,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                env={**os.environ, "PYTHONUNBUFFERED": "1"},
                preexec_fn=(lambda: os.sched_setaffinity(0, cpus)) if cpus else None,
            )

    def wait_http(self, port: int, path: str, timeout: float = 60.0) -> None:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if self.popen.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.popen.returncode}; log: {self.log_path}")
            try:
                connection = http.client.HTTPConnection(HOST, port, timeout=2)
                connection.request("GET", path)
                if connection.getresponse().status == 200:
                    connection.close()
                    return
                connection.close()
            except OSError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"{self.name} not ready on port {port} after {timeout}s; log: {self.log_path}")

    def stop(self) -> None:
        if self.popen.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.popen.pid, signal.SIGTERM)
            try:
                self.popen.wait(timeout=10)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.popen.pid, signal.SIGKILL)
                self.popen.wait(timeout=10)


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _wait_serving(port: int, name: str, timeout: float = 60.0) -> None:
    """Until one streamed completion through `port` succeeds (a router may be up before its workers are)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        with contextlib.suppress(OSError):
            phase = asyncio.run(run_phase(port, 1, 0.2))
            if phase.latencies:
                return
        time.sleep(0.3)
    raise RuntimeError(f"{name} did not serve a completion within {timeout:.0f} s")


def _add(total: Phase, part: Phase) -> None:
    total.latencies += part.latencies
    total.failed += part.failed
    total.elapsed += part.elapsed


def _summary(latency: Phase, load: Phase, round_p50: list[float]) -> dict[str, Any]:
    return {
        "p50_ms": round(_percentile(latency.latencies, 0.5) * 1e3, 3),
        "p99_ms": round(_percentile(latency.latencies, 0.99) * 1e3, 3),
        "p50_ms_at_concurrency": round(_percentile(load.latencies, 0.5) * 1e3, 3),
        "rps": round(len(load.latencies) / load.elapsed, 1),
        "p50_ms_per_round": [round(v * 1e3, 3) for v in round_p50],
        "requests": len(latency.latencies) + len(load.latencies),
        "failed": latency.failed + load.failed,
    }


def parse_cpus(text: str) -> set[int]:
    """``"0-3,6"`` -> {0, 1, 2, 3, 6} (argparse type)."""
    cpus: set[int] = set()
    try:
        for part in text.split(","):
            low, _, high = part.partition("-")
            cpus.update(range(int(low), int(high or low) + 1))
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid CPU list {text!r} (examples: 0-1, 0,2)") from None
    if not cpus:
        raise argparse.ArgumentTypeError(f"empty CPU list {text!r}")
    return cpus


def _added_ms(round_p50: dict[str, list[float]], target: str) -> float:
    """Median over rounds of (target's one-stream p50 - direct's), in ms: what the hop adds."""
    pairs = zip(round_p50[target], round_p50["direct"], strict=True)
    return round(statistics.median((r - d) * 1e3 for r, d in pairs), 3)


def _vs_ours(results: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Every other router next to ours: its rps, one-stream p50 and added p50, ours / theirs."""
    ours = results["router"]
    out = {}
    for name, theirs in results.items():
        if name in ("direct", "router"):
            continue
        out[name] = {
            "rps": theirs["rps"],
            "p50_ms": theirs["p50_ms"],
            "added_p50_ms": theirs["added_p50_ms"],
            "ours_rps": ours["rps"],
            "ours_p50_ms": ours["p50_ms"],
            "ours_added_p50_ms": ours["added_p50_ms"],
            "rps_ratio_ours_vs": round(ours["rps"] / theirs["rps"], 2) if theirs["rps"] else None,
            "p50_ratio_ours_vs": round(ours["p50_ms"] / theirs["p50_ms"], 2) if theirs["p50_ms"] else None,
        }
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--serve-backend", type=int, nargs="+", metavar="PORT", help=argparse.SUPPRESS)
    parser.add_argument("--concurrency", type=int, default=64, help="streams of the throughput phase (default: 64)")
    parser.add_argument("--duration", type=float, default=4.0, help="seconds per throughput phase (default: 4)")
    parser.add_argument("--latency-duration", type=float, default=2.0, help="seconds per latency phase (default: 2)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds over the targets (default: 3)")
    parser.add_argument("--chunks", type=int, default=4, help="token events per backend stream (default: 4)")
    parser.add_argument(
        "--ascend-proxy", type=Path, help=f"path of vLLM-Ascend's example proxy (default: from {ascend_peers.ENV_VAR})"
    )
    parser.add_argument(
        "--targets", nargs="+", help="only these of router, ascend_proxy, vllm_router, sglang_router (default: all)"
    )
    parser.add_argument("--log-dir", type=Path, help="where the processes' logs go (default: a temporary folder)")
    parser.add_argument(
        "--router-cpus",
        type=parse_cpus,
        default=os.sched_getaffinity(0),
        help="CPUs every router target is pinned to, e.g. 0-1 (default: all this process may use)",
    )
    parser.add_argument(
        "--client-cpus",
        type=parse_cpus,
        help="CPUs of the load generator and the fake backend, e.g. 0 (default: not pinned)",
    )
    parser.add_argument(
        "--router-workers",
        type=int,
        help="our Router's --workers (default: one per --router-cpus CPU, as the Rust routers' threads)",
    )
    args = parser.parse_args()
    if args.serve_backend:
        serve_backend(args.serve_backend, args.chunks)
        return 0
    left_out: dict[str, str] = {}
    if args.ascend_proxy is None:
        args.ascend_proxy, why = ascend_peers.example_proxy()
        if args.ascend_proxy is None:
            left_out["ascend_proxy"] = why
            print(f"ascend_proxy target left out: {why}", file=sys.stderr, flush=True)
    elif not args.ascend_proxy.is_file():
        parser.error(f"vLLM-Ascend's example proxy not found at {args.ascend_proxy}")

    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="router-bench-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    names = ("router", "ascend_proxy", "vllm_router", "sglang_router")
    ports = {name: free_port() for name in names}
    metrics_ports = {name: free_port() for name in names}
    prefill_port, decode_port = free_port(), free_port()
    router_workers = args.router_workers or len(args.router_cpus)
    wanted = targets(ports, prefill_port, decode_port, args.ascend_proxy or Path(), metrics_ports, router_workers)
    wanted = [t for t in wanted if args.targets is None or t.name in args.targets or t.name == "router"]
    wanted = [t for t in wanted if t.name not in left_out]
    target_names = ("direct", *(t.name for t in wanted))
    processes: list[Process] = []
    try:
        say = lambda text: print(text, file=sys.stderr, flush=True)  # noqa: E731
        say(f"logs in {log_dir}; targets {', '.join(target_names)}")
        backend = [sys.executable, str(Path(__file__).resolve()), "--serve-backend", str(prefill_port)]
        backend += [str(decode_port), "--chunks", str(args.chunks)]
        processes.append(Process("backend", backend, log_dir, args.client_cpus))
        processes[-1].wait_http(decode_port, "/health")
        for target in wanted:
            processes.append(Process(target.name, target.cmd, log_dir, args.router_cpus))
        for target, process in zip(wanted, processes[1:], strict=True):
            process.wait_http(ports[target.name], target.health_path)
            _wait_serving(ports[target.name], target.name)
        target_port = {"direct": decode_port, **{t.name: ports[t.name] for t in wanted}}

        latency: dict[str, Phase] = {t: Phase() for t in target_names}
        load: dict[str, Phase] = {t: Phase() for t in target_names}
        round_p50: dict[str, list[float]] = {t: [] for t in target_names}

        async def bench() -> None:
            for target in target_names:  # warm-up: connections, caches
                await run_phase(target_port[target], args.concurrency, 0.5)
            for round_index in range(args.rounds):
                shift = round_index % len(target_names)
                order = target_names[shift:] + target_names[:shift]
                # Latency phases back to back (so each round's targets see the same machine), then load.
                for target in order:
                    one = await run_phase(target_port[target], 1, args.latency_duration)
                    _add(latency[target], one)
                    round_p50[target].append(_percentile(one.latencies, 0.5))
                for target in order:
                    many = await run_phase(target_port[target], args.concurrency, args.duration)
                    _add(load[target], many)
                    say(
                        f"round {round_index + 1}/{args.rounds} {target:13s} "
                        f"p50 {round_p50[target][-1] * 1e3:7.3f} ms  "
                        f"rps@{args.concurrency} {len(many.latencies) / many.elapsed:8.1f}  failed {many.failed}"
                    )

        if args.client_cpus:
            os.sched_setaffinity(0, args.client_cpus)
        run(bench())
        results = {t: _summary(latency[t], load[t], round_p50[t]) for t in target_names}
        for target in target_names:
            results[target]["added_p50_ms"] = _added_ms(round_p50, target)
        added = results["router"]["added_p50_ms"]
        ascend = results.get("ascend_proxy", {}).get("rps")
        ratio = results["router"]["rps"] / ascend if ascend else None
        vllm = results.get("vllm_router")
        vllm_ratio = results["router"]["rps"] / vllm["rps"] if vllm and vllm["rps"] else None
        report = {
            "added_p50_ms": added,
            "rps": results["router"]["rps"],
            "rps_ratio_vs_ascend_proxy": round(ratio, 2) if ratio is not None else None,
            "rps_ratio_vs_vllm_router": round(vllm_ratio, 2) if vllm_ratio is not None else None,
            "vllm_router_added_p50_ms": vllm["added_p50_ms"] if vllm else None,
            "vs_ours": _vs_ours(results),
            "optional_routers_installed": installed(),
            "left_out": left_out,
            "concurrency": args.concurrency,
            "latency_concurrency": 1,
            "rounds": args.rounds,
            "duration_s": args.duration,
            "latency_duration_s": args.latency_duration,
            "chunks_per_stream": args.chunks + 2,
            "cpus": os.cpu_count(),
            "router_cpus": sorted(args.router_cpus),
            "client_cpus": sorted(args.client_cpus) if args.client_cpus else None,
            "router_workers": router_workers,
            "targets": results,
            "targets_met": {
                "added_p50_ms<=1.0": added <= 1.0,
                "rps_ratio_vs_ascend_proxy>=2.0": ratio is not None and ratio >= 2.0,
                "rps_ratio_vs_vllm_router>=1.0": vllm_ratio is not None and vllm_ratio >= 1.0,
                "added_p50_ms<vllm_router": vllm is not None and added < vllm["added_p50_ms"],
                "zero_failed": all(r["failed"] == 0 for r in results.values()),
            },
        }
        report["path_decision"] = path_decision.run(prompts=200, calls=1000)
        report["targets_met"]["path_decision_p50_us<200"] = report["path_decision"]["within_bar"]
        print(json.dumps(report, indent=2))
        return 0
    finally:
        for process in reversed(processes):
            process.stop()


if __name__ == "__main__":
    sys.exit(main())
