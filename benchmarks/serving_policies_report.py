"""Judging and aggregation of the path-policy phase (`serving_policies.py`): pure functions, no servers.

A *round* maps each variant (a Router `--path-policy`, or `colocated`) to what it measured:
``{"closed": {"<length>x<concurrency>": point}, "traces": {name: run}}``, where a closed-loop
point and a trace run both hold ``ttft_ms`` and ``tpot_ms`` (``p50``, ``p99``), a run also
``goodput_rps``, and both the Router's ``paths`` (``pd_router_path_total`` counted during that
workload, ``{"<path>/<reason>": n}``; absent for `colocated`, which has no Router). A variant that
failed has ``error`` instead.

`acceptance` judges:

- closed loop, at every (length, concurrency): adaptive TTFT p50 / colocated TTFT p50 <=
  `CLOSED_TTFT_LIMIT` and adaptive TPOT p99 / always-pd TPOT p99 <= `CLOSED_TPOT_LIMIT`; each
  ratio is taken within a round (both ran minutes apart on the same machine) and the median over
  rounds is judged;
- traces: adaptive goodput (mean over rounds) >= the best of the static policies' (always-pd,
  always-local, threshold, non-cached) on every trace, and >= `TRACE_GAIN` x the best on at
  least one; both at ``--slo-ttft-ms`` and at every TTFT SLO of ``SWEEP_TTFT_SLOS_MS``. Goodput is
  the requests meeting both SLOs per second of the trace's offered span (requests / rate:
  ``serving_trace.RunStats.offered_s``), i.e. the offered rate times the share that met them.

A criterion whose numbers are missing (a variant failed or was not run) has ``pass: null``;
``all_pass`` is true only when every criterion passed.
"""

from __future__ import annotations

import math
import re
import statistics
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from benchmarks.serving_report import ratio

ADAPTIVE = "adaptive"
ALWAYS_PD = "always-pd"
COLOCATED = "colocated"
STATIC_POLICIES = ("always-pd", "always-local", "threshold", "non-cached")
POLICIES = (ADAPTIVE, *STATIC_POLICIES)
CLOSED_TTFT_LIMIT = 1.15
CLOSED_TPOT_LIMIT = 1.25
TRACE_GAIN = 1.10
PATH_METRIC = "pd_router_path_total"

_SAMPLE = re.compile(r"^(?P<name>[A-Za-z_:][A-Za-z0-9_:]*)(?:\{(?P<labels>[^}]*)\})?\s+(?P<value>\S+)")
_LABEL = re.compile(r'(?P<key>[A-Za-z_][A-Za-z0-9_]*)="(?P<value>(?:[^"\\]|\\.)*)"')

Round = Mapping[str, Mapping[str, Any]]


def path_counts(metrics_text: str, metric: str = PATH_METRIC) -> dict[str, float]:
    """``{"<path>/<reason>": value}`` of `metric`'s samples in a Prometheus text exposition."""
    out: dict[str, float] = {}
    for line in metrics_text.splitlines():
        match = _SAMPLE.match(line.strip())
        if match is None or match["name"] != metric:
            continue
        labels = {m["key"]: m["value"] for m in _LABEL.finditer(match["labels"] or "")}
        key = f"{labels.get('path', '')}/{labels.get('reason', '')}"
        try:
            out[key] = out.get(key, 0.0) + float(match["value"])
        except ValueError:
            continue
    return out


def counts_delta(before: Mapping[str, float], after: Mapping[str, float]) -> dict[str, int]:
    """What each counter gained between two `path_counts` scrapes (keys that did not move left out)."""
    out = {}
    for key, value in after.items():
        gained = int(round(value - before.get(key, 0.0)))
        if gained:
            out[key] = gained
    return dict(sorted(out.items()))


def by_path(counts: Mapping[str, int]) -> dict[str, int]:
    """``{"<path>/<reason>": n}`` summed per path."""
    out: dict[str, int] = {}
    for key, n in counts.items():
        path = key.split("/", 1)[0]
        out[path] = out.get(path, 0) + n
    return dict(sorted(out.items()))


def sum_counts(many: Iterable[Mapping[str, int] | None]) -> dict[str, int]:
    """The counts added key by key (None entries skipped)."""
    out: dict[str, int] = {}
    for counts in many:
        for key, n in (counts or {}).items():
            out[key] = out.get(key, 0) + n
    return dict(sorted(out.items()))


def _median(values: Iterable[float | None], places: int = 3) -> float | None:
    kept = [v for v in values if v is not None]
    return round(statistics.median(kept), places) if kept else None


def _mean(values: Iterable[float | None], places: int = 3) -> float | None:
    kept = [v for v in values if v is not None]
    return round(statistics.fmean(kept), places) if kept else None


def _workload(rnd: Round, variant: str, kind: str, key: str) -> Mapping[str, Any]:
    """One round's entry for (variant, "closed"/"traces", point or trace name); {} when missing."""
    entry = rnd.get(variant) or {}
    if entry.get("error"):
        return {}
    return (entry.get(kind) or {}).get(key) or {}


def _value(entry: Mapping[str, Any], metric: str, q: str) -> float | None:
    return (entry.get(metric) or {}).get(q)


def _keys(rounds: Sequence[Round], kind: str) -> list[str]:
    """Every point or trace name any variant of any round measured, in first-seen order."""
    seen: dict[str, None] = {}
    for rnd in rounds:
        for entry in rnd.values():
            for key in (entry.get(kind) or {}) if not entry.get("error") else ():
                seen.setdefault(key, None)
    return list(seen)


def paired_ratio(
    rounds: Sequence[Round], kind: str, key: str, ours: str, theirs: str, metric: str, q: str
) -> dict[str, Any]:
    """ours / theirs of `metric` `q` within each round, and their median."""
    per_round = [
        ratio(_value(_workload(r, ours, kind, key), metric, q), _value(_workload(r, theirs, kind, key), metric, q))
        for r in rounds
    ]
    return {"rounds": per_round, "ratio": _median(per_round)}


def _limit_check(rows: dict[str, dict[str, Any]], limit: float, at_most: bool) -> dict[str, Any]:
    """Pass flags per row (ratio <= limit, or >= with `at_most` False) and the worst row."""
    for row in rows.values():
        value = row["ratio"]
        row["pass"] = None if value is None else (value <= limit if at_most else value >= limit)
    values = [row["ratio"] for row in rows.values() if row["ratio"] is not None]
    worst = (max if at_most else min)(values, default=None)
    flags = [row["pass"] for row in rows.values()]
    passed = None if not flags or None in flags else all(flags)
    return {"threshold": f"{'<=' if at_most else '>='} {limit}", "worst": worst, "points": rows, "pass": passed}


def judge_closed(rounds: Sequence[Round]) -> dict[str, dict[str, Any]]:
    """The two closed-loop criteria (module docstring), per (length, concurrency)."""
    points = _keys(rounds, "closed")
    ttft = {p: paired_ratio(rounds, "closed", p, ADAPTIVE, COLOCATED, "ttft_ms", "p50") for p in points}
    tpot = {p: paired_ratio(rounds, "closed", p, ADAPTIVE, ALWAYS_PD, "tpot_ms", "p99") for p in points}
    return {
        "closed_loop_ttft_p50_adaptive_vs_colocated": _limit_check(ttft, CLOSED_TTFT_LIMIT, True),
        "closed_loop_tpot_p99_adaptive_vs_always_pd": _limit_check(tpot, CLOSED_TPOT_LIMIT, True),
    }


def mean_goodput(rounds: Sequence[Round], variant: str, trace: str) -> float | None:
    """`variant`'s goodput on `trace`, the mean over the rounds it ran in."""
    return _mean(_workload(r, variant, "traces", trace).get("goodput_rps") for r in rounds)


def judge_traces(rounds: Sequence[Round], static: Sequence[str] = STATIC_POLICIES) -> dict[str, dict[str, Any]]:
    """The two trace criteria (module docstring): per trace adaptive / the best static policy's goodput.

    ``slo_attained`` (the share of requests meeting both SLOs, mean over rounds) is given beside
    it. When every static policy's goodput is 0 the ratio is undefined (None): adaptive then passes
    both criteria on that trace if its own goodput is above 0, and only the first if it is 0 too.
    """
    rows: dict[str, dict[str, Any]] = {}
    for trace in _keys(rounds, "traces"):
        goodput = {name: mean_goodput(rounds, name, trace) for name in (ADAPTIVE, *static)}
        missing = [name for name, g in goodput.items() if g is None]
        measured = {name: g for name, g in goodput.items() if name != ADAPTIVE and g is not None}
        best = max(measured, key=lambda name: measured[name]) if measured else None
        attained = {
            name: _mean(_workload(r, name, "traces", trace).get("slo_attained") for r in rounds) for name in goodput
        }
        row: dict[str, Any] = {"goodput_rps": goodput, "slo_attained": attained, "best_static": best, "ratio": None}
        if missing or best is None:
            row.update(pass_=None, gain=None, reason=f"no goodput for {missing}")
        elif measured[best] == 0:
            row.update(pass_=True, gain=goodput[ADAPTIVE] > 0, reason="no static policy met the SLOs")
        else:
            row["ratio"] = ratio(goodput[ADAPTIVE], measured[best])
            row.update(pass_=row["ratio"] >= 1.0, gain=row["ratio"] >= TRACE_GAIN)
        row["pass"] = row.pop("pass_")
        rows[trace] = row
    # The swept TTFT SLOs are judged too (every one, so no SLO is picked after the fact).
    swept = {
        f"{trace} @ {slo} ms": row["adaptive_vs_best_static"]
        for trace, per_slo in judge_sweep(rounds, static).items()
        for slo, row in per_slo.items()
        if row["adaptive_vs_best_static"] is not None
    }
    flags = [row["pass"] for row in rows.values()] + [value >= 1.0 for value in swept.values()]
    gains = [row.pop("gain") for row in rows.values()] + [value >= TRACE_GAIN for value in swept.values()]
    values = [row["ratio"] for row in rows.values() if row["ratio"] is not None] + list(swept.values())
    at_least = {
        "threshold": ">= 1.0 on every trace, at --slo-ttft-ms and at every swept TTFT SLO",
        "worst": min(values, default=None),
        "traces": rows,
        "swept": swept,
        "pass": None if not flags or None in flags else all(flags),
    }
    gain = {
        "threshold": f">= {TRACE_GAIN} on at least one trace (at --slo-ttft-ms or a swept TTFT SLO)",
        "best": max(values, default=None),
        "where": [name for name, value in swept.items() if value >= TRACE_GAIN],
        "pass": True if True in gains else (None if not gains or None in gains else False),
    }
    return {"trace_goodput_adaptive_vs_best_static": at_least, "trace_goodput_gain_somewhere": gain}


def acceptance(rounds: Sequence[Round]) -> dict[str, Any]:
    """Every criterion of the module docstring, and ``all_pass``."""
    out: dict[str, Any] = {**judge_closed(rounds), **judge_traces(rounds)}
    out["all_pass"] = all(c.get("pass") is True for c in out.values())
    return out


def summarize(rounds: Sequence[Round]) -> dict[str, dict[str, dict[str, Any]]]:
    """Per variant and workload ("closed <point>" or the trace's name): the median over rounds of
    TTFT and TPOT p50/p99, the mean goodput (traces), failures, and the Router's path counts summed."""
    variants: dict[str, None] = {}
    for rnd in rounds:
        for name in rnd:
            variants.setdefault(name, None)
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for variant in variants:
        rows: dict[str, dict[str, Any]] = {}
        for kind, label in (("closed", "closed {}"), ("traces", "{}")):
            for key in _keys(rounds, kind):
                entries = [_workload(r, variant, kind, key) for r in rounds]
                entries = [e for e in entries if e]
                if not entries:
                    continue
                row: dict[str, Any] = {
                    f"{metric}_{q}": _median((_value(e, metric, q) for e in entries), 1)
                    for metric in ("ttft_ms", "tpot_ms")
                    for q in ("p50", "p99")
                }
                if kind == "traces":
                    row["goodput_rps"] = _mean(e.get("goodput_rps") for e in entries)
                row["failed"] = sum(int(e.get("failed") or 0) for e in entries)
                if any("paths" in e for e in entries):
                    row["paths"] = sum_counts(e.get("paths") for e in entries)
                    row["by_path"] = by_path(row["paths"])
                rows[label.format(key)] = row
        errors = [str((r.get(variant) or {}).get("error"))[:300] for r in rounds if (r.get(variant) or {}).get("error")]
        if errors:
            rows["errors"] = {"rounds": errors}
        out[variant] = rows
    return out


def path_totals(rounds: Sequence[Round]) -> dict[str, dict[str, int]]:
    """Per variant with a Router: requests per path over every workload of every round."""
    out: dict[str, dict[str, int]] = {}
    for rnd in rounds:
        for variant, entry in rnd.items():
            for kind in ("closed", "traces"):
                for workload in (entry.get(kind) or {}).values():
                    if "paths" in workload:
                        out[variant] = sum_counts([out.get(variant), by_path(workload["paths"])])
    return out


#: TTFT SLOs (ms) each trace's goodput is also scored at (the TPOT SLO as configured): the judged
#: SLO (--slo-ttft-ms) is one point of a curve, shown whole so no single SLO is picked after the fact.
SWEEP_TTFT_SLOS_MS = (250, 500, 1000, 2000, 3000)


def goodput_sweep(results: Sequence[Any], duration_s: float, slo_tpot_ms: float) -> dict[str, float]:
    """Requests per second (of ``duration_s``: the run's offered span) meeting TTFT <= each of
    ``SWEEP_TTFT_SLOS_MS`` and TPOT <= ``slo_tpot_ms``."""
    ok = [r for r in results if not r.error]
    out: dict[str, float] = {}
    for slo in SWEEP_TTFT_SLOS_MS:
        good = sum(1 for r in ok if r.ttft_s * 1e3 <= slo and (math.isnan(r.tpot_s) or r.tpot_s * 1e3 <= slo_tpot_ms))
        out[str(slo)] = round(good / duration_s, 3) if duration_s > 0 else 0.0
    return out


def judge_sweep(rounds: Sequence[Round], static: Sequence[str] = STATIC_POLICIES) -> dict[str, dict[str, Any]]:
    """Per trace and swept TTFT SLO: mean goodput per variant over rounds and adaptive / best static."""
    out: dict[str, dict[str, Any]] = {}
    for trace in _keys(rounds, "traces"):
        per_slo: dict[str, Any] = {}
        for slo in map(str, SWEEP_TTFT_SLOS_MS):
            goodput = {
                name: _mean(
                    (_workload(r, name, "traces", trace).get("goodput_by_ttft_slo_ms") or {}).get(slo) for r in rounds
                )
                for name in (ADAPTIVE, *static, COLOCATED)
            }
            statics = {n: g for n, g in goodput.items() if n in static and g is not None}
            best = max(statics, key=lambda n: statics[n]) if statics else None
            adaptive = goodput.get(ADAPTIVE)
            gain = ratio(adaptive, statics[best]) if best and adaptive is not None and statics[best] else None
            per_slo[slo] = {"goodput_rps": goodput, "best_static": best, "adaptive_vs_best_static": gain}
        out[trace] = per_slo
    return out
