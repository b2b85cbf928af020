"""launch.ascend_peers: the one place that finds vLLM-Ascend's proxy scripts (PDC_VLLM_ASCEND_PEERS)."""

from __future__ import annotations

from pathlib import Path

from launch import ascend_peers


def test_unset_names_the_variable() -> None:
    path, why = ascend_peers.example_proxy({})
    assert path is None and ascend_peers.ENV_VAR in why


def test_the_scripts_folder_or_its_parent(tmp_path: Path) -> None:
    folder = tmp_path / ascend_peers.RELEASE_DIR
    folder.mkdir()
    (folder / ascend_peers.EXAMPLE_PROXY).write_text("# stand-in\n")
    for value in (folder, tmp_path):
        assert ascend_peers.example_proxy({ascend_peers.ENV_VAR: str(value)}) == (
            folder / ascend_peers.EXAMPLE_PROXY,
            "",
        )


def test_a_folder_without_the_proxy_says_where_it_looked(tmp_path: Path) -> None:
    path, why = ascend_peers.example_proxy({ascend_peers.ENV_VAR: str(tmp_path)})
    assert path is None and str(tmp_path) in why and ascend_peers.EXAMPLE_PROXY in why


def test_required_only_under_ci() -> None:
    assert (
        ascend_peers.required({"CI": "true"})
        and not ascend_peers.required({})
        and not ascend_peers.required({"CI": "0"})
    )
