"""Own a set of child processes, each in its own session: start, watch and stop them (`ProcessGroup`).

Every process is started with `start_new_session=True`, so its pid is also its process-group id,
and stopping it signals the whole group: vLLM forks EngineCore and worker children, they share
the group of the `vllm serve` process, so none of them survives. A process's stdout+stderr go to
a log file, and/or line by line with a prefix to the console ("inline output").
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import types
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, TextIO

from launch.affinity import instance_cpus, pin_to

logger = logging.getLogger("launch.processes")

STOP_GRACE_S = 10.0
LOG_TAIL_LINES = 40
#: How often `ProcessGroup.wait` looks at its processes.
POLL_INTERVAL_S = 0.2
#: How long to wait for the last echoed lines of a process that has exited.
OUTPUT_DRAIN_S = 2.0

#: Repository root: launch/.. . Child processes run here so `python -m launch.vllm_cli`
#: and `python -m proxy` import this checkout.
REPO_ROOT = Path(__file__).resolve().parent.parent


class ProcessFailed(RuntimeError):
    """A managed process exited early or did not become healthy in time."""


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
    """A child process started by a `ProcessGroup`, with its name and log file (None: no log file)."""

    name: str
    popen: subprocess.Popen[bytes]
    log_path: Path | None
    cmd: list[str] = field(default_factory=list)
    #: How the group's messages name the process (default: `name`).
    label: str = ""
    #: The thread that copies the process's output to the console (inline output), if any.
    output: threading.Thread | None = field(default=None, repr=False)
    #: The cores its whole process tree is placed on ('0-1,3'), '' when not placed.
    cpus: str = ""
    #: Drains it before a SIGTERM stop (`launch.drain`: called with a time bound, returns what happened).
    drain: Callable[[float], str] | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        self.label = self.label or self.name

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
        """The last lines of the process's log ('' without a log file)."""
        return tail(self.log_path, lines) if self.log_path is not None else ""

    def describe_failure(self, reason: str) -> str:
        """A message naming the process, the reason, the log path and the log's tail."""
        if self.log_path is None:
            return f"{self.name} (pid {self.pid}) {reason}; no log file (its output went to the console)"
        return (
            f"{self.name} (pid {self.pid}) {reason}; log: {self.log_path}\n"
            f"--- last lines of {self.log_path.name} ---\n{self.log_tail()}"
        )

    def wait_output(self, timeout: float = OUTPUT_DRAIN_S) -> None:
        """Wait up to `timeout` s until the output copied to the console has all been written."""
        if self.output is not None:
            self.output.join(timeout)


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


def _copy_output(src: IO[bytes], prefix: str, console: TextIO, log: IO[bytes] | None, lock: threading.Lock) -> None:
    """Copy a process's output line by line: as it is to `log`, headed by `prefix` to `console`.

    Reads to the end even when the console fails (a closed pipe), so the process never blocks on
    a full pipe.
    """
    console_ok = True
    try:
        for raw in iter(src.readline, b""):
            if log is not None:
                log.write(raw)
                log.flush()
            if not console_ok:
                continue
            text = raw.decode("utf-8", errors="replace")
            try:
                with lock:
                    console.write(prefix + (text if text.endswith("\n") else text + "\n"))
                    console.flush()
            except (OSError, ValueError):
                console_ok = False
    finally:
        src.close()
        if log is not None:
            log.close()


class ProcessGroup:
    """Context manager owning a set of child processes; stops them all on the way out.

    Each process is started with `start_new_session=True`, so its pid is also its process-group
    id, and stopping it signals the whole group (vLLM's EngineCore and worker children included).
    Stopping happens on `__exit__` (normal exit or exception), on `signals` (SIGINT and SIGTERM by
    default) while the context is active, and at interpreter exit as a last resort. The signal
    handlers (installed only when entered from the main thread) stop the processes at once (a
    further signal meanwhile is ignored), hand the signal on to the handler they replaced (an
    outer `ProcessGroup`'s, say), then raise `KeyboardInterrupt` (SIGINT) or `SystemExit(128 + N)`
    (signal N) so the caller unwinds. On SIGTERM the processes that have a drain
    (`ManagedProcess.drain`, `launch.drain`) are drained first, at once, for at most `drain_s`.

    `wait(first=True)` returns as soon as one process has exited; stopping the group then (leaving
    the `with`) stops all when one dies. The group's messages (a process exited, stopping,
    SIGKILL, a signal) go to `report` when given, else to the `launch.processes` logger.
    """

    def __init__(
        self,
        log_dir: Path | str | None = None,
        *,
        handle_signals: bool = True,
        stop_grace_s: float = STOP_GRACE_S,
        signals: Sequence[signal.Signals] = (signal.SIGINT, signal.SIGTERM),
        report: Callable[[str], None] | None = None,
        console: TextIO | None = None,
        drain_s: float | None = None,
    ) -> None:
        """``drain_s``: on SIGTERM, processes with a `ManagedProcess.drain` are drained first, at most
        that long (default `launch.drain.DRAIN_S`; 0: no drain)."""
        self._log_dir = Path(log_dir) if log_dir is not None else None
        if self._log_dir is not None:
            self._log_dir.mkdir(parents=True, exist_ok=True)
        self.handle_signals = handle_signals
        self.stop_grace_s = stop_grace_s
        self.drain_s = drain_s
        self.signals = tuple(signals)
        self.report = report
        #: Where inline output goes (default: sys.stdout at the time a process starts).
        self.console = console
        self.processes: list[ManagedProcess] = []
        self._lock = threading.RLock()  # the signal handler may re-enter
        self._console_lock = threading.Lock()
        self._old_handlers: dict[int, Any] = {}
        self._atexit_registered = False
        self._in_signal_stop = False

    @property
    def log_dir(self) -> Path:
        """Where the log files go (a new temporary directory, made on first use, unless given)."""
        if self._log_dir is None:
            self._log_dir = Path(tempfile.mkdtemp(prefix="pd-logs-"))
        return self._log_dir

    def _say(self, level: int, message: str) -> None:
        if self.report is not None:
            self.report(message)
        else:
            logger.log(level, message)

    # -- starting ---------------------------------------------------------------------------
    def start(
        self,
        name: str,
        cmd: Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        cwd: Path | str | None = None,
        label: str | None = None,
        log: bool = True,
        echo: str | None = None,
        cpus: str | None = None,
    ) -> ManagedProcess:
        """Start `cmd` in a new session (in `cwd`, default the repository root).

        Its stdout+stderr go to `<log_dir>/<name>.log` unless `log` is False, and with `echo` (a
        line prefix) also to the console, each line headed by `echo`; with neither, the process
        writes to this process's stdout/stderr. `label` names it in the group's messages.

        `cpus` ('0-1,3') places the process, and so every process it forks (vLLM's EngineCore and
        workers), on those cores (`os.sched_setaffinity` before the command runs, like `taskset
        -c`); None (the default) takes them from `env`'s VLLM_CPU_OMP_THREADS_BIND when that is a
        core list (`launch.affinity.instance_cpus`: a vLLM CPU instance's whole tree goes where
        its OpenMP threads are bound); '' leaves the placement alone.
        """
        cmd = list(cmd)
        cpus = instance_cpus(env) if cpus is None else cpus
        log_path = self.log_dir / f"{name}.log" if log else None
        where = f"log {log_path}" if log_path is not None else "no log file"
        where += f", cpus {cpus}" if cpus else ""
        logger.info("starting %s: %s (%s)", name, " ".join(cmd), where)
        log_file = open(log_path, "ab") if log_path is not None else None  # closed below, or by the output thread
        try:
            popen = subprocess.Popen(
                cmd,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE if echo is not None else log_file,
                stderr=subprocess.STDOUT if echo is not None or log_file is not None else None,
                env=dict(env) if env is not None else None,
                cwd=str(cwd) if cwd is not None else str(REPO_ROOT),
                start_new_session=True,
                preexec_fn=pin_to(cpus) if cpus else None,
            )
        except BaseException:
            if log_file is not None:
                log_file.close()
            raise
        output = None
        if echo is not None:
            assert popen.stdout is not None
            console = self.console or sys.stdout
            args = (popen.stdout, echo, console, log_file, self._console_lock)
            output = threading.Thread(target=_copy_output, args=args, daemon=True, name=f"output-{name}")
            output.start()
        elif log_file is not None:
            log_file.close()
        proc = ManagedProcess(
            name=name, popen=popen, log_path=log_path, cmd=cmd, label=label or "", output=output, cpus=cpus
        )
        with self._lock:
            self.processes.append(proc)
        if not self._atexit_registered:
            atexit.register(self.stop_all)
            self._atexit_registered = True
        return proc

    # -- waiting ----------------------------------------------------------------------------
    def wait(
        self,
        *,
        first: bool = False,
        interval: float = POLL_INTERVAL_S,
        on_exit: Callable[[ManagedProcess, int], None] | None = None,
    ) -> list[tuple[ManagedProcess, int]]:
        """Block until every process has exited, or with `first` until one has (whatever its code).

        Returns (process, exit code) in the order the exits were seen. Each exit is reported
        ("<label> exited with code N", after the process's inline output) and handed to `on_exit`.
        """
        with self._lock:
            pending = list(self.processes)
        exits: list[tuple[ManagedProcess, int]] = []
        while pending:
            for proc in list(pending):
                code = proc.poll()
                if code is None:
                    continue
                pending.remove(proc)
                proc.wait_output()
                self._say(logging.INFO, f"{proc.label} exited with code {code}")
                exits.append((proc, code))
                if on_exit is not None:
                    on_exit(proc, code)
            if first and exits:
                break
            if pending:
                time.sleep(interval)
        return exits

    # -- stopping ---------------------------------------------------------------------------
    def stop(self, proc: ManagedProcess, grace_s: float | None = None, *, drain: bool = False) -> None:
        """Stop one process and its process group (with ``drain``: its drain first, bounded)."""
        if drain:
            self.drain([proc])
        self._stop([proc], self.stop_grace_s if grace_s is None else grace_s)

    def drain(self, procs: Sequence[ManagedProcess] | None = None) -> None:
        """Drain ``procs`` (default: every process) that have a drain, at once, within ``drain_s``."""
        from launch.drain import DRAIN_S, drain_all

        bound = DRAIN_S if self.drain_s is None else self.drain_s
        with self._lock:
            live = [p for p in (self.processes if procs is None else procs) if p.is_running()]
        if bound > 0:
            drain_all(live, bound, lambda line: self._say(logging.INFO, line))

    def stop_all(self, grace_s: float | None = None) -> None:
        """Stop every process this group started (in parallel: SIGTERM, wait, SIGKILL)."""
        with self._lock:
            procs = list(self.processes)
        self._stop(procs, self.stop_grace_s if grace_s is None else grace_s)

    def _stop(self, procs: list[ManagedProcess], grace_s: float) -> None:
        live = [p for p in procs if p.is_running() or group_alive(p.pid)]
        for p in live:
            self._say(logging.INFO, f"stopping {p.label} (process group {p.pid})")
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
            self._say(logging.WARNING, f"{p.label} did not stop within {grace_s:.0f} s; sending SIGKILL")
            signal_group(p.pid, signal.SIGKILL)
        for p in pending:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.popen.wait(timeout=5)
        for p in live:
            p.wait_output()
        with self._lock:
            for p in procs:
                if p in self.processes and not p.is_running():
                    self.processes.remove(p)

    # -- context manager and signals --------------------------------------------------------
    def _on_signal(self, signum: int, frame: types.FrameType | None) -> None:
        # Stop everything here and now, whatever the caller later does with the exception
        # (pytest, for one, records a SystemExit inside a test as a failure and goes on).
        if self._in_signal_stop:
            return  # a second Ctrl-C while stopping for the first: let the stop finish
        self._in_signal_stop = True
        try:
            name = signal.Signals(signum).name
            self._say(logging.WARNING, f"received {name}; stopping {len(self.processes)} process(es)")
            if signum == signal.SIGTERM:
                self.drain()  # an orderly stop: instances with a drain hand their work over first
            self.stop_all()
        finally:
            self._in_signal_stop = False
        previous = self._old_handlers.get(signum)
        if callable(previous):
            previous(signum, frame)  # an outer group's handler, or Python's SIGINT default: both raise
        if signum == signal.SIGINT:
            raise KeyboardInterrupt
        raise SystemExit(128 + signum)

    def __enter__(self) -> ProcessGroup:
        if self.handle_signals and threading.current_thread() is threading.main_thread():
            for sig in self.signals:
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
