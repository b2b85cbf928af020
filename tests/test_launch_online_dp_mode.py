"""External-DP launcher: the DP mode (`--dp-mode auto|vllm|independent`), fast (no process started).

- `auto`: dense/MoE detection from the model's local config.json (vLLM's DP for MoE or unknown models);
- an explicit `--dp-mode` overrides the detection;
- independent mode: the per-rank rewrite of `--kv-transfer-config` (dp_rank, dp_size, bootstrap_host),
  the configurations it refuses, and what `--dry-run` shows.
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest

from launch import dp_mode
from launch.dp_checks import UsageError
from launch.launch_online_dp import main
from tests.support.launch_dp import BASE, KV, plans_for

# -- DP mode ----------------------------------------------------------------------------------
DENSE = {"architectures": ["LlamaForCausalLM"], "num_attention_heads": 4}


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
