"""Fixtures of the unit tests: log capture, a TLS certificate, the fake-scheduler pair, and the
transfer-manager rig (tests/support/transfer_rig.py): backends, bootstrap server, managers.

Helpers that tests import live in tests/support; nothing imports this module."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest

from pd_connector.bootstrap.server import BootstrapServer
from pd_connector.config import parse_config
from pd_connector.scheduler import PDScheduler
from tests.support.fake_scheduler import BS
from tests.support.key_files import self_signed
from tests.support.transfer_rig import Engines, Rig, start_bootstrap


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


@pytest.fixture(scope="module")
def cert(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    """A self-signed certificate for 127.0.0.1 / localhost and its key (PEM files): ``(certfile, keyfile)``."""
    cert_path, key_path = self_signed(tmp_path_factory.mktemp("tls"), "bootstrap")
    return str(cert_path), str(key_path)


@pytest.fixture
def dsched() -> PDScheduler:
    """A decode-side PDScheduler (tests/support/fake_scheduler.py fakes vLLM's requests and blocks)."""
    return PDScheduler(parse_config("kv_consumer", {}), block_size=BS)


@pytest.fixture
def psched() -> PDScheduler:
    """A prefill-side PDScheduler."""
    return PDScheduler(parse_config("kv_producer", {}), block_size=BS)


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
