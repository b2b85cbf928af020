"""examples/cpu_1p1d/run.sh end to end: real P, D and Router from plain shell commands."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from launch.processes import free_ports, group_alive
from tests.support.serving import START_TIMEOUT_S

pytestmark = pytest.mark.e2e

SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "cpu_1p1d" / "run.sh"


def _kill_leftovers(pid_file: Path) -> list[int]:
    """SIGKILL the process group of every pid the script recorded that is still alive; return them."""
    alive = []
    for line in pid_file.read_text().split() if pid_file.exists() else []:
        pid = int(line)
        if group_alive(pid):
            alive.append(pid)
            os.killpg(pid, signal.SIGKILL)
    return alive


def test_cpu_1p1d_example_serves_one_request_and_stops_everything(tiny_model: Path, tmp_path: Path) -> None:
    p_port, bootstrap_port, d_port, router_port = free_ports(4)
    log_dir = tmp_path / "logs"
    env = dict(
        os.environ,
        PYTHON=sys.executable,
        MODEL=str(tiny_model),
        P_PORT=str(p_port),
        BOOTSTRAP_PORT=str(bootstrap_port),
        D_PORT=str(d_port),
        ROUTER_PORT=str(router_port),
        LOG_DIR=str(log_dir),
        START_TIMEOUT_S=str(int(START_TIMEOUT_S)),
    )
    proc = subprocess.Popen(
        ["bash", str(SCRIPT)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,
    )  # fmt: skip
    try:
        out, _ = proc.communicate(timeout=START_TIMEOUT_S + 120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)  # the script's trap stops P, D and the Router
            proc.wait(timeout=60)
        leftovers = _kill_leftovers(log_dir / "pids")
    assert proc.returncode == 0, out
    assert leftovers == [], f"the example left processes running: {leftovers}"
    assert len((log_dir / "pids").read_text().split()) == 3
    for name in ("prefill", "decode", "router"):
        assert f"{name} healthy" in out
    chunks = [line for line in out.splitlines() if line.startswith("data: {")]
    assert chunks and '"finish_reason":"length"' in chunks[-1], out
    assert "data: [DONE]" in out
    assert "pushed" in out and "KV received" in out, out  # the KV moved from P to D
    assert "stopped P, D and the Router" in out
