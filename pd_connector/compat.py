"""Whether a decode instance can take KV from a prefill deployment (block size, KV dtype, layers).

Used twice: by D's transfer manager at handshake time (exact, per rank) and by the HTTP
middleware in D's API server before a request reaches the engine, so that a misconfigured
P/D pair gives the client a clear error instead of a generic failed request.
"""

from __future__ import annotations

from typing import Any

from pd_connector.protocol import Route


def kv_dtype_name(vllm_config: Any) -> str:
    """The KV cache dtype as both sides report it: ``cache_dtype`` unless auto, else the model dtype."""
    cache_dtype = vllm_config.cache_config.cache_dtype
    if cache_dtype and cache_dtype != "auto":
        return str(cache_dtype)
    return str(vllm_config.model_config.dtype).removeprefix("torch.")


def route_mismatch(route: Route, addr: str, block_size: int, kv_dtype: str, num_layers: int | None) -> str | None:
    """Why D (``block_size``, ``kv_dtype``, ``num_layers``) cannot use P's ``route``; None if it can.

    ``num_layers`` None skips the layer check (the API server does not know how many KV layers
    its workers registered); a route without a layer count (0) skips it too.
    """
    if route.block_size != block_size:
        return (
            f"block size mismatch: the prefill deployment at {addr} uses --block-size {route.block_size}, "
            f"this decode instance {block_size}; start P and D with the same block size"
        )
    if route.kv_cache_dtype != kv_dtype:
        return (
            f"KV cache dtype mismatch: the prefill deployment at {addr} uses {route.kv_cache_dtype}, "
            f"this decode instance {kv_dtype}; start P and D with the same --dtype/--kv-cache-dtype"
        )
    if num_layers is not None and route.num_layers and route.num_layers != num_layers:
        return (
            f"layer count mismatch: the prefill deployment at {addr} has {route.num_layers} KV layers, "
            f"this decode instance {num_layers}; P and D must serve the same model"
        )
    return None
