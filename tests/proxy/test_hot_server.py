"""The Router's raw HTTP/1.1 server for the generation endpoints (proxy/server/hot_server.py), over raw sockets.

A real ``python -m proxy`` in front of the fake backends; each test writes the HTTP bytes itself
so that keep-alive, hand-over to aiohttp mid-connection, ``Expect: 100-continue``, chunked
bodies, HTTP/1.0, pipelining and malformed requests are exercised exactly.
"""

from __future__ import annotations

import json

from tests.support.raw_http import RawConnection, json_body, raw_post
from tests.support.router_rig import Backends, RouterFactory, new_rid, request_body, sse_events


def test_one_connection_serves_generation_then_other_routes_then_generation(
    backends: Backends, router_factory: RouterFactory
) -> None:
    router = router_factory(backends.ok_p, backends.ok_d)
    conn = RawConnection(router.proc.port)
    try:
        rid = new_rid("hot-mixed")
        conn.send(raw_post("/v1/completions", json_body("/v1/completions"), rid))
        status, headers, body = conn.answer()
        assert status == 200, body
        assert headers["x-request-id"] == rid
        assert json.loads(body)["choices"]
        conn.send(b"GET /health HTTP/1.1\r\nHost: router\r\n\r\n")  # handed over to aiohttp
        status, _, body = conn.answer("GET")
        assert status == 200, body
        assert json.loads(body)["status"] == "healthy"
        conn.send(raw_post("/v1/chat/completions", json_body("/v1/chat/completions", stream=True), rid))
        status, headers, body = conn.answer()
        assert status == 200, body
        assert headers["content-type"].startswith("text/event-stream")
        assert sse_events(body)[-1] == "[DONE]"
    finally:
        conn.close()


def test_keep_alive_stream_then_json_and_pipelined_requests(backends: Backends, router_factory: RouterFactory) -> None:
    router = router_factory(backends.ok_p, backends.ok_d)
    conn = RawConnection(router.proc.port)
    try:
        first, second = new_rid("hot-pipe1"), new_rid("hot-pipe2")
        stream = raw_post("/v1/completions", json_body("/v1/completions", stream=True), first)
        conn.send(stream + raw_post("/v1/completions", json_body("/v1/completions"), second))  # one write, two requests
        status, headers, body = conn.answer()
        assert (status, headers["x-request-id"], headers["transfer-encoding"]) == (200, first, "chunked")
        assert sse_events(body)[-1] == "[DONE]"
        status, headers, body = conn.answer()
        assert (status, headers["x-request-id"]) == (200, second)
        assert json.loads(body)["choices"]
    finally:
        conn.close()


def test_expect_100_continue_and_chunked_body(backends: Backends, router_factory: RouterFactory) -> None:
    router = router_factory(backends.ok_p, backends.ok_d)
    conn = RawConnection(router.proc.port)
    try:
        body = json_body("/v1/completions")
        head = "POST /v1/completions HTTP/1.1\r\nHost: router\r\nExpect: 100-continue\r\n"
        conn.send(f"{head}Content-Length: {len(body)}\r\n\r\n".encode())
        assert conn.file.readline() == b"HTTP/1.1 100 Continue\r\n"
        assert conn.file.readline() == b"\r\n"
        conn.send(body)
        status, _, answer = conn.answer()
        assert status == 200, answer
        half = len(body) // 2
        chunked = b"%x\r\n%b\r\n%x\r\n%b\r\n0\r\n\r\n" % (half, body[:half], len(body) - half, body[half:])
        conn.send(b"POST /v1/completions HTTP/1.1\r\nHost: router\r\nTransfer-Encoding: chunked\r\n\r\n" + chunked)
        status, _, answer = conn.answer()
        assert status == 200, answer
        assert json.loads(answer)["choices"]
    finally:
        conn.close()


def test_http_1_0_stream_ends_with_the_connection(backends: Backends, router_factory: RouterFactory) -> None:
    router = router_factory(backends.ok_p, backends.ok_d)
    conn = RawConnection(router.proc.port)
    try:
        conn.send(
            raw_post("/v1/completions", json_body("/v1/completions", stream=True), new_rid("hot-10"), version="1.0")
        )
        status, headers, body = conn.answer()
        assert status == 200, body
        assert "transfer-encoding" not in headers
        assert sse_events(body)[-1] == "[DONE]"
    finally:
        conn.close()


def test_bad_json_413_and_malformed_http(backends: Backends, router_factory: RouterFactory) -> None:
    router = router_factory(backends.ok_p, backends.ok_d, "--max-body-size", "300")
    conn = RawConnection(router.proc.port)
    try:
        conn.send(raw_post("/v1/completions", b"{not json", new_rid("hot-bad")))
        status, _, body = conn.answer()
        assert status == 400, body
        assert "not valid JSON" in json.loads(body)["error"]["message"]
        big = json.dumps(request_body("/v1/completions", prompt="x" * 400)).encode()
        conn.send(raw_post("/v1/completions", big, new_rid("hot-413")))
        status, _, body = conn.answer()
        assert status == 413, body
        assert "exceeds the limit of 300 bytes" in json.loads(body)["error"]["message"]
        assert conn.closed_by_peer()  # a body over the limit is not read: the connection closes
    finally:
        conn.close()
    conn = RawConnection(router.proc.port)
    try:
        conn.send(raw_post("/v1/completions", b"{not json", new_rid("hot-bad2")))
        status, _, body = conn.answer()
        assert status == 400, body
        conn.send(raw_post("/v1/completions", json_body("/v1/completions"), new_rid("hot-after-400")))
        status, _, body = conn.answer()
        assert status == 200, body  # the connection survived the JSON error
    finally:
        conn.close()
    conn = RawConnection(router.proc.port)
    try:
        conn.send(b"POST /v1/completions HTTP/1.1\r\nContent-Length: nope\r\n\r\n")
        status, headers, body = conn.answer()
        assert status == 400, body
        assert json.loads(body)["error"]["type"] == "invalid_request_error"
        assert headers["connection"] == "close"
        assert conn.closed_by_peer()
    finally:
        conn.close()


def test_get_on_a_generation_path_is_aiohttps_405(backends: Backends, router_factory: RouterFactory) -> None:
    router = router_factory(backends.ok_p, backends.ok_d)
    conn = RawConnection(router.proc.port)
    try:
        conn.send(b"GET /v1/completions HTTP/1.1\r\nHost: router\r\n\r\n")
        status, _, body = conn.answer("GET")
        assert status == 405, body
    finally:
        conn.close()
