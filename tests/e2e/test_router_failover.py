"""A decoder killed mid-run: its streams resume on the live one, never an error or a hang; later requests go there too.

Module setup: one extra decode instance (a second consumer of the session stack's prefiller)
and a Router of its own in front of P and both decoders (``--routing room``: even rooms go to
the stack's decoder, odd rooms to the extra one). The test SIGKILLs the extra decoder's
process group while streams run on both. Rooms 2k and 2k+1 stream the same prompt: the even
room's stream, never cut, is the uninterrupted run the resumed odd one must equal token for token
(greedy). That a stream with no decoder left ends with an error event is tests/proxy/test_resume.py's.
"""

from __future__ import annotations

import json
import os
import re
import signal
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from launch.processes import ManagedProcess, ProcessGroup, free_port, vllm_env, vllm_serve_cmd, wait_http_ok
from proxy.admin_token import admin_headers
from tests.support.serving import D_KV_WAIT_TIMEOUT_S, P_ROOM_TIMEOUT_S, START_TIMEOUT_S, prompt_of_length, wait_kv_free

pytestmark = pytest.mark.e2e

#: Every client must be done this long after the kill (its stream resumed and finished: never a hang).
CLIENT_BOUND_S = 150.0
STREAM_TOKENS = 1900  # prompt 60 + 1900 fits --max-model-len 2048


@dataclass
class TwoDecoders:
    router_url: str
    live_decode_url: str
    extra_decode_url: str
    extra_decode: ManagedProcess
    extra_port: int
    model: str
    router: ManagedProcess


@pytest.fixture(scope="module")
def two_decoders(pd_stack, tmp_path_factory: pytest.TempPathFactory):
    log_dir = tmp_path_factory.mktemp("router-failover-logs")
    host = pd_stack.host
    with ProcessGroup(log_dir) as group:
        extra_port = free_port()
        cmd = vllm_serve_cmd(
            pd_stack.model,
            extra_port,
            kv_role="kv_consumer",
            bootstrap_port=pd_stack.bootstrap_port,
            extra_config={"kv_wait_timeout_s": D_KV_WAIT_TIMEOUT_S},
        )
        extra = group.start("decode-extra", cmd, env=vllm_env("1"))
        router_port = free_port()
        router_cmd = [
            sys.executable, "-m", "proxy", "--host", host, "--port", str(router_port),
            "--prefiller-hosts", host, "--prefiller-ports", str(pd_stack.prefill_port),
            "--prefiller-bootstrap-ports", str(pd_stack.bootstrap_port),
            "--decoder-hosts", host, host, "--decoder-ports", str(pd_stack.decode_port), str(extra_port),
            # A slow health answer on this loaded machine must not send the odd rooms to the live decoder.
            "--health-interval", "1", "--health-timeout", "15", "--trust-client-room",
        ]  # fmt: skip
        router = group.start("router-two-decoders", router_cmd, env=dict(os.environ, PYTHONUNBUFFERED="1"))
        wait_http_ok(f"http://{host}:{extra_port}/health", START_TIMEOUT_S, extra)
        router_url = f"http://{host}:{router_port}"
        wait_http_ok(f"{router_url}/health", 60, router)
        yield TwoDecoders(
            router_url=router_url,
            live_decode_url=pd_stack.decode_url,
            extra_decode_url=f"http://{host}:{extra_port}",
            extra_decode=extra,
            extra_port=extra_port,
            model=pd_stack.model,
            router=router,
        )


@dataclass
class Outcome:
    room: int
    status: int | None = None
    events: list[str] = field(default_factory=list)
    error: str | None = None
    elapsed: float = 0.0
    ended_at: float = 0.0

    @property
    def done(self) -> bool:
        return bool(self.events) and self.events[-1] == "[DONE]"

    @property
    def finish_reason(self) -> str | None:
        """The finish_reason of the last chunk that has one (vLLM sends it on the final token's chunk)."""
        for event in reversed(self.events):
            if event == "[DONE]":
                continue
            choices = json.loads(event).get("choices") or []
            if choices and choices[0].get("finish_reason"):
                return choices[0]["finish_reason"]
        return None

    @property
    def text(self) -> str:
        return "".join(
            c.get("text") or "" for e in self.events if e != "[DONE]" for c in json.loads(e).get("choices") or ()
        )

    @property
    def usage(self) -> dict | None:
        for event in reversed(self.events):
            if event != "[DONE]" and (usage := json.loads(event).get("usage")):
                return usage
        return None

    @property
    def error_event(self) -> dict | None:
        if self.events and self.events[-1] != "[DONE]":
            last = json.loads(self.events[-1])
            return last.get("error")
        return None


def _stream(url: str, model: str, room: int, max_tokens: int, started: list[int]) -> Outcome:
    outcome = Outcome(room)
    t0 = time.monotonic()
    body = {
        "model": model,
        "prompt": prompt_of_length(60, salt=room // 2),  # rooms 2k and 2k+1: the same prompt
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "bootstrap_room": room,
    }
    try:
        with httpx.Client(timeout=httpx.Timeout(CLIENT_BOUND_S * 2), trust_env=False) as client:
            with client.stream("POST", f"{url}/v1/completions", json=body) as response:
                outcome.status = response.status_code
                for line in response.iter_lines():
                    if line.startswith("data: "):
                        outcome.events.append(line[len("data: ") :])
                        if len(outcome.events) == 2:  # D's first event (the first one is P's token)
                            started.append(room)
                if response.status_code != 200:
                    outcome.error = response.read().decode(errors="replace")
    except httpx.HTTPError as exc:
        outcome.error = f"{type(exc).__name__}: {exc}"
    outcome.ended_at = time.monotonic()
    outcome.elapsed = outcome.ended_at - t0
    return outcome


def _running_requests(decode_url: str) -> float:
    """vLLM's ``vllm:num_requests_running`` gauge on one instance (summed over its engines)."""
    text = httpx.get(f"{decode_url}/metrics", timeout=10, trust_env=False).text
    return sum(
        float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith("vllm:num_requests_running{")
    )


def _gauges(url: str) -> list[str]:
    text = httpx.get(f"{url}/metrics", timeout=10, trust_env=False).text
    return [line for line in text.splitlines() if line.startswith(("vllm:num_requests", "vllm:pd_"))][:12]


def _router_metric(url: str, name: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=10, trust_env=False).text
    return sum(
        float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith((f"{name} ", f"{name}{{"))
    )


def _complete(url: str, model: str, room: int) -> httpx.Response:
    body = {"model": model, "prompt": prompt_of_length(40, salt=room % 50), "max_tokens": 6, "bootstrap_room": room}
    return httpx.post(f"{url}/v1/completions", json=body, timeout=120, trust_env=False)


def test_killed_decoders_streams_resume_on_the_live_one_and_traffic_moves_there(two_decoders: TwoDecoders) -> None:
    stack = two_decoders
    # Warm both decoders up (and check the room rule: odd rooms reach the extra decoder).
    for room in (2, 3):
        response = _complete(stack.router_url, stack.model, room)
        assert response.status_code == 200, response.text

    rooms = [10, 11, 12, 13, 14, 15]  # even: live decoder, odd: extra decoder
    started: list[int] = []
    with ThreadPoolExecutor(len(rooms)) as pool:
        futures = [pool.submit(_stream, stack.router_url, stack.model, room, STREAM_TOKENS, started) for room in rooms]
        # Kill as soon as every stream on the extra decoder (odd rooms) is under way and the extra decoder
        # itself reports them running (so the Router did send them there): the last of them has barely
        # begun, so at least one is cut off however fast this machine generates.
        on_extra = [room for room in rooms if room % 2]
        deadline = time.monotonic() + 120
        running = 0.0
        while time.monotonic() < deadline:
            if set(on_extra) <= set(started):
                running = _running_requests(stack.extra_decode_url)
                if running >= 1:
                    break
            time.sleep(0.02)
        assert set(on_extra) <= set(started), f"streams on the extra decoder did not start: {sorted(started)}"
        assert running >= 1, (
            "the extra decoder runs none of the odd rooms' streams (the Router sent them elsewhere): "
            f"running on the live one: {_running_requests(stack.live_decode_url)}; "
            f"extra's gauges: {_gauges(stack.extra_decode_url)}"
        )
        os.killpg(stack.extra_decode.pid, signal.SIGKILL)
        killed_at = time.monotonic()
        outcomes = [f.result(timeout=CLIENT_BOUND_S + 60) for f in futures]
        finished_within = time.monotonic() - killed_at
    assert finished_within < CLIENT_BOUND_S, f"clients still waiting {finished_within:.0f}s after the kill"

    by_room = {outcome.room: outcome for outcome in outcomes}
    for outcome in outcomes:
        # Every stream ends whole, the extra decoder's ones too: resumed on the live decoder, no error event.
        assert outcome.status == 200, outcome
        assert outcome.error_event is None, f"room {outcome.room}: {outcome.error_event}"
        assert outcome.done, f"room {outcome.room} did not finish: {outcome.events[-2:]}"
        assert outcome.finish_reason == "length", outcome.events[-2:]
        assert outcome.usage is not None and outcome.usage["completion_tokens"] == STREAM_TOKENS, outcome.usage
        assert len({json.loads(e)["id"] for e in outcome.events if e != "[DONE]"}) == 1  # one answer
    for room in on_extra:
        twin = by_room[room - 1]  # the same prompt, never cut
        assert by_room[room].usage == twin.usage
        got, want = by_room[room].text, twin.text
        at = next((i for i, (a, b) in enumerate(zip(got, want, strict=False)) if a != b), min(len(got), len(want)))
        assert got == want, (
            f"room {room}'s stream differs from room {room - 1}'s at character {at}: {got[at - 40 : at + 40]!r}"
        )
    router_log = Path(stack.router.log_path).read_text(errors="replace")
    resumed = re.findall(
        r"stream cut on decoder \S+ \((\w+)\) after (\d+) token\(s\); resumed on .*? in ([\d.]+) ms", router_log
    )
    assert resumed, "no stream was still running on the killed decoder; raise STREAM_TOKENS"
    # Time to resume: from the Router seeing the cut to the resumed leg's first chunk (P's prefill of
    # the prompt and the tokens sent included).
    print(f"\nresumed {len(resumed)} stream(s) (reason, tokens sent, ms to resume): {resumed}")
    assert _router_metric(stack.router_url, "pd_router_resumes_total") == len(resumed)

    # Later requests go to the live decoder, whatever their room (the first may fail over).
    for room in (21, 23, 25, 22):
        response = _complete(stack.router_url, stack.model, room)
        assert response.status_code == 200, response.text
    headers = admin_headers(int(stack.router_url.rsplit(":", 1)[1]))  # the details are the admin's
    health = httpx.get(f"{stack.router_url}/health", headers=headers, timeout=30, trust_env=False).json()
    states = {d["port"]: d["healthy"] for d in health["decoders"]}
    assert states[stack.extra_port] is False
    assert health["status"] == "healthy"

    # Nothing stays held on the live instances.
    assert wait_kv_free(stack.live_decode_url, timeout=30) == 0.0


def test_no_kv_left_on_prefill_after_the_kill(pd_stack, two_decoders: TwoDecoders) -> None:
    """KV that P prepared for the dead decoder is freed (its transfer fails or its room times out)."""
    assert wait_kv_free(pd_stack.prefill_url, timeout=P_ROOM_TIMEOUT_S + 30) == 0.0
    log = Path(two_decoders.router.log_path).read_text(errors="replace")
    assert "marked unhealthy" in log or "failed its health check" in log
