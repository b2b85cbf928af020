"""Start, watch and stop the processes of a local PD deployment (vLLM P/D instances, the Router).

Used by the local launcher (`python -m launch.local`) and by the end-to-end test fixtures.

- `ProcessGroup` starts every process in its own session (`start_new_session=True`), logs its
  stdout/stderr to a file, and on exit, exception, SIGINT or SIGTERM stops all of them by process
  group: SIGTERM, a grace period, then SIGKILL. vLLM forks EngineCore and worker children; they
  share the group of the `vllm serve` process, so none of them survives.
- `vllm_serve_cmd`, `vllm_env` and `router_cmd` build the command lines and environments.
- `start_pd_stack` brings up one P, one D and the Router on free loopback ports.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import types
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

logger = logging.getLogger(__name__)

LOOPBACK = "127.0.0.1"
STOP_GRACE_S = 10.0
#: vLLM instances on this machine start in ~30-60 s each; leave room for a slow, loaded box.
DEFAULT_START_TIMEOUT_S = 300.0
LOG_TAIL_LINES = 40
#: ASGI middleware that answers HTTP 400 to malformed `kv_transfer_params` (pd_connector).
KV_PARAMS_MIDDLEWARE = "pd_connector.http_validation.KVParamsValidationMiddleware"

#: Repository root: launch/.. . Child processes run here so `python -m launch.vllm_cli`
#: and `python -m proxy` import this checkout.
REPO_ROOT = Path(__file__).resolve().parent.parent


class ProcessFailed(RuntimeError):
    """A managed process exited early or did not become healthy in time."""


def free_port() -> int:
    """Return a TCP port that was free on 127.0.0.1 a moment ago (bind to port 0 and release)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((LOOPBACK, 0))
        return int(sock.getsockname()[1])


def free_ports(count: int) -> list[int]:
    """Return `count` distinct free ports (all held open together while choosing them)."""
    socks: list[socket.socket] = []
    try:
        for _ in range(count):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            socks.append(sock)
            sock.bind((LOOPBACK, 0))
        return [int(s.getsockname()[1]) for s in socks]
    finally:
        for sock in socks:
            sock.close()


def tail(path: Path | str, lines: int = LOG_TAIL_LINES) -> str:
    """Return the last `lines` lines of a text file ('' if it does not exist)."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - 64 * 1024))
            data = f.read()
    except OSError:
        return ""
    return "\n".join(data.decode("utf-8", errors="replace").splitlines()[-lines:])


@dataclass
class ManagedProcess:
    """A child process started by a `ProcessGroup`, with its name and log file."""

    name: str
    popen: subprocess.Popen[bytes]
    log_path: Path
    cmd: list[str] = field(default_factory=list)

    @property
    def pid(self) -> int:
        """Process id (also the process-group id: it was started in a new session)."""
        return self.popen.pid

    def poll(self) -> int | None:
        """Exit code, or None while it runs."""
        return self.popen.poll()

    def is_running(self) -> bool:
        """True while the process has not exited."""
        return self.popen.poll() is None

    def log_tail(self, lines: int = LOG_TAIL_LINES) -> str:
        """The last lines of the process's log."""
        return tail(self.log_path, lines)

    def describe_failure(self, reason: str) -> str:
        """A message naming the process, the reason, the log path and the log's tail."""
        return (
            f"{self.name} (pid {self.pid}) {reason}; log: {self.log_path}\n"
            f"--- last lines of {self.log_path.name} ---\n{self.log_tail()}"
        )


def group_members(pgid: int) -> list[int]:
    """Pids of the live (non-zombie) processes in process group `pgid`, read from /proc.

    Zombies are left out: an orphaned child that has exited may wait a while to be reaped by
    PID 1, and it holds no resources. Off Linux (no /proc) it falls back to `killpg(pgid, 0)`
    and returns `[pgid]` if anything answers.
    """
    proc = Path("/proc")
    if not proc.is_dir():
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return []
        except PermissionError:
            return [pgid]
        return [pgid]
    members = []
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # Fields after the command (which may hold spaces) start after the last ')'.
        fields = stat[stat.rfind(")") + 2 :].split()
        state, pgrp = fields[0], int(fields[2])
        if pgrp == pgid and state not in ("Z", "X"):
            members.append(int(entry.name))
    return members


def group_alive(pgid: int) -> bool:
    """True if any live process is still in process group `pgid`."""
    return bool(group_members(pgid))


def signal_group(pgid: int, sig: signal.Signals) -> None:
    """Send `sig` to process group `pgid`; a group that is gone (or not ours) is ignored."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


class ProcessGroup:
    """Context manager owning a set of child processes; stops them all on the way out.

    Each process is started with `start_new_session=True`, so its pid is also its process-group
    id, and stopping it signals the whole group (vLLM's EngineCore and worker children included).
    Stopping happens on `__exit__` (normal exit or exception), on SIGINT/SIGTERM while the
    context is active, and at interpreter exit as a last resort. The signal handlers (installed
    only when entered from the main thread) stop the processes at once, hand the signal on to the
    handler they replaced (an outer `ProcessGroup`'s, say), then raise `KeyboardInterrupt`
    (SIGINT) or `SystemExit(143)` (SIGTERM) so the caller unwinds.
    """

    def __init__(
        self,
        log_dir: Path | str | None = None,
        *,
        handle_signals: bool = True,
        stop_grace_s: float = STOP_GRACE_S,
    ) -> None:
        self.log_dir = Path(log_dir) if log_dir is not None else Path(tempfile.mkdtemp(prefix="pd-logs-"))
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.handle_signals = handle_signals
        self.stop_grace_s = stop_grace_s
        self.processes: list[ManagedProcess] = []
        self._lock = threading.RLock()  # the signal handler may re-enter
        self._old_handlers: dict[int, Any] = {}
        self._atexit_registered = False

    # -- starting ---------------------------------------------------------------------------
    def start(
        self,
        name: str,
        cmd: Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        cwd: Path | str | None = None,
    ) -> ManagedProcess:
        """Start `cmd` in a new session, stdout+stderr to `<log_dir>/<name>.log`."""
        log_path = self.log_dir / f"{name}.log"
        cmd = list(cmd)
        logger.info("starting %s: %s (log %s)", name, " ".join(cmd), log_path)
        with open(log_path, "ab") as log:
            popen = subprocess.Popen(
                cmd,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=dict(env) if env is not None else None,
                cwd=str(cwd) if cwd is not None else str(REPO_ROOT),
                start_new_session=True,
            )
        proc = ManagedProcess(name=name, popen=popen, log_path=log_path, cmd=cmd)
        with self._lock:
            self.processes.append(proc)
        if not self._atexit_registered:
            atexit.register(self.stop_all)
            self._atexit_registered = True
        return proc

    # -- stopping ---------------------------------------------------------------------------
    def stop(self, proc: ManagedProcess, grace_s: float | None = None) -> None:
        """Stop one process and its process group."""
        self._stop([proc], self.stop_grace_s if grace_s is None else grace_s)

    def stop_all(self, grace_s: float | None = None) -> None:
        """Stop every process this group started (in parallel: SIGTERM, wait, SIGKILL)."""
        with self._lock:
            procs = list(self.processes)
        self._stop(procs, self.stop_grace_s if grace_s is None else grace_s)

    def _stop(self, procs: list[ManagedProcess], grace_s: float) -> None:
        live = [p for p in procs if p.is_running() or group_alive(p.pid)]
        for p in live:
            logger.info("stopping %s (pid %d)", p.name, p.pid)
            signal_group(p.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        pending = list(live)
        while pending and time.monotonic() < deadline:
            for p in list(pending):
                p.poll()  # reap the leader so it does not count as alive
                if not p.is_running() and not group_alive(p.pid):
                    pending.remove(p)
            if pending:
                time.sleep(0.1)
        for p in pending:
            logger.warning("%s (pid %d) did not stop in %.0f s; sending SIGKILL", p.name, p.pid, grace_s)
            signal_group(p.pid, signal.SIGKILL)
        for p in pending:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.popen.wait(timeout=5)
        with self._lock:
            for p in procs:
                if p in self.processes and not p.is_running():
                    self.processes.remove(p)

    # -- context manager and signals --------------------------------------------------------
    def _on_signal(self, signum: int, frame: types.FrameType | None) -> None:
        # Stop everything here and now, whatever the caller later does with the exception
        # (pytest, for one, records a SystemExit inside a test as a failure and goes on).
        name = signal.Signals(signum).name
        logger.warning("received %s; stopping %d process(es)", name, len(self.processes))
        self.stop_all()
        previous = self._old_handlers.get(signum)
        if callable(previous):
            previous(signum, frame)  # an outer group's handler, or Python's SIGINT default: both raise
        if signum == signal.SIGINT:
            raise KeyboardInterrupt
        raise SystemExit(128 + signum)

    def __enter__(self) -> ProcessGroup:
        if self.handle_signals and threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._old_handlers[sig] = signal.signal(sig, self._on_signal)
        return self

    def __exit__(self, *exc_info: object) -> None:
        try:
            self.stop_all()
        finally:
            # Keep the atexit fallback if stopping was interrupted (a second Ctrl-C).
            if self._atexit_registered and not self.processes:
                atexit.unregister(self.stop_all)
                self._atexit_registered = False
            for sig, handler in self._old_handlers.items():
                signal.signal(sig, handler)
            self._old_handlers.clear()


# -- command lines ----------------------------------------------------------------------------
def vllm_serve_cmd(
    model: str | Path,
    port: int,
    *,
    kv_role: str | None = None,
    bootstrap_port: int | None = None,
    extra_config: Mapping[str, Any] | None = None,
    extra_args: Sequence[str] = (),
    served_model_name: str | None = None,
    host: str = LOOPBACK,
    validate_kv_params: bool = True,
) -> list[str]:
    """Command line of one `vllm serve` of `model` on this CPU machine (via `launch.vllm_cli`).

    With `kv_role` ("kv_producer" for P, "kv_consumer" for D) it adds a PDConnector
    `--kv-transfer-config` (`extra_config` entries are merged into `kv_connector_extra_config`)
    and, unless `validate_kv_params` is False, the `--middleware` that rejects malformed
    `kv_transfer_params` with HTTP 400.
    """
    cmd = [
        sys.executable,
        "-m",
        "launch.vllm_cli",
        "serve",
        str(model),
        "--host",
        host,
        "--port",
        str(port),
        "--dtype",
        "float32",
        "--block-size",
        "32",
        "--max-model-len",
        "2048",
    ]
    if served_model_name:
        cmd += ["--served-model-name", served_model_name]
    if kv_role is not None:
        if kv_role not in ("kv_producer", "kv_consumer"):
            raise ValueError(f"kv_role must be 'kv_producer' or 'kv_consumer', not {kv_role!r}")
        extra: dict[str, Any] = {"bootstrap_port": bootstrap_port, "local_ip": host, "protocol": "tcp"}
        extra.update(extra_config or {})
        kv_config = {"kv_connector": "PDConnector", "kv_role": kv_role, "kv_connector_extra_config": extra}
        cmd += ["--kv-transfer-config", json.dumps(kv_config)]
        if validate_kv_params:
            cmd += ["--middleware", KV_PARAMS_MIDDLEWARE]
    cmd += list(extra_args)
    return cmd


def vllm_env(cpu_bind: str, kv_space_gib: int = 1) -> dict[str, str]:
    """Environment for one vLLM CPU instance: its own cores and a small KV cache."""
    env = dict(os.environ)
    env["VLLM_CPU_OMP_THREADS_BIND"] = cpu_bind
    env["VLLM_CPU_KVCACHE_SPACE"] = str(kv_space_gib)
    env["PYTHONUNBUFFERED"] = "1"
    return env


def router_cmd(
    port: int,
    prefill: Sequence[tuple[str, int, int]],
    decode: Sequence[tuple[str, int]],
    *,
    host: str = LOOPBACK,
) -> list[str]:
    """Command line of the Router (`python -m proxy`).

    `prefill` is [(host, http_port, bootstrap_port)], `decode` is [(host, http_port)].
    """
    if not prefill or not decode:
        raise ValueError("the Router needs at least one prefill and one decode instance")
    return [
        sys.executable,
        "-m",
        "proxy",
        "--host",
        host,
        "--port",
        str(port),
        "--prefiller-hosts",
        *[h for h, _, _ in prefill],
        "--prefiller-ports",
        *[str(p) for _, p, _ in prefill],
        "--prefiller-bootstrap-ports",
        *[str(b) for _, _, b in prefill],
        "--decoder-hosts",
        *[h for h, _ in decode],
        "--decoder-ports",
        *[str(p) for _, p in decode],
    ]


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


def wait_all_healthy(
    targets: Sequence[tuple[str, ManagedProcess | None]],
    timeout: float = DEFAULT_START_TIMEOUT_S,
    *,
    watch: Sequence[ManagedProcess] = (),
    interval: float = 0.5,
) -> None:
    """Poll every (url, process) target with GET until each has answered 200 once.

    Raises `ProcessFailed` as soon as a target's process, or one of `watch`, exits (with the
    tail of its log), or when `timeout` seconds pass with a target still not ready.
    """
    deadline = time.monotonic() + timeout
    pending = list(targets)
    last_error: dict[str, str] = {}
    with httpx.Client(timeout=5.0, trust_env=False) as client:
        while True:
            for proc in [p for _, p in pending if p is not None] + list(watch):
                if not proc.is_running():
                    waiting_for = ", ".join(url for url, _ in pending)
                    reason = f"exited with code {proc.poll()} while waiting for {waiting_for}"
                    raise ProcessFailed(proc.describe_failure(reason))
            for url, proc in list(pending):
                try:
                    resp = client.get(url)
                except httpx.HTTPError as exc:
                    last_error[url] = f"{type(exc).__name__}: {exc}"
                    continue
                if resp.status_code == 200:
                    pending.remove((url, proc))
                else:
                    last_error[url] = f"HTTP {resp.status_code}"
            if not pending:
                return
            if time.monotonic() >= deadline:
                url, proc = pending[0]
                reason = f"not ready at {url} after {timeout:.0f} s ({last_error.get(url, 'no answer')})"
                raise ProcessFailed(proc.describe_failure(reason) if proc is not None else reason)
            time.sleep(interval)


def wait_http_ok(
    url: str,
    timeout: float = DEFAULT_START_TIMEOUT_S,
    proc: ManagedProcess | None = None,
    interval: float = 0.5,
) -> None:
    """Poll `url` with GET until it answers 200.

    Raises `ProcessFailed` (with the tail of the process's log when `proc` is given) if `proc`
    exits first or if `timeout` seconds pass.
    """
    wait_all_healthy([(url, proc)], timeout, interval=interval)


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
) -> PDStack:
    """Start P (kv_producer, CPU 0), D (kv_consumer, CPU 1) and the Router; wait until all are healthy.

    `p_args`/`d_args` are extra `vllm serve` flags (e.g. `--tensor-parallel-size 2`), `p_cpus` and
    `d_cpus` each side's VLLM_CPU_OMP_THREADS_BIND (TP or DP ranks joined by `|`).

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
    r_cmd = router_cmd(router_port, [(host, p_port, bootstrap_port)], [(host, d_port)], host=host)
    say(f"starting router on :{router_port}")
    router_env = dict(os.environ, PYTHONUNBUFFERED="1")
    router = group.start("router", r_cmd, env=router_env)
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
