"""PDKVConnectorStats / PDPromMetrics as vLLM uses them: per-worker objects folded by vLLM's own
KVOutputAggregator, sent as a dict, rebuilt in the frontend, logged and recorded in Prometheus."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from pd_connector.connector import PDConnector
from pd_connector.messages import DoneStatus
from pd_connector.metrics import METRIC_NAMES, PDKVConnectorStats, PDPromMetrics
from pd_connector.transfer.stats import FAILURE_REASONS, TransferStats, reason_of_status


def worker_stats(rank: str, pushes: int, nbytes: int, rooms_held: int) -> PDKVConnectorStats:
    stats = TransferStats(rank)
    for _ in range(pushes):
        stats.observe_push(nbytes, 3, 0.002)
    stats.observe_recv(100, 0.001)
    stats.fail("timeout", "recvs_failed")
    stats.inc("rooms_expired")
    data = stats.take_interval({"rooms_held": rooms_held})
    assert data is not None
    return PDKVConnectorStats(data=data)


def as_sent(stats: PDKVConnectorStats) -> dict[str, Any]:
    """The payload vLLM's scheduler sends the frontend: ``to_dict()`` on vLLM 0.32, the ``data`` field on
    0.23 (whose ``KVConnectorStats`` has no ``to_dict``)."""
    to_dict = getattr(stats, "to_dict", None)
    return to_dict() if to_dict is not None else stats.data


def test_take_interval_resets_and_sends_gauges_only_when_changed() -> None:
    stats = TransferStats("dp0tp0")
    assert stats.take_interval({"rooms_held": 0}) is not None  # the first sample of a gauge goes out
    assert stats.take_interval({"rooms_held": 0}) is None  # nothing new
    stats.observe_push(10, 1, 0.1)
    data = stats.take_interval({"rooms_held": 0})
    assert data is not None and data["bytes_sent"] == 10 and data["gauges"]["rooms_held"] == {}
    assert stats.take_interval({"rooms_held": 2})["gauges"]["rooms_held"] == {"dp0tp0": 2}  # type: ignore[index]
    assert stats.snapshot().bytes_sent == 10  # cumulative view unaffected


def test_counting_is_thread_safe() -> None:
    """Pushes and failures bumped from 4 threads (test_backend covers inc()) all land in one interval."""
    stats = TransferStats()

    def bump(_: int) -> None:
        for _ in range(2000):
            stats.observe_push(1, 1, 0.0)
            stats.fail("peer_lost")

    with ThreadPoolExecutor(4) as pool:
        list(pool.map(bump, range(4)))
    data = stats.take_interval()
    assert data is not None and data["bytes_sent"] == 8000 and len(data["transfer_bytes"]) == 8000
    assert data["failures"]["peer_lost"] == 8000


def test_aggregate_across_workers_with_vllms_aggregator() -> None:
    from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
    from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

    def output(stats: PDKVConnectorStats | None) -> ModelRunnerOutput:
        return ModelRunnerOutput(
            req_ids=[], req_id_to_index={}, kv_connector_output=KVConnectorOutput(kv_connector_stats=stats)
        )

    outs = [output(worker_stats("dp0tp0", 2, 1000, 3)), output(None), output(worker_stats("dp0tp1", 1, 500, 4))]
    merged = KVOutputAggregator(expected_finished_count=3).aggregate(outs)
    assert merged is not None and merged.kv_connector_output is not None
    stats = merged.kv_connector_output.kv_connector_stats
    assert isinstance(stats, PDKVConnectorStats) and not stats.is_empty()
    # The scheduler sends the dict; the frontend rebuilds the object through the connector class.
    rebuilt = PDConnector.build_kv_connector_stats(as_sent(stats))
    assert isinstance(rebuilt, PDKVConnectorStats)
    d = rebuilt.data
    assert d["bytes_sent"] == 2500 and d["transfers_ok"] == 3 and d["bytes_received"] == 200
    assert d["failures"]["timeout"] == 2 and d["rooms_expired"] == 2
    assert d["gauges"]["rooms_held"] == {"dp0tp0": 3, "dp0tp1": 4}
    reduced = rebuilt.reduce()
    assert reduced["pushes"] == 3 and reduced["loads"] == 2 and reduced["failures"] == 2
    assert reduced["rooms held"] == 4  # TP ranks hold the same rooms: the max, not the sum
    assert reduced["push MB/s"] == pytest.approx(2500 / 2**20 / 0.006, rel=0.01)


def test_aggregate_over_time_like_vllms_log_interval() -> None:
    acc = PDKVConnectorStats(data=as_sent(worker_stats("r0", 1, 10, 5)))
    later = PDKVConnectorStats(data=as_sent(worker_stats("r0", 1, 20, 1)))
    acc = acc.aggregate(later)
    assert isinstance(acc, PDKVConnectorStats)
    assert acc.data["bytes_sent"] == 30 and acc.data["gauges"]["rooms_held"] == {"r0": 1}  # latest sample wins
    assert acc.aggregate(PDKVConnectorStats()) is acc and acc.data["bytes_sent"] == 30
    empty = PDConnector.build_kv_connector_stats(None)
    assert isinstance(empty, PDKVConnectorStats) and empty.is_empty()
    acc.reset()
    assert acc.is_empty()


def test_reason_of_every_status() -> None:
    for status in DoneStatus:
        if status is not DoneStatus.OK:
            assert reason_of_status(status) in FAILURE_REASONS
    assert reason_of_status(DoneStatus.TIMEOUT) == "timeout"
    assert reason_of_status(DoneStatus.INCOMPATIBLE) == "mismatch"


def _metric_types(registry: CollectorRegistry) -> dict[type, type]:
    def bound(cls: type) -> type:
        class Bound(cls):  # type: ignore[valid-type,misc]
            def __init__(self, *args: Any, **kwargs: Any) -> None:
                super().__init__(*args, registry=registry, **kwargs)

        return Bound

    return {Counter: bound(Counter), Gauge: bound(Gauge), Histogram: bound(Histogram)}


def test_prom_metrics_record_an_interval() -> None:
    from types import SimpleNamespace

    registry = CollectorRegistry()
    labels = {0: ["tiny", "0"]}
    cfg = SimpleNamespace(kv_transfer_config=None)
    prom = PDConnector.build_prom_metrics(cfg, _metric_types(registry), ["model_name", "engine"], labels)  # type: ignore[arg-type]
    assert isinstance(prom, PDPromMetrics)
    prom.observe(as_sent(worker_stats("dp0tp0", 2, 1000, 3)), 0)
    get = registry.get_sample_value
    eng = {"model_name": "tiny", "engine": "0"}
    assert get(METRIC_NAMES["bytes_sent"] + "_total", eng) == 2000
    assert get(METRIC_NAMES["bytes_received"] + "_total", eng) == 100
    assert get(METRIC_NAMES["transfer_seconds"] + "_count", eng) == 2
    assert get(METRIC_NAMES["throughput"] + "_count", eng) == 2
    assert get(METRIC_NAMES["transfer_entries"] + "_sum", eng) == 6
    assert get(METRIC_NAMES["handshake_seconds"] + "_count", eng) == 1
    assert get(METRIC_NAMES["rooms_held"], eng) == 3
    assert get(METRIC_NAMES["rooms_expired"] + "_total", eng) == 1
    assert get(METRIC_NAMES["failures"] + "_total", {**eng, "reason": "timeout"}) == 1
    assert get(METRIC_NAMES["failures"] + "_total", {**eng, "reason": "mismatch"}) == 0  # present from the start
    assert all(name.startswith("vllm:pd_kv_") for name in METRIC_NAMES.values())


def test_bad_frames_are_counted_apart_from_failures() -> None:
    """A malformed ZMQ frame fails no transfer: its own counter, no failure reason bumped."""
    from types import SimpleNamespace

    stats = TransferStats("dp0tp0")
    stats.inc("bad_frames", 2)
    data = stats.take_interval()
    assert data is not None and data["bad_frames"] == 2 and not any(data["failures"].values())
    assert not PDKVConnectorStats(data=data).is_empty()
    registry = CollectorRegistry()
    cfg = SimpleNamespace(kv_transfer_config=None)
    prom = PDConnector.build_prom_metrics(cfg, _metric_types(registry), ["model_name", "engine"], {0: ["tiny", "0"]})  # type: ignore[arg-type]
    prom.observe(data, 0)
    eng = {"model_name": "tiny", "engine": "0"}
    assert registry.get_sample_value(METRIC_NAMES["bad_frames"] + "_total", eng) == 2
    for reason in FAILURE_REASONS:
        assert registry.get_sample_value(METRIC_NAMES["failures"] + "_total", {**eng, "reason": reason}) == 0
