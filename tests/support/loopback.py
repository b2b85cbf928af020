"""Loopback helpers for the unit tests: the host, free ports, polling, raw ZMQ frames."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest
import zmq

from launch.ports import free_port as launch_free_port

HOST = "127.0.0.1"


def free_port() -> int:
    """A loopback TCP port that was free a moment ago, outside the ephemeral range (launch.ports)."""
    return launch_free_port()


def wait_for(predicate: Callable[[], Any], timeout: float = 10.0, interval: float = 0.01, what: str = "") -> Any:
    """Poll `predicate` until it returns something truthy; fail the test after `timeout` s."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout} s waiting for {what or predicate}")
        time.sleep(interval)


def push_raw(endpoint: str, *frames: bytes) -> None:
    """Send ``frames`` as they are to a PULL socket at ``endpoint`` (a peer that skips the Channel)."""
    ctx = zmq.Context()
    try:
        sock = ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 2000)
        sock.connect(endpoint)
        for frame in frames:
            sock.send(frame)
        sock.close()
    finally:
        ctx.term()
