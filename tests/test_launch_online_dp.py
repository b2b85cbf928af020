"""Unit tests of the external-DP launcher and its per-rank template (fast: no vLLM start-up).

- the flag checks of the deployment guide: each violation -> exit code 2 and a one-line message;
- the per-rank command lines and environments (`build_plans`, `--dry-run`);
- the DP mode (`--dp-mode auto|vllm|independent`): dense/MoE detection from config.json and the
  per-rank rewrite of `--kv-transfer-config` in independent mode;
- `run_dp_template.sh` run with a harmless command in place of `vllm`: arguments and env;
- the launcher's process handling with a harmless template: exit codes, a failing rank stops
  the others, SIGTERM reaches every rank's process group (SIGKILL after the grace period).
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from launch import dp_devices, dp_mode, dp_plan
from launch.dp_checks import UsageError
from launch.dp_devices import compact_ids
from launch.dp_plan import build_plans
from launch.launch_online_dp import main, parse_args

REPO = Path(__file__).resolve().parent.parent
TEMPLATE = REPO / "launch" / "run_dp_template.sh"
BASH = shutil.which("bash") or "/bin/bash"

BASE = ["--dp-size", "2", "--dp-address", "127.0.0.1", "--dp-rpc-port", "13345", "--vllm-start-port", "18100"]


def plans_for(argv: list[str], **kw):
    args, extra = parse_args(argv)
    return build_plans(args, extra, **kw)


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


# -- DP mode ----------------------------------------------------------------------------------
DENSE = {"architectures": ["LlamaForCausalLM"], "num_attention_heads": 4}
KV = {"kv_connector": "PDConnector", "kv_role": "kv_producer"}


def model_dir(tmp_path: Path, config: dict | None, name: str = "model") -> str:
    path = tmp_path / name
    path.mkdir()
    if config is not None:
        (path / "config.json").write_text(json.dumps(config))
    return str(path)


def kv_config_of(cmd: list[str]) -> dict:
    """The JSON of the (last) --kv-transfer-config in a rank's command, either argument form."""
    found = None
    for i, arg in enumerate(cmd):
        if arg == "--kv-transfer-config":
            found = cmd[i + 1]
        elif arg.startswith("--kv-transfer-config="):
            found = arg.split("=", 1)[1]
    assert found is not None, cmd
    return json.loads(found)


def test_auto_dp_mode_picks_independent_for_a_dense_local_model(tmp_path):
    model = model_dir(tmp_path, DENSE)
    plans = plans_for([*BASE, "--device", "cpu", "--cpu-bind", "none", "--model", model])
    assert [p.dp_mode for p in plans] == ["independent", "independent"]
    assert [p.env["PD_DP_MODE"] for p in plans] == ["independent", "independent"]
    assert plans[0].dp_mode_reason.startswith("auto: ")
    assert "dense model" in plans[0].dp_mode_reason
    # The template's seven positional arguments stay as they are.
    assert plans[1].cmd[2:9] == ["", "18101", "2", "1", "127.0.0.1", "13345", "1"]


@pytest.mark.parametrize(
    ("config", "marker"),
    [
        ({"architectures": ["MixtralForCausalLM"], "num_local_experts": 4, "num_experts_per_tok": 2}, "experts=4"),
        ({"architectures": ["DeepseekV3ForCausalLM"], "n_routed_experts": 8}, "n_routed_experts=8"),
        ({"architectures": ["Qwen3MoeForCausalLM"], "num_experts": 16}, "num_experts=16"),
        ({"text_config": {"num_experts_per_tok": 2}}, "text_config.num_experts_per_tok=2"),
    ],
    ids=["mixtral", "deepseek", "qwen-moe", "nested-text-config"],
)
def test_auto_dp_mode_picks_vllm_for_an_moe_model(tmp_path, config, marker):
    model = model_dir(tmp_path, config)
    plans = plans_for([*BASE, "--device", "cpu", "--cpu-bind", "none", "--model", model])
    assert [p.dp_mode for p in plans] == ["vllm", "vllm"]
    assert plans[0].env["PD_DP_MODE"] == "vllm"
    assert "MoE model" in plans[0].dp_mode_reason
    assert marker in plans[0].dp_mode_reason


def test_auto_dp_mode_ignores_zero_and_non_integer_expert_counts(tmp_path):
    config = {**DENSE, "num_experts": 0, "num_local_experts": None, "moe_num_experts": "4", "n_routed_experts": True}
    assert dp_mode.detect_dp_mode(model_dir(tmp_path, config))[0] == "independent"


@pytest.mark.parametrize("kind", ["missing-path", "hub-name", "no-config-json", "bad-json", "no-model"])
def test_auto_dp_mode_picks_vllm_without_a_readable_local_config(tmp_path, kind):
    if kind == "missing-path":
        model = str(tmp_path / "nope")
    elif kind == "hub-name":
        model = "mistralai/Mixtral-8x7B-v0.1"
    elif kind == "no-config-json":
        model = model_dir(tmp_path, None)
    elif kind == "bad-json":
        model = model_dir(tmp_path, None)
        (Path(model) / "config.json").write_text("{not json")
    else:
        model = None
    mode, why = dp_mode.detect_dp_mode(model)
    assert mode == "vllm", why
    argv = [*BASE, "--device", "cpu", "--cpu-bind", "none", *(["--model", model] if model else [])]
    plans = plans_for(argv)
    assert plans[0].dp_mode == "vllm"
    assert "--kv-transfer-config" not in plans[0].cmd


def test_explicit_dp_mode_overrides_the_detection(tmp_path):
    dense = model_dir(tmp_path, DENSE)
    argv = [*BASE, "--device", "cpu", "--cpu-bind", "none"]
    plans = plans_for([*argv, "--model", dense, "--dp-mode", "vllm"])
    assert (plans[0].dp_mode, plans[0].dp_mode_reason) == ("vllm", "--dp-mode vllm")
    plans = plans_for([*argv, "--model", "org/hub-model", "--dp-mode", "independent"])
    assert (plans[0].dp_mode, plans[0].env["PD_DP_MODE"]) == ("independent", "independent")


@pytest.mark.parametrize("form", ["separate", "equals"])
def test_independent_mode_gives_each_rank_its_dp_place_in_the_kv_transfer_config(form):
    user = {**KV, "kv_connector_extra_config": {"bootstrap_port": 18800, "local_ip": "10.0.0.9"}}
    if form == "separate":
        kv_args = ["--kv-transfer-config", json.dumps(user)]
    else:
        kv_args = [f"--kv-transfer-config={json.dumps(user)}"]
    argv = [
        "--dp-size", "4", "--dp-size-local", "2", "--dp-rank-start", "2", "--dp-address", "10.0.0.1",
        "--device", "cpu", "--cpu-bind", "none", "--model", "m", "--dp-mode", "independent",
        "--", "--dtype", "float32", *kv_args, "--enforce-eager",
    ]  # fmt: skip
    plans = plans_for(argv)
    for plan, rank in zip(plans, (2, 3), strict=True):
        assert plan.kv_config_rewritten
        extra = plan.cmd[9:]
        assert extra[:2] == ["--dtype", "float32"] and extra[-1] == "--enforce-eager"
        if form == "equals":
            assert len(extra) == 4 and extra[2].startswith("--kv-transfer-config={")
        got = kv_config_of(plan.cmd)
        assert got == {
            **KV,
            "kv_connector_extra_config": {
                "bootstrap_port": 18800,
                "local_ip": "10.0.0.9",
                "dp_rank": rank,
                "dp_size": 4,
                "bootstrap_host": "10.0.0.1",
            },
        }


def test_independent_mode_creates_the_extra_config_and_keeps_a_given_bootstrap_host():
    argv = [*BASE, "--device", "cpu", "--cpu-bind", "none", "--dp-mode", "independent", "--"]
    plans = plans_for([*argv, "--kv-transfer-config", json.dumps(KV)])
    assert kv_config_of(plans[1].cmd)["kv_connector_extra_config"] == {
        "dp_rank": 1,
        "dp_size": 2,
        "bootstrap_host": "127.0.0.1",
    }
    user = {**KV, "kv_connector_extra_config": {"bootstrap_host": "p-node-0.example"}}
    plans = plans_for([*argv, "--kv-transfer-config", json.dumps(user)])
    assert [kv_config_of(p.cmd)["kv_connector_extra_config"]["bootstrap_host"] for p in plans] == [
        "p-node-0.example",
        "p-node-0.example",
    ]


def test_vllm_mode_passes_the_kv_transfer_config_unchanged(tmp_path):
    model = model_dir(tmp_path, {"num_local_experts": 4})
    kv = json.dumps({**KV, "kv_connector_extra_config": {"dp_rank": 0}})
    plans = plans_for(
        [*BASE, "--device", "cpu", "--cpu-bind", "none", "--model", model, "--", "--kv-transfer-config", kv]
    )
    assert plans[1].cmd[9:] == ["--kv-transfer-config", kv]
    assert not plans[1].kv_config_rewritten


def test_independent_mode_does_not_use_the_dp_rpc_port():
    # It may even fall among the API ports: no rank listens on it.
    plans = plans_for(
        [*BASE, "--device", "cpu", "--cpu-bind", "none", "--dp-mode", "independent", "--dp-rpc-port", "18101"]
    )
    assert [p.port for p in plans] == [18100, 18101]


INDEPENDENT = [*BASE, "--device", "cpu", "--cpu-bind", "none", "--dp-mode", "independent"]
BAD_KV_CONFIGS = [
    (["--kv-transfer-config", json.dumps({**KV, "kv_connector_extra_config": {"dp_rank": 0}})],
     "kv_connector_extra_config.dp_rank is set per rank by the launcher"),
    ([f"--kv-transfer-config={json.dumps({**KV, 'kv_connector_extra_config': {'dp_size': 2}})}"],
     "kv_connector_extra_config.dp_size is set per rank by the launcher"),
    (["--kv-transfer-config", "{kv_connector: PDConnector}"], "--kv-transfer-config (rewritten per rank"),
    (["--kv-transfer-config=[1, 2]"], "must be a JSON object, got '[1, 2]'"),
    (["--kv-transfer-config", '{"kv_connector_extra_config": 3}'], "kv_connector_extra_config must be a JSON object"),
    (["--dtype", "float32", "--kv-transfer-config"], "--kv-transfer-config needs a value"),
    (["--kv-transfer-config.kv_connector", "PDConnector"], "not in dotted form"),
]  # fmt: skip


@pytest.mark.parametrize(("extra", "message"), BAD_KV_CONFIGS, ids=[m for _, m in BAD_KV_CONFIGS])
def test_independent_mode_refuses_a_kv_transfer_config_it_cannot_rewrite(extra, message, capsys):
    with pytest.raises(UsageError) as exc:
        plans_for([*INDEPENDENT, "--", *extra])
    assert message in str(exc.value)
    assert main([*INDEPENDENT, "--dry-run", "--", *extra]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.count("\n") == 1, err
    assert message in err


def test_independent_mode_also_reads_the_underscore_spelling():
    plans = plans_for([*INDEPENDENT, "--", "--kv_transfer_config", json.dumps(KV)])
    assert plans[0].cmd[9] == "--kv_transfer_config"
    assert json.loads(plans[0].cmd[10])["kv_connector_extra_config"]["dp_rank"] == 0


def test_dry_run_shows_the_mode_and_each_rank_rewritten_kv_config(tmp_path, capsys):
    model = model_dir(tmp_path, DENSE)
    argv = [*BASE, "--device", "cpu", "--cpu-bind", "none", "--model", model, "--dry-run"]
    assert main([*argv, "--", "--kv-transfer-config", json.dumps(KV)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("# dp mode independent (auto: ")
    assert len(lines) == 5
    for line, rank in ((lines[2], 0), (lines[4], 1)):
        words = shlex.split(line)
        assert "PD_DP_MODE=independent" in words
        got = kv_config_of(words)
        assert got["kv_connector_extra_config"] == {"dp_rank": rank, "dp_size": 2, "bootstrap_host": "127.0.0.1"}


def test_dry_run_notes_when_independent_mode_has_no_kv_config_to_rewrite(capsys):
    assert main([*INDEPENDENT, "--dry-run", "--", "--dtype", "float32"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "# dp mode independent (--dp-mode independent)"
    assert lines[1].startswith("# note: no PDConnector --kv-transfer-config")
    assert shlex.split(lines[3])[-2:] == ["--dtype", "float32"]


def test_independent_mode_leaves_another_connectors_config_alone(capsys):
    other = json.dumps({"kv_connector": "MooncakeConnectorV1", "kv_role": "kv_producer"})
    plans = plans_for([*INDEPENDENT, "--", "--kv-transfer-config", other])
    assert plans[0].cmd[-2:] == ["--kv-transfer-config", other] and not plans[0].kv_config_rewritten
    assert main([*INDEPENDENT, "--dry-run", "--", f"--kv-transfer-config={other}"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].startswith("# note: no PDConnector --kv-transfer-config")
    assert shlex.split(lines[3])[-1] == f"--kv-transfer-config={other}"


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


# -- running ranks (with a harmless template) ---------------------------------------------------
FAKE_TEMPLATE = textwrap.dedent(
    """\
    # Test stand-in for run_dp_template.sh: records its arguments, then acts per FAKE_MODE_<rank>.
    rank=$4
    mode_var="FAKE_MODE_$rank"
    # ignore-term: SIGTERM ignored before the pid file tells the test this rank runs
    [ "${!mode_var:-ok}" = ignore-term ] && trap '' TERM
    printf '%s\\n' "$@" > "$FAKE_OUT/args_$rank"
    echo "$$" > "$FAKE_OUT/pid_$rank"
    case ${!mode_var:-ok} in
        ok) exit 0 ;;
        ok-late) sleep 2; exit 0 ;;
        fail) echo "rank $rank: boom"; sleep 1; touch "$FAKE_OUT/failed_$rank"; exit 3 ;;
        sleep) exec sleep 60 ;;
        ignore-term) exec sleep 60 ;;
    esac
    """
)


@pytest.fixture
def fake(tmp_path):
    template = tmp_path / "fake_template.sh"
    template.write_text(FAKE_TEMPLATE)
    return template


def launcher(template: Path, out: Path, modes: dict[int, str], *extra: str) -> subprocess.Popen[str]:
    """Run the launcher (2 local ranks) with `template`; nothing binds the ports (--skip-port-check)."""
    env = dict(os.environ, FAKE_OUT=str(out), **{f"FAKE_MODE_{r}": m for r, m in modes.items()})
    cmd = [
        sys.executable, "-m", "launch.launch_online_dp", "--dp-size", "2", "--dp-address", "127.0.0.1",
        "--dp-rpc-port", "13345", "--vllm-start-port", "18100", "--host", "127.0.0.1",
        "--device", "cpu", "--cpu-bind", "none", "--template", str(template), "--no-health-watch",
        "--skip-port-check", "--model", "m", *extra,
    ]  # fmt: skip
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def wait_for_files(*paths: Path, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not all(p.exists() and p.read_text().strip() for p in paths):
        assert time.monotonic() < deadline, f"not written in time: {paths}"
        time.sleep(0.05)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie still answers kill(0); look at its state.
    stat = Path(f"/proc/{pid}/stat")
    return not (stat.exists() and stat.read_text().rsplit(")", 1)[1].split()[0] in ("Z", "X"))


def test_launcher_runs_every_rank_and_exits_0_when_they_do(tmp_path, fake):
    proc = launcher(fake, tmp_path, {0: "ok-late", 1: "ok-late"}, "--", "--dtype", "float32")
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, out
    for rank in (0, 1):
        args = (tmp_path / f"args_{rank}").read_text().splitlines()
        assert args[3] == str(rank)
        assert args[2] == "2"
        assert args[7:] == ["--dtype", "float32"]
    assert "exited with code 0" in out


def test_launcher_independent_mode_hands_each_rank_its_kv_config(tmp_path, fake):
    # ok-late: a rank that exits at once makes the launcher stop the other, maybe before it wrote its args.
    modes = {0: "ok-late", 1: "ok-late"}
    proc = launcher(fake, tmp_path, modes, "--dp-mode", "independent", "--", "--kv-transfer-config", json.dumps(KV))
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, out
    assert "launch_online_dp: dp mode independent (--dp-mode independent)" in out
    assert "independent instances, DP master 127.0.0.1" in out
    for rank in (0, 1):
        args = (tmp_path / f"args_{rank}").read_text().splitlines()
        assert json.loads(args[8])["kv_connector_extra_config"]["dp_rank"] == rank


def test_a_rank_exiting_0_still_stops_the_others(tmp_path, fake):
    # vLLM's API server exits 0 after its engine core died: the DP group is broken all the same.
    proc = launcher(fake, tmp_path, {0: "ok-late", 1: "sleep"}, "--stop-grace-s", "5")
    wait_for_files(tmp_path / "pid_0", tmp_path / "pid_1")
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, out
    assert "dp rank 0 exited with code 0" in out
    assert "a rank exited; stopping the others" in out
    assert not alive(int((tmp_path / "pid_1").read_text()))


def test_a_failing_rank_stops_the_others_and_sets_the_exit_code(tmp_path, fake):
    proc = launcher(fake, tmp_path, {0: "sleep", 1: "fail"}, "--stop-grace-s", "5")
    wait_for_files(tmp_path / "pid_0")
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 3, out
    assert "dp rank 1 exited with code 3" in out
    assert "stopping the others" in out
    assert not alive(int((tmp_path / "pid_0").read_text()))


def test_keep_going_leaves_the_other_ranks_running(tmp_path, fake):
    proc = launcher(fake, tmp_path, {0: "sleep", 1: "fail"}, "--keep-going")
    try:
        wait_for_files(tmp_path / "pid_0")
        deadline = time.monotonic() + 20
        while not (tmp_path / "failed_1").exists():
            assert time.monotonic() < deadline, "rank 1 did not fail in time"
            time.sleep(0.05)
        time.sleep(1.0)  # several launcher polls: it has seen rank 1 exit
        assert proc.poll() is None
        assert alive(int((tmp_path / "pid_0").read_text()))
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, out
    assert "dp rank 1 exited with code 3" in out
    assert not alive(int((tmp_path / "pid_0").read_text()))


def test_sigterm_reaches_every_rank_group_and_sigkill_follows_the_grace_period(tmp_path, fake):
    proc = launcher(fake, tmp_path, {0: "sleep", 1: "ignore-term"}, "--stop-grace-s", "1")
    try:
        wait_for_files(tmp_path / "pid_0", tmp_path / "pid_1")
        pids = [int((tmp_path / f"pid_{r}").read_text()) for r in (0, 1)]
        assert all(alive(p) for p in pids)
        # Each rank leads its own process group (not the launcher's).
        assert {os.getpgid(p) for p in pids} == set(pids)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=30)
        elapsed = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 143, out
    assert "received SIGTERM" in out
    assert "dp rank 1 did not stop within 1 s; sending SIGKILL" in out
    assert elapsed < 15
    assert not any(alive(p) for p in pids)


def test_log_dir_gets_one_log_per_rank(tmp_path, fake):
    logs = tmp_path / "logs"
    proc = launcher(fake, tmp_path, {0: "ok-late", 1: "ok-late"}, "--log-dir", str(logs))
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, out
    assert sorted(p.name for p in logs.iterdir()) == ["dp_rank_0.log", "dp_rank_1.log"]
    assert f"log {logs / 'dp_rank_0.log'}" in out


def test_a_failing_rank_log_tail_is_shown(tmp_path, fake):
    logs = tmp_path / "logs"
    proc = launcher(fake, tmp_path, {0: "sleep", 1: "fail"}, "--log-dir", str(logs))
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 3, out
    assert f"last lines of {logs / 'dp_rank_1.log'}:\nrank 1: boom" in out


def test_without_log_dir_each_rank_output_is_inline_with_its_prefix(tmp_path, fake):
    proc = launcher(fake, tmp_path, {0: "sleep", 1: "fail"}, "--stop-grace-s", "5")
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 3, out
    assert "started dp rank 1 (pid " in out and "output inline" in out
    # The rank's own lines come first, then the launcher's report of its exit.
    assert out.index("[dp rank 1] rank 1: boom\n") < out.index("dp rank 1 exited with code 3")
    assert "last lines of" not in out
