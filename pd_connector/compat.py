"""Whether a decode instance can take KV from a prefill deployment: every P/D compatibility check.

- ``kv_mismatch`` / ``route_mismatch`` (block size, KV dtype, layers, model): by D's transfer manager
  at handshake time (exact, per rank) and by the HTTP middleware in D's API server before a request
  reaches the engine, so that a misconfigured P/D pair gives the client a clear error instead of a
  generic failed request;
- ``version_problem`` / ``peer_problem``: by a P rank on a D rank's ``PeerHello`` (wire version, KV
  facts, heads and TP split, KV cache groups, NHD reshuffle), before any write plan is made.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pd_connector import messages as proto
from pd_connector.layouts.kv_groups import check_peer_groups
from pd_connector.layouts.regions import LayoutError, Region
from pd_connector.layouts.tp import MappingError, check_head_regions, needs_head_split, plan_decode_rank
from pd_connector.messages import Route

if TYPE_CHECKING:
    from pd_connector.transfer.context import RankSpec


def kv_dtype_name(vllm_config: Any) -> str:
    """The KV cache dtype as both sides report it: ``cache_dtype`` unless auto, else the model dtype."""
    cache_dtype = vllm_config.cache_config.cache_dtype
    if cache_dtype and cache_dtype != "auto":
        return str(cache_dtype)
    return str(vllm_config.model_config.dtype).removeprefix("torch.")


def model_fingerprint(vllm_config: Any) -> str:
    """The served model in the terms that decide whether its KV cache fits another instance's.

    Architecture, layers, hidden size, vocabulary, KV heads and head size: P and D may load the
    model from different paths, but must agree on these. "" when the config cannot tell (the
    check is then skipped).
    """
    model = vllm_config.model_config
    try:
        arch = ",".join(getattr(model, "architectures", None) or []) or "?"
        layers = getattr(model.hf_text_config, "num_hidden_layers", "?")
        return (
            f"{arch} layers={layers} hidden={model.get_hidden_size()} vocab={model.get_vocab_size()} "
            f"kv_heads={model.get_total_num_kv_heads()} head_size={model.get_head_size()}"
        )
    except Exception:  # noqa: BLE001 - an unusual config only loses this check
        return ""


@dataclass(frozen=True)
class KVFacts:
    """What one side's KV cache must share with the other's. None / "" = not known here (not compared)."""

    block_size: int
    kv_dtype: str
    num_layers: int | None = None
    model: str = ""


def kv_mismatch(prefill_name: str, prefill: KVFacts, decode_name: str, decode: KVFacts) -> str | None:
    """Why KV from ``prefill`` cannot go into ``decode`` (a message naming both values); None if it can."""
    p, d = prefill, decode
    if p.model and d.model and p.model != d.model:
        return (
            f"model mismatch: {prefill_name} serves [{p.model}], {decode_name} [{d.model}]; "
            "P and D must serve the same model"
        )
    if p.block_size != d.block_size:
        return (
            f"block size mismatch: {prefill_name} uses --block-size {p.block_size}, {decode_name} {d.block_size}; "
            "start P and D with the same block size"
        )
    if p.kv_dtype != d.kv_dtype:
        return (
            f"KV cache dtype mismatch: {prefill_name} uses {p.kv_dtype}, {decode_name} {d.kv_dtype}; "
            "start P and D with the same --dtype/--kv-cache-dtype"
        )
    if p.num_layers is not None and d.num_layers is not None and p.num_layers != d.num_layers:
        return (
            f"layer count mismatch: {prefill_name} has {p.num_layers} KV layers, {decode_name} {d.num_layers}; "
            "P and D must serve the same model"
        )
    return None


def route_mismatch(
    route: Route, addr: str, block_size: int, kv_dtype: str, num_layers: int | None, model: str = ""
) -> str | None:
    """Why D (``block_size``, ``kv_dtype``, ``num_layers``, ``model``) cannot use P's ``route``; None if it can.

    ``num_layers`` None skips the layer check (the API server does not know how many KV layers
    its workers registered); a route without a layer count (0) skips it too, and an empty
    ``model`` on either side skips the model check.
    """
    prefill = KVFacts(route.block_size, route.kv_cache_dtype, route.num_layers or None, route.model)
    decode = KVFacts(block_size, kv_dtype, num_layers, model)
    return kv_mismatch(f"the prefill deployment at {addr}", prefill, "this decode instance", decode)


def version_problem(hello: proto.PeerHello) -> str | None:
    """Why a decode peer speaks another ZMQ wire version than this rank (naming both); None if it does not."""
    if hello.wire_version == proto.WIRE_VERSION:
        return None
    theirs = hello.wire_version or "1 or older (no version in its PeerHello)"
    return (
        f"incompatible decode instance {hello.peer_id}: it speaks PDConnector wire version {theirs}, "
        f"this prefill rank speaks version {proto.WIRE_VERSION}; run the same PDConnector release on P and D"
    )


def peer_problem(spec: RankSpec, regions: Sequence[Region], hello: proto.PeerHello) -> str | None:
    """Why KV of this P rank cannot go to the decode rank that sent ``hello``; None if it can."""
    try:
        ours = KVFacts(spec.block_size, spec.kv_dtype, spec.num_layers)
        theirs = KVFacts(hello.block_size, hello.kv_dtype, hello.num_layers)
        problem = kv_mismatch("this prefill instance", ours, f"decode instance {hello.peer_id}", theirs)
        if problem is not None:
            raise LayoutError(problem)
        if (hello.total_kv_heads, hello.use_mla) != (spec.total_kv_heads, spec.use_mla):
            raise LayoutError(
                f"model mismatch: prefill has {spec.total_kv_heads} KV heads (MLA {spec.use_mla}), "
                f"decode {hello.total_kv_heads} (MLA {hello.use_mla})"
            )
        check_head_regions(regions, [Region(*r) for r in hello.regions], spec.local_kv_heads, hello.local_kv_heads)
        check_peer_groups(spec.region_groups, hello.region_groups, len(regions))
        plan = plan_decode_rank(spec.heads, spec.tp_size, hello.tp_size, hello.tp_rank, is_mla=spec.use_mla)
        head_major = spec.heads_outermost and hello.heads_outermost
        staged = spec.token_major and hello.token_major  # transfer.nhd_reshuffle
        split = needs_head_split(plan, spec.local_kv_heads, hello.local_kv_heads)
        if split and not head_major and staged and len(set(spec.region_groups)) > 1:
            raise MappingError(
                f"prefill TP {spec.tp_size} / decode TP {hello.tp_size} on token-major (NHD) KV is reshuffled for "
                "one KV cache group only, this model has several; use equal TP sizes or "
                "--disable-hybrid-kv-cache-manager"
            )
        if split and not (head_major or staged):
            raise MappingError(
                f"prefill TP {spec.tp_size} / decode TP {hello.tp_size} split KV heads inside a block, "
                "but the KV layout keeps heads inside tokens (NHD) and is not reshuffled on both sides "
                "(staging_bytes 0, decode.tp_size set to prefill's TP size, or a layout other than "
                "[blocks, block_size, heads, dim]); use equal TP sizes"
            )
    except LayoutError as exc:
        return f"incompatible decode instance {hello.peer_id}: {exc}"
    return None
