"""The Router's command line: defaults, validation, one-line errors with exit code 2."""

from __future__ import annotations

import subprocess
import sys

import pytest

from proxy.cli import parse_config
from tests.support.router_rig import REPO_ROOT

BASE = ["--prefiller-hosts", "p1", "--prefiller-ports", "8100", "--decoder-hosts", "d1", "--decoder-ports", "8200"]


def test_defaults() -> None:
    config = parse_config(BASE)
    assert (config.host, config.port) == ("127.0.0.1", 8000)
    assert config.max_retries == 3
    assert config.retry_delay == 0.001
    assert config.request_timeout == 600
    assert config.connect_timeout == 5
    assert config.log_level == "INFO"
    assert config.routing == "room"
    assert config.health_interval == 5 and config.health_timeout == 2
    assert config.max_body_size == 32 * 1024 * 1024
    assert (config.max_waiting_retries, config.waiting_retry_interval) == (3, 10)
    (prefiller,) = config.prefillers
    assert (prefiller.host, prefiller.port, prefiller.bootstrap_port) == ("p1", 8100, 18800)
    (decoder,) = config.decoders
    assert (decoder.host, decoder.port, decoder.bootstrap_port) == ("d1", 8200, None)


def test_backend_authorization_from_openai_api_key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    assert parse_config(BASE).backend_authorization is None
    monkeypatch.setenv("OPENAI_API_KEY", "sk-x")
    assert parse_config(BASE).backend_authorization == "Bearer sk-x"


def test_several_backends_and_bootstrap_ports() -> None:
    config = parse_config(
        [
            "--prefiller-hosts", "a", "b",
            "--prefiller-ports", "1", "2",
            "--prefiller-bootstrap-ports", "9001", "9002",
            "--decoder-hosts", "c", "d", "e",
            "--decoder-ports", "3", "4", "5",
            "--log-level", "debug",
        ]
    )  # fmt: skip
    assert [(b.host, b.port, b.bootstrap_port) for b in config.prefillers] == [("a", 1, 9001), ("b", 2, 9002)]
    assert [(b.host, b.port) for b in config.decoders] == [("c", 3), ("d", 4), ("e", 5)]
    assert config.log_level == "DEBUG"


def test_one_bootstrap_port_applies_to_all() -> None:
    config = parse_config(
        ["--prefiller-hosts", "a", "b", "--prefiller-ports", "1", "2", "--prefiller-bootstrap-ports", "7000"]
        + ["--decoder-hosts", "c", "--decoder-ports", "3"]
    )
    assert [b.bootstrap_port for b in config.prefillers] == [7000, 7000]


def test_external_dp_prefillers_share_one_bootstrap_server() -> None:
    config = parse_config(
        [
            "--prefiller-hosts", "a", "b",
            "--prefiller-ports", "9000", "9000",
            "--prefiller-bootstrap-ports", "8998",
            "--prefiller-bootstrap-hosts", "a",
            "--prefiller-dp-ranks", "0", "1",
            "--decoder-hosts", "c", "--decoder-ports", "3",
        ]
    )  # fmt: skip
    assert [b.bootstrap_address for b in config.prefillers] == [("a", 8998), ("a", 8998)]
    assert [b.dp_rank for b in config.prefillers] == [0, 1]
    assert "dp rank 1" in config.describe() and "bootstrap a:8998" in config.describe()
    plain = parse_config(BASE)
    assert plain.prefillers[0].dp_rank is None
    assert plain.prefillers[0].bootstrap_address == ("p1", 18800)


def test_new_flags() -> None:
    config = parse_config(
        [
            *BASE,
            "--routing", "least-loaded",
            "--health-interval", "0",
            "--health-timeout", "0.5",
            "--max-body-size", "512k",
            "--max-waiting-retries", "5",
            "--waiting-retry-interval", "1.5",
            "--workers", "1",
        ]
    )  # fmt: skip
    assert config.routing == "least-loaded"
    assert (config.health_interval, config.health_timeout) == (0, 0.5)
    assert config.max_body_size == 512 * 1024
    assert (config.max_waiting_retries, config.waiting_retry_interval) == (5, 1.5)


@pytest.mark.parametrize(("text", "size"), [("100", 100), ("2k", 2048), ("3M", 3 * 1024**2), ("1GiB", 1024**3)])
def test_body_sizes(text: str, size: int) -> None:
    assert parse_config([*BASE, "--max-body-size", text]).max_body_size == size


def test_vllm_ascend_command_line_is_accepted() -> None:
    """The flags of vLLM-Ascend's example proxy, as its docs use them."""
    config = parse_config(
        [
            "--host", "0.0.0.0", "--port", "9000", "--workers", "1",
            "--prefiller-hosts", "127.0.0.1", "127.0.0.1", "--prefiller-ports", "8100", "8101",
            "--decoder-hosts", "127.0.0.1", "127.0.0.1", "--decoder-ports", "8200", "8201",
            "--max-retries", "3", "--retry-delay", "0.001",
            "--max-waiting-retries", "3", "--waiting-retry-interval", "10", "--log-level", "INFO",
        ]
    )  # fmt: skip
    assert (config.host, config.port) == ("0.0.0.0", 9000)
    assert [b.port for b in config.prefillers] == [8100, 8101]


BAD_FLAGS = {
    "host/port count": ["--prefiller-hosts", "a", "b", "--prefiller-ports", "1", "--decoder-hosts", "c"]
    + ["--decoder-ports", "3"],
    "decoder port range": BASE[:6] + ["--decoder-ports", "70000"],
    "no decoders": BASE[:4],
    "no prefillers": BASE[4:],
    "router port 0": [*BASE, "--port", "0"],
    "bootstrap count": [*BASE, "--prefiller-bootstrap-ports", "1", "2"],
    "bootstrap range": [*BASE, "--prefiller-bootstrap-ports", "0"],
    "bootstrap hosts count": [*BASE, "--prefiller-bootstrap-hosts", "a", "b"],
    "dp ranks count": [*BASE, "--prefiller-dp-ranks", "0", "1"],
    "dp rank negative": [*BASE, "--prefiller-dp-ranks", "-1"],
    "dp rank twice": ["--prefiller-hosts", "a", "b", "--prefiller-ports", "1", "2", "--prefiller-dp-ranks", "0", "0"]
    + ["--prefiller-bootstrap-hosts", "a", "--decoder-hosts", "c", "--decoder-ports", "3"],
    "retries": [*BASE, "--max-retries", "0"],
    "timeout": [*BASE, "--request-timeout", "-1"],
    "timeout nan": [*BASE, "--connect-timeout", "nan"],
    "not an int": [*BASE, "--port", "http"],
    "unknown flag": [*BASE, "--bogus"],
    "routing": [*BASE, "--routing", "random"],
    "health interval": [*BASE, "--health-interval", "-1"],
    "body size": [*BASE, "--max-body-size", "lots"],
    "body size 0": [*BASE, "--max-body-size", "0"],
    "workers": [*BASE, "--workers", "0"],
    "waiting retries": [*BASE, "--max-waiting-retries", "0"],
    "duplicate decoder": BASE[:4] + ["--decoder-hosts", "d1", "d1", "--decoder-ports", "8200", "8200"],
}


@pytest.mark.parametrize("argv", BAD_FLAGS.values(), ids=BAD_FLAGS.keys())
def test_bad_flags_exit_2_in_process(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        parse_config(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "error:" in err, err


@pytest.mark.parametrize("case", ["host/port count", "decoder port range", "no prefillers"])
def test_bad_flags_exit_2_as_a_process(case: str) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "proxy", *BAD_FLAGS[case]],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert result.returncode == 2
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("python -m proxy: error: ")
    assert result.stdout == ""


def test_routing_choices_help_and_readme_come_from_the_policy_table() -> None:
    from proxy.cli import build_parser
    from proxy.router_config import ROUTING_POLICIES
    from proxy.upstream.routing import POLICIES, describe

    assert ROUTING_POLICIES == tuple(POLICIES)
    (action,) = [a for a in build_parser()._actions if a.dest == "routing"]
    assert tuple(action.choices) == ROUTING_POLICIES and action.default == ROUTING_POLICIES[0]
    help_text = " ".join((action.help or "").replace("%%", "%").split())
    readme = (REPO_ROOT / "README.md").read_text()
    section = readme[readme.index("**Routing** (`--routing`") :]
    section = section[: section.index("\n\n**")]
    listed = [line for line in section.splitlines() if line.startswith("- `")]
    assert len(listed) == len(POLICIES)
    for name, line in zip(POLICIES, listed, strict=True):
        assert f"'{name}' = {describe(name)}" in help_text
        default = " (default)" if name == ROUTING_POLICIES[0] else ""
        assert line == f"- `{name}`{default}: {describe(name)}"
