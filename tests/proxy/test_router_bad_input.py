"""The Router (``python -m proxy``) as a real process: bad client requests are refused with an OpenAI error.

Invalid JSON, wrong field types (400, the field named) and bodies over ``--max-body-size`` (413),
after which the Router keeps serving. ``router_ok`` comes from conftest.py.
"""

from __future__ import annotations

import json

import pytest

from tests.support.router_rig import (
    Backends,
    Router,
    RouterFactory,
    assert_openai_error,
    http_client,
    request_body,
)

# --- bad requests -----------------------------------------------------------------------


@pytest.mark.parametrize("payload", [b"{not json", b"[1, 2]", b"\xff\xfe", b"", b"[" * 100_000 + b"]" * 100_000])
def test_invalid_json_is_400_and_router_keeps_serving(router_ok: Router, payload: bytes) -> None:
    with http_client() as client:
        response = client.post(
            f"{router_ok.url}/v1/chat/completions", content=payload, headers={"Content-Type": "application/json"}
        )
        assert_openai_error(response, 400, "invalid_request_error")
        assert response.headers["x-request-id"]
        again = client.post(f"{router_ok.url}/v1/chat/completions", json=request_body("/v1/chat/completions"))
    assert again.status_code == 200, again.text


# --- bad input ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "extra", "param"),
    [
        ("/v1/completions", {"stream": "yes"}, "stream"),
        ("/v1/completions", {"max_tokens": "8"}, "max_tokens"),
        ("/v1/completions", {"max_tokens": True}, "max_tokens"),
        ("/v1/completions", {"prompt": 5}, "prompt"),
        ("/v1/completions", {"prompt": None}, "prompt"),
        ("/v1/completions", {"prompt": [1, "a"]}, "prompt"),
        ("/v1/completions", {"model": 3}, "model"),
        ("/v1/completions", {"stream_options": []}, "stream_options"),
        ("/v1/completions", {"kv_transfer_params": "x"}, "kv_transfer_params"),
        ("/v1/chat/completions", {"messages": "hi"}, "messages"),
        ("/v1/chat/completions", {"messages": []}, "messages"),
        ("/v1/chat/completions", {"messages": ["hi"]}, "messages"),
    ],
)
def test_wrong_types_are_400_with_the_field_named(router_ok: Router, path: str, extra: dict, param: str) -> None:
    with http_client() as client:
        response = client.post(f"{router_ok.url}{path}", json=request_body(path, **extra))
    error = assert_openai_error(response, 400, "invalid_request_error", param)
    assert param in error["message"]


@pytest.fixture(scope="session")
def router_small_body(backends: Backends, router_factory: RouterFactory) -> Router:
    return router_factory(backends.ok_p, backends.ok_d, "--max-body-size", "1k")


@pytest.mark.parametrize("chunked", [False, True])
def test_body_over_the_limit_is_413_and_router_keeps_serving(router_small_body: Router, chunked: bool) -> None:
    big = json.dumps(request_body("/v1/completions", prompt="x" * 2000)).encode()
    with http_client() as client:
        content = iter([big[:500], big[500:]]) if chunked else big
        response = client.post(
            f"{router_small_body.url}/v1/completions", content=content, headers={"Content-Type": "application/json"}
        )
        error = assert_openai_error(response, 413, "invalid_request_error")
        assert "1024" in error["message"]
        again = client.post(f"{router_small_body.url}/v1/completions", json=request_body("/v1/completions"))
    assert again.status_code == 200, again.text
