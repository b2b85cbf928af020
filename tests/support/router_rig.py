"""Helpers shared by the Router tests (tests/proxy): free ports, polling, child processes."""

from __future__ import annotations

import ctypes
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from proxy.access.admin_token import admin_headers as _token_headers
from tests.support.loopback import HOST, free_port, wait_for

REPO_ROOT = Path(__file__).resolve().parents[2]
FAKE_BACKEND = Path(__file__).with_name("fake_backend.py")
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


def wait_until(predicate: Callable[[], Any], timeout: float, interval: float = 0.05) -> Any:
    """Poll ``predicate`` until it returns something truthy; return it, or fail after ``timeout``."""
    return wait_for(predicate, timeout, interval)


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

    def wait_listening(self, timeout: float = STARTUP_TIMEOUT_S, path: str = "/health") -> None:
        """Wait until the process answers HTTP on its port (any status), or fail with its log."""
        assert self.popen is not None
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if self.popen.poll() is not None:
                pytest.fail(f"{self.name} exited with {self.popen.returncode}:\n{self.log_text()}")
            try:
                httpx.get(f"{self.url}{path}", timeout=1.0, trust_env=False)
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
    ok_p2: int
    ok_d: int
    ok_d2: int
    ok_d_slow: int
    fail500: int
    fail500_late: int
    fail400: int
    incompatible: int
    hang: int
    hang2: int
    slow_stream: int
    slow_stream2: int
    slow_short: int
    late_stream: int
    die_mid_stream: int
    die_mid_stream2: int
    die_held: int
    resume_d: int
    error_event: int
    lingering_d: int
    down: int


#: Every fake backend, served by one process (tests/support/fake_backend.py ``--specs``).
BACKEND_SPECS: dict[str, dict[str, Any]] = {
    "ok_p": {"mode": "ok"},
    "ok_p2": {"mode": "ok"},
    "ok_d": {"mode": "ok"},
    "ok_d2": {"mode": "ok"},
    # Answers after 0.5 s (like a decoder waiting for its KV), so a failing P is noticed first.
    "ok_d_slow": {"mode": "ok", "delay": 0.5},
    # A decoder refusing every PD request with HTTP 409 kv_transfer_incompatible.
    "incompatible": {"mode": "incompatible"},
    "fail500": {"mode": "fail500"},
    # Fails only after D's stream has started sending (D is slow_stream in those tests).
    "fail500_late": {"mode": "fail500", "delay": 1.0},
    "fail400": {"mode": "fail400"},
    "hang": {"mode": "hang"},
    "hang2": {"mode": "hang"},
    "slow_stream": {"mode": "slow_stream", "chunks": 200, "chunk_interval": 0.1},
    "slow_stream2": {"mode": "slow_stream", "chunks": 200, "chunk_interval": 0.1},
    # A stream that takes about 2 s.
    "slow_short": {"mode": "slow_stream", "chunks": 20, "chunk_interval": 0.1},
    # Sends its stream's headers at once but its first chunk only after 5 s.
    "late_stream": {"mode": "ok", "stream_delay": 5.0},
    # Three chunks 50 ms apart, then the connection drops.
    "die_mid_stream": {"mode": "die_mid_stream", "chunks": 3, "chunk_interval": 0.05},
    "die_mid_stream2": {"mode": "die_mid_stream", "chunks": 3, "chunk_interval": 0.05},
    # The same, its last event naming one more token whose text is still held (HELD_ID).
    "die_held": {"mode": "die_mid_stream", "chunks": 3, "chunk_interval": 0.05, "held_last": True},
    # Eight tokens in all (request_body's max_tokens), a resumed stream continuing where it was cut.
    "resume_d": {"mode": "slow_stream", "chunks": 8, "chunk_interval": 0.01},
    "error_event": {"mode": "error_event"},
    # Keeps its stream open 2 s after [DONE] (a client may hang up in between).
    "lingering_d": {"mode": "ok", "done_linger": 2.0},
}


@dataclass
class Router:
    """A running ``python -m proxy`` and the backends it fronts (the first of each role, and all)."""

    proc: Proc
    prefill_port: int
    decode_port: int
    bootstrap_port: int
    prefill_ports: tuple[int, ...] = ()
    decode_ports: tuple[int, ...] = ()

    @property
    def url(self) -> str:
        return self.proc.url


RouterFactory = Callable[..., Router]


def router_args(
    port: int, prefill: Sequence[int], decode: Sequence[int], bootstrap_port: int, *extra: str
) -> list[str]:
    """Command line of a Router on ``port`` in front of loopback backends."""
    return [
        sys.executable,
        "-m",
        "proxy",
        "--host",
        HOST,
        "--port",
        str(port),
        "--prefiller-hosts",
        *[HOST] * len(prefill),
        "--prefiller-ports",
        *map(str, prefill),
        "--prefiller-bootstrap-ports",
        str(bootstrap_port),
        "--decoder-hosts",
        *[HOST] * len(decode),
        "--decoder-ports",
        *map(str, decode),
        "--connect-timeout",
        "2",
        "--log-level",
        "DEBUG",
        # The tests steer requests with client rooms; ``--no-trust-client-room`` in ``extra`` turns it off.
        "--trust-client-room",
        # Most tests check the two-instance path (P and D at once); ``--first-token-from-prefill``
        # in ``extra`` turns the first-token path back on (tests/proxy/test_first_token.py).
        "--no-first-token-from-prefill",
        *extra,
    ]


def start_router(log_dir: Path, prefill: Sequence[int], decode: Sequence[int], *extra: str) -> Router:
    """Start a Router process (the caller stops ``router.proc``) and wait until it listens."""
    port = free_port()
    bootstrap_port = free_port()
    args = router_args(port, prefill, decode, bootstrap_port, *extra)
    proc = Proc(f"router {port}", port, args, log_dir / f"router-{port}.log").start()
    try:
        # /healthcheck: the Router's /health waits for its first round of health checks.
        proc.wait_listening(path="/healthcheck")
    except BaseException:
        proc.stop()
        raise
    return Router(proc, prefill[0], decode[0], bootstrap_port, tuple(prefill), tuple(decode))


# -- helpers of the Router tests ---------------------------------------------------------


def admin_headers(router: Router) -> dict[str, str]:
    """The admin token header of a Router started without one (the token it generated)."""
    return _token_headers(router.proc.port)


PATHS = ("/v1/completions", "/v1/chat/completions")


def request_body(path: str, **extra: Any) -> dict[str, Any]:
    if path.endswith("/chat/completions"):
        return {"model": "fake-model", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8, **extra}
    return {"model": "fake-model", "prompt": "Hi", "max_tokens": 8, **extra}


def new_rid(tag: str) -> str:
    return f"test-{tag}-{uuid.uuid4().hex[:8]}"


def http_client(timeout: float = 20.0) -> httpx.Client:
    return httpx.Client(timeout=timeout, trust_env=False)


def records(port: int, rid: str) -> list[dict[str, Any]]:
    stats = httpx.get(f"http://{HOST}:{port}/stats", timeout=5, trust_env=False).json()
    return [r for r in stats["requests"] if r["request_id"] == rid]


def record(port: int, rid: str) -> dict[str, Any]:
    found = wait_until(lambda: records(port, rid), timeout=10)
    assert len(found) == 1, found
    return found[0]


def wait_state(port: int, rid: str, state: str, timeout: float = 10) -> dict[str, Any]:
    """Wait until the backend's record of request ``rid`` reaches ``state`` (e.g. disconnected)."""
    return wait_until(lambda: next((r for r in records(port, rid) if r["state"] == state), None), timeout)


def wait_none_open(port: int, rid: str, timeout: float = 10) -> list[dict[str, Any]]:
    """Wait until no request ``rid`` is still open on the backend (each one disconnected or completed).

    A backend request that was cancelled before it was sent leaves no record at all.
    """
    time.sleep(0.3)  # let requests already on the wire arrive
    return wait_until(lambda: all(r["state"] != "started" for r in records(port, rid)) and [1], timeout)


def sse_events(raw: bytes) -> list[str]:
    return [block[len("data: ") :] for block in raw.decode().split("\n\n") if block.startswith("data: ")]


def assert_openai_error(
    response: httpx.Response, status: int, error_type: str, param: str | None = None
) -> dict[str, Any]:
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    error = response.json()["error"]
    assert error["type"] == error_type
    assert error["code"] == status
    assert error["param"] == param
    assert error["message"]
    return error
