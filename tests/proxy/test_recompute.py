"""Answers a decoder cuts with ``stop_reason: "recomputed"`` (vLLM-Ascend's ``recompute_scheduler_enable``),
continued by a real Router process on a fresh pair (:mod:`proxy.strategies.recompute`).

The fake P and D run in this process (aiohttp, one thread). D "generates" `` t0``, `` t1``, ... in
order, one token an event, starting after the tokens its prompt already holds (`` t<k>`` in a text
prompt or chat messages, ids >= 1000 in a token-id prompt), so a continued answer is exactly the
one an uninterrupted D gives. A request id ``...-rc<N>x<K>-...`` makes D cut its first ``K`` answers
to that request after ``N`` tokens as vLLM-Ascend's recompute scheduler does: an event (or answer)
with ``finish_reason: "stop"``, ``stop_reason: "recomputed"`` and no new token, then usage, ``[DONE]``.
P answers like vLLM's prefill (and the first-token path's ``return_token_ids``: token id 1000 + k).
"""

from __future__ import annotations

import asyncio
import json
import re
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from tests.support.router_rig import HOST, Router, free_port, http_client, new_rid, sse_events, start_router, wait_until

TOKEN = re.compile(r" t\d+")
CUT = re.compile(r"-rc(\d+)x(\d+)-")
FIRST_ID = 1000
MAX_TOKENS = 8


def _tokens(offset: int, count: int) -> list[str]:
    return [f" t{i}" for i in range(offset, offset + count)]


def _full(count: int = MAX_TOKENS) -> str:
    return "".join(_tokens(0, count))


def _prompt_text(body: dict[str, Any]) -> str:
    if "messages" in body:
        return "".join(str(m.get("content")) for m in body["messages"])
    return str(body["prompt"])


def _offset(body: dict[str, Any]) -> int:
    prompt = body.get("prompt")
    if isinstance(prompt, list):
        return sum(1 for t in prompt if t >= FIRST_ID)
    return len(TOKEN.findall(_prompt_text(body)))


async def _health(_request: web.Request) -> web.Response:
    return web.Response()


class FakePD:
    """One fake prefiller and one fake decoder on loopback ports, served by a thread's event loop."""

    def __init__(self) -> None:
        self.p_port, self.d_port = free_port(), free_port()
        self.calls: dict[tuple[str, str], list[dict[str, Any]]] = {}
        self.loop = asyncio.new_event_loop()
        self.runners: list[web.AppRunner] = []
        started = threading.Event()
        self.thread = threading.Thread(target=self._serve, args=(started,), daemon=True)
        self.thread.start()
        assert started.wait(20), "fake P/D did not start"

    def bodies(self, role: str, rid: str, count: int | None = None) -> list[dict[str, Any]]:
        """The bodies ``role`` got for request ``rid``; with ``count``, once that many came (P is
        not waited for by the Router: its last request may arrive after the client's answer)."""
        if count is not None:
            wait_until(lambda: len(self.calls.get((role, rid), [])) >= count, timeout=5)
        return self.calls.get((role, rid), [])

    def _serve(self, started: threading.Event) -> None:
        asyncio.set_event_loop(self.loop)
        for port, handler in ((self.p_port, self._prefill), (self.d_port, self._decode)):
            app = web.Application()
            app.router.add_post("/v1/completions", handler)
            app.router.add_post("/v1/chat/completions", handler)
            app.router.add_get("/health", _health)
            runner = web.AppRunner(app)
            self.loop.run_until_complete(runner.setup())
            self.loop.run_until_complete(web.TCPSite(runner, HOST, port).start())
            self.runners.append(runner)
        started.set()
        self.loop.run_forever()

    def stop(self) -> None:
        async def cleanup() -> None:
            for runner in self.runners:
                await runner.cleanup()

        asyncio.run_coroutine_threadsafe(cleanup(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)

    def _record(self, role: str, request: web.Request, body: dict[str, Any]) -> int:
        calls = self.calls.setdefault((role, request.headers.get("X-Request-Id", "")), [])
        calls.append(body)
        return len(calls)

    async def _prefill(self, request: web.Request) -> web.Response:
        body = await request.json()
        self._record("P", request, body)
        offset = _offset(body)
        choice: dict[str, Any] = {"index": 0, "text": f" t{offset}", "finish_reason": "length", "stop_reason": None}
        if body.get("return_token_ids"):
            choice["prompt_token_ids"] = [ord(c) for c in str(body["prompt"])]
            choice["token_ids"] = [FIRST_ID + offset]
        prompt_tokens = len(_prompt_text(body))
        usage = {"prompt_tokens": prompt_tokens, "completion_tokens": 1, "total_tokens": prompt_tokens + 1}
        return web.json_response({"id": "cmpl-p", "created": 1, "model": "m", "choices": [choice], "usage": usage})

    async def _decode(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        rid = request.headers.get("X-Request-Id", "")
        number = self._record("D", request, body)
        chat = request.path.endswith("/chat/completions")
        limit = body.get("max_tokens", body.get("max_completion_tokens", 16))
        cut = CUT.search(rid)
        count, stop = limit, ("length", None)
        if cut and number <= int(cut.group(2)):
            count, stop = int(cut.group(1)), ("stop", "recomputed")
        tokens = _tokens(_offset(body), count)
        prompt = body.get("prompt")
        prompt_tokens = len(prompt) if isinstance(prompt, list) else len(_prompt_text(body))
        usage = {"prompt_tokens": prompt_tokens, "completion_tokens": count, "total_tokens": prompt_tokens + count}
        answer_id = f"cmpl-d{number}"
        if not body.get("stream"):
            text = "".join(tokens)
            choice: dict[str, Any] = {"index": 0, "finish_reason": stop[0], "stop_reason": stop[1]}
            choice.update({"message": {"role": "assistant", "content": text}} if chat else {"text": text})
            return web.json_response({"id": answer_id, "created": 1, "model": "m", "choices": [choice], "usage": usage})
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)

        async def send(choice: dict[str, Any] | None, extra: dict[str, Any] | None = None) -> None:
            payload = {"id": answer_id, "created": 1, "model": "m", "choices": [] if choice is None else [choice]}
            await response.write(b"data: " + json.dumps({**payload, **(extra or {})}).encode() + b"\n\n")

        def choice_of(text: str, finish: str | None = None, reason: str | None = None) -> dict[str, Any]:
            part = {"delta": {"content": text}} if chat else {"text": text}
            return {"index": 0, **part, "finish_reason": finish, "stop_reason": reason}

        if chat:
            await send({"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None})
        for i, token in enumerate(tokens):
            last = i == len(tokens) - 1 and stop[1] is None
            await send(choice_of(token, *(stop if last else (None, None))))
        if stop[1] is not None:
            await send(choice_of("", *stop))  # vLLM-Ascend: no new token, the request given back
        if (body.get("stream_options") or {}).get("include_usage"):
            await send(None, {"usage": usage})
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response


@pytest.fixture(scope="module")
def fake() -> Iterator[FakePD]:
    pd = FakePD()
    try:
        yield pd
    finally:
        pd.stop()


@pytest.fixture(scope="module")
def routers(fake: FakePD, proc_dir: Path) -> Iterator[dict[str, Router]]:
    made = {
        "plain": start_router(proc_dir, [fake.p_port], [fake.d_port]),
        "first": start_router(proc_dir, [fake.p_port], [fake.d_port], "--first-token-from-prefill"),
        "cap2": start_router(proc_dir, [fake.p_port], [fake.d_port], "--max-recomputes", "2"),
    }
    try:
        yield made
    finally:
        for router in made.values():
            router.proc.stop()


def _post(router: Router, path: str, rid: str, **extra: Any) -> Any:
    if path.endswith("/chat/completions"):
        body: dict[str, Any] = {"model": "m", "messages": [{"role": "user", "content": "Hi"}], **extra}
    else:
        body = {"model": "m", "prompt": "Hi", **extra}
    body.setdefault("max_tokens", MAX_TOKENS)
    with http_client() as client:
        return client.post(f"{router.url}{path}", json=body, headers={"X-Request-Id": rid})


def _stream_text(events: list[str]) -> tuple[str, list[dict[str, Any]]]:
    assert events[-1] == "[DONE]" and events.count("[DONE]") == 1, events
    payloads = [json.loads(e) for e in events[:-1]]
    text = ""
    for payload in payloads:
        for choice in payload["choices"]:
            text += choice.get("text") or (choice.get("delta") or {}).get("content") or ""
    return text, payloads


PATHS = ("/v1/completions", "/v1/chat/completions")


def _lines(router: Router, rid: str) -> str:
    return "\n".join(line for line in router.proc.log_text().splitlines() if f"rid={rid}" in line)


@pytest.mark.parametrize("path", PATHS)
def test_streamed_answer_is_continued_on_a_fresh_pair(routers: dict[str, Router], fake: FakePD, path: str) -> None:
    rid = new_rid("rc3x1-")
    response = _post(routers["plain"], path, rid, stream=True, stream_options={"include_usage": True})
    assert response.status_code == 200
    assert b"recomputed" not in response.content
    text, payloads = _stream_text(sse_events(response.content))
    assert text == _full()
    assert {p["id"] for p in payloads} == {"cmpl-d1"}  # one answer
    finishes = [c["finish_reason"] for p in payloads for c in p["choices"] if c["finish_reason"]]
    assert finishes == ["length"]
    if path.endswith("/chat/completions"):
        assert sum(1 for p in payloads for c in p["choices"] if "role" in c["delta"]) == 1
    assert payloads[-1]["usage"] == {"prompt_tokens": 2, "completion_tokens": MAX_TOKENS, "total_tokens": 10}
    p_bodies = sorted(fake.bodies("P", rid, 2), key=lambda b: len(_prompt_text(b)))  # P is not waited for
    d_bodies = fake.bodies("D", rid)
    assert len(p_bodies) == 2 and len(d_bodies) == 2
    assert d_bodies[1]["max_tokens"] == MAX_TOKENS - 3
    if path.endswith("/chat/completions"):
        continued = {"role": "assistant", "content": _full(3)}
        assert p_bodies[1]["messages"] == [{"role": "user", "content": "Hi"}, continued]
        assert p_bodies[1]["continue_final_message"] is True and p_bodies[1]["add_generation_prompt"] is False
    else:
        assert p_bodies[1]["prompt"] == "Hi" + _full(3)
    # A fresh pair: another room for the continuation.
    rooms = [b["kv_transfer_params"]["bootstrap_room"] for b in p_bodies]
    assert rooms[0] != rooms[1]


@pytest.mark.parametrize("path", PATHS)
def test_whole_answer_is_one_merged_answer(routers: dict[str, Router], fake: FakePD, path: str) -> None:
    rid = new_rid("rc2x2-")  # cut twice: three legs
    response = _post(routers["plain"], path, rid)
    assert response.status_code == 200
    answer = response.json()
    choice = answer["choices"][0]
    text = choice["message"]["content"] if path.endswith("/chat/completions") else choice["text"]
    assert text == _full()
    assert choice["finish_reason"] == "length" and choice["stop_reason"] is None
    assert answer["id"] == "cmpl-d1"
    assert answer["usage"] == {"prompt_tokens": 2, "completion_tokens": MAX_TOKENS, "total_tokens": 10}
    assert [b["max_tokens"] for b in fake.bodies("D", rid)] == [MAX_TOKENS, MAX_TOKENS - 2, MAX_TOKENS - 4]
    prompts = sorted((_prompt_text(b) for b in fake.bodies("P", rid, 3)), key=len)  # P's may arrive out of order
    assert prompts == ["Hi", "Hi" + _full(2), "Hi" + _full(4)]


def test_streamed_answer_without_usage_counts_events(routers: dict[str, Router], fake: FakePD) -> None:
    rid = new_rid("rc3x2-")
    response = _post(routers["plain"], "/v1/completions", rid, stream=True)
    text, payloads = _stream_text(sse_events(response.content))
    assert text == _full()
    assert all("usage" not in p or p["usage"] is None for p in payloads)  # only the Router asked D for it
    assert [b["max_tokens"] for b in fake.bodies("D", rid)] == [MAX_TOKENS, MAX_TOKENS - 3, MAX_TOKENS - 6]
    assert fake.bodies("D", rid)[1]["stream_options"] == {"include_usage": True}


def test_first_token_path_continues_after_p_token(routers: dict[str, Router], fake: FakePD) -> None:
    rid = new_rid("rc3x1-")
    response = _post(routers["first"], "/v1/completions", rid, stream=True, stream_options={"include_usage": True})
    assert b"recomputed" not in response.content
    text, payloads = _stream_text(sse_events(response.content))
    assert text == _full()
    assert payloads[-1]["usage"]["completion_tokens"] == MAX_TOKENS
    p_bodies, d_bodies = fake.bodies("P", rid, 2), fake.bodies("D", rid)
    assert p_bodies[0]["return_token_ids"] is True
    assert d_bodies[0]["prompt"] == [ord("H"), ord("i"), FIRST_ID] and d_bodies[0]["max_tokens"] == MAX_TOKENS - 1
    # P's token 1 and D's three: four generated, four left.
    assert p_bodies[1]["prompt"] == "Hi" + _full(4)
    assert d_bodies[1]["max_tokens"] == MAX_TOKENS - 4


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "json"])
def test_cap_on_continuations(routers: dict[str, Router], fake: FakePD, stream: bool) -> None:
    router = routers["cap2"]
    rid = new_rid("rc1x9-")  # cut every time
    response = _post(router, "/v1/completions", rid, stream=stream)
    assert response.status_code == 200
    assert len(fake.bodies("D", rid)) == 3  # the first answer and two continuations
    if stream:
        text, payloads = _stream_text(sse_events(response.content))
        reasons = [c.get("stop_reason") for p in payloads for c in p["choices"] if c["finish_reason"]]
        assert reasons == ["recomputed"]  # the answer as it is
    else:
        choice = response.json()["choices"][0]
        text = choice["text"]
        assert choice["stop_reason"] == "recomputed"
        assert response.json()["usage"]["completion_tokens"] == 3
    assert text == _full(3)
    wait_until(lambda: "2 continuations made (--max-recomputes)" in _lines(router, rid), timeout=5)
    lines = _lines(router, rid).splitlines()
    assert sum("continuation " in line and "/2:" in line for line in lines) == 2  # a line per continuation


def test_continuation_log_line(routers: dict[str, Router]) -> None:
    rid = new_rid("rc3x1-")
    assert _post(routers["plain"], "/v1/completions", rid).status_code == 200
    wait_until(lambda: "continuation 1/3" in _lines(routers["plain"], rid), timeout=5)
    lines = _lines(routers["plain"], rid).splitlines()
    assert any("stopped with recomputed after 3 tokens" in line and "continuation 1/3" in line for line in lines)


# -- the pure part (proxy.strategies.recompute_body) and the flag, in process ---------------------------------


def _event(payload: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(payload).encode() + b"\n\n"


def test_watch_holds_back_a_recomputed_event_split_over_chunks() -> None:
    from proxy.strategies.recompute_body import Progress, StreamWatch

    watch = StreamWatch(None, Progress(), leg=0, client_usage=True)
    token = _event({"id": "a", "choices": [{"text": " t0", "finish_reason": None}]})
    assert watch(token) is token  # a whole event, unchanged: passed on as it is
    cut = _event({"id": "a", "choices": [{"text": "", "finish_reason": "stop", "stop_reason": "recomputed"}]})
    usage = _event({"id": "a", "choices": [], "usage": {"prompt_tokens": 2, "completion_tokens": 1}})
    sent = watch(cut[:20]) + watch(cut[20:] + usage) + watch(b"data: [DONE]\n\n")
    assert sent == b""
    assert watch.recomputed and watch.text == " t0" and watch.leg_tokens == 1
    assert watch.held == cut + usage + b"data: [DONE]\n\n"  # what goes out should the answer end as is
    assert watch.progress.id == "a" and watch.progress.prompt_tokens == 2


def test_watch_reads_no_event_until_one_is_recomputed() -> None:
    """The first leg's events pass through unread (no JSON parsed per event of every stream); the text
    and tokens before a ``recomputed`` event are read when it comes, events split over chunks included."""
    from proxy.strategies.recompute_body import Progress, StreamWatch

    watch = StreamWatch(None, Progress(), leg=0, client_usage=False)
    quoted = _event({"id": "b", "choices": [{"text": ' "recomputed" t0', "finish_reason": None}]})
    two = _event({"id": "b", "choices": [{"text": " t1", "finish_reason": None}]})
    assert watch(quoted) is quoted and watch(two[:15]) == b"" and watch(two[15:]) == two
    assert watch.parts == [] and watch.tokens == 0 and watch.progress.id is None  # nothing read yet
    cut = _event({"id": "b", "choices": [{"text": "", "finish_reason": "stop", "stop_reason": "recomputed"}]})
    assert watch(cut) == b"" and watch.recomputed
    assert watch.text == ' "recomputed" t0 t1' and watch.leg_tokens == 2 and watch.progress.id == "b"


def test_continuation_bodies() -> None:
    from proxy.strategies.recompute_body import Progress, continuation_body, unsupported_reason

    done = Progress(text=" t0 t1", tokens=2)
    chat = {
        "messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Sure:"}],
        "continue_final_message": True,
        "add_generation_prompt": False,
        "max_completion_tokens": 5,
        "min_tokens": 1,
    }
    body = continuation_body("/v1/chat/completions", chat, done)
    assert body is not None
    assert body["messages"][-1] == {"role": "assistant", "content": "Sure: t0 t1"}  # the client's own, continued
    assert body["max_completion_tokens"] == 3 and body["min_tokens"] == 0
    assert chat["messages"][-1]["content"] == "Sure:"  # the client's body is not changed
    # No max_tokens: vLLM's default for completions (16); no budget left: no continuation.
    assert continuation_body("/v1/completions", {"prompt": ["Hi"]}, done) == {"prompt": "Hi t0 t1", "max_tokens": 14}
    assert continuation_body("/v1/completions", {"prompt": "Hi", "max_tokens": 2}, done) is None
    assert unsupported_reason("/v1/completions", {"prompt": [1, 2]}) is not None
    assert unsupported_reason("/v1/completions", {"prompt": "Hi", "n": 2}) == "n > 1"
    assert unsupported_reason("/v1/chat/completions", {"messages": [], "echo": True}) == "echo"


def test_merged_answer_concatenates_logprobs_and_token_ids() -> None:
    from proxy.strategies.recompute_body import Progress, merged_answer

    def leg(text: str, ids: list[int], stop: str | None) -> dict[str, Any]:
        logprobs = {"tokens": [text], "token_logprobs": [-0.5]}
        choice = {"text": text, "token_ids": ids, "logprobs": logprobs, "finish_reason": "stop", "stop_reason": stop}
        return {"id": f"id-{text}", "created": 1, "choices": [choice], "usage": {"prompt_tokens": 2}}

    merged = json.loads(
        merged_answer([leg("a", [1], "recomputed"), leg("b", [2], None)], Progress(text="ab", tokens=2))
    )
    choice = merged["choices"][0]
    assert merged["id"] == "id-a" and choice["text"] == "ab" and choice["stop_reason"] is None
    assert choice["token_ids"] == [1, 2]
    assert choice["logprobs"] == {"tokens": ["a", "b"], "token_logprobs": [-0.5, -0.5]}
    assert merged["usage"] == {"prompt_tokens": 2, "completion_tokens": 2, "total_tokens": 4}


def test_max_recomputes_flag() -> None:
    from proxy.cli import parse_config

    base = ["--prefiller-hosts", "h", "--prefiller-ports", "1", "--decoder-hosts", "h", "--decoder-ports", "2"]
    assert parse_config(base).max_recomputes == 3
    assert parse_config([*base, "--max-recomputes", "0"]).max_recomputes == 0
    with pytest.raises(SystemExit) as exit_info:
        parse_config([*base, "--max-recomputes", "-1"])
    assert exit_info.value.code == 2
