"""Fixtures for the Router tests: real ``python -m proxy`` processes in front of fake backends.

Every process is started with ``subprocess.Popen`` on a free loopback port, waited for
with a deadline, and stopped by its pid in a finalizer whether the tests pass or fail.
"""

from __future__ import annotations

import signal
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from proxy_testlib import (
    BACKEND_MODES,
    FAKE_BACKEND,
    HOST,
    REPO_ROOT,
    TEST_TIMEOUT_S,
    Backends,
    Proc,
    Router,
    RouterFactory,
    free_port,
)

# In-process tests import the `proxy` package from this checkout, installed or not.
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))


@pytest.fixture(scope="session")
def proc_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("proxy-procs")


@pytest.fixture(scope="session")
def backends(proc_dir: Path) -> Iterator[Backends]:
    """Start every fake backend at once (they start in parallel) and stop them at the end."""
    procs: dict[str, Proc] = {}
    try:
        for name, mode_args in BACKEND_MODES.items():
            port = free_port()
            args = [sys.executable, str(FAKE_BACKEND), "--port", str(port), *mode_args]
            procs[name] = Proc(f"fake backend {name}", port, args, proc_dir / f"backend-{name}.log").start()
        for proc in procs.values():
            proc.wait_listening()
        yield Backends(**{name: proc.port for name, proc in procs.items()}, down=free_port())
    finally:
        for proc in procs.values():
            proc.stop()


@pytest.fixture(scope="session")
def router_factory(proc_dir: Path) -> Iterator[RouterFactory]:
    """``make(prefill_port, decode_port, *extra_flags)``: a Router (cached per configuration)."""
    routers: dict[tuple[Any, ...], Router] = {}

    def make(prefill_port: int, decode_port: int, *extra: str) -> Router:
        key = (prefill_port, decode_port, extra)
        if key not in routers:
            port = free_port()
            bootstrap_port = free_port()
            args = [
                sys.executable,
                "-m",
                "proxy",
                "--host",
                HOST,
                "--port",
                str(port),
                "--prefiller-hosts",
                HOST,
                "--prefiller-ports",
                str(prefill_port),
                "--prefiller-bootstrap-ports",
                str(bootstrap_port),
                "--decoder-hosts",
                HOST,
                "--decoder-ports",
                str(decode_port),
                "--connect-timeout",
                "2",
                "--log-level",
                "DEBUG",
                *extra,
            ]
            proc = Proc(f"router {port}", port, args, proc_dir / f"router-{port}.log").start()
            routers[key] = Router(proc, prefill_port, decode_port, bootstrap_port)
            try:
                proc.wait_listening()
            except BaseException:
                proc.stop()
                raise
        return routers[key]

    try:
        yield make
    finally:
        for router in routers.values():
            router.proc.stop()


class _TestTimeout(Exception):
    pass


@pytest.fixture(autouse=True)
def _per_test_timeout() -> Iterator[None]:
    """Fail a test whose body runs longer than TEST_TIMEOUT_S (no plugin needed)."""

    def expire(signum: int, frame: Any) -> None:
        raise _TestTimeout(f"test exceeded {TEST_TIMEOUT_S}s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(TEST_TIMEOUT_S)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
