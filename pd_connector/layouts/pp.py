"""Pipeline-parallel prefill: which layers each P stage holds, and how D maps its layers to stages.

A prefill deployment run with ``--pipeline-parallel-size N`` splits the model's layers into N
contiguous stages; a stage's ranks hold (and push) only their own layers' KV. Each P rank
registers its stage (``pp_rank``) and its layer range ``[first_layer, end_layer)`` with the
bootstrap server; the route lists every stage's range. A decode rank (always one stage: decode
runs PP 1, as in vLLM-Ascend) asks every stage that holds one of its layers, and its load is
complete once each of them has answered.

Layers are named by their global index, read from the KV cache names (``model.layers.7.self_attn.attn``
is layer 7), so P stage 1's first region pairs with D's region of the same layer, not with D's first.
On P, a decode peer's ``PeerHello`` is narrowed to the stage's layers (:func:`localize_hello`): the
rest of the transfer code then pairs P's regions with D's index by index, as with PP 1.

vLLM-Ascend's ``prefill.pp_layer_partition`` ("2,4": layers per stage, as ``VLLM_PP_LAYER_PARTITION``)
tells its decode how P split the layers; here P says so itself, and the key is a check: each
stage must start where the partition says (:func:`partition_mismatch`).

Everything here is pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import msgspec

from pd_connector import messages as proto
from pd_connector.layouts.regions import LayoutError, regions_of_kv_caches

PARTITION_KEY = "pp_layer_partition"


class PipelineError(LayoutError):
    """Stages whose layers cannot be mapped to the decode instance's (the message names both)."""


def layer_index(name: str) -> int | None:
    """Global layer index in a KV cache name (its first all-digit dotted part), None without one."""
    for part in name.split("."):
        if part.isdigit():
            return int(part)
    return None


def region_layers_of(kv_caches: Mapping[str, Any], num_blocks: int) -> tuple[int, ...]:
    """The global layer index of each KV region (``layout.regions_of_kv_caches`` order).

    A name without an index gets its position in ``kv_caches``: PP 1 pairs regions by position
    anyway; a pipeline-parallel stage refuses such names (:func:`stage_range`).
    """
    out: list[int] = []
    for position, (name, value) in enumerate(kv_caches.items()):
        index = layer_index(name)
        out += [position if index is None else index] * len(regions_of_kv_caches({name: value}, num_blocks))
    return tuple(out)


def stage_range(kv_caches: Mapping[str, Any], pp_rank: int) -> tuple[int, int]:
    """``[first_layer, end_layer)`` of the layers in this stage's KV caches; they must be contiguous."""
    indices = [layer_index(name) for name in kv_caches]
    unnamed = [name for name, index in zip(kv_caches, indices, strict=True) if index is None]
    if unnamed:
        raise PipelineError(
            f"pipeline stage {pp_rank}: KV cache name(s) {unnamed[:3]} carry no layer index; "
            "decode cannot tell which of its layers they are"
        )
    layers = sorted(set(i for i in indices if i is not None))
    if not layers:
        raise PipelineError(f"pipeline stage {pp_rank} holds no KV layers")
    first, end = layers[0], layers[-1] + 1
    if len(layers) != end - first:
        raise PipelineError(f"pipeline stage {pp_rank} holds layers {layers}, which are not contiguous")
    return first, end


def parse_partition(key: str, value: Any) -> tuple[int, ...]:
    """``pp_layer_partition`` of extra-config ``key``: "2,4" (or [2, 4]) layers per stage, each >= 1."""
    where = f"kv_connector_extra_config.{key}.{PARTITION_KEY}"
    items = value.split(",") if isinstance(value, str) else value
    if not isinstance(items, (list, tuple)) or not items:
        raise ValueError(f'{where} must be layers per stage like "2,4", got {value!r}')
    out = []
    for item in items:
        try:
            if isinstance(item, bool):
                raise ValueError
            count = int(item.strip()) if isinstance(item, str) else int(item)
        except (ValueError, TypeError):
            raise ValueError(f'{where} must be layers per stage like "2,4", got {value!r}') from None
        if count < 1:
            raise ValueError(f"{where}: every stage holds >= 1 layer, got {value!r}")
        out.append(count)
    return tuple(out)


def partition_mismatch(
    key: str, partition: Sequence[int] | None, what: str, stage_firsts: Sequence[int | None]
) -> str | None:
    """Why stages starting at ``stage_firsts`` (None: not known) disagree with ``pp_layer_partition``.

    Only starts are compared: a last stage may hold more (vLLM-Ascend puts MTP draft layers there).
    """
    if partition is None:
        return None
    where = f"kv_connector_extra_config.{key}.{PARTITION_KEY}"
    if len(partition) != len(stage_firsts):
        return f"{where} names {len(partition)} stages, but {what} has pipeline-parallel size {len(stage_firsts)}"
    for stage, first in enumerate(stage_firsts):
        expected = sum(partition[:stage])
        if first is not None and first != expected:
            return (
                f"{where} is {','.join(map(str, partition))}: stage {stage} would start at layer {expected}, "
                f"but in {what} it starts at layer {first}; correct {where} or the deployment"
            )
    return None


# ------------------------------------------------------------------ decode side


def stages_for(route: proto.Route, d_layers: Sequence[int], addr: str) -> list[int]:
    """P stages (pp ranks, ascending) that hold one of ``d_layers``; each D layer must be in exactly one."""
    if route.pp_size <= 1:
        return [0]
    ranges = route.stage_layers
    if len(ranges) != route.pp_size:
        raise PipelineError(
            f"the prefill deployment at {addr} has pipeline-parallel size {route.pp_size} "
            f"but told the layers of {len(ranges)} stages"
        )
    stages: set[int] = set()
    for layer in sorted(set(d_layers)):
        holders = [s for s, (first, end) in enumerate(ranges) if first <= layer < end]
        if len(holders) != 1:
            shown = ", ".join(f"stage {s}: [{a}, {b})" for s, (a, b) in enumerate(ranges))
            problem = "no stage" if not holders else f"stages {holders}"
            raise PipelineError(
                f"layer {layer} of this decode instance is held by {problem} of the prefill deployment at "
                f"{addr} ({shown}); P and D must serve the same model"
            )
        stages.add(holders[0])
    return sorted(stages)


# ------------------------------------------------------------------ prefill side


def localize_hello(region_layers: Sequence[int], pp_size: int, hello: proto.PeerHello) -> proto.PeerHello:
    """D's hello narrowed to this P stage's layers: its regions (and their groups) paired with P's by index.

    With PP 1 (or a stage that holds every layer D has) it is returned as it is. Raises
    PipelineError when D does not say which layer each region is, or lacks one of the stage's layers.
    """
    if pp_size <= 1:
        return hello
    if not hello.region_layers or len(hello.region_layers) != len(hello.regions):
        raise PipelineError(
            f"decode peer {hello.peer_id} does not say which layer each of its KV regions holds; "
            "it cannot take KV from a pipeline-parallel prefill (run P and D on the same PDConnector version)"
        )
    ours = set(region_layers)
    keep = [i for i, layer in enumerate(hello.region_layers) if layer in ours]
    theirs = [hello.region_layers[i] for i in keep]
    if theirs != list(region_layers):
        missing = sorted(ours - set(theirs))
        raise PipelineError(
            f"decode peer {hello.peer_id}: this prefill stage holds layers {sorted(ours)}, "
            f"decode's regions of them do not pair up (missing layers {missing}); P and D must serve the same model"
        )
    groups = [hello.region_groups[i] for i in keep] if hello.region_groups else []
    return msgspec.structs.replace(
        hello,
        regions=[hello.regions[i] for i in keep],
        region_groups=groups,
        region_layers=theirs,
        num_layers=len(ours),
    )


def own_stage_problem(key: str, sizes: Any, pp_rank: int, pp_size: int, first_layer: int) -> str | None:
    """Why this rank's stage (``pp_rank`` of ``pp_size``, starting at ``first_layer``) disagrees with its
    own side's ``pp_size`` / ``pp_layer_partition`` (``peer_sizes.SideSizes``; None: not configured)."""
    if sizes is None:
        return None
    where = f"kv_connector_extra_config.{key}"
    if sizes.pp_size is not None and sizes.pp_size != pp_size:
        return (
            f"{where}.pp_size is {sizes.pp_size}, but this {key} instance runs --pipeline-parallel-size {pp_size}; "
            f"correct {where} or the deployment"
        )
    firsts: list[int | None] = [None] * pp_size
    firsts[pp_rank] = first_layer
    return partition_mismatch(key, sizes.pp_layer_partition, f"this {key} instance", firsts)
