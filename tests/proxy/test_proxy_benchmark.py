"""benchmarks/router.py runs end to end (a very short run; the numbers are not checked here)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from proxy_testlib import REPO_ROOT

BENCHMARK = REPO_ROOT / "benchmarks" / "router.py"
ASCEND_PROXY = (
    REPO_ROOT.parent / "shared" / "peers" / "vllm-ascend-0.23.0.post1" / "load_balance_proxy_server_example.py"
)


@pytest.mark.skipif(not ASCEND_PROXY.is_file(), reason="vLLM-Ascend's example proxy is not in ../shared/peers")
def test_benchmark_runs_and_prints_its_json(tmp_path) -> None:
    args = ["--rounds", "1", "--duration", "0.5", "--latency-duration", "0.3", "--concurrency", "8"]
    result = subprocess.run(
        [sys.executable, str(BENCHMARK), *args, "--log-dir", str(tmp_path)],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout)
    assert set(report) >= {"added_p50_ms", "rps", "rps_ratio_vs_ascend_proxy", "targets", "targets_met"}
    assert set(report) >= {"rps_ratio_vs_vllm_router", "vllm_router_added_p50_ms", "router_cpus", "router_workers"}
    assert report["router_workers"] == len(report["router_cpus"])
    for target in ("direct", "router", "ascend_proxy"):
        assert report["targets"][target]["failed"] == 0, report
        assert report["targets"][target]["rps"] > 0
