"""A stand-in for a vLLM OpenAI server, for testing the Router with real HTTP processes.

Run one: ``python tests/support/fake_backend.py --port 9001 --mode ok``; or several in one
process (each on its own port): ``--specs '[{"port": 9001, "mode": "ok"}, ...]'`` (keys: the
long options below, with underscores). Modes:

- ``ok``: answers ``/v1/completions`` and ``/v1/chat/completions`` like vLLM (JSON, or an
  SSE stream of ``data: {...}`` chunks ending with ``data: [DONE]`` when ``stream`` is true,
  with a usage chunk when ``stream_options.include_usage`` is true), echoing the
  ``kv_transfer_params`` it received and its own port (``served_by``);
- ``fail500`` / ``fail400``: answers HTTP 500 / 400 with an OpenAI-style error body (after ``--delay`` seconds);
- ``incompatible``: a PD request (``kv_transfer_params``, no ``return_token_ids``) gets HTTP 409
  ``kv_transfer_incompatible``, as PDConnector's D middleware answers a block-size mismatch;
- ``hang``: never answers; notices when the caller closes the connection;
- ``slow_stream``: streams ``--chunks`` chunks, one every ``--chunk-interval`` seconds;
- ``die_mid_stream``: streams ``--chunks`` chunks, then drops the connection (no end of stream);
- ``error_event``: a stream whose first event is an error event (as vLLM sends when generation
  fails after its headers went out), then ``data: [DONE]``.

``--stream-delay`` holds a stream's first chunk back after its headers were sent (vLLM sends
the headers of a stream at once and its first chunk once D has the KV and a token).
``--done-linger`` keeps a stream open that long after its ``data: [DONE]`` event.
Spec keys only: ``metrics`` serves ``GET /metrics`` like a PDConnector decoder (requests running,
KV rooms held 0, ``vllm:pd_kv_sent_bytes_total``: a stream aborted while its kv_transfer_params
named a ``migrate_room`` counts KV_BYTES_PER_TOKEN per prompt and sent token, as a drained decoder
pushing it); ``fail_bootstrap_port`` answers HTTP 500 to a request whose KV comes from that
bootstrap port (a failed KV load); ``held_last`` (die_mid_stream, ``return_token_ids``): the last
event before the drop names one more token, HELD_ID, whose text is held (as when vLLM merges two
steps into one event and the second ends inside a character).

``POST /detokenize`` answers like vLLM's: ``{"prompt": text}`` of ``tokens`` (GENERATED_ID_BASE + i:
``tok<i> ``, HELD_ID: U+FFFD, any other id: that character); ``/stats`` lists each call's
X-Request-Id (``detokenized_for``).

Every generation request is recorded; ``GET /stats`` returns the counts of started,
completed and disconnected requests and the records (path, X-Request-Id, Authorization,
body, state), so tests can check what the Router sent and whether it closed a request.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from collections.abc import AsyncIterator
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

MODES = ("ok", "fail500", "fail400", "incompatible", "hang", "slow_stream", "die_mid_stream", "error_event")
TOKENS = ("Hello", ",", " world", "!")
POLL_S = 0.02


#: The token id a ``return_token_ids`` answer names for its one generated token.
FIRST_TOKEN_ID = 101
#: Streamed ``tok<i>`` tokens have id GENERATED_ID_BASE + i (``return_token_ids``).
GENERATED_ID_BASE = 1000
#: A text prompt holding this gets a token 1 without text (the first bytes of a character): P's
#: ``return_token_ids`` answer has text "", and a stream for that prompt starts with an empty chunk.
PARTIAL_MARK = "[partial]"
#: ``held_last``: the token whose text is still held when the stream drops (a generated id, so a
#: resumed leg given it in its prompt would go on one token too far).
HELD_ID = GENERATED_ID_BASE + 500
#: The context length ``GET /v1/models`` names (as vLLM's model card does).
MAX_MODEL_LEN = 2048
#: ``metrics``: KV bytes "pushed" per token of an aborted request with a migrate room.
KV_BYTES_PER_TOKEN = 1024


def prompt_ids(prompt: Any) -> list[int]:
    """The fake's "tokenization": token ids as given, else one id per character."""
    if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
        return list(prompt)
    return [ord(c) for c in str(prompt)]


def _token_text(token: int) -> str:
    """The fake's text of one token id (``/detokenize``)."""
    if token == HELD_ID:
        return "\ufffd"
    return f"tok{token - GENERATED_ID_BASE} " if token >= GENERATED_ID_BASE else chr(token)


def _completion(path: str, rid: str, text: str, kv: Any, port: int, body: dict[str, Any]) -> dict[str, Any]:
    base = {"id": f"cmpl-{rid}", "created": int(time.time()), "model": "fake-model", "kv_transfer_params": kv}
    usage = {"prompt_tokens": 3, "completion_tokens": len(TOKENS), "total_tokens": 3 + len(TOKENS)}
    if body.get("return_token_ids") and not path.endswith("/chat/completions"):
        # Like vLLM: the prompt's ids and the generated ones in the choice (one token: max_tokens 1).
        ids = prompt_ids(body.get("prompt"))
        usage = {"prompt_tokens": len(ids), "completion_tokens": 1, "total_tokens": len(ids) + 1}
        choice = {
            "index": 0,
            "text": "" if PARTIAL_MARK in str(body.get("prompt")) else TOKENS[0],
            "logprobs": None,
            "finish_reason": "length",
            "stop_reason": None,
            "prompt_token_ids": ids,
            "token_ids": [FIRST_TOKEN_ID],
        }
        return {**base, "object": "text_completion", "choices": [choice], "usage": usage, "served_by": port}
    if path.endswith("/chat/completions"):
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "length"}
        return {**base, "object": "chat.completion", "choices": [choice], "usage": usage, "served_by": port}
    choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": "length"}
    return {**base, "object": "text_completion", "choices": [choice], "usage": usage, "served_by": port}


def _usage_chunk(path: str, rid: str, completion_tokens: int, prompt_tokens: int = 3) -> bytes:
    obj = "chat.completion.chunk" if path.endswith("/chat/completions") else "text_completion"
    total = prompt_tokens + completion_tokens
    usage = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens, "total_tokens": total}
    payload = {"id": f"cmpl-{rid}", "object": obj, "model": "fake-model", "choices": [], "usage": usage}
    return b"data: " + json.dumps(payload).encode() + b"\n\n"


def _chunk(
    path: str, rid: str, index: int, token: str | None, kv: Any, port: int, ids: dict[str, Any] | None = None
) -> bytes:
    """One stream event; ``ids``: the ``prompt_token_ids``/``token_ids`` a ``return_token_ids``
    completions request gets in it (as vLLM: the prompt's on the first event only)."""
    chat = path.endswith("/chat/completions")
    finish = None if token is not None else "length"
    if chat:
        delta: dict[str, Any] = {"content": token} if token is not None else {}
        if index == 0:
            delta["role"] = "assistant"
        choice: dict[str, Any] = {"index": 0, "delta": delta, "finish_reason": finish}
        if ids is not None:  # like vLLM: the generated ids in the choice, the prompt's at the top
            choice["token_ids"] = ids["token_ids"]
        obj = "chat.completion.chunk"
    else:
        choice = {"index": 0, "text": token or "", "logprobs": None, "finish_reason": finish, **(ids or {})}
        obj = "text_completion"
    payload: dict[str, Any] = {"id": f"cmpl-{rid}", "object": obj, "model": "fake-model", "choices": [choice]}
    if chat and ids is not None and index == 0:
        payload["prompt_token_ids"] = ids["prompt_token_ids"]
    if index == 0:
        payload["kv_transfer_params"] = kv
        payload["served_by"] = port
    return b"data: " + json.dumps(payload).encode() + b"\n\n"


def build_app(
    mode: str,
    port: int,
    delay: float,
    chunks: int,
    chunk_interval: float,
    stream_delay: float = 0.0,
    done_linger: float = 0.0,
    metrics: bool = False,
    fail_bootstrap_port: int | None = None,
    held_last: bool = False,
) -> FastAPI:
    """The fake server for one behaviour ``mode``."""
    app = FastAPI()
    records: list[dict[str, Any]] = []
    sent_bytes = [0]
    detokenized_for: list[str] = []  # the X-Request-Id of each /detokenize call

    async def sleep_or_disconnect(request: Request, seconds: float | None) -> bool:
        """Sleep (forever when ``seconds`` is None); return True early if the client went away."""
        end = None if seconds is None else time.monotonic() + seconds
        while end is None or time.monotonic() < end:
            if await request.is_disconnected():
                return True
            await asyncio.sleep(POLL_S)
        return await request.is_disconnected()

    async def generate(request: Request) -> Response:
        path = request.url.path
        body = await request.json()
        rid = request.headers.get("x-request-id", "")
        record: dict[str, Any] = {
            "path": path,
            "request_id": rid,
            "authorization": request.headers.get("authorization"),
            "body": body,
            "state": "started",
        }
        records.append(record)
        kv = body.get("kv_transfer_params")
        stream = body.get("stream") is True

        if mode == "hang":
            await sleep_or_disconnect(request, None)
            record["state"] = "disconnected"
            return Response(status_code=499)

        if mode == "incompatible" and isinstance(kv, dict) and kv.get("do_remote_prefill"):
            # Like PDConnector's D middleware for a pair that can never transfer (a block-size mismatch).
            record["state"] = "completed"
            message = f"block size mismatch: the prefill deployment uses --block-size 32, fake {port} 64"
            error = {"message": message, "type": "kv_transfer_incompatible", "param": "kv_transfer_params", "code": 409}
            return JSONResponse({"error": error}, status_code=409)

        if fail_bootstrap_port is not None and isinstance(kv, dict) and kv.get("bootstrap_port") == fail_bootstrap_port:
            record["state"] = "completed"
            error = {"message": f"fake backend {port}: KV load failed", "type": "InternalServerError", "code": 500}
            return JSONResponse({"error": error, "object": "error"}, status_code=500)

        if mode in ("fail500", "fail400"):
            if await sleep_or_disconnect(request, delay):
                record["state"] = "disconnected"
                return Response(status_code=499)
            record["state"] = "completed"
            code = 500 if mode == "fail500" else 400
            kind = "InternalServerError" if code == 500 else "BadRequestError"
            error = {"message": f"fake backend {port} failed on purpose", "type": kind, "code": code}
            return JSONResponse({"error": error, "object": "error"}, status_code=code)

        if await sleep_or_disconnect(request, delay):
            record["state"] = "disconnected"
            return Response(status_code=499)

        if not stream:
            if mode == "slow_stream" and await sleep_or_disconnect(request, chunks * chunk_interval):
                record["state"] = "disconnected"
                return Response(status_code=499)
            record["state"] = "completed"
            return JSONResponse(_completion(path, rid, "".join(TOKENS), kv, port, body))

        token_ids = body.get("return_token_ids") is True
        if path.endswith("/chat/completions"):  # the fake's chat "template": the messages' contents
            prompt_text: Any = "".join(str(m.get("content")) for m in body.get("messages") or () if isinstance(m, dict))
        else:
            prompt_text = body.get("prompt")
        prompt = prompt_ids(prompt_text) if token_ids else []
        if mode in ("slow_stream", "die_mid_stream"):
            # A "model" that goes on from what it generated: a prompt ending in its own token ids
            # (GENERATED_ID_BASE + i, a resumed stream) continues at the next token.
            start = sum(1 for t in prompt if t >= GENERATED_ID_BASE)
            tokens = [f"tok{i} " for i in range(start, chunks)]
            interval = chunk_interval
        else:
            tokens = list(TOKENS)
            if isinstance(body.get("prompt"), str) and PARTIAL_MARK in body["prompt"]:
                tokens.insert(0, "")
            interval = 0.005
        usage = isinstance(body.get("stream_options"), dict) and body["stream_options"].get("include_usage") is True

        if mode == "error_event":

            async def failing() -> AsyncIterator[bytes]:
                record["state"] = "completed"
                error = {
                    "message": f"fake backend {port}: generation failed",
                    "type": "InternalServerError",
                    "code": 500,
                }
                yield b"data: " + json.dumps({"error": error}).encode() + b"\n\n"
                yield b"data: [DONE]\n\n"

            return StreamingResponse(failing(), media_type="text/event-stream")

        async def events() -> AsyncIterator[bytes]:
            finished = False
            sent = 0
            try:
                # Like vLLM: the status line and headers go out at once, data once tokens exist.
                if stream_delay and await sleep_or_disconnect(request, stream_delay):
                    return
                for index, token in enumerate(tokens):
                    if index and await sleep_or_disconnect(request, interval):
                        return
                    ids = None
                    if token_ids:
                        gen = GENERATED_ID_BASE + int(token[3:]) if token.startswith("tok") else GENERATED_ID_BASE
                        held = [HELD_ID] if held_last and mode == "die_mid_stream" and index == len(tokens) - 1 else []
                        ids = {"prompt_token_ids": prompt if index == 0 else None, "token_ids": [gen, *held]}
                    yield _chunk(path, rid, index, token, kv, port, ids)
                    sent += 1
                if mode == "die_mid_stream":
                    record["state"] = "died"
                    raise RuntimeError("fake backend dies mid-stream on purpose")
                end_ids = {"prompt_token_ids": None, "token_ids": []} if token_ids else None
                yield _chunk(path, rid, len(tokens), None, kv, port, end_ids)
                if usage:
                    yield _usage_chunk(path, rid, len(tokens), len(prompt) if token_ids else 3)
                yield b"data: [DONE]\n\n"
                finished = True
                if done_linger:
                    await sleep_or_disconnect(request, done_linger)
            finally:
                if not finished and isinstance(kv, dict) and kv.get("migrate_room") is not None:
                    sent_bytes[0] += KV_BYTES_PER_TOKEN * (len(prompt_ids(body.get("prompt"))) + sent)
                if record["state"] != "died":
                    record["state"] = "completed" if finished else "disconnected"

        return StreamingResponse(events(), media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await generate(request)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await generate(request)

    @app.post("/detokenize")
    async def detokenize(request: Request) -> dict[str, Any]:
        detokenized_for.append(request.headers.get("x-request-id", ""))
        tokens = (await request.json()).get("tokens") or []
        return {"prompt": "".join(_token_text(t) for t in tokens)}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        card = {"id": "fake-model", "object": "model", "owned_by": f"fake-{port}", "max_model_len": MAX_MODEL_LEN}
        return {"object": "list", "data": [card]}

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200)

    if metrics:

        @app.get("/metrics")
        async def prometheus() -> Response:
            running = sum(1 for r in records if r["state"] == "started")
            text = (
                f"vllm:num_requests_running {running}\nvllm:num_requests_waiting 0\nvllm:pd_kv_rooms_held 0\n"
                f"# TYPE vllm:pd_kv_sent_bytes counter\nvllm:pd_kv_sent_bytes_total {sent_bytes[0]}\n"
            )
            return Response(text, media_type="text/plain")

    @app.get("/stats")
    async def stats() -> dict[str, Any]:
        counts = {state: sum(1 for r in records if r["state"] == state) for state in ("completed", "disconnected")}
        return {
            "mode": mode,
            "started": len(records),
            **counts,
            "detokenized_for": detokenized_for,
            "requests": records,
        }

    return app


SPEC_KEYS = {
    "port",
    "mode",
    "delay",
    "chunks",
    "chunk_interval",
    "stream_delay",
    "done_linger",
    "metrics",
    "fail_bootstrap_port",
    "held_last",
}
#: Optional spec keys: serve HTTPS with this certificate and key.
TLS_KEYS = {"ssl_certfile", "ssl_keyfile"}


async def serve(specs: list[dict[str, Any]], host: str) -> None:
    """Serve every spec (one fake backend per port) in this process until SIGINT/SIGTERM."""
    servers = []
    for spec in specs:
        unknown = set(spec) - SPEC_KEYS - TLS_KEYS
        if unknown:
            raise SystemExit(f"unknown spec keys {sorted(unknown)}")
        app = build_app(
            spec.get("mode", "ok"),
            spec["port"],
            spec.get("delay", 0.0),
            spec.get("chunks", 100),
            spec.get("chunk_interval", 0.2),
            spec.get("stream_delay", 0.0),
            spec.get("done_linger", 0.0),
            spec.get("metrics", False),
            spec.get("fail_bootstrap_port"),
            spec.get("held_last", False),
        )
        tls = {k: spec[k] for k in TLS_KEYS if k in spec}
        config = uvicorn.Config(app, host=host, port=spec["port"], log_level="warning", access_log=False, **tls)
        servers.append(uvicorn.Server(config))
    await asyncio.gather(*(server.serve() for server in servers))


def main() -> None:
    """Parse the flags and serve."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int)
    parser.add_argument("--mode", choices=MODES, default="ok")
    parser.add_argument("--delay", type=float, default=0.0, help="seconds to wait before answering")
    parser.add_argument("--chunks", type=int, default=100, help="slow_stream, die_mid_stream: number of chunks")
    parser.add_argument("--chunk-interval", type=float, default=0.2, help="slow_stream: seconds between chunks")
    parser.add_argument("--stream-delay", type=float, default=0.0, help="seconds between headers and first chunk")
    parser.add_argument("--done-linger", type=float, default=0.0, help="seconds a stream stays open after [DONE]")
    parser.add_argument("--specs", help="JSON list of backends to serve in this process (instead of --port ...)")
    args = parser.parse_args()
    if args.specs:
        specs = json.loads(args.specs)
    elif args.port is not None:
        specs = [
            {
                "port": args.port,
                "mode": args.mode,
                "delay": args.delay,
                "chunks": args.chunks,
                "chunk_interval": args.chunk_interval,
                "stream_delay": args.stream_delay,
                "done_linger": args.done_linger,
            }
        ]
    else:
        parser.error("give --port (and --mode) or --specs")
    for spec in specs:
        if spec.get("mode", "ok") not in MODES:
            parser.error(f"unknown mode {spec.get('mode')!r}")
    asyncio.run(serve(specs, args.host))


if __name__ == "__main__":
    main()
