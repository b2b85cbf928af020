"""D's per-request KV accounting: the record's invariants, the books' arithmetic (healthy, first-token
continuation, failed and partly failed loads, vLLM's replay, bypasses), its counters through vLLM's stats
path into Prometheus, and its placement in ``usage`` by D's API-server middleware (JSON and SSE, and the
engine client's ``generate`` hook)."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from pd_connector.accounting import (
    RECOMPUTES_KEY,
    TOKENS_KEY,
    KVAccount,
    KVAccounts,
    RecomputeReason,
    merge_accounts,
)
from pd_connector.api_server.usage import AccountedSend, collecting, hook_engine, reset, with_json_usage
from pd_connector.bypass import BypassReason
from pd_connector.connector import PDConnector
from pd_connector.metrics import RECOMPUTE_METRIC, TOKENS_METRIC, PDKVConnectorStats

BS = 16


def _finish(books: KVAccounts, rid: str, prompt: int, params: bool = True) -> KVAccount:
    return books.finish(rid, prompt, params)


# ------------------------------------------------------------------ the record


def test_counts_must_add_up_to_the_prompt() -> None:
    with pytest.raises(ValueError, match="!= prompt_tokens 10"):
        KVAccount(10, 5, 0, 4, RecomputeReason.LOAD_FAILED)


def test_a_recompute_needs_a_reason_and_only_a_recompute_has_one() -> None:
    with pytest.raises(ValueError, match="needs a reason"):
        KVAccount(10, 6, 0, 4, RecomputeReason.NONE)
    with pytest.raises(ValueError, match="'load_failed' with 0 recomputed"):
        KVAccount(10, 10, 0, 0, RecomputeReason.LOAD_FAILED)


def test_every_bypass_reason_is_a_recompute_reason() -> None:
    for reason in BypassReason:
        assert RecomputeReason.of_bypass(reason).value == reason.value


def test_merge_sums_counts_keeps_first_reason_and_longest_transfer() -> None:
    a = KVAccount(10, 10, 0, 0, RecomputeReason.NONE, 100, 2.0).to_json()
    b = KVAccount(10, 0, 0, 10, RecomputeReason.LOAD_FAILED, 0, 7.5).to_json()
    merged = merge_accounts([a, b])
    assert merged == {
        "pushed_tokens": 10,
        "prefix_hit_tokens": 0,
        "recomputed_tokens": 10,
        "kv_bytes": 100,
        "recompute_reason": "load_failed",
        "transfer_ms": 7.5,
    }
    assert merge_accounts([a]) == a and merge_accounts([]) is None


# ------------------------------------------------------------------ the books


def test_healthy_load_after_a_local_hit() -> None:
    books = KVAccounts(BS, [1000], ranks=2)
    books.local_hit("r", 32)
    books.load("r", 68, [[5, 6, 7, 8, 9]])
    books.load("r", 0, [[5, 6, 7, 8, 9, 10]])  # vLLM allocates again once the load is done: ignored
    books.load_finished("r")
    books.scheduled("r", 99)  # the whole prompt in place but the last token, which vLLM reruns
    account = _finish(books, "r", 100)
    assert (account.prefix_hit_tokens, account.pushed_tokens, account.recomputed_tokens) == (32, 68, 0)
    assert account.recompute_reason is RecomputeReason.NONE
    assert account.kv_bytes == 5 * 1000 * 2 and account.transfer_ms is not None


def test_partly_failed_load_keeps_what_vllm_kept() -> None:
    books = KVAccounts(BS, [1000])
    books.local_hit("r", 0)
    books.load("r", 100, [[1, 2, 3, 4, 5, 6, 7]])
    books.blocks_failed({5, 40})  # vLLM 0.23 reports failed blocks; block 5 is this load's
    books.scheduled("r", 32)  # vLLM keeps the valid prefix
    account = _finish(books, "r", 100)
    assert (account.pushed_tokens, account.recomputed_tokens) == (32, 68)
    assert account.recompute_reason is RecomputeReason.LOAD_FAILED
    assert account.kv_bytes == 2 * 1000  # the two blocks kept


def test_failed_load_by_id_then_a_fresh_local_lookup() -> None:
    books = KVAccounts(BS, [1000])
    books.local_hit("r", 0)
    books.load("r", 100, [[1, 2, 3, 4, 5, 6, 7]])
    books.load_failed("r")  # vLLM >= 0.32: by request id; it recomputes from 0 and looks up again
    books.local_hit("r", 16)
    books.scheduled("r", 16)
    account = _finish(books, "r", 100)
    assert (account.prefix_hit_tokens, account.pushed_tokens, account.recomputed_tokens) == (16, 0, 84)
    assert account.recompute_reason is RecomputeReason.LOAD_FAILED and account.kv_bytes == 0


def test_vllm_rerunning_loaded_tokens_without_a_failure_is_a_replay() -> None:
    books = KVAccounts(BS)
    books.load("r", 100, [[1, 2, 3, 4, 5, 6, 7]])
    books.scheduled("r", 64)
    account = _finish(books, "r", 100)
    assert (account.pushed_tokens, account.recomputed_tokens) == (64, 36)
    assert account.recompute_reason is RecomputeReason.REPLAYED


def test_bypassed_request_names_the_bypass() -> None:
    books = KVAccounts(BS)
    books.local_hit("r", 96)
    books.bypassed("r", BypassReason.PREFIX_CACHED)
    books.scheduled("r", 96)
    account = _finish(books, "r", 101)
    assert (account.prefix_hit_tokens, account.recomputed_tokens) == (96, 5)
    assert account.recompute_reason is RecomputeReason.PREFIX_CACHED


def test_unknown_request_is_recomputed_with_a_reason() -> None:
    books = KVAccounts(BS)
    assert _finish(books, "x", 7, params=False).recompute_reason is RecomputeReason.NO_PARAMS
    assert _finish(books, "y", 7, params=True).recompute_reason is RecomputeReason.NOT_LOADED


def test_counters_go_through_vllm_stats_into_prometheus() -> None:
    books = KVAccounts(BS)
    books.load("a", 40, [[1, 2, 3]])
    books.scheduled("a", 39)
    _finish(books, "a", 40)
    _finish(books, "b", 7, params=False)
    data = books.take()
    assert data == {
        TOKENS_KEY: {"pushed": 40, "prefix_hit": 0, "recomputed": 7},
        RECOMPUTES_KEY: {"no_kv_transfer_params": 1},
    }
    assert books.take() is None
    stats = PDKVConnectorStats(data=dict(data))
    assert not stats.is_empty()
    stats.aggregate(PDKVConnectorStats(data={TOKENS_KEY: {"pushed": 2}}))
    assert stats.data[TOKENS_KEY]["pushed"] == 42
    registry = CollectorRegistry()

    def bound(cls: type) -> type:
        class Bound(cls):  # type: ignore[valid-type,misc]
            def __init__(self, *args: Any, **kwargs: Any) -> None:
                super().__init__(*args, registry=registry, **kwargs)

        return Bound

    types = {Counter: bound(Counter), Gauge: bound(Gauge), Histogram: bound(Histogram)}
    prom = PDConnector.build_prom_metrics(
        SimpleNamespace(kv_transfer_config=None),  # type: ignore[arg-type]
        types,
        ["model_name", "engine"],
        {0: ["tiny", "0"]},
    )
    prom.observe(stats.data, 0)
    eng = {"model_name": "tiny", "engine": "0"}
    assert registry.get_sample_value(TOKENS_METRIC + "_total", {**eng, "source": "pushed"}) == 42
    assert registry.get_sample_value(TOKENS_METRIC + "_total", {**eng, "source": "recomputed"}) == 7
    assert registry.get_sample_value(RECOMPUTE_METRIC + "_total", {**eng, "reason": "no_kv_transfer_params"}) == 1
    assert registry.get_sample_value(RECOMPUTE_METRIC + "_total", {**eng, "reason": "load_failed"}) == 0


# ------------------------------------------------------------------ placement in usage

RECORD = KVAccount(20, 16, 0, 4, RecomputeReason.PREFILLED_PART, 512, 3.25).to_json()


def test_json_answer_moves_the_record_into_usage() -> None:
    body = {"id": "x", "usage": {"prompt_tokens": 20}, "kv_transfer_params": {"pd_kv": RECORD}}
    out = json.loads(with_json_usage(json.dumps(body).encode(), []))
    assert out["usage"]["pd_kv"] == RECORD and out["kv_transfer_params"] is None
    kept = {**body, "kv_transfer_params": {"pd_kv": RECORD, "other": 1}}
    assert json.loads(with_json_usage(json.dumps(kept).encode(), []))["kv_transfer_params"] == {"other": 1}
    plain = json.dumps({"id": "x", "usage": {"prompt_tokens": 3}}).encode()
    assert with_json_usage(plain, []) == plain  # nothing to add: untouched


class _Engine:
    """An engine client whose generate yields two outputs, the last one final with an account."""

    async def generate(self, prompt: str) -> Any:
        yield SimpleNamespace(finished=False, kv_transfer_params=None)
        yield SimpleNamespace(finished=True, kv_transfer_params={"pd_kv": RECORD})


async def _serve(engine: _Engine, stream: bool) -> list[dict[str, Any]]:
    """What D's serving code does (generate, then answer), with the middleware's send around it."""
    sent: list[dict[str, Any]] = []

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    records, token = collecting()
    try:
        out = AccountedSend(send, records)
        async for _ in engine.generate("p"):
            pass
        if stream:
            await out(
                {"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]}
            )
            await out(
                {"type": "http.response.body", "body": b'data: {"choices":[{"text":"a"}]}\n\n', "more_body": True}
            )
            usage = b'data: {"id":"x","choices":[],"usage":{"prompt_tokens":20}}\n\n'
            await out({"type": "http.response.body", "body": usage, "more_body": True})
            await out({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False})
        else:
            body = json.dumps({"id": "x", "usage": {"prompt_tokens": 20}, "kv_transfer_params": None}).encode()
            headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
            await out({"type": "http.response.start", "status": 200, "headers": headers})
            await out({"type": "http.response.body", "body": body[:5], "more_body": True})
            await out({"type": "http.response.body", "body": body[5:], "more_body": False})
    finally:
        reset(token)
    return sent


def test_stream_usage_event_gets_the_record_from_the_engine_hook() -> None:
    engine = _Engine()
    assert hook_engine(SimpleNamespace(engine_client=engine)) and hook_engine(SimpleNamespace(engine_client=engine))
    sent = asyncio.run(_serve(engine, stream=True))
    bodies = [m["body"] for m in sent if m["type"] == "http.response.body"]
    assert bodies[0] == b'data: {"choices":[{"text":"a"}]}\n\n' and bodies[2] == b"data: [DONE]\n\n"
    usage = json.loads(bodies[1].split(b"\n\n")[0][6:])
    assert usage["usage"] == {"prompt_tokens": 20, "pd_kv": RECORD}


def test_json_answer_gets_the_record_and_its_length() -> None:
    engine = _Engine()
    hook_engine(SimpleNamespace(engine_client=engine))
    start, body = asyncio.run(_serve(engine, stream=False))
    answer = json.loads(body["body"])
    assert answer["usage"]["pd_kv"] == RECORD and not body["more_body"]
    assert dict(start["headers"])[b"content-length"] == str(len(body["body"])).encode()


def test_without_an_engine_client_nothing_is_hooked() -> None:
    assert not hook_engine(SimpleNamespace())


def test_a_load_an_extension_took_is_counted_as_pushed() -> None:
    """D first / layer mode: an extension takes the load; the core plans none but books it."""
    from vllm.v1.request import RequestStatus

    from pd_connector.config import parse_config
    from pd_connector.scheduler import PDScheduler
    from pd_connector.scheduling.extension import Match, Plan, SchedulerExtension
    from tests.support.fake_scheduler import D_PARAMS, FakeBlocks, FakeRequest

    class Taker(SchedulerExtension):
        def take_load(self, request: Any, params: Any, num_computed_tokens: int, covered: int) -> Match | None:
            return Match(covered - num_computed_tokens, True, Plan.PUSH)

    sched = PDScheduler(parse_config("kv_consumer", {}), BS, extensions=[Taker()], group_block_bytes=[100])
    req = FakeRequest("d-1", dict(D_PARAMS), 40)
    assert sched.get_num_new_matched_tokens(req, 16) == (24, True)  # type: ignore[arg-type]
    sched.update_state_after_alloc(req, FakeBlocks([3, 4, 5]), 24)  # type: ignore[arg-type]
    req.status = RequestStatus.FINISHED_STOPPED
    _, answer = sched.request_finished(req, [3, 4, 5])  # type: ignore[arg-type]
    assert answer is not None
    account = answer["pd_kv"]
    assert (account["prefix_hit_tokens"], account["pushed_tokens"], account["recomputed_tokens"]) == (16, 24, 0)
    assert account["kv_bytes"] == 2 * 100  # blocks 1 and 2 of the request: tokens 16..39
