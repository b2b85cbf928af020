"""Start-up refusals: deployments PDConnector cannot serve correctly stop with a sentence naming why.

Run by ``PDConnector.__init__`` on both sides (scheduler and every worker), before anything opens:

- models whose layers keep a recurrent state instead of (or beside) attention KV (Mamba / Mamba2
  hybrids, gated delta net as in Qwen3-Next; vLLM gives such layers a KV cache group whose spec is a
  ``MambaSpec``, ``vllm/v1/kv_cache_interface.py``), except the one case PDConnector moves (see
  ``pd_connector.layouts.state_groups``): an attention + recurrent-state hybrid on vLLM >= 0.32 with prefix
  caching on (vLLM then keeps the state in "align" mode, one block per ``block_size`` tokens), no
  speculative decoding, tensor and pipeline parallel size 1, ``transfer_mode`` ``request``, neither
  ``d2rh`` nor ``migration``. Attention-free models (plain Mamba) stay refused. vLLM-Ascend has a
  separate connector for them (``MooncakeHybridConnector``);
- context parallel (vLLM's ``prefill_context_parallel_size`` / ``decode_context_parallel_size``,
  vLLM-Ascend's pcp / dcp): a request's tokens are spread over ranks, a block's KV is on several;
- dual-batch overlap (``enable_dbo``, or ``ubatch_size`` > 1) with ``transfer_mode`` ``layer``: vLLM
  runs every layer once per micro-batch on two threads, and the layer push assumes one pass;
- kv_role ``kv_both`` with vLLM's data parallel or pipeline parallel, or with a recurrent-state model: a
  kv_both instance is one DP rank of one pipeline stage moving attention KV only (``config`` refuses its
  d2rh, layer mode, migration and dp_size).

``note_kv_transfer_fields`` says (in the log) what vLLM's ``kv_port`` and ``engine_id`` do here.
"""

from __future__ import annotations

import logging
from typing import Any

from pd_connector.config import ConfigError, DisaggConfig
from pd_connector.layouts.kv_groups import layer_kinds, recurrent_groups
from pd_connector.layouts.state_groups import state_transfer_problem

logger = logging.getLogger(__name__)

#: vLLM's KVTransferConfig.kv_port default (the same on vLLM 0.23 and 0.32): not set by the user.
VLLM_DEFAULT_KV_PORT = 14579

#: parallel_config attribute -> (vllm serve flag, vLLM-Ascend's name for it).
CONTEXT_PARALLEL = {
    "prefill_context_parallel_size": ("--prefill-context-parallel-size (-pcp)", "pcp"),
    "decode_context_parallel_size": ("--decode-context-parallel-size (-dcp)", "dcp"),
}


class UnsupportedSetupError(ConfigError):
    """A vLLM setting or model that PDConnector cannot disaggregate."""


def _architecture(vllm_config: Any) -> str:
    model = getattr(vllm_config, "model_config", None)
    return ",".join(getattr(model, "architectures", None) or []) or "this model"


def recurrent_state_problem(cfg: DisaggConfig, vllm_config: Any, kv_cache_config: Any) -> str | None:
    """Why this model's recurrent state cannot move with this setup, naming its layer kinds; else None."""
    arch = _architecture(vllm_config)
    fix = (
        "PDConnector moves attention KV only and does not support prefill/decode disaggregation of recurrent "
        "state; serve this model colocated (one vllm serve without --kv-transfer-config)"
    )
    if recurrent_groups(kv_cache_config):
        why = state_transfer_problem(cfg, vllm_config, kv_cache_config)
        if why is None:  # the supported hybrid case: the state moves as its own group (state_groups)
            return None
        return (
            f"{arch} has layers that keep a recurrent state (Mamba / linear attention) beside or instead of "
            f"attention KV: KV cache groups {layer_kinds(kv_cache_config)}. PDConnector moves that state only "
            f"for {why}; otherwise serve this model colocated (one vllm serve without --kv-transfer-config)"
        )
    model = getattr(vllm_config, "model_config", None)
    flags = [f for f in ("is_hybrid", "is_attention_free") if getattr(model, f, False) is True]
    if flags and not getattr(kv_cache_config, "kv_cache_groups", None):  # groups unknown: vLLM's model flags
        return f"{arch} is a model vLLM reports as {' and '.join(flags)} (recurrent-state layers). {fix}"
    return None


def context_parallel_problem(parallel_config: Any) -> str | None:
    """Why this instance's context parallel setting cannot be disaggregated; None at size 1."""
    for attr, (flag, ascend) in CONTEXT_PARALLEL.items():
        size = getattr(parallel_config, attr, 1)
        if isinstance(size, int) and size > 1:
            return (
                f"vLLM's {flag} is {size} (parallel_config.{attr}, vLLM-Ascend's {ascend}): context parallel "
                "spreads a request's tokens, and so each KV block, over several ranks, and PDConnector moves "
                f"whole blocks between ranks; start this instance with {attr} 1"
            )
    return None


def dual_batch_problem(cfg: DisaggConfig, parallel_config: Any) -> str | None:
    """Why dual-batch overlap cannot run with this transfer mode; None when it can (or is off)."""
    dbo = getattr(parallel_config, "enable_dbo", False) is True
    ubatch = getattr(parallel_config, "ubatch_size", 0)
    micro = isinstance(ubatch, int) and ubatch > 1
    if not (dbo or micro) or not (cfg.is_prefill and cfg.transfer_mode == "layer"):
        return None
    setting = "--enable-dbo (parallel_config.enable_dbo)" if dbo else f"--ubatch-size {ubatch}"
    return (
        f"vLLM's {setting} with kv_connector_extra_config.transfer_mode 'layer': micro-batching runs every "
        "layer once per micro-batch, and the layer push sends a layer's KV after its one pass; use "
        "transfer_mode 'request' or start P without micro-batching"
    )


def both_problem(cfg: DisaggConfig, parallel_config: Any, kv_cache_config: Any) -> str | None:
    """Why this kv_both instance cannot run as both sides; None when it can (or is not kv_both)."""
    if not cfg.is_both:
        return None
    for attr, flag in (("data_parallel_size", "--data-parallel-size"), ("pipeline_parallel_size", "-pp")):
        size = getattr(parallel_config, attr, 1)
        if isinstance(size, int) and size > 1:
            return (
                f"kv_role kv_both with vLLM's {flag} {size} (parallel_config.{attr}) is not supported: a kv_both "
                "instance prefills and decodes as one DP rank of one pipeline stage; start it with "
                f"{attr} 1, or run separate kv_producer and kv_consumer deployments"
            )
    if recurrent_groups(kv_cache_config):
        return (
            f"kv_role kv_both with a recurrent-state model (KV cache groups {layer_kinds(kv_cache_config)}) is not "
            "supported; run separate kv_producer and kv_consumer deployments"
        )
    return None


def refuse_unsupported(cfg: DisaggConfig, vllm_config: Any, kv_cache_config: Any) -> None:
    """UnsupportedSetupError for the first of the problems above that this instance has."""
    par = getattr(vllm_config, "parallel_config", None)
    for problem in (
        recurrent_state_problem(cfg, vllm_config, kv_cache_config),
        context_parallel_problem(par),
        dual_batch_problem(cfg, par),
        both_problem(cfg, par, kv_cache_config),
    ):
        if problem is not None:
            raise UnsupportedSetupError(f"PDConnector cannot serve this {cfg.mode} instance: {problem}")


def note_kv_transfer_fields(cfg: DisaggConfig, kv_transfer_config: Any, parallel_config: Any = None) -> list[str]:
    """Log what vLLM's ``kv_port`` and ``engine_id`` mean here (vLLM-Ascend's configs carry both); the lines.

    ``parallel_config`` (vLLM's, optional): with it the ``kv_port`` line names this engine's port range."""
    lines = []
    port = getattr(kv_transfer_config, "kv_port", VLLM_DEFAULT_KV_PORT)
    registered = (
        f"registers it with P's bootstrap server at bootstrap_host:bootstrap_port "
        f"({cfg.bootstrap_host}:{cfg.bootstrap_port}); docs/security.md lists the ports P and D hosts must reach"
    )
    if port is None or str(port) == str(VLLM_DEFAULT_KV_PORT):
        lines.append(
            f"kv_transfer_config.kv_port is vLLM's default ({VLLM_DEFAULT_KV_PORT}): each rank binds a random free "
            f"ZMQ port on kv_connector_extra_config.local_ip ({cfg.local_ip}) and {registered}"
        )
    else:
        span = ""
        tp = getattr(parallel_config, "tensor_parallel_size", None)
        pp = getattr(parallel_config, "pipeline_parallel_size", None)
        dp = cfg.dp_rank if cfg.dp_rank >= 0 else getattr(parallel_config, "data_parallel_index", None)
        if dp is None:
            dp = getattr(parallel_config, "data_parallel_rank", None)
        if isinstance(tp, int) and isinstance(pp, int) and isinstance(dp, int):
            first = int(port) + dp * tp * pp
            span = f"; data-parallel rank {dp} binds ports {first}-{first + tp * pp - 1}"
        lines.append(
            f"kv_transfer_config.kv_port {port}: each rank binds its ZMQ side channel on kv_connector_extra_config."
            f"local_ip ({cfg.local_ip}) at kv_port + dp_rank * tp_size * pp_size + pp_rank * tp_size + tp_rank, "
            f"as vLLM-Ascend's Mooncake connectors do{span} (each worker logs its port; a port in use stops "
            f"start-up), and {registered}"
        )
    engine_id = getattr(kv_transfer_config, "engine_id", None)
    if engine_id:
        lines.append(
            f"kv_transfer_config.engine_id {engine_id} only names this {cfg.mode} instance in PDConnector's start-up log: "
            "P and D find each other through P's bootstrap server and match requests by bootstrap_room"
        )
    for line in lines:
        logger.info("%s", line)
    return lines
