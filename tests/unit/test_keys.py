"""Keys derived from the token (HKDF-SHA256, one per purpose), signed bootstrap calls
(stale, replayed, altered calls refused; bounded memory), and a loopback listener that a client names as
bootstrap address gets neither the token nor anything that forges a frame; D does not echo its reply."""

from __future__ import annotations

import base64
import logging
import socket
import threading
from collections.abc import Iterator

import httpx
import pytest

from pd_connector.bootstrap.client import BootstrapError, RouteCache
from pd_connector.bootstrap.server import BootstrapServer, BootstrapState
from pd_connector.bootstrap.signing import CallVerifier, sign_call, signed_headers
from pd_connector.config import parse_config
from pd_connector.keys import BOOTSTRAP_INFO, FRAME_INFO, derive_keys, hkdf_sha256
from tests.support.loopback import HOST, free_port

TOKEN = b"the-deployment-secret-0123456789"
AUD = "0123456789abcdef" * 2  # the id of the server the calls below are for


def test_hkdf_matches_rfc5869_test_case_1() -> None:
    okm = hkdf_sha256(b"\x0b" * 22, bytes.fromhex("f0f1f2f3f4f5f6f7f8f9"), 42, salt=bytes(range(13)))
    assert okm.hex() == ("3cb25f25faacd57a90434f64d0362f2a2d2d0a90cf1a5a4c5db02d56ecc4c5bf34007208d5b887185865")


def test_keys_differ_per_purpose_and_from_the_token() -> None:
    keys = derive_keys(TOKEN)
    assert len({keys.frame, keys.bootstrap, TOKEN}) == 3 and len(keys.frame) == len(keys.bootstrap) == 32
    assert keys.frame == hkdf_sha256(TOKEN, FRAME_INFO) and keys.bootstrap == hkdf_sha256(TOKEN, BOOTSTRAP_INFO)
    assert derive_keys(TOKEN) == keys and derive_keys(TOKEN + b"x").frame != keys.frame
    assert keys.frame.hex() not in repr(keys) and "hidden" in repr(keys)


class Clock:
    def __init__(self, now: float = 1_700_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def _verifier(clock: Clock, **kw: float) -> CallVerifier:
    return CallVerifier(derive_keys(TOKEN).bootstrap, AUD, clock=clock, monotonic=clock, **kw)  # type: ignore[arg-type]


def test_a_signed_call_is_accepted_once() -> None:
    clock = Clock()
    verifier = _verifier(clock)
    key = derive_keys(TOKEN).bootstrap
    headers = sign_call(
        key, "POST", "/bootstrap/query_dp_ranks", b'{"bootstrap_rooms":[1]}', now=clock.now, audience=AUD
    )
    auth = headers["Authorization"]
    assert TOKEN.decode() not in auth and key.hex() not in auth
    assert verifier.check("POST", "/bootstrap/query_dp_ranks", b'{"bootstrap_rooms":[1]}', auth) is None
    again = verifier.check("POST", "/bootstrap/query_dp_ranks", b'{"bootstrap_rooms":[1]}', auth)
    assert again is not None and again.status == 401 and "already used" in again.message


@pytest.mark.parametrize(
    ("method", "target", "body"),
    [
        ("GET", "/bootstrap/query_dp_ranks", b"{}"),
        ("POST", "/bootstrap/route", b"{}"),
        ("POST", "/bootstrap/query_dp_ranks", b"{ }"),
    ],
)
def test_an_altered_call_is_refused(method: str, target: str, body: bytes) -> None:
    clock = Clock()
    auth = sign_call(
        derive_keys(TOKEN).bootstrap, "POST", "/bootstrap/query_dp_ranks", b"{}", now=clock.now, audience=AUD
    )
    refusal = _verifier(clock).check(method, target, body, auth["Authorization"])
    assert refusal is not None and "does not match" in refusal.message


def test_stale_and_future_calls_are_refused() -> None:
    clock = Clock()
    verifier = _verifier(clock, window_s=60)
    key = derive_keys(TOKEN).bootstrap
    for skew in (-61, 61):
        auth = sign_call(key, "GET", "/bootstrap/route", now=clock.now + skew, audience=AUD)["Authorization"]
        refusal = verifier.check("GET", "/bootstrap/route", b"", auth)
        assert refusal is not None and "away from this server's clock" in refusal.message
    fresh = sign_call(key, "GET", "/bootstrap/route", now=clock.now - 59, audience=AUD)["Authorization"]
    assert verifier.check("GET", "/bootstrap/route", b"", fresh) is None


def test_nonce_memory_is_bounded_and_expires() -> None:
    clock = Clock()
    verifier = _verifier(clock, window_s=10, kept=3)
    key = derive_keys(TOKEN).bootstrap

    def call() -> object:
        return verifier.check(
            "GET",
            "/bootstrap/route",
            b"",
            sign_call(key, "GET", "/bootstrap/route", now=clock.now, audience=AUD)["Authorization"],
        )

    assert [call(), call(), call()] == [None, None, None]
    full = call()
    assert full is not None and full.status == 429  # never forgets a live nonce to make room
    clock.now += 21  # past twice the window: the old nonces are stale anyway, forgotten
    assert call() is None and verifier.remembered == 1


def test_server_refuses_a_replayed_call(caplog: pytest.LogCaptureFixture) -> None:
    server = BootstrapServer(BootstrapState(attn_tp_size=1, attn_dp_size=1), HOST, free_port(), TOKEN)
    server.start()
    try:
        url = f"http://{HOST}:{server.port}/bootstrap/route"
        headers = signed_headers(TOKEN, "GET", "/bootstrap/route", audience=server.server_id)
        assert httpx.get(url, headers=headers, trust_env=False).status_code == 200
        with caplog.at_level(logging.WARNING, logger="pd_connector"):
            replayed = httpx.get(url, headers=headers, trust_env=False)
        assert replayed.status_code == 401 and "already used" in replayed.json()["error"]
        assert "already used" in caplog.text and server.state.refused == 1
    finally:
        server.stop()


# ------------------------------------------------------------ a listener a client names as bootstrap


class Listener:
    """A loopback 'bootstrap server' of an attacker's: records every byte, answers 500 with text of its own."""

    REPLY_TEXT = "ATTACKER-TEXT <script>"

    def __init__(self) -> None:
        self.sock = socket.create_server((HOST, 0))
        self.sock.settimeout(0.2)
        self.port = self.sock.getsockname()[1]
        self.received = bytearray()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except TimeoutError:
                continue
            with conn:
                conn.settimeout(2)
                data = b""
                try:
                    while b"\r\n\r\n" not in data:
                        chunk = conn.recv(65536)
                        if not chunk:
                            break
                        data += chunk
                    head, _, rest = data.partition(b"\r\n\r\n")
                    length = next(
                        (
                            int(line.split(b":")[1])
                            for line in head.split(b"\r\n")
                            if line.lower().startswith(b"content-length:")
                        ),
                        0,
                    )
                    while len(rest) < length:
                        rest += conn.recv(65536)
                    self.received += head + b"\r\n\r\n" + rest
                    if head.startswith(b"GET /bootstrap/health "):  # names a server id: signed calls follow
                        body = b'{"server_id": "%s"}' % AUD.encode()
                        status = b"200 OK"
                    else:
                        body, status = self.REPLY_TEXT.encode(), b"500 Oops"
                    conn.sendall(
                        b"HTTP/1.1 %s\r\nContent-Length: %d\r\nConnection: close\r\n\r\n%s" % (status, len(body), body)
                    )
                except OSError:
                    pass

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        self.sock.close()


@pytest.fixture
def listener() -> Iterator[Listener]:
    ear = Listener()
    yield ear
    ear.close()


def test_a_named_loopback_listener_gets_nothing_to_forge_with(
    listener: Listener, tmp_path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "token"
    path.write_text(TOKEN.decode())
    cfg = parse_config("kv_consumer", {"auth_token_file": str(path)})  # D on loopback: loopback is trusted
    cache = RouteCache.for_config(cfg, timeout_s=2)
    addr = f"{HOST}:{listener.port}"  # what a client wrote into kv_transfer_params.bootstrap_host/port
    with caplog.at_level(logging.WARNING, logger="pd_connector"):
        with pytest.raises(BootstrapError) as route_err:
            cache.get(addr)
        with pytest.raises(BootstrapError) as dp_err:
            cache.query_dp_rank(addr, 7)
    got = bytes(listener.received)
    assert b"GET /bootstrap/route" in got and b"POST /bootstrap/query_dp_ranks" in got  # it was contacted
    keys = derive_keys(TOKEN)
    for secret in (TOKEN, keys.frame, keys.bootstrap):
        for form in (secret, secret.hex().encode(), base64.b64encode(secret), base64.urlsafe_b64encode(secret)):
            assert form not in got
    assert b"Bearer" not in got
    # D's error names the host, never the listener's text; the text goes to D's log only.
    for err in (route_err, dp_err):
        assert addr in str(err.value) and "ATTACKER" not in str(err.value)
    assert Listener.REPLY_TEXT in caplog.text
