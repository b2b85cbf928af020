"""Router overhead: our Router vs vLLM-Ascend's example proxy vs a direct connection, in one run.

Three targets, all in front of the same fast local backend (a minimal HTTP/1.1 server on raw
asyncio, started as a subprocess, that answers a streaming completion with an SSE stream of a
few chunks at once and a non-streaming one, the prefill call, with a small JSON body):

- ``direct``: the load generator talks to the backend itself;
- ``router``: ``python -m proxy`` (this repository) with the backend as its only prefiller
  and only decoder, default flags (log level INFO: one log line per request);
- ``ascend_proxy``: ``load_balance_proxy_server_example.py`` from
  ``../shared/peers/vllm-ascend-0.23.0.post1/`` (unmodified, default flags), with the backend as
  its prefiller and decoder (it calls P, then D).

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
``rps_ratio_vs_ascend_proxy`` = router rps / Ascend proxy rps.

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
ASCEND_PROXY = (
    REPO_ROOT.parent / "shared" / "peers" / "vllm-ascend-0.23.0.post1" / "load_balance_proxy_server_example.py"
)
HOST = "127.0.0.1"
TARGETS = ("direct", "router", "ascend_proxy")


# -- the fast backend (runs in its own process: ``router.py --serve-backend PORT``) ---------------


def _sse_event(payload: dict) -> bytes:
    return b"data: " + json.dumps(payload, separators=(", ", ": ")).encode() + b"\n\n"


def _chunked(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


def backend_responses(chunks: int) -> tuple[bytes, list[bytes], bytes]:
    """(non-streaming answer, streaming answer's writes, plain 200) as raw HTTP/1.1 bytes."""
    created = int(time.time())

    def completion(choice: dict[str, Any], **extra: Any) -> dict[str, Any]:
        return {"id": "cmpl-bench", "object": "text_completion", "created": created, "model": "bench",
                "choices": [choice], **extra}  # fmt: skip

    events = []
    for i in range(chunks):
        choice = {"index": 0, "text": f" token{i}", "logprobs": None, "finish_reason": None, "stop_reason": None}
        events.append(_sse_event(completion(choice)))
    usage = {"prompt_tokens": 16, "total_tokens": 16 + chunks, "completion_tokens": chunks}
    final = {"index": 0, "text": "", "logprobs": None, "finish_reason": "length", "stop_reason": None}
    events.append(_sse_event(completion(final, usage=usage)))
    head = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream; charset=utf-8\r\ntransfer-encoding: chunked\r\n\r\n"
    writes = [head + _chunked(events[0])] + [_chunked(e) for e in events[1:]]
    writes.append(_chunked(b"data: [DONE]\n\n") + b"0\r\n\r\n")
    body = json.dumps(
        completion(
            {"index": 0, "text": " token0", "logprobs": None, "finish_reason": "length"},
            usage={"prompt_tokens": 16, "total_tokens": 17, "completion_tokens": 1},
            kv_transfer_params=None,
        )
    ).encode()
    answer = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body)
    models = json.dumps({"object": "list", "data": [{"id": "bench", "object": "model"}]}).encode()
    plain = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (
        len(models),
        models,
    )
    return answer, writes, plain


def serve_backend(port: int, chunks: int) -> None:
    """A minimal keep-alive HTTP/1.1 server: SSE stream or JSON for POSTs, 200 for the rest."""
    import httptools

    answer, stream_writes, plain = backend_responses(chunks)

    class Protocol(asyncio.Protocol):
        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            self.transport = transport
            self.parser = httptools.HttpRequestParser(self)
            self.url = b""
            self.body: list[bytes] = []

        def on_message_begin(self) -> None:
            self.url = b""
            self.body = []

        def on_url(self, url: bytes) -> None:
            self.url += url

        def on_body(self, body: bytes) -> None:
            self.body.append(body)

        def on_message_complete(self) -> None:
            if self.parser.get_method() != b"POST":
                self.transport.write(plain)
                return
            request = json.loads(b"".join(self.body))
            if request.get("stream"):
                asyncio.get_running_loop().create_task(self.stream())
            else:
                self.transport.write(answer)

        async def stream(self) -> None:
            # Separate writes, one event-loop turn apart, like a server producing tokens.
            for data in stream_writes:
                if self.transport.is_closing():
                    return
                self.transport.write(data)
                await asyncio.sleep(0)

        def data_received(self, data: bytes) -> None:
            try:
                self.parser.feed_data(data)
            except httptools.HttpParserError:
                self.transport.close()

    async def main() -> None:
        server = await asyncio.get_running_loop().create_server(Protocol, HOST, port, backlog=4096)
        async with server:
            await server.serve_forever()

    _run(main())


def _run(coro) -> None:  # type: ignore[no-untyped-def]
    try:
        import uvloop

        uvloop.run(coro)
    except ImportError:  # pragma: no cover
        asyncio.run(coro)


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

    def __init__(self, name: str, args: list[str], log_dir: Path) -> None:
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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--serve-backend", type=int, metavar="PORT", help=argparse.SUPPRESS)
    parser.add_argument("--concurrency", type=int, default=64, help="streams of the throughput phase (default: 64)")
    parser.add_argument("--duration", type=float, default=4.0, help="seconds per throughput phase (default: 4)")
    parser.add_argument("--latency-duration", type=float, default=2.0, help="seconds per latency phase (default: 2)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds over the three targets (default: 3)")
    parser.add_argument("--chunks", type=int, default=4, help="token events per backend stream (default: 4)")
    parser.add_argument("--ascend-proxy", type=Path, default=ASCEND_PROXY, help="path of vLLM-Ascend's example proxy")
    parser.add_argument("--log-dir", type=Path, help="where the processes' logs go (default: a temporary folder)")
    args = parser.parse_args()
    if args.serve_backend:
        serve_backend(args.serve_backend, args.chunks)
        return 0
    if not args.ascend_proxy.is_file():
        parser.error(f"vLLM-Ascend's example proxy not found at {args.ascend_proxy}")

    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="router-bench-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    ports = {"backend": free_port(), "router": free_port(), "ascend_proxy": free_port()}
    backend = str(ports["backend"])
    processes: list[Process] = []
    try:
        say = lambda text: print(text, file=sys.stderr, flush=True)  # noqa: E731
        say(f"logs in {log_dir}")
        processes.append(
            Process(
                "backend",
                [
                    sys.executable,
                    str(Path(__file__).resolve()),
                    "--serve-backend",
                    backend,
                    "--chunks",
                    str(args.chunks),
                ],
                log_dir,
            )
        )
        processes[-1].wait_http(ports["backend"], "/health")
        router = Process(
            "router",
            [sys.executable, "-m", "proxy", "--host", HOST, "--port", str(ports["router"])]
            + ["--prefiller-hosts", HOST, "--prefiller-ports", backend, "--decoder-hosts", HOST]
            + ["--decoder-ports", backend],
            log_dir,
        )
        ascend = Process(
            "ascend_proxy",
            [sys.executable, str(args.ascend_proxy), "--host", HOST, "--port", str(ports["ascend_proxy"])]
            + ["--prefiller-hosts", HOST, "--prefiller-ports", backend, "--decoder-hosts", HOST]
            + ["--decoder-ports", backend],
            log_dir,
        )
        processes += [router, ascend]
        router.wait_http(ports["router"], "/health")
        ascend.wait_http(ports["ascend_proxy"], "/healthcheck")
        target_port = {"direct": ports["backend"], "router": ports["router"], "ascend_proxy": ports["ascend_proxy"]}

        latency: dict[str, Phase] = {t: Phase() for t in TARGETS}
        load: dict[str, Phase] = {t: Phase() for t in TARGETS}

        round_p50: dict[str, list[float]] = {t: [] for t in TARGETS}

        def add(total: Phase, part: Phase) -> None:
            total.latencies += part.latencies
            total.failed += part.failed
            total.elapsed += part.elapsed

        async def bench() -> None:
            for target in TARGETS:  # warm-up: connections, caches
                await run_phase(target_port[target], args.concurrency, 0.5)
            for round_index in range(args.rounds):
                order = TARGETS[round_index % 3 :] + TARGETS[: round_index % 3]
                # Latency phases back to back (so each round's targets see the same machine), then load.
                for target in order:
                    one = await run_phase(target_port[target], 1, args.latency_duration)
                    add(latency[target], one)
                    round_p50[target].append(_percentile(one.latencies, 0.5))
                for target in order:
                    many = await run_phase(target_port[target], args.concurrency, args.duration)
                    add(load[target], many)
                    say(
                        f"round {round_index + 1}/{args.rounds} {target:12s} "
                        f"p50 {round_p50[target][-1] * 1e3:7.3f} ms  "
                        f"rps@{args.concurrency} {len(many.latencies) / many.elapsed:8.1f}  failed {many.failed}"
                    )

        _run(bench())
        results = {}
        for target in TARGETS:
            results[target] = {
                "p50_ms": round(_percentile(latency[target].latencies, 0.5) * 1e3, 3),
                "p99_ms": round(_percentile(latency[target].latencies, 0.99) * 1e3, 3),
                "p50_ms_at_concurrency": round(_percentile(load[target].latencies, 0.5) * 1e3, 3),
                "rps": round(len(load[target].latencies) / load[target].elapsed, 1),
                "p50_ms_per_round": [round(v * 1e3, 3) for v in round_p50[target]],
                "requests": len(latency[target].latencies) + len(load[target].latencies),
                "failed": latency[target].failed + load[target].failed,
            }
        # Per round, router p50 minus direct p50 (measured seconds apart); the median over rounds.
        added = statistics.median((r - d) * 1e3 for r, d in zip(round_p50["router"], round_p50["direct"], strict=True))
        ratio = results["router"]["rps"] / results["ascend_proxy"]["rps"] if results["ascend_proxy"]["rps"] else None
        report = {
            "added_p50_ms": round(added, 3),
            "rps": results["router"]["rps"],
            "rps_ratio_vs_ascend_proxy": round(ratio, 2) if ratio is not None else None,
            "concurrency": args.concurrency,
            "latency_concurrency": 1,
            "rounds": args.rounds,
            "duration_s": args.duration,
            "latency_duration_s": args.latency_duration,
            "chunks_per_stream": args.chunks + 2,
            "cpus": os.cpu_count(),
            "targets": results,
            "targets_met": {
                "added_p50_ms<=1.0": added <= 1.0,
                "rps_ratio_vs_ascend_proxy>=2.0": ratio is not None and ratio >= 2.0,
                "zero_failed": all(r["failed"] == 0 for r in results.values()),
            },
        }
        print(json.dumps(report, indent=2))
        return 0
    finally:
        for process in reversed(processes):
            process.stop()


if __name__ == "__main__":
    sys.exit(main())
