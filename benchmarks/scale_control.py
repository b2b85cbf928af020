"""Control plane at deployment size (``benchmarks/scale.py``): the bootstrap server and the D->P handshake.

Real code, fake ranks: the prefill side is one process (``PrefillHost``, forked once) running, per size,
the real ``BootstrapServer`` and one real ``KVTransferManager`` per P rank (ZMQ channel, listener, rooms);
the D ranks are real decode ``KVTransferManager`` objects in this process (so at 256 D ranks their
latency includes 256 ranks sharing one interpreter: the D side of the simulation, not of a deployment). Every call is signed (a token is
set, so bootstrap calls carry HMAC signatures and ZMQ frames the signed envelope). Only the bytes are
fake: the transfer backend (``NullBackend``) writes nothing, and the KV regions are made-up addresses
(they pass the same write-guard checks as real ones). A deployment of N ranks is TP min(N, 8), the rest
DP; the model has 8 KV heads, so a D rank reads its heads from one or more P ranks (mixed TP as
``tp_mapping`` plans it). Each D instance (its TP ranks) loads one room, held by P DP rank
``instance % P's DP size``, which the job names (as ``--prefiller-dp-ranks`` would).

One size = (P ranks, D ranks). Steps measured:

- ``register``: every P rank's ``register_rank`` (the real client) at once, from one thread each;
- ``route_lookup``: one D rank's cold ``RouteCache.get`` at a time (uncontended latency), then every
  D rank's at once (a stampede: D ranks start together);
- ``handshake_cold`` / ``handshake_warm``: every D rank ``add_recvs`` one load at the same instant
  (cold: route fetch, PeerHello, TransferRequest, P's (empty) push, TransferDone; warm: the same D
  ranks again with the route cached and the hello sent). Latency = from ``add_recvs`` until the load
  is in the rank's ``finished_recving``.

CPU: the bootstrap server's own thread (``/proc/<pid>/task/<tid>/stat``) and the whole prefill process
(its P ranks' listeners included), less that process's idle rate measured before the steps.
"""

from __future__ import annotations

import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

HOST = "127.0.0.1"
TOKEN_ENV = "PDC_SCALE_BENCH_TOKEN"
TOKEN = "scale-benchmark-token-0123456789abcdef"
BLOCK_SIZE, LAYERS, NUM_BLOCKS, HEAD_BYTES = 16, 2, 64, 256
HEADS = 8  # the model's KV heads
LOAD_BLOCKS = 4  # blocks per load
ROOM_BASE = 1 << 40


class NullBackend:
    """A transfer backend that moves no bytes: the benchmark measures the control plane only."""

    descriptor = b"null"

    def register(self, ranges: Any) -> None:
        pass

    def write(
        self, peer_descriptor: bytes, src: Any, dst: Any, lengths: Any, max_batch: int, still_wanted: Any = None
    ) -> None:
        pass

    def close(self) -> None:
        pass


def topology(ranks: int, tp_max: int = 8) -> tuple[int, int]:
    """(DP size, TP size) of a deployment of ``ranks`` ranks: TP up to ``tp_max``, the rest DP."""
    tp = min(ranks, tp_max)
    if ranks % tp:
        raise ValueError(f"{ranks} ranks do not split into TP {tp}")
    return ranks // tp, tp


def _config(mode: str, bootstrap_port: int) -> Any:
    from pd_connector.config import parse_config

    extra = {"local_ip": HOST, "auth_token_env": TOKEN_ENV, "bootstrap_port": bootstrap_port, "transfer_threads": 1,
             "kv_wait_timeout_s": 120.0, "room_timeout_s": 600.0, "http_timeout_s": 60.0, "peer_timeout_s": 60.0}  # fmt: skip
    return parse_config("kv_producer" if mode == "prefill" else "kv_consumer", extra)


def _manager(mode: str, bootstrap_port: int, dp: int, dp_size: int, tp: int, tp_size: int, rank_index: int) -> Any:
    from pd_connector.layouts.regions import Region
    from pd_connector.transfer.manager import KVTransferManager, RankSpec

    spec = RankSpec(
        tp_rank=tp, tp_size=tp_size, dp_rank=dp, dp_size=dp_size, block_size=BLOCK_SIZE, kv_dtype="float16",
        num_layers=LAYERS, total_kv_heads=HEADS, local_kv_heads=HEADS // tp_size, num_blocks=NUM_BLOCKS,
    )  # fmt: skip
    base = (rank_index + 1) << 32  # made-up addresses, one span per rank
    block = HEAD_BYTES * HEADS // tp_size
    regions = [Region(base + i * NUM_BLOCKS * block, block, block) for i in range(LAYERS)]
    return KVTransferManager(_config(mode, bootstrap_port), spec, regions, NullBackend())  # type: ignore[arg-type]


def room_of(round_index: int, instance: int) -> int:
    return ROOM_BASE + round_index * 1_000_000 + instance


# -- the prefill process -------------------------------------------------------------------------------


def _deploy(p_ranks: int, d_instances: int, rounds: int) -> tuple[Any, dict[tuple[int, int], Any], dict[str, Any]]:
    """One prefill deployment: bootstrap server, P ranks, every room's prefill done (rooms wait READY)."""
    from pd_connector.bootstrap.server import BootstrapServer, BootstrapState
    from pd_connector.metadata import SendJob

    dp_size, tp_size = topology(p_ranks)
    state = BootstrapState(attn_tp_size=tp_size, attn_dp_size=dp_size)
    server = BootstrapServer(state, HOST, 0, token=TOKEN.encode())
    server.start()
    port = server._server.servers[0].sockets[0].getsockname()[1]
    tid = server._thread.native_id if server._thread is not None else 0
    ranks = {}
    for dp in range(dp_size):
        for tp in range(tp_size):
            ranks[(dp, tp)] = _manager("prefill", port, dp, dp_size, tp, tp_size, dp * tp_size + tp)
    for (dp, _), mgr in ranks.items():  # one room per D instance and round
        jobs = [
            SendJob(f"p-{r}-{i}", room_of(r, i), list(range(LOAD_BLOCKS)), LOAD_BLOCKS * BLOCK_SIZE)
            for r in range(rounds)
            for i in range(d_instances)
            if i % dp_size == dp
        ]
        mgr.add_sends(jobs)
    info = {
        "bootstrap_port": port,
        "bootstrap_tid": tid,
        "ranks": [[dp, tp, m.rank_port] for (dp, tp), m in ranks.items()],
    }
    return server, ranks, info


def serve_prefill(conn: Any) -> None:
    """The prefill process: a deployment per ("deploy", p_ranks, d_instances, rounds), torn down on
    ("teardown",); returns on ("exit",) or a closed pipe."""
    os.environ[TOKEN_ENV] = TOKEN
    deployed: tuple[Any, dict[tuple[int, int], Any], dict[str, Any]] | None = None
    while True:
        try:
            command = conn.recv()
        except EOFError:
            command = ("exit",)
        if deployed is not None and command[0] in ("teardown", "exit"):
            server, ranks, _ = deployed
            _close_all(list(ranks.values()))
            server.stop()
            deployed = None
        if command[0] == "exit":
            return
        if command[0] == "deploy":
            deployed = _deploy(*command[1:])
            conn.send(deployed[2])
        else:
            conn.send({})


class PrefillHost:
    """The prefill process, forked from this one (vLLM is imported once, by the parent)."""

    def __init__(self) -> None:
        import multiprocessing

        from pd_connector.transfer import manager  # noqa: F401 - imported before the fork, once

        ctx = multiprocessing.get_context("fork")
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=serve_prefill, args=(child,), daemon=True)
        self._proc.start()
        self.pid = self._proc.pid

    def deploy(self, p_ranks: int, d_instances: int, rounds: int) -> dict[str, Any]:
        self._conn.send(("deploy", p_ranks, d_instances, rounds))
        return self._conn.recv()

    def teardown(self) -> None:
        self._conn.send(("teardown",))
        self._conn.recv()

    def close(self) -> None:
        try:
            self._conn.send(("exit",))
        except OSError:
            pass
        self._proc.join(timeout=30)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join()


def thread_cpu_s(pid: int, tid: int) -> float:
    """CPU seconds one thread ran (``schedstat``: nanoseconds, not the 10 ms ticks of ``stat``)."""
    try:
        return int(Path(f"/proc/{pid}/task/{tid}/schedstat").read_text().split()[0]) / 1e9
    except (OSError, ValueError, IndexError):
        return 0.0  # the thread ended


def process_cpu_s(pid: int) -> float:
    """CPU seconds of a process's live threads (ended threads' time is lost: the steps' threads live on)."""
    return sum(thread_cpu_s(pid, int(tid)) for tid in os.listdir(f"/proc/{pid}/task"))


class Meter:
    """CPU of the prefill process (less its idle rate) and of its bootstrap thread over one step."""

    def __init__(self, pid: int, tid: int, idle_rate: float) -> None:
        self.pid, self.tid, self.idle_rate = pid, tid, idle_rate

    def __enter__(self) -> Meter:
        self.t0, self.p0, self.b0 = time.perf_counter(), process_cpu_s(self.pid), thread_cpu_s(self.pid, self.tid)
        return self

    def __exit__(self, *exc: object) -> None:
        self.wall_s = time.perf_counter() - self.t0
        self.bootstrap_cpu_s = thread_cpu_s(self.pid, self.tid) - self.b0
        self.prefill_cpu_s = max(0.0, process_cpu_s(self.pid) - self.p0 - self.idle_rate * self.wall_s)


def percentiles(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    pick = lambda q: ordered[min(len(ordered) - 1, int(q * len(ordered)))]  # noqa: E731
    return {
        "p50_ms": round(pick(0.5) * 1e3, 3),
        "p99_ms": round(pick(0.99) * 1e3, 3),
        "max_ms": round(ordered[-1] * 1e3, 3),
    }


def _at_once(n: int, fn: Any) -> list[float]:
    """Run ``fn(i)`` for i in range(n) on n threads released together; each call's latency."""
    barrier = threading.Barrier(n + 1)
    out = [0.0] * n

    def one(i: int) -> None:
        barrier.wait()
        t = time.perf_counter()
        fn(i)
        out[i] = time.perf_counter() - t

    with ThreadPoolExecutor(max_workers=n) as pool:
        futures = [pool.submit(one, i) for i in range(n)]
        barrier.wait()
        for f in futures:
            f.result()
    return out


def _step(meter: Meter, latencies: list[float], count: int, **extra: Any) -> dict[str, Any]:
    return {
        **percentiles(latencies),
        "count": count,
        "wall_s": round(meter.wall_s, 4),
        "bootstrap_cpu_ms_per_call": round(meter.bootstrap_cpu_s * 1e3 / count, 4),
        "prefill_cpu_ms_per_call": round(meter.prefill_cpu_s * 1e3 / count, 4),
        **extra,
    }


def measure_size(
    host: PrefillHost, p_ranks: int, d_ranks: int, lookups: int = 30, min_calls: int = 64, idle_s: float = 1.0
) -> dict[str, Any]:
    """Every step at one size (see the module docstring)."""
    os.environ[TOKEN_ENV] = TOKEN
    from pd_connector.bootstrap.client import RouteCache, register_rank
    from pd_connector.messages import RegisterRank
    from pd_connector.metadata import RecvJob

    p_dp, p_tp = topology(p_ranks)
    d_dp, d_tp = topology(d_ranks)
    info = host.deploy(p_ranks, d_dp, 2)
    d_mgrs: list[Any] = []
    pid, port, tid = host.pid, info["bootstrap_port"], info["bootstrap_tid"]
    addr = f"{HOST}:{port}"
    try:
        idle_rate = _idle_rate(pid, idle_s)
        token = TOKEN.encode()
        out: dict[str, Any] = {"p_ranks": p_ranks, "d_ranks": d_ranks, "p_dp_tp": [p_dp, p_tp], "d_dp_tp": [d_dp, d_tp]}
        out["prefill_idle_cpu_per_s"] = round(idle_rate, 4)

        regs = [RegisterRank(p_tp, tp, p_dp, dp, HOST, rank_port, BLOCK_SIZE, "float16", num_layers=LAYERS)
                for dp, tp, rank_port in info["ranks"]]  # fmt: skip
        oks = [False] * len(regs)

        def register(i: int) -> None:
            oks[i] = register_rank(addr, regs[i], retries=3, interval_s=0.1, timeout_s=60.0, token=token)

        reps = max(1, min_calls // len(regs))  # small deployments register again (same endpoints): enough samples
        lat = []
        with Meter(pid, tid, idle_rate) as meter:
            for _ in range(reps):
                lat += _at_once(len(regs), register)
                if not all(oks):
                    raise RuntimeError(f"{oks.count(False)} P ranks did not register")
        out["register"] = _step(meter, lat, len(lat))

        lat = []
        with Meter(pid, tid, idle_rate) as meter:
            for _ in range(lookups):
                t = time.perf_counter()
                route = RouteCache(60.0, token=token).get(addr)
                lat.append(time.perf_counter() - t)
        from msgspec import json as mjson

        out["route_lookup"] = _step(meter, lat, lookups, route_bytes=len(mjson.encode(route)))
        with Meter(pid, tid, idle_rate) as meter:
            lat = _at_once(d_ranks, lambda i: RouteCache(60.0, token=token).get(addr))
        out["route_lookup_at_once"] = _step(meter, lat, d_ranks)

        d_mgrs = [_manager("decode", port, i // d_tp, d_dp, i % d_tp, d_tp, 100_000 + i) for i in range(d_ranks)]
        for round_index, name in enumerate(("handshake_cold", "handshake_warm")):
            jobs = [
                RecvJob(f"d-{round_index}-{i}", room_of(round_index, i // d_tp), HOST, port, (i // d_tp) % p_dp,
                        list(range(LOAD_BLOCKS)), 0, LOAD_BLOCKS * BLOCK_SIZE)
                for i in range(d_ranks)
            ]  # fmt: skip
            with Meter(pid, tid, idle_rate) as meter:
                lat = _handshakes(d_mgrs, jobs)
            out[name] = _step(meter, lat, d_ranks)
        return out
    finally:
        _close_all(d_mgrs)
        host.teardown()


def _idle_rate(pid: int, idle_s: float, windows: int = 4) -> float:
    """The prefill process's CPU seconds per second while nothing calls it (its listeners' polling): the
    least of a few windows: a burst in one (the deployment still settling, a GC pass) is no idle cost."""
    rates = []
    for _ in range(windows):
        c0, t0 = process_cpu_s(pid), time.perf_counter()
        time.sleep(idle_s / windows)
        rates.append((process_cpu_s(pid) - c0) / (time.perf_counter() - t0))
    return min(rates)


def _handshakes(mgrs: list[Any], jobs: list[Any]) -> list[float]:
    """Every manager's job started at once; seconds until each reported it received (a failure raises)."""
    started = [0.0] * len(mgrs)
    done: list[float | None] = [None] * len(mgrs)
    for i, (mgr, job) in enumerate(zip(mgrs, jobs, strict=True)):
        started[i] = time.perf_counter()
        mgr.add_recvs([job])
    deadline = time.monotonic() + 120
    while any(d is None for d in done):
        if time.monotonic() > deadline:
            raise RuntimeError(f"{done.count(None)} handshakes did not finish in 120 s")
        for i, mgr in enumerate(mgrs):
            if done[i] is None:
                _, recving, failed = mgr.take_finished()
                if failed:
                    raise RuntimeError(f"D rank {i}: load failed: {failed}")
                if jobs[i].req_id in recving:
                    done[i] = time.perf_counter()
        time.sleep(0.0005)
    return [d - s for d, s in zip(done, started, strict=True) if d is not None]


def _close_all(mgrs: list[Any]) -> None:
    for mgr in mgrs:
        mgr.channel._stop.set()  # every listener stops within one poll, not one after another
    for mgr in mgrs:
        mgr.close()
