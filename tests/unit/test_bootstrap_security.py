"""Network side of the control plane: the control plane binds loopback without a token, TLS on the bootstrap server,
live rank entries not replaced without the token, D contacts only trusted bootstrap hosts."""

from __future__ import annotations

import logging
import socket
from collections.abc import Iterator
from pathlib import Path

import httpx
import msgspec
import pytest

from pd_connector.bootstrap.client import (
    BootstrapError,
    BootstrapUntrusted,
    RouteCache,
    register_dp_rank,
    register_rank,
)
from pd_connector.bootstrap.exposure import exposure_of, is_loopback
from pd_connector.bootstrap.server import BootstrapServer, BootstrapState
from pd_connector.bootstrap.trust import TrustedHosts, split_addr, trusted_hosts_of
from pd_connector.config import ConfigError, parse_config
from pd_connector.keys import derive_keys
from pd_connector.messages import RegisterRank
from tests.support.loopback import HOST, free_port

TOKEN = b"another-test-token-0123456789"


def _rank(port: int, dp_size: int = 1) -> RegisterRank:
    return RegisterRank(1, 0, dp_size, 0, HOST, port, 16, "float16", num_layers=2)


@pytest.fixture
def listener() -> Iterator[int]:
    """A TCP port that accepts connections (a live rank's ZMQ socket, as far as a probe can tell)."""
    with socket.socket() as sock:
        sock.bind((HOST, 0))
        sock.listen(8)
        yield sock.getsockname()[1]


def _server(token: bytes | None = None, dp_size: int = 1, **tls: str) -> BootstrapServer:
    server = BootstrapServer(BootstrapState(attn_tp_size=1, attn_dp_size=dp_size), HOST, free_port(), token, **tls)
    server.start()
    return server


# ------------------------------------------------------------------ loopback without a token


@pytest.mark.parametrize("mode", ["kv_producer", "kv_consumer"])
def test_no_token_on_loopback_runs_and_says_so(mode: str) -> None:
    exposure = exposure_of(parse_config(mode, {}))
    assert not exposure.open
    assert "bind loopback 127.0.0.1 only" in exposure.line and "auth_token_file" in exposure.line


@pytest.mark.parametrize(
    ("mode", "extra", "named"),
    [
        ("kv_producer", {"local_ip": "10.0.0.1"}, "local_ip 10.0.0.1"),
        ("kv_consumer", {"local_ip": "fd00::5"}, "local_ip fd00::5"),
        ("kv_producer", {"bootstrap_host": "prefill-0.pd.svc"}, "bootstrap_host prefill-0.pd.svc"),
    ],
)
def test_no_token_off_loopback_is_refused_naming_the_key(mode: str, extra: dict, named: str) -> None:
    cfg = parse_config(mode, extra)  # parsing still works (tools, tests): the refusal is at start-up
    with pytest.raises(ConfigError) as err:
        exposure_of(cfg)
    assert named in str(err.value) and "auth_token_file or auth_token_env" in str(err.value)
    assert "insecure: true" in str(err.value)
    opened = exposure_of(parse_config(mode, {**extra, "insecure": True}))
    assert opened.open and "NO auth token" in opened.line


def test_a_token_allows_any_address(tmp_path: Path) -> None:
    path = tmp_path / "token"
    path.write_text(TOKEN.decode())
    exposure = exposure_of(parse_config("kv_producer", {"local_ip": "10.0.0.1", "auth_token_file": str(path)}))
    assert not exposure.open and "shared token set" in exposure.line and "10.0.0.1" in exposure.line


def test_decode_bootstrap_host_is_not_an_exposure() -> None:
    # D's own bootstrap_host only names a trusted default; D listens on local_ip alone.
    assert not exposure_of(parse_config("kv_consumer", {"bootstrap_host": "10.0.0.9"})).open


@pytest.mark.parametrize(("host", "loop"), [("127.0.0.1", True), ("::1", True), ("[::1]", True),
                                            ("localhost", True), ("10.0.0.1", False), ("p.svc", False)])  # fmt: skip
def test_is_loopback(host: str, loop: bool) -> None:
    assert is_loopback(host) is loop


# ------------------------------------------------------------------ TLS


def test_tls_bootstrap_server_and_clients(cert: tuple[str, str], listener: int) -> None:
    certfile, keyfile = cert
    server = _server(TOKEN, dp_size=2, ssl_certfile=certfile, ssl_keyfile=keyfile)
    addr = f"{HOST}:{server.port}"
    try:
        assert server.scheme == "https"
        info = RegisterRank(1, 0, 2, 0, HOST, listener, 16, "float16", num_layers=2)
        assert register_rank(addr, info, 1, 0.01, 5, token=TOKEN, ca_certs=certfile)
        info1 = RegisterRank(1, 0, 2, 1, HOST, listener, 16, "float16", num_layers=2)
        assert register_rank(addr, info1, 1, 0.01, 5, token=TOKEN, ca_certs=certfile)
        cache = RouteCache(5, token=TOKEN, ca_certs=certfile)
        assert cache.get(addr).rank(0, 0, 0) is not None
        register_dp_rank(addr, 77, 1, 5, TOKEN, certfile)
        assert cache.query_dp_rank(addr, 77) == 1
        # Plain http to a TLS server fails; so does https without the CA (the certificate is self-signed).
        with pytest.raises(BootstrapError, match=addr):
            RouteCache(5, token=TOKEN).get(addr)
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"https://{addr}/bootstrap/health", trust_env=False)
        assert not register_rank(addr, info, 1, 0.01, 5, token=TOKEN, ca_certs="")
    finally:
        server.stop()


def test_tls_config_keys(cert: tuple[str, str], tmp_path: Path) -> None:
    certfile, keyfile = cert
    cfg = parse_config(
        "kv_producer",
        {"bootstrap_ssl_certfile": certfile, "bootstrap_ssl_keyfile": keyfile, "bootstrap_ssl_ca_certs": certfile},
    )
    assert (cfg.bootstrap_ssl_certfile, cfg.bootstrap_ssl_keyfile, cfg.bootstrap_ssl_ca_certs) == (
        certfile,
        keyfile,
        certfile,
    )
    assert parse_config("kv_consumer", {"bootstrap_ssl_ca_certs": certfile}).bootstrap_ssl_ca_certs == certfile
    with pytest.raises(ConfigError, match="bootstrap_ssl_certfile and bootstrap_ssl_keyfile go together"):
        parse_config("kv_producer", {"bootstrap_ssl_certfile": certfile})
    with pytest.raises(ConfigError, match="bootstrap_ssl_ca_certs is not"):
        parse_config("kv_producer", {"bootstrap_ssl_certfile": certfile, "bootstrap_ssl_keyfile": keyfile})
    missing = str(tmp_path / "nope.pem")
    with pytest.raises(ConfigError, match="bootstrap_ssl_ca_certs .*nope.pem.* is not a readable file"):
        parse_config("kv_consumer", {"bootstrap_ssl_ca_certs": missing})


# ------------------------------------------------------------------ live entries


def test_live_rank_is_not_replaced_without_a_token(listener: int, caplog: pytest.LogCaptureFixture) -> None:
    server = _server()
    addr = f"{HOST}:{server.port}"
    url = f"http://{addr}/bootstrap/register_rank"
    try:
        assert register_rank(addr, _rank(listener), 1, 0.01, 5)
        assert register_rank(addr, _rank(listener), 1, 0.01, 5)  # the same endpoint again: fine
        with caplog.at_level(logging.WARNING, logger="pd_connector"):
            resp = httpx.put(url, content=msgspec.json.encode(_rank(4242)), trust_env=False)
        assert resp.status_code == 409
        assert f"{HOST}:{listener}" in resp.json()["error"] and "auth token" in resp.json()["error"]
        assert "refusing to move live rank dp=0 cp=0 tp=0" in caplog.text
        assert server.state.rank_table[(0, 0, 0, 0)].rank_port == listener
        assert httpx.get(f"http://{addr}/bootstrap/health", trust_env=False).json()["conflicts"] == 1
    finally:
        server.stop()


def test_a_gone_rank_is_replaced_and_logged(caplog: pytest.LogCaptureFixture) -> None:
    server = _server()
    addr = f"{HOST}:{server.port}"
    dead = free_port()  # nothing listens there: the old rank is gone (restarted)
    try:
        assert register_rank(addr, _rank(dead), 1, 0.01, 5)
        with caplog.at_level(logging.WARNING, logger="pd_connector"):
            assert register_rank(addr, _rank(4243), 1, 0.01, 5)
        assert f"rank dp=0 cp=0 tp=0 re-registered: {HOST}:{dead} -> {HOST}:4243 (old endpoint gone)" in caplog.text
        assert server.state.rank_table[(0, 0, 0, 0)].rank_port == 4243
    finally:
        server.stop()


def test_with_the_token_a_live_rank_is_replaced_and_logged(listener: int, caplog: pytest.LogCaptureFixture) -> None:
    server = _server(TOKEN, dp_size=2)
    addr = f"{HOST}:{server.port}"
    try:
        assert register_rank(addr, _rank(listener, 2), 1, 0.01, 5, token=TOKEN)
        with caplog.at_level(logging.WARNING, logger="pd_connector"):
            assert register_rank(addr, _rank(4244, 2), 1, 0.01, 5, token=TOKEN)
            register_dp_rank(addr, 5, 0, 5, TOKEN)
            register_dp_rank(addr, 5, 1, 5, TOKEN)
        assert f"re-registered: {HOST}:{listener} -> {HOST}:4244 (token checked)" in caplog.text
        assert "room=5 re-registered: dp rank 0 -> 1" in caplog.text
        assert RouteCache(5, token=TOKEN).query_dp_rank(addr, 5) == 1
        # Without it: 401, nothing changes.
        resp = httpx.put(
            f"http://{addr}/bootstrap/register_rank", content=msgspec.json.encode(_rank(1, 2)), trust_env=False
        )
        assert resp.status_code == 401 and server.state.rank_table[(0, 0, 0, 0)].rank_port == 4244
    finally:
        server.stop()


# ------------------------------------------------------------------ trusted bootstrap hosts


def test_trusted_hosts_parse_and_match() -> None:
    trust = TrustedHosts.parse(["10.0.0.0/8", "fd00::/8", "192.0.2.7", "[2001:db8::1]", "Prefill-0.pd.svc"])
    assert trust.allows("10.1.2.3") and trust.allows("192.0.2.7") and not trust.allows("192.0.2.8")
    assert trust.allows("fd00::1") and trust.allows("[fd00::1]") and trust.allows("2001:db8::1")
    assert not trust.allows("fe80::1") and not trust.allows("::1")
    assert trust.allows("prefill-0.pd.svc") and not trust.allows("prefill-1.pd.svc")
    assert trust.allows("::ffff:10.0.0.1")  # an IPv4-mapped IPv6 address is its IPv4 address
    assert not trust.allows("10.0.0.1.evil.example")  # a name is never compared with a network
    assert TrustedHosts.parse(["*"]).allows("anything.example")
    for bad in ("10.0.0.0/33", "a b", "host/path", "x\x00y", ""):
        with pytest.raises(ValueError, match="trusted_bootstrap_hosts"):
            TrustedHosts.parse([bad] if bad else ["[]"])


def test_trusted_hosts_default_and_config() -> None:
    # Default: what D was configured with. Loopback only for a deployment on loopback.
    on_loopback = trusted_hosts_of(parse_config("kv_consumer", {"bootstrap_host": "10.0.0.9"}))
    assert on_loopback.allows("127.0.0.1") and on_loopback.allows("::1") and on_loopback.allows("localhost")
    assert on_loopback.allows("10.0.0.9") and not on_loopback.allows("10.0.0.10")
    networked = {"bootstrap_host": "10.0.0.9", "local_ip": "10.0.0.5", "insecure": True}
    default = trusted_hosts_of(parse_config("kv_consumer", networked))
    assert default.allows("10.0.0.9") and not default.allows("10.0.0.5")
    assert not any(default.allows(h) for h in ("127.0.0.1", "127.0.0.2", "::1", "localhost"))
    unset = trusted_hosts_of(parse_config("kv_consumer", {"local_ip": "10.0.0.5", "insecure": True}))
    assert not unset.allows("127.0.0.1") and unset.describe() == "none"  # the default 127.0.0.1 is not trusted
    listed = trusted_hosts_of(parse_config("kv_consumer", {"trusted_bootstrap_hosts": "10.0.0.0/24, p.svc"}))
    assert listed.allows("10.0.0.10") and listed.allows("p.svc") and not listed.allows("127.0.0.1")
    assert parse_config("kv_consumer", {"trusted_bootstrap_hosts": ["*"]}).trusted_bootstrap_hosts == ("*",)
    with pytest.raises(ConfigError, match="trusted_bootstrap_hosts.*'300.0.0.0/8'"):
        parse_config("kv_consumer", {"trusted_bootstrap_hosts": ["300.0.0.0/8"]})
    for bad in ("*", "a b", "x/y"):
        with pytest.raises(ConfigError, match="bootstrap_host"):
            parse_config("kv_consumer", {"bootstrap_host": bad})
    with pytest.raises(ConfigError, match="must be a list of strings"):
        parse_config("kv_consumer", {"trusted_bootstrap_hosts": [1]})


@pytest.mark.parametrize(("addr", "host"), [("h:1", "h"), ("[::1]:18800", "::1"), ("10.0.0.1:5", "10.0.0.1")])
def test_split_addr(addr: str, host: str) -> None:
    assert split_addr(addr) == host


def test_route_cache_never_contacts_an_untrusted_host() -> None:
    with socket.socket() as sock:  # a listener of an attacker's: nothing may reach it
        sock.bind((HOST, 0))
        sock.listen(1)
        sock.settimeout(0.3)
        addr = f"{HOST}:{sock.getsockname()[1]}"
        cache = RouteCache(2, token=TOKEN, trusted=TrustedHosts.parse(["10.0.0.0/8"]))
        with pytest.raises(BootstrapUntrusted, match=f"bootstrap address {addr} is not trusted.*10.0.0.0/8"):
            cache.get(addr)
        with pytest.raises(BootstrapUntrusted):
            cache.query_dp_rank(addr, 1)
        with pytest.raises(TimeoutError):
            sock.accept()


def test_for_config_carries_token_and_trust(tmp_path: Path) -> None:
    path = tmp_path / "token"
    path.write_text(TOKEN.decode())
    cache = RouteCache.for_config(parse_config("kv_consumer", {"auth_token_file": str(path)}))
    assert cache._key == derive_keys(TOKEN).bootstrap  # noqa: SLF001 - what every call is signed with
    with pytest.raises(BootstrapUntrusted):
        cache.get("192.0.2.1:18800")
