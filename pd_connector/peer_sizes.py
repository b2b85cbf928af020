"""vLLM-Ascend's ``prefill`` / ``decode`` keys: the P and D deployments' DP and TP sizes.

``kv_connector_extra_config`` may say ``"prefill": {"dp_size": 2, "tp_size": 8}`` and
``"decode": {"dp_size": 32, "tp_size": 1}`` as vLLM-Ascend's MooncakeConnector takes them.
PDConnector learns P's topology from P's bootstrap route, so these are checks: each rank
compares its own side's sizes with what it runs as, and D compares ``prefill`` with the route
it reads. A disagreement is an error that names both values.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

SIZE_KEYS = ("dp_size", "tp_size")


class SizesError(ValueError):
    """A ``prefill`` / ``decode`` entry is malformed (the message names the key)."""


@dataclass(frozen=True)
class SideSizes:
    """DP and TP size of one side; None where the config does not say."""

    dp_size: int | None = None
    tp_size: int | None = None


def parse_sizes(key: str, value: Any) -> SideSizes:
    """``{"dp_size": int, "tp_size": int}`` (both optional) of extra-config key ``key``."""
    where = f"kv_connector_extra_config.{key}"
    if not isinstance(value, dict):
        raise SizesError(f'{where} must be an object like {{"dp_size": 1, "tp_size": 1}}, got {value!r}')
    unknown = sorted(set(value) - set(SIZE_KEYS))
    if unknown:
        raise SizesError(f"unknown key(s) {unknown} in {where}; known keys: {list(SIZE_KEYS)}")
    sizes: dict[str, int] = {}
    for name, raw in value.items():
        try:
            if isinstance(raw, bool) or not isinstance(raw, (int, str)):
                raise ValueError
            number = int(raw)
        except ValueError:
            raise SizesError(f"{where}.{name} must be an integer, got {raw!r}") from None
        if number < 1:
            raise SizesError(f"{where}.{name} must be >= 1, got {number}")
        sizes[name] = number
    return SideSizes(**sizes)


def sizes_mismatch(
    key: str, sizes: SideSizes | None, what: str, dp_size: int | None, tp_size: int | None
) -> str | None:
    """Why ``what`` (DP ``dp_size``, TP ``tp_size``; None: not known) disagrees with ``key``'s sizes."""
    if sizes is None:
        return None
    for name, configured, actual in (("tp_size", sizes.tp_size, tp_size), ("dp_size", sizes.dp_size, dp_size)):
        if configured is not None and actual is not None and configured != actual:
            return (
                f"kv_connector_extra_config.{key}.{name} is {configured}, but {what} has {name} {actual}; "
                f"correct kv_connector_extra_config.{key} or the deployment"
            )
    return None
