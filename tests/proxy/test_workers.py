"""``--workers N``: N Router processes on one port (proxy/server/workers.py), real processes on loopback."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from proxy.cli import parse_config
from proxy.server import workers as workers_module
from proxy.server.workers import Supervisor, SupervisorState
from tests.support.router_rig import (
    HOST,
    REPO_ROOT,
    Backends,
    Router,
    admin_headers,
    request_body,
    start_router,
    wait_until,
)


def _listening_sockets(port: int) -> int:
    """How many TCP sockets listen on ``port`` (``/proc/net/tcp``, state 0A)."""
    count = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        if not os.path.exists(table):
            continue
        with open(table) as f:
            for line in f.readlines()[1:]:
                fields = line.split()
                if int(fields[1].rsplit(":", 1)[1], 16) == port and fields[3] == "0A":
                    count += 1
    return count


def _health(router: Router) -> dict[str, Any]:
    """``GET /health`` on a new connection (so the kernel may pick another worker)."""
    with httpx.Client(timeout=10, trust_env=False) as client:
        return client.get(f"{router.url}/health", headers={"Connection": "close", **admin_headers(router)}).json()


def _seen_workers(router: Router, want: int) -> dict[int, dict[str, Any]]:
    """The ``/health`` body of each worker, by index, once every one of ``want`` answered."""
    seen: dict[int, dict[str, Any]] = {}

    def all_seen() -> bool:
        body = _health(router)
        seen[body["worker"]["index"]] = body
        return len(seen) == want

    wait_until(all_seen, timeout=20, interval=0.01)
    return seen


@pytest.fixture(scope="module")
def two_workers(proc_dir: Path, backends: Backends) -> Iterator[Router]:
    router = start_router(proc_dir, [backends.ok_p], [backends.ok_d, backends.down], "--workers", "2")
    try:
        yield router
    finally:
        router.proc.stop()


def test_workers_share_one_port_and_each_serves(two_workers: Router) -> None:
    router = two_workers
    assert wait_until(lambda: _listening_sockets(router.proc.port) == 2, timeout=10)
    seen = _seen_workers(router, 2)
    assert {body["worker"]["count"] for body in seen.values()} == {2}
    pids = {body["worker"]["pid"] for body in seen.values()}
    assert len(pids) == 2 and router.proc.popen is not None and router.proc.popen.pid not in pids
    # Completions through new connections reach both workers; every one streams to [DONE].
    for _ in range(20):
        with httpx.Client(timeout=20, trust_env=False) as client:
            body = request_body("/v1/completions", stream=True)
            response = client.post(f"{router.url}/v1/completions", json=body, headers={"Connection": "close"})
        assert response.status_code == 200, response.text
        assert response.text.rstrip().endswith("data: [DONE]")
    log = router.proc.log_text()
    assert "proxy[w0]: rid=" in log and "proxy[w1]: rid=" in log, log[-3000:]


def test_health_is_the_same_in_every_worker(two_workers: Router) -> None:
    # Each worker checks the backends itself: both see the down decoder as unhealthy, the other healthy.
    for body in _seen_workers(two_workers, 2).values():
        decoders = {d["port"]: d["healthy"] for d in body["decoders"]}
        assert decoders == {two_workers.decode_ports[0]: True, two_workers.decode_ports[1]: False}, body
        assert [p["healthy"] for p in body["prefillers"]] == [True]
        assert body["status"] == "healthy"


@pytest.mark.parametrize("path", ["/instances/add", "/instances/remove"])
def test_membership_changes_are_refused_with_several_workers(two_workers: Router, path: str) -> None:
    instances = {"instances": [{"role": "decode", "host": HOST, "port": two_workers.decode_port}]}
    admin = admin_headers(two_workers)
    response = httpx.post(f"{two_workers.url}{path}", json=instances, headers=admin, timeout=10, trust_env=False)
    assert response.status_code == 409, response.text
    message = response.json()["error"]["message"]
    assert path in message and "--workers 2" in message and "--workers 1" in message
    # Listing still answers (the worker that took the connection).
    listing = httpx.get(f"{two_workers.url}/instances", headers=admin, timeout=10, trust_env=False)
    assert listing.status_code == 200
    assert [d["port"] for d in listing.json()["decoders"]] == list(two_workers.decode_ports)


def test_sigterm_to_the_supervisor_stops_every_worker(proc_dir: Path, backends: Backends) -> None:
    router = start_router(proc_dir, [backends.ok_p], [backends.ok_d], "--workers", "2")
    try:
        pids = {body["worker"]["pid"] for body in _seen_workers(router, 2).values()}
        assert router.proc.popen is not None
        router.proc.popen.send_signal(signal.SIGTERM)
        assert router.proc.popen.wait(timeout=20) == 0
        for pid in pids:
            assert wait_until(lambda pid=pid: not os.path.exists(f"/proc/{pid}"), timeout=10)
        assert _listening_sockets(router.proc.port) == 0
    finally:
        router.proc.stop()


def test_a_port_in_use_is_a_clear_error(backends: Backends) -> None:
    with socket.socket() as busy:
        busy.bind((HOST, 0))
        busy.listen()
        port = busy.getsockname()[1]
        args = ["--host", HOST, "--port", str(port), "--prefiller-hosts", HOST, "--prefiller-ports", str(backends.ok_p)]
        args += ["--decoder-hosts", HOST, "--decoder-ports", str(backends.ok_d), "--workers", "2"]
        result = subprocess.run(
            [sys.executable, "-m", "proxy", *args], cwd=REPO_ROOT, capture_output=True, text=True, timeout=30
        )
    assert result.returncode == 1
    assert f"cannot listen on {HOST}:{port}" in result.stderr, result.stderr


def test_workers_flag() -> None:
    base = ["--prefiller-hosts", "p", "--prefiller-ports", "1", "--decoder-hosts", "d", "--decoder-ports", "2"]
    assert parse_config(base).workers == 1
    assert parse_config([*base, "--workers", "4"]).workers == 4


# -- the supervisor's decisions, with fork and waitpid replaced -------------------------------


class _FakeProcesses:
    """fork() hands out pids; waitpid() reports the exits queued in ``exits``."""

    def __init__(self) -> None:
        self.next_pid = 1000
        self.exits: list[tuple[int, int]] = []
        self.killed: list[tuple[int, int]] = []

    def fork(self) -> int:
        self.next_pid += 1
        return self.next_pid

    def waitpid(self, pid: int, options: int) -> tuple[int, int]:
        return self.exits.pop(0) if self.exits else (0, 0)

    def kill(self, pid: int, sig: int) -> None:
        self.killed.append((pid, sig))


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> _FakeProcesses:
    fake = _FakeProcesses()
    monkeypatch.setattr(workers_module.os, "waitpid", fake.waitpid)
    monkeypatch.setattr(workers_module.os, "kill", fake.kill)
    return fake


def _supervisor(fake: _FakeProcesses, count: int = 2) -> Supervisor:
    supervisor = Supervisor(count, socket.socket(), fork=fake.fork)
    for index in range(count):
        assert not supervisor._spawn(index)
    return supervisor


def test_a_worker_that_dies_later_is_forked_again(fake: _FakeProcesses) -> None:
    supervisor = _supervisor(fake)
    old = {pid: (index, started - 60.0) for pid, (index, started) in supervisor.workers.items()}
    supervisor.workers = old
    dead = min(old)
    fake.exits = [(dead, 9)]  # killed by SIGKILL
    supervisor._reap()
    assert supervisor.state is SupervisorState.RUNNING
    assert dead not in supervisor.workers
    assert sorted(index for index, _ in supervisor.workers.values()) == [0, 1]  # index 0 again, a new pid


def test_a_worker_that_dies_at_start_stops_the_router(fake: _FakeProcesses) -> None:
    supervisor = _supervisor(fake)
    first = min(supervisor.workers)
    fake.exits = [(first, 1 << 8)]  # exit code 1 right after its start
    supervisor._reap()
    assert supervisor.state is SupervisorState.FAILED
    assert list(supervisor.workers) == [first + 1]
    # The supervisor then stops the other worker and exits 1.
    fake.exits = [(0, 0)] * 10 + [(first + 1, 0)]
    started = time.monotonic()
    assert supervisor._supervise() == 1
    assert (first + 1, signal.SIGTERM) in fake.killed
    assert time.monotonic() - started < 5
