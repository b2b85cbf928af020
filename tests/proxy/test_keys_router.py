"""Router keys and TLS on real ``python -m proxy`` processes in front of the fake backends.

The backends record the ``Authorization`` they receive: they must see the key configured on the
Router for them, never the client's.
"""

from __future__ import annotations

import json
import ssl
import sys
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.support.key_files import secret_file, self_signed
from tests.support.router_rig import (
    FAKE_BACKEND,
    HOST,
    Backends,
    Proc,
    Router,
    RouterFactory,
    assert_openai_error,
    free_port,
    http_client,
    new_rid,
    record,
    records,
    request_body,
    router_args,
    wait_until,
)

CLIENT_KEY = "client-key-0123456789"
ADMIN_TOKEN = "admin-token-0123456789"
BACKEND_KEY = "backend-key-0123456789"


@pytest.fixture(scope="module")
def key_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    folder = tmp_path_factory.mktemp("router-keys")
    return {
        "client": secret_file(folder, "client-keys", f"other-client-key\n{CLIENT_KEY}\n"),
        "admin": secret_file(folder, "admin-token", f"{ADMIN_TOKEN}\n"),
        "backend": secret_file(folder, "backend-key", f"{BACKEND_KEY}\n"),
    }


@pytest.fixture(scope="module")
def router_keys(backends: Backends, router_factory: RouterFactory, key_files: dict[str, str]) -> Router:
    return router_factory(
        backends.ok_p,
        [backends.ok_d, backends.ok_d2],
        "--api-key-file", key_files["client"],
        "--admin-token-file", key_files["admin"],
        "--backend-api-key-file", key_files["backend"],
    )  # fmt: skip


def _bearer(secret: str, rid: str | None = None) -> dict[str, str]:
    headers = {"Authorization": f"Bearer {secret}"}
    if rid is not None:
        headers["X-Request-Id"] = rid
    return headers


def _refusals(router: Router) -> dict[tuple[str, str], float]:
    text = httpx.get(f"{router.url}/metrics", timeout=10, trust_env=False).text
    return {
        (s.labels["endpoint"], s.labels["reason"]): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == "pd_router_auth_refused_total"
    }


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_completion_needs_an_api_key_and_backends_get_the_routers_key(router_keys: Router, path: str) -> None:
    before = _refusals(router_keys)
    with http_client() as client:
        rid = new_rid("nokey")
        refused = client.post(f"{router_keys.url}{path}", json=request_body(path), headers={"X-Request-Id": rid})
        assert_openai_error(refused, 401, "authentication_error")
        assert refused.headers["www-authenticate"] == "Bearer"
        wrong = client.post(f"{router_keys.url}{path}", json=request_body(path), headers=_bearer("guess"))
        assert_openai_error(wrong, 401, "authentication_error")
        assert "guess" not in wrong.text
        # Nothing reached a backend for the refused request.
        assert records(router_keys.prefill_port, rid) == []
        assert records(router_keys.decode_port, rid) == [] and records(router_keys.decode_ports[1], rid) == []

        for stream in (False, True):
            rid = new_rid("key")
            body = request_body(path, stream=stream)
            answer = client.post(f"{router_keys.url}{path}", json=body, headers=_bearer(CLIENT_KEY, rid))
            assert answer.status_code == 200, answer.text
            p = record(router_keys.prefill_port, rid)
            d = next(r for port in router_keys.decode_ports for r in records(port, rid))
            assert p["authorization"] == d["authorization"] == f"Bearer {BACKEND_KEY}"
    after = _refusals(router_keys)
    assert after[(path, "missing")] == before.get((path, "missing"), 0) + 1
    assert after[(path, "wrong")] == before.get((path, "wrong"), 0) + 1


def test_models_needs_a_key_health_and_metrics_stay_open(router_keys: Router) -> None:
    with http_client() as client:
        assert_openai_error(client.get(f"{router_keys.url}/v1/models"), 401, "authentication_error")
        assert client.get(f"{router_keys.url}/v1/models", headers=_bearer(CLIENT_KEY)).status_code == 200
        assert_openai_error(client.get(f"{router_keys.url}/v1/nothing"), 401, "authentication_error")
        assert_openai_error(
            client.get(f"{router_keys.url}/v1/nothing", headers=_bearer(CLIENT_KEY)), 404, "not_found_error"
        )
        assert client.get(f"{router_keys.url}/health").status_code == 200
        assert client.get(f"{router_keys.url}/healthcheck").status_code == 200
        assert client.get(f"{router_keys.url}/metrics").status_code == 200


def test_admin_routes_need_the_admin_token(router_keys: Router, backends: Backends) -> None:
    url = router_keys.url
    add = {"role": "decode", "host": HOST, "port": backends.ok_d_slow}
    with http_client() as client:
        for headers in ({}, _bearer(CLIENT_KEY), _bearer("guess")):
            assert_openai_error(client.get(f"{url}/instances", headers=headers), 401, "authentication_error")
            refused = client.post(f"{url}/instances/add", json=add, headers=headers)
            assert_openai_error(refused, 401, "authentication_error")
            assert_openai_error(
                client.post(f"{url}/instances/remove", json=add, headers=headers), 401, "authentication_error"
            )
            assert_openai_error(client.post(f"{url}/reset_prefix_cache", headers=headers), 401, "authentication_error")
        listing = client.get(f"{url}/instances", headers=_bearer(ADMIN_TOKEN))
        assert listing.status_code == 200
        assert f"{HOST}:{backends.ok_d_slow}" not in listing.json()["current_decode_instances"]
        # With the token the admin routes work, and the Router sends the backends its own key.
        added = client.post(f"{url}/instances/add", json=add, headers=_bearer(ADMIN_TOKEN))
        assert added.status_code == 200, added.text
        assert added.json()["results"][0]["result"] == "added"
        removed = client.post(f"{url}/instances/remove", json=add, headers=_bearer(ADMIN_TOKEN))
        assert removed.status_code == 200, removed.text
        # The fake backends have no /reset_prefix_cache: a 500 listing each, but it was let through.
        assert client.post(f"{url}/reset_prefix_cache", headers=_bearer(ADMIN_TOKEN)).status_code == 500
        # The Router kept serving through all of it.
        rid = new_rid("after-admin")
        body = request_body("/v1/completions")
        assert client.post(f"{url}/v1/completions", json=body, headers=_bearer(CLIENT_KEY, rid)).status_code == 200
    counts = _refusals(router_keys)
    assert counts[("/instances/add", "missing")] >= 1 and counts[("/instances/add", "wrong")] >= 2
    log = router_keys.proc.log_text()
    assert "refused POST /instances/add from 127.0.0.1: wrong credential" in log
    assert CLIENT_KEY not in log and ADMIN_TOKEN not in log and "guess" not in log


def test_api_key_and_backend_key_from_the_environment(
    backends: Backends, fresh_router: RouterFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PD_ROUTER_API_KEY", "env-client-key")
    monkeypatch.setenv("PD_BACKEND_API_KEY", "env-backend-key")
    monkeypatch.setenv("OPENAI_API_KEY", "not-this-one")
    router = fresh_router(backends.ok_p, backends.ok_d)
    body = request_body("/v1/completions")
    with http_client() as client:
        assert client.post(f"{router.url}/v1/completions", json=body).status_code == 401
        rid = new_rid("env")
        response = client.post(f"{router.url}/v1/completions", json=body, headers=_bearer("env-client-key", rid))
        assert response.status_code == 200, response.text
    assert record(backends.ok_p, rid)["authorization"] == "Bearer env-backend-key"
    assert record(backends.ok_d, rid)["authorization"] == "Bearer env-backend-key"
    # Without an admin token the Router generates one and says where it is.
    assert "no admin token configured: generated one for the admin routes" in router.proc.log_text()


def test_https_router_with_a_self_signed_certificate(backends: Backends, tmp_path: Path) -> None:
    cert, key = self_signed(tmp_path)
    port = free_port()
    extra = ["--ssl-certfile", str(cert), "--ssl-keyfile", str(key), "--api-key", CLIENT_KEY]
    args = router_args(port, [backends.ok_p], [backends.ok_d], free_port(), *extra)
    proc = Proc(f"https router {port}", port, args, tmp_path / "router.log").start()
    url = f"https://{HOST}:{port}"
    verify = ssl.create_default_context(cafile=str(cert))
    try:

        def answers() -> bool:
            assert proc.popen is not None and proc.popen.poll() is None, proc.log_text()
            try:
                return httpx.get(f"{url}/healthcheck", verify=verify, timeout=1, trust_env=False).status_code == 200
            except httpx.HTTPError:
                return False

        wait_until(answers, timeout=40, interval=0.2)
        with httpx.Client(verify=verify, timeout=20, trust_env=False) as client:
            rid = new_rid("https")
            body = request_body("/v1/completions")
            response = client.post(f"{url}/v1/completions", json=body, headers=_bearer(CLIENT_KEY, rid))
            assert response.status_code == 200, response.text
            assert response.json()["choices"]
            assert client.post(f"{url}/v1/completions", json=body).status_code == 401
        assert record(backends.ok_d, rid)["authorization"] is None  # no backend key configured
        # Plain HTTP on the TLS port gets no answer; a client that does not trust the certificate fails.
        with pytest.raises(httpx.HTTPError):
            httpx.get(f"http://{HOST}:{port}/healthcheck", timeout=5, trust_env=False)
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"{url}/healthcheck", timeout=5, trust_env=False)
        assert f"Router listening on https://{HOST}:{port}" in proc.log_text()
    finally:
        proc.stop()


def _wait_https(proc: Proc, url: str, verify: ssl.SSLContext) -> None:
    def answers() -> bool:
        assert proc.popen is not None and proc.popen.poll() is None, proc.log_text()
        try:
            return httpx.get(url, verify=verify, timeout=1, trust_env=False).status_code < 500
        except httpx.HTTPError:
            return False

    wait_until(answers, timeout=40, interval=0.2)


def test_router_calls_https_backends_and_verifies_them(fresh_router: RouterFactory, tmp_path: Path) -> None:
    cert, key = self_signed(tmp_path, "backend")
    p_port, d_port = free_port(), free_port()
    tls = {"ssl_certfile": str(cert), "ssl_keyfile": str(key)}
    specs = [{"port": p_port, "mode": "ok", **tls}, {"port": d_port, "mode": "ok", **tls}]
    args = [sys.executable, str(FAKE_BACKEND), "--specs", json.dumps(specs)]
    backends_proc = Proc("https backends", p_port, args, tmp_path / "backends.log").start()
    verify = ssl.create_default_context(cafile=str(cert))
    try:
        for port in (p_port, d_port):
            _wait_https(backends_proc, f"https://{HOST}:{port}/health", verify)
        key_file = secret_file(tmp_path, "backend-key", f"{BACKEND_KEY}\n")
        verified = fresh_router(p_port, d_port, "--backend-ssl-ca-certs", str(cert), "--backend-api-key-file", key_file)
        rid = new_rid("https-backends")
        with http_client() as client:
            response = client.post(
                f"{verified.url}/v1/completions",
                json=request_body("/v1/completions"),
                headers={"X-Request-Id": rid, "Authorization": "Bearer client-side"},
            )
            assert response.status_code == 200, response.text
        for port in (p_port, d_port):
            stats = httpx.get(f"https://{HOST}:{port}/stats", verify=verify, timeout=5, trust_env=False).json()
            (seen,) = [r for r in stats["requests"] if r["request_id"] == rid]
            assert seen["authorization"] == f"Bearer {BACKEND_KEY}"
        # Without the backends' CA (system CAs only), their certificate is refused: no request is sent.
        unverified = fresh_router(p_port, d_port, "--backend-ssl", "--max-retries", "1")
        with http_client() as client:
            refused = client.post(f"{unverified.url}/v1/completions", json=request_body("/v1/completions"))
        assert refused.status_code == 503, refused.text
        assert "CERTIFICATE_VERIFY_FAILED" in refused.text or "certificate verify failed" in refused.text
    finally:
        backends_proc.stop()
