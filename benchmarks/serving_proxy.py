"""The benchmark's own small front ends (aiohttp, one process): `python benchmarks/serving_proxy.py MODE ...`.

- `rr URL...`: round-robin over plain vLLM instances (the colocated baseline; the Router has no
  plain mode): each POST goes to the next instance, its answer is passed through.
- `mooncake PREFILL_URL DECODE_URL BOOTSTRAP_URL ENGINE_ID`: 1P1D for vLLM's in-tree
  MooncakeConnector, the way its example proxy drives it: a fresh `transfer_id` per request,
  P gets `max_tokens: 1`, `stream: false`, `kv_transfer_params {do_remote_decode, transfer_id}`,
  D at the same time gets the client's body with `kv_transfer_params {do_remote_prefill,
  remote_engine_id, remote_bootstrap_addr, transfer_id}` (P pushes into D's blocks once its
  prefill is done); D's answer is passed through.

`GET /health` answers 200 when every backend's `/health` does.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import uuid
from typing import Any

import aiohttp
from aiohttp import web


def mooncake_bodies(body: dict[str, Any], engine_id: str, bootstrap_url: str) -> tuple[dict, dict]:
    """(P's body, D's body) of one request for vLLM's MooncakeConnector."""
    transfer_id = f"xfer-{uuid.uuid4().hex}"
    prefill = dict(body, max_tokens=1, stream=False)
    prefill.pop("stream_options", None)
    prefill["kv_transfer_params"] = {"do_remote_decode": True, "do_remote_prefill": False, "transfer_id": transfer_id}
    decode = dict(body)
    decode["kv_transfer_params"] = {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_engine_id": engine_id,
        "remote_bootstrap_addr": bootstrap_url,
        "transfer_id": transfer_id,
    }
    return prefill, decode


class Proxy:
    def __init__(self, mode: str, targets: list[str]) -> None:
        self.mode = mode
        self.targets = targets
        self.backends = targets[:2] if mode == "mooncake" else targets
        self.next_backend = itertools.cycle(self.backends)
        self.session: aiohttp.ClientSession | None = None

    async def start(self, app: web.Application) -> None:
        connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=60)
        self.session = aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=None))

    async def stop(self, app: web.Application) -> None:
        if self.session is not None:
            await self.session.close()

    async def health(self, request: web.Request) -> web.Response:
        assert self.session is not None
        for url in self.backends:
            try:
                async with self.session.get(f"{url}/health", timeout=aiohttp.ClientTimeout(total=2)) as resp:
                    if resp.status != 200:
                        return web.Response(status=503, text=f"{url}: {resp.status}")
            except (TimeoutError, aiohttp.ClientError) as exc:
                return web.Response(status=503, text=f"{url}: {exc}")
        return web.Response(text="ok")

    async def prefill(self, url: str, body: dict[str, Any]) -> None:
        assert self.session is not None
        async with self.session.post(url, json=body) as resp:
            await resp.read()

    async def completion(self, request: web.Request) -> web.StreamResponse:
        assert self.session is not None
        body = await request.json()
        if self.mode == "mooncake":
            prefill_body, body = mooncake_bodies(body, self.targets[3], self.targets[2])
            prefill = asyncio.create_task(self.prefill(f"{self.targets[0]}{request.path}", prefill_body))
            backend = self.targets[1]
        else:
            prefill, backend = None, next(self.next_backend)
        try:
            async with self.session.post(f"{backend}{request.path}", json=body) as upstream:
                response = web.StreamResponse(status=upstream.status)
                response.content_type = upstream.content_type
                await response.prepare(request)
                async for chunk in upstream.content.iter_any():
                    await response.write(chunk)
                await response.write_eof()
                return response
        finally:
            if prefill is not None:
                await asyncio.gather(prefill, return_exceptions=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("mode", choices=("rr", "mooncake"))
    parser.add_argument("targets", nargs="+")
    args = parser.parse_args()
    if args.mode == "mooncake" and len(args.targets) != 4:
        parser.error("mooncake needs PREFILL_URL DECODE_URL BOOTSTRAP_URL ENGINE_ID")
    proxy = Proxy(args.mode, args.targets)
    app = web.Application(client_max_size=64 * 1024 * 1024)
    app.on_startup.append(proxy.start)
    app.on_cleanup.append(proxy.stop)
    app.router.add_get("/health", proxy.health)
    app.router.add_post("/v1/completions", proxy.completion)
    app.router.add_post("/v1/chat/completions", proxy.completion)
    print(json.dumps({"mode": args.mode, "targets": args.targets}), flush=True)
    web.run_app(app, host=args.host, port=args.port, print=None, access_log=None)


if __name__ == "__main__":
    main()
