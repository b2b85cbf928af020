"""A decoder lost mid-run: first drained under load, then killed. No client sees an error or a hang.

Module setup: ONE extra decode instance (a second consumer of the session stack's prefiller), shared
by the tests below, which run in file order:

1. drain: 8 long greedy streams run through a Router in front of P and both decoders; the extra
   decoder (started with the connector's ``migration``, its own bootstrap server, and known to the
   Router through ``--decoder-bootstrap-ports``) is drained (``POST /instances/drain``) once its
   streams are under way. Its streams move WITH THEIR KV (proxy/strategies/kv_move.py): the extra decoder
   holds each aborted request's blocks as its migrate room and pushes them to the stack's decoder,
   which computes nothing of the prompt or the tokens already sent (``kv_bytes_moved`` > 0, no replay).
2. kill: the drained decoder is idle again (checked); a fresh Router sends it streams again (completions
   and one chat) and the test SIGKILLs its process group while streams run on both decoders: they resume on
   the live one, the chat as the same chat.
3. no KV left on P for the dead decoder.

Between 1 and 2, chat: one greedy streamed chat on each decoder, the extra one drained while its stream
runs; the moved chat goes on as a completions leg re-shaped into chat chunks, equal to its twin and
beginning with the colocated reference's chat answer.

Each test starts its own Router (``--trust-client-room``: even rooms go to the stack's decoder, odd
rooms to the extra one), so the drain's removal of the extra decoder does not carry over. Rooms 2k
and 2k+1 stream the same prompt: the even room's stream, never moved, is the uninterrupted run the
odd one must equal token for token (greedy). That a stream with no decoder left ends with an error
event is tests/proxy/test_resume.py's.
"""

from __future__ import annotations

import json
import os
import re
import signal
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from launch.processes import (
    ManagedProcess,
    PDStack,
    ProcessGroup,
    free_port,
    free_ports,
    router_cmd,
    vllm_env,
    vllm_serve_cmd,
    wait_http_ok,
)
from launch.sse import sse_lines
from proxy.access.admin_token import admin_headers
from tests.support.metrics import metric
from tests.support.serving import D_KV_WAIT_TIMEOUT_S, P_ROOM_TIMEOUT_S, START_TIMEOUT_S, wait_kv_free
from tests.support.streams import (
    Outcome,
    held,
    running_requests,
    short_completion,
    stream_completion,
)

pytestmark = pytest.mark.e2e

#: Drain: the drain fires as soon as the extra decoder's streams run, so 800 tokens leave it streams to move.
DRAIN_STREAM_TOKENS = 800
DRAIN_CLIENT_BOUND_S = 300.0
#: Kill: every client must be done this long after the kill (its stream resumed and finished: never a hang).
KILL_CLIENT_BOUND_S = 150.0
KILL_STREAM_TOKENS = 1900  # prompt 60 + 1900 fits --max-model-len 2048


@dataclass
class ExtraDecoder:
    """The module's extra decode instance and the group that owns it (and the tests' Routers)."""

    group: ProcessGroup
    process: ManagedProcess
    host: str
    port: int
    bootstrap_port: int

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"


@dataclass
class RoutedPair:
    """A Router in front of the stack's P, the stack's decoder (even rooms) and the extra one (odd rooms)."""

    url: str
    process: ManagedProcess

    @property
    def port(self) -> int:
        return int(self.url.rsplit(":", 1)[1])


@pytest.fixture(scope="module")
def extra_decoder(pd_stack: PDStack, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ExtraDecoder]:
    with ProcessGroup(tmp_path_factory.mktemp("decoder-loss-logs")) as group:
        port, bootstrap_port = free_ports(2)
        cmd = vllm_serve_cmd(
            pd_stack.model,
            port,
            kv_role="kv_consumer",
            bootstrap_port=bootstrap_port,  # its own bootstrap server: other decoders load its KV from it
            extra_config={"kv_wait_timeout_s": D_KV_WAIT_TIMEOUT_S, "migration": True},
        )
        process = group.start("decode-extra", cmd, env=vllm_env("1"))
        wait_http_ok(f"http://{pd_stack.host}:{port}/health", START_TIMEOUT_S, process)
        yield ExtraDecoder(group=group, process=process, host=pd_stack.host, port=port, bootstrap_port=bootstrap_port)


def start_router(pd_stack: PDStack, extra: ExtraDecoder, name: str) -> RoutedPair:
    """A Router (~1 s to start) in ``extra``'s group, in front of P and both decoders, healthy."""
    host = pd_stack.host
    port = free_port()
    cmd = router_cmd(
        port,
        [(host, pd_stack.prefill_port, pd_stack.bootstrap_port)],
        [(host, pd_stack.decode_port), (extra.host, extra.port)],
        host=host,
    )
    # A slow health answer on this loaded machine must not send the odd rooms to the live decoder.
    cmd += ["--health-interval", "1", "--health-timeout", "15", "--trust-client-room"]
    cmd += ["--decoder-bootstrap-ports", "0", str(extra.bootstrap_port)]  # the extra decoder moves by KV
    process = extra.group.start(name, cmd, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    url = f"http://{host}:{port}"
    wait_http_ok(f"{url}/health", 60, process)
    return RoutedPair(url=url, process=process)


@pytest.fixture
def drain_router(pd_stack: PDStack, extra_decoder: ExtraDecoder) -> Iterator[RoutedPair]:
    router = start_router(pd_stack, extra_decoder, "router-drain")
    yield router
    extra_decoder.group.stop(router.process)


@pytest.fixture(scope="module")
def kill_router(pd_stack: PDStack, extra_decoder: ExtraDecoder) -> RoutedPair:
    """The kill test's Router (kept for the test after it, which reads its log); stopped with the group."""
    return start_router(pd_stack, extra_decoder, "router-kill")


def warm_up(router: RoutedPair, model: str) -> None:
    """Warm both decoders up (and check the room rule: odd rooms reach the extra decoder)."""
    for room in (2, 3):
        response = short_completion(router.url, model, room)
        assert response.status_code == 200, response.text


def wait_streams_on_extra(on_extra: list[int], started: list[int], extra_url: str, poll_s: float) -> float:
    """Wait until every stream in ``on_extra`` is under way and the extra decoder runs at least one of them.

    The last of them has barely begun then, so at least one is still running however fast this machine
    generates. Returns the extra decoder's running gauge last read (0: the Router sent them elsewhere).
    """
    deadline = time.monotonic() + 120
    running = 0.0
    while time.monotonic() < deadline:
        if set(on_extra) <= set(started):
            running = running_requests(extra_url)
            if running >= 1:
                break
        time.sleep(poll_s)
    assert set(on_extra) <= set(started), f"streams on the extra decoder did not start: {sorted(started)}"
    return running


def test_drained_decoder_hands_its_streams_over_without_an_error(
    pd_stack: PDStack, extra_decoder: ExtraDecoder, drain_router: RoutedPair
) -> None:
    router, model = drain_router, pd_stack.model
    warm_up(router, model)

    rooms = list(range(30, 38))  # concurrency 8; odd rooms on the decoder that drains
    on_extra = [room for room in rooms if room % 2]
    started: list[int] = []
    with ThreadPoolExecutor(len(rooms)) as pool:
        futures = [
            pool.submit(stream_completion, router.url, model, room, DRAIN_STREAM_TOKENS, started, DRAIN_CLIENT_BOUND_S)
            for room in rooms
        ]
        wait_streams_on_extra(on_extra, started, extra_decoder.url, poll_s=0.05)
        body = {"role": "decode", "host": extra_decoder.host, "port": extra_decoder.port, "timeout_s": 120}
        t0 = time.monotonic()
        answer = httpx.post(
            f"{router.url}/instances/drain",
            json=body,
            headers=admin_headers(router.port),
            timeout=180,
            trust_env=False,
        )
        drain_s = time.monotonic() - t0
        held_after = held(extra_decoder.url, "decode")
        outcomes: list[Outcome] = [f.result(timeout=DRAIN_CLIENT_BOUND_S) for f in futures]

    assert answer.status_code == 200, answer.text
    (result,) = answer.json()["results"]
    moved = result["moved"].get("kv", 0)
    print(
        f"\ndrain of {extra_decoder.url}: {result['result']} in {drain_s:.2f} s (Router: {result['seconds']} s); "
        f"streams moved {result['moved']}, finished in place {result['waited']}, "
        f"KV bytes moved {result['kv_bytes_moved']}; held after {held_after}"
    )
    assert result["result"] == "drained" and moved >= 1, result
    assert set(result["moved"]) == {"kv"}, result  # no stream replayed (recomputed) nor lost
    assert result["kv_bytes_moved"] > 0, result
    assert result["held"] is not None and not any(result["held"].values()), result["held"]
    assert not any(held_after.values()), held_after
    assert [d["port"] for d in answer.json()["decoders"]] == [pd_stack.decode_port]

    by_room = {o.room: o for o in outcomes}
    for outcome in outcomes:  # 0 errors: every stream whole, one answer, the full budget
        assert outcome.status == 200 and outcome.error is None, outcome
        assert outcome.error_event is None, f"room {outcome.room}: {outcome.error_event}"
        assert outcome.done and outcome.finish_reason == "length", outcome.events[-2:]
        assert outcome.usage is not None and outcome.usage["completion_tokens"] == DRAIN_STREAM_TOKENS, outcome.usage
    for room in on_extra:  # greedy: the moved stream is the uninterrupted one's twin
        got, want = by_room[room].text, by_room[room - 1].text
        at = next((i for i, (a, b) in enumerate(zip(got, want, strict=False)) if a != b), min(len(got), len(want)))
        assert got == want, f"room {room} differs from room {room - 1} at character {at}: {got[at - 40 : at + 80]!r}"
    assert metric(router.url, "pd_router_resumes_total", endpoint="/v1/completions", reason="drain") == moved
    assert metric(router.url, "pd_router_drain_moves_total") == moved
    assert metric(router.url, "pd_router_resume_replayed_tokens_total") == 0  # nothing prefilled again
    log = Path(router.process.log_path or "").read_text(errors="replace")
    traced = re.findall(r"rid=\S+ room=\d+ POST .* drain \+[\d.]+ ms.* resumed \+", log)
    assert len(traced) == moved, "the phase trace of each moved request shows drain, cut and resume"

    # Nothing held afterwards: the drained decoder, the live one, the prefiller.
    assert wait_kv_free(extra_decoder.url, timeout=30) == 0.0
    assert wait_kv_free(pd_stack.decode_url, timeout=30) == 0.0
    assert wait_kv_free(pd_stack.prefill_url, timeout=60) == 0.0
    assert not any(held(pd_stack.prefill_url, "prefill").values())


#: Chat drain: one greedy chat stream this long on the extra decoder (its twin on the stack's), drained under way.
CHAT_STREAM_TOKENS = 800


def stream_chat(url: str, model: str, room: int, started: list[int], timeout_s: float) -> Outcome:
    """A greedy streamed chat of CHAT_STREAM_TOKENS tokens (``ignore_eos``) on the reference's second chat
    prompt in ``room``; ``room`` goes into ``started`` once its first token's chunk came (after the role's)."""
    from tests.support.serving import CHAT_PROMPTS

    outcome = Outcome(room)
    body = {
        "model": model,
        "messages": [{"role": "user", "content": CHAT_PROMPTS[1]}],
        "max_tokens": CHAT_STREAM_TOKENS,
        "ignore_eos": True,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "bootstrap_room": room,
    }
    try:
        with httpx.Client(timeout=httpx.Timeout(timeout_s), trust_env=False) as client:
            with client.stream("POST", f"{url}/v1/chat/completions", json=body) as response:
                outcome.status = response.status_code
                for line in sse_lines(response):
                    if line.startswith("data: "):
                        outcome.events.append(line[len("data: ") :])
                        if len(outcome.events) == 2:
                            started.append(room)
    except httpx.HTTPError as exc:
        outcome.error = f"{type(exc).__name__}: {exc}"
    return outcome


def chat_text(outcome: Outcome) -> str:
    """The assistant's text as the client assembles it from the chunks' ``delta.content``."""
    return "".join(
        (c.get("delta") or {}).get("content") or ""
        for e in outcome.events
        if e != "[DONE]"
        for c in json.loads(e).get("choices") or ()
    )


def test_drained_decoders_chat_stream_goes_on_as_the_same_chat(
    pd_stack: PDStack, extra_decoder: ExtraDecoder, reference: dict
) -> None:
    """A greedy streamed chat cut by a drain goes on on the stack's decoder (a completions leg re-shaped into
    chat chunks: proxy/strategies/resume_chat.py): the client's chat text is its uncut twin's, and begins with
    the colocated reference's chat answer (greedy, 12 tokens) to the same prompt."""
    from tests.support.serving import CHAT_PROMPTS

    router = start_router(pd_stack, extra_decoder, "router-chat")
    try:
        model = pd_stack.model
        warm_up(router, model)
        started: list[int] = []
        with ThreadPoolExecutor(2) as pool:
            futures = [
                pool.submit(stream_chat, router.url, model, room, started, DRAIN_CLIENT_BOUND_S) for room in (40, 41)
            ]
            wait_streams_on_extra([41], started, extra_decoder.url, poll_s=0.02)
            body = {"role": "decode", "host": extra_decoder.host, "port": extra_decoder.port, "timeout_s": 120}
            answer = httpx.post(
                f"{router.url}/instances/drain",
                json=body,
                headers=admin_headers(router.port),
                timeout=180,
                trust_env=False,
            )
            twin, moved = (f.result(timeout=DRAIN_CLIENT_BOUND_S) for f in futures)
        assert answer.status_code == 200, answer.text
        (result,) = answer.json()["results"]
        print(f"\nchat drain: moved {result['moved']}, finished in place {result['waited']}")
        assert result["result"] == "drained" and sum(result["moved"].values()) == 1, result
        for outcome in (twin, moved):
            assert outcome.status == 200 and outcome.error is None, outcome
            assert outcome.error_event is None and outcome.done, outcome.events[-2:]
            assert outcome.finish_reason == "length", outcome.events[-2:]
            assert outcome.usage is not None and outcome.usage["completion_tokens"] == CHAT_STREAM_TOKENS
            assert {json.loads(e)["object"] for e in outcome.events[:-1]} == {"chat.completion.chunk"}
            assert len(outcome.answer_ids) == 1
        got, want = chat_text(moved), chat_text(twin)
        at = next((i for i, (a, b) in enumerate(zip(got, want, strict=False)) if a != b), min(len(got), len(want)))
        assert got == want, f"the moved chat differs from its twin at character {at}: {got[at - 40 : at + 80]!r}"
        colocated = reference["chat"][True][CHAT_PROMPTS.index(CHAT_PROMPTS[1])]
        assert colocated and got.startswith(colocated), (got[:80], colocated)
        roles = [c["delta"].get("role") for e in moved.events[:-1] for c in json.loads(e)["choices"]]
        assert roles[0] == "assistant" and not any(roles[1:])
        log = Path(router.process.log_path or "").read_text(errors="replace")
        assert re.search(r"stream cut on decoder \S+ \(drain\) after \d+ token\(s\); resumed on", log), log[-2000:]
        assert wait_kv_free(extra_decoder.url, timeout=30) == 0.0
    finally:
        extra_decoder.group.stop(router.process)


def test_killed_decoders_streams_resume_on_the_live_one_and_traffic_moves_there(
    pd_stack: PDStack, extra_decoder: ExtraDecoder, kill_router: RoutedPair
) -> None:
    router, model = kill_router, pd_stack.model
    # The drained decoder is back to idle and healthy before it takes streams again.
    assert extra_decoder.process.is_running(), "the extra decoder exited"
    assert httpx.get(f"{extra_decoder.url}/health", timeout=30, trust_env=False).status_code == 200
    assert wait_kv_free(extra_decoder.url, timeout=30) == 0.0
    assert not any(held(extra_decoder.url, "decode").values()), held(extra_decoder.url, "decode")
    warm_up(router, model)

    rooms = list(range(10, 18))  # concurrency 8; even: live decoder, odd: extra decoder
    on_extra = [room for room in rooms if room % 2]
    chats = (50, 51)  # a greedy streamed chat on each decoder: the extra one's resumes as a chat
    started: list[int] = []
    with ThreadPoolExecutor(len(rooms) + len(chats)) as pool:
        futures = [
            pool.submit(
                stream_completion, router.url, model, room, KILL_STREAM_TOKENS, started, KILL_CLIENT_BOUND_S * 2
            )
            for room in rooms
        ]
        chat_futures = [
            pool.submit(stream_chat, router.url, model, room, started, KILL_CLIENT_BOUND_S * 2) for room in chats
        ]
        running = wait_streams_on_extra([*on_extra, chats[1]], started, extra_decoder.url, poll_s=0.02)
        assert running >= 1, (
            "the extra decoder runs none of the odd rooms' streams (the Router sent them elsewhere): "
            f"running on the live one: {running_requests(pd_stack.decode_url)}; "
            f"extra holds: {held(extra_decoder.url, 'decode')}"
        )
        os.killpg(extra_decoder.process.pid, signal.SIGKILL)
        killed_at = time.monotonic()
        outcomes = [f.result(timeout=KILL_CLIENT_BOUND_S + 60) for f in futures]
        chat_twin, chat_cut = (f.result(timeout=KILL_CLIENT_BOUND_S + 60) for f in chat_futures)
        finished_within = time.monotonic() - killed_at
    assert finished_within < KILL_CLIENT_BOUND_S, f"clients still waiting {finished_within:.0f}s after the kill"

    by_room = {outcome.room: outcome for outcome in outcomes}
    for outcome in outcomes:
        # Every stream ends whole, the extra decoder's ones too: resumed on the live decoder, no error event.
        assert outcome.status == 200, outcome
        assert outcome.error_event is None, f"room {outcome.room}: {outcome.error_event}"
        assert outcome.done, f"room {outcome.room} did not finish: {outcome.events[-2:]}"
        assert outcome.finish_reason == "length", outcome.events[-2:]
        assert outcome.usage is not None and outcome.usage["completion_tokens"] == KILL_STREAM_TOKENS, outcome.usage
        assert len(outcome.answer_ids) == 1  # one answer
    for room in on_extra:
        twin = by_room[room - 1]  # the same prompt, never cut
        # The token counts are the uncut twin's; the KV account (usage.pd_kv) is the last leg's: a
        # resumed leg's prompt is the client's prompt plus the tokens it already had.
        counts = ("prompt_tokens", "completion_tokens", "total_tokens")
        assert {k: by_room[room].usage[k] for k in counts} == {k: twin.usage[k] for k in counts}
        got, want = by_room[room].text, twin.text
        at = next((i for i, (a, b) in enumerate(zip(got, want, strict=False)) if a != b), min(len(got), len(want)))
        assert got == want, (
            f"room {room}'s stream differs from room {room - 1}'s at character {at}: {got[at - 40 : at + 40]!r}"
        )
    # The chat stream cut by the kill goes on as the same chat (replayed: the dead decoder's KV is gone).
    for outcome in (chat_twin, chat_cut):
        assert outcome.status == 200 and outcome.error is None, outcome
        assert outcome.error_event is None and outcome.done, outcome.events[-2:]
        assert outcome.usage is not None and outcome.usage["completion_tokens"] == CHAT_STREAM_TOKENS
        assert {json.loads(e)["object"] for e in outcome.events[:-1]} == {"chat.completion.chunk"}
    got, want = chat_text(chat_cut), chat_text(chat_twin)
    at = next((i for i, (a, b) in enumerate(zip(got, want, strict=False)) if a != b), min(len(got), len(want)))
    assert got == want, f"the killed decoder's chat differs from its twin at character {at}: {got[at - 40 : at + 80]!r}"
    router_log = Path(router.process.log_path or "").read_text(errors="replace")
    resumed = re.findall(
        r"stream cut on decoder \S+ \((\w+)\) after (\d+) token\(s\); resumed on .*? in ([\d.]+) ms", router_log
    )
    assert resumed, "no stream was still running on the killed decoder; raise KILL_STREAM_TOKENS"
    # Time to resume: from the Router seeing the cut to the resumed leg's first chunk (P's prefill of
    # the prompt and the tokens sent included).
    print(f"\nresumed {len(resumed)} stream(s) (reason, tokens sent, ms to resume): {resumed}")
    assert metric(router.url, "pd_router_resumes_total") == len(resumed)

    # Later requests go to the live decoder, whatever their room (the first may fail over).
    for room in (21, 23, 25, 22):
        response = short_completion(router.url, model, room)
        assert response.status_code == 200, response.text
    # The details are the admin's.
    health = httpx.get(f"{router.url}/health", headers=admin_headers(router.port), timeout=30, trust_env=False).json()
    states = {d["port"]: d["healthy"] for d in health["decoders"]}
    assert states[extra_decoder.port] is False
    assert health["status"] == "healthy"

    # Nothing stays held on the live instances.
    assert wait_kv_free(pd_stack.decode_url, timeout=30) == 0.0


def test_no_kv_left_on_prefill_after_the_kill(pd_stack: PDStack, kill_router: RoutedPair) -> None:
    """KV that P prepared for the dead decoder is freed (its transfer fails or its room times out)."""
    assert wait_kv_free(pd_stack.prefill_url, timeout=P_ROOM_TIMEOUT_S + 30) == 0.0
    log = Path(kill_router.process.log_path or "").read_text(errors="replace")
    assert "marked unhealthy" in log or "failed its health check" in log
