"""Router keys, in process: the bearer check, the admin gate, the flags."""

from __future__ import annotations

import asyncio
import json
import logging
import ssl
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import make_mocked_request

from proxy.access.api_keys import Access, BearerCheck, Gate, Refusal, access_of, is_loopback, startup_notes
from proxy.access.flags import ADMIN_TOKEN_ENV, API_KEY_ENV, BACKEND_KEY_ENV, LEGACY_BACKEND_KEY_ENV
from proxy.access.tls import client_context, server_context
from proxy.admin.instances import ADMIN_PATHS
from proxy.cli import parse_config
from proxy.router_config import AccessConfig, Backend, BackendTlsConfig
from proxy.router_metrics import RouterMetrics
from proxy.router_state import Router
from proxy.server.reply import Answer, BodyReply
from proxy.upstream.pool import BackendPool
from tests.support.key_files import secret_file, self_signed
from tests.support.router_rig import REPO_ROOT

BASE = ["--prefiller-hosts", "p1", "--prefiller-ports", "8100", "--decoder-hosts", "d1", "--decoder-ports", "8200"]
ENVS = (API_KEY_ENV, ADMIN_TOKEN_ENV, BACKEND_KEY_ENV, LEGACY_BACKEND_KEY_ENV)


@pytest.fixture(autouse=True)
def _no_key_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ENVS:
        monkeypatch.delenv(name, raising=False)


# -- the bearer check --------------------------------------------------------------------


def test_bearer_check_accepts_only_a_configured_key() -> None:
    check = BearerCheck(["k-one", "k-two"])
    assert check.check("Bearer k-one") is None
    assert check.check("bearer k-two") is None  # the scheme is case-insensitive, as in vLLM
    assert check.check("Bearer  k-two ") is None
    assert check.check("Bearer k-three") is Refusal.WRONG
    assert check.check("Bearer k-one-and-more") is Refusal.WRONG
    assert check.check("Bearer k-on") is Refusal.WRONG
    assert check.check(None) is Refusal.MISSING
    assert check.check("") is Refusal.MISSING
    assert check.check("Bearer ") is Refusal.MISSING
    assert check.check("Basic k-one") is Refusal.MISSING
    assert check.check("k-one") is Refusal.MISSING
    with pytest.raises(ValueError):
        BearerCheck([])


@pytest.mark.parametrize(
    ("remote", "loopback"),
    [
        ("127.0.0.1", True),
        ("127.8.9.10", True),
        ("::1", True),
        ("::ffff:127.0.0.1", True),
        ("10.0.0.5", False),
        ("::ffff:10.0.0.5", False),
        ("fe80::1%eth0", False),
        ("192.168.1.1", False),
        ("", False),
        (None, False),
        ("not-an-ip", False),
    ],
)
def test_is_loopback(remote: str | None, loopback: bool) -> None:
    assert is_loopback(remote) is loopback


def test_access_of_routes() -> None:
    assert access_of("/v1/completions", ADMIN_PATHS) is Access.CLIENT
    assert access_of("/v1/chat/completions", ADMIN_PATHS) is Access.CLIENT
    assert access_of("/v1/models", ADMIN_PATHS) is Access.CLIENT
    assert access_of("/v1", ADMIN_PATHS) is Access.CLIENT
    assert access_of("/v10/x", ADMIN_PATHS) is Access.PUBLIC
    for path in ("/instances", "/instances/add", "/instances/remove", "/instances/drain", "/reset_prefix_cache"):
        assert access_of(path, ADMIN_PATHS) is Access.ADMIN
    for path in ("/health", "/healthcheck", "/metrics"):
        assert access_of(path, ADMIN_PATHS) is Access.PUBLIC


# -- the gate, on requests from chosen addresses ----------------------------------------


class _Transport:
    """The one transport method a request's ``remote`` reads."""

    def __init__(self, peer: str) -> None:
        self.peer = peer

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return (self.peer, 40000) if name == "peername" else default


def _call(handler: Any, path: str, peer: str, authorization: str | None = None) -> Answer:
    headers = {"Authorization": authorization} if authorization else {}
    request = make_mocked_request("POST", path, headers=headers, transport=_Transport(peer))
    return asyncio.run(handler(request))


async def _ok(_request: web.Request) -> web.StreamResponse:
    return web.Response(text="served")


def _gate(access: AccessConfig) -> tuple[Gate, RouterMetrics]:
    metrics = RouterMetrics(BackendPool((Backend("prefill", "p", 1, 2),), (Backend("decode", "d", 3),)))
    return Gate(access, metrics, ADMIN_PATHS), metrics


def _refused(metrics: RouterMetrics, endpoint: str, reason: str) -> float:
    value = metrics.registry.get_sample_value("pd_router_auth_refused_total", {"endpoint": endpoint, "reason": reason})
    return value or 0.0


def _error(response: Answer) -> dict[str, Any]:
    assert isinstance(response, BodyReply)
    assert response.content_type == "application/json"
    return json.loads(response.body)["error"]


def test_nothing_configured_wraps_nothing_but_admin() -> None:
    gate, _ = _gate(AccessConfig())
    assert gate.wrap("/v1/completions", _ok) is _ok
    assert gate.wrap("/health", _ok) is _ok
    assert gate.wrap_fallback(_ok) is _ok
    assert gate.wrap("/instances/add", _ok) is not _ok  # refused: no admin token
    assert _gate(AccessConfig(insecure_admin=True))[0].wrap("/instances/add", _ok) is _ok


def test_without_admin_token_admin_routes_refuse_everyone_loopback_too(caplog: pytest.LogCaptureFixture) -> None:
    gate, metrics = _gate(AccessConfig())
    for path in sorted(ADMIN_PATHS):
        handler = gate.wrap(path, _ok)
        with caplog.at_level(logging.WARNING, logger="proxy"):
            for peer in ("127.0.0.1", "::1", "10.1.2.3"):
                refused = _call(handler, path, peer)
                assert refused.status == 403
                error = _error(refused)
                assert error["type"] == "permission_error" and error["code"] == 403
                assert "no admin token" in error["message"] and "--admin-token-file" in error["message"]
        assert any("from 10.1.2.3" in r.getMessage() and path in r.getMessage() for r in caplog.records)
        assert _refused(metrics, path, "no_token") == 3
        caplog.clear()


def test_a_flood_of_refused_calls_writes_a_few_lines_and_counts_all(caplog: pytest.LogCaptureFixture) -> None:
    gate, metrics = _gate(AccessConfig(api_keys=("k" * 24,)))
    handler = gate.wrap("/v1/completions", _ok)
    with caplog.at_level(logging.WARNING, logger="proxy"):
        for _ in range(40):
            assert _call(handler, "/v1/completions", "10.1.2.3", "Bearer guess").status == 401
        assert _call(handler, "/v1/completions", "10.1.2.4", "Bearer guess").status == 401  # its own lines
    lines = [r.getMessage() for r in caplog.records if "refused POST /v1/completions" in r.getMessage()]
    assert sum("from 10.1.2.3" in line for line in lines) == 10 and sum("from 10.1.2.4" in line for line in lines) == 1
    assert _refused(metrics, "/v1/completions", "wrong") == 41


def test_insecure_admin_answers_any_address() -> None:
    gate, _ = _gate(AccessConfig(insecure_admin=True))
    assert _call(gate.wrap("/instances/remove", _ok), "/instances/remove", "10.1.2.3").status == 200


def test_admin_token_is_needed_from_every_address_and_an_api_key_is_not_enough() -> None:
    gate, metrics = _gate(AccessConfig(api_keys=("client-key",), admin_token="admin-secret"))
    handler = gate.wrap("/instances/add", _ok)
    for peer in ("127.0.0.1", "10.1.2.3"):
        assert _call(handler, "/instances/add", peer, "Bearer admin-secret").status == 200
        assert _call(handler, "/instances/add", peer).status == 401
        assert _call(handler, "/instances/add", peer, "Bearer client-key").status == 401
    assert _refused(metrics, "/instances/add", "missing") == 2
    assert _refused(metrics, "/instances/add", "wrong") == 2
    # ... and the admin token is not a client key.
    client = gate.wrap("/v1/completions", _ok)
    assert _call(client, "/v1/completions", "127.0.0.1", "Bearer admin-secret").status == 401
    assert _call(client, "/v1/completions", "127.0.0.1", "Bearer client-key").status == 200


def test_api_key_refusal_is_an_openai_401() -> None:
    gate, metrics = _gate(AccessConfig(api_keys=("client-key",)))
    handler = gate.wrap("/v1/chat/completions", _ok)
    response = _call(handler, "/v1/chat/completions", "10.1.2.3")
    assert response.status == 401
    assert response.headers["WWW-Authenticate"] == "Bearer"
    error = _error(response)
    assert error["type"] == "authentication_error" and error["code"] == 401
    assert "Authorization: Bearer" in error["message"]
    wrong = _call(handler, "/v1/chat/completions", "10.1.2.3", "Bearer nope")
    assert wrong.status == 401 and "client-key" not in _error(wrong)["message"]
    assert _refused(metrics, "/v1/chat/completions", "missing") == 1
    assert _refused(metrics, "/v1/chat/completions", "wrong") == 1
    # Under /v1, an unknown path is refused before it is a 404; elsewhere it is not guarded.
    fallback = gate.wrap_fallback(_ok)
    assert _call(fallback, "/v1/nothing", "127.0.0.1").status == 401
    assert _call(fallback, "/v1/nothing", "127.0.0.1", "Bearer client-key").status == 200
    assert _call(fallback, "/other", "127.0.0.1").status == 200
    assert _refused(metrics, "/v1/*", "missing") == 1


def test_startup_notes_say_what_is_open() -> None:
    def text(access: AccessConfig, host: str = "127.0.0.1") -> str:
        return " | ".join(line for _, line in startup_notes(access, host))

    assert "refuse every call" in text(AccessConfig())
    generated = text(AccessConfig(admin_token="t", generated_token_file="/run/user/1/pd-router/admin-token-8000"))
    assert "generated one" in generated and "/run/user/1/pd-router/admin-token-8000" in generated
    assert "answer anyone" in text(AccessConfig(insecure_admin=True))
    assert "need the admin token" in text(AccessConfig(admin_token="t"))
    assert "no API key configured" in text(AccessConfig(), "0.0.0.0")
    assert "no API key configured" not in text(AccessConfig())
    assert "1 configured" in text(AccessConfig(api_keys=("k",)), "0.0.0.0")


# -- the flags ---------------------------------------------------------------------------


def test_no_keys_by_default() -> None:
    config = parse_config(BASE)
    assert config.access == AccessConfig()
    assert config.backend_authorization is None
    assert config.tls is None


def test_api_keys_from_flag_file_and_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    keys = secret_file(tmp_path, "keys", "file-key-1\n\n  file-key-2  \n")
    config = parse_config([*BASE, "--api-key", "flag-key", "--api-key-file", keys])
    assert config.access.api_keys == ("flag-key", "file-key-1", "file-key-2")
    monkeypatch.setenv(API_KEY_ENV, "env-key")
    assert parse_config(BASE).access.api_keys == ("env-key",)
    assert parse_config([*BASE, "--api-key-file", keys]).access.api_keys == ("file-key-1", "file-key-2")


def test_admin_token_from_file_or_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    token = secret_file(tmp_path, "admin", "admin-from-file\n")
    assert parse_config([*BASE, "--admin-token-file", token]).access.admin_token == "admin-from-file"
    monkeypatch.setenv(ADMIN_TOKEN_ENV, "admin-from-env")
    assert parse_config(BASE).access.admin_token == "admin-from-env"
    assert parse_config([*BASE, "--admin-token-file", token]).access.admin_token == "admin-from-file"
    assert parse_config([*BASE, "--api-key", "k"]).access.insecure_admin is False


def test_backend_key_from_file_then_env_then_openai_api_key(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(LEGACY_BACKEND_KEY_ENV, "sk-legacy")
    assert parse_config(BASE).backend_authorization == "Bearer sk-legacy"
    monkeypatch.setenv(BACKEND_KEY_ENV, "sk-env")
    assert parse_config(BASE).backend_authorization == "Bearer sk-env"
    key = secret_file(tmp_path, "backend", "sk-file\n")
    assert parse_config([*BASE, "--backend-api-key-file", key]).backend_authorization == "Bearer sk-file"


def test_secrets_are_not_in_the_config_repr(tmp_path: Path) -> None:
    token = secret_file(tmp_path, "admin", "admin-secret-value")
    backend = secret_file(tmp_path, "backend", "backend-secret-value")
    args = [*BASE, "--api-key", "client-secret-value", "--admin-token-file", token, "--backend-api-key-file", backend]
    text = repr(parse_config(args))
    assert "secret-value" not in text


def _cli_error(args: list[str], env: dict[str, str] | None = None) -> str:
    result = subprocess.run(
        [sys.executable, "-m", "proxy", *args],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert result.returncode == 2, result
    assert result.stderr.count("\n") == 1, result.stderr
    return result.stderr


def test_bad_secret_flags_are_one_line_errors_naming_the_file(tmp_path: Path) -> None:
    missing = str(tmp_path / "nothing-here")
    assert f"--api-key-file {missing}: cannot read it" in _cli_error([*BASE, "--api-key-file", missing])
    empty = secret_file(tmp_path, "empty", "\n\n")
    assert "holds no key" in _cli_error([*BASE, "--admin-token-file", empty])
    two = secret_file(tmp_path, "two", "secret-a\nsecret-b\n")
    error = _cli_error([*BASE, "--backend-api-key-file", two])
    assert "exactly one key" in error and "secret-a" not in error
    spaced = secret_file(tmp_path, "spaced", "secret with space\n")
    error = _cli_error([*BASE, "--api-key-file", spaced])
    assert "printable ASCII without spaces" in error and "secret with" not in error
    same = secret_file(tmp_path, "same", "shared-secret\n")
    assert "must differ" in _cli_error([*BASE, "--api-key", "shared-secret", "--admin-token-file", same])
    assert "--insecure-admin" in _cli_error([*BASE, "--admin-token-file", same, "--insecure-admin"])


def test_bad_tls_flags_are_one_line_errors(tmp_path: Path) -> None:
    cert = secret_file(tmp_path, "cert.pem", "not a certificate\n")
    assert "go together" in _cli_error([*BASE, "--ssl-certfile", cert])
    assert "needs --ssl-certfile" in _cli_error([*BASE, "--ssl-ca-certs", cert])
    error = _cli_error([*BASE, "--ssl-certfile", cert, "--ssl-keyfile", cert])
    assert f"cannot load the TLS certificate {cert!r}" in error


def test_server_context_from_a_generated_certificate(tmp_path: Path) -> None:
    cert, key = self_signed(tmp_path)
    config = parse_config([*BASE, "--ssl-certfile", str(cert), "--ssl-keyfile", str(key)])
    assert config.tls is not None and config.tls.certfile == str(cert)
    context = server_context(config.tls)
    assert context.verify_mode == ssl.CERT_NONE
    assert context.minimum_version == ssl.TLSVersion.TLSv1_2
    mtls = parse_config(
        [
            *BASE,
            "--ssl-certfile",
            str(cert),
            "--ssl-keyfile",
            str(key),
            "--ssl-ca-certs",
            str(cert),
            "--ssl-cert-reqs",
            "2",
        ]
    )
    assert mtls.tls is not None
    assert server_context(mtls.tls).verify_mode == ssl.CERT_REQUIRED


def test_backend_tls_flags(tmp_path: Path) -> None:
    cert, key = self_signed(tmp_path)
    assert parse_config(BASE).backend_tls is None
    assert parse_config([*BASE, "--backend-ssl"]).backend_tls == BackendTlsConfig()
    config = parse_config(
        [
            *BASE,
            "--backend-ssl-ca-certs",
            str(cert),
            "--backend-ssl-certfile",
            str(cert),
            "--backend-ssl-keyfile",
            str(key),
        ]
    )
    assert config.backend_tls == BackendTlsConfig(str(cert), str(cert), str(key))
    context = client_context(config.backend_tls)
    assert context.verify_mode == ssl.CERT_REQUIRED and context.check_hostname
    assert "needs --backend-ssl-certfile" in _cli_error([*BASE, "--backend-ssl-keyfile", str(key)])
    bad = secret_file(tmp_path, "bad-ca.pem", "not a certificate\n")
    assert f"cannot load the backends' CA certificates {bad!r}" in _cli_error([*BASE, "--backend-ssl-ca-certs", bad])


@pytest.mark.parametrize(("flags", "scheme"), [([], "http"), (["--backend-ssl"], "https")])
def test_instances_name_the_scheme_the_router_calls_backends_with(flags: list[str], scheme: str) -> None:
    router = Router(parse_config([*BASE, *flags]))
    try:
        listing = router.membership.listing()
        urls = [e["url"] for e in (*listing["prefillers"], *listing["decoders"])]
        assert urls == [f"{scheme}://p1:8100", f"{scheme}://d1:8200"]
    finally:
        router.http.close()
