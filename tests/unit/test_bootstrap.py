"""Bootstrap server (real uvicorn in a thread) and its HTTP client."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from typing import Any

import httpx
import msgspec
import pytest

from pd_connector.bootstrap import client as bclient
from pd_connector.bootstrap.client import BootstrapError, RouteCache, register_rank
from pd_connector.bootstrap.server import BootstrapServer, BootstrapState
from pd_connector.messages import RankInfo, RegisterRank, Route
from tests.support.loopback import HOST, free_port


def _rank(tp: int = 0, dp: int = 0, tp_size: int = 2, dp_size: int = 1, **kw: Any) -> RegisterRank:
    fields: dict[str, Any] = {
        "attn_tp_size": tp_size,
        "attn_tp_rank": tp,
        "attn_dp_size": dp_size,
        "attn_dp_rank": dp,
        "rank_ip": "127.0.0.1",
        "rank_port": 7000 + 10 * dp + tp,
        "block_size": 16,
        "kv_cache_dtype": "float16",
        "num_layers": 2,
    }
    fields.update(kw)
    return RegisterRank(**fields)


class Server:
    def __init__(self, server: BootstrapServer) -> None:
        self.server = server
        self.addr = f"{HOST}:{server.port}"
        self.url = f"http://{self.addr}"

    def put_rank(self, info: RegisterRank | bytes | dict) -> httpx.Response:
        body = info if isinstance(info, bytes) else msgspec.json.encode(info)
        return httpx.put(f"{self.url}/bootstrap/register_rank", content=body, timeout=5)

    def get(self, path: str) -> httpx.Response:
        return httpx.get(f"{self.url}{path}", timeout=5)

    def post(self, path: str, body: bytes | dict | list) -> httpx.Response:
        content = body if isinstance(body, bytes) else msgspec.json.encode(body)
        return httpx.post(f"{self.url}{path}", content=content, timeout=5)


def _start(tp_size: int = 2, dp_size: int = 1) -> BootstrapServer:
    server = BootstrapServer(BootstrapState(attn_tp_size=tp_size, attn_dp_size=dp_size), HOST, free_port())
    server.start()
    return server


@pytest.fixture(scope="module")
def shared_srv() -> Iterator[Server]:
    """One tp=2 server for the tests that only poke at it with bad requests."""
    server = _start(2, 1)
    try:
        yield Server(server)
    finally:
        server.stop()


@pytest.fixture
def srv(request: pytest.FixtureRequest) -> Iterator[Server]:
    """A real bootstrap server for a tp=2, dp=1 deployment (or `indirect` (tp, dp))."""
    tp_size, dp_size = getattr(request, "param", (2, 1))
    server = _start(tp_size, dp_size)
    try:
        yield Server(server)
    finally:
        server.stop()


def test_register_until_ready_and_route(srv: Server) -> None:
    health = srv.get("/bootstrap/health").json()
    assert health.pop("server_id") == srv.server.server_id and health.pop("signature_version") == 3
    assert health == {"status": "ok", "is_ready": False, "registered": 0, "expected": 2, "refused": 0, "conflicts": 0}
    route = msgspec.json.decode(srv.get("/bootstrap/route").content, type=Route)
    assert not route.is_ready and route.ranks == {}

    r = srv.put_rank(_rank(tp=1))
    assert r.status_code == 200 and r.json() == {"status": "ok", "is_ready": False}
    assert not srv.server.state.is_ready
    r = srv.put_rank(_rank(tp=0))
    assert r.status_code == 200 and r.json()["is_ready"] is True
    assert srv.server.state.is_ready
    # Re-registering a rank (restart: nothing listens at its old port) replaces its entry; still ready.
    assert srv.put_rank(_rank(tp=0, rank_port=9999)).status_code == 200

    raw = srv.get("/bootstrap/route")
    assert raw.status_code == 200
    assert raw.headers["content-type"].startswith("application/json")
    route = msgspec.json.decode(raw.content, type=Route)
    assert route == Route(
        attn_tp_size=2,
        attn_cp_size=1,
        dp_size=1,
        block_size=16,
        kv_cache_dtype="float16",
        num_layers=2,
        is_ready=True,
        ranks={"0,0,0": RankInfo("127.0.0.1", 9999), "0,0,1": RankInfo("127.0.0.1", 7001)},
    )
    assert route.rank(0, 0, 1) == RankInfo("127.0.0.1", 7001)
    health = srv.get("/bootstrap/health").json()
    assert health.pop("server_id") == srv.server.server_id and health.pop("signature_version") == 3
    assert health == {"status": "ok", "is_ready": True, "registered": 2, "expected": 2, "refused": 0, "conflicts": 0}


@pytest.mark.parametrize(
    ("bad", "needle"),
    [
        (_rank(tp_size=4), "tp/dp/cp/pp sizes"),
        (_rank(dp_size=2), "tp/dp/cp/pp sizes"),
        (_rank(attn_cp_size=2), "tp/dp/cp/pp sizes"),
        (_rank(tp=2), "outside"),
        (_rank(dp=1), "outside"),
        (_rank(tp=-1), "outside"),
    ],
)
def test_register_wrong_topology_is_400(shared_srv: Server, bad: RegisterRank, needle: str) -> None:
    table = dict(shared_srv.server.state.rank_table)
    r = shared_srv.put_rank(bad)
    assert r.status_code == 400
    assert needle in r.json()["error"]
    assert shared_srv.server.state.rank_table == table


def test_register_mismatched_block_size_or_dtype_is_400(srv: Server) -> None:
    assert srv.put_rank(_rank(tp=0)).status_code == 200
    r = srv.put_rank(_rank(tp=1, block_size=32))
    assert r.status_code == 400 and "block_size" in r.json()["error"]
    r = srv.put_rank(_rank(tp=1, kv_cache_dtype="bfloat16"))
    assert r.status_code == 400 and "kv_cache_dtype" in r.json()["error"]
    assert not srv.server.state.is_ready
    assert srv.put_rank(_rank(tp=1)).status_code == 200
    assert srv.server.state.is_ready


@pytest.mark.parametrize(
    ("method", "path", "body"),
    [
        ("PUT", "/bootstrap/register_rank", b"{not json"),
        ("PUT", "/bootstrap/register_rank", b""),
        ("PUT", "/bootstrap/register_rank", b"[1, 2]"),
        ("PUT", "/bootstrap/register_rank", b'{"attn_tp_size": 2}'),
        ("PUT", "/bootstrap/register_rank", msgspec.json.encode({**msgspec.structs.asdict(_rank()), "rank_port": "x"})),
        ("POST", "/bootstrap/register_dp_rank", b"\xff\xfe"),
        ("POST", "/bootstrap/register_dp_rank", b'{"bootstrap_room": "one", "dp_rank": 0}'),
        ("POST", "/bootstrap/register_dp_rank", b'{"bootstrap_room": 1}'),
        ("POST", "/bootstrap/query_dp_ranks", b'{"bootstrap_rooms": 5}'),
        ("POST", "/bootstrap/query_dp_ranks", b'{"bootstrap_rooms": ["a"]}'),
        ("POST", "/bootstrap/query_dp_ranks", b"null"),
        ("PUT", "/bootstrap/register_rank", b'{"rank_ip": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"),
    ],
)
def test_bad_bodies_are_400_and_server_survives(shared_srv: Server, method: str, path: str, body: bytes) -> None:
    srv = shared_srv
    r = httpx.request(method, f"{srv.url}{path}", content=body, timeout=5)
    assert r.status_code == 400, r.text
    message = r.json()["error"]
    assert isinstance(message, str) and message.startswith("invalid ")
    # Still serving, state untouched.
    assert srv.get("/bootstrap/health").status_code == 200
    assert srv.put_rank(_rank(tp=0)).status_code == 200


def test_wrong_field_type_names_the_field(shared_srv: Server) -> None:
    srv = shared_srv
    body = {**msgspec.structs.asdict(_rank()), "block_size": "sixteen"}
    r = srv.put_rank(msgspec.json.encode(body))
    assert r.status_code == 400
    assert "block_size" in r.json()["error"]


@pytest.mark.parametrize("srv", [(1, 4)], indirect=True)
def test_dp_rank_registry(srv: Server) -> None:
    assert srv.post("/bootstrap/register_dp_rank", {"bootstrap_room": 11, "dp_rank": 3}).json() == {"status": "ok"}
    assert srv.post("/bootstrap/register_dp_rank", {"bootstrap_room": 12, "dp_rank": 0}).status_code == 200
    assert srv.post("/bootstrap/register_dp_rank", {"bootstrap_room": 11, "dp_rank": 3}).status_code == 200  # again
    # Moving a room to another rank needs the token (this deployment has none): 409, the room stays.
    r = srv.post("/bootstrap/register_dp_rank", {"bootstrap_room": 11, "dp_rank": 2})
    assert r.status_code == 409 and "room 11 is served by dp rank 3" in r.json()["error"]
    assert srv.server.state.conflicts == 1
    r = srv.post("/bootstrap/register_dp_rank", {"bootstrap_room": 13, "dp_rank": 4})
    assert r.status_code == 400 and "dp_rank" in r.json()["error"]
    r = srv.post("/bootstrap/query_dp_ranks", {"bootstrap_rooms": [11, 12, 13, 2**62]})
    assert r.status_code == 200
    assert r.json() == {"dp_ranks": {"11": 3, "12": 0}}
    assert srv.post("/bootstrap/query_dp_ranks", {"bootstrap_rooms": []}).json() == {"dp_ranks": {}}

    cache = RouteCache(timeout_s=5)
    assert cache.query_dp_rank(srv.addr, 11) == 3
    assert cache.query_dp_rank(srv.addr, 13) is None


def test_unknown_path_and_method(shared_srv: Server) -> None:
    srv = shared_srv
    assert srv.get("/bootstrap/nope").status_code == 404
    assert srv.get("/bootstrap/register_rank").status_code == 405


def test_port_in_use_is_a_clear_error() -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as blocker:
        blocker.bind((HOST, 0))
        blocker.listen(1)
        port = blocker.getsockname()[1]
        server = BootstrapServer(BootstrapState(attn_tp_size=1, attn_dp_size=1), HOST, port)
        with pytest.raises(RuntimeError, match=rf"cannot bind {HOST}:{port}.*bootstrap_port"):
            server.start()


def test_second_server_on_same_port_is_a_clear_error(srv: Server) -> None:
    other = BootstrapServer(BootstrapState(attn_tp_size=1, attn_dp_size=1), HOST, srv.server.port)
    with pytest.raises(RuntimeError, match="cannot bind"):
        other.start()
    assert srv.get("/bootstrap/health").status_code == 200


def test_stop_releases_the_port() -> None:
    server = _start(1, 1)
    port = server.port
    server.stop()
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"http://{HOST}:{port}/bootstrap/health", timeout=2)
    again = BootstrapServer(BootstrapState(attn_tp_size=1, attn_dp_size=1), HOST, port)
    again.start()
    again.stop()


# ------------------------------------------------------------------ client


class _Spy:
    """Wraps an httpx function and counts calls."""

    def __init__(self, fn: Any) -> None:
        self.fn, self.calls = fn, 0

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        return self.fn(*args, **kwargs)


def test_register_rank_of_another_model_is_400_and_route_names_the_model(srv: Server) -> None:
    assert srv.put_rank(_rank(tp=0, model="Llama layers=2")).status_code == 200
    r = srv.put_rank(_rank(tp=1, model="Llama layers=4"))
    assert r.status_code == 400 and "model" in r.json()["error"]
    assert srv.put_rank(_rank(tp=1, model="Llama layers=2")).status_code == 200
    assert srv.get("/bootstrap/route").json()["model"] == "Llama layers=2"


def test_register_rank_client_success(srv: Server) -> None:
    assert register_rank(srv.addr, _rank(tp=0), retries=3, interval_s=0.01, timeout_s=5) is True
    assert register_rank(srv.addr, _rank(tp=1), retries=3, interval_s=0.01, timeout_s=5) is True
    assert srv.server.state.is_ready


def test_register_rank_retries_then_false(monkeypatch: pytest.MonkeyPatch, pd_logs: pytest.LogCaptureFixture) -> None:
    spy = _Spy(httpx.put)
    monkeypatch.setattr(bclient.httpx, "put", spy)
    addr = f"{HOST}:{free_port()}"  # nothing listens there
    t0 = time.monotonic()
    assert register_rank(addr, _rank(), retries=3, interval_s=0.05, timeout_s=1) is False
    assert spy.calls == 3
    assert time.monotonic() - t0 < 5
    assert f"could not register with bootstrap server {addr} after 3 tries" in pd_logs.text


def test_register_rank_waits_for_a_late_server(monkeypatch: pytest.MonkeyPatch) -> None:
    port = free_port()
    spy = _Spy(httpx.put)
    state = BootstrapState(attn_tp_size=1, attn_dp_size=1)
    started: list[BootstrapServer] = []

    def put_then_start(*args: Any, **kwargs: Any) -> Any:
        if spy.calls == 2 and not started:  # the server comes up after two failed tries
            server = BootstrapServer(state, HOST, port)
            server.start()
            started.append(server)
        return spy(*args, **kwargs)

    monkeypatch.setattr(bclient.httpx, "put", put_then_start)
    try:
        assert register_rank(f"{HOST}:{port}", _rank(tp_size=1), retries=5, interval_s=0.01, timeout_s=2)
        assert spy.calls == 3 and state.is_ready
    finally:
        for server in started:
            server.stop()


def test_register_rank_does_not_retry_a_refusal(srv: Server, monkeypatch: pytest.MonkeyPatch) -> None:
    spy = _Spy(httpx.put)
    monkeypatch.setattr(bclient.httpx, "put", spy)
    assert register_rank(srv.addr, _rank(tp_size=8), retries=5, interval_s=0.01, timeout_s=5) is False
    assert spy.calls == 1


def test_client_ignores_proxy_settings(srv: Server, monkeypatch: pytest.MonkeyPatch) -> None:
    """A proxy in the environment (set for pip, say) must not sit between P, D and the bootstrap server."""
    dead_proxy = f"http://{HOST}:{free_port()}"
    for name in ("HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.setenv(name, dead_proxy)
    for name in ("NO_PROXY", "no_proxy"):
        monkeypatch.delenv(name, raising=False)
    assert register_rank(srv.addr, _rank(tp=0), retries=1, interval_s=0.01, timeout_s=5)
    assert register_rank(srv.addr, _rank(tp=1), retries=1, interval_s=0.01, timeout_s=5)
    cache = RouteCache(timeout_s=5)
    assert cache.get(srv.addr).is_ready
    assert cache.query_dp_rank(srv.addr, 12345) is None


def test_route_cache_caches(srv: Server, monkeypatch: pytest.MonkeyPatch) -> None:
    srv.put_rank(_rank(tp=0))
    srv.put_rank(_rank(tp=1))
    spy = _Spy(httpx.get)
    monkeypatch.setattr(bclient.httpx, "get", spy)
    cache = RouteCache(timeout_s=5)
    first = cache.get(srv.addr)
    assert first.is_ready and first.rank(0, 0, 1) == RankInfo("127.0.0.1", 7001)
    assert cache.get(srv.addr) is first
    assert spy.calls == 1
    cache.invalidate(srv.addr)
    assert cache.get(srv.addr) == first
    assert spy.calls == 2


def test_route_cache_reads_a_restarted_deployment_after_its_ttl() -> None:
    """A prefill deployment restarted on the same bootstrap port has new rank endpoints."""
    port = free_port()
    now = [1000.0]  # the cache's clock, moved by hand: a slow server restart must not age the entry
    cache = RouteCache(timeout_s=5, ttl_s=10.0, clock=lambda: now[0])
    old = BootstrapServer(BootstrapState(attn_tp_size=1, attn_dp_size=1), HOST, port)
    old.start()
    try:
        assert Server(old).put_rank(_rank(tp_size=1, rank_port=7100)).status_code == 200
        assert cache.get(f"{HOST}:{port}").rank(0, 0, 0) == RankInfo("127.0.0.1", 7100)
    finally:
        old.stop()
    new = BootstrapServer(BootstrapState(attn_tp_size=1, attn_dp_size=1), HOST, port)
    new.start()
    try:
        assert Server(new).put_rank(_rank(tp_size=1, rank_port=7200)).status_code == 200
        now[0] += 9.9
        assert cache.get(f"{HOST}:{port}").rank(0, 0, 0) == RankInfo("127.0.0.1", 7100)  # still cached
        now[0] += 0.2
        assert cache.get(f"{HOST}:{port}").rank(0, 0, 0) == RankInfo("127.0.0.1", 7200)
    finally:
        new.stop()


def test_route_cache_unready_raises_and_is_not_cached(srv: Server) -> None:
    srv.put_rank(_rank(tp=0))
    cache = RouteCache(timeout_s=5)
    with pytest.raises(BootstrapError, match=r"not ready: 1 of 2 ranks registered"):
        cache.get(srv.addr)
    srv.put_rank(_rank(tp=1))
    assert cache.get(srv.addr).is_ready


def test_route_cache_unreachable_raises_quickly() -> None:
    addr = f"{HOST}:{free_port()}"
    cache = RouteCache(timeout_s=2)
    t0 = time.monotonic()
    with pytest.raises(BootstrapError, match=rf"bootstrap server {addr} unreachable"):
        cache.get(addr)
    with pytest.raises(BootstrapError, match="query_dp_ranks"):
        cache.query_dp_rank(addr, 1)
    assert time.monotonic() - t0 < 5


def test_route_cache_http_error_status(shared_srv: Server) -> None:
    # An address whose route path answers 404 (a prefix that is not the bootstrap API).
    cache = RouteCache(timeout_s=5)
    with pytest.raises(BootstrapError, match="HTTP 404"):
        cache.get(f"{shared_srv.addr}/nothing-here")
