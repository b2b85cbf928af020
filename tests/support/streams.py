"""Long streamed completions through a Router, and the `/metrics` figures read around them.

Used by the e2e tests that take a decoder away mid-run (tests/e2e/test_decoder_loss.py): the
streams run in threads (:func:`stream_completion` records each one's events in an :class:`Outcome`),
the test reads the decoders' and the Router's gauges and counters while they run and afterwards.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from launch.sse import sse_lines
from proxy.admin.drain import HELD_METRICS, held_counts
from tests.support.metrics import metric
from tests.support.serving import prompt_of_length


@dataclass
class Outcome:
    """One streamed completion as the client saw it: status, SSE data payloads, transport error, timing."""

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
    def usage(self) -> dict[str, Any] | None:
        for event in reversed(self.events):
            if event != "[DONE]" and (usage := json.loads(event).get("usage")):
                return usage
        return None

    @property
    def error_event(self) -> dict[str, Any] | None:
        if self.events and self.events[-1] != "[DONE]":
            last = json.loads(self.events[-1])
            return last.get("error")
        return None

    @property
    def answer_ids(self) -> set[str]:
        """The completion ids of its chunks (one answer: exactly one id)."""
        return {json.loads(e)["id"] for e in self.events if e != "[DONE]"}


def stream_completion(
    url: str, model: str, room: int, max_tokens: int, started: list[int], timeout_s: float
) -> Outcome:
    """A greedy streamed ``/v1/completions`` of ``max_tokens`` tokens (``ignore_eos``) in ``room``.

    Rooms 2k and 2k+1 get the same 60-token prompt, so one of them is the other's twin. ``room`` is
    appended to ``started`` once D's first event arrived (the first event is P's token).
    """
    outcome = Outcome(room)
    t0 = time.monotonic()
    body = {
        "model": model,
        "prompt": prompt_of_length(60, salt=room // 2),
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "bootstrap_room": room,
    }
    try:
        with httpx.Client(timeout=httpx.Timeout(timeout_s), trust_env=False) as client:
            with client.stream("POST", f"{url}/v1/completions", json=body) as response:
                outcome.status = response.status_code
                for line in sse_lines(response):
                    if line.startswith("data: "):
                        outcome.events.append(line[len("data: ") :])
                        if len(outcome.events) == 2:
                            started.append(room)
                if response.status_code != 200:
                    outcome.error = response.read().decode(errors="replace")
    except httpx.HTTPError as exc:
        outcome.error = f"{type(exc).__name__}: {exc}"
    outcome.ended_at = time.monotonic()
    outcome.elapsed = outcome.ended_at - t0
    return outcome


def short_completion(url: str, model: str, room: int) -> httpx.Response:
    """A 6-token non-streamed completion of a 40-token prompt in ``room`` (a warm-up, a routing probe)."""
    body = {"model": model, "prompt": prompt_of_length(40, salt=room % 50), "max_tokens": 6, "bootstrap_room": room}
    return httpx.post(f"{url}/v1/completions", json=body, timeout=120, trust_env=False)


def running_requests(url: str) -> float:
    """vLLM's ``vllm:num_requests_running`` gauge on one instance (summed over its engines)."""
    return metric(url, "vllm:num_requests_running")


def held(url: str, role: str) -> dict[str, float]:
    """What a vLLM instance of ``role`` ("decode"/"prefill") still holds (:data:`proxy.admin.drain.HELD_METRICS`)."""
    return held_counts(httpx.get(f"{url}/metrics", timeout=10, trust_env=False).text, HELD_METRICS[role])
