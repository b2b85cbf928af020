"""A decoder drained under load (``POST /instances/drain``): no client sees an error, the call returns
once the decoder holds nothing, and nothing stays held anywhere.

Module setup (as test_router_failover.py): one extra decode instance (a second consumer of the
session stack's prefiller) and a Router of its own in front of P and both decoders (``--routing
room``: even rooms to the stack's decoder, odd rooms to the extra one). 8 long greedy streams run,
rooms 2k and 2k+1 with the same prompt; the extra decoder is drained once its streams are under way.

The move is by REPLAY today (proxy/drain.py): the drained decoder's streams go on on the other
decoder after P prefilled their prompt plus the tokens already sent; its KV is not pushed D -> D
(``kv_bytes_moved`` 0). The even room's stream, never moved, is what the moved one must equal.
"""

from __future__ import annotations

import os
import re
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from launch.processes import ProcessGroup, free_port, vllm_env, vllm_serve_cmd, wait_http_ok
from proxy.admin_token import admin_headers
from proxy.drain import HELD_METRICS, held_counts
from tests.e2e.test_router_failover import Outcome, TwoDecoders, _complete, _router_metric, _running_requests, _stream
from tests.support.serving import D_KV_WAIT_TIMEOUT_S, START_TIMEOUT_S, wait_kv_free

pytestmark = pytest.mark.e2e

STREAM_TOKENS = 1900  # prompt 60 + 1900 fits --max-model-len 2048
CLIENT_BOUND_S = 300.0


@pytest.fixture(scope="module")
def drain_pair(pd_stack, tmp_path_factory: pytest.TempPathFactory):
    log_dir = tmp_path_factory.mktemp("drain-logs")
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
        extra = group.start("decode-drained", cmd, env=vllm_env("1"))
        router_port = free_port()
        router_cmd = [
            sys.executable, "-m", "proxy", "--host", host, "--port", str(router_port),
            "--prefiller-hosts", host, "--prefiller-ports", str(pd_stack.prefill_port),
            "--prefiller-bootstrap-ports", str(pd_stack.bootstrap_port),
            "--decoder-hosts", host, host, "--decoder-ports", str(pd_stack.decode_port), str(extra_port),
            "--health-interval", "1", "--health-timeout", "15", "--trust-client-room",
        ]  # fmt: skip
        router = group.start("router-drain", router_cmd, env=dict(os.environ, PYTHONUNBUFFERED="1"))
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


def _held(url: str, role: str) -> dict[str, float]:
    return held_counts(httpx.get(f"{url}/metrics", timeout=10, trust_env=False).text, HELD_METRICS[role])


def test_drained_decoder_hands_its_streams_over_without_an_error(pd_stack, drain_pair: TwoDecoders) -> None:
    stack = drain_pair
    for room in (2, 3):  # warm both decoders up
        response = _complete(stack.router_url, stack.model, room)
        assert response.status_code == 200, response.text

    rooms = list(range(30, 38))  # concurrency 8; odd rooms on the decoder that drains
    on_extra = [room for room in rooms if room % 2]
    started: list[int] = []
    with ThreadPoolExecutor(len(rooms)) as pool:
        futures = [pool.submit(_stream, stack.router_url, stack.model, room, STREAM_TOKENS, started) for room in rooms]
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if set(on_extra) <= set(started) and _running_requests(stack.extra_decode_url) >= 1:
                break
            time.sleep(0.05)
        assert set(on_extra) <= set(started), f"streams on the drained decoder did not start: {sorted(started)}"
        headers = admin_headers(int(stack.router_url.rsplit(":", 1)[1]))
        body = {"role": "decode", "host": pd_stack.host, "port": stack.extra_port, "timeout_s": 120}
        t0 = time.monotonic()
        answer = httpx.post(
            f"{stack.router_url}/instances/drain", json=body, headers=headers, timeout=180, trust_env=False
        )
        drain_s = time.monotonic() - t0
        held_after = _held(stack.extra_decode_url, "decode")
        outcomes: list[Outcome] = [f.result(timeout=CLIENT_BOUND_S) for f in futures]

    assert answer.status_code == 200, answer.text
    (result,) = answer.json()["results"]
    moved = result["moved"].get("replay", 0)
    print(
        f"\ndrain of {stack.extra_decode_url}: {result['result']} in {drain_s:.2f} s (Router: {result['seconds']} s); "
        f"streams moved {result['moved']} (by replay), finished in place {result['waited']}, "
        f"KV bytes moved {result['kv_bytes_moved']}; held after {held_after}"
    )
    assert result["result"] == "drained" and moved >= 1, result
    assert result["kv_bytes_moved"] == 0  # replay: the decoder's KV is not pushed D -> D (yet)
    assert result["held"] is not None and not any(result["held"].values()), result["held"]
    assert not any(held_after.values()), held_after
    assert [d["port"] for d in answer.json()["decoders"]] == [pd_stack.decode_port]

    by_room = {o.room: o for o in outcomes}
    for outcome in outcomes:  # 0 errors: every stream whole, one answer, the full budget
        assert outcome.status == 200 and outcome.error is None, outcome
        assert outcome.error_event is None, f"room {outcome.room}: {outcome.error_event}"
        assert outcome.done and outcome.finish_reason == "length", outcome.events[-2:]
        assert outcome.usage is not None and outcome.usage["completion_tokens"] == STREAM_TOKENS, outcome.usage
    for room in on_extra:  # greedy: the moved stream is the uninterrupted one's twin
        assert by_room[room].text == by_room[room - 1].text, f"room {room} differs from room {room - 1}"
    assert (
        _router_metric(stack.router_url, 'pd_router_resumes_total{endpoint="/v1/completions",reason="drain"}') == moved
    )
    assert _router_metric(stack.router_url, "pd_router_drain_moves_total") == moved
    log = Path(stack.router.log_path).read_text(errors="replace")
    traced = re.findall(r"rid=\S+ room=\d+ POST .* drain \+[\d.]+ ms.* resumed \+", log)
    assert len(traced) == moved, "the phase trace of each moved request shows drain, cut and resume"

    # Nothing held afterwards: the drained decoder, the live one, the prefiller.
    assert wait_kv_free(stack.extra_decode_url, timeout=30) == 0.0
    assert wait_kv_free(stack.live_decode_url, timeout=30) == 0.0
    assert wait_kv_free(pd_stack.prefill_url, timeout=60) == 0.0
    assert not any(_held(pd_stack.prefill_url, "prefill").values())
