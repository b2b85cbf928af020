"""DP mode of the external-DP launcher: `vllm` (vLLM's --data-parallel-* flags) or `independent`.

vLLM refuses external DP for dense models, so `auto` reads a local model's config.json:
dense -> `independent`, MoE (or unknown) -> `vllm`. In `independent` mode each rank's
PDConnector `--kv-transfer-config` is rewritten to carry the rank's DP place (`dp_rank`,
`dp_size`, `bootstrap_host`).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Mapping, Sequence
from pathlib import Path

from launch.dp_checks import UsageError

DP_MODES = ("auto", "vllm", "independent")
#: config.json keys (top level or in "text_config") whose positive integer value marks an MoE model.
MOE_CONFIG_KEYS = ("num_local_experts", "n_routed_experts", "num_experts", "moe_num_experts", "num_experts_per_tok")
KV_TRANSFER_FLAG = "--kv-transfer-config"
PD_CONNECTOR = "PDConnector"
#: kv_connector_extra_config keys the launcher sets per rank with --dp-mode independent.
INJECTED_DP_KEYS = ("dp_rank", "dp_size")


def _moe_markers(config: Mapping[str, object]) -> list[str]:
    """The MoE keys of a model's config.json (top level and "text_config") with a positive integer value."""
    found = []
    for prefix, scope in (("", config), ("text_config.", config.get("text_config"))):
        if not isinstance(scope, Mapping):
            continue
        for key in MOE_CONFIG_KEYS:
            value = scope.get(key)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                found.append(f"{prefix}{key}={value}")
    return found


def detect_dp_mode(model: str | None) -> tuple[str, str]:
    """("independent", why) for a local model directory whose config.json shows a dense model, else ("vllm", why)."""
    if not model:
        return "vllm", "no --model to inspect"
    config_path = Path(model).expanduser() / "config.json"
    try:
        if not config_path.is_file():
            return "vllm", f"no local {config_path} (a hub name?), so dense vs MoE is unknown"
        config = json.loads(config_path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        return "vllm", f"cannot read {config_path}: {exc}"
    if not isinstance(config, dict):
        return "vllm", f"{config_path} is not a JSON object"
    markers = _moe_markers(config)
    if markers:
        return "vllm", f"{config_path} shows an MoE model: {', '.join(markers)}"
    return "independent", f"{config_path} shows a dense model (no expert count), which vLLM refuses in external DP"


def resolve_dp_mode(args: argparse.Namespace) -> tuple[str, str]:
    """The DP mode the ranks run in ("vllm" or "independent") and why."""
    if args.dp_mode != "auto":
        return args.dp_mode, f"--dp-mode {args.dp_mode}"
    mode, why = detect_dp_mode(args.model)
    return mode, f"auto: {why}"


def _flag_name(arg: str) -> str:
    """`--kv_transfer_config=...` -> `--kv_transfer_config` -> `--kv-transfer-config` (vLLM reads `_` as `-`)."""
    name = arg.split("=", 1)[0]
    if not name.startswith("--"):
        return name
    head, dot, tail = name[2:].partition(".")
    return "--" + head.replace("_", "-") + dot + tail


def _with_dp_place(value: str, dp_rank: int, dp_size: int, bootstrap_host: str) -> str | None:
    """The JSON of --kv-transfer-config with this rank's dp_rank, dp_size (and bootstrap_host) in its extra config.

    None when the config names another connector than PDConnector (its extra config is left alone).
    """
    what = f"{KV_TRANSFER_FLAG} (rewritten per rank with --dp-mode independent)"
    try:
        config = json.loads(value)
    except ValueError as exc:
        raise UsageError(f"{what} must be a JSON object, got {value!r}: {exc}") from None
    if not isinstance(config, dict):
        raise UsageError(f"{what} must be a JSON object, got {value!r}")
    if config.get("kv_connector", PD_CONNECTOR) != PD_CONNECTOR:
        return None
    extra_config = config.get("kv_connector_extra_config")
    if extra_config is None:
        extra_config = config["kv_connector_extra_config"] = {}
    if not isinstance(extra_config, dict):
        raise UsageError(f"{what}: kv_connector_extra_config must be a JSON object, got {extra_config!r}")
    for key in INJECTED_DP_KEYS:
        if key in extra_config:
            raise UsageError(
                f"{KV_TRANSFER_FLAG}: kv_connector_extra_config.{key} is set per rank by the launcher with "
                "--dp-mode independent (from --dp-rank-start and --dp-size); remove it"
            )
    extra_config["dp_rank"] = dp_rank
    extra_config["dp_size"] = dp_size
    extra_config.setdefault("bootstrap_host", bootstrap_host)
    return json.dumps(config, separators=(",", ":"))


def rewrite_kv_transfer_config(
    extra: Sequence[str], *, dp_rank: int, dp_size: int, bootstrap_host: str
) -> tuple[list[str], bool]:
    """Give every `--kv-transfer-config JSON` / `--kv-transfer-config=JSON` in `extra` this rank's DP place.

    Returns the rewritten arguments and whether a PDConnector --kv-transfer-config was rewritten.
    """
    out: list[str] = []
    found = False
    i = 0
    while i < len(extra):
        arg = extra[i]
        name = _flag_name(arg)
        if name.startswith(KV_TRANSFER_FLAG + "."):
            raise UsageError(
                f"{arg.split('=', 1)[0]}: with --dp-mode independent pass {KV_TRANSFER_FLAG} as one JSON object "
                "(the launcher rewrites it per rank), not in dotted form"
            )
        if name == KV_TRANSFER_FLAG:
            if "=" in arg:
                flag, value = arg.split("=", 1)
            elif i + 1 < len(extra):
                flag, value = arg, extra[i + 1]
                i += 1
            else:
                raise UsageError(f"{arg} needs a value (a JSON object)")
            rewritten = _with_dp_place(value, dp_rank, dp_size, bootstrap_host)
            found = found or rewritten is not None
            value = value if rewritten is None else rewritten
            out += [f"{flag}={value}"] if "=" in arg else [flag, value]
        else:
            out.append(arg)
        i += 1
    return out, found
