"""``python -m launch.plan_calibrate`` against a small fake OpenAI server: it measures prefills and streams,
and writes a calibration the planner and the Router's ``--path-model`` both read."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from aiohttp import web

from launch import plan_calibrate
from launch.plan import load_models
from launch.ports import free_port
from proxy.planning.live import ModelSet


def _app() -> web.Application:
    async def completions(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        prompt = body["prompt"]
        await asyncio.sleep(0.002 + 0.00002 * len(prompt))  # "prefill": grows with the prompt
        if not body.get("stream"):
            return web.json_response({"choices": [{"text": "x", "index": 0}]})
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for _ in range(body["max_tokens"]):
            await response.write(b'data: {"choices": [{"text": "x"}]}\n\n')
            await asyncio.sleep(0.001)
        await response.write(b"data: [DONE]\n\n")
        return response

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    return app


@pytest.fixture
def server() -> Iterator[str]:
    port = free_port()
    loop = asyncio.new_event_loop()
    runner = web.AppRunner(_app())
    loop.run_until_complete(runner.setup())
    loop.run_until_complete(web.TCPSite(runner, "127.0.0.1", port).start())
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)
        loop.run_until_complete(runner.cleanup())
        loop.close()


def test_calibration_is_read_by_the_planner_and_the_router(server: str, tmp_path: Path, capsys) -> None:
    out = tmp_path / "calibration.json"
    args = ["--url", server, "--model", "fake", "--repeats", "1", "--out", str(out), "--push-bytes-per-s", "2e9"]
    assert plan_calibrate.main(args) == 0
    printed = json.loads(capsys.readouterr().out)
    assert set(printed["measured"]["prefill_ms"]) == {str(n) for n in plan_calibrate.LENGTHS}
    assert set(printed["measured"]["itl_ms"]) == {str(n) for n in plan_calibrate.BATCHES}
    saved = json.loads(out.read_text())
    assert saved["transfer"]["push_bytes_per_s"] == 2e9
    assert saved["step"]["b"] > 0  # the fake's prefill grows with the prompt
    models = ModelSet.load(str(out))
    assert models.p.to_dict() == models.d.to_dict() == saved["step"]
    assert load_models(str(out)).p.to_dict() == saved["step"]


def test_bad_repeats_is_named() -> None:
    with pytest.raises(SystemExit):
        plan_calibrate.main(["--url", "http://127.0.0.1:1", "--model", "m", "--repeats", "0"])
