"""The comparisons `benchmarks/serving.py` prints: ratios ours/other per rate and bucket, and `acceptance`.

Pure functions over the systems' summaries (`RunStats.summary` per rate, in rate order); a
latency ratio below 1 means ours is faster. `acceptance` answers the serving criteria:

- `ttft_p50_ratio_vs_colocated_max_low_rate`: at low load, the largest (over prompt-length
  buckets) ours/colocated TTFT; passes at <= 1.3. From the interleaved low-load run when it ran
  (`source: interleaved`: each bucket's median of per-prompt ratios), else from the trace's
  lowest rate (`source: trace`: each bucket's ratio of TTFT p50s); the trace's ratios of p50s
  are reported beside it either way (`trace`);
- `tpot_p99_ours_vs_colocated_at_highest_rate`: ours/colocated TPOT p99 at the highest rate;
  passes below 1.0 (decode does not stall behind prefills);
- `ttft_p50_ratio_vs_vllm_mooncake`: ours/vLLM-MooncakeConnector TTFT at low load, paired: each
  prompt has its own ratio ours/theirs; `value` is the median of those ratios, `pass` at <= 1.0,
  `pass_every_bucket` when every bucket's median (`paired_per_bucket`) is <= 1.0 too. The pairs
  come from the interleaved low-load run when it ran (`source: interleaved`), else from the
  trace's lowest rate (`source: trace`: the same prompts in the same order in every system). The
  trace's numbers are reported beside it either way (`trace`): its paired median, and the ratio
  of the two systems' TTFT p50s (`overall`, `per_bucket`).

Why the interleaved run judges the low-load criteria (`serving_interleaved.py`: every system up
at once, each prompt to each system in turn, one request at a time): in the trace the systems
run minutes apart, with three requests per bucket, and this machine's speed drifts by about 10%
over minutes (single prefills of one prompt vary that much), so one slow request moves a bucket's
p50 by a third; the interleaved pairs see the same drift on every system.

A criterion whose numbers are missing (a system failed or was not run, an empty bucket) has
`pass: null` and a `reason`; `all_pass` is true only when every criterion passed.
"""

from __future__ import annotations

import math
import statistics
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


def _worst_bucket(values: dict[str, float | None], what: str) -> tuple[float | None, str]:
    """The largest of the buckets' ratios; None (and why, naming ``what``) when any bucket lacks one."""
    missing = [label for label, v in values.items() if v is None]
    if not values or missing:
        return None, f"no {what} for bucket(s) {missing or 'any'}"
    return max(v for v in values.values() if v is not None), ""


def ttft_pairs(
    ours_ms: list[float | None], theirs_ms: list[float | None], labels: list[str | None]
) -> list[tuple[str | None, float]]:
    """(bucket label, ours/theirs) per request answered on both sides, in request order."""
    return [
        (label, a / b)
        for label, a, b in zip(labels, ours_ms, theirs_ms, strict=False)
        if a is not None and b is not None and b > 0
    ]


def pair_medians(
    pairs: list[tuple[str | None, float]], labels: list[str]
) -> tuple[float | None, dict[str, float | None]]:
    """The median of the pairs' ratios, overall and per bucket label (None where no pair is left)."""
    per_bucket = {label: median_of([r for lab, r in pairs if lab == label]) for label in labels}
    return median_of([r for _, r in pairs]), per_bucket


def paired_ttft_ratios(mine: dict[str, Any], theirs: dict[str, Any]) -> tuple[float | None, dict[str, float | None]]:
    """Median over requests of ours/theirs TTFT for the same request, overall and per bucket label
    (requests either side failed are left out; None where no pair is left)."""
    ours_ms, their_ms = mine.get("requests_ttft_ms") or [], theirs.get("requests_ttft_ms") or []
    labels = mine.get("requests_bucket") or [None] * len(ours_ms)
    return pair_medians(ttft_pairs(ours_ms, their_ms, labels), list(mine.get("buckets") or {}))


def median_of(values: list[float]) -> float | None:
    """The median rounded to 3 places; None for no values."""
    return round(statistics.median(values), 3) if values else None


def _judge_pairs(row: dict[str, Any], median: float | None, per_bucket: dict[str, float | None]) -> None:
    """Fill ``row`` (the vLLM-Mooncake criterion) from a paired median and its per-bucket medians."""
    row.pop("bucket_reason", None)
    worst, why = _worst_bucket(per_bucket, "paired TTFT ratio")
    row.update(_criterion(median, TTFT_VS_MOONCAKE_MAX, False, "no prompt answered on both systems"))
    row.update(statistic="median of per-prompt ratios", paired_per_bucket=per_bucket, max_over_buckets=worst)
    row["pass_every_bucket"] = None if worst is None else worst <= TTFT_VS_MOONCAKE_MAX
    if worst is None:
        row["bucket_reason"] = why


def _interleaved_vs(interleaved: dict[str, Any] | None, name: str) -> dict[str, Any] | None:
    """The interleaved run's summary of ours vs ``name`` (``serving_interleaved.summarize``), or None."""
    if interleaved is None or interleaved.get("error"):
        return None
    summary = (interleaved.get("vs") or {}).get(name)
    return summary if summary and not summary.get("error") else None


def _colocated_ttft(
    low_ours: dict[str, Any], low_coloc: dict[str, Any], pairs: dict[str, Any] | None
) -> dict[str, Any]:
    """The colocated TTFT criterion: from the interleaved pairs' bucket medians, else the trace's p50s."""
    trace_buckets = {label: b["ttft_ms_p50"] for label, b in bucket_ratios(low_ours, low_coloc).items()}
    trace_value, trace_why = _worst_bucket(trace_buckets, "TTFT p50 ratio")
    trace = {"rate_rps": low_ours["rate_rps"], "max_over_buckets": trace_value, "per_bucket": trace_buckets}
    if pairs is None:
        row = _criterion(trace_value, TTFT_VS_COLOCATED_MAX, False, trace_why)
        row.update(source="trace", statistic="ratio of TTFT p50s per bucket", rate_rps=trace["rate_rps"])
        row.update(per_bucket=trace["per_bucket"], trace=trace)
        return row
    medians: dict[str, float | None] = pairs.get("ttft_ratio_per_bucket") or {}
    value, why = _worst_bucket(medians, "paired TTFT ratio")
    row = _criterion(value, TTFT_VS_COLOCATED_MAX, False, why)
    row.update(source="interleaved", statistic="median of per-prompt ratios per bucket", per_bucket=medians)
    row.update(pairs=pairs.get("pairs"), ours_faster_share=pairs.get("ours_faster_share"), trace=trace)
    return row


def acceptance(systems: dict[str, dict[str, Any]], interleaved: dict[str, Any] | None = None) -> dict[str, Any]:
    """The serving acceptance criteria from the systems' summaries and, when it ran, the interleaved
    low-load run (``serving.py``'s ``interleaved_low_load``: per other system, under ``vs``, a
    ``serving_interleaved.summarize``); see the module docstring."""
    ours, colocated, mooncake = (_runs(systems, n) for n in ("pd", "colocated", "vllm_mooncake"))
    out: dict[str, Any] = {}

    if isinstance(ours, str) or isinstance(colocated, str):
        why = ours if isinstance(ours, str) else str(colocated)
        out["ttft_p50_ratio_vs_colocated_max_low_rate"] = _criterion(None, TTFT_VS_COLOCATED_MAX, False, why)
        out["tpot_p99_ours_vs_colocated_at_highest_rate"] = _criterion(None, TPOT_P99_VS_COLOCATED_BELOW, True, why)
    else:
        colocated_pairs = _interleaved_vs(interleaved, "colocated")
        row = _colocated_ttft(ours[0], colocated[0], colocated_pairs)
        out["ttft_p50_ratio_vs_colocated_max_low_rate"] = row
        high_ours, high_coloc = ours[-1], colocated[-1]
        row = _criterion(
            ratio(high_ours["tpot_ms"]["p99"], high_coloc["tpot_ms"]["p99"]), TPOT_P99_VS_COLOCATED_BELOW, True
        )
        row.update(rate_rps=high_ours["rate_rps"], ours_ms=high_ours["tpot_ms"]["p99"])
        row["colocated_ms"] = high_coloc["tpot_ms"]["p99"]
        out["tpot_p99_ours_vs_colocated_at_highest_rate"] = row

    row = {}
    if not isinstance(ours, str) and not isinstance(mooncake, str):
        low_ours, low_mc = ours[0], mooncake[0]
        paired, paired_buckets = paired_ttft_ratios(low_ours, low_mc)
        row["trace"] = {
            "rate_rps": low_ours["rate_rps"],
            "paired_median": paired,
            "paired_per_bucket": paired_buckets,
            "overall": ratio(low_ours["ttft_ms"]["p50"], low_mc["ttft_ms"]["p50"]),
            "per_bucket": {label: b["ttft_ms_p50"] for label, b in bucket_ratios(low_ours, low_mc).items()},
        }
        row["source"] = "trace"
        _judge_pairs(row, paired, paired_buckets)
    mooncake_pairs = _interleaved_vs(interleaved, "vllm_mooncake")
    if mooncake_pairs is not None:
        row["source"] = "interleaved"
        _judge_pairs(row, mooncake_pairs.get("ttft_ratio_median"), mooncake_pairs.get("ttft_ratio_per_bucket") or {})
        row.update(pairs=mooncake_pairs.get("pairs"), ours_faster_share=mooncake_pairs.get("ours_faster_share"))
    if "source" not in row:
        why = ours if isinstance(ours, str) else str(mooncake)
        if interleaved is not None and interleaved.get("error"):
            why += f"; interleaved run failed: {str(interleaved['error'])[:200]}"
        row = _criterion(None, TTFT_VS_MOONCAKE_MAX, False, why)
        row.update(max_over_buckets=None, pass_every_bucket=None)
    out["ttft_p50_ratio_vs_vllm_mooncake"] = row

    flags = [c["pass"] for c in out.values()] + [out["ttft_p50_ratio_vs_vllm_mooncake"]["pass_every_bucket"]]
    out["all_pass"] = all(f is True for f in flags)
    return out
