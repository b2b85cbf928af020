"""PDConnector's stats in vLLM's own KV-connector stats path: its periodic log line and ``/metrics``.

vLLM moves connector stats like this (0.23 and 0.32 alike):

1. every engine step each worker's ``PDConnector.get_kv_connector_stats()`` returns a
   ``PDKVConnectorStats`` with what happened since the previous step (or None);
2. the executor's ``KVOutputAggregator`` folds the workers' objects with ``aggregate``;
3. the scheduler sends ``to_dict()`` to the frontend (API server process);
4. there ``PDConnector.build_kv_connector_stats(data)`` rebuilds the object, which the log
   line folds over its interval (``aggregate``) and prints (``is_empty``, ``reduce``), and
   ``PDPromMetrics.observe(data, engine_idx)`` (built once by ``build_prom_metrics``) records
   it into Prometheus metrics labelled with vLLM's ``model_name`` and ``engine``.

The data dict is ``transfer.stats.empty_interval()``'s shape: plain lists, ints and dicts, so
it pickles and msgpacks as vLLM needs.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

from pd_connector.accounting import RECOMPUTE_REASONS, RECOMPUTES_KEY, SOURCES, TOKENS_KEY
from pd_connector.bypass import BYPASS_KEY, BYPASS_REASONS
from pd_connector.transfer.stats import COUNTS, FAILURE_REASONS, GAUGES, SERIES, empty_interval

#: Prometheus metric names (counters are exposed with a ``_total`` suffix).
METRIC_NAMES = {
    "bytes_sent": "vllm:pd_kv_sent_bytes",
    "bytes_received": "vllm:pd_kv_received_bytes",
    "transfer_seconds": "vllm:pd_kv_transfer_duration_seconds",
    "throughput": "vllm:pd_kv_transfer_throughput_bytes_per_second",
    "transfer_entries": "vllm:pd_kv_transfer_entries",
    "handshake_seconds": "vllm:pd_kv_handshake_duration_seconds",
    "rooms_held": "vllm:pd_kv_rooms_held",
    "loads_waiting": "vllm:pd_kv_loads_waiting",
    "failures": "vllm:pd_kv_transfer_failures",
    "rooms_expired": "vllm:pd_kv_rooms_expired",
    "auth_refused": "vllm:pd_kv_auth_refused",
    "bad_frames": "vllm:pd_kv_bad_frames",
    "transfers_ok": "vllm:pd_kv_pushes",
    "recvs_ok": "vllm:pd_kv_loads",
    "host_hit_blocks": "vllm:pd_kv_host_hit_blocks",
    "host_loads": "vllm:pd_kv_host_loads",
    "host_load_bytes": "vllm:pd_kv_host_load_bytes",
    "host_load_seconds": "vllm:pd_kv_host_load_duration_seconds",
}

#: Requests a P or D instance served without a KV transfer, by reason (pd_connector.bypass);
#: counted by the scheduler side, so not a ``vllm:pd_kv_`` transfer metric.
BYPASS_METRIC = "vllm:pd_requests_without_transfer"
#: D's per-request KV accounting (pd_connector.accounting), counted by the scheduler side: prompt tokens
#: by where their KV came from, and requests that recomputed prompt tokens, by reason.
TOKENS_METRIC = "vllm:pd_kv_tokens"
RECOMPUTE_METRIC = "vllm:pd_kv_recompute"
#: Interval keys the scheduler side adds to the workers' (their {label: count} dicts are summed).
_SCHEDULER_KEYS = (BYPASS_KEY, TOKENS_KEY, RECOMPUTES_KEY)

_SECONDS_BUCKETS = [0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0]
_THROUGHPUT_BUCKETS = [10.0**e for e in (6, 6.5, 7, 7.5, 8, 8.5, 9, 9.5, 10, 10.5, 11)]
_ENTRIES_BUCKETS = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 16384]


@dataclass
class PDKVConnectorStats(KVConnectorStats):
    """What PDConnector's workers saw during an interval; ``data`` is ``empty_interval()``-shaped."""

    def __post_init__(self) -> None:
        full = empty_interval()
        for key, value in (self.data or {}).items():
            full[key] = value
        for key in _SCHEDULER_KEYS:
            full[key] = dict(full.get(key) or {})
        self.data = full

    def reset(self) -> None:
        """Called by whoever keeps this object as an accumulator: forget everything."""
        self.data = {**empty_interval(), **{key: {} for key in _SCHEDULER_KEYS}}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        """Fold ``other`` in (another worker's step, or a later step): sum counts, join series.

        Gauges are per rank: a later sample of a rank replaces its earlier one.
        """
        if other is self or other.is_empty():
            return self
        mine, theirs = self.data, other.data
        for key in SERIES:
            mine[key].extend(theirs.get(key, ()))
        for key in COUNTS:
            mine[key] += theirs.get(key, 0)
        for reason, n in theirs.get("failures", {}).items():
            mine["failures"][reason] = mine["failures"].get(reason, 0) + n
        for name, per_rank in theirs.get("gauges", {}).items():
            mine["gauges"].setdefault(name, {}).update(per_rank)
        for key in _SCHEDULER_KEYS:
            for label, n in (theirs.get(key) or {}).items():
                counts = mine.setdefault(key, {})
                counts[label] = counts.get(label, 0) + n
        return self

    def is_empty(self) -> bool:
        """True when no transfer, load, failure or gauge change is in it."""
        d = self.data
        return (
            not any(d[key] for key in SERIES)
            and not any(d[key] for key in COUNTS)
            and not any(d["failures"].values())
            and not any(d["gauges"].values())
            and not any(any((d.get(key) or {}).values()) for key in _SCHEDULER_KEYS)
        )

    def reduce(self) -> dict[str, int | float]:
        """The interval in a few numbers, for vLLM's "KV Transfer metrics: ..." log line."""
        d = self.data
        seconds, nbytes = d["transfer_seconds"], d["transfer_bytes"]
        out: dict[str, int | float] = {
            "pushes": d["transfers_ok"],
            "loads": d["recvs_ok"],
            "MB sent": round(d["bytes_sent"] / 2**20, 3),
            "MB received": round(d["bytes_received"] / 2**20, 3),
        }
        if seconds:
            out["avg push ms"] = round(statistics.fmean(seconds) * 1e3, 3)
            out["push MB/s"] = round(sum(nbytes) / 2**20 / max(sum(seconds), 1e-9), 1)
            out["avg entries"] = round(statistics.fmean(d["transfer_entries"]), 1)
        if d["handshake_seconds"]:
            out["avg handshake ms"] = round(statistics.fmean(d["handshake_seconds"]) * 1e3, 3)
        for name in GAUGES:
            per_rank = d["gauges"].get(name) or {}
            if per_rank:
                out[name.replace("_", " ")] = max(per_rank.values())
        out["failures"] = sum(d["failures"].values())
        out["rooms expired"] = d["rooms_expired"]
        if any((d.get(BYPASS_KEY) or {}).values()):
            out["served without transfer"] = sum(d[BYPASS_KEY].values())
        if any((d.get(RECOMPUTES_KEY) or {}).values()):
            out["requests recomputing prompt KV"] = sum(d[RECOMPUTES_KEY].values())
        return out


def _per_engine(metric: Any, per_engine_labelvalues: dict[int, list[object]], *extra: str) -> dict[int, Any]:
    return {idx: metric.labels(*values, *extra) for idx, values in per_engine_labelvalues.items()}


class PDPromMetrics(KVConnectorPromMetrics):
    """PDConnector's Prometheus metrics; ``observe`` gets one aggregated interval dict per call."""

    def __init__(self, *args: Any) -> None:
        """Takes ``build_prom_metrics``'s arguments: vllm_config, metric_types, labelnames, per-engine labels."""
        super().__init__(*args)
        engines, labelnames = self.per_engine_labelvalues, self._labelnames

        def counter(key: str, doc: str) -> dict[int, Any]:
            return _per_engine(
                self._counter_cls(name=METRIC_NAMES[key], documentation=doc, labelnames=labelnames), engines
            )

        def histogram(key: str, doc: str, buckets: list[float]) -> dict[int, Any]:
            metric = self._histogram_cls(
                name=METRIC_NAMES[key], documentation=doc, buckets=buckets, labelnames=labelnames
            )
            return _per_engine(metric, engines)

        def gauge(key: str, doc: str) -> dict[int, Any]:
            return _per_engine(
                self._gauge_cls(name=METRIC_NAMES[key], documentation=doc, labelnames=labelnames), engines
            )

        self.counters = {
            "bytes_sent": counter("bytes_sent", "KV bytes this instance pushed (P, or a migrating decoder)."),
            "bytes_received": counter("bytes_received", "KV bytes this decode instance received (its blocks filled)."),
            "transfers_ok": counter("transfers_ok", "Successful KV pushes of this instance (one per D rank)."),
            "recvs_ok": counter("recvs_ok", "Completed KV loads of this decode instance."),
            "rooms_expired": counter("rooms_expired", "Rooms freed on prefill because no decode asked in time."),
            "auth_refused": counter("auth_refused", "ZMQ frames refused: missing or wrong control-plane token."),
            "bad_frames": counter("bad_frames", "ZMQ frames dropped: not a PDConnector message (no failure)."),
            "host_hit_blocks": counter("host_hit_blocks", "D2RH: blocks loaded from D's host pool, P not asked."),
            "host_loads": counter("host_loads", "D2RH: host -> device copies of this decode instance."),
            "host_load_bytes": counter("host_load_bytes", "D2RH: bytes copied from D's host pool to its device."),
        }
        self.histograms = {
            "transfer_seconds": histogram("transfer_seconds", "Duration of one KV push.", _SECONDS_BUCKETS),
            "transfer_entries": histogram("transfer_entries", "Write entries per KV push.", _ENTRIES_BUCKETS),
            "handshake_seconds": histogram(
                "handshake_seconds", "Decode: from load start to the request sent to every P rank.", _SECONDS_BUCKETS
            ),
            "host_load_seconds": histogram(
                "host_load_seconds", "D2RH: one host -> device copy, queued to done.", _SECONDS_BUCKETS
            ),
        }
        self.throughput = histogram("throughput", "Throughput of one KV push (bytes/s).", _THROUGHPUT_BUCKETS)
        self.gauges = {
            "rooms_held": gauge("rooms_held", "Rooms whose KV this instance holds (P, or a migrating decoder)."),
            "loads_waiting": gauge("loads_waiting", "KV loads this decode instance is waiting for."),
        }
        failures = self._counter_cls(
            name=METRIC_NAMES["failures"],
            documentation="Failed KV transfers and loads, by reason.",
            labelnames=[*labelnames, "reason"],
        )
        self.failures = {
            reason: _per_engine(failures, engines, reason) for reason in FAILURE_REASONS
        }  # every reason exists (at 0) from the start
        bypassed = self._counter_cls(
            name=BYPASS_METRIC,
            documentation="Requests this P or D instance served without a KV transfer, by reason (PD not used).",
            labelnames=[*labelnames, "reason"],
        )
        self.bypassed = {reason: _per_engine(bypassed, engines, reason) for reason in BYPASS_REASONS}
        tokens = self._counter_cls(
            name=TOKENS_METRIC,
            documentation="Decode: prompt tokens of finished requests by where their KV came from "
            "(pushed by prefill, prefix_hit in this instance's cache, recomputed here).",
            labelnames=[*labelnames, "source"],
        )
        self.tokens = {source: _per_engine(tokens, engines, source) for source in SOURCES}
        recomputes = self._counter_cls(
            name=RECOMPUTE_METRIC,
            documentation="Decode: finished requests that computed prompt tokens themselves, by reason.",
            labelnames=[*labelnames, "reason"],
        )
        self.recomputes = {reason: _per_engine(recomputes, engines, reason) for reason in RECOMPUTE_REASONS}

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        """Called by vLLM's Prometheus logger with each aggregated interval dict of an engine."""
        data = PDKVConnectorStats(data=dict(transfer_stats_data)).data
        for key, metric in self.counters.items():
            if data[key]:
                metric[engine_idx].inc(data[key])
        for key, metric in self.histograms.items():
            for value in data[key]:
                metric[engine_idx].observe(value)
        for nbytes, seconds in zip(data["transfer_bytes"], data["transfer_seconds"], strict=False):
            if seconds > 0:
                self.throughput[engine_idx].observe(nbytes / seconds)
        for name, metric in self.gauges.items():
            per_rank = data["gauges"].get(name) or {}
            if per_rank:
                metric[engine_idx].set(max(per_rank.values()))
        for reason, n in data["failures"].items():
            if n and reason in self.failures:
                self.failures[reason][engine_idx].inc(n)
        for reason, n in (data.get(BYPASS_KEY) or {}).items():
            if n and reason in self.bypassed:
                self.bypassed[reason][engine_idx].inc(n)
        for source, n in (data.get(TOKENS_KEY) or {}).items():
            if n and source in self.tokens:
                self.tokens[source][engine_idx].inc(n)
        for reason, n in (data.get(RECOMPUTES_KEY) or {}).items():
            if n and reason in self.recomputes:
                self.recomputes[reason][engine_idx].inc(n)
