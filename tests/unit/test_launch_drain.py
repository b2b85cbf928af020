"""SIGTERM on a launcher drains its instances first (launch/drain.py, ProcessGroup.drain), bounded.

No vLLM: a sleeping child process stands for an instance, a small HTTP server for the Router's
``/instances/drain`` and an instance's ``/metrics``.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from launch.drain import drain_all, idle_drainer, router_drainer

REPO = Path(__file__).resolve().parents[2]


class _Fake(ThreadingHTTPServer):
    calls: list[tuple[str, dict[str, Any], str | None]]
    metrics: list[str]


class _Handler(BaseHTTPRequestHandler):
    server: _Fake

    def log_message(self, *args: Any) -> None:
        pass

    def _reply(self, status: int, body: bytes, content_type: str = "application/json") -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.server.calls.append((self.path, body, self.headers.get("Authorization")))
        self._reply(200, json.dumps({"message": f"{body['role']} {body['port']}: drained in 0.1 s"}).encode())

    def do_GET(self) -> None:
        text = self.server.metrics.pop(0) if len(self.server.metrics) > 1 else self.server.metrics[0]
        self._reply(200, text.encode(), "text/plain")


@pytest.fixture
def fake() -> Iterator[_Fake]:
    server = _Fake(("127.0.0.1", 0), _Handler)
    server.calls, server.metrics = [], [""]
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()


def _url(server: _Fake) -> str:
    return f"http://127.0.0.1:{server.server_address[1]}"


def test_router_drainer_posts_the_instance_with_the_bound(fake: _Fake) -> None:
    drain = router_drainer(_url(fake), "decode", "127.0.0.1", 8200, token="t0k")
    assert drain(10.0) == "decode 8200: drained in 0.1 s"
    ((path, body, auth),) = fake.calls
    assert path == "/instances/drain" and auth == "Bearer t0k"
    assert body == {"role": "decode", "host": "127.0.0.1", "port": 8200, "timeout_s": 9.0}


def test_idle_drainer_waits_for_no_room_held(fake: _Fake) -> None:
    fake.metrics = [
        'vllm:num_requests_running{engine="0"} 0.0\nvllm:pd_kv_rooms_held{engine="0"} 2.0\n',
        'vllm:num_requests_running{engine="0"} 0.0\nvllm:pd_kv_rooms_held{engine="0"} 1.0\n',
        'vllm:num_requests_running{engine="0"} 0.0\nvllm:pd_kv_rooms_held{engine="0"} 0.0\n',
    ]
    assert idle_drainer(_url(fake), "prefill")(10.0).startswith("idle after")
    fake.metrics = ['vllm:pd_kv_rooms_held{engine="0"} 3.0\n']
    assert idle_drainer(_url(fake), "prefill")(0.6).startswith("still holding {'vllm:pd_kv_rooms_held': 3.0}")
    fake.metrics = ["other_metric 1.0\n"]
    assert idle_drainer(_url(fake), "decode")(1.0).startswith("no metrics to wait on")


class _Proc:
    def __init__(self, label: str, drain: Any) -> None:
        self.label, self.drain = label, drain


def test_drain_all_is_bounded_and_never_raises() -> None:
    lines: list[str] = []

    def slow(bound: float) -> str:
        time.sleep(30)
        return "never"

    def broken(bound: float) -> str:
        raise RuntimeError("router gone")

    start = time.monotonic()
    drain_all([_Proc("a", slow), _Proc("b", broken), _Proc("c", None)], 0.5, lines.append)
    assert time.monotonic() - start < 3
    assert lines[0] == "draining a, b first (at most 0 s)"
    assert any("b drain failed (RuntimeError: router gone); stopping it anyway" in line for line in lines)


def test_sigterm_drains_before_it_stops(tmp_path: Path, fake: _Fake) -> None:
    """A launcher holding a ProcessGroup, sent SIGTERM: the instance's drain runs while it still runs."""
    script = textwrap.dedent(
        f"""
        import sys, time
        sys.path.insert(0, {str(REPO)!r})
        from launch.drain import router_drainer
        from launch.processes import ProcessGroup
        with ProcessGroup({str(tmp_path)!r}, stop_grace_s=1.0, drain_s=5.0, report=print) as group:
            p = group.start("decode", [sys.executable, "-c", "import time; time.sleep(600)"])
            drain = router_drainer({_url(fake)!r}, "decode", "127.0.0.1", 8200, token="x")
            def checked(bound):
                assert p.is_running()
                return drain(bound)
            p.drain = checked
            print(p.pid, flush=True)
            group.wait()
        """
    )
    holder = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None
        int(holder.stdout.readline())
        holder.send_signal(signal.SIGTERM)
        assert holder.wait(timeout=30) == 128 + signal.SIGTERM
        out = holder.stdout.read()
        assert "draining decode first (at most 5 s)" in out
        assert "decode drained: decode 8200: drained in 0.1 s" in out
        assert out.index("decode drained") < out.index("stopping decode")
        ((_, body, _),) = fake.calls
        assert body["timeout_s"] == 4.0
    finally:
        if holder.poll() is None:
            holder.kill()
