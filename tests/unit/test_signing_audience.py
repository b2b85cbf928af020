"""Signatures name their audience: two prefill deployments share one token, and a call or frame captured
on its way to one is refused by the other (and by the first when replayed).

Bootstrap calls are signed for the server id the server tells in ``/bootstrap/health``
(``bootstrap.signing``, ``bootstrap.audience``); ZMQ frames for the receiver's endpoint
(``transfer.frames``). Real bootstrap servers and ZMQ channels on loopback ports."""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import struct
import time
from collections.abc import Iterator

import httpx
import msgspec
import pytest

from pd_connector import messages as proto
from pd_connector.bootstrap.audience import SERVER_IDS
from pd_connector.bootstrap.client import RouteCache, register_dp_rank, register_rank
from pd_connector.bootstrap.server import BootstrapServer, BootstrapState
from pd_connector.bootstrap.signing import SCHEME, signed_headers
from pd_connector.keys import bootstrap_key, frame_key
from pd_connector.messages import RankInfo, RegisterRank
from pd_connector.transfer.channel import Channel
from pd_connector.transfer.frames import FrameOpener, FrameRefused, FrameSealer
from pd_connector.transfer.liveness import PeerWatch
from pd_connector.transfer.stats import TransferStats
from tests.support.loopback import HOST, free_port, push_raw, wait_for

TOKEN = b"one-token-for-every-p-and-d-0123456789"
REGISTER = "/bootstrap/register_rank"


class Clock:
    """The servers' clock: the real one plus ``ahead`` seconds (a replay 'later' without waiting)."""

    def __init__(self) -> None:
        self.ahead = 0.0

    def __call__(self) -> float:
        return time.time() + self.ahead


class Deployment:
    """One prefill deployment's bootstrap server (tp=1, dp=1), its dp0/tp0 rank registered at ``rank_port``."""

    def __init__(self, clock: Clock) -> None:
        self.server = BootstrapServer(
            BootstrapState(attn_tp_size=1, attn_dp_size=1), HOST, free_port(), TOKEN, clock=clock
        )
        self.server.start()
        self.addr = f"{HOST}:{self.server.port}"
        self.rank_port = free_port()
        assert register_rank(self.addr, self.rank(), retries=1, interval_s=0.01, timeout_s=5, token=TOKEN)

    def rank(self) -> RegisterRank:
        return RegisterRank(1, 0, 1, 0, HOST, self.rank_port, 16, "float16", num_layers=2)

    def send(self, method: str, path: str, body: bytes, headers: dict[str, str]) -> httpx.Response:
        return httpx.request(
            method, f"http://{self.addr}{path}", content=body, headers=headers, timeout=5, trust_env=False
        )


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def pair(clock: Clock) -> Iterator[tuple[Deployment, Deployment]]:
    made: list[Deployment] = []
    try:
        made += [Deployment(clock), Deployment(clock)]
        yield made[0], made[1]
    finally:
        for deployment in made:
            deployment.server.stop()


def test_a_call_captured_for_one_deployment_is_refused_by_another_and_by_its_own_later(
    pair: tuple[Deployment, Deployment], clock: Clock, caplog: pytest.LogCaptureFixture
) -> None:
    a, b = pair
    assert a.server.server_id != b.server.server_id
    b_route = b.server.state.route()
    assert b_route.rank(0, 0, 0) == RankInfo(HOST, b.rank_port)
    # A's rank registers again (a restart on a new port): the call on the wire, captured.
    moved = msgspec.structs.replace(a.rank(), rank_port=free_port())
    body = msgspec.json.encode(moved)
    captured = {
        "content-type": "application/json",
        **signed_headers(TOKEN, "PUT", REGISTER, body, audience=a.server.server_id),
    }
    assert a.send("PUT", REGISTER, body, captured).status_code == 200
    with caplog.at_level(logging.WARNING, logger="pd_connector"):
        sent_to_b = b.send("PUT", REGISTER, body, captured)
    assert sent_to_b.status_code == 401 and sent_to_b.json()["reason"] == "audience"
    assert a.server.server_id in sent_to_b.text and b.server.server_id in sent_to_b.text
    assert b.server.state.route() == b_route and b.server.state.refused == 1  # B's ranks still route to B's rank
    assert "signed for bootstrap server" in caplog.text
    for later_s in (1.0, 10.0):  # replayed to A itself, 1 s and 10 s after it was accepted
        clock.ahead = later_s
        again = a.send("PUT", REGISTER, body, captured)
        assert again.status_code == 401 and again.json()["reason"] == "replay", again.text
        again_b = b.send("PUT", REGISTER, body, captured)
        assert again_b.status_code == 401 and again_b.json()["reason"] == "audience"
    assert a.server.state.route().rank(0, 0, 0) == RankInfo(HOST, moved.rank_port)
    assert b.server.state.route() == b_route and b.server.state.refused == 3
    # A read (GET /bootstrap/route) is bound the same way.
    read = signed_headers(TOKEN, "GET", "/bootstrap/route", audience=a.server.server_id)
    assert b.send("GET", "/bootstrap/route", b"", read).json()["reason"] == "audience"


def test_clients_sign_for_the_server_they_call_and_follow_its_restart(clock: Clock) -> None:
    a = Deployment(clock)
    port = a.server.port
    routes = RouteCache(5, token=TOKEN)
    try:
        assert routes.get(a.addr).rank(0, 0, 0) == RankInfo(HOST, a.rank_port)
        old_id = a.server.server_id
        a.server.stop()
        a.server = BootstrapServer(BootstrapState(attn_tp_size=1, attn_dp_size=1), HOST, port, TOKEN, clock=clock)
        a.server.start()
        assert a.server.server_id != old_id
        # P's rank re-registers and D reads the route: both still hold the old id, are refused once, read the
        # new id and sign again.
        assert SERVER_IDS.of(f"http://{a.addr}", _never_sent, 5) == old_id  # kept: no health call per call
        assert register_rank(a.addr, a.rank(), retries=1, interval_s=0.01, timeout_s=5, token=TOKEN)
        routes.invalidate(a.addr)
        assert routes.get(a.addr).rank(0, 0, 0) == RankInfo(HOST, a.rank_port)
        assert a.server.state.refused == 1  # only the first call, signed for the old id
    finally:
        a.server.stop()


def _never_sent(method: str, url: str, **kwargs: object) -> httpx.Response:
    raise AssertionError(f"{method} {url} sent: the server id should have been kept")


def test_an_older_signature_or_server_is_refused_naming_the_version(
    pair: tuple[Deployment, Deployment], caplog: pytest.LogCaptureFixture
) -> None:
    a, _ = pair
    # How a release before call signature v3 signed: no version, no audience.
    ts, nonce = int(time.time()), os.urandom(16).hex()
    text = b"\n".join(
        [
            b"pd-connector bootstrap call v2",
            b"GET",
            b"/bootstrap/route",
            hashlib.sha256(b"").hexdigest().encode(),
            str(ts).encode(),
            nonce.encode(),
        ]
    )
    sig = hmac.new(bootstrap_key(TOKEN) or b"", text, hashlib.sha256).hexdigest()
    old = a.send("GET", "/bootstrap/route", b"", {"Authorization": f"{SCHEME} ts={ts},nonce={nonce},sig={sig}"})
    assert old.status_code == 401 and old.json()["reason"] == "version"
    assert "version 2" in old.text and "version 3" in old.text
    # A server of that release tells no server id: the client says so, and sends nothing signed.
    seen: list[str] = []

    def old_server(request: httpx.Request) -> httpx.Response:
        seen.append(f"{request.method} {request.url.path}")
        return httpx.Response(200, json={"status": "ok", "is_ready": True})

    with httpx.Client(transport=httpx.MockTransport(old_server)) as client, caplog.at_level(logging.ERROR):
        assert not register_dp_rank("old-release:8998", 7, 0, 5, TOKEN, client=client)
    assert seen == ["GET /bootstrap/health"] and "older than call signature version 3" in caplog.text


# ------------------------------------------------------------------ frames


class Rank:
    """One rank's ZMQ channel (token shared by every deployment), recording the messages it accepts."""

    def __init__(self) -> None:
        self.messages: list[proto.Message] = []
        self.stats = TransferStats("test")
        self.channel = Channel(HOST, self.stats, self.messages.append, lambda now: None, TOKEN, PeerWatch(5.0))
        self.channel.start()


@pytest.fixture
def ranks() -> Iterator[list[Rank]]:
    made: list[Rank] = []
    yield made
    for rank in made:
        rank.channel.close()


def test_a_frame_for_one_rank_is_refused_by_other_deployments_and_ranks(
    ranks: list[Rank], caplog: pytest.LogCaptureFixture
) -> None:
    x_of_a, y_of_b, z_of_a = Rank(), Rank(), Rank()  # rank X of deployment A, rank Y of B, another rank of A
    ranks += [x_of_a, y_of_b, z_of_a]
    d = FrameSealer(frame_key(TOKEN), f"tcp://{HOST}:{free_port()}")  # a D rank's session
    captured = d.seal(x_of_a.channel.endpoint, proto.encode(proto.TransferCancel(41, "req-41", "d0")))
    with caplog.at_level(logging.WARNING, logger="pd_connector"):
        push_raw(y_of_b.channel.endpoint, captured)
        push_raw(z_of_a.channel.endpoint, captured)
        wait_for(lambda: y_of_b.stats.snapshot().auth_refused == 1, 5, what="B's rank refusing")
        wait_for(lambda: z_of_a.stats.snapshot().auth_refused == 1, 5, what="A's other rank refusing")
        # A rank counts a refusal, then writes its line (on its listener thread): wait for both lines.
        wait_for(lambda: caplog.text.count("addressed to") == 2, 5, what="both refusals logged")
    assert y_of_b.messages == [] and z_of_a.messages == []
    assert "room=41 request_id=req-41" in caplog.text  # its MAC matched: the log line names the request
    push_raw(x_of_a.channel.endpoint, captured, captured)  # where it was meant for: once
    wait_for(lambda: x_of_a.stats.snapshot().auth_refused == 1, 5, what="the replay refused")
    assert [type(m) for m in x_of_a.messages] == [proto.TransferCancel]


def test_a_frame_of_an_older_envelope_is_refused_naming_the_version() -> None:
    key, me = frame_key(TOKEN), "tcp://127.0.0.1:7001"
    assert key is not None

    def text(value: str) -> bytes:
        return struct.pack(">H", len(value)) + value.encode()

    # How a release before envelope v3 framed: version byte 2, MAC over the body alone.
    body = struct.pack(">B16sQQ", 2, os.urandom(16), 1, int(time.time() * 1000)) + text("tcp://127.0.0.1:7002")
    body += text(me) + b"payload"
    with pytest.raises(FrameRefused) as err:
        FrameOpener(key, me).open(hmac.new(key, body, hashlib.sha256).digest() + body)
    assert err.value.reason == "version" and "version 2" in str(err.value) and "version 3" in str(err.value)
