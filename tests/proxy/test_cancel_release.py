"""A client that leaves, at any point, has its room released on P's bootstrap server at once.

Real ``python -m proxy`` processes in front of the fake backends; a small HTTP server on the
prefillers' bootstrap port stands for P's bootstrap server and records each ``POST
/bootstrap/release_room`` (pd_connector.bootstrap.rooms_api). The points: before D is asked (the
first-token path, P never answers), after P answered and before D's answer (D never answers), and
mid-stream.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx
import pytest

from tests.support.router_rig import (
    HOST,
    Backends,
    Router,
    RouterFactory,
    http_client,
    new_rid,
    record,
    records,
    request_body,
    wait_until,
)


class FakeBootstrap:
    """Records the release calls it gets; answers as P's bootstrap server does."""

    def __init__(self, port: int) -> None:
        self.released: list[dict[str, Any]] = []
        calls = self.released

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                body = json.loads(self.rfile.read(int(self.headers["content-length"])))
                calls.append({"path": self.path, **body})
                answer = json.dumps({"room": body.get("room"), "before": "held", "ranks_told": 1}).encode()
                self.send_response(200)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer((HOST, port), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def rooms(self) -> list[int]:
        return [c["room"] for c in self.released if c["path"] == "/bootstrap/release_room"]

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def with_bootstrap(fresh_router: RouterFactory) -> Iterator[Any]:
    made: list[FakeBootstrap] = []

    def make(p: int, d: int, *extra: str) -> tuple[Router, FakeBootstrap]:
        router = fresh_router(p, d, "--health-interval", "0", *extra)
        made.append(FakeBootstrap(router.bootstrap_port))
        return router, made[-1]

    yield make
    for fake in made:
        fake.close()


def _leave_after(url: str, rid: str, room: int, seconds: float, stream: bool = True) -> None:
    """Send one request with ``room`` and go away after ``seconds`` (or once the first chunk came)."""
    body = request_body("/v1/completions", stream=stream, bootstrap_room=room)
    with http_client(timeout=seconds) as client:
        try:
            with client.stream("POST", f"{url}/v1/completions", json=body, headers={"X-Request-Id": rid}) as r:
                for _ in r.iter_bytes():
                    break  # mid-stream: the first chunk came
        except httpx.TimeoutException:
            pass  # before the answer


def test_leaving_before_decode_is_asked_releases_the_room(backends: Backends, with_bootstrap: Any) -> None:
    router, fake = with_bootstrap(backends.hang, backends.ok_d, "--first-token-from-prefill")
    rid = new_rid("leave-before-d")
    _leave_after(router.url, rid, 2001, 1.0)
    wait_until(lambda: 2001 in fake.rooms(), timeout=10)
    assert records(backends.ok_d, rid) == []  # D never saw the request
    release = next(c for c in fake.released if c["room"] == 2001)
    assert release["reason"] == "client disconnected before the answer"


def test_leaving_after_p_answered_releases_the_room(backends: Backends, with_bootstrap: Any) -> None:
    router, fake = with_bootstrap(backends.ok_p, backends.hang)
    rid = new_rid("leave-after-p")
    _leave_after(router.url, rid, 2002, 1.5)
    wait_until(lambda: 2002 in fake.rooms(), timeout=10)
    assert record(backends.ok_p, rid)["body"]["kv_transfer_params"]["bootstrap_room"] == 2002


def test_leaving_mid_stream_releases_the_room(backends: Backends, with_bootstrap: Any) -> None:
    router, fake = with_bootstrap(backends.ok_p, backends.slow_stream)
    rid = new_rid("leave-mid-stream")
    _leave_after(router.url, rid, 2003, 10.0)
    wait_until(lambda: 2003 in fake.rooms(), timeout=10)
    release = next(c for c in fake.released if c["room"] == 2003)
    assert release["reason"] == "client disconnected mid-stream"


def test_a_request_that_ends_well_releases_nothing(backends: Backends, with_bootstrap: Any) -> None:
    router, fake = with_bootstrap(backends.ok_p, backends.ok_d)
    rid = new_rid("no-release")
    with http_client() as client:
        answer = client.post(
            f"{router.url}/v1/completions",
            json=request_body("/v1/completions", bootstrap_room=2004),
            headers={"X-Request-Id": rid},
        )
    assert answer.status_code == 200
    record(backends.ok_d, rid)
    assert 2004 not in fake.rooms()


def test_with_no_decoder_left_the_room_is_released_on_p_not_through_a_decoder(
    backends: Backends, with_bootstrap: Any
) -> None:
    """P answered the first token and the only decoder cannot be reached: P's bootstrap server frees the
    room; no decoder's one-token load is sent."""
    router, fake = with_bootstrap(backends.ok_p, backends.down, "--first-token-from-prefill", "--max-retries", "1")
    rid = new_rid("release-on-p")
    with http_client() as client:
        body = request_body("/v1/completions", stream=True, bootstrap_room=2005)
        client.post(f"{router.url}/v1/completions", json=body, headers={"X-Request-Id": rid})
    wait_until(lambda: 2005 in fake.rooms(), timeout=10)
    release = next(c for c in fake.released if c["room"] == 2005)
    assert release["reason"] == "no decoder of the request will load it"
