"""The control-plane token and input checks: signed ZMQ frames, signed bootstrap
calls (keys derived from the token, which never travels), one log line for a 400, host names checked."""

from __future__ import annotations

import logging
from pathlib import Path

import httpx
import msgspec
import pytest
import zmq

from pd_connector import messages as proto
from pd_connector.auth import token_of
from pd_connector.bootstrap.client import RouteCache, register_rank
from pd_connector.bootstrap.server import BootstrapServer, BootstrapState
from pd_connector.bootstrap.signing import signed_headers
from pd_connector.config import ConfigError, parse_config
from pd_connector.keys import frame_key
from pd_connector.kv_params import KVParamsError, host_port, parse_kv_params
from pd_connector.messages import RegisterRank
from pd_connector.metadata import SendJob
from pd_connector.transfer.frames import FrameOpener, FrameRefused, FrameSealer
from tests.support.loopback import HOST, free_port, wait_for
from tests.support.transfer_rig import BLOCK_SIZE, Rig, recv_job

TOKEN = "s3cret-token-for-the-tests-0123"


def test_token_from_file_or_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "token"
    path.write_text(TOKEN + "\n")
    assert token_of(parse_config("kv_producer", {"auth_token_file": str(path)})) == TOKEN.encode()
    monkeypatch.setenv("PD_TOKEN_T", TOKEN)
    assert token_of(parse_config("kv_consumer", {"auth_token_env": "PD_TOKEN_T"})) == TOKEN.encode()
    assert token_of(parse_config("kv_consumer", {})) is None
    with pytest.raises(ConfigError, match="cannot be read"):
        parse_config("kv_producer", {"auth_token_file": str(tmp_path / "missing")})
    monkeypatch.setenv("PD_TOKEN_SHORT", "x")
    with pytest.raises(ConfigError, match="shorter than 16"):
        parse_config("kv_producer", {"auth_token_env": "PD_TOKEN_SHORT"})


def test_frames_are_signed_and_checked() -> None:
    key, to = frame_key(TOKEN.encode()), "tcp://127.0.0.1:5001"
    frame = FrameSealer(key, "tcp://127.0.0.1:5000").seal(to, b"payload")
    opened = FrameOpener(key, to).open(frame)
    assert opened.payload == b"payload" and opened.sender == "tcp://127.0.0.1:5000"
    assert FrameSealer(None, "x").seal(to, b"x") == b"x" and FrameOpener(None, to).open(b"x").payload == b"x"
    other = FrameSealer(frame_key(b"another-token-0123456"), "tcp://127.0.0.1:5000").seal(to, b"payload")
    for bad in (b"payload", frame[:-1] + b"!", other):
        with pytest.raises(FrameRefused):
            FrameOpener(key, to).open(bad)


@pytest.fixture
def token_env(monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    monkeypatch.setenv("PD_TOKEN_RIG", TOKEN)
    return {"auth_token_env": "PD_TOKEN_RIG"}


@pytest.fixture
def secure_server() -> BootstrapServer:
    server = BootstrapServer(BootstrapState(attn_tp_size=1, attn_dp_size=1), HOST, free_port(), TOKEN.encode())
    server.start()
    yield server  # type: ignore[misc]
    server.stop()


def test_bootstrap_calls_without_the_token_are_refused(
    secure_server: BootstrapServer, caplog: pytest.LogCaptureFixture
) -> None:
    base = f"http://{HOST}:{secure_server.port}"
    info = RegisterRank(1, 0, 1, 0, HOST, 1234, 16, "float16", num_layers=2)
    with caplog.at_level(logging.WARNING, logger="pd_connector"):
        assert not register_rank(f"{HOST}:{secure_server.port}", info, retries=1, interval_s=0.01, timeout_s=5)
        assert httpx.get(f"{base}/bootstrap/route", trust_env=False).status_code == 401
        for wrong in (
            {"Authorization": f"Bearer {TOKEN}"},
            signed_headers(b"not-the-token-0123456789", "GET", "/", audience=secure_server.server_id),
        ):
            assert httpx.get(f"{base}/bootstrap/route", headers=wrong, trust_env=False).status_code == 401
    assert "missing or malformed call signature" in caplog.text and HOST in caplog.text
    assert secure_server.state.refused == 4
    assert httpx.get(f"{base}/bootstrap/health", trust_env=False).status_code == 200
    key = TOKEN.encode()
    assert register_rank(f"{HOST}:{secure_server.port}", info, retries=1, interval_s=0.01, timeout_s=5, token=key)
    assert RouteCache(5, token=key).get(f"{HOST}:{secure_server.port}").rank(0, 0, 0) is not None


def test_a_bad_bootstrap_body_is_one_log_line(secure_server: BootstrapServer, caplog: pytest.LogCaptureFixture) -> None:
    url = f"http://{HOST}:{secure_server.port}/bootstrap/register_rank"
    with caplog.at_level(logging.WARNING):
        headers = signed_headers(
            TOKEN.encode(), "PUT", "/bootstrap/register_rank", b"\x00garbage", audience=secure_server.server_id
        )
        resp = httpx.put(url, content=b"\x00garbage", headers=headers, trust_env=False)
    assert resp.status_code == 400 and "RegisterRank" in resp.json()["error"]
    lines = [r for r in caplog.records if "register_rank" in r.getMessage()]
    assert len(lines) == 1 and lines[0].exc_info is None and "Traceback" not in caplog.text


def test_transfer_with_a_token_and_unsigned_frames_refused(
    engines, token_env: dict[str, str], secure_server: BootstrapServer
) -> None:
    rig = Rig(secure_server, engines)
    try:
        p = rig.make("prefill", seed=1, register=False, **token_env)
        info = RegisterRank(1, 0, 1, 0, HOST, p.mgr.rank_port, BLOCK_SIZE, "float16", num_layers=2)
        assert register_rank(f"{HOST}:{rig.bport}", info, 1, 0.01, 5, token=TOKEN.encode())
        d = rig.make("decode", **token_env)
        p.mgr.add_sends([SendJob("p-req", 71, [1, 2], 2 * BLOCK_SIZE)])
        d.mgr.add_recvs([recv_job(rig, "d-req", 71, [3, 4])])
        d.wait_recv("d-req")
        assert d.failed == {}
        # A spoofed, unsigned frame (a cancel of a live room) is refused and counted.
        p.mgr.add_sends([SendJob("p-req-2", 72, [5], BLOCK_SIZE)])
        ctx = zmq.Context.instance()
        sock = ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(p.mgr.endpoint)
        sock.send(msgspec.msgpack.encode(proto.TransferCancel(room=72, request_id="x")))
        sock.send(b"garbage")
        wait_for(lambda: p.stats().auth_refused == 2, 5, what="both frames refused")
        sock.close()
        assert p.room_state(72) is not None  # the spoofed cancel did nothing
    finally:
        rig.close()


@pytest.mark.parametrize("host", ["a\x00b", "evil host", "h/../x", "::zz", "x" * 300, ""])
def test_garbage_bootstrap_host_is_named(host: str) -> None:
    params = {"do_remote_prefill": True, "bootstrap_room": 1, "bootstrap_host": host, "bootstrap_port": 1}
    with pytest.raises(KVParamsError, match="bootstrap_host"):
        parse_kv_params(params)


@pytest.mark.parametrize("host", ["::1", "[::1]", "fe80::1%eth0"])
def test_ipv6_bootstrap_hosts_make_urls_with_brackets(host: str) -> None:
    params = {"do_remote_prefill": True, "bootstrap_room": 1, "bootstrap_host": host, "bootstrap_port": 18800}
    parsed = parse_kv_params(params)
    assert parsed.bootstrap_addr.startswith("[") and parsed.bootstrap_addr.endswith("]:18800")  # type: ignore[union-attr]
    assert host_port("10.0.0.1", 5) == "10.0.0.1:5"
