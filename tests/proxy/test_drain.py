"""``POST /instances/drain`` (proxy/admin/drain.py) with a real Router in front of fake backends.

A drained decoder's resumable stream moves to the other decoder by replay (P prefills the tokens the
client has; ``slow_short`` goes on from the fake's own generated ids up to tok19); a prefiller or a
decoder with nothing movable finishes in place; the call answers once nothing is in flight there.
"""

from __future__ import annotations

import json
import threading
import time
from typing import Any

import httpx
import pytest

from proxy.admin.drain import held_counts
from tests.support.metrics import metric
from tests.support.router_rig import (
    Backends,
    Router,
    RouterFactory,
    admin_headers,
    http_client,
    new_rid,
    records,
    request_body,
    sse_events,
    wait_state,
    wait_until,
)


def _drain(router: Router, port: int, role: str = "decode", **extra: Any) -> httpx.Response:
    payload = {"role": role, "host": "127.0.0.1", "port": port, **extra}
    return httpx.post(
        f"{router.url}/instances/drain", json=payload, headers=admin_headers(router), timeout=60, trust_env=False
    )


class _Client(threading.Thread):
    """One streamed request in the background; ``events`` once it ended."""

    def __init__(self, router: Router, rid: str, path: str = "/v1/completions", **extra: Any) -> None:
        super().__init__(daemon=True)
        self.url, self.rid, self.path = f"{router.url}{path}", rid, path
        self.body = request_body(path, stream=True, bootstrap_room=0, **extra)
        self.events: list[str] = []
        self.status = 0

    def run(self) -> None:
        with http_client(60) as client:
            try:
                response = client.post(self.url, json=self.body, headers={"X-Request-Id": self.rid})
            except httpx.HTTPError:  # the Router stopped under it (a test that does not wait)
                return
        self.status = response.status_code
        self.events = sse_events(response.content)


def _texts(events: list[str]) -> str:
    return "".join(c.get("text") or "" for e in events if e != "[DONE]" for c in json.loads(e).get("choices") or ())


def test_drained_decoder_stream_moves_by_replay(backends: Backends, fresh_router: RouterFactory) -> None:
    router = fresh_router(backends.ok_p, (backends.slow_stream, backends.slow_short))
    rid = new_rid("drain")
    client = _Client(router, rid, max_tokens=20, stream_options={"include_usage": True})
    client.start()
    wait_state(backends.slow_stream, rid, "started")
    time.sleep(0.3)  # a few tokens out
    answer = _drain(router, backends.slow_stream)
    client.join(30)
    assert answer.status_code == 200, answer.text
    (result,) = answer.json()["results"]
    assert result["result"] == "drained" and result["moved"] == {"replay": 1} and result["waited"] == 0
    assert result["kv_bytes_moved"] == 0 and result["held"] is None  # the fake has no /metrics
    assert [d["port"] for d in answer.json()["decoders"]] == [backends.slow_short]
    assert client.status == 200 and client.events[-1] == "[DONE]"
    assert not any("error" in json.loads(e) for e in client.events[:-1])
    assert _texts(client.events) == "".join(f"tok{i} " for i in range(20))
    assert json.loads(client.events[-2])["usage"]["completion_tokens"] == 20
    assert wait_state(backends.slow_stream, rid, "disconnected")  # D's request aborted
    (moved,) = records(backends.slow_short, rid)
    assert moved["body"]["prompt"][:2] == [ord("H"), ord("i")] and moved["body"]["prompt"][2] == 1000
    assert metric(router.url, "pd_router_resumes_total", reason="drain") == 1
    assert metric(router.url, "pd_router_drain_moves_total", mode="replay") == 1
    assert metric(router.url, "pd_router_drains_total", role="decode", outcome="drained") == 1
    assert metric(router.url, "pd_router_drain_seconds_count", role="decode") == 1

    def logged() -> str | None:
        text = router.proc.log_text()
        return text if f"rid={rid} room" in text and " drain +" in text else None

    log = wait_until(logged, 10)
    assert "drain drained in" in log and "moving off draining" in log


def test_unmovable_stream_finishes_in_place(backends: Backends, fresh_router: RouterFactory) -> None:
    router = fresh_router(backends.ok_p, (backends.slow_short, backends.ok_d))
    rid = new_rid("drain-chat")
    client = _Client(router, rid, "/v1/chat/completions", n=2)  # n > 1: not resumed
    client.start()
    wait_state(backends.slow_short, rid, "started")
    answer = _drain(router, backends.slow_short)
    client.join(30)
    assert answer.status_code == 200, answer.text
    (result,) = answer.json()["results"]
    assert result["result"] == "drained" and result["moved"] == {}
    assert client.events[-1] == "[DONE]" and records(backends.ok_d, rid) == []
    assert wait_state(backends.slow_short, rid, "completed")


def test_drain_timeout_answers_504(backends: Backends, fresh_router: RouterFactory) -> None:
    router = fresh_router(backends.ok_p, (backends.slow_stream2, backends.ok_d))
    rid = new_rid("drain-timeout")
    client = _Client(router, rid, "/v1/chat/completions", n=2)  # n > 1: not resumed, it stays
    client.start()
    wait_state(backends.slow_stream2, rid, "started")
    answer = _drain(router, backends.slow_stream2, timeout_s=0.5)
    assert answer.status_code == 504
    assert answer.json()["results"][0]["result"] == "timeout"
    assert metric(router.url, "pd_router_drains_total", role="decode", outcome="timeout") == 1


def test_prefiller_drain_and_refusals(backends: Backends, fresh_router: RouterFactory) -> None:
    router = fresh_router((backends.ok_p, backends.ok_p2), backends.ok_d)
    answer = _drain(router, backends.ok_p, role="prefill")
    assert answer.status_code == 200, answer.text
    assert answer.json()["results"][0]["result"] == "drained"
    assert [p["port"] for p in answer.json()["prefillers"]] == [backends.ok_p2]
    assert _drain(router, backends.ok_p, role="prefill").status_code == 404  # gone from the pool
    assert _drain(router, backends.ok_d, timeout_s=0).status_code == 400
    refused = httpx.post(
        f"{router.url}/instances/drain", json={"role": "decode", "host": "127.0.0.1", "port": 1}, trust_env=False
    )
    assert refused.status_code == 401


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("", {}),
        ('# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running{engine="0"} 2.0\n', {}),
        (
            'vllm:num_requests_running{engine="0"} 2.0\nvllm:num_requests_running{engine="1"} 1.0\n'
            "vllm:pd_kv_rooms_held 0.0\n",
            {"vllm:num_requests_running": 3.0, "vllm:pd_kv_rooms_held": 0.0},
        ),
    ],
)
def test_held_counts(text: str, expected: dict[str, float]) -> None:
    names = ("vllm:num_requests_running", "vllm:pd_kv_rooms_held")
    got = held_counts(text, names)
    if text.startswith("# TYPE"):
        assert got == {"vllm:num_requests_running": 2.0}
    else:
        assert got == expected
