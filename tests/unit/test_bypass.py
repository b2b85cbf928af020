"""No silent bypass: a P or D instance that serves a request without a KV transfer logs it (request
id and reason) and counts it in ``vllm:pd_requests_without_transfer_total{reason}``.

Driven through vLLM's real v1 Scheduler (tests/support/real_scheduler): the counts travel as the
scheduler side's connector stats, which vLLM >= 0.32 folds into the engine's SchedulerStats.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from vllm.v1.outputs import KVConnectorOutput
from vllm.v1.request import RequestStatus

from pd_connector.bypass import BYPASS_KEY, BypassReason, reason_for
from pd_connector.connector import PDConnector
from pd_connector.kv_params import PrefillParams, parse_kv_params
from pd_connector.metrics import BYPASS_METRIC, PDKVConnectorStats
from tests.support.fake_scheduler import BS, D_PARAMS, P_PARAMS, FakeRequest
from tests.support.real_scheduler import D_PARAMS as REAL_D_PARAMS
from tests.support.real_scheduler import FAILED_BY_ID, make_scheduler, request, step

#: vLLM >= 0.32 adds the scheduler side's connector stats to every step's; 0.23 only to steps whose
#: workers reported stats too (so there the counts wait for the next transfer).
SCHEDULER_STATS = FAILED_BY_ID


@pytest.fixture(scope="module")
def model(tiny_model: Path) -> Path:
    return tiny_model


def _run_to_end(sched: Any, rid: str, kv: KVConnectorOutput | None = None) -> dict[str, int]:
    """Steps until ``rid`` finished; the bypass counts the steps' SchedulerStats carried."""
    seen: dict[str, int] = {}
    for _ in range(20):
        _, _, engine_out = step(sched, kv)
        kv = None
        for outs in engine_out.values():
            stats = getattr(outs, "scheduler_stats", None)
            data = getattr(stats, "kv_connector_stats", None) or {}
            for reason, n in (data.get(BYPASS_KEY) or {}).items():
                seen[reason] = seen.get(reason, 0) + n
        if rid not in sched.requests or sched.requests[rid].is_finished():  # P holds its blocks for D
            if SCHEDULER_STATS:
                return seen
            pending = sched.connector.get_kv_connector_stats()  # 0.23: what waits for the next transfer
            return dict(pending.data[BYPASS_KEY]) if pending is not None else {}
    raise AssertionError(f"{rid} did not finish")


def test_decode_request_without_params_is_logged_and_counted(model: Path, caplog: pytest.LogCaptureFixture) -> None:
    sched = make_scheduler(model, "kv_consumer")
    sched.add_request(request("d-plain", {}))
    with caplog.at_level(logging.INFO, logger="pd_connector.bypass"):
        seen = _run_to_end(sched, "d-plain")
    assert seen == {"no_kv_transfer_params": 1}
    (line,) = [r.getMessage() for r in caplog.records if "without a KV transfer" in r.getMessage()]
    assert "req=d-plain" in line and "no_kv_transfer_params" in line


def test_prefill_asked_to_decode_is_counted_as_wrong_role(model: Path) -> None:
    sched = make_scheduler(model, "kv_producer")
    sched.add_request(request("p-wrong", dict(REAL_D_PARAMS)))
    assert _run_to_end(sched, "p-wrong") == {"wrong_role": 1}


def test_requests_with_a_transfer_are_not_counted(model: Path) -> None:
    d = make_scheduler(model, "kv_consumer")
    d.add_request(request("d-1", dict(REAL_D_PARAMS), max_tokens=1))
    step(d)
    assert _run_to_end(d, "d-1", KVConnectorOutput(finished_recving={"d-1"})) == {}
    p = make_scheduler(model, "kv_producer")
    p.add_request(request("p-1", PrefillParams(5).to_json(), max_tokens=1))
    assert _run_to_end(p, "p-1") == {}
    assert p.requests["p-1"].status == RequestStatus.FINISHED_LENGTH_CAPPED  # held for D, not counted


@pytest.mark.parametrize(
    ("is_prefill", "raw", "want"),
    [
        (False, None, BypassReason.NO_PARAMS),
        (False, {"do_remote_prefill": True}, BypassReason.MALFORMED),
        (False, {"do_remote_decode": False}, BypassReason.NOT_ASKED),
        (False, P_PARAMS, BypassReason.WRONG_ROLE),
        (True, D_PARAMS, BypassReason.WRONG_ROLE),
        (True, P_PARAMS, None),
        (False, D_PARAMS, None),
    ],
)
def test_reason_for(is_prefill: bool, raw: Any, want: BypassReason | None) -> None:
    try:
        params = parse_kv_params(raw, room_optional=True)
    except ValueError:
        params = None
    req = FakeRequest("r", raw, 2 * BS)
    assert reason_for(is_prefill, req.kv_transfer_params, params) is want


def test_bypass_counts_reach_prometheus() -> None:
    registry = CollectorRegistry()

    def bound(cls: type) -> type:
        class Bound(cls):  # type: ignore[valid-type,misc]
            def __init__(self, *args: Any, **kwargs: Any) -> None:
                super().__init__(*args, registry=registry, **kwargs)

        return Bound

    types = {Counter: bound(Counter), Gauge: bound(Gauge), Histogram: bound(Histogram)}
    from types import SimpleNamespace

    prom = PDConnector.build_prom_metrics(
        SimpleNamespace(kv_transfer_config=None),  # type: ignore[arg-type]
        types,
        ["model_name", "engine"],
        {0: ["tiny", "0"]},
    )
    stats = PDKVConnectorStats(data={BYPASS_KEY: {"no_kv_transfer_params": 2}})
    assert not stats.is_empty() and stats.reduce()["served without transfer"] == 2
    stats.aggregate(PDKVConnectorStats(data={BYPASS_KEY: {"wrong_role": 1}}))
    prom.observe(stats.data, 0)
    eng = {"model_name": "tiny", "engine": "0"}
    get = registry.get_sample_value
    assert get(BYPASS_METRIC + "_total", {**eng, "reason": "no_kv_transfer_params"}) == 2
    assert get(BYPASS_METRIC + "_total", {**eng, "reason": "wrong_role"}) == 1
    assert get(BYPASS_METRIC + "_total", {**eng, "reason": "prefix_cached"}) == 0  # present from the start
