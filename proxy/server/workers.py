"""Several Router processes on one port: ``--workers N`` (default 1: one process, nothing here runs).

One Router process is one asyncio event loop on one core. With ``--workers N > 1``,
:func:`fork_workers` (called by ``python -m proxy`` after parsing the flags, before any event
loop or thread exists) turns the process into a small supervisor that forks N workers; each
worker is a whole Router (its own application, backend pool, HTTP client, health loop and
metrics) listening on the same host and port with ``SO_REUSEPORT``, so the kernel spreads
incoming *connections* over the workers (by a hash of the connection's addresses; a keep-alive
connection stays with its worker).

What each worker knows, and why routing stays correct:

- **Health**: each worker checks every backend itself (``--health-interval``) and marks one
  unhealthy on its own connection failures, exactly as a single Router does; a ``GET /health``
  checks all backends at once in the worker that takes it, so its answer is current whichever
  worker answers. Workers can disagree for at most one health interval after a change.
- **Load** (``--routing least-loaded``; ``cache-aware``'s load balance): each worker counts its
  own requests in flight. Every worker gets an even share of the connections and routes its
  share to its least-loaded instance, so the instances' total load is balanced in expectation;
  no counter is shared, so there is no lock and nothing to go stale.
- **Rooms**: random 63-bit rooms (the default) do not collide across workers;
  ``--trust-client-room`` refuses a room already in flight *in the same worker*, and the
  prefiller itself refuses a room that is live there (``prefill_refused``, HTTP 409).
- **Membership**: ``/instances/add`` and ``/instances/remove`` would change one worker only, so
  with N > 1 they answer HTTP 409 saying so (:func:`refuse_membership_changes`); give the
  instances as flags, or run one worker to manage them at run time. ``/instances`` and
  ``/metrics`` describe the worker that took the connection (its ``/health`` body names it).
- ``--routing cache-aware``: each worker's prefix tree learns its own connections' prompts only;
  a warning says so at start.

The supervisor forwards SIGTERM/SIGINT to the workers (after a short grace, since a signal to
the whole process group reaches them anyway), waits for them, and exits; a worker that dies on
its own is forked again unless it died within :data:`CRASH_WINDOW_S` of its start (then the
supervisor stops the others and exits 1: the same error would repeat). Each worker asks the
kernel to SIGTERM it if the supervisor dies (``PR_SET_PDEATHSIG``).
"""

from __future__ import annotations

import contextlib
import ctypes
import enum
import logging
import os
import signal
import socket
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from proxy.router_config import RouterConfig

logger = logging.getLogger("proxy")

#: A worker that exits within this many seconds of its start is not forked again.
CRASH_WINDOW_S = 10.0
#: After a stop signal, how long the supervisor waits before forwarding it to the workers.
FORWARD_GRACE_S = 0.3
#: How long the workers get to stop before they are killed.
STOP_TIMEOUT_S = 15.0
#: Log line format in a worker (the worker's index after the logger name).
WORKER_LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s[w%(worker)s]: %(message)s"
_PR_SET_PDEATHSIG = 1


@dataclass(frozen=True)
class WorkerInfo:
    """This process's place among the Router's workers."""

    index: int
    count: int
    pid: int

    def record(self) -> dict[str, int]:
        return {"index": self.index, "count": self.count, "pid": self.pid}


class SupervisorState(enum.Enum):
    RUNNING = "running"  # workers serve; a dead one is forked again
    STOPPING = "stopping"  # a stop signal came: workers are being stopped
    FAILED = "failed"  # a worker crashed at start: the others are being stopped


_current: WorkerInfo | None = None


def current_worker() -> WorkerInfo | None:
    """This worker's index and count, or ``None`` in a single-process Router."""
    return _current


def reserve_port(host: str, port: int) -> socket.socket:
    """A socket bound to ``host:port`` with ``SO_REUSEPORT`` but not listening: it holds the port
    (and resolves port 0) for the workers' listening sockets, and takes no connection itself."""
    family, kind, proto, _, address = socket.getaddrinfo(
        host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        sock.bind(address)
    except OSError as exc:
        sock.close()
        raise SystemExit(f"python -m proxy: error: cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    return sock


def fork_workers(config: RouterConfig) -> RouterConfig:
    """With ``config.workers > 1``: fork the workers; returns in each worker (with the port
    resolved), never in the supervisor (it exits when the workers are done). With one worker:
    returns ``config`` at once."""
    if config.workers <= 1:
        return config
    if not hasattr(socket, "SO_REUSEPORT"):  # pragma: no cover (Linux has it)
        raise SystemExit("python -m proxy: error: --workers > 1 needs SO_REUSEPORT, which this OS lacks")
    reserved = reserve_port(config.host, config.port)
    config = replace(config, port=reserved.getsockname()[1])
    if config.routing == "cache-aware":
        logger.warning(
            "--routing cache-aware with --workers %d: each worker learns the prompts of its own connections only",
            config.workers,
        )
    logger.info(
        "Router supervisor pid %d: %d workers on port %d (SO_REUSEPORT)", os.getpid(), config.workers, config.port
    )
    index = Supervisor(config.workers, reserved).run()
    # In a worker from here on.
    reserved.close()
    global _current
    _current = WorkerInfo(index, config.workers, os.getpid())
    _label_log_lines(index)
    return config


def _label_log_lines(index: int) -> None:
    """Name the worker on every log line of this process."""

    def add_worker(record: logging.LogRecord) -> bool:
        record.worker = index
        return True

    for handler in logging.getLogger().handlers:
        handler.addFilter(add_worker)
        handler.setFormatter(logging.Formatter(WORKER_LOG_FORMAT))


def _die_with_parent() -> None:
    """Ask the kernel for a SIGTERM when the supervisor dies (Linux; elsewhere a no-op)."""
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


class Supervisor:
    """Forks the workers and waits for them (the parent process of ``--workers N``)."""

    def __init__(self, count: int, reserved: socket.socket, fork: Callable[[], int] = os.fork) -> None:
        self.count = count
        self.reserved = reserved
        self._fork = fork
        self.state = SupervisorState.RUNNING
        #: pid -> (worker index, start time)
        self.workers: dict[int, tuple[int, float]] = {}
        self._stop_at: float | None = None
        self._forwarded = False
        self._parent = os.getpid()

    def run(self) -> int:
        """Fork the workers; return a worker's index in that worker, exit in the supervisor."""
        previous = {sig: signal.signal(sig, self._on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
        for index in range(self.count):
            if self._spawn(index):
                return self._enter_worker(index, previous)
        code = self._supervise()
        if self._spawned_in_child is not None:
            return self._enter_worker(self._spawned_in_child, previous)
        self.reserved.close()
        sys.exit(code)

    _spawned_in_child: int | None = None

    def _enter_worker(self, index: int, previous: dict[int, Any]) -> int:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        _die_with_parent()
        if os.getppid() != self._parent:  # the supervisor died before the request took effect
            os._exit(1)
        return index

    def _spawn(self, index: int) -> bool:
        """Fork worker ``index``; True in the child."""
        pid = self._fork()
        if pid == 0:
            return True
        self.workers[pid] = (index, time.monotonic())
        logger.info("worker %d started (pid %d)", index, pid)
        return False

    def _on_signal(self, signum: int, _frame: object) -> None:
        if self.state is SupervisorState.RUNNING:
            logger.info("%s: stopping %d workers", signal.Signals(signum).name, len(self.workers))
            self.state = SupervisorState.STOPPING
            self._stop_at = time.monotonic()

    def _signal_workers(self, sig: int) -> None:
        for pid in list(self.workers):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)

    def _supervise(self) -> int:
        while self.workers:
            self._reap()
            if self._spawned_in_child is not None:
                return 0
            if self.state is not SupervisorState.RUNNING and self._stop_at is not None:
                waited = time.monotonic() - self._stop_at
                if not self._forwarded and waited >= FORWARD_GRACE_S:
                    self._forwarded = True
                    self._signal_workers(signal.SIGTERM)
                if waited >= STOP_TIMEOUT_S:
                    logger.error("workers did not stop within %.0f s; killing them", STOP_TIMEOUT_S)
                    self._signal_workers(signal.SIGKILL)
                    self._stop_at = time.monotonic() - STOP_TIMEOUT_S + 2.0  # reap, then kill again
            time.sleep(0.05)
        return 1 if self.state is SupervisorState.FAILED else 0

    def _reap(self) -> None:
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                self.workers.clear()
                return
            if pid == 0:
                return
            entry = self.workers.pop(pid, None)
            if entry is None:
                continue
            index, started = entry
            code = os.waitstatus_to_exitcode(status)
            if self.state is not SupervisorState.RUNNING:
                logger.info("worker %d (pid %d) exited with %d", index, pid, code)
                continue
            if time.monotonic() - started < CRASH_WINDOW_S:
                logger.error(
                    "worker %d (pid %d) exited with %d within %.0f s of its start; stopping the Router",
                    index,
                    pid,
                    code,
                    CRASH_WINDOW_S,
                )
                self.state = SupervisorState.FAILED
                self._stop_at = time.monotonic() - FORWARD_GRACE_S
                continue
            logger.error("worker %d (pid %d) exited with %d; starting it again", index, pid, code)
            if self._spawn(index):
                self._spawned_in_child = index
                return


def refuse_membership_changes(workers: int) -> Callable[[Any], Any]:
    """The handler ``/instances/add`` and ``/instances/remove`` get with ``--workers N > 1``."""
    from proxy.errors import INVALID_REQUEST, RouterError

    async def refuse(request: Any) -> Any:
        raise RouterError(
            409,
            f"{request.path} is not available with --workers {workers}: it would change one worker's pool "
            "only; list the instances in the Router's flags, or run it with --workers 1 to add and remove "
            "instances at run time",
            INVALID_REQUEST,
        )

    return refuse


#: The admin routes that change the pool (refused with several workers).
MEMBERSHIP_PATHS = ("/instances/add", "/instances/remove", "/instances/drain")
