"""Router keys end to end.

A second Router, with a client API key and an admin token, in front of the session stack's real
P and D (no new vLLM): calls without the key or token are refused (401) and change nothing, the
stack keeps serving, and with the key completions (JSON and stream) give the same tokens as the
session's Router.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest

from launch.processes import LOOPBACK, ManagedProcess, ProcessGroup, free_port, router_cmd, wait_http_ok
from tests.support.serving import prompt_of_length

pytestmark = pytest.mark.e2e

CLIENT_KEY = "e2e-client-key-5f0c2a"
ADMIN_TOKEN = "e2e-admin-token-91d7be"


@dataclass
class KeyedRouter:
    url: str
    process: ManagedProcess


def _secret(folder: Path, name: str, secret: str) -> str:
    path = folder / name
    path.write_text(secret + "\n")
    path.chmod(0o600)
    return str(path)


@pytest.fixture(scope="module")
def keyed_router(pd_stack, tmp_path_factory: pytest.TempPathFactory) -> Iterator[KeyedRouter]:
    folder = tmp_path_factory.mktemp("router-keys")
    port = free_port()
    cmd = [
        *router_cmd(
            port,
            [(pd_stack.host, pd_stack.prefill_port, pd_stack.bootstrap_port)],
            [(pd_stack.host, pd_stack.decode_port)],
        ),
        "--api-key-file", _secret(folder, "client-key", CLIENT_KEY),
        "--admin-token-file", _secret(folder, "admin-token", ADMIN_TOKEN),
    ]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k not in ("PD_ROUTER_API_KEY", "PD_ROUTER_ADMIN_TOKEN")}
    with ProcessGroup(folder) as group:
        process = group.start("router-keys", cmd, env=dict(env, PYTHONUNBUFFERED="1"))
        url = f"http://{LOOPBACK}:{port}"
        wait_http_ok(f"{url}/health", 60, process)
        yield KeyedRouter(url, process)


def _texts(base: str, key: str, model: str, prompt: str, stream: bool) -> list[str]:
    """The greedy completion of ``prompt`` through ``base`` by the ``openai`` client with ``key``."""
    with httpx.Client(trust_env=False, timeout=120) as http:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key=key, max_retries=0, http_client=http)
        if not stream:
            answer = client.completions.create(model=model, prompt=prompt, max_tokens=12, temperature=0)
            return [answer.choices[0].text]
        chunks = client.completions.create(model=model, prompt=prompt, max_tokens=12, temperature=0, stream=True)
        return ["".join(c.choices[0].text for c in chunks if c.choices)]


def _bearer(secret: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {secret}"}


def test_router_refuses_calls_without_key_or_admin_token_and_keeps_serving(keyed_router: KeyedRouter, pd_stack) -> None:
    url, model = keyed_router.url, pd_stack.model
    body = {"model": model, "prompt": prompt_of_length(40), "max_tokens": 4, "temperature": 0}
    bogus = {"role": "decode", "host": LOOPBACK, "port": free_port()}
    real_decoder = {"role": "decode", "host": pd_stack.host, "port": pd_stack.decode_port}
    with httpx.Client(timeout=120, trust_env=False) as client:
        before = client.get(f"{url}/instances", headers=_bearer(ADMIN_TOKEN))
        assert before.status_code == 200, before.text
        for headers in ({}, _bearer("wrong-key")):
            for response in (
                client.post(f"{url}/v1/completions", json=body, headers=headers),
                client.get(f"{url}/v1/models", headers=headers),
            ):
                assert response.status_code == 401, response.text
                assert response.json()["error"]["type"] == "authentication_error"
        # Admin calls without the admin token (none, a wrong one, the client key): refused, nothing changed.
        for headers in ({}, _bearer("wrong-token"), _bearer(CLIENT_KEY)):
            assert client.post(f"{url}/instances/add", json=bogus, headers=headers).status_code == 401
            assert client.post(f"{url}/instances/remove", json=real_decoder, headers=headers).status_code == 401
            assert client.post(f"{url}/reset_prefix_cache", headers=headers).status_code == 401
            assert client.get(f"{url}/instances", headers=headers).status_code == 401
        after = client.get(f"{url}/instances", headers=_bearer(ADMIN_TOKEN))
        assert after.json()["current_decode_instances"] == before.json()["current_decode_instances"]
        assert after.json()["waiting"] == []
        metrics = client.get(f"{url}/metrics").text
        assert 'pd_router_auth_refused_total{endpoint="/instances/add",reason="wrong"} 2.0' in metrics
        assert client.get(f"{url}/health").status_code == 200

    # With the key, the openai client's completions pass and equal the session Router's (same P and D).
    prompt = prompt_of_length(70, salt=3)
    for stream in (False, True):
        keyed = _texts(url, CLIENT_KEY, model, prompt, stream)
        plain = _texts(pd_stack.router_url, "unused", model, prompt, stream)
        assert keyed == plain and keyed[0]
    with pytest.raises(openai.AuthenticationError):
        _texts(url, "wrong-key", model, prompt, False)
    log = keyed_router.process.log_path.read_text(errors="replace")
    assert "refused POST /instances/remove from 127.0.0.1" in log
    assert CLIENT_KEY not in log and ADMIN_TOKEN not in log
