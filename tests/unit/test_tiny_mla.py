"""launch.tiny_mla: the tiny DeepSeek-V3-shaped MLA model's shape, its dense layers and its latent size."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from launch.tiny_mla import KV_LORA_RANK, QK_ROPE_HEAD_DIM, latent_bytes_per_token, make_tiny_mla_model


def test_builds_a_dense_deepseek_v3_with_the_cpu_mla_latent_size(tmp_path: Path) -> None:
    from safetensors import safe_open

    out = make_tiny_mla_model(tmp_path / "m")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["model_type"] == "deepseek_v3" and cfg["architectures"] == ["DeepseekV3ForCausalLM"]
    assert (cfg["kv_lora_rank"], cfg["qk_rope_head_dim"]) == (512, 64)  # vLLM CPU_MLA: head size 576 only
    assert cfg["first_k_dense_replace"] == cfg["num_hidden_layers"] == 2
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        names = list(f.keys())
    assert not [n for n in names if "experts" in n or ".gate." in n], "a layer has experts"
    assert any("kv_a_proj_with_mqa" in n for n in names) and any("kv_b_proj" in n for n in names)
    assert (out / "tokenizer.json").exists()
    # Reused as it is, not rebuilt.
    mtime = (out / "model.safetensors").stat().st_mtime_ns
    assert make_tiny_mla_model(out, seed=1) == out and (out / "model.safetensors").stat().st_mtime_ns == mtime


def test_latent_bytes_per_token() -> None:
    assert latent_bytes_per_token() == 2 * (KV_LORA_RANK + QK_ROPE_HEAD_DIM) * 4 == 4608
    assert latent_bytes_per_token(num_layers=3, dtype_bytes=2) == 3 * 576 * 2


@pytest.mark.parametrize("kwargs", [{"num_layers": 0}, {"num_heads": 0}, {"q_lora_rank": 0}])
def test_bad_shapes_name_the_value(tmp_path: Path, kwargs: dict) -> None:
    with pytest.raises(ValueError, match=str(next(iter(kwargs.values())))):
        make_tiny_mla_model(tmp_path / "m", **kwargs)
