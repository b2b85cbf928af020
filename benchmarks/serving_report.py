"""The comparisons `benchmarks/serving.py` prints: ratios ours/other per rate and bucket, and `acceptance`.

Pure functions over the systems' summaries (`RunStats.summary` per rate, in rate order); a
latency ratio below 1 means ours is faster. `acceptance` answers issue 11's serving criteria:

- `ttft_p50_ratio_vs_colocated_max_low_rate`: at the lowest rate, the largest (over prompt-length
  buckets) ours/colocated TTFT p50; passes at <= 1.3;
- `tpot_p99_ours_vs_colocated_at_highest_rate`: ours/colocated TPOT p99 at the highest rate;
  passes below 1.0 (decode does not stall behind prefills);
- `ttft_p50_ratio_vs_vllm_mooncake`: at the lowest rate, ours/vLLM-MooncakeConnector TTFT p50
  overall and the largest over the buckets; `pass` (overall) and `pass_every_bucket` at <= 1.0.

A criterion whose numbers are missing (a system failed or was not run, an empty bucket) has
`pass: null` and a `reason`; `all_pass` is true only when every criterion passed.
"""

from __future__ import annotations

import math
from typing import Any

RATIO_KEYS = ("throughput_rps", "goodput_rps", "throughput_output_tok_s")
LATENCY_KEYS = ("ttft_ms", "tpot_ms")
TTFT_VS_COLOCATED_MAX = 1.3
TPOT_P99_VS_COLOCATED_BELOW = 1.0
TTFT_VS_MOONCAKE_MAX = 1.0


def ratio(ours: float | None, theirs: float | None) -> float | None:
    """ours / theirs rounded to 3 places; None when either is missing, NaN, or theirs is 0."""
    if ours is None or theirs is None or theirs == 0 or math.isnan(ours) or math.isnan(theirs):
        return None
    return round(ours / theirs, 3)


def bucket_ratios(mine: dict[str, Any], theirs: dict[str, Any]) -> dict[str, dict[str, float | None]]:
    """Per bucket label of `mine`: ours / theirs TTFT and TPOT p50 and p99."""
    out = {}
    for label, bucket in (mine.get("buckets") or {}).items():
        other = (theirs.get("buckets") or {}).get(label) or {}
        out[label] = {
            f"{key}_{q}": ratio(bucket[key][q], (other.get(key) or {}).get(q))
            for key in LATENCY_KEYS
            for q in ("p50", "p99")
        }
    return out


def ratios(ours: dict[str, Any], other: dict[str, Any]) -> list[dict[str, Any]] | dict[str, str]:
    """Per rate: ours / other for the throughput keys, the p50/p99 latencies, and per bucket."""
    if "error" in other or "error" in ours:
        return {"error": "a system did not run: " + str(other.get("error") or ours.get("error"))[:300]}
    out = []
    for mine, theirs in zip(ours["runs"], other["runs"], strict=False):
        row: dict[str, Any] = {"rate_rps": mine["rate_rps"]}
        for key in RATIO_KEYS:
            row[key] = ratio(mine[key], theirs[key])
        for key in LATENCY_KEYS:
            for q in ("p50", "p99"):
                row[f"{key}_{q}"] = ratio(mine[key][q], theirs[key][q])
        row["buckets"] = bucket_ratios(mine, theirs)
        out.append(row)
    return out


def _runs(systems: dict[str, dict[str, Any]], name: str) -> list[dict[str, Any]] | str:
    """The runs of system `name` sorted by rate, or why there are none."""
    summary = systems.get(name)
    if summary is None:
        return f"{name} was not run"
    if summary.get("error"):
        return f"{name} failed: {str(summary['error'])[:200]}"
    if not summary.get("runs"):
        return f"{name} has no runs"
    return sorted(summary["runs"], key=lambda r: r["rate_rps"])


def _criterion(value: float | None, limit: float, strict: bool, reason: str = "") -> dict[str, Any]:
    passed = None if value is None else (value < limit if strict else value <= limit)
    out: dict[str, Any] = {"value": value, "threshold": f"{'<' if strict else '<='} {limit}", "pass": passed}
    if value is None:
        out["reason"] = reason or "a ratio is missing"
    return out


def _max_bucket_ttft_p50(per_bucket: dict[str, dict[str, float | None]]) -> tuple[float | None, str]:
    """The largest TTFT p50 ratio over the buckets; None (and why) when any bucket lacks one."""
    values = {label: b["ttft_ms_p50"] for label, b in per_bucket.items()}
    missing = [label for label, v in values.items() if v is None]
    if not values or missing:
        return None, f"no TTFT p50 ratio for bucket(s) {missing or 'any'}"
    return max(v for v in values.values() if v is not None), ""


def acceptance(systems: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Issue 11's serving criteria from the systems' summaries (see the module docstring)."""
    ours, colocated, mooncake = (_runs(systems, n) for n in ("pd", "colocated", "vllm_mooncake"))
    out: dict[str, Any] = {}

    if isinstance(ours, str) or isinstance(colocated, str):
        why = ours if isinstance(ours, str) else str(colocated)
        out["ttft_p50_ratio_vs_colocated_max_low_rate"] = _criterion(None, TTFT_VS_COLOCATED_MAX, False, why)
        out["tpot_p99_ours_vs_colocated_at_highest_rate"] = _criterion(None, TPOT_P99_VS_COLOCATED_BELOW, True, why)
    else:
        low_ours, low_coloc = ours[0], colocated[0]
        per_bucket = bucket_ratios(low_ours, low_coloc)
        value, why = _max_bucket_ttft_p50(per_bucket)
        row = _criterion(value, TTFT_VS_COLOCATED_MAX, False, why)
        row["rate_rps"] = low_ours["rate_rps"]
        row["per_bucket"] = {label: b["ttft_ms_p50"] for label, b in per_bucket.items()}
        out["ttft_p50_ratio_vs_colocated_max_low_rate"] = row
        high_ours, high_coloc = ours[-1], colocated[-1]
        row = _criterion(
            ratio(high_ours["tpot_ms"]["p99"], high_coloc["tpot_ms"]["p99"]), TPOT_P99_VS_COLOCATED_BELOW, True
        )
        row.update(rate_rps=high_ours["rate_rps"], ours_ms=high_ours["tpot_ms"]["p99"])
        row["colocated_ms"] = high_coloc["tpot_ms"]["p99"]
        out["tpot_p99_ours_vs_colocated_at_highest_rate"] = row

    if isinstance(ours, str) or isinstance(mooncake, str):
        why = ours if isinstance(ours, str) else str(mooncake)
        row = _criterion(None, TTFT_VS_MOONCAKE_MAX, False, why)
        row.update(overall=None, max_over_buckets=None, pass_every_bucket=None)
    else:
        low_ours, low_mc = ours[0], mooncake[0]
        overall = ratio(low_ours["ttft_ms"]["p50"], low_mc["ttft_ms"]["p50"])
        per_bucket = bucket_ratios(low_ours, low_mc)
        worst, why = _max_bucket_ttft_p50(per_bucket)
        row = _criterion(overall, TTFT_VS_MOONCAKE_MAX, False)
        row.update(rate_rps=low_ours["rate_rps"], overall=overall, max_over_buckets=worst)
        row["pass_every_bucket"] = None if worst is None else worst <= TTFT_VS_MOONCAKE_MAX
        row["per_bucket"] = {label: b["ttft_ms_p50"] for label, b in per_bucket.items()}
        if worst is None:
            row["bucket_reason"] = why
    out["ttft_p50_ratio_vs_vllm_mooncake"] = row

    flags = [c["pass"] for c in out.values()] + [out["ttft_p50_ratio_vs_vllm_mooncake"]["pass_every_bucket"]]
    out["all_pass"] = all(f is True for f in flags)
    return out
