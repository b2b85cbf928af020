"""D first, P on demand (pd_connector.ascend.metaserver): vLLM-Ascend's layer-wise proxy's metaserver flow."""

from __future__ import annotations

import json
import ssl
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from launch.ports import free_port
from pd_connector.api_server.validation import parse_body
from pd_connector.ascend import metaserver as ms
from pd_connector.config import DisaggConfig, parse_config
from pd_connector.kv_params import DecodeParams, PrefillParams, parse_kv_params
from pd_connector.scheduler import PDScheduler
from pd_connector.scheduling.decode_first import DecodeFirstExtension
from tests.support.fake_scheduler import FakeBlocks, FakeRequest, meta
from tests.support.key_files import self_signed
from tests.support.validation_app import compat_app, post

PROXY = "http://127.0.0.1:8000/v1/metaserver"
D_FIRST = {"do_remote_decode": False, "do_remote_prefill": True, "metaserver": PROXY}
LOOPBACK = ms.trusted_metaservers_of(parse_config("kv_consumer", {}))


class Recorder:
    """Stands in for the sender: what the scheduler queued."""

    def __init__(self) -> None:
        self.posts: list[ms.Post] = []

    def submit(self, post: ms.Post) -> bool:
        self.posts.append(post)
        return True


# ------------------------------------------------------------------ parsing and trust


@pytest.mark.parametrize(
    ("params", "want"),
    [
        (D_FIRST, PROXY),
        ({**D_FIRST, "bootstrap_room": 5}, None),  # a room: an ordinary D request
        ({**D_FIRST, "do_remote_prefill": False}, None),
        ({"do_remote_prefill": True}, None),
        ({**D_FIRST, "metaserver": 7}, 7),  # malformed: check_url names it
        (None, None),
        ("x", None),
    ],
)
def test_metaserver_of(params: Any, want: Any) -> None:
    assert ms.metaserver_of(params) == want


def test_default_trust_is_loopback_only_on_a_loopback_decoder() -> None:
    assert ms.check_url(PROXY, LOOPBACK) == PROXY
    assert ms.check_url("https://localhost:9/meta", LOOPBACK)
    cluster = ms.trusted_metaservers_of(DisaggConfig(mode="decode", local_ip="10.0.0.5", bootstrap_host="10.0.0.9"))
    with pytest.raises(ms.MetaserverError, match=r"'http://127\.0\.0\.1:8000/v1/metaserver' is not trusted.*none"):
        ms.check_url(PROXY, cluster)
    with pytest.raises(ms.MetaserverError, match="10.0.0.9"):  # not even P's bootstrap host by default
        ms.check_url("http://10.0.0.9:8000/v1/metaserver", cluster)


def test_configured_trust() -> None:
    cfg = parse_config("kv_consumer", {"trusted_metaservers": "10.1.0.0/16, proxy.pd.svc"})
    trusted = ms.trusted_metaservers_of(cfg)
    assert ms.check_url("http://10.1.2.3:8000/v1/metaserver", trusted)
    assert ms.check_url("http://proxy.pd.svc:8000/v1/metaserver", trusted)
    with pytest.raises(ms.MetaserverError, match="trusted_metaservers: 10.1.0.0/16, proxy.pd.svc"):
        ms.check_url("http://127.0.0.1:8000/v1/metaserver", trusted)
    with pytest.raises(Exception, match="trusted_metaservers"):
        parse_config("kv_consumer", {"trusted_metaservers": ["not a host!"]})


@pytest.mark.parametrize(
    "url",
    [
        7,
        "",
        "ftp://127.0.0.1/x",
        "http:///x",
        "http://user:pw@127.0.0.1/x",
        "http://127.0.0.1:99999/x",
        "http://a\nb/",
        "http://[::1/x",
    ],
)
def test_malformed_urls_are_refused_naming_the_value(url: Any) -> None:
    with pytest.raises(ms.MetaserverError, match="kv_transfer_params.metaserver"):
        ms.check_url(url, LOOPBACK)


def test_posted_params_are_a_prefill_request_for_the_room(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("VLLM_DISABLE_REQUEST_ID_RANDOMIZATION", raising=False)
    body = ms.prefill_request_params("cmpl-0f3c-0-1a2b3c4d", 42)
    assert body["request_id"] == "cmpl-0f3c-0"  # the id the proxy filed (vLLM's random suffix dropped)
    assert parse_kv_params(body, room_optional=True) == PrefillParams(room=42)
    assert ms.external_request_id("chatcmpl-abc-deadbeef") == "chatcmpl-abc"
    assert ms.external_request_id("cmpl-abc-0") == "cmpl-abc-0"
    monkeypatch.setenv("VLLM_DISABLE_REQUEST_ID_RANDOMIZATION", "1")
    assert ms.external_request_id("chatcmpl-abc-deadbeef") == "chatcmpl-abc-deadbeef"


def test_middleware_parts() -> None:
    raw = json.dumps({"prompt": "x", "kv_transfer_params": D_FIRST}).encode()
    assert parse_body(raw) == (None, None)  # no 400 for a remote prefill without a room
    assert ms.refusal(raw, LOOPBACK) is None
    bad = json.dumps({"kv_transfer_params": {**D_FIRST, "metaserver": "http://203.0.113.9/v1/metaserver"}}).encode()
    assert "'http://203.0.113.9/v1/metaserver' is not trusted" in (ms.refusal(bad, LOOPBACK) or "")
    assert ms.refusal(b"not json", LOOPBACK) is None


# ------------------------------------------------------------------ scheduler


def test_scheduler_serves_a_d_first_request_and_posts_after_alloc() -> None:
    cfg = parse_config("kv_consumer", {"bootstrap_port": 18811})
    sent = Recorder()
    first = ms.DecodeFirst(cfg, sent)  # type: ignore[arg-type]
    sched = PDScheduler(cfg, block_size=16, extensions=[DecodeFirstExtension(first)])
    req = FakeRequest("cmpl-u-0-0123abcd", dict(D_FIRST), 40)
    assert sched.get_num_new_matched_tokens(req, 0) == (40, True)
    assert sent.posts == []  # nothing before D's blocks exist
    sched.update_state_after_alloc(req, FakeBlocks([3, 4, 5]), 40)
    (job,) = meta(sched).recvs
    assert (job.bootstrap_host, job.bootstrap_port, job.prefill_dp_rank) == ("127.0.0.1", 18811, None)
    assert job.dst_block_ids == [3, 4, 5]
    (post,) = sent.posts
    assert post.url == PROXY and post.room == job.room and post.request_id == req.request_id
    assert post.body == {"request_id": "cmpl-u-0", "do_remote_decode": True, "do_remote_prefill": False,
                         "bootstrap_room": job.room}  # fmt: skip
    sched.update_state_after_alloc(req, FakeBlocks([3, 4, 5]), 40)  # called again: no second post
    assert len(sent.posts) == 1
    sched.request_finished(req, [3, 4, 5])


def test_scheduler_posts_nothing_for_a_request_that_ends_before_alloc() -> None:
    cfg = parse_config("kv_consumer", {})
    sent = Recorder()
    first = ms.DecodeFirst(cfg, sent)  # type: ignore[arg-type]
    sched = PDScheduler(cfg, block_size=16, extensions=[DecodeFirstExtension(first)])
    req = FakeRequest("r-1", dict(D_FIRST), 40)
    assert sched.get_num_new_matched_tokens(req, 0) == (40, True)
    sched.request_finished(req, [])  # aborted while it queued
    assert sent.posts == [] and not first._pending
    cached = FakeRequest("r-2", dict(D_FIRST), 32)  # all in D's prefix cache: no load, no prefill asked
    assert sched.get_num_new_matched_tokens(cached, 32) == (0, False)
    assert sent.posts == [] and not first._pending


def test_scheduler_refuses_an_untrusted_metaserver(pd_logs: pytest.LogCaptureFixture) -> None:
    sched = PDScheduler(parse_config("kv_consumer", {}), block_size=16)
    req = FakeRequest("r-3", {**D_FIRST, "metaserver": "http://203.0.113.9:80/m"}, 40)
    assert sched.get_num_new_matched_tokens(req, 0) == (0, False)  # prefilled here
    assert any("'http://203.0.113.9:80/m' is not trusted" in r.getMessage() for r in pd_logs.records)


def test_decode_first_params_are_decode_params() -> None:
    first = ms.DecodeFirst(parse_config("kv_consumer", {"bootstrap_host": "127.0.0.2"}), Recorder())  # type: ignore[arg-type]
    params = first.params_of(FakeRequest("x", dict(D_FIRST), 8))
    assert isinstance(params, DecodeParams) and params.bootstrap_addr.startswith("127.0.0.2:")
    assert first.params_of(FakeRequest("y", {"do_remote_prefill": False}, 8)) is None


# ------------------------------------------------------------------ sender


class _Handler(BaseHTTPRequestHandler):
    status = 200
    seen: list[dict[str, Any]] = []

    def do_POST(self) -> None:  # noqa: N802
        body = self.rfile.read(int(self.headers["content-length"]))
        type(self).seen.append(json.loads(body))
        self.send_response(type(self).status)
        self.send_header("content-length", "4")
        self.end_headers()
        self.wfile.write(b"null")

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def server() -> Iterator[tuple[str, type[_Handler]]]:
    handler = type("H", (_Handler,), {"seen": [], "status": 200})
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}/v1/metaserver", handler
    finally:
        httpd.shutdown()
        httpd.server_close()


def _wait(cond: Any, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond() and time.monotonic() < deadline:
        time.sleep(0.01)


def test_sender_posts_off_the_callers_thread(server: tuple[str, type[_Handler]]) -> None:
    url, handler = server
    sender = ms.MetaserverSender(5.0, threads=2)
    try:
        assert sender.submit(ms.Post(url, {"request_id": "a", "bootstrap_room": 1}, 1, "a-1"))
        _wait(lambda: sender.sent == 1)
        assert handler.seen == [{"request_id": "a", "bootstrap_room": 1}] and sender.failed == 0
    finally:
        sender.close()


def test_sender_does_not_repeat_a_post_the_proxy_refused(
    server: tuple[str, type[_Handler]], pd_logs: pytest.LogCaptureFixture
) -> None:
    url, handler = server
    handler.status = 500
    sender = ms.MetaserverSender(5.0, threads=1)
    try:
        sender.submit(ms.Post(url, {}, 9, "req-9"))
        _wait(lambda: sender.failed == 1)
        assert len(handler.seen) == 1 and sender.sent == 0
        assert any("room=9 req=req-9" in r.getMessage() and "HTTP 500" in r.getMessage() for r in pd_logs.records)
    finally:
        sender.close()


def test_sender_retries_a_refused_connection_a_bounded_number_of_times(pd_logs: pytest.LogCaptureFixture) -> None:
    sender = ms.MetaserverSender(1.0, threads=1, retry_delay_s=0.01)
    try:
        sender.submit(ms.Post(f"http://127.0.0.1:{free_port()}/v1/metaserver", {}, 3, "req-3"))
        _wait(lambda: sender.failed == 1)
        assert sender.failed == 1 and sender.sent == 0
        retries = [r for r in pd_logs.records if "retrying" in r.getMessage()]
        assert len(retries) == ms.POST_ATTEMPTS - 1
    finally:
        sender.close()


def test_sender_queue_is_bounded(pd_logs: pytest.LogCaptureFixture) -> None:
    sender = ms.MetaserverSender(1.0, threads=0, limit=1)  # nobody drains it
    assert sender.submit(ms.Post(PROXY, {}, 1, "r1"))
    assert not sender.submit(ms.Post(PROXY, {}, 2, "r2"))
    assert sender.failed == 1 and any("room=2 req=r2" in r.getMessage() for r in pd_logs.records)


# ------------------------------------------------------------------ mutual TLS (tls_config)


@pytest.fixture
def mtls_server(tmp_path: Path) -> Iterator[tuple[str, type[_Handler], tuple[Path, Path], tuple[Path, Path]]]:
    """An https metaserver that requires a client certificate signed by the client's (self-signed) CA:
    (url, handler, server cert and key, client cert and key)."""
    server_pair, client_pair = self_signed(tmp_path, "metaserver"), self_signed(tmp_path, "decoder")
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(*server_pair)
    ctx.verify_mode = ssl.CERT_REQUIRED
    ctx.load_verify_locations(client_pair[0])
    handler = type("H", (_Handler,), {"seen": [], "status": 200})
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    httpd.socket = ctx.wrap_socket(httpd.socket, server_side=True)
    httpd.handle_error = lambda *_: None  # type: ignore[method-assign]  # refused handshakes
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"https://127.0.0.1:{httpd.server_address[1]}/v1/metaserver", handler, server_pair, client_pair
    finally:
        httpd.shutdown()
        httpd.server_close()


def _d_first_post(cfg: DisaggConfig, url: str) -> ms.DecodeFirst:
    """D's scheduler side takes a D-first request for ``url`` and queues its post (its own sender: cfg's TLS)."""
    first = ms.DecodeFirst(cfg)
    assert isinstance(first.params_of(FakeRequest("tls-1", {**D_FIRST, "metaserver": url}, 8)), DecodeParams)
    first.allocated("tls-1")
    return first


def test_tls_config_is_the_client_certificate_of_ds_metaserver_posts(mtls_server: Any) -> None:
    url, handler, (server_cert, _), (client_cert, client_key) = mtls_server
    tls = {"ssl_enable": True, "ssl_certfile": str(client_cert), "ssl_keyfile": str(client_key)}
    cfg = parse_config("kv_consumer", {"tls_config": {**tls, "ssl_ca_certs": str(server_cert)}})
    first = _d_first_post(cfg, url)
    try:
        sender = first._sender
        assert sender is not None
        _wait(lambda: sender.sent == 1)
        assert sender.sent == 1 and sender.failed == 0
        assert handler.seen[0]["do_remote_decode"] is True and handler.seen[0]["request_id"] == "tls-1"
    finally:
        first.close()


@pytest.mark.parametrize("with_ca_only", [False, True])
def test_without_tls_config_the_metaserver_refuses_d(mtls_server: Any, with_ca_only: bool) -> None:
    url, handler, (server_cert, _), _ = mtls_server
    extra = {"tls_config": {"ssl_enable": True, "ssl_ca_certs": str(server_cert)}} if with_ca_only else {}
    first = _d_first_post(parse_config("kv_consumer", extra), url)
    try:
        sender = first._sender
        assert sender is not None
        _wait(lambda: sender.failed == 1, timeout=15)
        assert sender.failed == 1 and sender.sent == 0 and handler.seen == []
    finally:
        first.close()


# ------------------------------------------------------------------ D's middleware


def test_middleware_refuses_an_untrusted_metaserver_with_403_and_passes_a_trusted_one() -> None:
    from starlette.testclient import TestClient

    with TestClient(compat_app(block_size=32, extra={"trusted_metaservers": ["10.9.0.0/16"]})) as c:
        ok = {**D_FIRST, "metaserver": "http://10.9.1.1:8000/v1/metaserver"}
        r = post(c, "/v1/completions", {"model": "m", "prompt": "hi", "kv_transfer_params": ok})
        assert r.status_code == 200  # no 400 for the missing room, no route check: the engine gets it
        r = post(c, "/v1/chat/completions", {"model": "m", "messages": [], "kv_transfer_params": D_FIRST})
        assert r.status_code == 403
        err = r.json()["error"]
        assert err["type"] == "kv_transfer_untrusted_metaserver" and PROXY in err["message"]
        assert "trusted_metaservers: 10.9.0.0/16" in err["message"]
    with TestClient(compat_app(block_size=32, role="kv_producer")) as c:  # P: not its business
        body = {"model": "m", "prompt": "hi", "kv_transfer_params": {**D_FIRST, "metaserver": "http://203.0.113.1/"}}
        assert post(c, "/v1/completions", body).status_code == 200
