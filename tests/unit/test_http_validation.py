"""KVParamsValidationMiddleware in front of a tiny Starlette app (starlette TestClient)."""

from __future__ import annotations

import asyncio
import json
import socket
import time
from collections.abc import Iterator
from typing import Any

import pytest
from starlette.testclient import TestClient

from pd_connector.api_server.validation import CHECKED_PATHS, KVParamsValidationMiddleware, parse_body
from pd_connector.bootstrap.client import register_rank
from pd_connector.bootstrap.server import BootstrapServer, BootstrapState
from pd_connector.messages import RegisterRank
from tests.support.loopback import free_port
from tests.support.validation_app import compat_app as _compat_app
from tests.support.validation_app import make_app, post

GOOD_D = {
    "do_remote_prefill": True,
    "bootstrap_room": 5,
    "bootstrap_host": "10.0.0.1",
    "bootstrap_port": 18800,
    "prefill_dp_rank": 0,
}
GOOD_P = {"do_remote_decode": True, "bootstrap_room": 5}


@pytest.fixture(scope="module")
def client() -> Iterator[TestClient]:
    with TestClient(make_app()) as c:
        yield c


@pytest.mark.parametrize("path", CHECKED_PATHS)
@pytest.mark.parametrize(
    ("params", "field"),
    [
        ({**GOOD_D, "bootstrap_room": -1}, "bootstrap_room"),
        ({**GOOD_D, "bootstrap_room": "\u00b2"}, "bootstrap_room"),
        ({**GOOD_D, "bootstrap_port": 70000}, "bootstrap_port"),
        ({**GOOD_D, "bootstrap_host": ""}, "bootstrap_host"),
        ({**GOOD_D, "prefill_dp_rank": "zero"}, "prefill_dp_rank"),
        ({**GOOD_D, "do_remote_decode": True}, "do_remote_decode"),
        ({"do_remote_decode": "yes", "bootstrap_room": 1}, "do_remote_decode"),
        ({"do_remote_decode": True, "bootstrap_room": "x"}, "bootstrap_room"),
        ("room-5", "kv_transfer_params must be a JSON object"),
        ([1], "kv_transfer_params must be a JSON object"),
    ],
)
def test_malformed_params_are_rejected(client: TestClient, path: str, params: Any, field: str) -> None:
    r = post(client, path, {"model": "m", "prompt": "hi", "kv_transfer_params": params})
    assert r.status_code == 400
    assert r.headers["content-type"] == "application/json"
    err = r.json()["error"]
    assert field in err["message"]
    assert err["type"] == "invalid_request_error"
    assert err["param"] == "kv_transfer_params"
    assert err["code"] == 400
    assert "path" not in r.json()  # the app never saw it


@pytest.mark.parametrize("path", CHECKED_PATHS)
@pytest.mark.parametrize(
    "body",
    [
        {"model": "m", "prompt": "hi", "kv_transfer_params": GOOD_D},
        {"model": "m", "messages": [{"role": "user", "content": "ü"}], "kv_transfer_params": GOOD_P},
        {"model": "m", "prompt": "no params"},
        {"model": "m", "prompt": "null params", "kv_transfer_params": None},
        {"model": "m", "kv_transfer_params": {}},
        # P-then-D proxies (vLLM-Ascend's) name no room; P picks one.
        {"model": "m", "prompt": "hi", "kv_transfer_params": {"do_remote_decode": True, "remote_host": None}},
        [{"kv_transfer_params": "not checked in a list body"}],
    ],
)
def test_good_requests_pass_with_body_intact(client: TestClient, path: str, body: Any) -> None:
    raw = json.dumps(body, ensure_ascii=False).encode()
    r = post(client, path, raw)
    assert r.status_code == 200
    assert r.json() == {"path": path, "method": "POST", "body": raw.decode("latin-1")}


def test_invalid_json_is_left_to_the_app(client: TestClient) -> None:
    raw = b'{"kv_transfer_params": {"bootstrap_room": -1'
    r = post(client, "/v1/completions", raw)
    assert r.status_code == 200 and r.json()["body"] == raw.decode()


def test_json_nested_past_the_recursion_limit_is_a_400(client: TestClient) -> None:
    raw = b'{"kv_transfer_params": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    r = post(client, "/v1/completions", raw)
    assert r.status_code == 400 and "too deeply" in r.json()["error"]["message"]
    assert post(client, "/v1/completions", b"{}").status_code == 200


def test_other_paths_and_methods_pass_through(client: TestClient) -> None:
    bad = json.dumps({"kv_transfer_params": {"do_remote_decode": True, "bootstrap_room": -1}}).encode()
    r = post(client, "/tokenize", bad)
    assert r.status_code == 200 and r.json()["body"] == bad.decode()
    r = client.get("/v1/models")
    assert r.status_code == 200 and r.json()["method"] == "GET"
    r = client.get("/v1/completions")
    assert r.status_code == 200 and r.json()["body"] == ""


def test_large_body_passes_intact(client: TestClient) -> None:
    body = {"model": "m", "prompt": "x" * 300_000, "kv_transfer_params": GOOD_D}
    raw = json.dumps(body).encode()
    r = post(client, "/v1/completions", raw)
    assert r.status_code == 200 and r.json()["body"] == raw.decode()


def test_server_keeps_serving_after_rejections(client: TestClient) -> None:
    for _ in range(3):
        assert post(client, "/v1/completions", {"kv_transfer_params": 5}).status_code == 400
    assert post(client, "/v1/completions", {"kv_transfer_params": GOOD_P}).status_code == 200


# -------------------------------------------------------- raw ASGI behaviour


class InnerApp:
    def __init__(self) -> None:
        self.calls: list[tuple[dict, list[dict]]] = []

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        messages = []
        if scope["type"] == "http":
            while True:
                message = await receive()
                messages.append(message)
                if message["type"] != "http.request" or not message.get("more_body", False):
                    break
        self.calls.append((scope, messages))


def run_asgi(scope: dict, incoming: list[dict]) -> tuple[InnerApp, list[dict]]:
    inner, sent, queue = InnerApp(), [], list(incoming)

    async def receive() -> dict:
        return queue.pop(0) if queue else {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        sent.append(message)

    asyncio.run(KVParamsValidationMiddleware(inner)(scope, receive, send))
    return inner, sent


HTTP_SCOPE = {"type": "http", "method": "POST", "path": "/v1/completions", "headers": []}


def test_chunked_body_is_joined_and_replayed() -> None:
    body = json.dumps({"prompt": "abc", "kv_transfer_params": GOOD_D}).encode()
    chunks = [body[:10], body[10:25], body[25:]]
    incoming = [{"type": "http.request", "body": c, "more_body": i < 2} for i, c in enumerate(chunks)]
    inner, sent = run_asgi(dict(HTTP_SCOPE), incoming)
    assert sent == []
    ((_, messages),) = inner.calls
    assert messages == [{"type": "http.request", "body": body, "more_body": False}]


def test_chunked_bad_body_is_rejected() -> None:
    body = json.dumps({"kv_transfer_params": {"do_remote_decode": True, "bootstrap_room": -3}}).encode()
    incoming = [
        {"type": "http.request", "body": body[:7], "more_body": True},
        {"type": "http.request", "body": body[7:]},
    ]
    inner, sent = run_asgi(dict(HTTP_SCOPE), incoming)
    assert inner.calls == []
    assert sent[0]["type"] == "http.response.start" and sent[0]["status"] == 400
    headers = dict(sent[0]["headers"])
    assert int(headers[b"content-length"]) == len(sent[1]["body"])
    assert "bootstrap_room" in json.loads(sent[1]["body"])["error"]["message"]


def test_disconnect_while_reading_is_passed_on() -> None:
    incoming = [{"type": "http.request", "body": b'{"a"', "more_body": True}, {"type": "http.disconnect"}]
    inner, sent = run_asgi(dict(HTTP_SCOPE), incoming)
    assert sent == []
    ((_, messages),) = inner.calls
    assert messages == [{"type": "http.disconnect"}]


def test_non_http_scope_passes_through() -> None:
    inner, sent = run_asgi({"type": "lifespan"}, [])
    assert len(inner.calls) == 1 and inner.calls[0][0] == {"type": "lifespan"} and sent == []


def test_parse_body_reports_only_malformed_params() -> None:
    assert parse_body(b"") == (None, None)
    assert parse_body(b"[]") == (None, None)
    params, error = parse_body(json.dumps({"kv_transfer_params": GOOD_D}).encode())
    assert error is None and params is not None and params.bootstrap_port == GOOD_D["bootstrap_port"]
    params, msg = parse_body(json.dumps({"kv_transfer_params": {**GOOD_D, "bootstrap_port": "x"}}).encode())
    assert params is None and msg is not None and "bootstrap_port" in msg


# ------------------------------------------- D: is the named prefill deployment compatible?


@pytest.fixture(scope="module")
def prefill_bootstrap() -> Iterator[int]:
    """A real bootstrap server with one registered P rank: block size 32, float32, 2 layers."""
    server = BootstrapServer(BootstrapState(attn_tp_size=1, attn_dp_size=1), "127.0.0.1", free_port())
    server.start()
    rank = RegisterRank(
        attn_tp_size=1, attn_tp_rank=0, attn_dp_size=1, attn_dp_rank=0, rank_ip="127.0.0.1", rank_port=7000,
        block_size=32, kv_cache_dtype="float32", num_layers=2,
        model="LlamaForCausalLM layers=2 hidden=128 vocab=259 kv_heads=2 head_size=32",
    )  # fmt: skip
    assert register_rank(f"127.0.0.1:{server.port}", rank, retries=1, interval_s=0.1, timeout_s=5)
    try:
        yield server.port
    finally:
        server.stop()


def _d_body(port: int) -> dict[str, Any]:
    params = {**GOOD_D, "bootstrap_host": "127.0.0.1", "bootstrap_port": port}
    return {"model": "m", "prompt": "hi", "kv_transfer_params": params}


def test_block_size_mismatch_with_the_prefill_deployment_is_409(prefill_bootstrap: int) -> None:
    with TestClient(_compat_app(block_size=64)) as c:
        for _ in range(2):  # the second answer comes from the cached route
            r = post(c, "/v1/completions", _d_body(prefill_bootstrap))
            assert r.status_code == 409
            err = r.json()["error"]
            assert err["type"] == "kv_transfer_incompatible" and err["code"] == 409
            assert "block size mismatch" in err["message"] and "32" in err["message"] and "64" in err["message"]
        # Requests without a remote prefill are not affected.
        assert post(c, "/v1/completions", {"model": "m", "prompt": "hi"}).status_code == 200


def test_dtype_mismatch_is_409(prefill_bootstrap: int) -> None:
    with TestClient(_compat_app(block_size=32, dtype="bfloat16")) as c:
        r = post(c, "/v1/chat/completions", _d_body(prefill_bootstrap))
        assert r.status_code == 409 and "dtype mismatch" in r.json()["error"]["message"]


def test_a_prefill_dp_rank_the_deployment_lacks_is_a_400_naming_it(prefill_bootstrap: int) -> None:
    body = _d_body(prefill_bootstrap)
    body["kv_transfer_params"]["prefill_dp_rank"] = 3
    with TestClient(_compat_app(block_size=32)) as c:
        r = post(c, "/v1/completions", body)
        assert r.status_code == 400, r.text
        message = r.json()["error"]["message"]
        assert "prefill_dp_rank 3" in message and "0..0" in message
        body["kv_transfer_params"]["prefill_dp_rank"] = 0
        assert post(c, "/v1/completions", body).status_code == 200


def test_compatible_deployment_passes(prefill_bootstrap: int) -> None:
    with TestClient(_compat_app(block_size=32)) as c:
        r = post(c, "/v1/completions", _d_body(prefill_bootstrap))
        assert r.status_code == 200 and r.json()["path"] == "/v1/completions"


def test_unreachable_bootstrap_is_a_502_naming_it_at_once() -> None:
    port = free_port()
    with TestClient(_compat_app(block_size=64)) as c:
        t0 = time.monotonic()
        for _ in range(2):  # the second answer comes from the remembered failure
            r = post(c, "/v1/completions", _d_body(port))
            assert r.status_code == 502
            err = r.json()["error"]
            assert err["type"] == "kv_transfer_bootstrap_unreachable" and f"127.0.0.1:{port}" in err["message"]
        assert time.monotonic() - t0 < 5


def test_untrusted_bootstrap_host_is_a_403_and_never_contacted() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.2", 0))
        sock.listen(1)
        sock.settimeout(0.2)
        port = sock.getsockname()[1]
        body = _d_body(port)
        body["kv_transfer_params"]["bootstrap_host"] = "127.0.0.2"
        extra = {"trusted_bootstrap_hosts": ["127.0.0.1", "fd00::/8"]}
        with TestClient(_compat_app(block_size=32, extra=extra)) as c:
            r = post(c, "/v1/completions", body)
            assert r.status_code == 403
            err = r.json()["error"]
            assert err["type"] == "kv_transfer_untrusted_bootstrap"
            assert f"127.0.0.2:{port} is not trusted" in err["message"] and "fd00::/8" in err["message"]
            body["kv_transfer_params"]["bootstrap_host"] = "::1"  # IPv6 alike (not on this list)
            r = post(c, "/v1/completions", body)
            assert r.status_code == 403 and f"[::1]:{port}" in r.json()["error"]["message"]
        with pytest.raises(TimeoutError):
            sock.accept()


def test_the_check_reads_routes_with_this_instances_token(monkeypatch: pytest.MonkeyPatch) -> None:
    token = "middleware-test-token-0123456789"
    monkeypatch.setenv("PD_TEST_TOKEN", token)
    server = BootstrapServer(BootstrapState(attn_tp_size=1, attn_dp_size=1), "127.0.0.1", free_port(), token.encode())
    server.start()
    try:
        rank = RegisterRank(1, 0, 1, 0, "127.0.0.1", 7000, 32, "float32", num_layers=2)
        assert register_rank(f"127.0.0.1:{server.port}", rank, 1, 0.1, 5, token=token.encode())
        with TestClient(_compat_app(block_size=64, extra={"auth_token_env": "PD_TEST_TOKEN"})) as c:
            r = post(c, "/v1/completions", _d_body(server.port))
            assert r.status_code == 409 and "block size mismatch" in r.json()["error"]["message"]
        with TestClient(_compat_app(block_size=64)) as c:  # no token: P refuses D, named at once
            r = post(c, "/v1/completions", _d_body(server.port))
            assert r.status_code == 502 and "HTTP 401" in r.json()["error"]["message"]
        assert server.state.refused == 1
    finally:
        server.stop()


def test_prefill_instances_are_not_checked(prefill_bootstrap: int) -> None:
    with TestClient(_compat_app(block_size=64, role="kv_producer")) as c:
        assert post(c, "/v1/completions", _d_body(prefill_bootstrap)).status_code == 200


def test_model_mismatch_is_409(prefill_bootstrap: int) -> None:
    with TestClient(_compat_app(block_size=32, hidden=256)) as c:
        r = post(c, "/v1/completions", _d_body(prefill_bootstrap))
        assert r.status_code == 409
        message = r.json()["error"]["message"]
        assert "model mismatch" in message and "hidden=128" in message and "hidden=256" in message
    with TestClient(_compat_app(block_size=32, hidden=128)) as c:
        assert post(c, "/v1/completions", _d_body(prefill_bootstrap)).status_code == 200
