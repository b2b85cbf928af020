"""vLLM's own benchmark client (``vllm bench serve``, random dataset) through the Router: zero failed requests."""

from __future__ import annotations

import json
import subprocess
import sys

import httpx
import pytest

from launch.processes import REPO_ROOT
from tests.e2e.conftest import P_ROOM_TIMEOUT_S
from tests.e2e.helpers import wait_kv_free

pytestmark = pytest.mark.e2e

NUM_PROMPTS = 40


def test_vllm_bench_serve_through_the_router(pd_stack, tmp_path) -> None:
    cmd = [
        sys.executable, "-m", "launch.vllm_cli", "bench", "serve",
        "--backend", "openai",
        "--base-url", pd_stack.router_url,
        "--endpoint", "/v1/completions",
        "--model", pd_stack.model,
        "--tokenizer", pd_stack.model,
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
    report = json.loads((tmp_path / "bench.json").read_text())
    errors = [e for e in report.get("errors", []) if e]
    assert report["failed"] == 0, f"{report['failed']} failed: {errors[:3]}\n{output}"
    assert report["completed"] == NUM_PROMPTS, output
    assert report["total_output_tokens"] > 0
    # The Router saw every request, answered all of them with 200, and nothing stays held.
    metrics = httpx.get(f"{pd_stack.router_url}/metrics", timeout=10, trust_env=False).text
    assert 'pd_router_requests_total{endpoint="/v1/completions",status="200"}' in metrics
    assert wait_kv_free(pd_stack.decode_url) == 0.0
    assert wait_kv_free(pd_stack.prefill_url, timeout=P_ROOM_TIMEOUT_S + 30) == 0.0
