"""kv_both instances behind the Router (``--both-hosts``): in both pools, never paired with themselves.

Unit tests of the flags and the pool's picks, then a real Router in front of fake backends: two
kv_both instances prefill for each other, and a request whose only free pair is one instance is
served by it alone (the local path)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import httpx
import pytest

from proxy.cli import parse_config
from proxy.router_config import Backend
from proxy.upstream.pool import BackendPool, BackendState
from tests.support.router_rig import HOST, Backends, Proc, free_port, new_rid, records, request_body

BOTH = ("--both-hosts", "h", "h", "--both-ports", "8001", "8002", "--both-bootstrap-ports", "18801", "18802")


def _pool(routing: str = "room") -> BackendPool:
    config = parse_config(list(BOTH))
    return BackendPool(config.prefillers, config.decoders, routing)


def _port(state: BackendState | None) -> int:
    assert state is not None
    return state.backend.port


def test_both_instances_are_in_both_pools() -> None:
    config = parse_config(list(BOTH))
    assert [(b.role, b.port, b.bootstrap_port, b.both) for b in config.prefillers] == [
        ("prefill", 8001, 18801, True),
        ("prefill", 8002, 18802, True),
    ]
    assert [(b.role, b.port, b.bootstrap_port, b.both) for b in config.decoders] == [
        ("decode", 8001, None, True),  # not movable by KV: kv_both refuses migration
        ("decode", 8002, None, True),
    ]
    assert "kv_both" in config.describe() and config.decoders[0].name == "decoder h:8001 (kv_both)"
    assert config.prefillers[0].same_instance(config.decoders[0])
    mixed = parse_config(["--prefiller-hosts", "h", "--prefiller-ports", "7001", *BOTH[:6]])
    assert [b.port for b in mixed.prefillers] == [7001, 8001, 8002]
    assert [b.port for b in mixed.decoders] == [8001, 8002]
    assert mixed.prefillers[1].bootstrap_port == 18800  # the connector's default


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        ([*BOTH, "--decoder-hosts", "h", "--decoder-ports", "8001"], "8001 is also listed"),
        (["--both-hosts", "h", "--both-ports", "8001", "8002"], "--both-hosts has 1 values but --both-ports has 2"),
        (
            ["--both-hosts", "h", "--both-ports", "8001", "--both-bootstrap-ports", "0"],
            "--both-bootstrap-ports: port 0",
        ),
        (["--prefiller-hosts", "h", "--prefiller-ports", "1", "--both-bootstrap-ports", "2"], "needs --both-hosts"),
        (["--both-hosts", "h", "h", "--both-ports", "8001", "8001"], "listed twice"),
    ],
)
def test_bad_both_flags_are_named(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        parse_config(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("routing", ["room", "least-loaded", "cache-aware"])
def test_a_room_never_pairs_an_instance_with_itself(routing: str) -> None:
    pool = _pool(routing)
    directions = set()
    for room in range(8):
        p, d = pool.pick("prefill", room), pool.pick("decode", room)
        assert _port(p) != _port(d), (room, routing)
        directions.add((_port(p), _port(d)))
    if routing == "room":  # rooms of both parities: each instance prefills for the other
        assert directions == {(8001, 8002), (8002, 8001)}


def test_the_twin_is_left_only_when_nothing_else_is_free() -> None:
    pool = _pool()
    pool.mark_unhealthy(pool.active["decode"][1], "down")  # 8002's decode side
    assert _port(pool.pick("prefill", 0)) == 8001
    assert _port(pool.pick("decode", 0)) == 8001  # only its own decode side is healthy: the caller goes local
    other = pool.active["decode"][1]
    assert _port(pool.pick("prefill", 1)) == 8002
    assert pool.pick("decode", 1) is not other  # 8002's twin is avoided; 8001 is healthy


def test_alone_with_itself_names_an_instance_whose_only_decoder_is_its_own() -> None:
    pool = _pool()
    p0, p1 = pool.active["prefill"]
    assert not pool.alone_with_itself(p0)
    pool.mark_unhealthy(pool.active["decode"][1], "down")
    assert pool.alone_with_itself(p0)  # 8001: only its own decode side is healthy
    assert not pool.alone_with_itself(p1)  # 8002 may decode on 8001
    fixed = BackendState(Backend("prefill", "h", 8001))
    assert not pool.alone_with_itself(fixed)  # only a kv_both prefiller is ever alone


def test_a_fixed_prefiller_may_pair_with_any_decoder() -> None:
    pool = BackendPool((Backend("prefill", "h", 7001, 18800),), (Backend("decode", "h", 8001, both=True),))
    assert _port(pool.pick("prefill", 5)) == 7001
    assert _port(pool.pick("decode", 5)) == 8001
    assert pool.snapshot()["decoders"][0]["kv_both"] is True


# -- a real Router in front of fake backends ------------------------------------------------


def _router(proc_dir: Path, ports: tuple[int, ...], *extra: str) -> Proc:
    port = free_port()
    args = [
        sys.executable, "-m", "proxy", "--host", HOST, "--port", str(port),
        "--both-hosts", *[HOST] * len(ports), "--both-ports", *map(str, ports),
        "--both-bootstrap-ports", str(free_port()),
        "--connect-timeout", "2", "--trust-client-room", *(extra or ["--no-first-token-from-prefill"]),
    ]  # fmt: skip
    proc = Proc(f"router {port}", port, args, proc_dir / f"router-both-{port}.log").start()
    try:
        proc.wait_listening(path="/healthcheck")
    except BaseException:
        proc.stop()
        raise
    return proc


def _post(router: Proc, rid: str, room: int, stream: bool = False) -> httpx.Response:
    with httpx.Client(timeout=20, trust_env=False) as client:
        body = request_body("/v1/completions", bootstrap_room=room, stream=stream)
        return client.post(f"{router.url}/v1/completions", json=body, headers={"X-Request-Id": rid})


def _kv(record: dict[str, Any]) -> dict[str, Any]:
    return record["body"].get("kv_transfer_params") or {}


def test_two_both_instances_prefill_for_each_other(backends: Backends, proc_dir: Path) -> None:
    a, b = backends.ok_p, backends.ok_p2
    router = _router(proc_dir, (a, b))
    try:
        for room, (p_port, d_port) in ((0, (a, b)), (1, (b, a))):
            rid = new_rid("both")
            assert _post(router, rid, room).status_code == 200
            (p,) = records(p_port, rid)
            (d,) = records(d_port, rid)
            assert _kv(p)["do_remote_decode"] is True and _kv(p)["bootstrap_room"] == room
            assert _kv(d)["do_remote_prefill"] is True and _kv(d)["bootstrap_room"] == room
    finally:
        router.stop()


@pytest.mark.parametrize("path", ["--no-first-token-from-prefill", "--first-token-from-prefill"])
def test_one_both_instance_alone_serves_requests_itself(backends: Backends, proc_dir: Path, path: str) -> None:
    router = _router(proc_dir, (backends.ok_d2,), path)
    try:
        rid = new_rid("both-alone")
        assert _post(router, rid, 3, stream=True).status_code == 200  # a stream: the first-token path's
        (only,) = records(backends.ok_d2, rid)
        assert not _kv(only).get("do_remote_decode") and not _kv(only).get("do_remote_prefill")
    finally:
        router.stop()
