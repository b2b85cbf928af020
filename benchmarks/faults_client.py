"""The fault campaign's client (benchmarks/faults.py): one /v1/completions call per plan, with its abort.

Every call ends in one `Outcome` within the deadline: a complete answer (its text and any
``usage.pd_kv`` records kept for the checks), an explicit error (HTTP 4xx/5xx with a JSON error body,
or an SSE error event), an abort the client chose, or a failure of the system under test (an unclear
answer: a cut stream, a 200 without a finished choice, a body that is not JSON; or a hang).
"""

from __future__ import annotations

import enum
import json
import socket
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx

from benchmarks.faults_plan import RequestPlan
from launch.sse import sse_lines
from tests.support.chaos_tools import error_message


class Outcome(enum.Enum):
    OK = "ok"
    ERROR = "explicit_error"
    ABORTED = "aborted"  # the client closed on purpose
    UNCLEAR = "unclear"
    HANG = "hang"


@dataclass
class Call:
    """What one call saw."""

    outcome: Outcome
    status: int = 0
    text: str = ""
    detail: str = ""
    seconds: float = 0.0
    events: int = 0
    #: ``usage.pd_kv`` of the answer (None: the answer had no such field).
    pd_kv: dict | None = None
    finished: bool = False
    extra: dict[str, object] = field(default_factory=dict)


def body_of(model: str, plan: RequestPlan, prompt: str) -> dict:
    body: dict = {
        "model": model,
        "prompt": prompt,
        "max_tokens": plan.prompt.max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": plan.stream,
    }
    if plan.stream:
        body["stream_options"] = {"include_usage": True}
    return body


def abort_before_routing(url: str, body: dict) -> Call:
    """Headers and half the body, then the connection closes: the Router never has a whole request."""
    data = json.dumps(body).encode()
    host, port = url.removeprefix("http://").rsplit(":", 1)
    head = f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
    head += f"Content-Length: {len(data)}\r\n\r\n"
    with socket.create_connection((host, int(port)), timeout=5) as sock:
        sock.sendall(head.encode() + data[: len(data) // 2])
        time.sleep(0.05)
    return Call(Outcome.ABORTED, detail="closed with half the body sent")


def _socket_of(resp: httpx.Response) -> socket.socket | None:
    stream = resp.extensions.get("network_stream")
    return stream.get_extra_info("socket") if stream is not None else None


def _rst(sock: socket.socket | None) -> None:
    if sock is None:
        return
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


def call(
    url: str,
    body: dict,
    *,
    deadline_s: float,
    abort_after_s: float | None = None,
    abort_after_events: int = 0,
    on_event: Callable[[int], float | None] | None = None,
    reset_after_done: bool = False,
    rid: str = "",
) -> Call:
    """One call. ``abort_after_s``: the client gives up after that long (non-streamed: a read timeout;
    streamed: the socket is shut). ``abort_after_events``: a stream is closed after that many events.
    ``on_event(n)`` may return seconds after which the stream is shut (a fault was set off)."""
    t0 = time.monotonic()
    # a stream's headers come with D's first chunk (the Router holds them back): the read timeout aborts
    # before them, the timer below after them
    read = abort_after_s if abort_after_s is not None else deadline_s
    timeout = httpx.Timeout(deadline_s, connect=5.0, read=read)
    result = Call(Outcome.UNCLEAR)
    aborting = threading.Event()
    headers = {"X-Request-Id": rid} if rid else {}
    try:
        with httpx.Client(timeout=timeout, trust_env=False) as client:
            if not body["stream"]:
                resp = client.post(f"{url}/v1/completions", json=body, headers=headers)
                result = _classify_body(resp)
            else:
                with client.stream("POST", f"{url}/v1/completions", json=body, headers=headers) as resp:
                    result.status = resp.status_code
                    if resp.status_code != 200:
                        resp.read()
                        result = _classify_body(resp)
                    else:
                        sock = _socket_of(resp)

                        def shut() -> None:
                            aborting.set()
                            _rst(sock)

                        if abort_after_s is not None:
                            threading.Timer(max(0.0, abort_after_s - (time.monotonic() - t0)), shut).start()
                        result = _read_stream(resp, t0 + deadline_s, abort_after_events, on_event, shut)
                        if reset_after_done and result.outcome is Outcome.OK:
                            _rst(sock)
                            result.extra["reset_after_done"] = True
    except httpx.TimeoutException as exc:
        if abort_after_s is not None and time.monotonic() - t0 < deadline_s:
            result = Call(Outcome.ABORTED, detail=f"gave up after {abort_after_s:.2f} s")
        else:
            result = Call(Outcome.HANG, detail=f"{type(exc).__name__} after {time.monotonic() - t0:.1f} s")
    except httpx.HTTPError as exc:
        if aborting.is_set():
            result = Call(Outcome.ABORTED, detail=f"shut by the client ({type(exc).__name__})")
        else:
            result = Call(Outcome.UNCLEAR, detail=f"{type(exc).__name__}: {exc}")
    if aborting.is_set() and result.outcome is Outcome.UNCLEAR:
        result.outcome, result.detail = Outcome.ABORTED, f"shut by the client; {result.detail}"
    result.seconds = round(time.monotonic() - t0, 3)
    result.detail = result.detail[:400]
    return result


def _classify_body(resp: httpx.Response) -> Call:
    status = resp.status_code
    try:
        body = resp.json()
    except ValueError:
        return Call(Outcome.UNCLEAR, status, detail=f"HTTP {status}, not JSON: {resp.text[:200]!r}")
    if status == 200:
        choices = body.get("choices") if isinstance(body, dict) else None
        if choices and choices[0].get("finish_reason") in ("length", "stop"):
            usage = body.get("usage") or {}
            return Call(Outcome.OK, status, text=choices[0].get("text") or "", pd_kv=usage.get("pd_kv"), finished=True)
        return Call(Outcome.UNCLEAR, status, detail=f"HTTP 200 without a finished choice: {str(body)[:200]}")
    message = error_message(body)
    if status >= 400 and message:
        return Call(Outcome.ERROR, status, detail=f"HTTP {status}: {message}")
    return Call(Outcome.UNCLEAR, status, detail=f"HTTP {status}: {str(body)[:200]}")


def _read_stream(
    resp: httpx.Response,
    deadline: float,
    abort_after_events: int,
    on_event: Callable[[int], float | None] | None,
    shut: Callable[[], None],
) -> Call:
    out = Call(Outcome.UNCLEAR, 200)
    parts: list[str] = []
    for line in sse_lines(resp):
        if time.monotonic() > deadline:
            out.outcome, out.detail = Outcome.HANG, f"stream still open after its deadline ({out.events} events)"
            break
        if not line.startswith("data: "):
            continue
        data = line[len("data: ") :]
        if data == "[DONE]":
            if out.finished:
                out.outcome = Outcome.OK
            else:
                out.detail = f"[DONE] without a finish_reason after {out.events} events"
            break
        try:
            chunk = json.loads(data)
        except ValueError:
            out.detail = f"SSE event that is not JSON: {data[:200]!r}"
            break
        message = error_message(chunk)
        if message:
            out.outcome, out.detail = Outcome.ERROR, f"SSE error event after {out.events} events: {message}"
            break
        out.events += 1
        for choice in chunk.get("choices") or []:
            parts.append(choice.get("text") or "")
            out.finished = out.finished or bool(choice.get("finish_reason"))
        usage = chunk.get("usage") or {}
        if "pd_kv" in usage:
            out.pd_kv = usage["pd_kv"]
        if abort_after_events and out.events >= abort_after_events:
            shut()
            out.outcome, out.detail = Outcome.ABORTED, f"closed after {out.events} events"
            break
        if on_event is not None:
            after = on_event(out.events)
            if after is not None:
                threading.Timer(after, shut).start()
    else:
        out.detail = out.detail or f"stream ended after {out.events} events without [DONE] or an error event"
    out.text = "".join(parts)
    return out
