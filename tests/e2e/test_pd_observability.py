"""Observability with real processes: connector metrics on P's and D's /metrics (and vLLM's
periodic log line), phase-trace lines of P, D and the Router, and the waterfall picture."""

from __future__ import annotations

import json
import random
import string
import threading
import time
import uuid
from pathlib import Path

import httpx
import pytest

from launch.trace import draw, load_traces
from pd_connector.metrics import METRIC_NAMES
from pd_connector.trace import PHASES, TraceRecord, parse_trace_line
from tests.support.metrics import metric, wait_metric
from tests.support.serving import BLOCK_SIZE, D_KV_WAIT_TIMEOUT_S, count_in_log

pytestmark = pytest.mark.e2e


def block_bytes(model_dir: str) -> int:
    """KV bytes of one block, from the model's shape (vLLM CPU: K and V per layer, fp32)."""
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    return cfg["num_hidden_layers"] * 2 * cfg["num_key_value_heads"] * head_dim * BLOCK_SIZE * 4


def random_prompt(n: int) -> str:
    return "".join(random.choices(string.ascii_letters, k=n))  # no prefix-cache hit on D


def post(url: str, body: dict, timeout: float = 120, headers: dict | None = None) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", json=body, timeout=timeout, trust_env=False, headers=headers)


def test_bytes_on_metrics_match_the_model_shape(pd_stack) -> None:
    sent, received = METRIC_NAMES["bytes_sent"] + "_total", METRIC_NAMES["bytes_received"] + "_total"
    p0, d0 = metric(pd_stack.prefill_url, sent), metric(pd_stack.decode_url, received)
    expected = 0
    for n in (40, 75, 150):  # 2, 3 and 5 blocks
        body = {"model": pd_stack.model, "prompt": random_prompt(n), "max_tokens": 3, "temperature": 0}
        resp = post(pd_stack.router_url, body)
        assert resp.status_code == 200, resp.text
        expected += -(-resp.json()["usage"]["prompt_tokens"] // BLOCK_SIZE) * block_bytes(pd_stack.model)
    p_bytes = wait_metric(pd_stack.prefill_url, sent, p0 + expected) - p0
    d_bytes = wait_metric(pd_stack.decode_url, received, d0 + expected) - d0
    print(f"expected {expected} bytes; P /metrics {p_bytes:.0f}, D /metrics {d_bytes:.0f}")
    assert p_bytes == d_bytes == expected
    for url, key in ((pd_stack.prefill_url, "transfer_seconds"), (pd_stack.decode_url, "handshake_seconds")):
        assert metric(url, METRIC_NAMES[key] + "_count") >= 3
    assert metric(pd_stack.prefill_url, METRIC_NAMES["rooms_held"]) == 0
    assert metric(pd_stack.decode_url, METRIC_NAMES["loads_waiting"]) == 0


def test_failures_counted_by_reason(pd_stack) -> None:
    """A load for a room P never computes (timeout, after kv_wait_timeout_s) on D; then vLLM's periodic
    log line. Requests that never reach the connector: a bootstrap server nobody listens on (D's
    middleware answers 502) and a prefill DP rank the deployment does not have (400 naming it; the
    connector's own peer_lost count is covered by tests/unit/test_liveness_manager.py)."""
    failures = METRIC_NAMES["failures"] + "_total"
    before = {r: metric(pd_stack.decode_url, failures, reason=r) for r in ("peer_lost", "timeout")}

    def decode_only(port: int, dp_rank: int | None = None) -> httpx.Response:
        params = {
            "do_remote_prefill": True,
            "bootstrap_room": random.getrandbits(63),
            "bootstrap_host": "127.0.0.1",
            "bootstrap_port": port,
            **({} if dp_rank is None else {"prefill_dp_rank": dp_rank}),
        }
        body = {"model": pd_stack.model, "prompt": random_prompt(50), "max_tokens": 2, "kv_transfer_params": params}
        resp = post(pd_stack.decode_url, body, timeout=D_KV_WAIT_TIMEOUT_S + 60)
        assert resp.status_code >= 400
        return resp

    slow = threading.Thread(target=decode_only, args=(pd_stack.bootstrap_port,))
    slow.start()
    refused = decode_only(pd_stack.bootstrap_port, dp_rank=5)  # P has DP size 1
    assert refused.status_code == 400 and "prefill_dp_rank 5" in refused.text, refused.text
    assert metric(pd_stack.decode_url, failures, reason="peer_lost") == before["peer_lost"]
    slow.join()
    got = wait_metric(pd_stack.decode_url, failures, before["timeout"] + 1, reason="timeout")
    assert got == before["timeout"] + 1
    assert metric(pd_stack.decode_url, failures, reason="mismatch") >= 0  # every reason is exported
    deadline = time.monotonic() + 30
    while count_in_log(pd_stack.decode.log_path, r"KV Transfer metrics: .*failures=") == 0:
        assert time.monotonic() < deadline, "no 'KV Transfer metrics' line in D's log"
        time.sleep(1)


def traces_of(path: Path, room: int) -> list[TraceRecord]:
    return [r for r in map(parse_trace_line, path.read_text(errors="replace").splitlines()) if r and r.room == room]


def traced_request(pd_stack, prompt_len: int, max_tokens: int) -> int:
    """Send one request through the Router; its room, read from the Router's trace line."""
    rid = uuid.uuid4().hex
    body = {"model": pd_stack.model, "prompt": random_prompt(prompt_len), "max_tokens": max_tokens}
    assert post(pd_stack.router_url, body, headers={"X-Request-Id": rid}).status_code == 200
    deadline = time.monotonic() + 10
    while True:
        text = pd_stack.router.log_path.read_text(errors="replace")
        for rec in filter(None, map(parse_trace_line, text.splitlines())):
            if rec.side == "router" and rec.req_id == rid:
                return rec.room
        assert time.monotonic() < deadline, f"no Router trace line for req={rid}"
        time.sleep(0.2)


def test_one_request_traced_on_router_p_and_d(pd_stack) -> None:
    room = traced_request(pd_stack, 100, 4)
    logs = {
        "router": pd_stack.router.log_path,
        "prefill": pd_stack.prefill.log_path,
        "decode": pd_stack.decode.log_path,
    }
    deadline = time.monotonic() + 15
    while not all(traces_of(path, room) for path in logs.values()):
        assert time.monotonic() < deadline, {side: traces_of(p, room) for side, p in logs.items()}
        time.sleep(0.25)
    rec = {side: traces_of(path, room)[-1] for side, path in logs.items()}
    # The Router marks the one path it chose (--path-policy; the suites pin always-pd): path_pd.
    expected = {side: [n for n in PHASES[side] if not n.startswith("path_") or n == "path_pd"] for side in logs}
    for side, r in rec.items():
        assert r.side == side and r.outcome == "ok", r
        assert {name for name, _ in r.phases} == set(expected[side]), r
        assert [ms for _, ms in r.phases] == sorted(ms for _, ms in r.phases)
    p, d, router = rec["prefill"], rec["decode"], rec["router"]
    order = [name for name, _ in p.phases]
    assert order.index("received") < order.index("prefill_done") < order.index("push_started")
    assert order.index("d_asked") < order.index("push_started") < order.index("push_done")
    assert [n for n, _ in d.phases] == list(PHASES["decode"])
    assert [n for n, _ in router.phases] == expected["router"]
    slack = 0.005  # one machine, one clock; the lines round to 0.1 ms
    at = lambda r, ph: r.at(ph) or 0.0  # noqa: E731
    assert at(router, "received") <= at(p, "received") + slack and at(router, "received") <= at(d, "received") + slack
    assert at(p, "push_done") <= at(d, "kv_ready") + slack
    assert at(d, "scheduled") <= at(router, "d_first_byte") + slack <= at(router, "done") + 2 * slack


def test_waterfall_png_from_the_runs_logs(pd_stack, tmp_path) -> None:
    from PIL import Image

    rooms = [traced_request(pd_stack, 60, 2) for _ in range(2)]
    deadline = time.monotonic() + 15
    while not all(len(load_traces(pd_stack.log_dir).get(r, {})) == 3 for r in rooms):
        assert time.monotonic() < deadline
        time.sleep(0.25)
    traced = load_traces(pd_stack.log_dir)
    out = tmp_path / "trace.png"
    groups = draw(traced, out)
    assert groups == len(traced) and set(rooms) <= set(traced)
    with Image.open(out) as img:
        img.verify()
    with Image.open(out) as img:
        assert img.format == "PNG" and img.size[0] >= 800 and img.size[1] >= 100
