"""Tools of the chaos test (tests/e2e/test_chaos.py): seeded client load, answer classes, figures, garbage.

Every client call has a deadline and ends in one `Outcome`: a complete answer, a clear error (HTTP
4xx/5xx with a JSON error body, or an SSE error event), a disconnect the client chose, or a failure
of the system under test: an unclear answer (a cut stream, a 200 without choices, a body that is not
JSON...) or a hang (no end before the deadline).
"""

from __future__ import annotations

import enum
import json
import random
import socket
import time
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, field

import httpx
import zmq

from launch.sse import sse_lines
from tests.support.serving import kv_usage, prompt_of_length

#: Seconds one client call may take before it counts as a hang.
CLIENT_DEADLINE_S = 60.0


class Outcome(enum.Enum):
    OK = "ok"
    CLEAR_ERROR = "clear_error"
    DISCONNECTED = "disconnected"  # the client closed the connection on purpose
    UNCLEAR = "unclear"
    HANG = "hang"


class Disconnect(enum.Enum):
    NONE = "none"
    MID_STREAM = "mid_stream"  # close after a few SSE events
    BEFORE_ANSWER = "before_answer"  # non-streaming: give up after a short read timeout


@dataclass(frozen=True)
class Plan:
    """One client request, drawn from the seeded RNG before anything runs."""

    prompt_len: int
    salt: int
    stream: bool
    max_tokens: int
    disconnect: Disconnect = Disconnect.NONE
    close_after_events: int = 0
    close_after_s: float = 0.0


@dataclass
class Result:
    plan: Plan
    outcome: Outcome
    status: int
    seconds: float
    detail: str = ""


def error_message(body: object) -> str | None:
    """The message of an OpenAI/Router/FastAPI-style JSON error body, None if it is not one."""
    if not isinstance(body, dict):
        return None
    err = body.get("error")
    if isinstance(err, dict):
        return str(err.get("message") or err)
    if isinstance(err, str) and err:
        return err
    if body.get("object") == "error" and body.get("message"):
        return str(body["message"])
    if "detail" in body:
        return str(body["detail"])
    return None


def plans(rng: random.Random, n: int, disconnect_share: float = 0.25) -> list[Plan]:
    """``n`` requests: random prompt lengths (1..300 tokens), half streaming, short ``max_tokens``;
    ``disconnect_share`` of them close their connection early (mid-stream, or before a non-streamed answer)."""
    out = []
    for _ in range(n):
        stream = rng.random() < 0.5
        leave = rng.random() < disconnect_share
        if leave and stream:
            plan = Plan(rng.randint(1, 300), rng.randint(0, 150), True, 48, Disconnect.MID_STREAM, rng.randint(1, 4))
        elif leave:
            plan = Plan(
                rng.randint(1, 300), rng.randint(0, 150), False, 48, Disconnect.BEFORE_ANSWER, 0, rng.uniform(0.05, 0.6)
            )
        else:
            plan = Plan(rng.randint(1, 300), rng.randint(0, 150), stream, rng.randint(2, 12))
        out.append(plan)
    return out


def body_of(model: str, plan: Plan) -> dict:
    return {
        "model": model,
        "prompt": prompt_of_length(plan.prompt_len, salt=plan.salt),
        "max_tokens": plan.max_tokens,
        "temperature": 0,
        "ignore_eos": plan.disconnect is not Disconnect.NONE,
        "stream": plan.stream,
    }


def call(url: str, model: str, plan: Plan, deadline_s: float = CLIENT_DEADLINE_S) -> Result:
    """One /v1/completions call through ``url``, classified (never raises, never outlives ``deadline_s`` much)."""
    t0 = time.monotonic()
    read = plan.close_after_s if plan.disconnect is Disconnect.BEFORE_ANSWER else deadline_s
    timeout = httpx.Timeout(deadline_s, connect=5.0, read=read)
    status = 0
    try:
        with httpx.Client(timeout=timeout, trust_env=False) as client:
            if not plan.stream:
                resp = client.post(f"{url}/v1/completions", json=body_of(model, plan))
                status = resp.status_code
                outcome, detail = _classify_body(resp)
            else:
                with client.stream("POST", f"{url}/v1/completions", json=body_of(model, plan)) as resp:
                    status = resp.status_code
                    if status != 200:
                        resp.read()
                        outcome, detail = _classify_body(resp)
                    else:
                        outcome, detail = _classify_stream(resp, plan, t0 + deadline_s)
    except httpx.TimeoutException as exc:
        if plan.disconnect is Disconnect.BEFORE_ANSWER and time.monotonic() - t0 < deadline_s:
            outcome, detail = Outcome.DISCONNECTED, "closed before the answer"
        else:
            outcome, detail = Outcome.HANG, f"{type(exc).__name__} after {time.monotonic() - t0:.1f} s"
    except httpx.HTTPError as exc:
        outcome, detail = Outcome.UNCLEAR, f"{type(exc).__name__}: {exc}"
    return Result(plan, outcome, status, time.monotonic() - t0, detail[:300])


def _classify_body(resp: httpx.Response) -> tuple[Outcome, str]:
    try:
        body = resp.json()
    except ValueError:
        return Outcome.UNCLEAR, f"HTTP {resp.status_code}, not JSON: {resp.text[:200]!r}"
    if resp.status_code == 200:
        choices = body.get("choices") if isinstance(body, dict) else None
        if choices and choices[0].get("finish_reason") in ("length", "stop"):
            return Outcome.OK, ""
        return Outcome.UNCLEAR, f"HTTP 200 without a finished choice: {str(body)[:200]}"
    message = error_message(body)
    if resp.status_code >= 400 and message:
        return Outcome.CLEAR_ERROR, f"HTTP {resp.status_code}: {message}"
    return Outcome.UNCLEAR, f"HTTP {resp.status_code}: {str(body)[:200]}"


def _classify_stream(resp: httpx.Response, plan: Plan, deadline: float) -> tuple[Outcome, str]:
    events = 0
    finished = False
    for line in sse_lines(resp):
        if time.monotonic() > deadline:
            return Outcome.HANG, f"stream still open after its deadline ({events} events)"
        if not line.startswith("data: "):
            continue
        data = line[len("data: ") :]
        if data == "[DONE]":
            return (Outcome.OK, "") if finished else (Outcome.UNCLEAR, "[DONE] without a finish_reason")
        try:
            chunk = json.loads(data)
        except ValueError:
            return Outcome.UNCLEAR, f"SSE event that is not JSON: {data[:200]!r}"
        message = error_message(chunk)
        if message:
            return Outcome.CLEAR_ERROR, f"SSE error event after {events} events: {message}"
        events += 1
        finished = finished or any(c.get("finish_reason") for c in chunk.get("choices", []))
        if plan.disconnect is Disconnect.MID_STREAM and events >= plan.close_after_events:
            return Outcome.DISCONNECTED, f"closed after {events} events"
    return Outcome.UNCLEAR, f"stream ended after {events} events without [DONE] or an error event"


def run_load(url: str, model: str, todo: Sequence[Plan], concurrency: int = 16) -> list[Result]:
    """Run ``todo`` through ``url``, ``concurrency`` at a time; results in plan order."""
    with ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="chaos-client") as pool:
        return list(pool.map(lambda p: call(url, model, p), todo))


def start_load(url: str, model: str, todo: Sequence[Plan], concurrency: int = 16) -> Future[list[Result]]:
    """`run_load` in the background (a thread); ``.result()`` waits for every call."""
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="chaos-load")
    future = pool.submit(run_load, url, model, todo, concurrency)
    pool.shutdown(wait=False)
    return future


# -- figures -------------------------------------------------------------------------------------
@dataclass
class PhaseFigures:
    """What one phase did and saw (the chaos test's report, one entry per phase)."""

    name: str
    requests: int = 0
    ok: int = 0
    clear_errors: int = 0
    disconnects: int = 0
    unclear: int = 0
    hangs: int = 0
    #: Seconds until each side held no KV block after the phase ("P", "D").
    kv_free_s: dict[str, float] = field(default_factory=dict)
    seconds: float = 0.0
    #: Phase-specific counts (malformed inputs answered 4xx, garbage frames sent, ...).
    extra: dict[str, object] = field(default_factory=dict)
    #: A few error messages the clients got, for the log.
    sample_errors: list[str] = field(default_factory=list)

    def add(self, results: Sequence[Result]) -> None:
        counts = Counter(r.outcome for r in results)
        self.requests += len(results)
        self.ok += counts[Outcome.OK]
        self.clear_errors += counts[Outcome.CLEAR_ERROR]
        self.disconnects += counts[Outcome.DISCONNECTED]
        self.unclear += counts[Outcome.UNCLEAR]
        self.hangs += counts[Outcome.HANG]
        for r in results:
            if r.outcome is Outcome.CLEAR_ERROR and r.detail not in self.sample_errors and len(self.sample_errors) < 4:
                self.sample_errors.append(r.detail)

    def as_dict(self) -> dict[str, object]:
        out = asdict(self)
        out["max_kv_free_s"] = max(self.kv_free_s.values(), default=0.0)
        return out


def assert_all_answered(name: str, results: Sequence[Result]) -> None:
    """No hang and no unclear answer among ``results``."""
    bad = [r for r in results if r.outcome in (Outcome.UNCLEAR, Outcome.HANG)]
    assert not bad, f"{name}: {len(bad)} of {len(results)} calls ended badly, e.g. " + "; ".join(
        f"{r.outcome.value} (HTTP {r.status}, {r.seconds:.1f} s, stream={r.plan.stream}): {r.detail}" for r in bad[:5]
    )


def seconds_to_kv_free(url: str, timeout: float) -> float:
    """Seconds until ``url`` holds no KV block; AssertionError naming the usage after ``timeout``."""
    t0 = time.monotonic()
    while True:
        usage = kv_usage(url)
        took = time.monotonic() - t0
        if usage == 0.0:
            return round(took, 2)
        assert took < timeout, f"{url} still holds KV (usage {usage:.4f}) after {timeout:.0f} s"
        time.sleep(0.2)


def wait_until(what: str, check: Callable[[], bool], timeout: float, interval: float = 0.5) -> float:
    """Poll ``check`` until true; seconds it took, AssertionError naming ``what`` after ``timeout``."""
    t0 = time.monotonic()
    while True:
        try:
            if check():
                return time.monotonic() - t0
        except httpx.HTTPError:
            pass
        assert time.monotonic() - t0 < timeout, f"{what}: not after {timeout:.0f} s"
        time.sleep(interval)


def healthy(url: str) -> bool:
    return httpx.get(f"{url}/health", timeout=5, trust_env=False).status_code == 200


# -- garbage on the wire -------------------------------------------------------------------------
def garbage_payloads(rng: random.Random, n: int) -> list[bytes]:
    """Random frames of awkward sizes: empty, shorter than, exactly and just over a MAC, large, msgpack-ish."""
    sizes = [0, 1, 31, 32, 33, 200, 4096, 65536]
    out = [rng.randbytes(sizes[i % len(sizes)]) for i in range(n)]
    out += [b"\x82\xa4type\xa5hello", b"\x00" * 64, b"\xff" * 33]
    return out


def zmq_garbage(endpoint: str, frames: Sequence[bytes]) -> int:
    """Send ``frames`` (single and multipart) to a ZMQ PULL ``endpoint``; returns how many went out."""
    ctx = zmq.Context()
    sent = 0
    try:
        sock = ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 2000)
        sock.setsockopt(zmq.SNDTIMEO, 2000)
        sock.connect(endpoint)
        for i, frame in enumerate(frames):
            if i % 5 == 4:
                sock.send_multipart([frame, frame[:7], b""])
            else:
                sock.send(frame)
            sent += 1
        sock.close()
    finally:
        ctx.term()
    return sent


def tcp_garbage(host: str, port: int, rng: random.Random, connections: int = 6) -> int:
    """Open ``connections`` raw TCP connections to ``port``, write random bytes (and a half HTTP
    request, a bogus ZMTP greeting) and close; returns the bytes written."""
    written = 0
    heads = [
        b"",
        b"GET /bootstrap/route HTTP/1.1\r\nHost: x\r\nContent-Length: 99999\r\n",
        b"\xff\x00\x00\x00\x00\x00\x00\x00\x01\x7f",
    ]
    for i in range(connections):
        data = heads[i % len(heads)] + rng.randbytes(rng.choice([16, 1024, 70000]))
        try:
            with socket.create_connection((host, port), timeout=3) as sock:
                sock.settimeout(3)
                sock.sendall(data)
                written += len(data)
                try:
                    sock.recv(4096)  # whatever the server answers (or a close)
                except OSError:
                    pass
        except OSError:
            pass  # the server may reset the connection mid-write: that is a fine reaction to garbage
    return written
