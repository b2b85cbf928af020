"""A tiny Starlette app behind PDConnector's KVParamsValidationMiddleware (starlette TestClient), as vLLM's
API server would be: the echo routes, and D's or P's vLLM config on the app state (``compat_app``)."""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route
from starlette.testclient import TestClient

from pd_connector.api_server.validation import CHECKED_PATHS, KVParamsValidationMiddleware


async def echo(request: Request) -> JSONResponse:
    raw = await request.body()
    return JSONResponse({"path": request.url.path, "method": request.method, "body": raw.decode("latin-1")})


def make_app() -> Starlette:
    routes = [Route(path, echo, methods=["GET", "POST"]) for path in (*CHECKED_PATHS, "/v1/models", "/tokenize")]
    app = Starlette(routes=routes)
    app.add_middleware(KVParamsValidationMiddleware)
    return app


def post(client: TestClient, path: str, body: Any) -> Any:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    return client.post(path, content=raw, headers={"content-type": "application/json"})


class ModelConfigStub(SimpleNamespace):
    """The parts of vLLM's ModelConfig that compat.model_fingerprint reads."""

    def get_hidden_size(self) -> int:
        return self.hidden

    def get_vocab_size(self) -> int:
        return 259

    def get_total_num_kv_heads(self) -> int:
        return 2

    def get_head_size(self) -> int:
        return 32


def compat_app(
    block_size: int, dtype: str = "float32", role: str = "kv_consumer", hidden: int = 0, extra: dict | None = None
) -> Starlette:
    """``make_app`` with a PDConnector instance's vLLM config (``role``, block size, dtype, extra config)."""
    app = make_app()
    model = (
        ModelConfigStub(dtype=f"torch.{dtype}", architectures=["LlamaForCausalLM"], hidden=hidden,
                        hf_text_config=SimpleNamespace(num_hidden_layers=2))
        if hidden
        else SimpleNamespace(dtype=f"torch.{dtype}")
    )  # fmt: skip
    app.state.vllm_config = SimpleNamespace(
        kv_transfer_config=SimpleNamespace(kv_connector="PDConnector", kv_role=role, kv_connector_extra_config=extra),
        cache_config=SimpleNamespace(block_size=block_size, cache_dtype="auto"),
        model_config=model,
    )
    return app
