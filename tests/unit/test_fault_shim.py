"""The fault shims of the fault campaign (launch/fault_shim.py, launch/fault_shim_http.py) on loopback.

Real ZMQ PUSH -> proxy -> PULL sockets and a real HTTP upstream: each fault does what it says.
"""

from __future__ import annotations

import json
import random
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest
import zmq

from launch.fault_shim import FaultRates, FrameFault, ZmtpFaultProxy, encode_frame
from launch.fault_shim_http import BootstrapMode, BootstrapShim

RECV_MS = 3000


@pytest.fixture
def pull() -> Iterator[tuple[zmq.Socket, int]]:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PULL)
    sock.setsockopt(zmq.RCVTIMEO, RECV_MS)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    yield sock, port
    sock.close(linger=0)
    ctx.term()


@pytest.fixture
def proxy(pull: tuple[zmq.Socket, int]) -> Iterator[ZmtpFaultProxy]:
    shim = ZmtpFaultProxy(("127.0.0.1", pull[1]), random.Random(7)).start()
    yield shim
    shim.stop()


def send_all(port: int, messages: list[list[bytes]]) -> None:
    ctx = zmq.Context()
    push = ctx.socket(zmq.PUSH)
    push.connect(f"tcp://127.0.0.1:{port}")
    for message in messages:
        push.send_multipart(message)
    push.close(linger=RECV_MS)
    ctx.term()


def receive(sock: zmq.Socket, until_quiet_ms: int = 600) -> list[list[bytes]]:
    out = []
    sock.setsockopt(zmq.RCVTIMEO, RECV_MS)
    while True:
        try:
            out.append(sock.recv_multipart())
        except zmq.Again:
            return out
        sock.setsockopt(zmq.RCVTIMEO, until_quiet_ms)


def numbered(n: int) -> list[list[bytes]]:
    return [[f"m{i}".encode()] for i in range(n)]


def test_encode_frame_short_and_long() -> None:
    assert encode_frame(0x01, b"ab") == b"\x01\x02ab"
    long = encode_frame(0x00, b"x" * 300)
    assert long[0] == 0x02 and int.from_bytes(long[1:9], "big") == 300 and len(long) == 309


def test_rates_are_checked_and_drawn() -> None:
    with pytest.raises(ValueError, match="sum to at most 1"):
        FaultRates(drop=0.7, duplicate=0.7)
    assert FaultRates(truncate=1.0).draw(random.Random(1)) is FrameFault.TRUNCATE
    assert FaultRates().draw(random.Random(1)) is None


def test_no_faults_relays_every_message_in_order(proxy: ZmtpFaultProxy, pull: tuple[zmq.Socket, int]) -> None:
    messages = [*numbered(20), [b"head", b"x" * 1000]]  # a multipart one with a long frame
    send_all(proxy.port, messages)
    assert receive(pull[0]) == messages
    assert proxy.counts["passed"] == 21 and proxy.counts["connections"] == 1
    assert proxy.counts["commands"] >= 1  # ZMTP's READY went through untouched


def test_drop_sends_nothing_on(proxy: ZmtpFaultProxy, pull: tuple[zmq.Socket, int]) -> None:
    proxy.set_rates(FaultRates(drop=1.0))
    send_all(proxy.port, numbered(5))
    assert receive(pull[0]) == []
    assert proxy.counts["drop"] == 5


def test_duplicate_sends_each_twice(proxy: ZmtpFaultProxy, pull: tuple[zmq.Socket, int]) -> None:
    proxy.set_rates(FaultRates(duplicate=1.0))
    send_all(proxy.port, numbered(3))
    assert receive(pull[0]) == [[b"m0"], [b"m0"], [b"m1"], [b"m1"], [b"m2"], [b"m2"]]


def test_delay_stalls_the_connection(proxy: ZmtpFaultProxy, pull: tuple[zmq.Socket, int]) -> None:
    proxy.set_rates(FaultRates(delay=1.0, delay_s=0.3))
    t0 = time.monotonic()
    send_all(proxy.port, numbered(3))
    got = receive(pull[0])
    assert got == numbered(3)  # in order: later messages wait behind a delayed one
    assert time.monotonic() - t0 >= 0.9  # three stalls of 0.3 s each before the last one arrived
    assert proxy.counts["delay"] == 3


def test_reorder_lets_the_next_message_overtake(proxy: ZmtpFaultProxy, pull: tuple[zmq.Socket, int]) -> None:
    proxy.set_rates(FaultRates(reorder=1.0, hold_s=0.3))
    send_all(proxy.port, numbered(5))
    # m0 held, m1 overtakes it; m2 held, m3 overtakes; m4 held with nothing after it: sent on D's close
    assert receive(pull[0]) == [[b"m1"], [b"m0"], [b"m3"], [b"m2"], [b"m4"]]


def test_truncate_cuts_the_last_frame(proxy: ZmtpFaultProxy, pull: tuple[zmq.Socket, int]) -> None:
    proxy.set_rates(FaultRates(truncate=1.0))
    send_all(proxy.port, [[b"head", b"y" * 400], [b"z" * 50]])
    got = receive(pull[0])
    assert len(got) == 2
    assert got[0][0] == b"head" and len(got[0]) == 2 and len(got[0][1]) < 400 and set(got[0][1]) <= {ord("y")}
    assert len(got[1]) == 1 and len(got[1][0]) < 50


def test_rates_change_while_connected(proxy: ZmtpFaultProxy, pull: tuple[zmq.Socket, int]) -> None:
    ctx = zmq.Context()
    push = ctx.socket(zmq.PUSH)
    push.connect(f"tcp://127.0.0.1:{proxy.port}")
    push.send(b"a")
    assert receive(pull[0]) == [[b"a"]]
    proxy.set_rates(FaultRates(drop=1.0))
    push.send(b"b")
    assert receive(pull[0]) == []
    proxy.set_rates(FaultRates())
    push.send(b"c")
    assert receive(pull[0]) == [[b"c"]]
    push.close(linger=0)
    ctx.term()


# -- the bootstrap shim ------------------------------------------------------------------------------
class _Upstream(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    rank_port = 0

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002
        pass

    def do_GET(self) -> None:
        if self.path == "/bootstrap/route":
            body = json.dumps(
                {"is_ready": True, "ranks": {"0,0,0": {"rank_ip": "127.0.0.1", "rank_port": self.rank_port}}}
            )
        else:
            body = json.dumps({"status": "ok", "path": self.path})
        data = body.encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


@pytest.fixture
def shim(pull: tuple[zmq.Socket, int]) -> Iterator[BootstrapShim]:
    handler = type("Upstream", (_Upstream,), {"rank_port": pull[1]})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    front = BootstrapShim(("127.0.0.1", server.server_address[1]), random.Random(3))
    yield front
    front.stop()
    server.shutdown()
    server.server_close()


def get(shim: BootstrapShim, path: str, timeout: float = 5.0) -> httpx.Response:
    return httpx.get(f"http://127.0.0.1:{shim.port}{path}", timeout=timeout, trust_env=False)


def test_route_points_at_a_zmq_fault_proxy(shim: BootstrapShim, pull: tuple[zmq.Socket, int]) -> None:
    rank = get(shim, "/bootstrap/route").json()["ranks"]["0,0,0"]
    proxy = shim.zmq_proxies[0]
    assert (rank["rank_ip"], rank["rank_port"]) == ("127.0.0.1", proxy.port) != ("127.0.0.1", pull[1])
    assert get(shim, "/bootstrap/route").json()["ranks"]["0,0,0"]["rank_port"] == proxy.port  # one per rank
    shim.set_zmq_rates(FaultRates(duplicate=1.0))
    send_all(rank["rank_port"], [[b"via-route"]])
    assert receive(pull[0]) == [[b"via-route"], [b"via-route"]]
    assert get(shim, "/bootstrap/health").json() == {"status": "ok", "path": "/bootstrap/health"}


def test_refuse_with_reset(shim: BootstrapShim) -> None:
    shim.set_mode(BootstrapMode.REFUSE_RST)
    with pytest.raises(httpx.TransportError):
        get(shim, "/bootstrap/health")
    assert shim.counts["refuse_rst"] == 1


def test_refuse_with_503(shim: BootstrapShim) -> None:
    shim.set_mode(BootstrapMode.REFUSE_503)
    resp = get(shim, "/bootstrap/route")
    assert resp.status_code == 503 and "refused" in resp.json()["error"]


def test_slow_answers_late(shim: BootstrapShim) -> None:
    shim.set_mode(BootstrapMode.SLOW, slow_s=0.5)
    t0 = time.monotonic()
    assert get(shim, "/bootstrap/health").status_code == 200
    assert time.monotonic() - t0 >= 0.5
    with pytest.raises(httpx.ReadTimeout):
        get(shim, "/bootstrap/health", timeout=0.2)


def test_restart_refuses_while_down_then_listens_on_the_same_port(shim: BootstrapShim) -> None:
    port = shim.port
    down = threading.Thread(target=shim.restart, args=(0.6,))
    down.start()
    time.sleep(0.2)
    with pytest.raises(httpx.ConnectError):
        get(shim, "/bootstrap/health")
    down.join()
    assert shim.port == port and get(shim, "/bootstrap/health").status_code == 200


def test_upstream_down_is_a_reset(shim: BootstrapShim) -> None:
    shim.upstream = ("127.0.0.1", 1)  # nothing listens on port 1
    with pytest.raises(httpx.TransportError):
        get(shim, "/bootstrap/health")
    assert shim.counts["upstream_down"] == 1
