"""What Mooncake's transfer engine listens on, as `MooncakeBackend.open` logs it (docs/security.md).

This Mooncake version binds every interface whatever `local_ip`: the RPC/handshake port on 0.0.0.0 and
the TCP data port on [::]. If a release starts binding `local_ip`, this test fails: then docs/security.md,
the examples' port tables and tests/e2e/test_listeners.py's allowance should shrink with it.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from tests.support.netns import mooncake_listeners

pytest.importorskip("mooncake.engine")


def test_open_logs_the_wildcard_listeners_it_made(caplog: pytest.LogCaptureFixture, tmp_path: Path) -> None:
    from pd_connector.transfer.mooncake import MooncakeBackend, own_listeners

    before = own_listeners()
    with caplog.at_level(logging.WARNING):
        backend = MooncakeBackend.open("127.0.0.1", "tcp")
    try:
        made = own_listeners() - before
        log = tmp_path / "log"
        log.write_text(caplog.text)
        logged = mooncake_listeners(log)
        assert logged == made and len(made) == 2, (logged, made)
        rpc_port = int(backend.session.rsplit(":", 1)[1])
        assert ("0.0.0.0", rpc_port) in made  # the session's port, on every interface
        assert all(host in ("0.0.0.0", "::") and 15000 <= port <= 17000 for host, port in made), made
    finally:
        backend.close()
