"""vLLM-Ascend's ``prefill`` / ``decode`` keys: the P and D deployments' DP, TP and PP sizes.

``kv_connector_extra_config`` may say ``"prefill": {"dp_size": 2, "tp_size": 8, "pp_size": 2,
"pp_layer_partition": "30,31"}`` and ``"decode": {"dp_size": 32, "tp_size": 1, "pp_size": 1}`` as
vLLM-Ascend's MooncakeConnector takes them. PDConnector learns P's topology (its pipeline stages'
layers included, ``layouts.pp``) from P's bootstrap route, so these are checks: each rank compares
its own side's sizes with what it runs as, and D compares ``prefill`` with the route it reads. A
disagreement is an error that names both values. Decode runs one pipeline stage (as in
vLLM-Ascend, whose decode asserts ``pp_size`` 1): ``decode.pp_size`` other than 1 is refused.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pd_connector.layouts.pp import PARTITION_KEY, parse_partition

SIZE_KEYS = ("dp_size", "tp_size", "pp_size")


class SizesError(ValueError):
    """A ``prefill`` / ``decode`` entry is malformed (the message names the key)."""


@dataclass(frozen=True)
class SideSizes:
    """DP, TP and PP size of one side (and P's layers per stage); None where the config does not say."""

    dp_size: int | None = None
    tp_size: int | None = None
    pp_size: int | None = None
    pp_layer_partition: tuple[int, ...] | None = None  # layers per pipeline stage (prefill only)


def parse_sizes(key: str, value: Any) -> SideSizes:
    """``{"dp_size": int, "tp_size": int, "pp_size": int, "pp_layer_partition": "2,4"}`` (all optional)
    of extra-config key ``key`` (``pp_layer_partition`` on ``prefill`` only; ``decode.pp_size`` must be 1)."""
    where = f"kv_connector_extra_config.{key}"
    if not isinstance(value, dict):
        raise SizesError(f'{where} must be an object like {{"dp_size": 1, "tp_size": 1}}, got {value!r}')
    known = [*SIZE_KEYS, PARTITION_KEY] if key == "prefill" else list(SIZE_KEYS)
    unknown = sorted(set(value) - set(known))
    if unknown:
        why = " (decode runs one pipeline stage: only prefill's layers are split)" if PARTITION_KEY in unknown else ""
        raise SizesError(f"unknown key(s) {unknown} in {where}; known keys: {known}{why}")
    sizes: dict[str, Any] = {}
    for name, raw in value.items():
        if name == PARTITION_KEY:
            try:
                sizes[name] = parse_partition(key, raw)
            except ValueError as exc:
                raise SizesError(str(exc)) from None
            continue
        try:
            if isinstance(raw, bool) or not isinstance(raw, (int, str)):
                raise ValueError
            number = int(raw)
        except ValueError:
            raise SizesError(f"{where}.{name} must be an integer, got {raw!r}") from None
        if number < 1:
            raise SizesError(f"{where}.{name} must be >= 1, got {number}")
        sizes[name] = number
    result = SideSizes(**sizes)
    if key == "decode" and result.pp_size not in (None, 1):
        raise SizesError(
            f"{where}.pp_size is {result.pp_size}: PDConnector's decode runs one pipeline stage (as vLLM-Ascend's, "
            "which asserts decode pp_size 1); run decode with --pipeline-parallel-size 1 and set decode.pp_size 1"
        )
    partition = result.pp_layer_partition
    if partition is not None and result.pp_size is not None and len(partition) != result.pp_size:
        raise SizesError(
            f"{where}.{PARTITION_KEY} names {len(partition)} stages ({','.join(map(str, partition))}) "
            f"but {where}.pp_size is {result.pp_size}"
        )
    return result


def sizes_mismatch(
    key: str,
    sizes: SideSizes | None,
    what: str,
    dp_size: int | None,
    tp_size: int | None,
    pp_size: int | None = None,
) -> str | None:
    """Why ``what`` (DP ``dp_size``, TP ``tp_size``, PP ``pp_size``; None: not known) disagrees with ``key``'s sizes."""
    if sizes is None:
        return None
    checks = (
        ("tp_size", sizes.tp_size, tp_size),
        ("dp_size", sizes.dp_size, dp_size),
        ("pp_size", sizes.pp_size, pp_size),
    )
    for name, configured, actual in checks:
        if configured is not None and actual is not None and configured != actual:
            return (
                f"kv_connector_extra_config.{key}.{name} is {configured}, but {what} has {name} {actual}; "
                f"correct kv_connector_extra_config.{key} or the deployment"
            )
    return None
