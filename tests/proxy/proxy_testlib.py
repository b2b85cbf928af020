"""Helpers shared by the Router tests: free ports, polling, child processes.

Kept out of ``conftest.py`` so test modules can import them (``tests/proxy`` is not a package:
pytest puts this folder on ``sys.path``).
"""

from __future__ import annotations

import ctypes
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
FAKE_BACKEND = Path(__file__).with_name("fake_backend.py")
HOST = "127.0.0.1"
#: Deadline for a process to start listening (a slow 2-core machine imports FastAPI slowly).
STARTUP_TIMEOUT_S = 40.0
#: Hard limit for one test's own body (fixtures that start processes have their own deadlines).
TEST_TIMEOUT_S = 45


def _die_with_parent() -> None:
    """In the child, before exec: on Linux, get SIGTERM if pytest dies without its finalizers."""
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            pass


def free_port() -> int:
    """A loopback TCP port nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((HOST, 0))
        return sock.getsockname()[1]


def wait_until(predicate: Callable[[], Any], timeout: float, interval: float = 0.05) -> Any:
    """Poll ``predicate`` until it returns something truthy; return it, or fail after ``timeout``."""
    end = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > end:
            pytest.fail(f"condition not met within {timeout}s (last value: {value!r})")
        time.sleep(interval)


@dataclass
class Proc:
    """A child process listening on ``port``; its output goes to ``log_path``."""

    name: str
    port: int
    args: list[str]
    log_path: Path
    popen: subprocess.Popen[bytes] | None = field(default=None, repr=False)

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    def start(self) -> Proc:
        log = self.log_path.open("wb")
        self.popen = subprocess.Popen(
            self.args, cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT, preexec_fn=_die_with_parent
        )
        log.close()
        return self

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def wait_listening(self, timeout: float = STARTUP_TIMEOUT_S) -> None:
        """Wait until the process answers HTTP on its port (any status), or fail with its log."""
        assert self.popen is not None
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if self.popen.poll() is not None:
                pytest.fail(f"{self.name} exited with {self.popen.returncode}:\n{self.log_text()}")
            try:
                httpx.get(f"{self.url}/health", timeout=1.0, trust_env=False)
                return
            except httpx.HTTPError:
                time.sleep(0.1)
        pytest.fail(f"{self.name} did not listen on port {self.port} within {timeout}s:\n{self.log_text()}")

    def stop(self) -> None:
        """Stop the process by its pid: SIGTERM, then SIGKILL if it does not exit in time."""
        if self.popen is None or self.popen.poll() is not None:
            return
        self.popen.send_signal(signal.SIGTERM)
        try:
            self.popen.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            self.popen.wait(timeout=5)


@dataclass(frozen=True)
class Backends:
    """Ports of the fake backends shared by all Router tests (``down`` has nothing listening)."""

    ok_p: int
    ok_d: int
    fail500: int
    fail500_late: int
    hang: int
    slow_stream: int
    late_stream: int
    down: int


BACKEND_MODES: dict[str, list[str]] = {
    "ok_p": ["--mode", "ok"],
    "ok_d": ["--mode", "ok"],
    "fail500": ["--mode", "fail500"],
    # Fails only after D's stream has started sending (D is slow_stream in those tests).
    "fail500_late": ["--mode", "fail500", "--delay", "1.0"],
    "hang": ["--mode", "hang"],
    "slow_stream": ["--mode", "slow_stream", "--chunks", "200", "--chunk-interval", "0.1"],
    # Sends its stream's headers at once but its first chunk only after 5 s.
    "late_stream": ["--mode", "ok", "--stream-delay", "5"],
}


@dataclass
class Router:
    """A running ``python -m proxy`` and the backends it fronts."""

    proc: Proc
    prefill_port: int
    decode_port: int
    bootstrap_port: int

    @property
    def url(self) -> str:
        return self.proc.url


RouterFactory = Callable[..., Router]
