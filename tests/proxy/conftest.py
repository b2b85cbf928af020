"""Fixtures for the Router tests: real ``python -m proxy`` processes in front of fake backends.

Every process is started with ``subprocess.Popen`` on a free loopback port, waited for
with a deadline, and stopped by its pid in a finalizer whether the tests pass or fail.
"""

from __future__ import annotations

import json
import signal
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from tests.support.router_rig import (
    BACKEND_SPECS,
    FAKE_BACKEND,
    TEST_TIMEOUT_S,
    Backends,
    Proc,
    Router,
    RouterFactory,
    free_port,
    start_router,
)


@pytest.fixture(scope="session")
def proc_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("proxy-procs")


@pytest.fixture(scope="session")
def backends(proc_dir: Path) -> Iterator[Backends]:
    """Start every fake backend (one process, one port each) and stop them at the end."""
    ports = {name: free_port() for name in BACKEND_SPECS}
    specs = [{"port": ports[name], **spec} for name, spec in BACKEND_SPECS.items()]
    args = [sys.executable, str(FAKE_BACKEND), "--specs", json.dumps(specs)]
    proc = Proc("fake backends", ports["ok_p"], args, proc_dir / "backends.log").start()
    try:
        for port in ports.values():
            Proc(f"fake backend {port}", port, [], proc.log_path, proc.popen).wait_listening()
        yield Backends(**ports, down=free_port())
    finally:
        proc.stop()


@pytest.fixture(scope="session")
def router_factory(proc_dir: Path) -> Iterator[RouterFactory]:
    """``make(prefill, decode, *extra_flags)``: a Router (cached per configuration).

    ``prefill`` and ``decode`` are a port or a sequence of ports.
    """
    routers: dict[tuple[Any, ...], Router] = {}

    def make(prefill: int | Sequence[int], decode: int | Sequence[int], *extra: str) -> Router:
        prefill_ports = (prefill,) if isinstance(prefill, int) else tuple(prefill)
        decode_ports = (decode,) if isinstance(decode, int) else tuple(decode)
        key = (prefill_ports, decode_ports, extra)
        if key not in routers:
            routers[key] = start_router(proc_dir, prefill_ports, decode_ports, *extra)
        return routers[key]

    try:
        yield make
    finally:
        for router in routers.values():
            router.proc.stop()


@pytest.fixture(scope="session")
def router_ok(backends: Backends, router_factory: RouterFactory) -> Router:
    """A Router in front of one healthy prefiller and one healthy decoder (the test_router_* modules share it)."""
    return router_factory(backends.ok_p, backends.ok_d)


@pytest.fixture
def fresh_router(proc_dir: Path) -> Iterator[RouterFactory]:
    """``make(prefill, decode, *extra_flags)``: a new Router process, stopped when the test ends."""
    started: list[Router] = []

    def make(prefill: int | Sequence[int], decode: int | Sequence[int], *extra: str) -> Router:
        prefill_ports = (prefill,) if isinstance(prefill, int) else tuple(prefill)
        decode_ports = (decode,) if isinstance(decode, int) else tuple(decode)
        started.append(start_router(proc_dir, prefill_ports, decode_ports, *extra))
        return started[-1]

    try:
        yield make
    finally:
        for router in started:
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
