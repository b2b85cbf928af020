"""vLLM's own benchmark client (``vllm bench serve``, random dataset) through the Router: zero failed requests
(the session stack's Router, and a ``--workers 2`` Router in front of the same P and D)."""

from __future__ import annotations

import json
import subprocess
import sys

import httpx
import pytest

from launch.processes import LOOPBACK, REPO_ROOT, ProcessGroup, free_ports, router_cmd, wait_all_healthy
from tests.support.serving import P_ROOM_TIMEOUT_S, wait_kv_free

pytestmark = pytest.mark.e2e

NUM_PROMPTS = 40


def _bench(router_url: str, model: str, tmp_path) -> tuple[dict, str]:
    """``vllm bench serve`` through ``router_url``: its saved report and the tail of its output."""
    cmd = [
        sys.executable, "-m", "launch.vllm_cli", "bench", "serve",
        "--backend", "openai",
        "--base-url", router_url,
        "--endpoint", "/v1/completions",
        "--model", model,
        "--tokenizer", model,
        "--dataset-name", "random",
        "--random-input-len", "64",
        "--random-output-len", "16",
        "--num-prompts", str(NUM_PROMPTS),
        "--max-concurrency", "8",
        "--seed", "7",
        "--disable-tqdm",
        "--save-result", "--save-detailed",
        "--result-dir", str(tmp_path),
        "--result-filename", "bench.json",
    ]  # fmt: skip
    result = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=900)
    output = result.stdout[-4000:] + result.stderr[-4000:]
    assert result.returncode == 0, output
    return json.loads((tmp_path / "bench.json").read_text()), output


def test_vllm_bench_serve_through_the_router(pd_stack, tmp_path) -> None:
    report, output = _bench(pd_stack.router_url, pd_stack.model, tmp_path)
    errors = [e for e in report.get("errors", []) if e]
    assert report["failed"] == 0, f"{report['failed']} failed: {errors[:3]}\n{output}"
    assert report["completed"] == NUM_PROMPTS, output
    assert report["total_output_tokens"] > 0
    # The Router saw every request, answered all of them with 200, and nothing stays held.
    metrics = httpx.get(f"{pd_stack.router_url}/metrics", timeout=10, trust_env=False).text
    assert 'pd_router_requests_total{endpoint="/v1/completions",status="200"}' in metrics
    assert wait_kv_free(pd_stack.decode_url) == 0.0
    assert wait_kv_free(pd_stack.prefill_url, timeout=P_ROOM_TIMEOUT_S + 30) == 0.0


def test_vllm_bench_serve_through_two_router_workers(pd_stack, tmp_path) -> None:
    (port,) = free_ports(1)
    prefill = [(LOOPBACK, pd_stack.prefill_port, pd_stack.bootstrap_port)]
    decode = [(LOOPBACK, pd_stack.decode_port)]
    with ProcessGroup(tmp_path / "logs") as group:
        router = group.start("router-workers", [*router_cmd(port, prefill, decode), "--workers", "2"])
        url = f"http://{LOOPBACK}:{port}"
        wait_all_healthy([(f"{url}/health", router)], 60)
        report, output = _bench(url, pd_stack.model, tmp_path)
        assert report["failed"] == 0, f"{report['failed']} failed: {report.get('errors', [])[:3]}\n{output}"
        assert report["completed"] == NUM_PROMPTS, output
        log = router.log_path.read_text(errors="replace")
    # Every request has its line, written by one of the two workers.
    served = [line for line in log.splitlines() if "POST /v1/completions" in line and "status=200" in line]
    assert len(served) >= NUM_PROMPTS, log[-3000:]
    assert all("proxy[w0]: rid=" in line or "proxy[w1]: rid=" in line for line in served), served[:3]
    assert wait_kv_free(pd_stack.decode_url) == 0.0
    assert wait_kv_free(pd_stack.prefill_url, timeout=P_ROOM_TIMEOUT_S + 30) == 0.0
