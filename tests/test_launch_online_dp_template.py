"""External-DP launcher: `run_dp_template.sh` run with a harmless command in place of `vllm`.

Checks the serve command line and environment it builds per device (cpu, npu) and DP mode
(vllm, independent), its fallback to the vllm_cli wrapper, its input checks (exit code 2),
and shellcheck where installed.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap

import pytest

from tests.support.launch_dp import REPO, TEMPLATE

BASH = shutil.which("bash") or "/bin/bash"

# -- the template -----------------------------------------------------------------------------
DUMP = textwrap.dedent(
    """
    import json, os, sys
    keys = ["ASCEND_RT_VISIBLE_DEVICES", "VLLM_CPU_OMP_THREADS_BIND", "HCCL_IF_IP", "GLOO_SOCKET_IFNAME",
            "TP_SOCKET_IFNAME", "HCCL_SOCKET_IFNAME", "HCCL_BUFFSIZE", "TASK_QUEUE_ENABLE", "OMP_NUM_THREADS",
            "PYTORCH_NPU_ALLOC_CONF", "PYTHONUNBUFFERED", "PYTHONPATH"]
    with open(os.environ["DUMP_OUT"], "w") as f:
        json.dump({"argv": sys.argv[1:], "env": {k: os.environ.get(k) for k in keys}, "pid": os.getpid()}, f)
    """
)


@pytest.fixture
def dump(tmp_path):
    script = tmp_path / "dump.py"
    script.write_text(DUMP)
    return script


def run_template(args, env, tmp_path):
    out = tmp_path / "dump.json"
    full_env = {"PATH": "/usr/bin:/bin", "DUMP_OUT": str(out), "HOME": str(tmp_path), **env}
    proc = subprocess.run([BASH, str(TEMPLATE), *args], env=full_env, capture_output=True, text=True, timeout=30)
    data = json.loads(out.read_text()) if out.exists() else None
    return proc, data


RANK_ARGS = ["0-1|2-3", "8101", "4", "3", "10.0.0.1", "12321", "2"]


def test_template_cpu_runs_the_serve_command_with_the_rank_flags(tmp_path, dump):
    env = {"PD_MODEL": "/models/tiny", "PD_DEVICE": "cpu", "PD_SERVE_CMD": f"{sys.executable} {dump}"}
    proc, data = run_template([*RANK_ARGS, "--kv-transfer-config", '{"a": 1, "b": "x y"}'], env, tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert data["argv"] == [
        "serve", "/models/tiny", "--host", "0.0.0.0", "--port", "8101",
        "--data-parallel-size", "4", "--data-parallel-rank", "3",
        "--data-parallel-address", "10.0.0.1", "--data-parallel-rpc-port", "12321",
        "--tensor-parallel-size", "2", "--kv-transfer-config", '{"a": 1, "b": "x y"}',
    ]  # fmt: skip
    assert data["env"]["VLLM_CPU_OMP_THREADS_BIND"] == "0-1|2-3"
    assert data["env"]["ASCEND_RT_VISIBLE_DEVICES"] is None
    assert data["env"]["HCCL_BUFFSIZE"] is None
    assert data["env"]["PYTHONUNBUFFERED"] == "1"
    assert "dp rank 3/4 (cpu" in proc.stderr


DP_FLAGS = ["--data-parallel-size", "--data-parallel-rank", "--data-parallel-address", "--data-parallel-rpc-port"]


def test_template_independent_mode_omits_the_data_parallel_flags(tmp_path, dump):
    kv = '{"kv_connector":"PDConnector","kv_connector_extra_config":{"dp_rank":3,"dp_size":4}}'
    env = {
        "PD_MODEL": "/m",
        "PD_DEVICE": "cpu",
        "PD_DP_MODE": "independent",
        "PD_SERVE_CMD": f"{sys.executable} {dump}",
    }
    proc, data = run_template([*RANK_ARGS, "--kv-transfer-config", kv], env, tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert data["argv"] == [
        "serve", "/m", "--host", "0.0.0.0", "--port", "8101", "--tensor-parallel-size", "2",
        "--kv-transfer-config", kv,
    ]  # fmt: skip
    assert not any(a.startswith("--data-parallel") for a in data["argv"])
    assert "dp rank 3/4 (cpu, devices '0-1|2-3', dp mode independent)" in proc.stderr


def test_template_vllm_mode_passes_the_data_parallel_flags(tmp_path, dump):
    env = {"PD_MODEL": "/m", "PD_DEVICE": "cpu", "PD_DP_MODE": "vllm", "PD_SERVE_CMD": f"{sys.executable} {dump}"}
    proc, data = run_template(RANK_ARGS, env, tmp_path)
    assert proc.returncode == 0, proc.stderr
    argv = data["argv"]
    assert [argv[argv.index(f) + 1] for f in DP_FLAGS] == ["4", "3", "10.0.0.1", "12321"]
    assert argv[-2:] == ["--tensor-parallel-size", "2"]
    assert "dp mode vllm" in proc.stderr


def test_template_cpu_without_cores_keeps_the_default_binding(tmp_path, dump):
    env = {"PD_MODEL": "m", "PD_DEVICE": "cpu", "PD_HOST": "127.0.0.1", "PD_SERVE_CMD": f"{sys.executable} {dump}"}
    proc, data = run_template(["", *RANK_ARGS[1:]], env, tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert data["env"]["VLLM_CPU_OMP_THREADS_BIND"] is None
    assert data["argv"][2:4] == ["--host", "127.0.0.1"]


def test_template_npu_sets_device_visibility_and_hccl_env(tmp_path, dump):
    env = {
        "PD_MODEL": "/w",
        "PD_DEVICE": "npu",
        "PD_NIC_NAME": "eth9",
        "PD_LOCAL_IP": "10.0.0.7",
        "HCCL_BUFFSIZE": "256",  # a value from the environment wins over the template's default
        "PD_SERVE_CMD": f"{sys.executable} {dump}",
    }
    proc, data = run_template(["4,5", *RANK_ARGS[1:]], env, tmp_path)
    assert proc.returncode == 0, proc.stderr
    got = data["env"]
    assert got["ASCEND_RT_VISIBLE_DEVICES"] == "4,5"
    assert got["HCCL_IF_IP"] == "10.0.0.7"
    assert got["GLOO_SOCKET_IFNAME"] == got["TP_SOCKET_IFNAME"] == got["HCCL_SOCKET_IFNAME"] == "eth9"
    assert got["HCCL_BUFFSIZE"] == "256"
    assert got["TASK_QUEUE_ENABLE"] == "1"
    assert got["OMP_NUM_THREADS"] == "10"
    assert got["PYTORCH_NPU_ALLOC_CONF"] == "expandable_segments:True"
    assert got["VLLM_CPU_OMP_THREADS_BIND"] is None


def test_template_falls_back_to_the_vllm_cli_wrapper(tmp_path, dump):
    # No PD_SERVE_CMD and no `vllm` on PATH: it runs `$PD_PYTHON -m launch.vllm_cli serve ...`
    # with this repository on PYTHONPATH. A fake interpreter records what it was given.
    fake_python = tmp_path / "python"
    fake_python.write_text(f'#!{BASH}\nexec {sys.executable} {dump} "$@"\n')
    fake_python.chmod(0o755)
    env = {"PD_MODEL": "m", "PD_DEVICE": "cpu", "PD_PYTHON": str(fake_python), "PYTHONPATH": "/extra"}
    proc, data = run_template(RANK_ARGS, env, tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert data["argv"][:4] == ["-m", "launch.vllm_cli", "serve", "m"]
    assert data["env"]["PYTHONPATH"] == f"{REPO}:/extra"


@pytest.mark.parametrize(
    ("args", "env", "message"),
    [
        (RANK_ARGS, {"PD_DEVICE": "cpu"}, "no model: set PD_MODEL"),
        (RANK_ARGS[:6], {"PD_MODEL": "m"}, "expected 7 arguments"),
        (["0", "80x1", *RANK_ARGS[2:]], {"PD_MODEL": "m"}, "port must be a non-negative integer, got '80x1'"),
        (["0", "8101", "4", "3", "", "1", "1"], {"PD_MODEL": "m"}, "dp_address is empty"),
        (RANK_ARGS, {"PD_MODEL": "m", "PD_DEVICE": "gpu"}, "PD_DEVICE must be 'npu' or 'cpu', got 'gpu'"),
        (RANK_ARGS, {"PD_MODEL": "m", "PD_DP_MODE": "dense"}, "PD_DP_MODE must be 'vllm' or 'independent'"),
    ],
)
def test_template_rejects_bad_input_with_exit_2(tmp_path, dump, args, env, message):
    proc, data = run_template(args, {"PD_SERVE_CMD": f"{sys.executable} {dump}", **env}, tmp_path)
    assert proc.returncode == 2
    assert data is None
    assert message in proc.stderr


def test_template_passes_shellcheck_when_available():
    shellcheck = shutil.which("shellcheck")
    if shellcheck is None:
        pytest.skip("shellcheck is not installed")
    proc = subprocess.run([shellcheck, str(TEMPLATE)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout
