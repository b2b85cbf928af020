"""Shared helpers for the unit tests: free loopback ports, log capture, polling, and the fixtures
of the transfer-manager rig (tests/unit/transfer_rig.py): backends, bootstrap server, managers."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest

from pd_connector.bootstrap.server import BootstrapServer
from tests.support.loopback import HOST, free_port, wait_for
from tests.support.transfer_rig import Engines, Rig, start_bootstrap

__all__ = ["HOST", "free_port", "wait_for"]  # re-exported: tests import them from here


@pytest.fixture
def pd_logs(caplog: pytest.LogCaptureFixture) -> Iterator[pytest.LogCaptureFixture]:
    """caplog that also sees the `pd_connector` loggers (they do not propagate to root)."""
    log = logging.getLogger("pd_connector")
    old_level = log.level
    log.addHandler(caplog.handler)
    log.setLevel(logging.DEBUG)
    caplog.handler.setLevel(logging.DEBUG)
    try:
        yield caplog
    finally:
        log.removeHandler(caplog.handler)
        log.setLevel(old_level)


# ------------------------------------------------------------ transfer-manager rig


@pytest.fixture(scope="module")
def backend_pool() -> Iterator[dict[str, Engines]]:
    """Backends by name, opened on first use and closed at the end of the module."""
    pool: dict[str, Engines] = {}
    try:
        yield pool
    finally:
        for e in pool.values():
            e.close()


@pytest.fixture
def backend_name() -> str:
    """The backend a test's managers use; tests parametrize it to run on Mooncake too."""
    return "inproc"


@pytest.fixture
def engines(backend_pool: dict[str, Engines], backend_name: str) -> Engines:
    """The shared P and D backends of `backend_name`, opened once per module."""
    if backend_name not in backend_pool:
        backend_pool[backend_name] = Engines(backend_name)
    return backend_pool[backend_name]


@pytest.fixture(scope="module")
def bootstrap() -> Iterator[BootstrapServer]:
    """One bootstrap server per module; each test registers its own P rank on it."""
    server = start_bootstrap()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def rig(bootstrap: BootstrapServer, engines: Engines) -> Iterator[Rig]:
    """Managers on the module's bootstrap server; every one is closed after the test."""
    r = Rig(bootstrap, engines)
    try:
        yield r
    finally:
        r.close()


@pytest.fixture
def fresh_rig(engines: Engines) -> Iterator[Rig]:
    """A rig with its own, empty bootstrap server."""
    server = start_bootstrap()
    r = Rig(server, engines)
    try:
        yield r
    finally:
        r.close()
        server.stop()
