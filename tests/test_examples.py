"""examples/: every script parses, every command line in it is accepted by its real parser.

The Ascend examples cannot run here, so each script runs with `vllm`, `python` and `curl`
replaced by recorders on PATH; every recorded command is then checked by what would read it
for real: vLLM's own `serve` argument parser plus PDConnector's config parser for `vllm
serve`, the launcher's `--dry-run` for `python -m launch.launch_online_dp`, the Router's
flag parser for `python -m proxy`. The Kubernetes manifests are validated against the
Kubernetes schema (`kubernetes-validate --strict`). `examples/cpu_1p1d` runs end to end in
`tests/e2e/test_examples_cpu.py`.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from pd_connector.bootstrap.exposure import exposure_of
from pd_connector.bootstrap.trust import trusted_hosts_of
from pd_connector.config import parse_config as parse_kv_config
from proxy.cli import parse_config as parse_router_config

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
SCRIPTS = sorted(EXAMPLES.rglob("*.sh"))
#: (script, arguments) of every runnable Ascend example script.
ASCEND_RUNS = [
    ("ascend_1p1d_2node/prefill.sh", []),
    ("ascend_1p1d_2node/decode.sh", []),
    ("ascend_1p1d_2node/router.sh", []),
    ("ascend_xpyd_external_dp/prefill_node.sh", ["1"]),
    ("ascend_xpyd_external_dp/prefill_node.sh", ["2"]),
    ("ascend_xpyd_external_dp/decode_node.sh", ["1"]),
    ("ascend_xpyd_external_dp/decode_node.sh", ["2"]),
    ("ascend_xpyd_external_dp/router.sh", []),
]
#: The examples read PDConnector's control-plane token from this variable (auth_token_env).
TOKEN_ENV = "PD_AUTH_TOKEN"
RECORDER = '#!/usr/bin/env bash\nprintf "%s\\0" "$(basename "$0")" "$@" >> "$RECORD"\nprintf "\\n\\0" >> "$RECORD"\n'


@pytest.fixture(autouse=True)
def _control_plane_token(monkeypatch: pytest.MonkeyPatch) -> None:
    """The shared token the multi-node examples require (their scripts and configs read it)."""
    monkeypatch.setenv(TOKEN_ENV, "example-token-0123456789abcdef")


def test_every_example_has_a_readme() -> None:
    dirs = sorted(p for p in EXAMPLES.iterdir() if p.is_dir())
    assert {d.name for d in dirs} >= {"cpu_1p1d", "ascend_1p1d_2node", "ascend_xpyd_external_dp", "kubernetes"}
    for d in dirs:
        assert (d / "README.md").is_file(), f"{d} has no README.md"


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: str(p.relative_to(EXAMPLES)))
def test_scripts_are_valid_bash(script: Path) -> None:
    subprocess.run(["bash", "-n", str(script)], check=True)


def _recorded_commands(script: str, args: list[str], tmp_path: Path) -> list[list[str]]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name in ("vllm", "python", "curl"):
        (bin_dir / name).write_text(RECORDER)
        (bin_dir / name).chmod(0o755)
    record = tmp_path / "record"
    record.unlink(missing_ok=True)
    env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", RECORD=str(record), DRY_RUN="1")
    subprocess.run(["bash", str(EXAMPLES / script), *args], check=True, env=env, cwd=ROOT, timeout=60)
    fields = record.read_text().split("\0")
    commands, current = [], []
    for field in fields:
        if field == "\n":
            commands.append(current)
            current = []
        elif field:
            current.append(field)
    return [c for c in commands if c[0] != "curl"]


def _vllm_serve_parser():  # noqa: ANN202 - vLLM's parser type differs between versions
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    try:
        from vllm.entrypoints.launchers.cli_args import make_arg_parser
    except ImportError:  # vLLM 0.23
        from vllm.entrypoints.openai.cli_args import make_arg_parser
    return make_arg_parser(FlexibleArgumentParser())


def _check_vllm_serve(argv: list[str]) -> None:
    """`serve MODEL ...` as vLLM parses it; its kv-transfer-config as PDConnector parses it."""
    assert argv[0] == "serve", argv
    args = _vllm_serve_parser().parse_args(argv[1:])
    kv = args.kv_transfer_config
    assert kv is not None and kv.kv_connector == "PDConnector", argv
    exposure_of(parse_kv_config(kv.kv_role, kv.kv_connector_extra_config))  # a non-loopback one has a token


def _check_launcher(argv: list[str]) -> None:
    assert "--dry-run" in argv, argv
    out = subprocess.run(
        [sys.executable, "-m", "launch.launch_online_dp", *argv],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        env=dict(os.environ, PD_LOCAL_IP="192.0.2.1"),
    )
    assert out.returncode == 0, out.stderr
    ranks = [line for line in out.stdout.splitlines() if "run_dp_template.sh" in line]
    local = int(argv[argv.index("--dp-size-local") + 1])
    assert len(ranks) == local, out.stdout
    # What every rank's `vllm serve` gets after the launcher's own flags.
    _check_vllm_serve(["serve", "MODEL", *argv[argv.index("--") + 1 :]])


@pytest.mark.parametrize(("script", "args"), ASCEND_RUNS, ids=lambda v: v if isinstance(v, str) else " ".join(v))
def test_ascend_example_command_lines_parse(script: str, args: list[str], tmp_path: Path) -> None:
    commands = _recorded_commands(script, args, tmp_path)
    assert commands, f"{script} ran no vllm/python command"
    for cmd in commands:
        if cmd[0] == "vllm":
            _check_vllm_serve(cmd[1:])
        elif cmd[1:3] == ["-m", "launch.launch_online_dp"]:
            _check_launcher(cmd[3:])
        elif cmd[1:3] == ["-m", "proxy"]:
            config = parse_router_config(cmd[3:])
            assert config.prefillers and config.decoders
        else:
            pytest.fail(f"{script}: unexpected command {cmd}")


def test_xpyd_router_lists_every_rank(tmp_path: Path) -> None:
    (router,) = _recorded_commands("ascend_xpyd_external_dp/router.sh", [], tmp_path)
    config = parse_router_config(router[3:])
    assert len(config.prefillers) == 4 and len(config.decoders) == 32
    assert [p.dp_rank for p in config.prefillers] == [0, 1, 0, 1]
    assert [p.bootstrap_address[0] for p in config.prefillers] == ["192.0.0.1"] * 2 + ["192.0.0.2"] * 2


@pytest.mark.parametrize(
    ("decode", "router"),
    [("ascend_1p1d_2node/decode.sh", "ascend_1p1d_2node/router.sh"),
     ("ascend_xpyd_external_dp/decode_node.sh", "ascend_xpyd_external_dp/router.sh")],
)  # fmt: skip
def test_decode_trusts_every_bootstrap_host_the_router_names(decode: str, router: str, tmp_path: Path) -> None:
    (cmd,) = _recorded_commands(decode, ["1"] if "node" in decode else [], tmp_path)
    kv = json.loads(cmd[cmd.index("--kv-transfer-config") + 1])
    trusted = trusted_hosts_of(parse_kv_config(kv["kv_role"], kv["kv_connector_extra_config"]))
    (router_cmd,) = _recorded_commands(router, [], tmp_path)
    hosts = {p.bootstrap_address[0] for p in parse_router_config(router_cmd[3:]).prefillers}
    assert hosts and all(trusted.allows(h) for h in hosts), (hosts, trusted.describe())


def test_kubernetes_manifests_match_the_schema() -> None:
    validator = shutil.which("kubernetes-validate", path=str(Path(sys.executable).parent)) or shutil.which(
        "kubernetes-validate"
    )
    assert validator, "kubernetes-validate is not installed (test extra)"
    manifests = sorted(str(p) for p in (EXAMPLES / "kubernetes").glob("*.yaml"))
    out = subprocess.run([validator, "--strict", *manifests], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.count("passed") == 9, out.stdout  # 7 resources + networkpolicy.yaml's 2


def test_kubernetes_kv_configs_parse() -> None:
    import yaml

    (configmap,) = yaml.safe_load_all((EXAMPLES / "kubernetes" / "configmap.yaml").read_text())
    roles = {}
    for name, text in configmap["data"].items():
        kv = json.loads(text.replace("POD_IP", "10.1.2.3"))
        assert kv["kv_connector"] == "PDConnector"
        roles[name] = parse_kv_config(kv["kv_role"], kv["kv_connector_extra_config"])
        exposure_of(roles[name])
    assert sorted(roles) == ["decode.json", "prefill.json"]
    assert roles["prefill.json"].is_prefill and not roles["decode.json"].is_prefill
    for manifest in ("prefill.yaml", "decode.yaml"):
        text = (EXAMPLES / "kubernetes" / manifest).read_text()
        assert f"/etc/pd-connector/{manifest.split('.')[0]}.json" in text
