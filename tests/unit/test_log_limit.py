"""LogLimiter (pd_connector/log_limit.py) and the refusal lines that use it: a flood of bad
bootstrap calls or bad ZMQ frames writes a bounded number of lines, and every one is counted."""

from __future__ import annotations

import logging

import httpx
import pytest
import zmq

from pd_connector.bootstrap.server import BootstrapServer, BootstrapState
from pd_connector.log_limit import LogLimiter
from tests.support.loopback import HOST, free_port, wait_for
from tests.support.transfer_rig import Rig

FLOOD = 40


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _limiter(caplog: pytest.LogCaptureFixture, **kw: object) -> tuple[LogLimiter, Clock]:
    log = logging.getLogger("test.log_limit")
    caplog.set_level(logging.INFO, logger="test.log_limit")
    clock = Clock()
    return LogLimiter(log, clock=clock, **kw), clock  # type: ignore[arg-type]


def _lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "test.log_limit"]


def test_a_burst_per_key_then_the_held_back_count_on_the_next_window(caplog: pytest.LogCaptureFixture) -> None:
    limiter, clock = _limiter(caplog, interval_s=10.0, burst=3)
    written = [limiter.warning(("token", "10.0.0.7"), "refused call %d from %s", i, "10.0.0.7") for i in range(8)]
    assert written == [True, True, True, False, False, False, False, False]
    assert limiter.warning(("token", "10.0.0.8"), "refused call from %s", "10.0.0.8")  # another source: its own
    clock.now += 9.9
    assert not limiter.warning(("token", "10.0.0.7"), "refused again")
    clock.now += 0.1  # the window is over
    assert limiter.warning(("token", "10.0.0.7"), "refused call %d", 99)
    lines = _lines(caplog)
    assert lines[:3] == [f"refused call {i} from 10.0.0.7" for i in range(3)]
    assert lines[3] == "refused call from 10.0.0.8"
    assert lines[4] == "refused call 99 (6 similar line(s) suppressed before this one: at most 3 per 10 s)"
    assert len(lines) == 5
    assert all(r.levelno == logging.WARNING for r in caplog.records if r.name == "test.log_limit")


def test_keys_are_bounded_and_expired_ones_are_forgotten(caplog: pytest.LogCaptureFixture) -> None:
    limiter, clock = _limiter(caplog, interval_s=5.0, burst=1, max_keys=2)
    assert limiter.warning("a", "a") and limiter.warning("b", "b")
    assert limiter.warning("c", "c first")  # table full of live keys: c goes to the shared overflow key
    assert not limiter.warning("d", "d first")  # ... which has used its line
    clock.now += 5.0
    assert limiter.log(logging.INFO, "e", "e after expiry")  # a and b expired: e gets a key of its own
    assert len(limiter._windows) <= 3  # 2 keys + the overflow key, never more
    assert _lines(caplog) == ["a", "b", "c first", "e after expiry"]


@pytest.mark.parametrize("kw", [{"interval_s": -1.0}, {"burst": 0}, {"max_keys": 0}])
def test_bad_settings_are_refused_by_name(kw: dict[str, float]) -> None:
    with pytest.raises(ValueError, match="LogLimiter needs"):
        LogLimiter(logging.getLogger("x"), **kw)  # type: ignore[arg-type]


def test_a_flood_of_unauthenticated_bootstrap_calls_writes_a_few_lines(pd_logs: pytest.LogCaptureFixture) -> None:
    server = BootstrapServer(BootstrapState(attn_tp_size=1, attn_dp_size=1), HOST, free_port(), b"t" * 32)
    server.start()
    try:
        with httpx.Client(trust_env=False, timeout=5) as client:
            for _ in range(FLOOD):
                assert client.get(f"http://{HOST}:{server.port}/bootstrap/route").status_code == 401
            for _ in range(3):  # another route: a key of its own, so its first lines show
                assert client.put(f"http://{HOST}:{server.port}/bootstrap/register_rank").status_code == 401
        assert server.state.refused == FLOOD + 3
    finally:
        server.stop()
    lines = [r.getMessage() for r in pd_logs.records if "missing or malformed call signature" in r.getMessage()]
    assert sum("GET /bootstrap/route" in line for line in lines) == 10  # the default burst
    assert sum("PUT /bootstrap/register_rank" in line for line in lines) == 3


def test_a_flood_of_garbage_frames_writes_a_few_lines_and_counts_all(
    rig: Rig, pd_logs: pytest.LogCaptureFixture
) -> None:
    d = rig.make("decode")
    ctx = zmq.Context()
    try:
        sock = ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(d.mgr.endpoint)
        for i in range(FLOOD):
            sock.send(b"\x00garbage %d" % i)
        wait_for(lambda: d.stats().bad_frames == FLOOD, timeout=10, what="every garbage frame counted")
        sock.close(linger=0)
    finally:
        ctx.term()
    lines = [r for r in pd_logs.records if "dropping malformed ZMQ frame" in r.getMessage()]
    assert len(lines) == 10 and d.mgr.channel.listening
