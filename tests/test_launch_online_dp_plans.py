"""External-DP launcher: flag checks and per-rank plans (fast: no process is started).

- the flag checks of the deployment guide: each violation -> exit code 2 and a one-line message;
- the per-rank command lines and environments (`build_plans`, `--dry-run`): devices, CPU binding,
  ports, the serve command and the health URL.

The DP mode (`--dp-mode`) is in test_launch_online_dp_mode.py, the per-rank template in
test_launch_online_dp_template.py, the running ranks in test_launch_online_dp_ranks.py.
"""

from __future__ import annotations

import os
import shlex
import socket
import sys

import pytest

from launch import dp_devices, dp_plan
from launch.dp_checks import UsageError
from launch.dp_devices import compact_ids
from launch.launch_online_dp import main
from tests.support.launch_dp import BASE, REPO, TEMPLATE, plans_for

# -- flag checks ------------------------------------------------------------------------------
BAD_FLAGS = [
    (["--dp-size", "0", "--dp-address", "127.0.0.1"], "--dp-size must be >= 1"),
    ([*BASE, "--tp-size", "0"], "--tp-size must be >= 1"),
    ([*BASE, "--dp-size-local", "0"], "--dp-size-local must be -1 or between 1 and --dp-size (2)"),
    ([*BASE, "--dp-size-local", "3"], "--dp-size-local must be -1 or between 1 and --dp-size (2)"),
    ([*BASE, "--dp-size-local", "-2"], "--dp-size-local must be -1 or between 1 and --dp-size (2)"),
    ([*BASE, "--dp-rank-start", "-1"], "--dp-rank-start must be >= 0"),
    ([*BASE, "--dp-size-local", "2", "--dp-rank-start", "1"], "--dp-rank-start (1) + --dp-size-local (2)"),
    ([*BASE, "--dp-rank-start", "2", "--dp-size-local", "1"], "ranks 2..2 do not exist"),
    ([*BASE, "--dp-rpc-port", "0"], "--dp-rpc-port must be between 1 and 65535"),
    ([*BASE, "--dp-rpc-port", "70000"], "--dp-rpc-port must be between 1 and 65535"),
    ([*BASE, "--vllm-start-port", "0"], "--vllm-start-port must leave 2 ports within 1..65535"),
    ([*BASE, "--vllm-start-port", "65535"], "(got 65535..65536)"),
    ([*BASE, "--dp-rpc-port", "18101"], "--dp-rpc-port 18101 falls in the API ports 18100..18101"),
    (["--dp-size", "2", "--dp-address", "not an address!"], "--dp-address must be an IP address or host name"),
    ([*BASE, "--stop-grace-s", "-1"], "--stop-grace-s must be >= 0"),
    ([*BASE, "--template", "/nonexistent/run.sh"], "template /nonexistent/run.sh does not exist"),
    ([*BASE, "--", "--port", "9"], "--port is set per rank by the launcher"),
    ([*BASE, "--", "--data-parallel-rank=1"], "--data-parallel-rank is set per rank"),
    ([*BASE, "--", "-tp", "2"], "-tp is set per rank"),
    ([*BASE, "--device", "cpu", "--cpu-bind", "0"], "--cpu-bind needs 2 non-empty core lists separated by ';'"),
    ([*BASE, "--device", "cpu", "--cpu-bind", "0;x"], "--cpu-bind: 'x' is not an id or an id range"),
    ([*BASE, "--device", "cpu", "--tp-size", "2", "--cpu-bind", "0;1"], "must hold 2 core group(s)"),
    (
        [*BASE, "--device", "npu", "--tp-size", "2", "--visible-devices", "0,1,2"],
        "--dp-size-local (2) * --tp-size (2) = 4 NPUs, but only 3 are available (--visible-devices)",
    ),
    ([*BASE, "--device", "npu", "--visible-devices", "0,0"], "--visible-devices: ids must not repeat"),
    ([*BASE, "--serve-cmd", "/usr/bin/my\\ vllm"], "the serve command must be words without whitespace"),
]


@pytest.mark.parametrize(("argv", "message"), BAD_FLAGS, ids=[m for _, m in BAD_FLAGS])
def test_constraint_violation_exits_2_with_one_line(argv, message, capsys):
    assert main([*argv, "--dry-run"]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.count("\n") == 1, err
    assert err.startswith("launch_online_dp: error: ")
    assert message in err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--dp-size", "two", "--dp-address", "127.0.0.1"], "argument --dp-size: invalid int value: 'two'"),
        (["--dp-size", "2"], "the following arguments are required: --dp-address"),
        ([*BASE, "--no-such-flag"], "unrecognized arguments: --no-such-flag"),
        ([*BASE, "--device", "gpu"], "argument --device: invalid choice"),
    ],
)
def test_bad_flag_syntax_exits_2_with_one_line(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert message in err


def test_cpu_bind_auto_needs_a_cpu_per_rank():
    with pytest.raises(UsageError, match=r"needs one CPU per rank and TP rank \(2 x 1 = 2\), .* only 1"):
        plans_for([*BASE, "--device", "cpu"], cpus=[0])


def test_busy_api_port_exits_2_before_starting_anything(tmp_path, capsys):
    marker = tmp_path / "started"
    template = tmp_path / "t.sh"
    template.write_text(f"touch {marker}\n")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = sock.getsockname()[1]
        argv = [
            "--dp-size", "1", "--dp-address", "127.0.0.1", "--dp-rpc-port", str(port + 1 if port < 65535 else 1),
            "--vllm-start-port", str(port), "--host", "127.0.0.1", "--device", "cpu", "--template", str(template),
        ]  # fmt: skip
        assert main(argv) == 2
    assert f"API port {port} (dp rank 0) is already in use on 127.0.0.1" in capsys.readouterr().err
    assert not marker.exists()


# -- per-rank plans ---------------------------------------------------------------------------
def test_npu_plans_follow_the_guide_second_node_example():
    # Node 2 of a DP 4 / TP 2 group: ranks 2 and 3, NPUs 0-1 and 2-3, ports 7100 and 7101.
    argv = [
        "--dp-size", "4", "--tp-size", "2", "--dp-size-local", "2", "--dp-rank-start", "2",
        "--dp-address", "192.0.0.1", "--dp-rpc-port", "12321", "--vllm-start-port", "7100",
        "--device", "npu", "--visible-devices", "0-7", "--model", "/models/ds", "--serve-cmd", "vllm",
        "--", "--enable-expert-parallel", "--kv-transfer-config", '{"kv_connector": "PDConnector"}',
    ]  # fmt: skip
    plans = plans_for(argv, environ={})
    assert [p.dp_rank for p in plans] == [2, 3]
    assert [p.port for p in plans] == [7100, 7101]
    assert [p.devices for p in plans] == ["0,1", "2,3"]
    extra = ["--enable-expert-parallel", "--kv-transfer-config", '{"kv_connector": "PDConnector"}']
    assert plans[1].cmd == ["bash", str(TEMPLATE), "2,3", "7101", "4", "3", "192.0.0.1", "12321", "2", *extra]
    env = plans[0].env
    assert env["PD_DEVICE"] == "npu"
    assert env["PD_MODEL"] == "/models/ds"
    assert env["PD_HOST"] == "0.0.0.0"
    assert env["PD_SERVE_CMD"] == "vllm"
    assert "PYTHONPATH" not in env
    assert plans[0].health_url == "http://127.0.0.1:7100/health"


def test_npu_pool_defaults_to_the_visible_devices_of_the_environment():
    plans = plans_for([*BASE, "--device", "npu"], environ={"ASCEND_RT_VISIBLE_DEVICES": "4,5,6,7"})
    assert [p.devices for p in plans] == ["4", "5"]
    with pytest.raises(UsageError, match="only 1 are available"):
        plans_for([*BASE, "--device", "npu"], environ={"ASCEND_RT_VISIBLE_DEVICES": "3"})


def test_cpu_auto_bind_splits_the_cpus_between_ranks_and_tp_ranks():
    argv = [*BASE, "--device", "cpu", "--tp-size", "2"]
    assert [p.devices for p in plans_for(argv, cpus=range(8))] == ["0-1|2-3", "4-5|6-7"]
    assert [p.devices for p in plans_for([*BASE, "--device", "cpu"], cpus=[0, 1])] == ["0", "1"]
    # Uneven: each rank gets the same number of CPUs; the rest stay free.
    assert [p.devices for p in plans_for([*BASE, "--device", "cpu"], cpus=[0, 2, 3, 5, 6])] == ["0,2", "3,5"]


def test_cpu_bind_none_and_explicit_lists():
    assert [p.devices for p in plans_for([*BASE, "--device", "cpu", "--cpu-bind", "none"])] == ["", ""]
    explicit = plans_for([*BASE, "--device", "cpu", "--tp-size", "2", "--cpu-bind", "0|1; 2-3|4"])
    assert [p.devices for p in explicit] == ["0|1", "2-3|4"]
    assert explicit[0].cmd[2] == "0|1"


def test_cpu_plans_use_the_vllm_cli_wrapper_when_the_console_script_fails(monkeypatch):
    monkeypatch.setattr(dp_plan.shutil, "which", lambda name: None)
    plans = plans_for([*BASE, "--device", "cpu", "--host", "127.0.0.1"], environ={"PYTHONPATH": "/x"}, cpus=[0, 1])
    env = plans[1].env
    assert env["PD_SERVE_CMD"] == f"{sys.executable} -m launch.vllm_cli"
    assert env["PD_PYTHON"] == sys.executable
    assert env["PYTHONPATH"] == f"{REPO}{os.pathsep}/x"
    assert env["PD_DEVICE"] == "cpu"
    assert env["PD_DP_LOCAL_INDEX"] == "1"
    assert "PD_MODEL" not in env
    assert plans[1].cmd[2:9] == ["1", "18101", "2", "1", "127.0.0.1", "13345", "1"]


def test_dp_size_local_minus_one_starts_every_rank():
    plans = plans_for(["--dp-size", "3", "--dp-address", "node-0.example", "--device", "cpu", "--cpu-bind", "none"])
    assert [(p.dp_rank, p.local_index, p.port) for p in plans] == [(0, 0, 9000), (1, 1, 9001), (2, 2, 9002)]
    assert plans[0].cmd[6:8] == ["node-0.example", "12345"]


def test_device_auto_detection(monkeypatch):
    monkeypatch.setattr(
        dp_devices.shutil, "which", lambda name: "/usr/local/bin/npu-smi" if name == "npu-smi" else None
    )
    assert dp_devices.detect_device() == "npu"
    monkeypatch.setattr(dp_devices.shutil, "which", lambda name: None)
    monkeypatch.setattr(dp_devices.importlib.util, "find_spec", lambda name: None)
    assert dp_devices.detect_device() == "cpu"


def test_ipv6_host_health_url():
    plans = plans_for([*BASE, "--device", "cpu", "--cpu-bind", "none", "--host", "::"])
    assert plans[0].health_url == "http://[::1]:18100/health"


def test_compact_ids():
    assert compact_ids([0, 1, 2, 5, 7, 8]) == "0-2,5,7-8"
    assert compact_ids([3]) == "3"
    assert compact_ids([]) == ""


def test_dry_run_prints_a_runnable_line_per_rank(capsys):
    extra = ["--kv-transfer-config", '{"kv_connector":"PDConnector","kv_role":"kv_producer"}']
    argv = [*BASE, "--device", "cpu", "--cpu-bind", "0;1", "--model", "/m", "--dry-run", "--", *extra]
    assert main(argv) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("# dp mode vllm (auto: no local /m/config.json")
    assert lines[1] == "# dp rank 0 (local 0): http://127.0.0.1:18100/health"
    words = shlex.split(lines[4])
    assert words[0] == "env"
    assert "PD_MODEL=/m" in words and "PD_DEVICE=cpu" in words
    i = words.index("bash")
    assert words[i + 1 :] == [str(TEMPLATE), "1", "18101", "2", "1", "127.0.0.1", "13345", "1", *extra]
