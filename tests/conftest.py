"""Fixtures shared by every test: the tiny offline model.

Routers the tests start choose every request's path as ``always-pd`` (P prefills, the KV is pushed)
unless a test names ``--path-policy``: the suites check the transfer path; the path choice has its
own tests (``tests/proxy/test_path_choice.py``, ``tests/e2e/test_path_policy.py``).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("PD_ROUTER_PATH_POLICY", "always-pd")  # proxy.planning.flags.PATH_POLICY_ENV


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random-weight Llama with a byte-level tokenizer (~1.5 MB), built once per session."""
    from launch.tiny_model import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("models") / "tiny-llama")


@pytest.fixture(scope="session")
def tiny_hybrid_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random-weight Mamba2 + attention hybrid (GraniteMoeHybrid, 4 layers, ~3 MB), built once per session."""
    from launch.tiny_hybrid import make_tiny_hybrid_model

    return make_tiny_hybrid_model(tmp_path_factory.mktemp("models") / "tiny-hybrid")


@pytest.fixture(scope="session")
def tiny_mla_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random-weight DeepSeek-V3-shaped MLA model (2 dense layers, ~10 MB), built once per session."""
    from launch.tiny_mla import make_tiny_mla_model

    return make_tiny_mla_model(tmp_path_factory.mktemp("models") / "tiny-mla")
