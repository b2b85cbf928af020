"""Build a tiny random-weight Llama model with a byte-level tokenizer, offline.

The model is only meant for tests and demos on machines with no model hub access:
it loads in vLLM like any Hugging Face checkpoint, in a few MB.
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

SPECIAL_TOKENS = ["<s>", "</s>", "<pad>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def build_tokenizer(out: Path) -> int:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for ch in sorted(alphabet):
        vocab[ch] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(out))
    return len(vocab)


def make_tiny_model(
    out_dir: str | Path,
    seed: int = 0,
    num_layers: int = 2,
    *,
    hidden_size: int = 128,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int | None = None,
    sliding_window: int | None = None,
) -> Path:
    """Write a tiny random Llama (default GQA: hidden 128, 4 heads, 2 KV heads, head_dim 32) to out_dir.

    `hidden_size`, `num_heads`, `num_kv_heads` and `intermediate_size` (default 2 x hidden) give
    other shapes (head_dim = hidden / heads), e.g. the benchmarks' hidden 512, 6 layers, 8 heads,
    2 KV heads. An existing model in out_dir is reused as it is.

    `sliding_window` (tokens) makes a hybrid model: even layers attend within that window
    (``layer_types`` ``sliding_attention``), odd layers to the whole prompt (``full_attention``), so
    vLLM's hybrid KV cache manager gives it two KV cache groups.
    """
    if hidden_size % num_heads or num_heads % num_kv_heads:
        raise ValueError(f"hidden {hidden_size}, heads {num_heads}, KV heads {num_kv_heads} do not divide")
    if sliding_window is not None and (sliding_window < 1 or num_layers < 2):
        raise ValueError(f"sliding_window {sliding_window} needs a window >= 1 and >= 2 layers, got {num_layers}")
    hybrid = {}
    if sliding_window is not None:
        kinds = ("sliding_attention", "full_attention")
        hybrid = {"sliding_window": sliding_window, "layer_types": [kinds[i % 2] for i in range(num_layers)]}
    from transformers import LlamaConfig, LlamaForCausalLM

    out = Path(out_dir)
    if (out / "config.json").exists() and (out / "tokenizer.json").exists():
        return out
    out.mkdir(parents=True, exist_ok=True)
    vocab_size = build_tokenizer(out)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size or 2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=hidden_size // num_heads,
        max_position_embeddings=4096,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=2,
        tie_word_embeddings=False,
        initializer_range=0.25,
        torch_dtype="float32",
        **hybrid,
    )
    return save_random_model(LlamaForCausalLM, config, out, seed, "tiny model")


def save_random_model(model_cls: Any, config: Any, out: Path, seed: int, what: str) -> Path:
    """Build ``model_cls(config)`` with random float32 weights from ``seed`` and write it, with the
    tokenizer's special ids as its generation config, to ``out`` (the builders of launch.tiny_*)."""
    import torch

    torch.manual_seed(seed)
    model = model_cls(config).to(torch.float32)
    model.save_pretrained(str(out), safe_serialization=True)
    gen = {"bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 2}
    (out / "generation_config.json").write_text(json.dumps(gen))
    logger.info("%s written to %s", what, out)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("out_dir")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--num-layers", type=int, default=2)
    parser.add_argument("--hidden-size", type=int, default=128)
    parser.add_argument("--num-heads", type=int, default=4)
    parser.add_argument("--num-kv-heads", type=int, default=2)
    parser.add_argument("--sliding-window", type=int, default=None, help="hybrid: even layers use this window")
    args = parser.parse_args()
    shape = {"hidden_size": args.hidden_size, "num_heads": args.num_heads, "num_kv_heads": args.num_kv_heads}
    shape["sliding_window"] = args.sliding_window
    print(make_tiny_model(args.out_dir, args.seed, args.num_layers, **shape))


if __name__ == "__main__":
    main()
